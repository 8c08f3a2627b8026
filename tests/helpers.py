"""Plain helpers shared by several test modules: constants and functions, each once (fixtures live in
conftest.py). Test modules import them with `from helpers import ...`."""
import json
import math
import os
import signal

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The Boolean family's tiny run: 1 epoch, width 8, 1 layer of 2 heads, one batch per epoch.
BOOLEAN_TINY = ["--epochs", "1", "--dim", "8", "--layers", "1", "--heads", "2", "--batch-size",
                "1024", "--no-progress", "--threads", "1"]


def result_of(folder):
    """The dict a run folder's result.json holds."""
    with open(os.path.join(folder, "result.json"), encoding="utf-8") as f:
        return json.load(f)


def same_weights(a, b):
    """True when state dicts a and b have the same keys and every tensor is equal (torch.equal)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def files_of(folder):
    """{relative path: (bytes, mtime in ns)} of every file below folder."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_mtime_ns)
    return found


def one_line(err):
    """The single line of stderr (fails if there are more, or a traceback)."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def random_bytes(count, seed=0):
    """count bytes drawn uniformly from a generator seeded with seed."""
    return bytes(torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(seed)).tolist())


def random_masks(layers, heads, n, seed=1):
    """(layers, heads, n, n) mask logits of all sizes, so rows mix open and closed entries."""
    return 3 * torch.randn(layers, heads, n, n, generator=torch.Generator().manual_seed(seed))


def split_heads(t, heads):
    """(B, N, H * d) -> (B, H, N, d): the per-head layout MaskedSelfAttention computes in."""
    batch, n, _ = t.shape
    return t.view(batch, n, heads, -1).transpose(1, 2)


def qkv_by_hand(block, x):
    """q, k, v (B, H, N, head_dim) of a MaskedSelfAttention (no qkv bias) on x (B, N, dim), from its
    qkv weight by hand: the rows of W_Q, then W_K, then W_V."""
    q, k, v = (x @ block.qkv.weight.T).split(block.heads * block.head_dim, dim=-1)
    return split_heads(q, block.heads), split_heads(k, block.heads), split_heads(v, block.heads)


def qkv_weights(block):
    """W_Q, W_K, W_V of a MaskedSelfAttention, detached: the consecutive row blocks of its qkv weight."""
    return block.qkv.weight.detach().split(block.heads * block.head_dim)


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


def one_thread_args(args):
    """args with --threads 1: without it train.py picks the free cores, and a run's last digits
    depend on its thread count, so two runs compared bit for bit must share it."""
    return args if "--threads" in args else [*args, "--threads", "1"]


def kill_then_resume(args, tmp_path, monkeypatch):
    """Run train.main(args) to the end in tmp_path/whole; run it again in tmp_path/killed, killed
    right after its first checkpoint.pt is written (KeyboardInterrupt), then --resume it. Returns
    both result.json dicts (whole, resumed) for the caller to compare. (save_checkpoint also
    writes attention_before.pt before training: that one is let through.)"""
    import train
    args = one_thread_args(args)
    assert train.main([*args, "--out", str(tmp_path / "whole")]) == 0
    real_save = train.save_checkpoint

    def save_then_die(path, state):
        real_save(path, state)
        if os.path.basename(path) == "checkpoint.pt":
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.main([*args, "--out", str(tmp_path / "killed")])
    assert not (tmp_path / "killed" / "result.json").exists()
    monkeypatch.setattr(train, "save_checkpoint", real_save)
    assert train.main([*args, "--out", str(tmp_path / "killed"), "--resume"]) == 0
    return result_of(tmp_path / "whole"), result_of(tmp_path / "killed")


def interrupt_then_resume(args, tmp_path, monkeypatch, capsys, step, signum=signal.SIGINT):
    """Run train.main(args) to the end in tmp_path/whole; run it again in tmp_path/stopped with
    signum raised in-process inside the loss function of optimizer step `step` (deterministic:
    the handler runs before raise_signal returns), which must end the run with exit 128 + signum
    and one line on stderr; then --resume it. Returns (whole result.json, resumed result.json,
    that line, (whole, resumed) final weights from checkpoint.pt) for the caller to compare."""
    import train
    args = one_thread_args(args)
    assert train.main([*args, "--out", str(tmp_path / "whole")]) == 0
    real_train = train.train
    monkeypatch.setattr(train, "train", train_raising(real_train, step, signum))
    capsys.readouterr()
    assert train.main([*args, "--out", str(tmp_path / "stopped")]) == 128 + signum
    line = one_line(capsys.readouterr().err)
    assert not (tmp_path / "stopped" / "result.json").exists()
    monkeypatch.setattr(train, "train", real_train)
    assert train.main([*args, "--out", str(tmp_path / "stopped"), "--resume"]) == 0
    weights = [torch.load(tmp_path / run / "checkpoint.pt", weights_only=False)["model"]
               for run in ("whole", "stopped")]
    return result_of(tmp_path / "whole"), result_of(tmp_path / "stopped"), line, weights


def train_raising(real_train, step, *signums):
    """train.train that raises each of signums in-process inside the loss of optimizer step `step`."""
    def train_with_signals(run, exp, *rest):
        real_loss, calls = exp.loss_of, []

        def loss_of(net, batch):
            calls.append(1)
            if len(calls) == step:
                for signum in signums:
                    signal.raise_signal(signum)
            return real_loss(net, batch)
        exp.loss_of = loss_of
        return real_train(run, exp, *rest)
    return train_with_signals
