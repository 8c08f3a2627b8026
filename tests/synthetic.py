"""Test scaffolding: a synthetic CIFAR-10 in the real files' python-pickle layout, written
without NumPy, for offline checks of the vision pipeline (tests, tests/bench_vision.py).

    python tests/synthetic.py DIR [TRAIN_SIZE TEST_SIZE]
"""
import array
import os
import pickle
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks import CIFAR_LAYOUT  # noqa: E402


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


if __name__ == "__main__":
    if len(sys.argv) not in (2, 4):
        sys.exit("usage: python tests/synthetic.py DIR [TRAIN_SIZE TEST_SIZE]")
    sizes = [int(s) for s in sys.argv[2:4]] or [500, 100]
    print(f"wrote {write_synthetic_cifar10(sys.argv[1], *sizes)}")
