"""Plain helpers shared by several test modules: constants and functions, each once (fixtures live in
conftest.py). Test modules import them with `from helpers import ...`."""
import math
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The Boolean family's tiny run: 1 epoch, width 8, 1 layer of 2 heads, one batch per epoch.
BOOLEAN_TINY = ["--epochs", "1", "--dim", "8", "--layers", "1", "--heads", "2", "--batch-size",
                "1024", "--no-progress", "--threads", "1"]


def split_heads(t, heads):
    """(B, N, H * d) -> (B, H, N, d): the per-head layout MaskedSelfAttention computes in."""
    batch, n, _ = t.shape
    return t.view(batch, n, heads, -1).transpose(1, 2)


def qkv_by_hand(block, x):
    """q, k, v (B, H, N, head_dim) of a MaskedSelfAttention (no qkv bias) on x (B, N, dim), from its
    qkv weight by hand: the rows of W_Q, then W_K, then W_V."""
    q, k, v = (x @ block.qkv.weight.T).split(block.heads * block.head_dim, dim=-1)
    return split_heads(q, block.heads), split_heads(k, block.heads), split_heads(v, block.heads)


def mimetic_noise(dim, generator):
    """Our transcription of Z in get_ortho_like (osiriszjq/structured_initialization, dist='uniform'):
    (dim, dim), uniform on +-sqrt(3 / dim), drawn from generator."""
    return (torch.rand(dim, dim, generator=generator) * 2 - 1) * math.sqrt(3 / dim)


def runs_of(*flags):
    """The runs train.py plans for a command line (train.plan), configs and folders included."""
    import train
    return train.plan(train.build_parser().parse_args(list(flags)))


def experiment(*flags, data=None, **config):
    """The Experiment train.py builds on the CPU for the command line's first run (its family's
    setup, as train.execute calls it; data: the run's own unless given; config: keys changed)."""
    import train
    run = runs_of(*flags)[0]
    run.config.update(config)
    data = train.load_data(run) if data is None else data
    return train.FAMILIES[run.family]["setup"](run, data, train.Place(torch.device("cpu"), 0, 1))
