"""Three-digit arithmetic (Section 5.2): the data against its definition, the digit-structure
masks against the roles they document, the metrics against hand counts, and the CLI run, sweep
and data-efficiency picture."""
import xml.etree.ElementTree as ET

import pytest
import torch
from hypothesis import given, settings, strategies as st

import maskprior
import tasks
import train
from helpers import result_of

TINY = ["--layers", "2", "--dim", "16", "--epochs", "1", "--eval-size", "500", "--threads", "1",
        "--no-progress"]


# ---- data --------------------------------------------------------------------------------------

def pair_ids(tokens):
    """The pair id 1000 a + b of each row of operand tokens (P, 6 + K), digits least significant first."""
    return sum(tokens[:, i] * 10 ** i for i in range(3)) * 1000 + sum(tokens[:, 3 + i] * 10 ** i for i in range(3))


@settings(deadline=None, max_examples=30)
@given(st.integers(0, 10 ** 6 - 1), st.sampled_from(list(tasks.ARITHMETIC_TASKS)))
def test_examples_spell_operands_and_answer_least_significant_first(pair, task):
    """Every pair is a row of the data set (train or held out, all of them evaluated): found by its id,
    its tokens and answer digits spelled as the layout says."""
    data = tasks.arithmetic_dataset(task, 0.004, seed=3, eval_size=None)
    tokens, answers = torch.cat([data["x_train"], data["x_eval"]]), torch.cat([data["y_train"], data["y_eval"]])
    k = tasks.ARITHMETIC_TASKS[task]
    assert tokens.shape == (10 ** 6, 6 + k) and answers.shape == (10 ** 6, k)
    row = (pair_ids(tokens) == pair).nonzero()[:, 0]
    assert len(row) == 1
    a, b = divmod(pair, 1000)
    value = a + b if task == "addition" else a * b
    row, answer = tokens[row[0]].tolist(), answers[row[0]].tolist()
    assert "".join(map(str, row[:3]))[::-1] == f"{a:03d}"
    assert "".join(map(str, row[3:6]))[::-1] == f"{b:03d}"
    assert row[6:] == [tasks.PLACEHOLDER] * k
    assert "".join(map(str, answer))[::-1] == f"{value:0{k}d}"


def test_every_answer_is_its_pairs_sum_or_product():
    for task in tasks.ARITHMETIC_TASKS:
        data = tasks.arithmetic_dataset(task, 0.004, seed=3, eval_size=None)
        for x, y in ((data["x_train"], data["y_train"]), (data["x_eval"], data["y_eval"])):
            a, b = pair_ids(x) // 1000, pair_ids(x) % 1000
            value = sum(y[:, i] * 10 ** i for i in range(y.shape[1]))
            assert torch.equal(value, a + b if task == "addition" else a * b)
            assert (x[:, 6:] == tasks.PLACEHOLDER).all()


def test_split_is_seeded_disjoint_and_complete():
    data = tasks.arithmetic_dataset("addition", 0.004, seed=3, eval_size=None)
    train_ids, held_out = pair_ids(data["x_train"]), pair_ids(data["x_eval"])
    assert len(train_ids) == 4000 and len(held_out) == 996_000 == data["held_out_pairs"] == data["eval_pairs"]
    assert torch.cat([train_ids, held_out]).sort().values.equal(torch.arange(10 ** 6))
    again = tasks.arithmetic_dataset("addition", 0.004, seed=3, eval_size=1000)
    other = tasks.arithmetic_dataset("addition", 0.004, seed=4, eval_size=1000)
    assert again["x_train"].equal(data["x_train"]) and not other["x_train"].equal(data["x_train"])
    assert again["y_train"].equal(data["y_train"])
    with pytest.raises(ValueError, match="train_frac must lie in"):
        tasks.arithmetic_dataset("addition", 1.0, seed=3)


def test_evaluation_sample_is_fixed_and_held_out():
    data = tasks.arithmetic_dataset("addition", 0.01, seed=1, eval_size=5000)
    again = tasks.arithmetic_dataset("addition", 0.01, seed=1, eval_size=5000)
    assert data["x_eval"].shape == (5000, 10) and data["x_eval"].equal(again["x_eval"])
    assert data["held_out_pairs"] == 990_000 and data["eval_pairs"] == 5000
    assert not set(pair_ids(data["x_eval"]).tolist()) & set(pair_ids(data["x_train"]).tolist())
    every = tasks.arithmetic_dataset("addition", 0.5, seed=1, eval_size=None)
    assert every["eval_pairs"] == len(every["x_eval"]) == 500_000


def test_metrics_against_hand_counts():
    answers = torch.tensor([[1, 2], [3, 4], [5, 6]])
    predicted = torch.tensor([[1, 2], [3, 0], [0, 0]])        # 1 row right, 3 of 6 digits
    logits = torch.nn.functional.one_hot(predicted, 10).float() * 50
    m = tasks.arithmetic_metrics(logits, answers)
    assert m["seq_acc"] == pytest.approx(100 / 3) and m["digit_acc"] == pytest.approx(50)
    assert m["position_acc"] == pytest.approx([200 / 3, 100 / 3])
    assert m["test_loss"] == pytest.approx(50 * 3 / 6, rel=1e-4)   # each wrong digit costs 50


# ---- masks -------------------------------------------------------------------------------------

def opened(mask_row):
    """Positions a (H?) mask row opens."""
    return set(torch.nonzero(mask_row > 0).flatten().tolist())


A = lambda i: i
B = lambda j: 3 + j
C = lambda k: 6 + k


def test_addition_mask_roles():
    m = maskprior.mask_addition(depth=2, heads=4)
    assert m.shape == (2, 4, 10, 10) and set(m.unique().tolist()) == {-5.0, 5.0}
    assert m[0].equal(m[1])                                   # the same heads in every layer
    for h in range(4):
        for i in range(3):                                    # aligned operand digits, every head
            assert opened(m[0, h, A(i)]) == {A(i), B(i)} and opened(m[0, h, B(i)]) == {A(i), B(i)}
    for k in range(4):
        column = {A(k), B(k)} if k < 3 else set()
        below = {A(k - 1), B(k - 1), C(k - 1)} if k else set()
        assert opened(m[0, 0, C(k)]) == {C(k)} | column
        assert opened(m[0, 1, C(k)]) == {C(k)} | below
        assert opened(m[0, 2, C(k)]) == {C(k)} | {p for j in range(k) for p in (A(j), B(j))}
        assert opened(m[0, 3, C(k)]) == opened(m[0, 0, C(k)])


def test_multiplication_mask_routes_each_partial_product_to_its_column():
    m = maskprior.mask_multiplication(depth=1, heads=8)       # roles repeat: head h = role h % 4
    assert m.shape == (1, 8, 12, 12) and m[0, :4].equal(m[0, 4:])
    for i in range(3):
        assert opened(m[0, 0, A(i)]) == {A(i), B(0), B(1), B(2)}
    lands_on = {k: [] for k in range(6)}
    for i in range(3):
        for j in range(3):
            lands_on[i + j].append((i, j))
    for k in range(6):
        products = {p for i, j in lands_on[k] for p in (A(i), B(j))}
        assert opened(m[0, 0, C(k)]) == {C(k)} | products
        carry = {p for i, j in lands_on.get(k - 1, []) for p in (A(i), B(j))}
        assert opened(m[0, 1, C(k)]) == {C(k)} | carry | ({C(k - 1)} if k else set())
        assert opened(m[0, 3, C(k)]) == {C(j) for j in range(k + 1)}


@pytest.mark.parametrize("task", list(maskprior.ARITHMETIC_MASKS))
@pytest.mark.parametrize("init, floor", [("svd", 0.99), ("opt", 0.85)])
def test_qk_baselines_put_the_arithmetic_pattern_into_qk(task, init, floor, mass_on_pseudo_input):
    pattern = maskprior.ARITHMETIC_MASKS[task](2, 4)
    n = pattern.shape[-1]

    def model():
        torch.manual_seed(0)
        return maskprior.Transformer(11, n, 64, 2, 4, 64, 10, mode="none", cls_token=False,
                                     readout="tokens")
    generator = torch.Generator().manual_seed(0)
    if init == "svd":  # open 10000, close 0: Table "Arithmetic task setup"
        qk = maskprior.structured_svd_init_(model(), pattern, 1e4, 0.0, generator=generator)
    else:
        qk = maskprior.structured_opt_init_(model(), pattern, generator=generator)
    # measured at width 64, heads of 16: SVD 1.00, Opt 0.92-0.93 (0.98-0.99 at the cpu width 128),
    # default 0.24-0.35
    assert mass_on_pseudo_input(qk, pattern).min() > floor
    assert mass_on_pseudo_input(model(), pattern).max() < 0.5


# ---- the CLI -----------------------------------------------------------------------------------

@pytest.mark.parametrize("init", ["default", "mask", "structured-svd", "structured-opt"])
def test_cli_run_writes_the_table_fields(tmp_path, init, run_cli, attention_svg):
    out = tmp_path / "run"
    proc = run_cli("--task", "addition", "--init", init, "--train-frac", "0.001", "--out",
                   str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    result = result_of(out)
    final = result["final"]
    assert result["status"] == "done" and result["train_pairs"] == 1000
    assert result["eval_pairs"] == 500 and result["config"]["train_frac"] == 0.001
    assert 0 <= final["seq_acc"] <= final["digit_acc"] <= 100 and final["test_loss"] > 0
    assert len(final["position_acc"]) == 4
    for key in ("prior_mass_init", "prior_mass_final", "pattern_corr_init", "pattern_corr_final"):
        assert 0 <= final[key] <= 1 or key.startswith("pattern_corr")
    assert len(final["prior_mass_init_per_head"]) == 2          # layers
    texts, titles, _ = attention_svg(out)
    assert "mean attention, after training" in titles and "layer 2" in texts
    assert ("mask bias log σ(s M), after training" in titles) == (init == "mask")
    assert not any("CLS" in t for t in texts)                   # arithmetic has no CLS token
    assert (final["mask_drift"] is None) == (init != "mask")
    # the prior is in place at init on real inputs: measured at this tiny width, default 0.24,
    # structured-svd 0.52, mask 0.97. structured-opt's fit to the pseudo-input shows only weakly on
    # real inputs (0.28 here, 0.45 at the cpu width; README "Arithmetic"), so it is not checked.
    if init != "structured-opt":
        assert (final["prior_mass_init"] > 0.45) == (init != "default")


def test_sweep_writes_the_data_efficiency_table_and_picture(tmp_path, run_cli):
    proc = run_cli("--task", "multiplication", "--init", "default", "mask", "--train-frac",
                   "0.001", "0.002", "--out", str(tmp_path), *TINY)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == [f"multiplication-{i}-seed0-frac{f}" for i in ("default", "mask")
                     for f in ("0.001", "0.002")]
    table = (tmp_path / "table.md").read_text()
    assert "## Arithmetic (Section 5.2)\n\n| task | train frac | init | seeds | seq acc (%) |" in table
    rows = [line.split(" | ")[:4] for line in table.split("## Persistence")[0].splitlines()
            if line.startswith("| multiplication")]
    assert rows == [["| multiplication", f, i, "1/1"] for f in ("0.001", "0.002")
                    for i in ("default", "mask")]
    svg = ET.parse(tmp_path / "data_efficiency.svg").getroot()
    lines = svg.findall(".//{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 and all(len(l.get("points").split()) == 2 for l in lines)


def test_each_data_efficiency_panel_spans_its_own_train_fractions():
    # the two panels of Figure "Test sequence accuracy under varying training fractions": addition
    # and multiplication are swept over different fractions, each panel's axis holds only its own,
    # in rising order, one evenly spaced slot each, and each line has a dot at each of its fractions
    curves = {"addition": {"default": [(0.001, 1.0), (0.01, 99.0)], "mask": [(0.001, 95.0), (0.01, 100.0)]},
              "multiplication": {"default": [(0.1, 40.0), (0.01, 0.0), (0.03, 1.0)]}}
    results = [{"task": task, "init": init, "seed": 0, "status": "done", "config": {"train_frac": x},
                "final": {"seq_acc": y}} for task, lines in curves.items() for init, pts in lines.items()
               for x, y in pts]
    svg = ET.fromstring(tasks.result_tables(results, ["default", "mask"])[1]["data_efficiency.svg"])
    ns = "{http://www.w3.org/2000/svg}"
    for panel, (task, lines) in zip(svg.findall(f"{ns}g"), curves.items()):
        fractions = sorted({x for pts in lines.values() for x, _ in pts})
        ticks = [t.text for t in panel.findall(f"{ns}text") if t.text in {"0.001", "0.01", "0.03", "0.1"}]
        assert ticks == [f"{x:g}" for x in fractions], task
        # the axes, d="M<left>,<top>V<bottom>H<right>": the i-th fraction in the middle of the i-th slot
        axis = next(p.get("d") for p in panel.findall(f"{ns}path") if p.get("stroke") == "black")
        left, right = float(axis[1:].split(",")[0]), float(axis.split("H")[1])
        slots = [left + (i + 0.5) * (right - left) / len(fractions) for i in range(len(fractions))]
        for line in panel.findall(f"{ns}polyline"):
            xs = [float(p.split(",")[0]) for p in line.get("points").split()]
            assert xs == pytest.approx(slots, abs=0.05), task     # pixels to 0.1
        dots = sorted({float(c.get("cx")) for c in panel.findall(f"{ns}circle")})
        assert dots == pytest.approx(slots, abs=0.05), task


@pytest.mark.parametrize("args, message", [
    (["--task", "addition", "--train-frac", "1.5"], "must lie strictly between 0 and 1"),
    (["--task", "addition", "--eval-size", "0"], "--eval-size"),
    (["--task", "majority", "--train-frac", "0.01"], "--train-frac applies to arithmetic tasks only"),
    (["--task", "addition", "--iters", "5"], "--iters applies to language tasks only"),
    (["--task", "addition", "lm"], "cannot share one grid"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    assert train.main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
