"""Image classification (Section 5.3): the ViT, the impulse mask and its QK counterpart, the
CIFAR data pipeline on a tiny data set in CIFAR-10's real pickle layout, every init through the
command line, bad input, torchrun with 2 gloo processes, and kill + --resume."""
import importlib.util
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch
import torchvision.datasets.cifar
from hypothesis import given, settings, strategies as st

import maskprior
import tasks
import train
from helpers import ROOT, experiment, interrupt_then_resume, kill_then_resume, result_of, runs_of, same_weights
from synthetic import write_synthetic_cifar10

# A tiny ViT on 32 x 32 images: patch 8 -> 4 x 4 patches + CLS = 17 positions, width 16.
TINY = ["--dim", "16", "--layers", "2", "--heads", "2", "--patch-size", "8", "--batch-size", "16",
        "--no-progress"]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------
# The model and the impulse mask
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", ["cls", "avg"])
def test_vit_shapes(pool):
    torch.manual_seed(0)
    masks = maskprior.impulse_mask(2, 3, 4)                          # (2, 3, 17, 17)
    vit = maskprior.ViT(32, 8, 10, 24, 2, 3, 96, masks=masks, mode="learnable", pool=pool)
    logits, attns = vit(torch.randn(5, 3, 32, 32), return_attn=True)
    assert logits.shape == (5, 10) and vit.grid == 4
    assert len(attns) == 2 and attns[0].shape == (5, 3, 17, 17)
    torch.testing.assert_close(attns[1].sum(-1), torch.ones(5, 3, 17))
    torch.testing.assert_close(vit(torch.randn(2, 3, 32, 32)).shape, torch.Size([2, 10]))
    with pytest.raises(ValueError, match="multiple"):
        maskprior.ViT(30, 8, 10, 24, 2, 3, 96)


def vision_setup(init, task="cifar10", *flags, seed=0):
    """train.vision_setup's experiment for the preset and flags, on 4 blank images of the
    preset's size (batch 2, no workers): the model, its prior and its pattern as a run has them."""
    flags = ["--task", task, "--init", init, "--seed", str(seed), *flags]
    size = runs_of(*flags)[0].config["image_size"]
    images = [(torch.zeros(3, size, size), 0)] * 4
    data = {"train": images, "test": images, "classes": tasks.VISION_CLASSES[task]}
    torch.manual_seed(seed)                     # as train.execute does before the setup
    return experiment(*flags, data=data, batch_size=2)


def test_paper_preset_is_vit_tiny_patch16_224():
    exp = vision_setup("mask", "cifar100", "--preset", "paper")
    model, pattern = exp.model, exp.pattern
    blocks = model.blocks
    assert len(blocks) == 12 and model.grid == 14 and pattern.shape == (12, 3, 197, 197)
    attn = blocks[0].attn
    assert (attn.heads, attn.head_dim, attn.seq_len, attn.mode) == (3, 64, 197, "learnable")
    assert blocks[0].mlp.fc.weight.shape == (768, 192) and model.head.weight.shape == (100, 192)
    # drop path is torchvision's StochasticDepth, rising linearly from 0 to 0.1 (timm's rule)
    rates = [b.drop_path.p for b in blocks]
    assert type(blocks[0].drop_path).__name__ == "StochasticDepth"
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.1) and rates == sorted(rates)


# The reference's impulse order: k = [4, 1, 5, 3, 7, 0, 2, 6, 8], (row, col) = (k // 3 - 1, k % 3 - 1):
# identity, up, right, left, down, then the diagonals (ViT-Tiny's 3 heads: identity, up, right).
NINE = [(0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1)]


def test_impulse_heads_follow_the_reference_order():
    """On a 3 x 3 grid the centre patch of head h opens exactly its offset NINE[h mod 9]."""
    m = maskprior.impulse_mask(1, 11, 3)
    centre = 1 + 1 * 3 + 1                                              # patch (1, 1); 0 is CLS
    for h in range(11):
        dr, dc = NINE[h % 9]                                            # head i uses k[i mod 9]
        opened = (m[0, h, centre] == maskprior.OPEN).nonzero().flatten().tolist()
        assert opened == [1 + (1 + dr) * 3 + (1 + dc)], h


@settings(deadline=None, max_examples=30)
@given(depth=st.integers(1, 2), heads=st.integers(1, 10), grid=st.integers(1, 6))
def test_impulse_mask_matches_its_definition(depth, heads, grid):
    m = maskprior.impulse_mask(depth, heads, grid)
    n = grid * grid + 1
    assert m.shape == (depth, heads, n, n)
    assert set(m.unique().tolist()) <= {maskprior.OPEN, maskprior.CLOSE}
    assert torch.equal(m[0].expand_as(m), m)                              # every layer the same
    offsets = [NINE[h % 9] for h in range(heads)]
    for h in range(heads):
        assert (m[0, h, 0] == maskprior.OPEN).all()                       # CLS row: all open
        assert (m[0, h, 1:, 0] == maskprior.CLOSE).all()                  # CLS column: closed
        dr, dc = offsets[h]
        for r in range(grid):
            for c in range(grid):
                row = m[0, h, 1 + r * grid + c]
                open_keys = (row == maskprior.OPEN).nonzero().flatten().tolist()
                on_grid = 0 <= r + dr < grid and 0 <= c + dc < grid
                # exactly the neighbour at the head's offset, or an empty row off the grid
                assert open_keys == ([1 + (r + dr) * grid + (c + dc)] if on_grid else [])


def test_impulse_qk_init_puts_most_attention_on_the_pattern(mass_on_pseudo_input):
    """At the cpu preset's shape (8 x 8 patches + CLS, width 96, 3 heads of 32, 6 layers), the SVD
    solver writes the impulse into W_Q / W_K: attention computed on the pseudo-input (positions
    only) puts this mass on the open entries, mean over query rows (measured, seed 0): identity
    head 1.00, up and right 0.81 each, mean 0.873. Up and right have 8 empty rows (top row /
    right column of the grid), so at most 57/65 = 0.877 is reachable for them (0.918 overall).
    Default init: 0.03."""
    pattern = maskprior.impulse_mask(6, 3, 8)
    exp = vision_setup("impulse")
    assert torch.equal(exp.pattern, pattern) and maskprior.mask_biases(exp.model) is None
    default = mass_on_pseudo_input(vision_setup("default").model, pattern)
    mass = mass_on_pseudo_input(exp.model, pattern)                    # (layers, heads)
    assert mass.mean() > 0.8 and mass[:, 0].min() > 0.99 and mass.min() > 0.7
    assert default.max() < 0.1


# ------------------------------------------------------------------------------------------
# Data: a tiny data set in CIFAR-10's python-pickle layout
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    """60 training and 20 test images of 32 x 32 written as the real files are: pickled dicts in
    cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta)."""
    root = tmp_path_factory.mktemp("data")
    write_synthetic_cifar10(str(root), train_size=60, test_size=20, seed=0)
    return str(root)


@pytest.fixture
def skip_md5(monkeypatch):
    """Our files cannot have the real MD5 sums: bypass torchvision's check in this process only."""
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)


def test_torchvision_reads_the_tiny_set_and_the_pipeline(cifar_dir, skip_md5):
    data = tasks.vision_dataset("cifar10", cifar_dir, 32)
    assert len(data["train"]) == 60 and len(data["test"]) == 20 and data["classes"] == 10
    image, label = data["test"][3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 3
    raw = data["test"].data[3]                        # (32, 32, 3) uint8, as torchvision stores it
    with open(os.path.join(cifar_dir, "cifar-10-batches-py", "test_batch"), "rb") as f:
        row = pickle.load(f)["data"][3]
    assert bytes(raw.transpose(2, 0, 1).tobytes()) == bytes(row)  # channel-major rows, unchanged
    randaugment = [t for t in data["train"].transform.transforms if type(t).__name__ == "RandAugment"]
    assert len(randaugment) == 1 and randaugment[0].magnitude == 9      # "RandAug (m9)"
    images, soft = tasks.mixup_cutmix(10)(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    assert soft.shape == (4, 10) and torch.allclose(soft.sum(1), torch.ones(4))


def test_torchvision_refuses_files_that_fail_its_md5_check(cifar_dir):
    tasks.forget_data()          # a new command: the set read above, without the MD5 check, is read again
    with pytest.raises(tasks.DataError, match="MD5"):
        tasks.vision_dataset("cifar10", cifar_dir, 32)


# ------------------------------------------------------------------------------------------
# Runs through the command line
# ------------------------------------------------------------------------------------------

def test_every_init_trains_through_the_cli(cifar_dir, skip_md5, tmp_path, capsys, attention_svg):
    """One grid of the five inits, 2 epochs each: result.json with final.top1 and the persistence
    numbers, the pictures, and table.md."""
    inits = list(train.FAMILIES["vision"]["inits"])
    assert train.main(["--task", "cifar10", "--init", *inits, "--epochs", "2", "--data-dir",
                       cifar_dir, "--out", str(tmp_path), *TINY]) == 0
    out = capsys.readouterr().out
    finals = {}
    for init in inits:
        folder = tmp_path / f"cifar10-{init}-seed0"
        result = result_of(folder)
        assert result["status"] == "done" and f"cifar10/{init}/seed0: best top-1 (%) " in out
        final = finals[init] = result["final"]
        assert 0 <= final["top1"] <= 100 and final["best_top1"] >= final["top1"]
        assert [h["epoch"] for h in result["history"]] == [1, 2]
        for key in ("prior_mass_init", "prior_mass_final", "pattern_corr_init", "pattern_corr_final"):
            assert isinstance(final[key], float)
        assert torch.tensor(final["prior_mass_init_per_head"]).shape == (2, 2)   # (layers, heads)
        # attention.svg: the mean maps and the first test image's centre patch on the 4 x 4
        # patch grid, before and after; with a mask, each map's bias beside it
        texts, titles, panels = attention_svg(folder)
        maps = ["mean attention", "test image 1, centre patch: attention"]
        if init.startswith("mask"):
            maps += ["mask bias log σ(s M)", "centre patch: mask bias"]
        else:
            assert final["mask_drift"] is None
        assert sorted(titles) == sorted(f"{m}, {when} training" for m in maps
                                        for when in ("before", "after"))
        assert {"layer 2", "head 2", "attention weight on each patch"} <= set(texts)
        # a 4 x 4 grid of 32 x 32 pixel cells per panel, 2 layers x 2 heads, 4-pixel gutters
        assert panels["test image 1, centre patch: attention, after training"].shape == \
            (3, 2 * (128 + 4) + 4, 2 * (128 + 4) + 4)
        assert not [p for p in os.listdir(folder) if ".tmp" in p]
    # the prior is where each init puts it: mask 0.88 (CLS row + one open key per patch row, the
    # rest at -10), impulse in W_Q / W_K less sharply (0.46 at this tiny width), default 0.11
    assert finals["mask"]["prior_mass_init"] > 0.8 and finals["mask-fixed"]["prior_mass_init"] > 0.8
    assert finals["mask"]["prior_mass_init"] > finals["impulse"]["prior_mass_init"] > \
        finals["default"]["prior_mass_init"]
    assert finals["mask-fixed"]["mask_drift"] == 0 and finals["mask"]["mask_drift"] > 0
    table = (tmp_path / "table.md").read_text()
    assert "## Vision (Section 5.3)" in table and "| cifar10 | impulse | 1/1 |" in table and "| 95.12" in table


def test_missing_dataset_is_one_line_and_exit_2(tmp_path, run_cli):
    proc = run_cli("--task", "cifar100", "--init", "mask", "--data-dir", str(tmp_path), *TINY,
                   "--threads", "1", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"expected {tmp_path}/cifar-100-python/" in lines[0], proc.stderr
    assert "--download" in lines[0]


@pytest.mark.parametrize("args, message", [
    (["--task", "imagenet100", "--data-dir", "/nonexistent"],
     "ImageNet100: expected two folders, /nonexistent/imagenet100/train and "
     "/nonexistent/imagenet100/val"),
    (["--task", "imagenet100", "--download"], "ImageNet100 has no --download"),
    (["--task", "majority", "--download"], "--download applies to vision tasks only"),
    (["--task", "lm", "--epochs", "3"], "--epochs applies to boolean and arithmetic and vision tasks only"),
    (["--task", "cifar10", "--init", "structured-svd"], "--init structured-svd is not available"),
    (["--task", "majority", "--init", "impulse"], "--init impulse is not available"),
    (["--task", "cifar10", "--patch-size", "5"], "--image-size 32 is not a multiple"),
    (["--task", "majority", "--model", "timm"], "--model applies to vision tasks only"),
    (["--task", "cifar10", "--model", "timm", "--init", "mask", "impulse"],
     "--model timm takes --init default, mask, mask-fixed, no --mask-from"),
])
def test_vision_bad_input_exits_2_with_one_line(args, message, capsys):
    assert train.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_model_timm_trains_timms_vit_with_the_mask_prior(cifar_dir, skip_md5, tmp_path, capsys):
    """--model timm: timm's VisionTransformer of the same shape, M put in by add_mask_prior (fixed
    for mask-fixed), timm's pos_embed and cls_token undecayed as maskprior.ViT's pos and cls."""
    timm = pytest.importorskip("timm", reason="needs the test extras (pip install .[test]): timm")
    assert train.main(["--task", "cifar10", "--model", "timm", "--init", "default", "mask",
                       "mask-fixed", "--epochs", "2", "--data-dir", cifar_dir, "--out",
                       str(tmp_path), *TINY]) == 0
    pattern = maskprior.impulse_mask(2, 2, 4)
    for init in ("default", "mask", "mask-fixed"):
        folder = tmp_path / f"cifar10-{init}-seed0"
        result = result_of(folder)
        assert result["status"] == "done" and result["config"]["model"] == "timm"
        assert 0 <= result["final"]["top1"] <= 100 and not (folder / "attention.svg").exists()
        weights = torch.load(folder / "checkpoint.pt", weights_only=False)["model"]
        assert "blocks.0.attn.qkv.weight" in weights
        masks = [weights.get(f"blocks.{layer}.attn.mask") for layer in range(2)]
        if init == "default":
            assert masks == [None, None]
        else:
            moved = [not torch.equal(m, p) for m, p in zip(masks, pattern)]
            assert moved == [init == "mask"] * 2
    model = timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1,
                                          num_heads=2, num_classes=10)
    maskprior.add_mask_prior(model, pattern[:1])
    optimizer = train.make_optimizer(model, {"optimizer": "adamw", "weight_decay": 0.05,
                                             "mask_decay": 1e-3, "lr": 1e-3})
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert [decay[id(named[n])] for n in ("pos_embed", "cls_token", "blocks.0.attn.mask",
                                           "blocks.0.attn.qkv.weight")] == [0.0, 0.0, 1e-3, 0.05]


def test_model_timm_without_timm_is_one_line_and_exit_2(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "timm" else find_spec(name, *rest))
    assert train.main(["--task", "cifar10", "--model", "timm", "--init", "mask"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["train.py: error: --model timm needs timm: pip install timm"]


def test_resume_without_a_checkpoint_is_exit_2_and_leaves_no_files(cifar_dir, skip_md5, tmp_path,
                                                                   capsys):
    out = tmp_path / "run"
    assert train.main(["--task", "cifar10", "--resume", "--out", str(out), "--data-dir", cifar_dir,
                       *TINY]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"train.py: error: --resume: no checkpoint at {out}/checkpoint.pt: run "
                     f"without --resume first"]
    assert not out.exists()


def test_warmup_as_long_as_the_run_is_shortened_and_said_so(cifar_dir, skip_md5, tmp_path, capsys):
    """--epochs 1 with the cpu preset's 1 warmup epoch: the run goes ahead with no warmup, and
    result.json and the summary line say the warmup was shortened from 1 to 0 epochs."""
    assert train.main(["--task", "cifar10", "--init", "default", "--epochs", "1", "--data-dir",
                       cifar_dir, "--out", str(tmp_path), *TINY]) == 0
    config = result_of(tmp_path)["config"]
    assert (config["warmup_epochs"], config["warmup_shortened_from"]) == (0, 1)
    assert "warmup shortened from 1 to 0 epochs" in capsys.readouterr().out
    config = runs_of("--task", "cifar10", "--epochs", "5", "--warmup-epochs", "9")[0].config
    assert (config["warmup_epochs"], config["warmup_shortened_from"]) == (4, 9)
    assert "warmup_shortened_from" not in runs_of("--task", "cifar10", "--epochs", "5")[0].config


def test_killed_run_resumes_and_ends_where_an_uninterrupted_one_does(cifar_dir, skip_md5,
                                                                     tmp_path, monkeypatch):
    args = ["--task", "cifar10", "--init", "mask", "--epochs", "3", "--data-dir", cifar_dir, *TINY]
    whole, resumed = kill_then_resume(args, tmp_path, monkeypatch)   # killed after epoch 1
    assert resumed["resumed_at"] == 1 and len(whole["history"]) == 3
    assert resumed["history"] == whole["history"]       # losses, lr, top-1 of every epoch
    for key in ("top1", "test_loss", "prior_mass_init", "prior_mass_final", "mask_drift"):
        assert resumed["final"][key] == whole["final"][key], key


def test_a_signal_mid_epoch_resumes_exactly(cifar_dir, skip_md5, tmp_path, monkeypatch, capsys):
    """SIGTERM during step 2 of epoch 1 (3 steps an epoch): resumed, the epoch's last batch gets
    the augmentation, MixUp / CutMix and drop path of the uninterrupted run."""
    args = ["--task", "cifar10", "--init", "mask", "--epochs", "2", "--data-dir", cifar_dir, *TINY]
    whole, resumed, line, weights = interrupt_then_resume(args, tmp_path, monkeypatch, capsys, 2,
                                                          signal.SIGTERM)
    assert line.startswith("train.py: interrupted at epoch 1 (step 2); the checkpoint of epoch 1 "
                           "(step 2) is kept in "), line
    assert resumed["history"] == whole["history"]
    for key in ("top1", "test_loss", "prior_mass_init", "prior_mass_final", "mask_drift"):
        assert resumed["final"][key] == whole["final"][key], key
    assert same_weights(*weights)


def test_torchrun_two_cpu_processes_with_gloo(cifar_dir, tmp_path):
    """DistributedDataParallel on the CPU: 2 processes, gloo, the global batch of 16 split 8 + 8,
    one result from rank 0. The launcher script bypasses the MD5 check in the test's processes."""
    launcher = tmp_path / "train_tiny_cifar.py"
    launcher.write_text(
        "import runpy, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import torchvision.datasets.cifar\n"
        "torchvision.datasets.cifar.check_integrity = lambda *a, **k: True  # test data only\n"
        f"runpy.run_path({os.path.join(ROOT, 'train.py')!r}, run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(launcher), "--task", "cifar10", "--init", "mask", "--epochs", "2", "--data-dir",
         cifar_dir, "--out", str(out), "--threads", "1", *TINY],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("cifar10/mask/seed0: best top-1") == 1       # rank 0 reports, once
    result = result_of(out)
    assert result["world_size"] == 2 and [h["epoch"] for h in result["history"]] == [1, 2]
    assert 0 <= result["final"]["top1"] <= 100 and (out / "attention.svg").exists()
