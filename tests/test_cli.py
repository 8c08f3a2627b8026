"""train.py end to end: result files, the grid table, bad input, a NaN loss, reproducibility."""
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from conftest import ROOT

TINY = ["--epochs", "1", "--dim", "8", "--layers", "1", "--heads", "2", "--batch-size", "1024",
        "--no-progress"]


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_short_run_writes_a_valid_result(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("--task", "majority", "--init", "mask", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    assert "majority / mask / seed 0: test loss" in proc.stdout
    result = json.loads((out / "result.json").read_text())
    assert {"task", "init", "seed", "config", "seconds", "final", "history"} <= set(result)
    assert (result["task"], result["init"], result["seed"], result["status"]) == ("majority", "mask", 0, "done")
    final = result["final"]
    for key in ("test_loss", "test_acc", "unseen_loss", "unseen_acc", "unseen_mse_to_mdi"):
        assert isinstance(final[key], float)
    assert 0 <= final["test_acc"] <= 100 and final["test_loss"] >= 0
    assert set(final["fourier"]) == {"1", "x0", "x1", "x2", "x0x1", "x0x2", "x1x2", "x0x1x2"}
    assert len(result["history"]) == 1 and result["config"]["dim"] == 8
    for picture in ("mask_before.png", "mask_after.png"):
        data = (out / picture).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir(out) if ".tmp" in p]  # atomic writes leave no temp files


def test_threesym_reports_no_accuracy_and_default_has_no_mask_pictures(tmp_path):
    proc = run_cli("--task", "threesym", "--init", "default", "--out", str(tmp_path), *TINY)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final"]["test_acc"] is None and result["final"]["unseen_acc"] is None
    assert not (tmp_path / "mask_before.png").exists()


def test_grid_prints_a_markdown_table_with_mean_and_std(tmp_path):
    proc = run_cli("--task", "2parity", "--init", "default", "mask-zero", "--seeds", "0", "1",
                   "--out", str(tmp_path), *TINY)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("## Results\n\n| task | init | seeds | train loss | test loss")
    results = table.split("## Persistence of the prior")[0]
    rows = [line for line in results.splitlines() if line.startswith("| 2parity")]
    assert len(rows) == 2 and all("| 2/2 |" in row and "±" in row for row in rows)
    assert "| 1.379 | 75 |" in rows[0]  # the paper's numbers beside ours
    assert table.strip() in proc.stdout
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert sorted((r["init"], r["seed"]) for r in grid) == [
        ("default", 0), ("default", 1), ("mask-zero", 0), ("mask-zero", 1)]
    assert (tmp_path / "2parity-mask-zero-seed1" / "result.json").exists()


def test_every_init_runs_and_reports_persistence_and_summarize_merges_grids(tmp_path):
    qk_inits = ["structured-svd", "structured-opt", "mimetic"]
    mask_inits = ["mask", "mask-zero", "mask-fixed", "mask-hadamard"]
    for inits, folder in ((["default"] + qk_inits, "qk"), (mask_inits, "masks")):
        proc = run_cli("--task", "majority", "--init", *inits, "--out", str(tmp_path / folder), *TINY)
        assert proc.returncode == 0, proc.stderr
    finals = {}
    for folder in ("qk", "masks"):
        for run in json.loads((tmp_path / folder / "grid.json").read_text()):
            finals[run["init"]] = run["final"]
    assert set(finals) == {"default", *qk_inits, *mask_inits}
    for init, final in finals.items():
        assert 0 <= final["prior_mass_init"] <= 1 and 0 <= final["prior_mass_final"] <= 1
        assert len(final["prior_mass_init_per_head"]) == 1          # layers
        assert len(final["pattern_corr_final_per_head"][0]) == 2    # heads
        assert (final["mask_drift"] is None) == (init in ["default"] + qk_inits)
    assert finals["mask-fixed"]["mask_drift"] == 0
    assert finals["mask"]["mask_drift"] > 0
    # the prior is in place at initialisation, well above the default model's
    assert finals["structured-svd"]["prior_mass_init"] > 2 * finals["default"]["prior_mass_init"]
    assert finals["mask"]["prior_mass_init"] > 0.99

    proc = run_cli("--summarize", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "table.md").read_text()
    rows = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| majority")]
    assert rows == ["default", "mask", "mask-zero", "mask-fixed", "mask-hadamard",   # results,
                    "structured-svd", "structured-opt", "mimetic"] * 2              # persistence
    assert "## Persistence of the prior" in table


@pytest.mark.parametrize("args, message", [
    (["--summarize", "/nonexistent/folder"], "no result.json below /nonexistent/folder"),
    (["--task", "parity5"], "invalid choice: 'parity5'"),
    (["--init", "kaiming"], "invalid choice: 'kaiming'"),
    (["--epochs", "-3"], "--epochs: must be a finite number > 0"),
    (["--lr", "nan"], "--lr: must be a finite number > 0"),
    (["--lr", "inf"], "--lr: must be a finite number > 0"),
    (["--seed", "-1"], "--seed: must be >= 0"),
    (["--batch-size", "many"], "--batch-size: expected a int"),
    (["--device", "cuda:99"], "--device cuda:99"),
    (["--device", "banana"], "--device"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_input_exits_2_with_one_clear_line(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:")
    assert message in lines[0]


def test_nan_loss_stops_the_run_with_a_message_and_keeps_the_result(tmp_path, monkeypatch, capsys):
    real_loss = train.mse_loss
    calls = []

    def loss_that_turns_nan(pred, target):
        calls.append(1)
        loss = real_loss(pred, target)
        return loss * float("nan") if len(calls) > 3 else loss

    monkeypatch.setattr(train, "mse_loss", loss_that_turns_nan)
    code = train.main(["--task", "2parity", "--init", "mask", "--out", str(tmp_path), *TINY])
    assert code == 1
    err = capsys.readouterr().err
    assert "loss became nan at epoch 1, step 4" in err and str(tmp_path) in err
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "diverged" and "nan" in result["error"]
    assert (tmp_path / "mask_before.png").exists()


def test_same_seed_same_result_other_seed_other_result(tmp_path):
    finals = []
    for seed, name in ((0, "a"), (0, "b"), (1, "c")):
        assert train.main(["--task", "majority", "--init", "mask", "--seed", str(seed),
                           "--out", str(tmp_path / name), *TINY]) == 0
        finals.append(json.loads((tmp_path / name / "result.json").read_text())["final"])
    assert finals[0] == finals[1]
    assert finals[0]["test_loss"] != finals[2]["test_loss"]


def test_png_encoder_round_trips_pixels():
    import struct
    import zlib
    image = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8)
    data = train.png_bytes(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        length, = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        pos += 12 + length
    assert struct.unpack(">II", chunks[b"IHDR"][:8]) == (7, 5)
    rows = torch.tensor(list(zlib.decompress(chunks[b"IDAT"])), dtype=torch.uint8).view(5, 1 + 21)
    assert (rows[:, 0] == 0).all()
    assert torch.equal(rows[:, 1:].view(5, 7, 3).permute(2, 0, 1), image)
