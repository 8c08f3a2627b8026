"""Priors learned from a trained model (--mask-from): maskprior.learned_mask against its definition
on synthetic attention maps, every refusal of a source run as one line and exit 2, the config a
learned-prior run records, its M at init, its resume, and the figure of learned beside hand-made
priors."""
import hashlib
import json
import math
import os
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import maskprior
import train
from helpers import experiment, files_of, kill_then_resume, one_line, result_of
from synthetic import SHAPES, write_image_tree

pytestmark = pytest.mark.usefixtures("one_thread")

# Tiny runs of about a second each: arithmetic (2 layers of 4 heads, width 16, N = 10 for
# addition), a GPT (1 layer, 2 heads, blocks of 16 bytes) and a ViT (8 x 8 images, 4 patches + CLS).
TINY = ["--layers", "2", "--dim", "16", "--epochs", "1", "--eval-size", "500", "--threads", "1",
        "--no-progress"]
TINY_LM = ["--iters", "8", "--eval-every", "4", "--layers", "1", "--heads", "2", "--dim", "16",
           "--block-size", "16", "--batch-size", "4", "--no-progress"]
TINY_VIT = ["--image-size", "8", "--patch-size", "4", "--dim", "12", "--layers", "1", "--heads", "2",
            "--batch-size", "8", "--epochs", "1", "--no-progress"]
SVG = "{http://www.w3.org/2000/svg}"


# ------------------------------------------------------------------------------------------
# The construction: M_ij = +A if i = j or p_ij >= tau / n_i, else -A
# ------------------------------------------------------------------------------------------

def test_an_encoder_row_opens_the_keys_at_or_above_tau_over_n():
    """N = 4: a uniform row's share is 0.25; an entry exactly at tau / N is open; the diagonal is
    open whatever it holds."""
    p = torch.tensor([[0.10, 0.25, 0.40, 0.25],      # diagonal 0.10 < 0.25: open anyway
                      [0.30, 0.20, 0.24, 0.26],
                      [0.05, 0.05, 0.05, 0.85],
                      [0.25, 0.25, 0.25, 0.25]])[None, None]        # (1, 1, 4, 4)
    expected = {1.0: [[1, 1, 1, 1], [1, 1, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]],
                2.0: [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 1]],   # >= 0.5
                0.5: [[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]}   # >= 0.125
    expected[2.0][0][0] = expected[0.5][0][0] = 1
    for tau, opened in expected.items():
        m = maskprior.learned_mask(p, 5.0, tau)
        assert m.dtype == torch.float32 and m.shape == (1, 1, 4, 4)
        assert m[0, 0].tolist() == [[5.0 if o else -5.0 for o in row] for row in opened], tau


def test_a_causal_row_counts_only_the_keys_it_sees():
    """Row i of a causal model sees i + 1 keys: its threshold is tau / (i + 1), not tau / N; the
    future (j > i) is closed even where the maps hold mass."""
    p = torch.tensor([[1.00, 0.00, 0.00, 0.00],
                      [0.45, 0.55, 0.00, 0.00],      # threshold 1/2: 0.45 closed
                      [0.30, 0.34, 0.36, 0.00],      # 1/3: 0.30 closed, 0.34 open
                      [0.20, 0.26, 0.30, 0.24]])     # 1/4: 0.20 and 0.24 closed
    m = maskprior.learned_mask(p, 1.0, 1.0, causal=True)
    assert m.tolist() == [[1, -1, -1, -1], [-1, 1, -1, -1], [-1, 1, 1, -1], [-1, 1, 1, 1]]
    # as an encoder (threshold 1/4 everywhere) the same rows open more, and the future too
    assert maskprior.learned_mask(p, 1.0, 1.0)[1].tolist() == [1, 1, -1, -1]
    past = torch.ones(4, 4).tril()
    uniform = past / past.sum(-1, keepdim=True) + 0.9 * (1 - past)   # mass in the future too
    assert maskprior.learned_mask(uniform, 1.0, causal=True).tolist() == \
        torch.where(past > 0, 1.0, -1.0).tolist()                     # the past open, the future not


@settings(deadline=None, max_examples=40, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), n=st.integers(1, 9), tau=st.floats(0.1, 4.0),
       causal=st.booleans(), magnitude=st.sampled_from([1.0, 5.0, 10.0]),
       sharpness=st.sampled_from([0.5, 2.0, 6.0]))
def test_every_entry_follows_the_rule(seed, n, tau, causal, magnitude, sharpness):
    """Each entry of random maps (softmax over the keys a row sees; 2 layers x 3 heads) is +A
    exactly when i = j or p_ij >= tau / n_i, and a larger tau opens a subset."""
    g = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(2, 3, n, n, generator=g)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    p = logits.masked_fill(future, -math.inf).softmax(-1) if causal else logits.softmax(-1)
    m = maskprior.learned_mask(p, magnitude, tau, causal)
    assert m.shape == p.shape and m.dtype == torch.float32
    for l in range(2):
        for h in range(3):
            for i in range(n):
                seen = i + 1 if causal else n
                for j in range(n):
                    opened = i == j or (p[l, h, i, j].item() >= tau / seen and not (causal and j > i))
                    assert m[l, h, i, j].item() == (magnitude if opened else -magnitude), (l, h, i, j)
    wider = maskprior.learned_mask(p, magnitude, tau / 2, causal)
    assert ((wider > 0) | (m < 0)).all()                    # open at tau -> open at tau / 2


@pytest.mark.parametrize("task", [*maskprior.BOOLEAN_MASKS, *maskprior.ARITHMETIC_MASKS])
def test_attention_that_is_the_hand_made_pattern_gives_it_back(task):
    """A model attending uniformly over each hand-made pattern's open keys (every one of them
    opens its diagonal): at tau = 1 the learned mask is that pattern, at its own magnitude."""
    pattern = (maskprior.boolean_mask(task, 2, 3) if task in maskprior.BOOLEAN_MASKS
               else maskprior.ARITHMETIC_MASKS[task](2, 4))
    opened = (pattern > 0).float()
    p = opened / opened.sum(-1, keepdim=True)
    assert torch.equal(maskprior.learned_mask(p, pattern.max().item()), pattern)


def test_open_fraction_counts_off_diagonal_and_for_causal_the_past_only():
    m = torch.tensor([[1.0, -1, 1], [1, 1, -1], [-1, -1, 1]])
    assert maskprior.open_fraction(m) == pytest.approx(2 / 6)          # (0,2) and (1,0) of 6
    assert maskprior.open_fraction(m, causal=True) == pytest.approx(1 / 3)   # (1,0) of 3
    assert maskprior.open_fraction(m.expand(2, 3, 3, 3)) == pytest.approx(2 / 6)
    assert maskprior.open_fraction(torch.ones(1, 1)) == 0.0


# ------------------------------------------------------------------------------------------
# Source runs, made once
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished default addition run at 1 % of the pairs (2 layers x 4 heads x 10 x 10)."""
    out = tmp_path_factory.mktemp("sources") / "addition-default-seed0-frac0.01"
    assert train.main(["--task", "addition", "--init", "default", "--train-frac", "0.01", *TINY,
                       "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def lm_source(tmp_path_factory):
    out = tmp_path_factory.mktemp("sources") / "lm-default"
    assert train.main(["--task", "lm", "--init", "default", *TINY_LM, "--out", str(out)]) == 0
    return out


def source_attention(folder):
    return torch.load(folder / "attention_after.pt", weights_only=True)["attn"]


def target(source_dir, *extra):
    """train.main's arguments of a tiny learned-prior addition run at 0.1 % of the pairs."""
    return ["--task", "addition", "--init", "mask", "--train-frac", "0.001", *TINY,
            "--mask-from", str(source_dir), *extra]


# ------------------------------------------------------------------------------------------
# Refusals: one line, exit 2, nothing written, the source untouched
# ------------------------------------------------------------------------------------------

def damaged(kind, src, folder):
    """A copy of the source run in folder, damaged as kind says; returns what --mask-from gets."""
    if kind == "no folder":
        return str(folder / "nowhere")
    shutil.copytree(src, folder)
    attention = folder / "attention_after.pt"
    if kind == "empty folder":
        shutil.rmtree(folder)
        folder.mkdir()
    elif kind == "result.json damaged":
        (folder / "result.json").write_text('{"task": "addition", "init"')
    elif kind == "not finished":
        result = result_of(folder)
        (folder / "result.json").write_text(json.dumps({**result, "status": "running", "final": None}))
    elif kind == "no attention_after.pt":
        attention.unlink()
    elif kind == "attention_after.pt damaged":
        attention.write_bytes(b"not a pickle at all" * 10)
    elif kind == "no attn":
        torch.save({"attn": None, "bias": None}, attention)
    elif kind == "not a dict":
        torch.save([torch.zeros(2, 4, 10, 10)], attention)
    elif kind == "attn 3-D":
        torch.save({"attn": torch.zeros(4, 10, 10)}, attention)
    elif kind == "NaN":
        attn = source_attention(src).clone()
        attn[1, 2, 3, 4] = math.nan
        torch.save({"attn": attn, "bias": None}, attention)
    return str(folder)


REFUSALS = {
    "no folder": "no such folder",
    "empty folder": "no result.json there: not a run folder of train.py",
    "result.json damaged": "result.json is damaged or not a result of train.py",
    "not finished": "not a finished run (status 'running'): name a run whose result.json says done",
    "no attention_after.pt": "no attention_after.pt there: it holds the attention maps",
    "attention_after.pt damaged": "attention_after.pt is damaged or not one of train.py's (UnpicklingError)",
    "no attn": "attention_after.pt holds no mean attention maps (a layers x heads x N x N tensor under 'attn')",
    "not a dict": "attention_after.pt holds no mean attention maps (a layers x heads x N x N tensor under 'attn')",
    "attn 3-D": "attention_after.pt holds no mean attention maps (a layers x heads x N x N tensor under 'attn')",
    "NaN": "attention_after.pt's mean attention is not finite (NaN or inf)",
}


def refused(args, capsys):
    """train.main(args) exits 2 with one line on stderr; returns that line."""
    assert train.main(args) == 2
    return one_line(capsys.readouterr().err)


@pytest.mark.parametrize("kind", REFUSALS)
def test_a_missing_unfinished_or_damaged_source_is_refused(kind, source, tmp_path, capsys):
    folder = damaged(kind, source, tmp_path / "source")
    before = files_of(tmp_path / "source") if os.path.isdir(folder) else None
    line = refused(target(folder, "--out", str(tmp_path / "out")), capsys)
    assert line == f"train.py: error: --mask-from {folder}: {REFUSALS[kind]}"
    assert not (tmp_path / "out").exists()
    if before is not None:
        assert files_of(tmp_path / "source") == before


@pytest.mark.parametrize("extra, theirs, ours", [
    (["--layers", "3"], "2 layers x 4 heads x 10 x 10", "3 layers x 4 heads x 10 x 10"),
    (["--heads", "2"], "2 layers x 4 heads x 10 x 10", "2 layers x 2 heads x 10 x 10"),
])
def test_a_source_of_another_shape_is_refused_naming_both(extra, theirs, ours, source, tmp_path, capsys):
    line = refused(target(source, *extra, "--out", str(tmp_path / "out")), capsys)
    assert line == (f"train.py: error: --mask-from {source}: its attention maps are {theirs}, this "
                    f"model's {ours}: the source needs the same --layers, --heads and sequence length")
    assert not (tmp_path / "out").exists()


def test_a_source_of_another_task_length_is_refused(source, tmp_path, capsys):
    """Addition (N = 10) into multiplication (N = 12): a prior carried across tasks needs the same N."""
    args = ["--task", "multiplication", "--init", "mask", *TINY, "--mask-from", str(source),
            "--out", str(tmp_path / "out")]
    assert "this model's 2 layers x 4 heads x 12 x 12" in refused(args, capsys)


@pytest.mark.parametrize("args, message", [
    (["--init", "default"], "--mask-from: --init default has no mask prior to replace (mask, "
                            "mask-fixed or mask-hadamard only)"),
    (["--init", "mask", "structured-svd"], "--mask-from: --init structured-svd has no mask prior"),
    (["--init", "mask-zero"], "--mask-from: --init mask-zero has no mask prior"),
    (["--mask-error", "moved:0.5"], "--mask-from and --mask-error: a learned prior is not edited, "
                                    "give one of the two"),
    (["--mask-threshold", "0"], "argument --mask-threshold: must be a number > 0, got '0'"),
])
def test_flags_that_do_not_go_with_mask_from_are_refused(args, message, source, tmp_path, capsys):
    line = refused([*target(source), *args, "--out", str(tmp_path / "out")], capsys)
    assert line.startswith("train.py: error: ") and message in line


def test_vision_impulse_and_a_threshold_alone_are_refused(source, tmp_path, capsys):
    assert refused(["--task", "images", "--init", "impulse", "--mask-from", str(source)], capsys) == \
        ("train.py: error: --mask-from: --init impulse has no mask prior to replace (mask, "
         "mask-fixed or mask-hadamard only)")
    assert refused(["--task", "addition", "--init", "mask", "--mask-threshold", "2"], capsys) == \
        "train.py: error: --mask-threshold applies with --mask-from only"
    assert refused(target(source, "--out", str(source)), capsys) == \
        f"train.py: error: --out {source} is the --mask-from folder: the run would overwrite its source"


# ------------------------------------------------------------------------------------------
# A learned-prior run
# ------------------------------------------------------------------------------------------

def test_the_run_records_its_source_and_starts_from_the_learned_mask(source, tmp_path):
    """config: the source, its hash, task, init, train fraction, seed, tau and density; M at init is
    learned_mask of the source's maps at A = 5 (attention_before.pt's bias is log sigmoid of it);
    prior_mass_* is measured on the learned pattern, true_prior_mass_* on mask_addition."""
    out = tmp_path / "run"
    assert train.main([*target(source, "--mask-threshold", "1.1"), "--out", str(out)]) == 0
    result = result_of(out)
    config, final = result["config"], result["final"]
    learned = maskprior.learned_mask(source_attention(source), 5.0, 1.1)          # (2, 4, 10, 10)
    digest = hashlib.sha256((source / "attention_after.pt").read_bytes()).hexdigest()
    assert {k: v for k, v in config.items() if k.startswith("mask_from") or k in
            ("mask_threshold", "mask_density")} == {
        "mask_from": str(source), "mask_from_sha256": digest, "mask_from_task": "addition",
        "mask_from_init": "default", "mask_from_train_frac": 0.01, "mask_from_seed": 0,
        "mask_threshold": 1.1, "mask_density": maskprior.open_fraction(learned)}
    assert 0 < config["mask_density"] < 1
    before = torch.load(out / "attention_before.pt", weights_only=True)
    assert torch.equal(before["bias"], F.logsigmoid(learned))
    hand_made = maskprior.mask_addition(2, 4)
    assert not torch.equal(learned, hand_made)
    assert final["prior_mass_init"] == pytest.approx(
        maskprior.prior_stats(before["attn"], learned)[0].mean().item())
    assert final["true_prior_mass_init"] == pytest.approx(
        maskprior.prior_stats(before["attn"], hand_made)[0].mean().item())
    assert final["true_prior_mass_init"] != pytest.approx(final["prior_mass_init"])


def test_everything_but_m_starts_as_in_the_hand_made_mask_run(source):
    """The learned prior replaces M after the family's setup: the same weights and batches as the
    hand-made run, only M differs, and the optimizer trains the new M."""
    flags = target(source)
    at = flags.index("--mask-from")
    torch.manual_seed(0)
    hand = experiment(*flags[:at], *flags[at + 2:])
    torch.manual_seed(0)
    ours = experiment(*flags)
    for (name, a), (_, b) in zip(hand.model.state_dict().items(), ours.model.state_dict().items()):
        assert torch.equal(a, b) == (not name.endswith("mask")), name
    masks = [p for name, p in ours.model.named_parameters() if name.endswith("mask")]
    assert torch.equal(torch.stack(masks), maskprior.learned_mask(source_attention(source), 5.0))
    trained = {id(p) for group in ours.optimizer.param_groups for p in group["params"]}
    assert all(id(m) in trained for m in masks)
    assert torch.equal(ours.true_pattern, hand.pattern) and torch.equal(ours.pattern, torch.stack(masks))


def test_a_learned_prior_run_resumes_exactly(source, tmp_path, monkeypatch):
    args = [*target(source), "--epochs", "2", "--eval-every", "1"]
    whole, resumed = kill_then_resume(args, tmp_path, monkeypatch)      # killed after epoch 1
    assert resumed["resumed_at"] == 1 and resumed["config"] == whole["config"]
    assert resumed["history"] == whole["history"] and resumed["final"] == whole["final"]


def test_resume_refuses_a_source_trained_again(source, tmp_path, capsys):
    """The source's attention maps changed under a started run: its hash differs from the
    checkpoint's config, so --resume names it and stops."""
    src = tmp_path / "source"
    shutil.copytree(source, src)
    out = str(tmp_path / "out")
    assert train.main([*target(src), "--out", out]) == 0
    attn = source_attention(src)
    torch.save({"attn": attn.flip(-1), "bias": None}, src / "attention_after.pt")
    line = refused([*target(src), "--out", out, "--resume"], capsys)
    assert "--resume:" in line and "mask_from_sha256" in line


def test_a_tau_sweep_sits_beside_the_default_and_hand_made_runs(source, tmp_path, capsys):
    """One grid root: default, hand-made mask and a learned prior at tau 0.5, 1, 2 each get their
    folder; a larger tau opens fewer entries; table.md names the prior of each row."""
    root = str(tmp_path)
    common = ["--task", "addition", "--train-frac", "0.001", *TINY, "--seeds", "0", "1", "--out", root]
    assert train.main([*common, "--init", "default", "mask"]) == 0
    assert train.main([*common, "--init", "mask", "--mask-from", str(source),
                       "--mask-threshold", "0.5", "1", "2"]) == 0
    name = source.name
    learned = [f"addition-mask-seed{s}-frac0.001-from-{name}-tau{t}" for t in ("0.5", "1", "2") for s in (0, 1)]
    assert sorted(os.listdir(root)) == sorted(
        [f"addition-{i}-seed{s}-frac0.001" for i in ("default", "mask") for s in (0, 1)]
        + learned + ["curves.svg", "grid.json", "table.md"])
    density = [result_of(tmp_path / f)["config"]["mask_density"] for f in learned[::2]]
    assert density[0] > density[1] > density[2]
    assert train.main(["--summarize", root]) == 0
    table, persistence = (tmp_path / "table.md").read_text().split("## Arithmetic (Section 5.2)")[1].split(
        "## Persistence of the prior")
    rows = [line.split(" | ")[2:5] for line in table.splitlines() if line.startswith("| addition")]
    assert rows == [["default", "—", "2/2"], ["mask", "—", "2/2"],
                    *[["mask", f"{name}, τ {t}", "2/2"] for t in ("0.5", "1", "2")]]
    header = next(line for line in table.splitlines() if line.startswith("| task"))
    assert "| task | train frac | init | mask from | seeds |" in header
    assert "paper seq acc (%) / digit acc (%) / test loss" in header
    assert "true prior mass final" in next(line for line in persistence.splitlines() if line.startswith("| task"))
    assert f"addition/mask/seed1 (train frac 0.001, mask from {name}, τ 2): seq acc (%) " in capsys.readouterr().out


def test_a_gpt_learns_its_prior_from_a_default_gpt(lm_source, tmp_path):
    """The GPT saves its mean attention maps (causal: rows sum to 1 over keys j <= i); a learned
    prior puts M = +-1 under the scale s = 10, so the bias is log sigmoid(+-10); the density
    counts only the keys a row sees."""
    attn = source_attention(lm_source)                                   # (1, 2, 16, 16)
    assert attn.shape == (1, 2, 16, 16)
    assert torch.allclose(attn.sum(-1), torch.ones(1, 2, 16))
    assert (attn.triu(1) == 0).all()
    out = tmp_path / "run"
    assert train.main(["--task", "lm", "--init", "mask", *TINY_LM, "--mask-from", str(lm_source),
                       "--out", str(out)]) == 0
    result = result_of(out)
    learned = maskprior.learned_mask(attn, 1.0, 1.0, causal=True)
    assert result["config"]["mask_density"] == maskprior.open_fraction(learned, causal=True)
    assert result["config"]["mask_from_train_frac"] is None
    bias = torch.load(out / "attention_before.pt", weights_only=True)["bias"]
    assert torch.equal(bias, F.logsigmoid(10 * learned))
    assert set(bias.unique().tolist()) == {F.logsigmoid(torch.tensor(10.0)).item(),
                                           F.logsigmoid(torch.tensor(-10.0)).item()}
    assert "true_prior_mass_init" not in result["final"]          # no hand-made open / closed
    assert len(result["final"]["bias_by_distance_init"]) == 16


def test_a_vit_learns_its_prior_and_is_measured_against_the_impulse(tmp_path):
    images = write_image_tree(str(tmp_path / "images"), SHAPES[:3], 8, 8, "L")
    common = ["--task", "images", "--data-dir", images, *TINY_VIT]
    assert train.main([*common, "--init", "default", "--out", str(tmp_path / "src")]) == 0
    assert train.main([*common, "--init", "mask-fixed", "--mask-from", str(tmp_path / "src"),
                       "--out", str(tmp_path / "run")]) == 0
    final = result_of(tmp_path / "run")["final"]
    before = torch.load(tmp_path / "run" / "attention_before.pt", weights_only=True)
    impulse = maskprior.impulse_mask(1, 2, 2)                                 # (1, 2, 5, 5)
    assert final["true_prior_mass_init"] == pytest.approx(
        maskprior.prior_stats(before["attn"], impulse)[0].mean().item())
    after = torch.load(tmp_path / "run" / "attention_after.pt", weights_only=True)
    assert torch.equal(after["bias"], before["bias"])                           # mask-fixed


# ------------------------------------------------------------------------------------------
# Names, table cells and the figure
# ------------------------------------------------------------------------------------------

def test_run_names_and_the_inits_with_a_mask_prior():
    def folder(*flags):
        args = train.build_parser().parse_args(list(flags))
        settings = {key: (getattr(args, key) or [None])[0] for key in train.SWEEPS}
        return train.folder_name(args.task[0], args.init[0], args.seed, settings, args)
    assert folder("--task", "addition", "--train-frac", "0.001", "--mask-from", "runs/src",
                  "--mask-threshold", "0.5") == "addition-mask-seed0-frac0.001-from-src-tau0.5"
    assert folder("--task", "lm", "--seed", "1", "--mask-from", "src") == "lm-mask-seed1-from-src-tau1"
    assert folder("--task", "addition", "--train-frac", "0.001") == "addition-mask-seed0-frac0.001"
    assert set(train.MASK_PRIOR_INITS) == {"mask", "mask-fixed", "mask-hadamard"}


def test_the_figure_draws_learned_priors_beside_the_hand_made_one(source, tmp_path):
    """figures/learned_prior.svg: `--figure bias` of a folder holding a hand-made and a learned prior's run
    draws each prior before and after training, its label naming the run it was learned from."""
    hand, ours = tmp_path / "runs" / "hand", tmp_path / "runs" / "learned"
    args = ["--task", "addition", "--init", "mask", "--train-frac", "0.001", *TINY]
    assert train.main([*args, "--out", str(hand)]) == 0
    assert train.main([*args, "--mask-from", str(source), "--out", str(ours)]) == 0
    out = tmp_path / "learned_prior.svg"
    assert train.main(["--summarize", str(tmp_path / "runs"), "--figure", "bias", str(out)]) == 0
    svg = ET.parse(out).getroot()
    titles = [t.text.split(": prior mass")[0] for t in svg.iter(f"{SVG}text") if t.get("font-size") == "13"]
    learned = f"addition mask train frac 0.001 mask from {os.path.basename(source)}, τ 1"
    assert titles == [f"{label}, {when}" for label in ("addition mask train frac 0.001", learned)
                      for when in ("before training", "after training", "after - before")]
    images = [i.get("href") for i in svg.iter(f"{SVG}image")]
    assert len(images) == 6 and images[0] != images[3]                  # the two priors differ
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert "layer 2" in texts and "head 4" in texts
