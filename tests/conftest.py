"""Shared test set-up: import the three top-level modules from the repository root; the
helpers several test modules use, as fixtures (test modules never import each other)."""
import base64
import json
import math
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The suite runs on a 2-core CI machine; torch's default thread count is already the core count,
# and subprocess tests run one at a time, so nothing oversubscribes the cores.
torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for in-process runs: the CI machine's 2 cores may be shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def one_thread_args(args):
    """args with --threads 1: without it train.py picks the free cores, and a run's last digits
    depend on its thread count, so two runs compared bit for bit must share it."""
    return args if "--threads" in args else [*args, "--threads", "1"]


def kill_then_resume(args, tmp_path, monkeypatch):
    """Run train.main(args) to the end in tmp_path/whole; run it again in tmp_path/killed, killed
    right after its first checkpoint.pt is written (KeyboardInterrupt), then --resume it. Returns
    both result.json dicts (whole, resumed) for the caller to compare. (save_checkpoint also
    writes attention_before.pt before training: that one is let through.)"""
    import train  # the repository root is on sys.path only from this file's top on
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
    return (json.loads((tmp_path / "whole" / "result.json").read_text()),
            json.loads((tmp_path / "killed" / "result.json").read_text()))


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
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "stopped" / "result.json").exists()
    monkeypatch.setattr(train, "train", real_train)
    assert train.main([*args, "--out", str(tmp_path / "stopped"), "--resume"]) == 0
    weights = [torch.load(tmp_path / run / "checkpoint.pt", weights_only=False)["model"]
               for run in ("whole", "stopped")]
    return (json.loads((tmp_path / "whole" / "result.json").read_text()),
            json.loads((tmp_path / "stopped" / "result.json").read_text()), err.strip(), weights)


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


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The Boolean family's tiny run: 1 epoch, width 8, 1 layer of 2 heads, one batch per epoch.
BOOLEAN_TINY = ["--epochs", "1", "--dim", "8", "--layers", "1", "--heads", "2", "--batch-size",
                "1024", "--no-progress", "--threads", "1"]


@pytest.fixture
def run_cli():
    """run_cli(*args, timeout=300): `python train.py *args` in a subprocess from the repository
    root; the subprocess.CompletedProcess, output as text. TIKTOKEN_CACHE_DIR is left out of its
    environment, so no run reads a tokenizer cache (language tests pass --bpe-file)."""
    def run(*args, timeout=300):
        env = {key: value for key, value in os.environ.items() if key != "TIKTOKEN_CACHE_DIR"}
        return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    return run


@pytest.fixture
def mass_on_pseudo_input():
    """mass(model, pattern): attention of every layer and head computed on the pseudo-input P
    (no token content), mass on the pattern's open entries averaged over query rows, (L, H)."""
    import maskprior

    def mass(model, pattern):
        p = maskprior.pseudo_input(model)
        masses = []
        for layer, attn in enumerate(maskprior.attention_modules(model)):
            inner = attn.heads * attn.head_dim
            w = attn.qkv.weight.detach()
            q = (p @ w[:inner].T).view(len(p), attn.heads, attn.head_dim).transpose(0, 1)
            k = (p @ w[inner:2 * inner].T).view(len(p), attn.heads, attn.head_dim).transpose(0, 1)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim), -1)
            masses.append((a * maskprior.pattern_targets(pattern[layer])).sum(-1).mean(-1))
        return torch.stack(masses)
    return mass


@pytest.fixture
def attention_svg():
    """read(folder): a run folder's attention.svg, after checking that the folder holds no PNG
    file, as (its text lines, its block titles, {title: the block's panels decoded, (3, H, W)
    uint8}). The titles are the texts in 13 px; the panels are the embedded PNG of each block."""
    import warnings
    from torchvision.io import decode_png

    def read(folder):
        assert not [name for name in os.listdir(folder) if name.endswith(".png")]
        root = ET.parse(os.path.join(folder, "attention.svg")).getroot()
        texts = [t for t in root.iter("{http://www.w3.org/2000/svg}text")]
        titles = [t.text for t in texts if t.get("font-size") == "13"]
        images = [i.get("href") for i in root.iter("{http://www.w3.org/2000/svg}image")]
        assert len(images) == len(titles)
        with warnings.catch_warnings():   # torchvision marks its image codecs as deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            panels = [decode_png(torch.frombuffer(bytearray(base64.b64decode(
                href.split(",", 1)[1])), dtype=torch.uint8)) for href in images]
        return [t.text for t in texts], titles, dict(zip(titles, panels))
    return read
