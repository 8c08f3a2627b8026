"""The `paper` presets are the paper's setup tables (Tables 7-12: "Training setup for Boolean tasks",
"Arithmetic task setup", "Experimental setup for CIFAR10 / CIFAR100 / ImageNet100", "NLP task setup"):
each value below is copied from the paper's table, and the config train.py plans for the task at
`--preset paper` must hold it. The rows the tables leave out (widths from aryol/GOTU, warmup starts
from osiriszjq/structured_initialization) are the README's and the presets' comments' business."""
import inspect
import os

import pytest

import maskprior
import tasks
import train
from helpers import experiment, runs_of

# Table 7 "Training setup for Boolean tasks": every task the same row.
BOOLEAN_TABLE = {"epochs": 90, "layers": 4, "heads": 3, "lr": 1e-3, "batch_size": 256, "optimizer": "adam"}

# Table 8 "Arithmetic task setup" (the model and training rows).
ARITHMETIC_TABLE = {"layers": 6, "heads": 4, "dim": 256, "mlp_dim": 256, "head_dim": 64, "optimizer": "adamw",
                    "lr": 1e-3, "weight_decay": 1e-3, "batch_size": 256, "epochs": 50}

# Tables 9 and 10 "Experimental setup for CIFAR10 / CIFAR100" (identical but for the classes).
CIFAR_TABLE = {"image_size": 224, "patch_size": 16, "layers": 12, "heads": 3, "dim": 192, "batch_size": 512,
               "epochs": 400, "optimizer": "adamw", "lr": 2e-3, "warmup_epochs": 50, "weight_decay": 0.05,
               "drop_path": 0.1, "label_smoothing": 0.1, "mixup": 0.8, "cutmix": 1.0, "randaugment": 9}

# Table 11 "Experimental setup for ImageNet100": base lr 1e-3 scaled linearly by batch / 512.
IMAGENET100_TABLE = {**CIFAR_TABLE, "epochs": 300, "lr": 1e-3 * 512 / 512, "lr_base_size": 512,
                     "warmup_epochs": 5, "cooldown_epochs": 10, "pool": "avg"}

# Table 12 "NLP task setup".
NLP_TABLE = {"layers": 12, "heads": 12, "dim": 512, "batch_size": 128, "block_size": 64, "lr": 3e-4,
             "optimizer": "adamw", "dropout": 0.2}


@pytest.mark.parametrize("task, table, seed", [
    *[(task, BOOLEAN_TABLE, 0) for task in tasks.BOOLEAN_TASKS],
    ("addition", {**ARITHMETIC_TABLE, "train_frac": 0.004}, 0),          # Table 2's header: 0.4 %
    ("multiplication", {**ARITHMETIC_TABLE, "train_frac": 0.03}, 0),     # and 3 %
    ("cifar10", CIFAR_TABLE, 0), ("cifar100", CIFAR_TABLE, 0), ("imagenet100", IMAGENET100_TABLE, 42),
    ("tinystories", {**NLP_TABLE, "iters": 5000}, 1337), ("wikitext2", {**NLP_TABLE, "iters": 3000}, 1337),
])
def test_the_paper_preset_is_the_papers_setup_table(task, table, seed):
    run = runs_of("--task", task, "--preset", "paper")[0]
    assert {key: run.config[key] for key in table} == table
    assert run.seed == seed                    # the tables' Seed row (0, ImageNet100 42, NLP 1337)


def test_the_priors_magnitudes_and_the_qk_solves_are_the_papers(monkeypatch):
    """Experiment Details: Boolean and vision masks open 10 / close -10; arithmetic open 5 / close -5,
    Structured (SVD) open 10000 / close 0, Structured (Opt) 2000 steps at lr 1e-4 (Table 8); the GPT's
    log sigmoid(s M) with s = 10 (Appendix "Wiki-text and Tiny-stories")."""
    assert (maskprior.OPEN, maskprior.CLOSE) == (10.0, -10.0)
    assert (maskprior.ARITHMETIC_OPEN, maskprior.ARITHMETIC_CLOSE) == (5.0, -5.0)
    assert maskprior.GPT_MASK_SCALE == 10.0
    assert {family: train.FAMILIES[family]["magnitude"] for family in train.FAMILIES} == {
        "boolean": 10.0, "arithmetic": 5.0, "language": 10.0, "vision": 10.0}
    opt = inspect.signature(maskprior.structured_opt_init_).parameters
    assert (opt["steps"].default, opt["lr"].default) == (2000, 1e-4)
    solves = []                                # what the arithmetic run hands the SVD solve
    real_solve = maskprior.structured_svd_init_
    monkeypatch.setattr(maskprior, "structured_svd_init_", lambda *a, **k: solves.append(k) or real_solve(*a, **k))
    experiment("--task", "addition", "--init", "structured-svd")
    assert (solves[0]["open_logit"], solves[0]["noise_scale"]) == (1e4, 0.0)


def test_the_nlp_splits_are_the_tables_story_counts():
    """Table 12: TinyStories trains on 12k stories and validates on 2k (WikiText-2: its own splits)."""
    defaults = inspect.signature(tasks.lm_dataset).parameters
    assert (defaults["train_stories"].default, defaults["val_stories"].default) == (12000, 2000)


def test_every_test_the_readmes_map_names_exists():
    """The README's map ("The paper, item by item") names, for each item of the paper, the test that checks
    it: `test_file.py::test_name`, `::test_name` for another test of the file named last, or a name ending
    in * for a family of tests. Each must be a test function of that file, so the map cannot point at a
    test that was renamed or removed."""
    import ast
    import re
    from helpers import ROOT
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    rows = readme.split("## The paper, item by item", 1)[1].split("\n## ", 1)[0]
    named, current = [], None
    for file, name in re.findall(r"`(test_\w+\.py)?::(test_\w+\*?)`", rows):
        current = file or current
        named.append((current, name))
    assert len(named) >= 20                    # the map names a test for most of its 30 rows
    for file, name in named:
        tree = ast.parse(open(os.path.join(ROOT, "tests", file), encoding="utf-8").read())
        tests = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]
        found = [t for t in tests if t == name or name.endswith("*") and t.startswith(name[:-1])]
        assert found, f"README's map names {file}::{name}, which {file} does not define"
