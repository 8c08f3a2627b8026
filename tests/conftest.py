"""Shared test set-up: import the three top-level modules from the repository root."""
import json
import os
import sys

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


def kill_then_resume(args, tmp_path, monkeypatch):
    """Run train.main(args) to the end in tmp_path/whole; run it again in tmp_path/killed, killed
    right after its first checkpoint.pt is written (KeyboardInterrupt), then --resume it. Returns
    both result.json dicts (whole, resumed) for the caller to compare. (save_checkpoint also
    writes attention_before.pt before training: that one is let through.)"""
    import train  # the repository root is on sys.path only from this file's top on
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
