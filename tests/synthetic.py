"""Test scaffolding, written without NumPy, for offline checks of the vision pipeline (tests,
tests/bench_vision.py): a synthetic CIFAR-10 in the real files' python-pickle layout, synthetic
hand-drawn-like digits in the ImageFolder layout of --task imagenet100, a user's own data for
--task images (shapes, grey or colour, in either layout) and --task text (English prose); and, for
the language tests, a tiny tiktoken ranks file.

    python tests/synthetic.py DIR [TRAIN_SIZE TEST_SIZE]             # CIFAR-10 layout
    python tests/synthetic.py --digits DIR [TRAIN_SIZE TEST_SIZE]    # DIR/imagenet100/{train,val}
    python tests/synthetic.py --sklearn-digits DIR                   # DIR/{train,val}: the README's digits
"""
import argparse
import array
import base64
import os
import pickle
import sys

import torch
from PIL import Image, ImageDraw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks import CIFAR_LAYOUT, IMAGENET100_FOLDER  # noqa: E402


def write_synthetic_cifar10(root, train_size=500, test_size=100, seed=0):
    """A synthetic data set in CIFAR-10's python-pickle layout, root/cifar-10-batches-py/:
    data_batch_1..5 (the training images split evenly), test_batch and batches.meta, each a
    pickled dict as in the real files ("data": one row of 3072 uint8 per image, channel-major
    R then G then B, row-major 32 x 32; "labels": ints). Rows are array.array('B') so that no
    NumPy is needed to write them; torchvision's loader stacks them into uint8 arrays.

    Each of the 10 classes has a random low-frequency colour pattern (4 x 4 blocks of 8 x 8
    pixels); an image is its class pattern, randomly shifted by up to 4 pixels, plus uniform
    noise of +-48 grey levels, so a model can learn it but not at once. The real files' MD5
    sums do not match, so torchvision refuses these files unless its check is bypassed (tests
    and the README measurement do that themselves; the product keeps the check)."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randint(40, 216, (10, 3, 4, 4), generator=g).float()
    patterns = patterns.repeat_interleave(8, 2).repeat_interleave(8, 3)           # (10, 3, 32, 32)

    def images(count):
        labels = torch.arange(count) % 10
        shifts = torch.randint(-4, 5, (count, 2), generator=g)
        rows = []
        for label, (dy, dx) in zip(labels.tolist(), shifts.tolist()):
            img = patterns[label].roll((dy, dx), (1, 2))
            img = (img + torch.empty(img.shape).uniform_(-48, 48, generator=g)).clamp(0, 255)
            rows.append(array.array("B", bytes(img.round().to(torch.uint8).flatten().tolist())))
        return rows, labels.tolist()

    folder = os.path.join(root, CIFAR_LAYOUT["cifar10"][0])
    os.makedirs(folder, exist_ok=True)

    def dump(name, obj):
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(obj, f)

    rows, labels = images(train_size)
    for i in range(5):
        part = slice(i * train_size // 5, (i + 1) * train_size // 5)
        dump(f"data_batch_{i + 1}", {"batch_label": f"training batch {i + 1} of 5",
                                     "data": rows[part], "labels": labels[part]})
    rows, labels = images(test_size)
    dump("test_batch", {"batch_label": "testing batch 1 of 1", "data": rows, "labels": labels})
    dump("batches.meta", {"label_names": [f"class{c}" for c in range(10)],
                          "num_cases_per_batch": train_size // 5, "num_vis": 3072})
    return folder


# Seven-segment digits: corners (x, y) of a 1 x 2 box, the segments between them, and each
# digit's segments (a top, b top right, c bottom right, d bottom, e bottom left, f top left,
# g middle). 2 and 5 are mirror images, so a horizontal flip confuses them.
CORNERS = {"TL": (0, 0), "TR": (1, 0), "ML": (0, 1), "MR": (1, 1), "BL": (0, 2), "BR": (1, 2)}
SEGMENTS = {"a": ("TL", "TR"), "b": ("TR", "MR"), "c": ("MR", "BR"), "d": ("BL", "BR"),
            "e": ("ML", "BL"), "f": ("TL", "ML"), "g": ("ML", "MR")}
DIGIT_SEGMENTS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg",
                  "abcdfg")


def digit_image(label, g, size=32, low=8, noise=20.0):
    """One grey-scale digit (PIL "L", size x size): the label's seven-segment strokes with a
    random width and height, position, slant, stroke width and a jitter of every corner, drawn
    at size x size, shrunk to low x low and enlarged back (blurred and coarse, like scanned
    8 x 8 handwriting upscaled), plus Gaussian noise of std `noise` grey levels."""
    def u(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=g).item()
    w, h = u(0.35, 0.55) * size, u(0.3, 0.42) * size      # box width, half-height
    cx, cy, slant = u(0.4, 0.6) * size, u(0.45, 0.55) * size, u(-0.3, 0.3)
    points = {}
    for name, (x, y) in CORNERS.items():
        py = cy + (y - 1) * h + u(-2, 2)
        points[name] = (cx + (x - 0.5) * w - slant * (py - cy) + u(-2, 2), py)
    image = Image.new("L", (size, size), 0)
    draw, width = ImageDraw.Draw(image), int(u(3, 5))
    for segment in DIGIT_SEGMENTS[label]:
        draw.line([points[c] for c in SEGMENTS[segment]], fill=255, width=width)
    image = image.resize((low, low), Image.BILINEAR).resize((size, size), Image.BILINEAR)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).float()
    pixels = (pixels + noise * torch.randn(size * size, generator=g)).clamp(0, 255)
    return Image.frombytes("L", (size, size), bytes(pixels.round().to(torch.uint8).tolist()))


def write_synthetic_digits(root, train_size=1400, test_size=400, seed=0, **style):
    """Synthetic digits 0-9 (digit_image, `style` passed on) as the ImageFolder tree of --task
    imagenet100: root/imagenet100/{train,val}/<digit>/<n>.png, grey-scale 32 x 32 PNGs, the
    classes in turn. A stand-in for a user's own small data set, e.g. 1,400 scanned 8 x 8
    digits upscaled to 32 x 32: harder than write_synthetic_cifar10's set (the class is in the
    shape of thin, jittered strokes, not in a colour pattern), and hurt by augmentation that
    suits ImageNet (a crop of 8 % of the image holds a fragment of one stroke)."""
    g = torch.Generator().manual_seed(seed)
    for split, count in (("train", train_size), ("val", test_size)):
        for n in range(count):
            folder = os.path.join(root, IMAGENET100_FOLDER, split, str(n % 10))
            os.makedirs(folder, exist_ok=True)
            digit_image(n % 10, g, **style).save(os.path.join(folder, f"{n}.png"))
    return os.path.join(root, IMAGENET100_FOLDER)


def write_tiny_ranks(path):
    """A tiktoken ranks file with the 256 single bytes only (base64 token, rank per line) at path
    (a pathlib.Path); returns the path as a string, for --bpe-file."""
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# Shapes for a user's own ImageFolder tree (--task images): class folders named by the shape.
SHAPES = ("disc", "ring", "square", "frame", "triangle", "diamond", "cross", "plus", "hbar", "vbar")


def shape_image(shape, g, size=32, mode="L", noise=16.0):
    """One image (PIL mode "L" or "RGB", size x size) of a shape of SHAPES: random size and
    position; grey: white on black; colour: a random bright colour on a random dark one (the
    class is in the shape, not the colour); plus Gaussian noise of std `noise` levels."""
    def u(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=g).item()
    half, cx, cy = u(0.25, 0.4) * size, u(0.4, 0.6) * size, u(0.4, 0.6) * size
    x0, y0, x1, y1 = cx - half, cy - half, cx + half, cy + half
    colour = lambda lo, hi: int(u(lo, hi)) if mode == "L" else tuple(int(u(lo, hi)) for _ in "rgb")
    ink, width = colour(200, 256) if mode == "L" else colour(90, 256), max(1, size // 10)
    image = Image.new(mode, (size, size), colour(0, 40))
    draw = ImageDraw.Draw(image)
    lines = {"cross": [((x0, y0), (x1, y1)), ((x0, y1), (x1, y0))],
             "plus": [((cx, y0), (cx, y1)), ((x0, cy), (x1, cy))]}.get(shape, [])
    for line in lines:
        draw.line(line, fill=ink, width=width)
    polygons = {"triangle": [(cx, y0), (x1, y1), (x0, y1)],
                "diamond": [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]}
    if shape in polygons:
        draw.polygon(polygons[shape], fill=ink)
    if shape in ("disc", "ring"):
        draw.ellipse([x0, y0, x1, y1], fill=ink if shape == "disc" else None, outline=ink, width=width)
    if shape in ("square", "frame"):
        draw.rectangle([x0, y0, x1, y1], fill=ink if shape == "square" else None, outline=ink, width=width)
    if shape in ("hbar", "vbar"):
        draw.rectangle([x0, cy - width, x1, cy + width] if shape == "hbar" else
                       [cx - width, y0, cx + width, y1], fill=ink)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).float()
    pixels = (pixels + noise * torch.randn(len(pixels), generator=g)).clamp(0, 255)
    return Image.frombytes(mode, (size, size), bytes(pixels.round().to(torch.uint8).tolist()))


def write_image_tree(root, classes=SHAPES, per_class=10, size=32, mode="L", layout="split",
                     eval_per_class=3, eval_folder="val", seed=0):
    """An ImageFolder tree of shape_image PNGs for --task images. layout "split":
    root/train/<shape>/<n>.png (per_class each) and root/<eval_folder>/<shape>/<n>.png
    (eval_per_class each); "one folder": root/<shape>/<n>.png (per_class each). Returns root."""
    g = torch.Generator().manual_seed(seed)
    splits = [("train", per_class), (eval_folder, eval_per_class)] if layout == "split" else [("", per_class)]
    for split, count in splits:
        for shape in classes:
            folder = os.path.join(root, split, shape)
            os.makedirs(folder, exist_ok=True)
            for n in range(count):
                shape_image(shape, g, size, mode).save(os.path.join(folder, f"{n}.png"))
    return root


def write_text_files(root, train_chars=4000, valid_chars=1000, test_chars=0):
    """train.txt, valid.txt (and test.txt when test_chars > 0) for --task text: consecutive
    pieces of English prose from Python's own pydoc_data.topics (the corpus of tasks.lm_dataset("lm"))."""
    import pydoc_data.topics
    from tasks import TEXT_FILES
    topics = pydoc_data.topics.topics
    text, start = "\n\n".join(topics[key] for key in sorted(topics)), 0   # as tasks.lm_dataset("lm") joins it
    os.makedirs(root, exist_ok=True)
    for name, count in zip(TEXT_FILES, (train_chars, valid_chars, test_chars)):
        if count:
            with open(os.path.join(root, name), "w", encoding="utf-8") as f:
                f.write(text[start:start + count])
            start += count
    return root


def write_sklearn_digits(root, train_size=1400):
    """The README's stand-in for CIFAR (section "Vision"): scikit-learn's 1,797 handwritten digits (8 x 8,
    grey levels 0-16) as 32 x 32 grey PNGs (levels x 255 / 16, truncated; bilinear upscaling) in the
    --task images layout, root/{train,val}/<digit>/<index>.png: a seeded permutation (torch, seed 0) puts
    the first train_size in train/ and the rest in val/. Needs scikit-learn."""
    import sklearn.datasets
    x, y = sklearn.datasets.load_digits(return_X_y=True)
    levels = (torch.as_tensor(x, dtype=torch.float64) * 255 / 16).to(torch.uint8)      # (1797, 64)
    order = torch.randperm(len(levels), generator=torch.Generator().manual_seed(0)).tolist()
    for k, i in enumerate(order):
        folder = os.path.join(root, "train" if k < train_size else "val", str(int(y[i])))
        os.makedirs(folder, exist_ok=True)
        image = Image.frombytes("L", (8, 8), bytes(levels[i].tolist())).resize((32, 32), Image.BILINEAR)
        image.save(os.path.join(folder, f"{i}.png"))
    return root


def main(argv=None):
    """The command line (the module docstring's three forms); a missing scikit-learn is one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python tests/synthetic.py", description=__doc__.split("\n\n")[0])
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--digits", action="store_true", help="synthetic digits in DIR/imagenet100/{train,val}")
    kind.add_argument("--sklearn-digits", action="store_true",
                      help="scikit-learn's 1,797 digits in DIR/{train,val} (the README's; needs scikit-learn)")
    parser.add_argument("dir", metavar="DIR", help="where to write")
    parser.add_argument("sizes", metavar="SIZE", type=int, nargs="*",
                        help="TRAIN_SIZE TEST_SIZE (default 500 100; --digits 1400 400)")
    args = parser.parse_args(argv)
    if len(args.sizes) not in (0, 2) or (args.sklearn_digits and args.sizes):
        parser.error("give both TRAIN_SIZE and TEST_SIZE, or neither (--sklearn-digits: neither)")
    if args.sklearn_digits:
        try:
            import sklearn.datasets  # noqa: F401
        except ModuleNotFoundError:
            parser.exit(2, "synthetic.py: error: --sklearn-digits needs scikit-learn: pip install scikit-learn\n")
        print(f"wrote {write_sklearn_digits(args.dir)}")
        return
    sizes = args.sizes or ([1400, 400] if args.digits else [500, 100])
    write = write_synthetic_digits if args.digits else write_synthetic_cifar10
    print(f"wrote {write(args.dir, *sizes)}")


if __name__ == "__main__":
    main()
