"""Imperfect priors (Appendix "Why Not Just Fix the Mask?"): maskprior.edit_pattern edits the
fraction its kind says and nothing else, train.py's --mask-error / --mask-lr reach the prior and
M's optimizer group, and the true prior mass is measured on the exact pattern."""
import argparse
import math
import xml.etree.ElementTree as ET

import pytest
import torch
from hypothesis import given, settings, strategies as st

import maskprior
import tasks
import train
from helpers import BOOLEAN_TINY as TINY, experiment, result_of

# (pattern, whether position 0 is the CLS token): every Boolean and arithmetic prior
PATTERNS = {**{t: (maskprior.boolean_mask(t, 4, 3), True) for t in maskprior.BOOLEAN_MASKS},
            **{t: (f(2, 4), False) for t, f in maskprior.ARITHMETIC_MASKS.items()}}
N_SVG = "{http://www.w3.org/2000/svg}"


def edit_count(fraction, n):
    """How many of n entries an edit of fraction p (0 < p <= 1) touches: p n rounded half up, but
    at least one of n > 0 (a non-zero fraction always edits something)."""
    if n == 0:
        return 0
    return min(n, max(1, int(fraction * n + 0.5)))


def parts(n, cls_row):
    """The off-diagonal (N, N) entries edit_pattern edits, split into its parts: CLS row, rest."""
    off = ~torch.eye(n, dtype=torch.bool)
    first = torch.zeros(n, n, dtype=torch.bool)
    first[0] = cls_row
    return [off & first, off & ~first]


@settings(deadline=None, max_examples=40, derandomize=True)
@given(task=st.sampled_from(sorted(PATTERNS)), kind=st.sampled_from(maskprior.EDIT_KINDS),
       fraction=st.sampled_from([0.1, 0.25, 0.5, 1.0]), seed=st.integers(0, 2 ** 16))
def test_each_kind_edits_the_fraction_it_says_and_nothing_else(task, kind, fraction, seed):
    """Per (layer, head) matrix and part: extra opens edit_count(p, #closed) closed entries,
    missing closes edit_count(p, #open) open ones, moved closes k = min(edit_count(p, #open),
    #closed) and opens k; the diagonal, the two values and every other entry stay."""
    pattern, cls_row = PATTERNS[task]
    edited = maskprior.edit_pattern(pattern, kind, fraction, seed, cls_row)
    assert edited.shape == pattern.shape
    assert ((edited == pattern) | (edited == -pattern)).all()          # only negations (open <-> closed)
    n = pattern.shape[-1]
    diagonal = torch.eye(n, dtype=torch.bool)
    assert torch.equal(edited[..., diagonal], pattern[..., diagonal])   # every token sees itself
    for before, after in zip(pattern.flatten(0, 1), edited.flatten(0, 1)):
        for part in parts(n, cls_row):
            was_open, is_open = part & (before > 0), part & (after > 0)
            n_open, n_closed = int(was_open.sum()), int((part & (before < 0)).sum())
            opened, closed = int((is_open & ~was_open).sum()), int((was_open & ~is_open).sum())
            k = edit_count(fraction, n_closed if kind == "extra" else n_open)
            expected = {"extra": (k, 0), "missing": (0, k),
                        "moved": (min(k, n_closed), min(k, n_closed))}[kind]
            assert (opened, closed) == expected, (part[0].any().item(), n_open, n_closed)


def one_matrix_with_open_entries(n_open, n=20):
    """(1, 1, N, N) logits: the diagonal and n_open off-diagonal entries of row 1 on (keys 2, 3, ...)
    OPEN, the rest CLOSED."""
    pattern = torch.full((1, 1, n, n), maskprior.CLOSE)
    pattern[0, 0].diagonal().fill_(maskprior.OPEN)
    pattern[0, 0, 1, 2:2 + n_open] = maskprior.OPEN
    return pattern


@pytest.mark.parametrize("fraction, n_open, closed", [
    (0.25, 2, 1), (0.25, 6, 2), (0.1, 15, 2), (0.1, 4, 1), (0.5, 0, 0), (1.0, 7, 7), (0.5, 5, 3)])
def test_an_edit_rounds_half_up_and_edits_at_least_one_entry(fraction, n_open, closed):
    """missing closes p n of the n open off-diagonal entries, rounded half up (0.5 x 5 -> 3), and
    at least one (0.1 x 4 -> 1); nothing else changes."""
    pattern = one_matrix_with_open_entries(n_open)
    edited = maskprior.edit_pattern(pattern, "missing", fraction, seed=0)
    assert int(((pattern > 0) & (edited < 0)).sum()) == closed
    assert not ((pattern < 0) & (edited > 0)).any()


def test_an_edit_of_a_fraction_outside_0_1_or_of_an_unknown_kind_raises():
    pattern = one_matrix_with_open_entries(4)
    for kind, fraction in (("missing", 0.0), ("missing", 1.5), ("missing", math.nan), ("shifted", 0.5)):
        with pytest.raises(ValueError, match="0 < fraction <= 1"):
            maskprior.edit_pattern(pattern, kind, fraction, seed=0)


def test_the_cls_row_and_the_same_edit_in_every_layer_and_head():
    """2parity keeps CLS closed: missing and moved leave its row alone; majority's prior is its CLS
    row, which moved keeps at three keys, none of them x0, x1, x2 at p = 1. Equal patterns (all
    layers and heads of 2parity) get equal edits; a larger fraction's edit contains a smaller's."""
    parity, majority = PATTERNS["2parity"][0], PATTERNS["majority"][0]
    for kind in ("missing", "moved"):
        edited = maskprior.edit_pattern(parity, kind, 1.0, 3, cls_row=True)
        assert torch.equal(edited[..., 0, :], parity[..., 0, :])
        assert (edited == edited[0, 0]).all()
    moved = maskprior.edit_pattern(majority, "moved", 1.0, 3, cls_row=True)
    assert ((moved[..., 0, 1:] > 0).sum(-1) == 3).all() and (moved[..., 0, 1:4] < 0).all()
    small, large = (maskprior.edit_pattern(parity, "extra", p, 5, cls_row=True) > 0
                    for p in (0.1, 0.5))
    assert (large | ~small).all() and large.sum() > small.sum()


def test_same_seed_same_edit_other_seed_another_edit():
    pattern = PATTERNS["threesym"][0]
    first = maskprior.edit_pattern(pattern, "moved", 1.0, 0, cls_row=True)
    assert torch.equal(first, maskprior.edit_pattern(pattern, "moved", 1.0, 0, cls_row=True))
    assert not torch.equal(first, maskprior.edit_pattern(pattern, "moved", 1.0, 1, cls_row=True))


def test_mask_edit_takes_kind_and_fraction_or_none():
    """--mask-error's argparse type: 'none' -> None (the exact prior), KIND:P -> 'kind:p'."""
    assert train.mask_edit("moved:1") == "moved:1.0" and train.mask_edit("none") is None
    assert train.mask_edit("extra:0.25") == "extra:0.25"
    for bad in ("wrong:0.5", "moved:1.5", "moved:0", "moved", "extra:nan", "missing:-0.1"):
        with pytest.raises(argparse.ArgumentTypeError, match="KIND:FRACTION"):
            train.mask_edit(bad)


def tiny_experiment(init, *flags):
    return experiment("--task", "2parity", "--init", init, *TINY, *flags)


def test_mask_lr_reaches_the_mask_group_only():
    exp = tiny_experiment("mask", "--mask-lr", "0.03")
    masks = {id(p) for name, p in exp.model.named_parameters() if name.endswith("mask")}
    assert masks
    for group in exp.optimizer.param_groups:
        in_mask = {id(p) in masks for p in group["params"]}
        assert len(in_mask) == 1                                     # M never shares a group
        assert group["initial_lr"] == (0.03 if in_mask == {True} else 1e-3)
    fixed = tiny_experiment("mask-fixed")
    assert {g["initial_lr"] for g in fixed.optimizer.param_groups} == {1e-3}
    default = tiny_experiment("mask")                                  # no --mask-lr: the model's lr
    assert {g["initial_lr"] for g in default.optimizer.param_groups} == {1e-3}


def test_an_older_checkpoint_without_the_new_keys_still_resumes(tmp_path):
    """Runs without --mask-error / --mask-lr record None, which equals a missing key."""
    path = tmp_path / "checkpoint.pt"
    meta = {"task": "2parity", "config": {"lr": 1e-3}}
    torch.save({"meta": meta, "model": {}, "state": {}}, path)
    ours = {"task": "2parity", "config": {"lr": 1e-3, "mask_error": None, "mask_lr": None}}
    assert train.load_checkpoint(str(path), ours)["meta"] == meta


def test_grid_over_errors_and_mask_lr_records_them_and_draws_the_figure(tmp_path):
    """--mask-error none moved:1.0 --mask-lr 0.03 with mask and mask-fixed: four runs (mask-fixed
    once per error, no mask lr); the exact prior's true mass is its prior mass, the moved
    prior's is lower; table.md keys the rows by error and lr; imperfect_prior.svg has a line
    per init in each panel, 2 points each."""
    assert train.main(["--task", "2parity", "--init", "mask", "mask-fixed", "--mask-error", "none",
                       "moved:1.0", "--mask-lr", "0.03", "--out", str(tmp_path), *TINY]) == 0
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert folders == ["2parity-mask-fixed-seed0", "2parity-mask-fixed-seed0-err-moved1",
                       "2parity-mask-seed0-err-moved1-mlr0.03", "2parity-mask-seed0-mlr0.03"]
    for name in folders:
        config, final = result_of(tmp_path / name)["config"], result_of(tmp_path / name)["final"]
        assert config["mask_error"] == ("moved:1.0" if "err" in name else None)
        assert config["mask_lr"] == (0.03 if "mlr" in name else None)
        for when in ("init", "final"):
            if "err" in name:
                assert final[f"true_prior_mass_{when}"] < final[f"prior_mass_{when}"]
            else:
                assert final[f"true_prior_mass_{when}"] == final[f"prior_mass_{when}"]
    table = (tmp_path / "table.md").read_text()
    assert "| task | init | mask error | mask lr | seeds |" in table and "true prior mass final" in table
    rows = [line.split(" | ")[1:4] for line in table.split("## Persistence")[0].splitlines()
            if line.startswith("| 2parity")]
    assert rows == [["mask", "none", "0.03"], ["mask-fixed", "none", "—"],
                    ["mask", "moved:1.0", "0.03"], ["mask-fixed", "moved:1.0", "—"]]
    svg = ET.fromstring((tmp_path / "imperfect_prior.svg").read_text())
    lines = svg.findall(f".//{N_SVG}polyline")
    assert len(lines) == 2 + 3                  # accuracy: mask, mask-fixed; mass: + at init
    assert all(len(line.get("points").split()) == 2 for line in lines)
    labels = [t.text for t in svg.iter(f"{N_SVG}text")]
    assert {"test acc (%)", "true prior mass final", "mask error", "none", "moved:1.0", "mask, mask lr 0.03 (1 seed)",
            "mask-fixed, mask lr — (1 seed)", "at init (1 seed)"} <= set(labels)


def test_the_figure_marks_every_value_and_breaks_a_line_where_an_edit_is_missing():
    """imperfect_prior.svg of one seed a cell: mask at the four edits, mask-fixed without "extra".
    Every value gets a dot; mask-fixed's line stops at "none" and starts again at "missing", never
    joining "none" to "missing" across the edit it lacks; the legend says each line is one seed."""
    edits = [None, "extra:0.5", "missing:1.0", "moved:1.0"]
    def run(init, error, accuracy):
        return {"task": "majority", "init": init, "seed": 0, "status": "done",
                "config": {"mask_error": error, "mask_magnitude": 10.0, "mask_decay": 0.0},
                "final": {"test_acc": accuracy, "true_prior_mass_init": 0.9, "true_prior_mass_final": 0.8}}
    results = [run("mask", error, 100.0 - 10 * i) for i, error in enumerate(edits)]
    results += [run("mask-fixed", error, 90.0 - 10 * i) for i, error in enumerate(edits) if error != "extra:0.5"]
    svg = ET.fromstring(tasks.result_tables(results, list(train.INITS))[1]["imperfect_prior.svg"])
    accuracy = svg.findall(f"{N_SVG}g")[0]                      # the first panel: test acc
    lines = [(l.find(f"{N_SVG}title").text, len(l.get("points").split())) for l in accuracy.iter(f"{N_SVG}polyline")]
    assert lines == [("mask", 4), ("mask-fixed", 1), ("mask-fixed", 2)]
    assert len(accuracy.findall(f"{N_SVG}circle")) == 4 + 3
    ticks = [t.text for t in accuracy.iter(f"{N_SVG}text") if t.text in ("none", *edits[1:])]
    assert ticks == ["none", "extra:0.5", "missing:1.0", "moved:1.0"]
    texts = {t.text for t in svg.iter(f"{N_SVG}text")}
    assert {"mask (1 seed)", "mask-fixed (1 seed)", "at init (1 seed)"} <= texts


def test_the_command_line_records_the_error_and_the_mask_lr(tmp_path, run_cli):
    proc = run_cli("--task", "2parity", "--init", "mask", "--mask-error", "moved:1.0", "--mask-lr",
                   "0.03", "--seed", "0", "--threads", "1", "--out", str(tmp_path), *TINY)
    assert proc.returncode == 0, proc.stderr
    result = result_of(tmp_path)
    assert (result["config"]["mask_error"], result["config"]["mask_lr"]) == ("moved:1.0", 0.03)
    assert result["final"]["true_prior_mass_init"] < result["final"]["prior_mass_init"]
    assert "2parity/mask/seed0 (mask error moved:1.0, mask lr 0.03): train loss " in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--mask-error", "wrong:0.5"], "argument --mask-error: expected 'none' or KIND:FRACTION"),
    (["--mask-error", "moved:1.5"], "got 'moved:1.5'"),
    (["--mask-lr", "-1"], "argument --mask-lr: must be a number > 0, got '-1'"),
    (["--mask-lr", "0"], "argument --mask-lr: must be a number > 0, got '0'"),
    (["--mask-error", "moved:1", "--init", "mask", "default"], "--mask-error edits the mask prior"),
    (["--mask-error", "moved:1", "--task", "lm"], "--mask-error applies to boolean and arithmetic"),
    (["--mask-lr", "0.01", "--init", "mask-fixed"], "--mask-lr: --init mask-fixed has no trainable"),
])
def test_bad_mask_error_or_mask_lr_exits_2_with_one_line(args, message, capsys):
    assert train.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:") and message in lines[0], lines


def test_the_model_starts_from_the_edited_prior_and_measures_against_the_exact_one():
    exp = tiny_experiment("mask", "--mask-error", "moved:1.0")
    exact = maskprior.boolean_mask("2parity", 1, 2)
    assert torch.equal(exp.true_pattern, exact)
    assert torch.equal(exp.pattern, maskprior.edit_pattern(exact, "moved", 1.0, 0, cls_row=True))
    assert not torch.equal(exp.pattern, exact)
    exact_run = tiny_experiment("mask")                          # no --mask-error: the exact prior
    assert torch.equal(exact_run.pattern, exact) and torch.equal(exact_run.true_pattern, exact)
    masks = torch.stack([a.mask.detach() for a in maskprior.attention_modules(exp.model)])
    assert torch.equal(masks, exp.pattern)                     # A = 10: M is the pattern itself
