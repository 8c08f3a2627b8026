"""Tasks and their metrics: the data side of every experiment in the paper.

  1. Boolean GOTU tasks (Section 5.1, Table 1; Abbe et al. "Generalization on the Unseen"):
     target, seen domain, minimum-degree interpolator (MDI), metrics, Fourier coefficients.

Imports torch only (plus the standard library); never imports train.py.
"""

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# ----------------------------------------------------------------------------------------------
# 1. Boolean GOTU tasks (Section 5.1, anchors.md)
# ----------------------------------------------------------------------------------------------
# Inputs are bits in {-1, +1}^d with d = 15. Training uses every seen point of the cube
# (enumerated, not sampled); testing uses the whole cube, 2^15 = 32768 points, and reports the
# unseen part on its own as well. x has shape (P, d) throughout; every function returns (P,).

BOOLEAN_DIM = 15


@dataclass(frozen=True)
class BooleanTask:
    name: str
    target: Callable          # f(x), the true function
    seen: Callable            # bool mask of the training domain Omega_seen
    mdi: Callable             # minimum-degree interpolator: agrees with f on Omega_seen
    values: Optional[tuple]   # the values f can take, for accuracy; None where the paper has none


def _cyclic3(x):
    """sum_{i=0}^{d-1} x_i x_{i+1} x_{i+2}, indices mod d (wraps around)."""
    return (x * x.roll(-1, dims=1) * x.roll(-2, dims=1)).sum(1)


def _cyclic3_mdi(x):
    """cyclic3 with its first term x0 x1 x2 replaced by the quadratic that equals it on the seen
    domain: x0x1 + x1x2 + x2x0 - x0 - x1 - x2 + 1 (Section 5.1)."""
    x0, x1, x2 = x[:, 0], x[:, 1], x[:, 2]
    quadratic = x0 * x1 + x1 * x2 + x2 * x0 - x0 - x1 - x2 + 1
    return _cyclic3(x) - x0 * x1 * x2 + quadratic


BOOLEAN_TASKS = {
    # f = x0 x1; unseen: x0 = x1 = -1 (1/4 of the cube). MDI x0 + x1 - 1.
    "2parity": BooleanTask(
        "2parity",
        target=lambda x: x[:, 0] * x[:, 1],
        seen=lambda x: (x[:, 0] == 1) | (x[:, 1] == 1),
        mdi=lambda x: x[:, 0] + x[:, 1] - 1,
        values=(-1.0, 1.0)),
    # f = sign(x0 + x1 + x2); unseen: x0 = x1 = -1. MDI (x0 + x1 + 2 x2 - x0 x2 - x1 x2) / 2.
    "majority": BooleanTask(
        "majority",
        target=lambda x: torch.sign(x[:, 0] + x[:, 1] + x[:, 2]),
        seen=lambda x: (x[:, 0] == 1) | (x[:, 1] == 1),
        mdi=lambda x: (x[:, 0] + x[:, 1] + 2 * x[:, 2] - x[:, 0] * x[:, 2] - x[:, 1] * x[:, 2]) / 2,
        values=(-1.0, 1.0)),
    # f = sum_i x_i x_{i+1} x_{i+2}; unseen: x0 = x1 = x2 = -1 (1/8). A sum of 15 signs is odd.
    "cyclic3": BooleanTask(
        "cyclic3",
        target=_cyclic3,
        seen=lambda x: ~((x[:, 0] == -1) & (x[:, 1] == -1) & (x[:, 2] == -1)),
        mdi=_cyclic3_mdi,
        values=tuple(float(v) for v in range(-BOOLEAN_DIM, BOOLEAN_DIM + 1, 2))),
    # f = x0 x1 - 1.25 x1 x2 + 1.5 x2 x0; unseen: x0 x1 x2 = -1 (1/2). MDI x2 - 1.25 x0 + 1.5 x1.
    "threesym": BooleanTask(
        "threesym",
        target=lambda x: x[:, 0] * x[:, 1] - 1.25 * x[:, 1] * x[:, 2] + 1.5 * x[:, 2] * x[:, 0],
        seen=lambda x: x[:, 0] * x[:, 1] * x[:, 2] == 1,
        mdi=lambda x: x[:, 2] - 1.25 * x[:, 0] + 1.5 * x[:, 1],
        values=None),
}


def boolean_cube(d=BOOLEAN_DIM):
    """Every point of {-1, +1}^d, (2^d, d) float; row r holds the bits of r (bit i = column i)."""
    r = torch.arange(2 ** d)[:, None]
    bits = (r >> torch.arange(d)) & 1
    return (2 * bits - 1).float()


def boolean_tokens(x):
    """Bits {-1, +1} -> token ids {0, 1} for the embedding (one token per bit, as in GOTU)."""
    return ((x + 1) / 2).long()


def boolean_dataset(name, d=BOOLEAN_DIM):
    """Train = every seen point; test = the whole cube. Returns a dict of tensors."""
    task = BOOLEAN_TASKS[name]
    cube = boolean_cube(d)
    seen = task.seen(cube)
    return {"x_train": cube[seen], "y_train": task.target(cube[seen]),
            "x_test": cube, "y_test": task.target(cube), "unseen": ~seen}


def round_to_values(pred, values):
    """Each prediction replaced by the nearest of the target's possible values."""
    values = torch.tensor(values, dtype=pred.dtype, device=pred.device)
    return values[(pred[:, None] - values[None]).abs().argmin(1)]


def boolean_accuracy(pred, y, values):
    """Percent of predictions that round to the true value (sign for +-1, nearest odd integer for
    cyclic3). None where the target is continuous (threesym), as in the paper."""
    if values is None or len(pred) == 0:
        return None
    return 100.0 * (round_to_values(pred, values) == y).float().mean().item()


def boolean_metrics(name, pred, x):
    """Table 1's full-cube MSE and accuracy, the same on the unseen part alone, and on the unseen
    part the MSE to the MDI, so a run says which function it extrapolated with."""
    task = BOOLEAN_TASKS[name]
    y, unseen, mdi = task.target(x), ~task.seen(x), task.mdi(x)
    mse = lambda a, b: ((a - b) ** 2).mean().item()
    return {
        "test_loss": mse(pred, y),
        "test_acc": boolean_accuracy(pred, y, task.values),
        "unseen_loss": mse(pred[unseen], y[unseen]),
        "unseen_acc": boolean_accuracy(pred[unseen], y[unseen], task.values),
        "unseen_mse_to_mdi": mse(pred[unseen], mdi[unseen]),
    }


def fourier_coefficients(pred, x, variables=(0, 1, 2)):
    """hat f(S) = mean over the cube of f(x) prod_{i in S} x_i for every monomial S over the given
    variables (exact when x is the whole cube). Keys like "1", "x0", "x0x2"."""
    coeffs = {}
    for size in range(len(variables) + 1):
        for subset in itertools.combinations(variables, size):
            chi = x[:, list(subset)].prod(1) if subset else torch.ones(len(x))
            coeffs["".join(f"x{i}" for i in subset) or "1"] = (pred * chi).mean().item()
    return coeffs
