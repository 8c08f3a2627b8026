"""A user's own data: --task images (an ImageFolder tree, two layouts) and --task text (train.txt,
valid.txt, test.txt), their bad-data errors (exit 2, one line), and curves.svg, the training
curves that --summarize and a grid write next to table.md."""
import math
import os
import re
import xml.etree.ElementTree as ET

import pytest
from PIL import Image
from hypothesis import given, settings, strategies as st

import tasks
import train
from helpers import experiment, one_line, random_bytes, result_of
from synthetic import SHAPES, write_image_tree, write_text_files, write_tiny_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

# A ViT on 8 x 8 images in 4 x 4 patches (4 patches + CLS), width 12, 1 layer, 2 heads; a GPT of
# width 16 on blocks of 16 bytes. Each run takes about a second on one core.
TINY_VIT = ["--image-size", "8", "--patch-size", "4", "--dim", "12", "--layers", "1", "--heads", "2",
            "--batch-size", "8", "--epochs", "1", "--no-progress"]
TINY_GPT = ["--iters", "20", "--eval-every", "10", "--dim", "16", "--layers", "1", "--heads", "2",
            "--block-size", "16", "--batch-size", "4", "--no-progress"]
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def grey_split(tmp_path_factory):
    """Grey 16 x 16 PNGs of 3 shapes: train/<shape>/ 8 each, val/<shape>/ 3 each."""
    return write_image_tree(str(tmp_path_factory.mktemp("grey")), SHAPES[:3], 8, 16, "L")


@pytest.fixture(scope="module")
def colour_folder(tmp_path_factory):
    """Colour 20 x 20 PNGs of 4 shapes in one folder, <shape>/ 10 each (1 held out per class)."""
    return write_image_tree(str(tmp_path_factory.mktemp("colour")), SHAPES[3:7], 10, 20, "RGB",
                            layout="one folder")


# ------------------------------------------------------------------------------------------
# --task images
# ------------------------------------------------------------------------------------------

def test_images_grid_on_grey_split_layout_writes_top1_and_curves(grey_split, tmp_path):
    """Two inits on train/ + val/: each result names the task images, has final.top1, and the
    tree's classes and channels; the grid's curves.svg (and --summarize's) has both inits."""
    args = ["--task", "images", "--data-dir", grey_split, "--init", "default", "mask", *TINY_VIT]
    assert train.main([*args, "--out", str(tmp_path)]) == 0
    for init in ("default", "mask"):
        result = result_of(tmp_path / f"images-{init}-seed0")
        assert result["task"] == "images" and 0 <= result["final"]["top1"] <= 100
        data = result["data"]
        assert data["classes"] == list(SHAPES[:3]) and data["channels"] == 1
        assert (data["train_images"], data["eval_images"], data["split_seed"]) == (24, 9, None)
        assert data["eval_folder"] == os.path.join(grey_split, "val")
        assert data["source_size_min"] == data["source_size_max"] == [16, 16]
    assert result["config"]["epochs"] == 1 and result["config"]["crop_scale"] == 0.35
    assert inits_drawn(tmp_path / "curves.svg") == {"default", "mask"}
    os.remove(tmp_path / "curves.svg")
    assert train.main(["--summarize", str(tmp_path)]) == 0
    assert inits_drawn(tmp_path / "curves.svg") == {"default", "mask"}


def test_images_one_folder_layout_colour_run(colour_folder, tmp_path):
    assert train.main(["--task", "images", "--data-dir", colour_folder, "--init", "mask", *TINY_VIT,
                       "--out", str(tmp_path)]) == 0
    result = result_of(tmp_path)
    assert 0 <= result["final"]["top1"] <= 100 and result["data"]["channels"] == 3
    assert (result["data"]["train_images"], result["data"]["eval_images"]) == (36, 4)


def test_vit_takes_the_trees_channels_and_classes(grey_split, colour_folder):
    for folder, channels, classes in ((grey_split, 1, 3), (colour_folder, 3, 4)):
        data = tasks.vision_dataset("images", folder, 8)
        image, label = data["train"][0]
        assert image.shape == (channels, 8, 8) and data["test"][0][0].shape == (channels, 8, 8)
        exp = experiment("--task", "images", *TINY_VIT, "--data-dir", str(folder), data=data)
        assert exp.model.patch_embed.in_channels == channels
        assert exp.model.head.out_features == classes == data["classes"]
        assert exp.info["data"]["channels"] == channels


def test_one_folder_split_holds_out_a_tenth_of_each_class_with_a_fixed_seed(tmp_path):
    """Classes of 2, 9, 15 and 30 images: round(10 %) held out, at least one; train and held-out
    disjoint and together every file; the same split on every call (it has no run seed)."""
    for shape, count in zip(SHAPES, (2, 9, 15, 30)):
        write_image_tree(str(tmp_path), (shape,), count, 8, "L", layout="one folder")
    data = tasks.vision_dataset("images", str(tmp_path), 8)
    again = tasks.vision_dataset("images", str(tmp_path), 8)
    assert data["train"].samples == again["train"].samples and data["test"].samples == again["test"].samples
    assert data["info"]["data"]["split_seed"] == tasks.IMAGE_SPLIT_SEED
    assert data["train"].classes == sorted(SHAPES[:4])                 # labels: sorted names
    for shape, count in zip(SHAPES, (2, 9, 15, 30)):
        label = data["train"].classes.index(shape)
        train_files = {p for p, y in data["train"].samples if y == label}
        held = {p for p, y in data["test"].samples if y == label}
        assert len(held) == max(1, round(0.1 * count)) and not train_files & held
        folder = tmp_path / shape
        assert train_files | held == {str(folder / f) for f in os.listdir(folder)}


def test_mixed_grey_and_colour_images_are_read_as_colour(tmp_path):
    """A grey class beside RGBA and palette images: 3 channels, every image (3, S, S)."""
    write_image_tree(str(tmp_path), SHAPES[:2], 3, 8, "L", layout="one folder")
    for n, mode in enumerate(("RGBA", "P", "RGB")):
        Image.new(mode, (8, 12)).save(tmp_path / SHAPES[1] / f"extra{n}.png")
    data = tasks.vision_dataset("images", str(tmp_path), 8)
    assert data["channels"] == 3 and data["info"]["data"]["source_size_max"] == [8, 12]
    assert {data[split][i][0].shape for split in ("train", "test") for i in range(len(data[split]))} \
        == {(3, 8, 8)}


@pytest.mark.parametrize("eval_folder", ["validation", "test"])
def test_images_accepts_validation_or_test_for_val(eval_folder, tmp_path):
    write_image_tree(str(tmp_path), SHAPES[:2], 2, 8, "L", eval_per_class=1, eval_folder=eval_folder)
    data = tasks.vision_dataset("images", str(tmp_path), 8)
    assert len(data["train"]) == 4 and len(data["test"]) == 2
    assert data["info"]["data"]["eval_folder"] == str(tmp_path / eval_folder)


def test_links_back_into_the_tree_read_each_image_once_under_its_own_class(tmp_path):
    """A link in a class folder to the folder above it (`up -> ..`, which holds every class) and one
    to another class: each of the 16 training files is read once, labelled by the folder it is in."""
    root = write_image_tree(str(tmp_path), SHAPES[:2], 8, 8, "L", eval_per_class=2)
    os.symlink("..", os.path.join(root, "train", SHAPES[0], "up"))
    os.symlink(os.path.join("..", SHAPES[0]), os.path.join(root, "train", SHAPES[1], "sibling"))
    data = tasks.vision_dataset("images", root, 8)
    assert (data["info"]["data"]["train_images"], data["info"]["data"]["eval_images"]) == (16, 4)
    real = [(os.path.realpath(path), data["train"].classes[label]) for path, label in data["train"].samples]
    assert len({path for path, _ in real}) == 16
    assert all(os.path.basename(os.path.dirname(path)) == name for path, name in real)


def test_a_file_in_two_classes_is_refused_in_one_line(tmp_path, capsys):
    root = write_image_tree(str(tmp_path / "data"), SHAPES[:2], 3, 8, "L", eval_per_class=1)
    train_dir = os.path.join(root, "train")
    os.symlink(os.path.join(train_dir, SHAPES[0], "0.png"), os.path.join(train_dir, SHAPES[1], "9.png"))
    assert train.main(["--task", "images", "--data-dir", root, *TINY_VIT, "--out", str(tmp_path / "run")]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"train.py: error: images: {train_dir}/{SHAPES[1]}/9.png is in class {SHAPES[1]} and also in class "
        f"{SHAPES[0]} (as {train_dir}/{SHAPES[0]}/0.png): a file may be in one class only")
    assert not (tmp_path / "run").exists()


def break_images(kind, root):
    """A small tree with one fault; returns a piece of text the error line must hold."""
    if kind == "empty folder":
        os.makedirs(root / "train")
        os.makedirs(root / "val")
        return "holds no class folders"
    if kind == "class folder without images":
        write_image_tree(str(root), SHAPES[:2], 2, 8, "L", eval_per_class=1)
        os.remove(root / "val" / "disc" / "0.png")
        (root / "val" / "disc" / "notes.txt").write_text("not an image")
        return f"{root / 'val' / 'disc'} holds no image files"
    if kind == "one class":
        write_image_tree(str(root), SHAPES[:1], 3, 8, "L", layout="one folder")
        return "holds one class folder, disc/"
    if kind in ("corrupt image", "truncated image"):
        write_image_tree(str(root), SHAPES[:2], 2, 8, "L", eval_per_class=1)
        path = root / "train" / "ring" / "1.png"
        path.write_bytes(random_bytes(300) if kind == "corrupt image" else path.read_bytes()[:60])
        return f"{path} is not a readable image"
    if kind == "class missing from val":
        write_image_tree(str(root), SHAPES[:3], 2, 8, "L", eval_per_class=1)
        for name in os.listdir(root / "val" / "square"):
            os.remove(root / "val" / "square" / name)
        os.rmdir(root / "val" / "square")
        return f"class square has a folder in {root / 'train'} but not in {root / 'val'}"
    if kind == "train without val":
        write_image_tree(str(root / "train"), SHAPES[:2], 2, 8, "L", layout="one folder")
        return "has no evaluation folder beside it"
    write_image_tree(str(root), SHAPES[:2], 1, 8, "L", layout="one folder")   # one image a class
    return "holds one image; holding out 10 % of each class"


IMAGE_FAULTS = ["empty folder", "class folder without images", "one class", "corrupt image",
                "truncated image", "class missing from val", "train without val", "one image a class"]


@pytest.mark.parametrize("kind", IMAGE_FAULTS)
def test_bad_image_tree_is_exit_2_with_one_line(kind, tmp_path, capsys):
    expected = break_images(kind, tmp_path / "data")
    code = train.main(["--task", "images", "--data-dir", str(tmp_path / "data"), *TINY_VIT,
                       "--out", str(tmp_path / "run")])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith("train.py: error: images: ") and expected in line, line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------
# --task text
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("test_chars", [0, 1000])
def test_text_run_writes_val_ppl_and_says_whether_test_is_val(test_chars, tmp_path):
    write_text_files(str(tmp_path / "data"), 4000, 1000, test_chars)
    out = tmp_path / "run"
    assert train.main(["--task", "text", "--data-dir", str(tmp_path / "data"), "--init", "mask",
                       *TINY_GPT, "--out", str(out)]) == 0
    result = result_of(out)
    final, data = result["final"], result["data"]
    assert result["task"] == "text" and 1 < final["val_ppl"] < 256 and math.isfinite(final["val_ppl"])
    assert final["test_is_val"] == data["test_is_val"] == (test_chars == 0)
    assert data["tokenizer"] == "UTF-8 bytes" and data["tokens"]["val"] == 1000   # ASCII prose
    assert data["files"]["test"] == str(tmp_path / "data" / ("valid.txt" if not test_chars else "test.txt"))
    assert (final["test_ppl"] == final["val_ppl"]) == (test_chars == 0)


def test_text_with_bpe_file_uses_gpt2_tokens(tmp_path):
    write_text_files(str(tmp_path), 4000, 1000)
    data = tasks.lm_dataset("text", str(tmp_path), write_tiny_ranks(tmp_path / "ranks.tiktoken"))
    assert data["info"]["data"]["tokenizer"].startswith("GPT-2 BPE")
    assert data["vocab_size"] == tasks.GPT2_VOCAB and len(data["val"]) == 1000   # ranks of bytes only
    assert data["decode"](data["val"].tolist()) == (tmp_path / "valid.txt").read_text()


TEXT_FAULTS = {   # name -> (file to change, its new bytes or None to delete it, text of the error)
    "missing train.txt": ("train.txt", None, "expected {dir}/train.txt"),
    "missing valid.txt": ("valid.txt", None, "expected {dir}/valid.txt"),
    "empty file": ("valid.txt", b"", "{dir}/valid.txt is empty"),
    "white space only": ("train.txt", b" \n\n \n", "{dir}/train.txt is empty"),
    "binary file": ("train.txt", random_bytes(2000), "{dir}/train.txt cannot be read as UTF-8 text"),
    "latin-1 text": ("valid.txt", "caf\xe9 cr\xe8me ".encode("latin-1") * 20,
                     "{dir}/valid.txt cannot be read as UTF-8 text"),
    "NUL bytes": ("train.txt", b"\0\0\0 a\0" * 200, "{dir}/train.txt holds NUL bytes"),
    "UTF-16 text": ("test.txt", "a longer test split, in UTF-16 ".encode("utf-16-le") * 4,
                    "{dir}/test.txt holds NUL bytes"),
    "valid.txt shorter than a block": ("valid.txt", b"twelve bytes", "needs more tokens than "
                                       "{dir}/valid.txt holds (12): choose a block size below 11"),
}


@pytest.mark.parametrize("kind", list(TEXT_FAULTS))
def test_bad_text_is_exit_2_with_one_line(kind, tmp_path, capsys):
    folder = tmp_path / "data"
    write_text_files(str(folder), 4000, 1000, 1000)
    name, content, expected = TEXT_FAULTS[kind]
    if content is None:
        os.remove(folder / name)
    else:
        (folder / name).write_bytes(content)
    code = train.main(["--task", "text", "--data-dir", str(folder), *TINY_GPT, "--out", str(tmp_path / "run")])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith("train.py: error: ") and expected.format(dir=folder) in line, line
    assert not (tmp_path / "run").exists()


def test_help_names_both_own_data_tasks_with_their_layout(capsys):
    with pytest.raises(SystemExit):
        train.build_parser().parse_args(["--help"])
    lines = capsys.readouterr().out.splitlines()
    images = [l for l in lines if l.strip().startswith("--task images --data-dir DIR")]
    text = [l for l in lines if l.strip().startswith("--task text --data-dir DIR")]
    assert len(images) == len(text) == 1
    assert "DIR/train/<class>/" in images[0] and "DIR/<class>/" in images[0] and "10 %" in images[0]
    assert "DIR/train.txt" in text[0] and "DIR/valid.txt" in text[0] and "test.txt" in text[0]


# ------------------------------------------------------------------------------------------
# curves.svg
# ------------------------------------------------------------------------------------------

def inits_drawn(path):
    """The titles of the mean lines of curves.svg."""
    root = ET.parse(path).getroot()
    return {line.find(f"{SVG}title").text for line in root.iter(f"{SVG}polyline")}


def fake_result(task, init, seed, history, status="done"):
    return {"task": task, "init": init, "seed": seed, "status": status, "config": {},
            "final": {}, "history": history}


def boolean_history(offset, epochs=4):   # evaluations every second epoch, as eval_every 2
    return [{"epoch": e, "train_loss": 1.0 / e + offset, "lr": 1e-3,
             **({"test_acc": 50.0 + 10 * e + offset, "test_loss": 1.0} if e % 2 == 0 else {})}
            for e in range(1, epochs + 1)]


def points(element):
    return [tuple(map(float, p.split(","))) for p in element.get("points").split()]


def curves(results):
    """curves.svg of these results as the tables draw it, parsed; None when there is none."""
    svg = tasks.result_tables(results, list(train.INITS))[1].get("curves.svg")
    return svg and ET.fromstring(svg)


def test_curves_svg_one_line_per_init_and_chart_with_a_band_for_several_seeds():
    """majority: default with 3 seeds, mask with 1; lm: mask with 2, plus a diverged run that is
    left out. A row of panels per number, training loss and then the main number, a panel per task,
    each with one mean line per init; a band only around the lines of several seeds, enclosing their
    mean; labelled axes; a legend that says how many seeds each line is the mean of (mask: 1 seed on
    majority, 2 on lm)."""
    results = [fake_result("majority", "default", s, boolean_history(s)) for s in range(3)]
    results += [fake_result("majority", "mask", 0, boolean_history(5))]
    results += [fake_result("lm", "mask", s, [{"iter": 10 * i, "train_loss": 3.0 - i / 10 + s,
                                                "val_loss": 1.0, "val_ppl": 30.0 - i + s}
                                               for i in range(1, 6)]) for s in range(2)]
    results += [fake_result("lm", "default", 0, [{"iter": 10, "train_loss": 3.0}], "diverged")]
    root = curves(results)
    lines = [(l.find(f"{SVG}title").text, points(l)) for l in root.iter(f"{SVG}polyline")]
    assert [title for title, _ in lines] == ["default", "mask", "mask"] * 2
    assert [len(p) for _, p in lines] == [4, 4, 5, 2, 2, 5]   # every epoch; every evaluation
    bands = [points(p) for p in root.iter(f"{SVG}polygon")]
    assert len(bands) == 4                                     # majority default x 2, lm mask x 2
    for band, (_, line) in zip(bands, [lines[0], lines[2], lines[3], lines[5]]):
        for x, y in line:
            ys = [by for bx, by in band if abs(bx - x) < 0.05]
            assert len(ys) == 2 and min(ys) <= y <= max(ys)
    texts = [t.text for t in root.iter(f"{SVG}text")]
    for label in ("epoch", "iteration (optimizer steps)", "train loss, log scale", "test acc (%)",
                  "val ppl", "train loss", "default (3 seeds)", "mask (1-2 seeds)",
                  "majority", "lm"):
        assert label in texts, label


def test_curves_svg_threesym_draws_test_loss_and_sweeps_get_a_line_each():
    """threesym's main number is its test loss (the paper's). Two mask magnitudes are two lines,
    named by A, the same colour, different dashes."""
    results = [fake_result("threesym", "mask", 0, boolean_history(a)) for a in (1, 2)]
    for r, a in zip(results, (1.0, 2.0)):
        r["config"]["mask_magnitude"] = a
    root = curves(results)
    lines = list(root.iter(f"{SVG}polyline"))
    assert [l.find(f"{SVG}title").text for l in lines] == ["mask, A 1", "mask, A 2"] * 2
    assert lines[0].get("stroke") == lines[1].get("stroke")
    assert lines[0].get("stroke-dasharray") != lines[1].get("stroke-dasharray")
    assert "test loss" in [t.text for t in root.iter(f"{SVG}text")]


def test_curves_svg_leaves_out_histories_it_cannot_draw():
    """A result.json edited by hand: a history that is no list of dicts, or holds no numbers, is
    left out (--summarize must not fail on it); nothing drawable at all gives no figure."""
    good = fake_result("majority", "mask", 0, boolean_history(0))
    bad = [fake_result("majority", "default", s, h) for s, h in enumerate(
        ["text", [1, 2], [{"epoch": "one", "train_loss": "low", "test_acc": True}], None])]
    root = curves([good, *bad])
    assert [l.find(f"{SVG}title").text for l in root.iter(f"{SVG}polyline")] == ["mask", "mask"]
    assert curves(bad[:2]) is None


def test_a_line_is_the_mean_over_seeds_in_a_band_from_the_lowest_to_the_highest():
    """Two seeds: train loss 1 and 3 at epoch 1 (mean 2, the middle of its band), 4 and none at epoch
    2 (no band there), NaN at epoch 3 (left out: no point at epoch 3)."""
    histories = [[{"epoch": 1, "train_loss": 1.0}, {"epoch": 2, "train_loss": 4.0}],
                 [{"epoch": 1, "train_loss": 3.0}, {"epoch": 2}, {"epoch": 3, "train_loss": float("nan")}]]
    root = curves([fake_result("majority", "mask", s, h) for s, h in enumerate(histories)])
    [line] = [points(l) for l in root.iter(f"{SVG}polyline")]
    [band] = [points(p) for p in root.iter(f"{SVG}polygon")]
    x_ticks = [t.text for t in root.find(f"{SVG}g").iter(f"{SVG}text") if t.get("text-anchor") == "middle"
               and t.text.isdigit()]
    assert len(line) == 2 and x_ticks == ["1", "2"]
    (x1, mean1), (x2, mean2) = line
    at_1 = sorted(y for x, y in band if abs(x - x1) < 0.05)
    assert len(at_1) == 2 and mean1 == pytest.approx((at_1[0] + at_1[1]) / 2, abs=0.1)
    assert [y for x, y in band if abs(x - x2) < 0.05] == [mean2, mean2]


@settings(max_examples=30, deadline=None)
@given(st.floats(-1e4, 1e4), st.floats(1e-3, 1e4), st.booleans())
def test_y_ticks_are_evenly_spaced_round_values_inside_the_axis(lo, span, log):
    """A run whose train loss goes from lo to hi: the y axis's ticks are round numbers, in order, inside
    the axis; evenly spaced on a linear axis, 1, 2 or 5 times a power of ten on a log one (the axis of
    positive values across a factor of ten and more)."""
    if log:
        lo, hi = abs(lo) + 1e-3, (abs(lo) + 1e-3) * (10 + span)
    else:
        hi = lo + span
    root = curves([fake_result("majority", "mask", 0, [{"epoch": 1, "train_loss": lo},
                                                       {"epoch": 2, "train_loss": hi}])])
    panel = root.find(f"{SVG}g")
    axis = next(p.get("d") for p in panel.iter(f"{SVG}path") if p.get("stroke") == "black")
    top, bottom = float(axis.split(",")[1].split("V")[0]), float(axis.split("V")[1].split("H")[0])
    labels = [t for t in panel.iter(f"{SVG}text") if t.get("text-anchor") == "end"]
    ticks = [float(t.text) for t in labels]
    pixels = [float(t.get("y")) - 4 for t in labels]
    assert 2 <= len(ticks) <= 11 and ticks == sorted(ticks)
    assert all(top - 0.05 <= p <= bottom + 0.05 for p in pixels)
    assert all(pixels[i] > pixels[i + 1] for i in range(len(pixels) - 1))     # higher values higher up
    log_axis = "train loss, log scale" in [t.text for t in panel.iter(f"{SVG}text")]
    assert log_axis == (lo > 0 and hi >= 10 * lo)
    if log_axis:
        assert {float(re.sub(r"e.*", "", f"{t:e}")) for t in ticks} <= {1.0, 2.0, 5.0}
    else:
        steps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(steps) - min(steps) <= 1e-4 * max(steps)
