"""train.py end to end: result files, the grid table, bad input, a NaN loss, reproducibility."""
import json
import os
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

import maskprior
import tasks
import train
from helpers import BOOLEAN_TINY as TINY, experiment, kill_then_resume, result_of, runs_of


def test_short_run_writes_a_valid_result(tmp_path, run_cli, attention_svg):
    out = tmp_path / "run"
    proc = run_cli("--task", "majority", "--init", "mask", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    assert "majority/mask/seed0: train loss" in proc.stdout and ", on target no, " in proc.stdout
    result = result_of(out)
    assert {"task", "init", "seed", "config", "seconds", "final", "history"} <= set(result)
    assert (result["task"], result["init"], result["seed"], result["status"]) == ("majority", "mask", 0, "done")
    final = result["final"]
    for key in ("test_loss", "test_acc", "unseen_loss", "unseen_acc", "unseen_mse_to_mdi"):
        assert isinstance(final[key], float)
    assert 0 <= final["test_acc"] <= 100 and final["test_loss"] >= 0
    assert set(final["fourier"]) == {"1", "x0", "x1", "x2", "x0x1", "x0x2", "x1x2", "x0x1x2"}
    assert len(result["history"]) == 1 and result["config"]["dim"] == 8
    # attention.svg: before | after, each the mean attention and beside it the mask bias, named
    # layers and heads, each block with its colour bar saying what the colours mean
    texts, titles, panels = attention_svg(out)
    assert titles == ["mean attention, before training", "mask bias log σ(s M), before training",
                      "mean attention, after training", "mask bias log σ(s M), after training"]
    assert {"layer 1", "head 1", "head 2", "mean attention weight", "bias added to the logits"} <= set(texts)
    assert "layer 2" not in texts and "head 3" not in texts
    # the bias before training: 1 layer x 2 heads of 16 x 16 entries, 8 x 8 pixels each, 4-pixel
    # gutters; log sigmoid(10 M) from -10 (purple) to 0 (yellow): the open diagonal yellow
    image = panels["mask bias log σ(s M), before training"]
    assert image.shape == (3, 4 + 128 + 4, 2 * (128 + 4) + 4)
    pixel = lambda head, i, j: image[:, 4 + 8 * i + 3, 4 + 132 * head + 8 * j + 3].tolist()
    assert pixel(1, 5, 5) == [253, 231, 37] and pixel(1, 5, 9) == [68, 1, 84]
    assert pixel(0, 0, 1) == [253, 231, 37]                     # majority: CLS reads x0, x1, x2
    assert not [p for p in os.listdir(out) if ".tmp" in p]  # atomic writes leave no temp files


def test_threesym_reports_its_sign_accuracy_and_default_has_no_mask_pictures(tmp_path, run_cli,
                                                                              attention_svg):
    proc = run_cli("--task", "threesym", "--init", "default", "--out", str(tmp_path), *TINY)
    assert proc.returncode == 0, proc.stderr
    result = result_of(tmp_path)
    final = result["final"]                    # the accuracy is ours (the paper reports none for threesym)
    assert 0 <= final["unseen_acc"] <= 100 and 0 <= final["test_acc"] <= 100
    assert isinstance(final["test_acc"], float) and "test_acc" in result["history"][-1]
    _, titles, _ = attention_svg(tmp_path)
    assert titles == ["mean attention, before training", "mean attention, after training"]


def test_grid_prints_a_markdown_table_with_mean_and_std(tmp_path, run_cli):
    proc = run_cli("--task", "2parity", "--init", "default", "mask-zero", "--seeds", "0", "1",
                   "--out", str(tmp_path), *TINY)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("## Boolean tasks (Section 5.1, Table 1)\n\n"
                            "| task | init | seeds | train loss | test loss")
    results = table.split("## Persistence of the prior")[0]
    rows = [line for line in results.splitlines() if line.startswith("| 2parity")]
    assert len(rows) == 2 and all("| 2/2 |" in row and "±" in row for row in rows)
    # the paper's numbers beside ours, with what the tiny run changed of the preset they describe
    assert "| 1.379 / 75 (this run: " in rows[0] and "epochs 1, not the preset's 10" in rows[0], rows[0]
    assert table.strip() in proc.stdout
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert sorted((r["init"], r["seed"]) for r in grid) == [
        ("default", 0), ("default", 1), ("mask-zero", 0), ("mask-zero", 1)]
    assert (tmp_path / "2parity-mask-zero-seed1" / "result.json").exists()


def test_every_init_runs_and_reports_persistence_and_summarize_merges_grids(tmp_path, run_cli):
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
    (["--summarize", "/nonexistent/folder"], "--summarize /nonexistent/folder: no such folder"),
    (["--task", "parity5"], "invalid choice: 'parity5'"),
    (["--init", "kaiming"], "invalid choice: 'kaiming'"),
    (["--epochs", "-3"], "--epochs: must be a number > 0, got '-3'"),
    (["--lr", "nan"], "--lr: must be a number > 0, got 'nan'"),
    (["--lr", "inf"], "--lr: must be a number > 0, got 'inf'"),
    (["--seed", "-1"], "--seed: must be a number >= 0, got '-1'"),
    (["--weight-decay", "-0.1"], "--weight-decay: must be a number >= 0, got '-0.1'"),
    (["--batch-size", "many"], "--batch-size: expected a int"),
    (["--device", "cuda:99"], "--device cuda:99"),
    (["--device", "banana"], "--device"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_input_exits_2_with_one_clear_line(args, message, capsys):
    assert train.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:")
    assert message in lines[0]


def test_bad_input_through_the_script_is_exit_2_and_one_line_without_traceback(run_cli):
    proc = run_cli("--task", "parity5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: argument --task: invalid "
                                                   "choice: 'parity5'") and "majority" in lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--seed", "1", "--seeds", "2", "3"], "argument --seeds: not allowed with argument --seed"),
    (["--summarize", "{out}", "--task", "addition"], "--summarize takes no other flag (--task given)"),
    (["--summarize", "{out}", "--preset", "paper"], "--summarize takes no other flag (--preset given)"),
])
def test_a_flag_the_command_would_drop_is_refused_not_ignored(flags, message, tmp_path, capsys):
    out = str(tmp_path)          # a regression trains or summarizes here, never under the repository
    flags = [flag.replace("{out}", out) for flag in flags]
    assert train.main(flags + ([] if "--summarize" in flags else ["--out", out, *TINY])) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and message in lines[0], lines
    assert os.listdir(out) == []


def test_summarizing_a_single_runs_folder_leaves_it_that_runs_to_resume(tmp_path, capsys):
    out = str(tmp_path / "majority-mask-seed0")
    command = ["--task", "majority", "--init", "mask", "--out", out, *TINY]
    assert train.main(command) == 0
    assert train.main(["--summarize", out]) == 0
    assert {"table.md", "curves.svg", "result.json"} <= set(os.listdir(out))
    capsys.readouterr()
    # the run's own command: the folder holds that run (not "a grid"), and --resume keeps the finished run
    assert train.main(command) == 2
    error = capsys.readouterr().err
    assert f"--out {out} already holds a run" in error and "holds a grid" not in error, error
    before = result_of(out)
    assert train.main(command + ["--resume"]) == 0
    assert result_of(out)["final"] == before["final"]


def test_synthetic_help_writes_nothing_and_sklearn_digits_without_sklearn_is_one_line(tmp_path, monkeypatch,
                                                                                    capsys):
    import synthetic
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        synthetic.main(["--help"])
    assert done.value.code == 0 and "--sklearn-digits" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []                  # no folder named "--help"
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(SystemExit) as done:
        synthetic.main(["--sklearn-digits", "digits"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and lines == [
        "synthetic.py: error: --sklearn-digits needs scikit-learn: pip install scikit-learn"]
    assert os.listdir(tmp_path) == []


def test_nan_loss_stops_the_run_with_a_message_and_keeps_the_result(tmp_path, monkeypatch, capsys,
                                                                    attention_svg):
    real_setup = train.FAMILIES["boolean"]["setup"]
    calls = []

    def setup_whose_loss_turns_nan(*args, **kwargs):
        exp = real_setup(*args, **kwargs)
        real_loss = exp.loss_of

        def loss_that_turns_nan(net, batch):
            calls.append(1)
            loss = real_loss(net, batch)
            return loss * float("nan") if len(calls) > 3 else loss
        exp.loss_of = loss_that_turns_nan
        return exp

    monkeypatch.setitem(train.FAMILIES["boolean"], "setup", setup_whose_loss_turns_nan)
    code = train.main(["--task", "2parity", "--init", "mask", "--out", str(tmp_path), *TINY])
    assert code == 1
    err = capsys.readouterr().err
    assert "loss became nan at step 4 (epoch 1)" in err and str(tmp_path) in err
    result = result_of(tmp_path)
    assert result["status"] == "diverged" and "nan" in result["error"]
    _, titles, _ = attention_svg(tmp_path)                         # the prior before training
    assert titles == ["mean attention, before training", "mask bias log σ(s M), before training"]


def test_same_seed_same_result_other_seed_other_result(tmp_path):
    finals = []
    for seed, name in ((0, "a"), (0, "b"), (1, "c")):
        assert train.main(["--task", "majority", "--init", "mask", "--seed", str(seed),
                           "--out", str(tmp_path / name), *TINY]) == 0
        finals.append(result_of(tmp_path / name)["final"])
    assert finals[0] == finals[1]
    assert finals[0]["test_loss"] != finals[2]["test_loss"]


@pytest.mark.parametrize("preset, flag, weights_decay", [("paper", [], 1e-3), ("cpu", [], 0.0),
                                                       ("paper", ["--weight-decay", "0"], 0.0),
                                                       ("cpu", ["--weight-decay", "0.01"], 0.01)])
def test_weight_decay_replaces_the_presets_on_the_weights_and_leaves_m_to_mask_decay(preset, flag,
                                                                                    weights_decay):
    exp = experiment("--task", "2parity", "--preset", preset, "--mask-decay", "0.5", *flag)
    masks = {id(p) for name, p in exp.model.named_parameters() if name.endswith("mask")}
    decays = {id(p): group["weight_decay"] for group in exp.optimizer.param_groups for p in group["params"]}
    assert masks and len(decays) == sum(p.requires_grad for p in exp.model.parameters())
    assert all(decay == (0.5 if key in masks else weights_decay) for key, decay in decays.items())


@pytest.mark.parametrize("init", ["default", "mask", "structured-svd"])
def test_the_paper_presets_boolean_model_starts_positions_and_cls_as_the_gotu_code(init):
    """--preset paper builds aryol/GOTU's model: positions and CLS drawn from N(0, 1); the QK
    inits solve on them without rescaling them (norm_p = 18 is for positions drawn at 0.02)."""
    model = experiment("--task", "2parity", "--init", init, "--preset", "paper").model
    assert model.pos.shape == (1, 16, 256) and model.cls.shape == (1, 1, 256)
    assert 0.95 < model.pos.std().item() < 1.05 and 0.85 < model.cls.std().item() < 1.15
    assert abs(model.pos.mean().item()) < 0.05


def test_a_paper_preset_boolean_model_draws_its_starts_in_the_gotu_models_order():
    """aryol/GOTU's TokenTransformer draws the bit embedding N(0, 1), then the positions and then
    CLS with torch.randn; a run seeded s (train.execute seeds torch first) draws the same numbers."""
    torch.manual_seed(3)
    model = experiment("--task", "majority", "--preset", "paper", "--seed", "3").model
    torch.manual_seed(3)
    embedding, positions, cls = torch.randn(2, 256), torch.randn(1, 16, 256), torch.randn(1, 1, 256)
    assert torch.equal(model.embed.weight, embedding)
    assert torch.equal(model.pos, positions) and torch.equal(model.cls, cls)


@pytest.mark.parametrize("flags, config_keys, shape", [
    (["--dim", "48", "--head-dim", "8"], {"dim": 48, "head_dim": 8, "mlp_dim": 48}, (48, 8, 48)),
    (["--mlp-dim", "32"], {"dim": 64, "head_dim": None, "mlp_dim": 32}, (64, 21, 32)),
    (["--preset", "paper", "--dim", "64", "--mlp-dim", "64"], {"dim": 64, "head_dim": None, "mlp_dim": 64},
     (64, 21, 64)),
    (["--preset", "paper", "--head-dim", "16"], {"dim": 256, "head_dim": 16, "mlp_dim": 256}, (256, 16, 256)),
], ids=["dim-head", "mlp", "paper-narrow", "paper-heads"])
def test_width_flags_reach_the_model_and_its_config(flags, config_keys, shape):
    """--dim, --head-dim, --mlp-dim (the study of what decides target or MDI changes each alone):
    the config records them, the attention has 3 heads of head_dim, the MLP mlp_dim units."""
    config = runs_of("--task", "2parity", *flags)[0].config
    assert {key: config[key] for key in config_keys} == config_keys
    model = experiment("--task", "2parity", *flags).model
    dim, head_dim, mlp_dim = shape
    for block in model.blocks:
        assert block.attn.head_dim == head_dim and block.attn.qkv.weight.shape == (3 * 3 * head_dim, dim)
        assert block.mlp.fc.weight.shape == (mlp_dim, dim)


@pytest.mark.parametrize("preset, pos_std, cls_std", [("cpu", 1.0, 1.0), ("paper", 0.02, 0.0), ("paper", 0.5, 0.25)])
def test_pos_std_and_cls_std_set_the_starts_and_the_config(preset, pos_std, cls_std):
    """--pos-std and --cls-std replace a preset's starts (cpu: N(0, 0.02^2) and 0; paper: N(0, 1)):
    the config says so and the drawn positions and CLS have that spread (CLS 0: zeros)."""
    flags = ["--task", "majority", "--preset", preset, "--pos-std", str(pos_std), "--cls-std", str(cls_std)]
    config = runs_of(*flags)[0].config
    assert (config["pos_std"], config["cls_std"]) == (pos_std, cls_std)
    torch.manual_seed(0)
    model = experiment(*flags).model
    assert model.pos.std().item() == pytest.approx(pos_std, rel=0.1)
    if cls_std == 0:
        assert torch.equal(model.cls, torch.zeros_like(model.cls))
    else:   # one token of `dim` draws: the spread within 25 %
        assert model.cls.std().item() == pytest.approx(cls_std, rel=0.25)


def test_the_study_flags_are_refused_where_they_do_not_apply(capsys):
    assert train.main(["--task", "lm", "--cls-std", "1"]) == 2
    assert "--cls-std applies to boolean tasks only" in capsys.readouterr().err
    assert train.main(["--task", "cifar10", "--head-dim", "8"]) == 2
    assert "--head-dim applies to boolean and arithmetic tasks only" in capsys.readouterr().err


def test_a_cpu_run_trains_with_subnormal_floats_flushed_and_puts_the_flag_back(tmp_path, monkeypatch):
    """Attention's backward through pairs the mask shuts yields subnormal floats, which slow CPU
    kernels many times; a run flushes them to zero (torch.set_flush_denormal) while it trains."""
    subnormal = torch.finfo(torch.float32).tiny / 8               # below the smallest normal float
    doubled_during_run, real_run = [], train.execute
    def run_and_probe(*args):
        doubled_during_run.append((torch.tensor([subnormal]) * 2).item())
        return real_run(*args)
    monkeypatch.setattr(train, "execute", run_and_probe)
    assert (torch.tensor([subnormal]) * 2).item() > 0
    assert train.main(["--task", "2parity", "--init", "mask", "--device", "cpu",
                       "--out", str(tmp_path), *TINY]) == 0
    assert doubled_during_run == [0.0]
    assert (torch.tensor([subnormal]) * 2).item() > 0              # as it was before the run


VIRIDIS = torch.tensor([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
                       dtype=torch.float32) / 255         # viridis at 0, 1/4, 1/2, 3/4 and 1


def heatmap_image(grid, lo, hi):
    """The PNG of the one block of tasks.heatmap_svg for grid (rows, cols, n, n), decoded: (3, H, W)."""
    import base64
    import warnings
    from torchvision.io import decode_png
    svg = ET.fromstring(tasks.heatmap_svg([[("a block", grid, lo, hi, "what the colours mean")]], []))
    [href] = [i.get("href") for i in svg.iter("{http://www.w3.org/2000/svg}image")]
    data = base64.b64decode(href.split(",", 1)[1])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_png(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def test_viridis_hits_its_anchors_and_interpolates():
    """One panel of 8 entries: lo, the anchors, a value halfway between the first two, and two values
    outside [lo, hi] (clamped); each entry a block of 128 // 8 = 16 pixels."""
    values = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 0.125, -3.0, 7.0])
    grid = torch.zeros(1, 1, 8, 8)
    grid[0, 0, 0] = values                                              # the first row
    image = heatmap_image(grid, 0.0, 1.0)
    colours = [image[:, 4 + 8, 4 + 16 * j + 8].tolist() for j in range(8)]
    expected = torch.cat([VIRIDIS, (VIRIDIS[:1] + VIRIDIS[1:2]) / 2, VIRIDIS[[0, 4]]])
    assert colours == (expected * 255).round().to(torch.uint8).tolist()


def test_heatmap_png_holds_each_entry_as_a_block_of_its_colour_and_white_gutters():
    """The panels of every heat-map SVG: a (rows, cols, n, n) grid, each entry a cell x cell block (cell =
    128 // n) coloured by viridis at (v - lo) / (hi - lo), linear between its anchors, panels 4 white
    pixels apart (make_grid's padding)."""
    rows, cols, n, lo, hi = 2, 3, 4, -2.0, 6.0
    grid = torch.rand(rows, cols, n, n, generator=torch.Generator().manual_seed(0)) * (hi - lo) + lo
    grid[0, 0, 0, 0], grid[1, 2, 3, 3] = lo, hi                     # the two ends of the scale
    image = heatmap_image(grid, lo, hi)
    cell, pad = 128 // n, 4
    assert image.shape == (3, rows * (n * cell + pad) + pad, cols * (n * cell + pad) + pad)
    place = (grid - lo) / (hi - lo) * 4                                # where each value lies among the anchors
    below = place.floor().long().clamp(max=3)
    mix = (place - below)[..., None]
    # the colour each entry should have, (R, C, n, n, 3)
    expected = ((VIRIDIS[below] * (1 - mix) + VIRIDIS[below + 1] * mix) * 255).round().to(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            top, left = pad + r * (n * cell + pad), pad + c * (n * cell + pad)
            panel = image[:, top:top + n * cell, left:left + n * cell]
            blocks = panel.unflatten(1, (n, cell)).unflatten(3, (n, cell))    # (3, n, cell, n, cell)
            want = expected[r, c].permute(2, 0, 1)[:, :, None, :, None].expand_as(blocks)
            assert torch.equal(blocks, want), (r, c)
    assert (image[:, :pad, :] == 255).all() and (image[:, :, :pad] == 255).all()
    assert (image[:, :, pad + n * cell:2 * pad + n * cell] == 255).all()    # between columns
    assert image[:, pad, pad].tolist() == [68, 1, 84]                       # lo: viridis purple
    last = image[:, -pad - 1, -pad - 1].tolist()
    assert last == [253, 231, 37]                                           # hi: viridis yellow


def test_mask_magnitude_sets_the_prior_and_a_sweep_writes_its_table_and_figure(tmp_path):
    """--mask-magnitude 2 5: one run per A in <task>-<init>-seed<seed>-A<A>; config records A; the
    mask starts at +-A, so attention_before.pt's bias is log sigmoid(+-A) on the pattern's open /
    closed entries; table.md gets an "A" column and mask_magnitude.svg one line per panel."""
    assert train.main(["--task", "majority", "--init", "mask", "--mask-magnitude", "2", "5",
                       "--out", str(tmp_path), *TINY]) == 0
    pattern = maskprior.boolean_mask("majority", 1, 2)                            # (1, 2, 16, 16), +-10
    for magnitude in (2, 5):
        folder = tmp_path / f"majority-mask-seed0-A{magnitude}"
        assert result_of(folder)["config"]["mask_magnitude"] == magnitude
        before = torch.load(folder / "attention_before.pt", weights_only=False)
        assert set(before) == {"attn", "bias"} and before["attn"].shape == (1, 2, 16, 16)
        expected = torch.nn.functional.logsigmoid(magnitude * pattern.sign())
        torch.testing.assert_close(before["bias"], expected)
        after = torch.load(folder / "attention_after.pt", weights_only=False)
        assert not torch.equal(after["bias"], before["bias"])          # the mask trained
    config = result_of(tmp_path / "majority-mask-seed0-A2")["config"]
    assert config["mask_magnitude"] == 2.0 and isinstance(config["mask_magnitude"], float)
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("## Boolean tasks (Section 5.1, Table 1)\n\n| task | init | A | seeds | train loss |")
    rows = [line.split(" | ")[:4] for line in table.splitlines() if line.startswith("| majority")]
    assert rows == [["| majority", "mask", "2", "1/1"], ["| majority", "mask", "5", "1/1"]] * 2
    svg = (tmp_path / "mask_magnitude.svg").read_text()
    # one well-formed SVG document (accuracy panel and mask-drift panel), each with one line
    # (init mask) of two points (A = 2, 5)
    root = ET.fromstring(svg)
    lines = root.findall(".//{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 and all(len(line.get("points").split()) == 2 for line in lines)


def test_killed_boolean_run_resumes_and_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    """Boolean runs write checkpoint.pt at every evaluation round too: killed after epoch 1 of 2
    and resumed, the history and every final number equal the uninterrupted run's."""
    args = ["--task", "majority", "--init", "mask", *TINY, "--epochs", "2", "--eval-every", "1"]
    whole, resumed = kill_then_resume(args, tmp_path, monkeypatch)
    assert whole["resumed_at"] is None and resumed["resumed_at"] == 1
    assert [h["epoch"] for h in whole["history"]] == [1, 2] and "test_loss" in whole["history"][0]
    assert resumed["history"] == whole["history"]
    assert resumed["final"] == whole["final"]


def test_a_killed_grid_resumes_keeping_its_finished_runs(tmp_path, monkeypatch, one_thread):
    """--resume on a grid: a finished run is read back, not run again; the killed run continues
    from its checkpoint; a run that never started starts; all end as in the uninterrupted grid."""
    import train
    args = ["--task", "majority", "--init", "default", "mask", "mask-zero", *TINY]
    assert train.main([*args, "--out", str(tmp_path / "whole")]) == 0
    real_save = train.save_checkpoint

    def die_in_the_mask_run(path, state):
        real_save(path, state)
        if path.endswith(os.path.join("majority-mask-seed0", "checkpoint.pt")):
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "save_checkpoint", die_in_the_mask_run)
    with pytest.raises(KeyboardInterrupt):
        train.main([*args, "--out", str(tmp_path / "killed")])
    monkeypatch.setattr(train, "save_checkpoint", real_save)
    finished = tmp_path / "killed" / "majority-default-seed0" / "result.json"
    written_at = finished.stat().st_mtime_ns
    assert not (tmp_path / "killed" / "majority-mask-zero-seed0").exists()
    assert train.main([*args, "--out", str(tmp_path / "killed"), "--resume"]) == 0
    assert finished.stat().st_mtime_ns == written_at
    for name in ("majority-default-seed0", "majority-mask-seed0", "majority-mask-zero-seed0"):
        whole, resumed = (result_of(tmp_path / grid / name) for grid in ("whole", "killed"))
        assert resumed["final"] == whole["final"], name


def qk_products(*flags):
    """W_Q,h^T W_K,h (D, D) of every layer and head of the model a command builds (seed 0): the
    logits a structured init writes, whatever basis the SVD chose for the factors."""
    torch.manual_seed(0)                                   # the positions the solve reads
    products = []
    for attn in maskprior.attention_modules(experiment(*flags).model):
        q, k, _ = attn.qkv.weight.detach().view(3, attn.heads, attn.head_dim, -1)     # (H, d, D) each
        products.append(q.transpose(-1, -2) @ k)                                     # (H, D, D)
    return torch.stack(products)


@pytest.mark.parametrize("init", ["structured-svd", "structured-opt"])
def test_pos_scale_sets_the_factor_the_structured_solve_multiplies_the_positions_by(init):
    """The structured inits multiply the learned positions by NORM_P = 18 before their solve (the 2025
    code's norm_p); --pos-scale X multiplies them by X instead: std 0.02 X, and the config says so."""
    flags = ["--task", "majority", "--init", init]
    scaled = experiment(*flags).model.pos
    unscaled = experiment(*flags, "--pos-scale", "1").model.pos
    assert runs_of(*flags, "--pos-scale", "1")[0].config["pos_scale"] == 1.0
    assert "pos_scale" not in runs_of(*flags)[0].config       # a default run's config is as it was
    assert unscaled.std().item() == pytest.approx(0.02, rel=0.1)
    assert scaled.std().item() == pytest.approx(0.02 * maskprior.NORM_P, rel=0.1)


def test_svd_open_and_noise_set_the_solve_targets_which_the_norm_makes_scale_free():
    """structured_svd_init_ solves for T = open * target + noise * eps on the closed entries and then
    sets Q_h, K_h to Frobenius norm 7: without noise the open logit only scales T, so --svd-open 10
    and 10000 write the same W_Q, W_K; what counts is noise over open, which --svd-noise 3 at
    --svd-open 10 makes large. The Boolean tasks solve with 1000 and noise 3, the arithmetic ones
    with 10000 and none (Table "Arithmetic task setup")."""
    flags = ["--task", "majority", "--init", "structured-svd"]
    quiet_10 = qk_products(*flags, "--svd-noise", "0", "--svd-open", "10")
    quiet_1e4 = qk_products(*flags, "--svd-noise", "0", "--svd-open", "10000")
    noisy_10 = qk_products(*flags, "--svd-noise", "3", "--svd-open", "10")
    largest = quiet_1e4.abs().max().item()
    assert torch.allclose(quiet_10, quiet_1e4, atol=1e-4 * largest)
    assert (noisy_10 - quiet_10).abs().max() > 0.1 * largest
    config = runs_of(*flags, "--svd-noise", "0", "--svd-open", "10")[0].config
    assert (config["svd_noise"], config["svd_open"]) == (0.0, 10.0)


@pytest.mark.parametrize("args, message", [
    (["--task", "majority", "--init", "structured-opt", "--svd-open", "10"],
     "--svd-open sets the structured-svd solve: --init structured-opt has none"),
    (["--task", "addition", "--init", "mask", "structured-svd", "--pos-scale", "1"],
     "--pos-scale sets the structured-svd or structured-opt solve: --init mask has none"),
    (["--task", "lm", "--init", "mimetic", "--svd-noise", "3"], "--svd-noise applies to boolean and arithmetic"),
    (["--task", "addition", "--init", "structured-svd", "--pos-scale", "0"], "--pos-scale: must be a number > 0"),
])
def test_the_structured_solve_flags_are_refused_where_no_init_solves(args, message, capsys):
    assert train.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
