"""The README's figures (section "Figures"): `train.py --figure NAME FILE`, each kind drawn from the mask
constructors or from tiny runs (1 epoch), and checked against what it draws: the pattern's open entries in
yellow, each run's prior mass in its titles, the Boolean dots at the runs' numbers, a grid's own figures."""
import os
import re
import xml.etree.ElementTree as ET

import pytest
import torch

import maskprior
import tasks
import train
from helpers import BOOLEAN_TINY, result_of
from synthetic import SHAPES, write_image_tree

pytestmark = pytest.mark.usefixtures("one_thread")

YELLOW, PURPLE = [253, 231, 37], [68, 1, 84]          # viridis at the top and the bottom of a colour bar


def near(colour, target):
    """True when an entry's colour is target's within rounding of a value a hair off the bar's end."""
    return all(abs(a - b) <= 3 for a, b in zip(colour, target))


def entries(panel_png, rows, cols, n):
    """The colour at the centre of every entry of a heat-map block's PNG (tasks.heatmap_svg: cells of
    128 // n pixels, panels 4 pixels apart), (rows, cols, n, n, 3) as lists."""
    cell, pad = max(1, 128 // n), 4
    return [[[[panel_png[:, pad + r * (n * cell + pad) + i * cell + cell // 2,
                         pad + c * (n * cell + pad) + j * cell + cell // 2].tolist()
               for j in range(n)] for i in range(n)] for c in range(cols)] for r in range(rows)]


def as_colours(pattern):
    """A (rows, cols, n, n) Boolean pattern as the colours a block on the pattern's own range shows."""
    return [[[[YELLOW if v else PURPLE for v in row] for row in m] for m in layer] for layer in pattern.tolist()]


def draw(tmp_path, *args):
    """train.main(["--figure", ...]) into tmp_path / attention.svg (the name the attention_svg fixture reads):
    its exit code."""
    return train.main([*args[:-1], "--figure", args[-1], str(tmp_path / "attention.svg")])


def test_the_constructor_figures_draw_each_pattern_at_the_paper_shapes(tmp_path, attention_svg):
    """masks: every layer and head of each task's pattern at the `paper` presets' shapes, open in
    yellow; logits: the first layer on each task's own +-A; impulse: head h's 3 x 3 filter has its one at
    offset IMPULSE_ORDER[h] (Appendix "Visualization of Structure Initialization"), above its mask."""
    assert draw(tmp_path, "masks") == 0
    _, titles, panels = attention_svg(tmp_path)
    assert titles == [*maskprior.BOOLEAN_MASKS, *maskprior.ARITHMETIC_MASKS]
    for task in maskprior.BOOLEAN_MASKS:
        assert entries(panels[task], 4, 3, 16) == as_colours(maskprior.boolean_mask(task, 4, 3) > 0)
    for task, make in maskprior.ARITHMETIC_MASKS.items():
        pattern = make(6, 4) > 0
        assert entries(panels[task], 6, 4, pattern.shape[-1]) == as_colours(pattern)

    assert draw(tmp_path, "logits") == 0
    texts, titles, panels = attention_svg(tmp_path)
    assert titles == [f"{task}: M, layer 1" for task in [*maskprior.BOOLEAN_MASKS, *maskprior.ARITHMETIC_MASKS]]
    threesym = maskprior.boolean_mask("threesym", 1, 3) > 0
    assert entries(panels["threesym: M, layer 1"], 1, 3, 16) == as_colours(threesym)
    assert {"-10", "10", "-5", "5"} <= set(texts)          # the Boolean +-10, the arithmetic +-5 (Table 8)

    assert draw(tmp_path, "impulse") == 0
    _, titles, panels = attention_svg(tmp_path)
    filters = torch.zeros(1, 9, 3, 3, dtype=torch.bool)
    for head, k in enumerate(maskprior.IMPULSE_ORDER):
        filters[0, head, k // 3, k % 3] = True
    assert entries(panels[titles[0]], 1, 9, 3) == as_colours(filters)
    assert entries(panels[titles[1]], 1, 9, 17) == as_colours(maskprior.impulse_mask(1, 9, 4) > 0)


@pytest.fixture(scope="module")
def boolean_grid(tmp_path_factory):
    """A tiny majority grid of the default and the mask: its folder."""
    out = tmp_path_factory.mktemp("boolean")
    assert train.main(["--task", "majority", "--init", "default", "mask", "--out", str(out), *BOOLEAN_TINY]) == 0
    return out


def test_attention_and_bias_draw_each_run_before_and_after_with_its_prior_mass(boolean_grid, tmp_path,
                                                                              attention_svg):
    """attention: a band a run in INITS order, before | after | after - before, titled with result.json's
    prior mass; the mask run's maps as attention_*.pt holds them. bias: the mask run alone (the others have
    no M). --summarize with --figure leaves DIR's table.md as it was."""
    tables = (boolean_grid / "table.md").read_bytes()
    assert draw(tmp_path, "--summarize", str(boolean_grid), "attention") == 0
    _, titles, panels = attention_svg(tmp_path)
    expected = []
    for init in ("default", "mask"):
        final = result_of(boolean_grid / f"majority-{init}-seed0")["final"]
        expected += [f"majority {init}, before training: prior mass {tasks.fmt(final['prior_mass_init'], 2)}",
                     f"majority {init}, after training: prior mass {tasks.fmt(final['prior_mass_final'], 2)}",
                     f"majority {init}, after - before"]
    assert titles == expected
    # the mask run before training: each bit token sees only itself (yellow), never another bit (purple)
    mask_before = entries(panels[expected[3]], 1, 2, 16)
    assert all(near(mask_before[0][h][i][i], YELLOW) for h in range(2) for i in range(1, 16))
    assert all(near(mask_before[0][h][i][j], PURPLE) for h in range(2) for i in range(1, 16) for j in range(1, 16)
               if i != j)
    assert (boolean_grid / "table.md").read_bytes() == tables

    assert draw(tmp_path, "--summarize", str(boolean_grid), "bias") == 0
    _, titles, panels = attention_svg(tmp_path)
    assert [t.split(",")[0] for t in titles] == ["majority mask"] * 3
    open_entries = maskprior.boolean_mask("majority", 1, 2) > 0
    assert entries(panels[titles[0]], 1, 2, 16) == as_colours(open_entries)        # log sigmoid(M): 0 where open


def test_boolean_dots_stand_at_each_inits_test_loss_and_accuracy(boolean_grid, tmp_path):
    """boolean (Figure 3): a dot per init in two rows of panels, test loss over test accuracy; each
    accuracy dot at its height on the 0-100 axis (tasks.chart_panel: top 24, bottom 214 in a panel)."""
    assert draw(tmp_path, "--summarize", str(boolean_grid), "boolean") == 0
    svg = ET.parse(tmp_path / "attention.svg").getroot()
    groups = [g for g in svg.iter("{http://www.w3.org/2000/svg}g")]
    assert len(groups) == 2                                                          # loss, accuracy: majority
    texts = [t.text for t in groups[1].iter("{http://www.w3.org/2000/svg}text")]
    assert {"majority", "test acc (%)", "init", "default", "mask"} <= set(texts)
    dots = [float(c.get("cy")) for c in groups[1].iter("{http://www.w3.org/2000/svg}circle")]
    accuracies = [result_of(boolean_grid / f"majority-{init}-seed0")["final"]["test_acc"]
                  for init in ("default", "mask")]
    assert dots == pytest.approx([214 - a / 100 * 190 for a in accuracies], abs=0.06)


def test_a_grids_figures_are_the_ones_it_wrote(boolean_grid, tmp_path):
    """curves, data_efficiency (and mask_magnitude, imperfect_prior, by the same path): the file the grid
    wrote at its end, byte for byte, into FILE."""
    assert train.main(["--task", "addition", "--init", "mask", "--train-frac", "0.001", "0.002", "--layers", "1",
                       "--dim", "16", "--epochs", "1", "--eval-size", "200", "--threads", "1", "--no-progress",
                       "--out", str(tmp_path / "addition")]) == 0
    for name, grid in (("curves", boolean_grid), ("data_efficiency", tmp_path / "addition")):
        assert draw(tmp_path, "--summarize", str(grid), name) == 0
        assert (tmp_path / "attention.svg").read_text() == (grid / f"{name}.svg").read_text()


def test_centre_draws_a_vits_centre_patch_on_its_grid(boolean_grid, tmp_path, attention_svg, capsys):
    """centre (Figure 11): a ViT run's centre-patch attention on the 4 x 4 patch grid, before | after;
    a grid without a ViT has nothing to draw: exit 2, one line naming the figures."""
    data = write_image_tree(str(tmp_path / "images"), SHAPES[:2], 4, 32, "L")
    assert train.main(["--task", "images", "--data-dir", data, "--init", "mask", "--epochs", "1", "--dim", "16",
                       "--layers", "1", "--heads", "2", "--patch-size", "8", "--batch-size", "8", "--no-progress",
                       "--out", str(tmp_path / "vit")]) == 0
    assert draw(tmp_path, "--summarize", str(tmp_path / "vit"), "centre") == 0
    _, titles, panels = attention_svg(tmp_path)
    assert [t.split(":")[0] for t in titles] == ["images mask, before training", "images mask, after training",
                                                 "images mask, after - before"]
    assert panels[titles[1]].shape == (3, 4 + 128 + 4, 2 * (128 + 4) + 4)             # 1 layer, 2 heads
    assert draw(tmp_path, "--summarize", str(boolean_grid), "centre") == 2
    assert capsys.readouterr().err.startswith("train.py: error: --figure centre: nothing to draw; NAME: masks, ")
    # the centre patch (2, 2) before training: head 1 (identity) attends to itself, head 2 to the patch above
    before = entries(panels[titles[0]], 1, 2, 4)
    assert near(before[0][0][2][2], YELLOW) and near(before[0][1][1][2], YELLOW)
    assert near(before[0][0][0][0], PURPLE) and near(before[0][1][2][2], PURPLE)


def test_a_figure_with_nothing_to_draw_is_one_line_and_exit_2(tmp_path, capsys):
    assert draw(tmp_path, "nonsense") == 2
    assert draw(tmp_path, "attention") == 2                  # a run figure without --summarize DIR
    err = capsys.readouterr().err.splitlines()
    assert err == [f"train.py: error: --figure {name}: nothing to draw; NAME: {', '.join(train.FIGURES)} (--help)"
                   for name in ("nonsense", "attention")]
    assert not os.path.exists(tmp_path / "attention.svg")
    assert train.main(["--figure", "masks", str(tmp_path / "no" / "such" / "folder.svg")]) == 2
    assert capsys.readouterr().err.startswith("train.py: error: cannot write ")
    # a flag of what to train would be dropped: refused, as with --summarize
    assert train.main(["--figure", "masks", str(tmp_path / "attention.svg"), "--task", "addition"]) == 2
    assert capsys.readouterr().err == ("train.py: error: --figure takes no other flag (--task given): it draws the "
                                       "mask constructors' patterns\n")
    assert not os.path.exists(tmp_path / "attention.svg")
