"""Tasks and their metrics, the data side of every experiment in the paper, in its order, then reports:

  1. Boolean GOTU tasks (Section 5.1, Table 1; Abbe et al. "Generalization on the Unseen").
  2. Three-digit arithmetic (Section 5.2, Table "Performance of arithmetic tasks").
  3. Image classification (Section 5.3): CIFAR-10/100, ImageNet100 through torchvision.
  4. Language modelling (Appendix "Wiki-text and Tiny-stories"), GPT-2 tokens through tiktoken.
  5. Your own data: a folder of images (--task images), text files (--task text), and their checks.
  6. Reports: result tables (table.md beside the paper's numbers, a run's summary line), line charts.
  7. Pictures: heat maps of attention maps and mask biases (attention.svg, persistence, learned priors).
Each loader returns its tensors or data sets and, under "sources", what it read (train.py fingerprints
it). Reports read what result.json records. Imports torch and the standard library (torchvision, PIL,
tiktoken only where needed), never train.py.

The four loaders, boolean_dataset, arithmetic_dataset, lm_dataset and vision_dataset, cache what they
return (@cached: functools.cache): the runs of one command share one copy, built or read once, and
must not change it. A command starts with forget_data(), so that it reads every file afresh: a file
changed between two commands of one process (tests call train.main many times) is seen, and --resume
can refuse data that changed.
"""


import base64
import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import statistics
import warnings
from collections import namedtuple
from xml.sax.saxutils import escape

import torch


def autocast(device):
    """bf16 autocast on CUDA, a no-op on the CPU: the evaluations here and train.py's steps."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

@contextlib.contextmanager
def evaluating(model):
    """The model in eval mode inside the block (which gets its device), in train mode after it."""
    model.eval()
    yield next(model.parameters()).device
    model.train()

def paper_table(inits, rows):
    """{(task, init): numbers} of a table of the paper written as {task: [its numbers per init]}."""
    return {(t, i): cell for t, cells in rows.items() for i, cell in zip(inits, cells, strict=True)}

class DataError(Exception):
    """A missing or unreadable dataset or tokenizer file; the message says what to put where."""

CACHED = []   # the loaders that keep what they return, until forget_data

def cached(loader):
    """The loader with functools.cache: one copy per arguments (see the top of this file)."""
    CACHED.append(functools.cache(loader))
    return CACHED[-1]

def forget_data():
    """Empty the loaders' caches: train.py calls it as each command starts."""
    for loader in CACHED:
        loader.cache_clear()

# === 1. Boolean GOTU tasks (Section 5.1; the tasks of aryol/GOTU, Abbe et al. 2023) ===============
# Bits x in {-1, +1}^d, d = 15, shape (P, d) throughout. Training uses every seen point of the cube (not
# sampled); testing the whole cube (2^15 points) and its unseen part. For each task, Section 5.1 gives
# f, the seen domain Omega_seen and the minimum-degree interpolator (MDI): the lowest-degree function
# that agrees with f on Omega_seen, which a Transformer without the right prior learns instead of f.
BOOLEAN_DIM = 15
# Each task's name and the values f can take (accuracy rounds a prediction to the nearest one); threesym
# is continuous: the paper reports no accuracy for it. A sum of 15 signs (cyclic3) is odd.
BOOLEAN_TASKS = {"2parity": (-1.0, 1.0), "majority": (-1.0, 1.0),
                 "cyclic3": tuple(float(v) for v in range(-BOOLEAN_DIM, BOOLEAN_DIM + 1, 2)),
                 "threesym": None}
BooleanTask = namedtuple("BooleanTask", "target seen mdi")   # each (P,): f(x), x in Omega_seen, MDI(x)

def boolean_task(name, x):
    """Section 5.1's f, Omega_seen and MDI of a task at the bits x (P, d)."""
    x0, x1, x2 = x[:, 0], x[:, 1], x[:, 2]
    if name == "2parity":       # f = x0 x1, unseen x0 = x1 = -1 (1/4 of the cube); there x0 x1 = x0 + x1 - 1
        return BooleanTask(x0 * x1, (x0 == 1) | (x1 == 1), x0 + x1 - 1)
    if name == "majority":      # f = Maj(x0, x1, x2), unseen x0 = x1 = -1; MDI (x0 + x1 + 2 x2 - x0 x2 - x1 x2) / 2
        return BooleanTask(torch.sign(x0 + x1 + x2), (x0 == 1) | (x1 == 1),
                           (x0 + x1 + 2 * x2 - x0 * x2 - x1 * x2) / 2)
    if name == "cyclic3":       # f = sum_i x_i x_{i+1} x_{i+2}, indices mod d; unseen x0 = x1 = x2 = -1 (1/8)
        target = (x * x.roll(-1, dims=1) * x.roll(-2, dims=1)).sum(1)
        quadratic = x0 * x1 + x1 * x2 + x2 * x0 - x0 - x1 - x2 + 1    # = x0 x1 x2 on the seen domain
        return BooleanTask(target, ~((x0 == -1) & (x1 == -1) & (x2 == -1)), target - x0 * x1 * x2 + quadratic)
    # threesym: f = x0 x1 - 1.25 x1 x2 + 1.5 x2 x0, unseen x0 x1 x2 = -1 (1/2); MDI x2 - 1.25 x0 + 1.5 x1
    return BooleanTask(x0 * x1 - 1.25 * x1 * x2 + 1.5 * x2 * x0, x0 * x1 * x2 == 1, x2 - 1.25 * x0 + 1.5 * x1)

def boolean_cube(d=BOOLEAN_DIM):
    """Every point of {-1, +1}^d, (2^d, d) float; row r holds the bits of r (bit i = column i)."""
    bits = (torch.arange(2 ** d)[:, None] >> torch.arange(d)) & 1
    return (2 * bits - 1).float()

def boolean_tokens(x):
    """Bits {-1, +1} -> token ids {0, 1} for the embedding (one token per bit, as in GOTU)."""
    return ((x + 1) / 2).long()

@cached
def boolean_dataset(name):
    """Train = every seen point; test = the whole cube. Returns a dict of tensors."""
    cube = boolean_cube()
    task = boolean_task(name, cube)
    return {"x_train": cube[task.seen], "y_train": task.target[task.seen],
            "x_test": cube, "y_test": task.target, "unseen": ~task.seen}

def boolean_accuracy(pred, y, values):
    """Percent of predictions whose nearest possible value (values) is the true one; None for a
    continuous target (threesym) or no predictions."""
    if values is None or len(pred) == 0:
        return None
    values = torch.tensor(values, dtype=pred.dtype, device=pred.device)
    nearest = values[(pred[:, None] - values[None]).abs().argmin(1)]
    return 100.0 * (nearest == y).float().mean().item()

def boolean_metrics(name, pred, x):
    """Table 1's MSE and accuracy on the cube and its unseen part, and the unseen MSE to the MDI."""
    task, values = boolean_task(name, x), BOOLEAN_TASKS[name]
    y, unseen, mdi = task.target, ~task.seen, task.mdi
    return {"test_loss": ((pred - y) ** 2).mean().item(), "test_acc": boolean_accuracy(pred, y, values),
            "unseen_loss": ((pred[unseen] - y[unseen]) ** 2).mean().item(),
            "unseen_acc": boolean_accuracy(pred[unseen], y[unseen], values),
            "unseen_mse_to_mdi": ((pred[unseen] - mdi[unseen]) ** 2).mean().item()}

def fourier_coefficients(pred, x, variables=(0, 1, 2)):
    """hat f(S) = mean of f(x) prod_{i in S} x_i over x, for each monomial S of variables: "1", "x0x2"."""
    subsets = [s for k in range(len(variables) + 1) for s in itertools.combinations(variables, k)]
    # chi_S(x) = x[:, S].prod(1), (P,); the empty product is 1
    return {"".join(f"x{i}" for i in s) or "1": (pred * x[:, list(s)].prod(1)).mean().item() for s in subsets}

@torch.no_grad()
def boolean_predictions(model, x, batch=8192):
    """Predictions for bits x (P, d), float32 on the CPU, in batches of aryol/GOTU's test size."""
    with evaluating(model) as device:
        out = [model(boolean_tokens(x[i:i + batch]).to(device)).squeeze(-1).float().cpu()
               for i in range(0, len(x), batch)]
    return torch.cat(out)

# The paper's Table 1 and Table "Ablation on mask initialization" (test loss, test acc %).
PAPER_BOOLEAN = paper_table(("default", "structured-svd", "structured-opt", "mask", "mask-zero"), {
    "2parity": [(1.379, 75.00), (1.737, 75.00), (1.746, 75.00), (0.0029, 100.00), (1.38, 75.00)],
    "cyclic3": [(5.648, 87.45), (3.257, 87.48), (3.230, 87.47), (0.0034, 99.98), (2.53, 87.46)],
    "majority": [(0.509, 87.40), (0.516, 87.40), (0.495, 87.40), (0.0051, 100.00), (0.50, 87.4)],
    "threesym": [(7.621, None), (7.616, None), (7.635, None), (2.9745, None), (7.62, None)]})

# === 2. Three-digit arithmetic (Section 5.2) ======================================================
# Tables "Arithmetic task setup" and "Performance of arithmetic tasks": all 10^6 pairs 0 <= a, b <= 999
# (pair id 1000 a + b), a seeded fraction to train; an encoder predicts the whole answer in one pass from
# six operand digits and one placeholder per answer digit, every number least significant first:
#
#   position   0   1   2   3   4   5   6   7  ...  6+K-1
#   token     a0  a1  a2  b0  b1  b2   _   _  ...   _        a0 = units digit of a, _ = token 10
#   target                             c0  c1  ...  c(K-1)   c_k = the 10^k digit of a + b or a * b
#
# so digit i of a and of b sit at the same offset, and a carry's source c_{k-1} right before the digit
# it changes (maskprior.py's masks assume this order). K = 4 for addition, 6 for multiplication.
ARITHMETIC_TASKS = {"addition": 4, "multiplication": 6}          # task -> answer digits K
ARITHMETIC_TRAIN_FRAC = {"addition": 0.004, "multiplication": 0.03}  # the paper's Table
OPERAND_DIGITS = 3
PLACEHOLDER = 10                                                # token of an answer slot
ARITHMETIC_VOCAB = 11                                           # digits 0-9 and the placeholder
ALL_PAIRS = 10 ** (2 * OPERAND_DIGITS)

def digits(n, count):
    """(P,) integers -> (P, count) decimal digits, least significant first."""
    return torch.div(n[:, None], 10 ** torch.arange(count), rounding_mode="floor") % 10

def arithmetic_split(train_frac, seed):
    """(train ids, held-out ids): the first round(train_frac * 10^6) of a seeded permutation train."""
    if not 0 < train_frac < 1:
        raise ValueError(f"train_frac must lie in (0, 1), got {train_frac}")
    perm = torch.randperm(ALL_PAIRS, generator=torch.Generator().manual_seed(seed))
    n_train = max(1, round(train_frac * ALL_PAIRS))
    return perm[:n_train], perm[n_train:]

def arithmetic_examples(task, ids):
    """Pair ids (P,) -> input tokens (P, 6 + K) and answer digits (P, K), in the layout above."""
    k = ARITHMETIC_TASKS[task]
    a, b = ids // 1000, ids % 1000
    value = a + b if task == "addition" else a * b
    slots = torch.full((len(ids), k), PLACEHOLDER)
    tokens = torch.cat([digits(a, OPERAND_DIGITS), digits(b, OPERAND_DIGITS), slots], 1)
    return tokens, digits(value, k)

@cached
def arithmetic_dataset(task, train_frac, seed, eval_size=100_000):
    """Train and evaluation tensors; evaluation: a seeded sample of eval_size held-out pairs (None: all)."""
    train_ids, held_out = arithmetic_split(train_frac, seed)
    if eval_size is not None and eval_size < len(held_out):
        pick = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(seed + 1))
        held_out = held_out[pick[:eval_size]]
    x_train, y_train = arithmetic_examples(task, train_ids)
    x_eval, y_eval = arithmetic_examples(task, held_out)
    return {"x_train": x_train, "y_train": y_train, "x_eval": x_eval, "y_eval": y_eval,
            "eval_pairs": len(held_out), "held_out_pairs": ALL_PAIRS - len(train_ids)}

def arithmetic_metrics(logits, answers):
    """Table "Performance of arithmetic tasks": sequence (all digits right) and digit accuracy (%),
    cross-entropy per digit, accuracy per answer position; logits (P, K, 10), answers (P, K)."""
    right = logits.argmax(-1) == answers                                  # (P, K)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), answers.flatten())
    return {"test_loss": loss.item(), "seq_acc": 100.0 * right.all(1).float().mean().item(),
            "digit_acc": 100.0 * right.float().mean().item(),
            "position_acc": (100.0 * right.float().mean(0)).tolist()}

def answer_logits(model, tokens):
    """Digit logits of the answer slots, the positions after the six operand digits: (B, K, 10)."""
    return model(tokens)[:, 2 * OPERAND_DIGITS:]

@torch.inference_mode()
def arithmetic_logits(model, x, batch=512):
    """answer_logits over many pairs, (P, K, 10) float32 on the CPU; larger batches measured slower."""
    out = []
    with evaluating(model) as device:
        for i in range(0, len(x), batch):
            with autocast(device):
                out.append(answer_logits(model, x[i:i + batch].to(device)).float().cpu())
    return torch.cat(out)

# The paper's Table "Performance of arithmetic tasks" (seq acc %, digit acc %, loss) at ARITHMETIC_TRAIN_FRAC.
PAPER_ARITHMETIC = paper_table(("default", "structured-svd", "structured-opt", "mask"), {
    "multiplication": [(5.01, 70.78, 2.27), (11.13, 74.57, 1.77), (27.82, 82.37, 0.85), (69.49, 94.13, 0.20)],
    "addition": [(1.19, 40.59, 4.51), (0.87, 38.56, 4.59), (3.39, 49.87, 3.40), (77.49, 93.86, 0.23)]})

# === 3. Image classification (Section 5.3) ========================================================
# Tables "Experimental setup for CIFAR10", "... for CIFAR100", "... for ImageNet100"; torchvision reads
# the data and augments it. cifar10, cifar100: the python-pickle layout (CIFAR_LAYOUT) in --data-dir,
# checked by torchvision's MD5 sums; imagenet100: an ImageFolder tree DATA/imagenet100/{train,val}/
# <class>/<image> (e.g. https://huggingface.co/datasets/clane9/imagenet-100 as image files); images:
# the user's own (image_folder_dataset). --download (CIFAR only) is opt-in; else missing data: DataError.
VISION_TASKS = ("cifar10", "cifar100", "imagenet100", "images")
VISION_CLASSES = {"cifar10": 10, "cifar100": 100, "imagenet100": 100}
CIFAR_LAYOUT = {  # folder torchvision expects under --data-dir, and the files in it
    "cifar10": ("cifar-10-batches-py",
                tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch", "batches.meta")),
    "cifar100": ("cifar-100-python", ("train", "test", "meta"))}
IMAGENET100_FOLDER = "imagenet100"
# Per-channel mean and std for Normalize: CIFAR's own (as timm's CIFAR recipes) and ImageNet's.
NORMALIZATION = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
                 "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
                 **dict.fromkeys(("imagenet100", "images"), ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))}
RESIZED_CROP_TASKS = ("imagenet100", "images")   # images of any size: timm's ImageNet crops

def vision_transform(name, image_size, train, randaugment_magnitude=9, crop_scale=0.08, channels=3):
    """The image pipeline (torchvision.transforms.v2), uint8 PIL image -> normalised (C, S, S), C = 1 for
    grey images; train: random crop (CIFAR padded by S / 8, else timm's RandomResizedCrop), flip, the
    tables' "RandAug (m9)"; test: resize (then, but for CIFAR, timm's centre crop of crop_pct 0.875)."""
    from torchvision.transforms import v2
    mean, std = NORMALIZATION[name]
    if channels == 1:
        mean, std = (statistics.fmean(mean),), (statistics.fmean(std),)
    if train and name in RESIZED_CROP_TASKS:
        geometry = [v2.RandomResizedCrop(image_size, scale=(crop_scale, 1.0), antialias=True)]
    elif train:
        geometry = [v2.Resize(image_size, antialias=True), v2.RandomCrop(image_size, padding=image_size // 8)]
    elif name in RESIZED_CROP_TASKS:
        geometry = [v2.Resize(int(image_size / 0.875), antialias=True), v2.CenterCrop(image_size)]
    else:
        geometry = [v2.Resize(image_size, antialias=True)]
    augment = [v2.RandomHorizontalFlip(), v2.RandAugment(magnitude=randaugment_magnitude)] if train else []
    return v2.Compose([v2.ToImage(), *geometry, *augment, v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(mean, std)])

def mixup_cutmix(num_classes, mixup_alpha=0.8, cutmix_alpha=1.0):
    """The tables' "Mixup / CutMix 0.8 / 1.0" as timm's Mixup (switch probability 0.5): images,
    soft_targets = mix(images (B, C, H, W), labels (B,)); an alpha of 0 turns one off (both: one-hot)."""
    from torchvision.transforms import v2
    mixers = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []
    mixers += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else []
    if mixers:
        return v2.RandomChoice(mixers)
    def one_hot(images, labels):   # neither: the images as they are, the labels as one-hot targets
        return images, torch.nn.functional.one_hot(labels, num_classes).float()
    return one_hot

def cifar_split(name, data_dir, transform, train, download):
    """torchvision's CIFAR10 / CIFAR100 split, or DataError naming the folder and layout."""
    from torchvision import datasets
    folder, files = CIFAR_LAYOUT[name]
    path = os.path.join(data_dir, folder)
    pretty, cls = ("CIFAR-10", datasets.CIFAR10) if name == "cifar10" else ("CIFAR-100", datasets.CIFAR100)
    if not download and not all(os.path.isfile(os.path.join(path, f)) for f in files):
        raise DataError(f"{pretty}: expected {path}/ holding {', '.join(files)} (the python "
                        f"version, unpacked; --data-dir {data_dir}), or pass --download")
    try:
        return cls(data_dir, train=train, transform=transform, download=download)
    except RuntimeError as err:  # torchvision: "Dataset not found or corrupted" (MD5 mismatch)
        raise DataError(f"{pretty} in {path} failed torchvision's MD5 check of its files ({err})")
    except OSError as err:       # --download without a network
        raise DataError(f"{pretty}: download into {path} failed ({err})")

def imagenet100_split(data_dir, split, transform):
    """One split of ImageNet100 as torchvision's ImageFolder, or DataError naming the folders."""
    from torchvision import datasets
    root = os.path.join(data_dir, IMAGENET100_FOLDER)
    path = os.path.join(root, split)
    if not os.path.isdir(path) or not any(os.scandir(path)):
        raise DataError(f"ImageNet100: expected two folders, {root}/train and {root}/val, each "
                        f"with one sub-folder of images per class ({path} is missing or empty); "
                        f"--download cannot fetch it")
    try:
        return datasets.ImageFolder(path, transform=transform)
    except (OSError, RuntimeError, ValueError) as err:   # e.g. class folders without images
        raise DataError(f"ImageNet100: {path} is not a readable ImageFolder tree ({err})")

@cached
def vision_dataset(name, data_dir, image_size, download=False, randaugment_magnitude=9, crop_scale=0.08):
    """{"train", "test", "classes", "sources", "root"} (images: also "channels", "info")."""
    if name == "imagenet100" and download:
        raise DataError("ImageNet100 has no --download; build the ImageFolder tree "
                        f"{data_dir}/{IMAGENET100_FOLDER}/{{train,val}}/<class>/<image>")
    if name == "images":
        if download:
            raise DataError(f"--task images has no --download; it reads your own images: {IMAGES_LAYOUT}")
        return image_folder_dataset(data_dir, image_size, randaugment_magnitude, crop_scale)
    train_tf = vision_transform(name, image_size, True, randaugment_magnitude, crop_scale)
    test_tf = vision_transform(name, image_size, False)
    if name == "imagenet100":
        train, test = imagenet100_split(data_dir, "train", train_tf), imagenet100_split(data_dir, "val", test_tf)
        sources = {f"{IMAGENET100_FOLDER}/train": [path for path, _ in train.samples],
                   f"{IMAGENET100_FOLDER}/val": [path for path, _ in test.samples]}
    else:
        train = cifar_split(name, data_dir, train_tf, True, download)
        test = cifar_split(name, data_dir, test_tf, False, False)
        folder, files = CIFAR_LAYOUT[name]
        sources = {folder: [os.path.join(data_dir, folder, f) for f in files]}
    return {"train": train, "test": test, "classes": VISION_CLASSES[name], "sources": sources,
            "root": data_dir}


def vision_loaders(data, batch_size, rank, world, workers, seed, pin_memory):
    """Training loader over this process's share of each shuffled epoch (a DistributedSampler, its own
    generator seeding its workers), test loader over every world-th image (the ranks' sums add up)."""
    from torch.utils.data import DataLoader, DistributedSampler, Subset
    sampler = DistributedSampler(data["train"], world, rank, shuffle=True, seed=seed, drop_last=True)
    train = DataLoader(data["train"], batch_size // world, sampler=sampler, num_workers=workers,
                       pin_memory=pin_memory, drop_last=True, generator=torch.Generator())
    test = DataLoader(Subset(data["test"], range(rank, len(data["test"]), world)),
                      batch_size // world, num_workers=workers, pin_memory=pin_memory)
    return train, test, sampler

@torch.no_grad()
def vision_scores(model, loader):
    """(correct top-1 predictions, summed cross-entropy, images) over a test loader."""
    correct, total, count = 0, 0.0, 0
    with evaluating(model) as device:
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with autocast(device):
                logits = model(images)
            correct += (logits.argmax(-1) == labels).sum().item()
            total += torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").item()
            count += len(labels)
    return correct, total, count

# The paper's Table "Best Top-1 accuracy (%) on vision benchmarks that are all using ViT-T model"
# (Section 5.3); mask-fixed from Appendix A.2's Table "Best Top-1 accuracy (%) on vision benchmarks.
# Values in parentheses ...", which prints ImageNet100's mask init as 85.82 (Section 5.3: 85.92).
PAPER_VISION = paper_table(("default", "mimetic", "impulse", "mask-fixed", "mask"), {
    "cifar10": [94.20, 94.80, 95.12, 94.16, 95.66], "cifar100": [74.00, 76.80, 76.47, 78.77, 77.95],
    "imagenet100": [83.38, 84.38, 83.16, 81.78, 85.92]})

# === 4. Language modelling (Appendix "Wiki-text and Tiny-stories", Table "NLP task setup") ========
# Four corpora, dicts of 1-D int64 token tensors {"train", "val", "test"}; GPT-2 tokens but for lm and
# text without --bpe-file (UTF-8 bytes, vocab 256). lm: pydoc_data.topics, English prose shipped with
# Python (nothing to download); tinystories: the first 12k stories to train, 2k to validate (and test,
# as in the paper); wikitext2: WikiText-2 raw; text: the user's own files (TEXT_FILES).
LM_TASKS = ("lm", "tinystories", "wikitext2", "text")
GPT2_VOCAB = 50257
END_OF_TEXT = "<|endoftext|>"
TINYSTORIES_FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")
WIKITEXT2_FILES = tuple(f"wikitext-2-raw/wiki.{split}.raw" for split in ("train", "valid", "test"))
BPE_HELP = ("GPT-2's ranks file: r50k_base.tiktoken (the same ids as 'gpt2'; sha256 306cd27f...dd930),"
            " e.g. from a machine with internet: python -c \"import tiktoken; "
            "tiktoken.get_encoding('gpt2')\" with TIKTOKEN_CACHE_DIR set, then copy the cached file")

def embedded_corpus():
    """pydoc_data.topics joined in key order: English technical prose from the standard library."""
    import pydoc_data.topics
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))

def byte_tokens(text):
    """UTF-8 bytes as token ids 0..255 (the byte-level tokenizer of lm, and of text without --bpe-file)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

def decode_bytes(ids):
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

def split_tokens(tokens, val_fraction=0.05, test_fraction=0.05):
    """Contiguous train / val / test split of one token stream (last 10% held out)."""
    n_val, n_test = int(len(tokens) * val_fraction), int(len(tokens) * test_fraction)
    n_train = len(tokens) - n_val - n_test
    return {"train": tokens[:n_train], "val": tokens[n_train:n_train + n_val],
            "test": tokens[n_train + n_val:]}

def gpt2_encoding(bpe_file=None):
    """GPT-2's tokenizer through tiktoken, offline: from bpe_file (BPE_HELP) or TIKTOKEN_CACHE_DIR."""
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str
    if bpe_file is None:
        if not os.environ.get("TIKTOKEN_CACHE_DIR"):
            raise DataError(f"no GPT-2 tokenizer: pass --bpe-file PATH or set TIKTOKEN_CACHE_DIR "
                            f"to a cache that holds it ({BPE_HELP})")
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as err:  # tiktoken would try to download what its cache lacks
            raise DataError(f"TIKTOKEN_CACHE_DIR={os.environ['TIKTOKEN_CACHE_DIR']} does not hold "
                            f"GPT-2's ranks ({type(err).__name__}); pass --bpe-file ({BPE_HELP})")
    if os.path.isdir(bpe_file):
        raise DataError(f"--bpe-file {bpe_file} is a folder: name the ranks file in it ({BPE_HELP})")
    if not os.path.isfile(bpe_file):
        raise DataError(f"--bpe-file {bpe_file}: no such file ({BPE_HELP})")
    try:   # each line of a ranks file is "<base64 token> <rank>"
        ranks = tiktoken.load.load_tiktoken_bpe(bpe_file)
        if not ranks:
            raise ValueError("it holds no ranks")
        # tiktoken's Rust core panics on these instead of raising: check them first
        if len(set(ranks.values())) != len(ranks) or max(ranks.values()) >= GPT2_VOCAB - 1:
            raise ValueError(f"two tokens share a rank, or a rank is not below {GPT2_VOCAB - 1}")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"{len(missing)} of the 256 single bytes have no rank")
        full = len(ranks) == GPT2_VOCAB - 1  # the real file; tests pass a tiny one
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={END_OF_TEXT: GPT2_VOCAB - 1},
                                 explicit_n_vocab=GPT2_VOCAB if full else None)
    except (ValueError, OSError, UnicodeError, AssertionError) as err:
        raise DataError(f"--bpe-file {bpe_file} is not a tiktoken ranks file ({str(err)[:80]}): "
                        f"lines of '<base64 token> <rank>' are expected ({BPE_HELP})")

def gpt2_decoder(encoding):
    """ids -> text that never fails: an id a small ranks file lacks (a larger model's) is U+FFFD."""
    def decode(ids):
        pieces = []
        for i in ids:
            try:
                pieces.append(encoding.decode_single_token_bytes(i))
            except KeyError:
                pieces.append("\ufffd".encode())
        return b"".join(pieces).decode("utf-8", "replace")
    return decode

def read_text(data_dir, relative, what):
    """The UTF-8 text of data_dir/relative, or DataError naming the file (what: whose file it is)."""
    path = os.path.join(data_dir, relative)
    if not os.path.isfile(path):
        raise DataError(f"{what}: expected {path} (--data-dir {data_dir})")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{what}: {path} cannot be read as UTF-8 text ({type(err).__name__})")

def encode_documents(encoding, documents):
    """GPT-2 ids of the documents, each followed by <|endoftext|>, as one stream."""
    ids = [i for doc in documents for i in (*encoding.encode_ordinary(doc), encoding.eot_token)]
    return torch.tensor(ids, dtype=torch.long)

@cached
def lm_dataset(name, data_dir="data", bpe_file=None, train_stories=12000, val_stories=2000):
    """{"train", "val", "test"} token streams, "vocab_size", "decode", "sources" (what was read)."""
    if name == "lm":   # the corpus is Python's own: its source is the token stream
        tokens = byte_tokens(embedded_corpus())
        return {**split_tokens(tokens), "vocab_size": 256, "decode": decode_bytes,
                "test_is_val": False, "sources": {"pydoc_data.topics": tokens}, "root": None}
    if name == "text":
        return text_dataset(data_dir, bpe_file)
    if name == "tinystories":   # the first stories of each file, stories separated by <|endoftext|>
        train_text = read_text(data_dir, TINYSTORIES_FILES[0], "TinyStories training stories")
        val_text = read_text(data_dir, TINYSTORIES_FILES[1], "TinyStories validation stories")
        train_docs = [s for s in map(str.strip, train_text.split(END_OF_TEXT)) if s][:train_stories]
        val_docs = [s for s in map(str.strip, val_text.split(END_OF_TEXT)) if s][:val_stories]
        enc, files = gpt2_encoding(bpe_file), TINYSTORIES_FILES
        val = encode_documents(enc, val_docs)                    # also the test split
        streams = [encode_documents(enc, train_docs), val, val]
    elif name == "wikitext2":
        texts = [read_text(data_dir, rel, f"WikiText-2 raw {split}") for rel, split in
                 zip(WIKITEXT2_FILES, ("train", "validation", "test"))]
        enc, files = gpt2_encoding(bpe_file), WIKITEXT2_FILES
        streams = [torch.tensor(enc.encode_ordinary(t), dtype=torch.long) for t in texts]
    else:
        raise ValueError(f"unknown language task {name!r}")
    return {**dict(zip(("train", "val", "test"), streams)), "vocab_size": enc.n_vocab,
            "decode": gpt2_decoder(enc), "test_is_val": name == "tinystories", "root": data_dir,
            "sources": corpus_sources(data_dir, [os.path.join(data_dir, f) for f in files], bpe_file)}

def corpus_sources(data_dir, paths, bpe_file):
    """{file below data_dir: its path (each once), "--bpe-file": the ranks file or None}."""
    return {**{os.path.relpath(path, data_dir): path for path in dict.fromkeys(paths)}, "--bpe-file": bpe_file}

def check_lm_splits(data, block_size):
    """DataError for a context longer than a split (named by its file for --task text)."""
    for split in ("train", "val", "test"):
        if len(data[split]) > block_size + 1:
            continue
        name, more = f"the {split} split", ""
        if "files" in data:
            name, more = data["files"][split], ", or give it more text"
        raise DataError(f"--block-size {block_size} needs more tokens than {name} holds "
                        f"({len(data[split])}): choose a block size below {len(data[split]) - 1}{more}")

def lm_batch(tokens, block_size, batch_size, generator):
    """nanoGPT's get_batch: batch_size random windows; inputs (B, T) and next-token targets (B, T)."""
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(block_size)                      # (B, T)
    return tokens[index], tokens[index + 1]

def lm_windows(tokens, block_size):
    """The whole split in consecutive windows, inputs (W, T) and targets (W, T), every token after
    the first predicted once (targets of -100, which cross-entropy ignores, pad the last window)."""
    n = len(tokens) - 1
    windows = -(-n // block_size)
    x = torch.zeros(windows * block_size, dtype=torch.long)
    y = torch.full((windows * block_size,), -100, dtype=torch.long)
    x[:n], y[:n] = tokens[:-1], tokens[1:]
    return x.view(windows, block_size), y.view(windows, block_size)

@torch.no_grad()
def lm_loss(model, tokens, block_size, batch=64):
    """Mean next-token cross-entropy over every token of a split (not a sample of batches)."""
    with evaluating(model) as device:
        x, y = lm_windows(tokens, block_size)
        total, count = 0.0, 0
        for i in range(0, len(x), batch):
            with autocast(device):
                logits = model(x[i:i + batch].to(device))
            targets = y[i:i + batch].to(device)
            total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                       ignore_index=-100, reduction="sum").item()
            count += (targets != -100).sum().item()
    return total / count

# The paper's Table "Perplexity (PPL) comparison" (val, test).
PAPER_LM = paper_table(("default", "mask", "mimetic"), {
    "wikitext2": [(172.78, 181.91), (166.76, 179.70), (178.34, 188.87)],
    "tinystories": [(10.42, 10.49), (10.40, 10.48), (10.64, 10.60)]})


# === 5. Your own data: a folder of images (--task images), text files (--task text) ==============
# Both are checked up front: bad data (empty, binary, one class, an unreadable image, ...) is one
# DataError naming the file, before anything trains.
TEXT_FILES = ("train.txt", "valid.txt", "test.txt")    # --task text: the last one optional
TEXT_LAYOUT = ("DIR/train.txt and DIR/valid.txt (DIR/test.txt optional), UTF-8 text; byte tokens, "
               "or GPT-2's with --bpe-file")

def text_dataset(data_dir, bpe_file=None):
    """--task text (TEXT_FILES in data_dir); DataError for a missing, empty, binary or non-UTF-8 file."""
    files = {split: os.path.join(data_dir, name) for split, name in zip(("train", "val", "test"), TEXT_FILES)}
    if not os.path.exists(files["test"]):
        files["test"] = files["val"]
    texts = {}
    for split, path in files.items():
        texts[split] = read_text(data_dir, os.path.basename(path), "text")
        if not texts[split].strip():
            raise DataError(f"text: {path} is empty (or white space only)")
        if "\0" in texts[split]:
            raise DataError(f"text: {path} holds NUL bytes: a binary file (or UTF-16), not UTF-8 text")
    if bpe_file is None:                   # UTF-8 bytes
        streams = {split: byte_tokens(text) for split, text in texts.items()}
        vocab, decode, tokenizer = 256, decode_bytes, "UTF-8 bytes"
    else:                                  # GPT-2's tokens
        encoding = gpt2_encoding(bpe_file)
        streams = {split: torch.tensor(encoding.encode_ordinary(text), dtype=torch.long)
                   for split, text in texts.items()}
        vocab, decode, tokenizer = encoding.n_vocab, gpt2_decoder(encoding), f"GPT-2 BPE ({bpe_file})"
    test_is_val = files["test"] == files["val"]
    info = {"files": files, "tokenizer": tokenizer, "test_is_val": test_is_val,
            "tokens": {split: len(tokens) for split, tokens in streams.items()}}
    return {**streams, "vocab_size": vocab, "decode": decode, "test_is_val": test_is_val, "files": files,
            "info": {"data": info}, "sources": corpus_sources(data_dir, files.values(), bpe_file),
            "root": data_dir}

# --task images (IMAGES_LAYOUT): classes sorted by name (label = position, as ImageFolder), hidden and
# non-image files skipped. Each file is read once: a folder is entered once (a loop `ln -s . loop`, or a
# second link to one folder, is walked once), a link back into the tree's own folders (another class, or
# a folder above the class folder: `up -> ..`) is not followed, and no file may be in two classes, nor
# both trained on and held out. Every header is read up front (PIL's Image.verify): a damaged file is
# named before training, and the channels are 1 if all images are grey, else 3. The one-folder layout
# holds out IMAGE_HOLD_OUT of each class by the fixed IMAGE_SPLIT_SEED (every init and seed sees the same
# images). Images are resized to --image-size: the ViT's patch grid, hence the prior, must be fixed. Wide
# images (16-bit, 32-bit integer, float) are scaled to 8 bits by one range for the whole tree (the
# "wide_range" of result.json's "data"), never clipped.
IMAGES_LAYOUT = ("DIR/train/<class>/<image> and DIR/val/<class>/<image> (or validation/, test/), "
                 "or DIR/<class>/<image> with 10 % of each class held out")
OWN_DATA_HELP = (f"your own data:\n  --task images --data-dir DIR  {IMAGES_LAYOUT}\n"
                 f"  --task text --data-dir DIR    {TEXT_LAYOUT}")   # train.py --help, at the end
IMAGE_EVAL_FOLDERS = ("val", "validation", "test")
IMAGE_HOLD_OUT = 0.1
IMAGE_SPLIT_SEED = 0
WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")   # PIL's one-channel modes wider than 8 bits
GREY_MODES = ("1", "L", "LA", *WIDE_MODES)                  # PIL modes of one-channel images

class ImageFiles(torch.utils.data.Dataset):
    """torchvision's ImageFolder over a list of (path, label) samples, read by PIL as mode "L" or "RGB";
    a wide image's values v become 255 v / wide_range first (PIL's own conversion would clip at 255)."""
    def __init__(self, samples, classes, mode, transform, wide_range=None):
        self.samples, self.classes, self.mode, self.transform = samples, classes, mode, transform
        self.wide_range = wide_range
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, i):
        from PIL import Image
        path, label = self.samples[i]
        try:   # a file whose header was fine but whose pixels are cut short fails only here
            with Image.open(path) as image:
                if image.mode in WIDE_MODES:   # "I" or "F" first: PIL scales those two linearly
                    wide = image.convert("F" if image.mode == "F" else "I")
                    image = wide.point(self.to_8_bits).convert("L")
                image = image.convert(self.mode)
        except OSError as err:
            raise DataError(f"images: {path} cannot be decoded ({err}): delete or replace it")
        return self.transform(image), label
    def to_8_bits(self, value):
        return value * (255 / self.wide_range)

def identity(path):
    """(device, inode) of the file or folder at path: two paths (links) to one file are one file."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino

def image_files(folder, hint):
    """{class: its image files, sorted} below folder/<class>/ (the train/ or val/ folder, or the one folder),
    each file once; DataError for no folder, fewer than two classes, or a class without images."""
    from torchvision.datasets.folder import IMG_EXTENSIONS
    if not os.path.isdir(folder):
        raise DataError(f"images: no folder {folder} ({hint})")
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    if len(classes) < 2:
        found = f"one class folder, {classes[0]}/" if classes else "no class folders"
        raise DataError(f"images: {folder} holds {found}; a classifier needs two or more ({hint})")
    walked = set()                # folders not to enter (again): each class folder and every folder above one
    for name in classes:
        path = os.path.realpath(os.path.join(folder, name))
        while identity(path) not in walked:           # up to the file system's root
            walked.add(identity(path))
            path = os.path.dirname(path)
    files = {}
    for name in classes:
        found = {}                                    # identity -> the first path to it, in name order
        for parent, subfolders, names in os.walk(os.path.join(folder, name), followlinks=True):
            entered = []
            for sub in sorted(subfolders):
                if identity(os.path.join(parent, sub)) not in walked:   # not a loop, a second link, `up -> ..`
                    walked.add(identity(os.path.join(parent, sub)))
                    entered.append(sub)
            subfolders[:] = entered
            for file in sorted(names):
                path = os.path.join(parent, file)
                if file.lower().endswith(IMG_EXTENSIONS) and not file.startswith(".") and os.path.isfile(path):
                    found.setdefault(identity(path), path)
        files[name] = sorted(found.values())
        if not files[name]:
            raise DataError(f"images: {os.path.join(folder, name)} holds no image files ({' '.join(IMG_EXTENSIONS)})")
    return files

def hold_out(files, folder):
    """(train, held-out) {class: paths}: IMAGE_HOLD_OUT of each class (at least one image) held out."""
    generator = torch.Generator().manual_seed(IMAGE_SPLIT_SEED)
    train, held = {}, {}
    for name, paths in files.items():
        if len(paths) < 2:
            raise DataError(f"images: {folder}/{name} holds one image; holding out 10 % of each "
                            f"class (at least one image) needs two or more per class")
        order = torch.randperm(len(paths), generator=generator).tolist()
        count = max(1, round(IMAGE_HOLD_OUT * len(paths)))
        held[name] = sorted(paths[i] for i in order[:count])
        train[name] = sorted(paths[i] for i in order[count:])
    return train, held

def check_each_file_once(train, held):
    """DataError naming a file in two classes, or both trained on and held out (the same file, by any path)."""
    first = {}                                        # identity -> (role, class, path) where first found
    for role, files in (("trained on", train), ("held out", held)):
        for name, paths in files.items():
            for path in paths:
                other_role, other_name, other = first.setdefault(identity(path), (role, name, path))
                if other_role != role:
                    raise DataError(f"images: {path} is held out and also trained on (as {other}): a file "
                                    f"may be in one of the two only")
                if other_name != name:
                    raise DataError(f"images: {path} is in class {name} and also in class {other_name} "
                                    f"(as {other}): a file may be in one class only")

def image_header(path):
    """(PIL mode, (width, height), the largest value of a wide image, else None) of an image file checked
    by Image.verify, or DataError."""
    from PIL import Image
    try:
        with Image.open(path) as image:
            mode, size = image.mode, image.size
            image.verify()
        if mode not in WIDE_MODES:
            return mode, size, None
        with Image.open(path) as image:   # verify leaves the image unusable: opened again
            return mode, size, (image.convert("F") if mode != "F" else image).getextrema()[1]
    except Exception as err:   # PIL raises UnidentifiedImageError, SyntaxError, struct.error, ...
        raise DataError(f"images: {path} is not a readable image ({type(err).__name__}): delete "
                        f"or replace it")

def image_folder_dataset(data_dir, image_size, randaugment_magnitude=9, crop_scale=0.08):
    """--task images from the user's ImageFolder tree (IMAGES_LAYOUT); "info": result.json's "data"."""
    hint = f"--data-dir DIR: {IMAGES_LAYOUT}"
    train_dir = os.path.join(data_dir, "train")
    eval_name = next((n for n in IMAGE_EVAL_FOLDERS if os.path.isdir(os.path.join(data_dir, n))), None)
    if os.path.isdir(train_dir) and eval_name:
        eval_dir = os.path.join(data_dir, eval_name)
        train, held = image_files(train_dir, hint), image_files(eval_dir, hint)
        for have, lack, have_dir, lack_dir in ((train, held, train_dir, eval_dir),
                                               (held, train, eval_dir, train_dir)):
            missing = sorted(set(have) - set(lack))
            if missing:
                raise DataError(f"images: class {missing[0]} has a folder in {have_dir} but not in "
                                f"{lack_dir}; both need the same class folders")
        layout = {"layout": "train and eval folders", "train_folder": train_dir,
                  "eval_folder": eval_dir, "split_seed": None}
    elif os.path.isdir(train_dir):
        raise DataError(f"images: {train_dir} has no evaluation folder beside it (val/, "
                        f"validation/ or test/, with the same class folders)")
    else:
        train, held = hold_out(image_files(data_dir, hint), data_dir)
        layout = {"layout": "one folder, 10 % of each class held out", "train_folder": data_dir,
                  "eval_folder": data_dir, "split_seed": IMAGE_SPLIT_SEED}
    check_each_file_once(train, held)
    classes = sorted(train)
    samples = {}                  # "train" and "test": [(path, label)]
    for split, files in (("train", train), ("test", held)):
        samples[split] = [(path, label) for label, name in enumerate(classes) for path in files[name]]
    headers = [image_header(path) for split in ("train", "test") for path, _ in samples[split]]
    channels = 1 if all(mode in GREY_MODES for mode, _, _ in headers) else 3
    wide = max((top for _, _, top in headers if top is not None), default=None)
    if wide is not None:          # the largest value, rounded up to 1 (floats in [0, 1]), 255 or 65535 if below
        wide = next((nominal for nominal in (1.0, 255.0, 65535.0) if wide <= nominal), wide)
    datasets = {}
    for split in ("train", "test"):
        transform = vision_transform("images", image_size, split == "train", randaugment_magnitude, crop_scale,
                                     channels)
        datasets[split] = ImageFiles(samples[split], classes, "L" if channels == 1 else "RGB", transform, wide)
    widths, heights = zip(*(size for _, size, _ in headers))
    info = {**layout, "classes": classes, "train_images": len(samples["train"]),
            "eval_images": len(samples["test"]), "channels": channels, "resized_to": image_size,
            "source_size_min": [min(widths), min(heights)], "source_size_max": [max(widths), max(heights)],
            **({"wide_range": wide} if wide else {})}
    sources = {}                  # per class folder and role: a refusal of --resume names the folder that changed
    for role, files, top in (("trained on", train, layout["train_folder"]), ("held out", held, layout["eval_folder"])):
        for name, paths in files.items():   # "train/disc", "val/disc"; one folder: "disc (trained on)"
            sources[f"{name} ({role})" if top == data_dir else f"{os.path.basename(top)}/{name}"] = paths
    return {**datasets, "classes": len(classes), "channels": channels, "info": {"data": info},
            "sources": sources, "root": data_dir}

# === 6. Reports: result tables, ours beside the paper's numbers above (table.md) ==================
# A table's row is one key: the runs of one task and init with one config (every key of result.json's
# "config"; the seed is not one of them) on one data set, mean ± std over their seeds. Two configs or two
# data sets are never averaged: they are rows of their own. A table's columns are the settings
# (settings_of) that tell two rows of one task apart, and train frac, mask error, mask lr and prior
# wherever a row sets them: such a row is not the paper's experiment, whatever the other rows are.
FAMILY_OF = {**{t: "boolean" for t in BOOLEAN_TASKS}, **{t: "arithmetic" for t in ARITHMETIC_TASKS},
             **{t: "language" for t in LM_TASKS}, **{t: "vision" for t in VISION_TASKS}}
ALWAYS_SHOWN = ("train frac", "mask error", "mask lr", "prior")   # a column wherever a row sets it

def fmt(value, digits=4):
    """A number as tables print it: 4 significant digits, whole from 1000 on; None: "n/a"."""
    if value is None:
        return "n/a"
    if abs(value) < 1000:
        return f"{value:.{digits}g}"
    return f"{value:.0f}"

def mean_std(values):
    """"mean ± std" of the finite values; seeds without one are counted: "0.5 ± 0.1 (1 of 3: inf)"."""
    numbers = [v for v in values if v is not None and math.isfinite(v)]
    others = [v for v in values if v is None or not math.isfinite(v)]
    if not values:
        return "—"
    said = ", ".join(sorted({fmt(v) for v in others}))      # "inf", "n/a", ...
    if not numbers:
        return said
    note = f" ({len(others)} of {len(values)}: {said})" if others else ""
    try:
        std = statistics.stdev(numbers) if len(numbers) > 1 else 0.0
        text = f"{fmt(statistics.fmean(numbers))} ± {fmt(std, 2)}"
    except OverflowError:                # finite values whose sum is not: beyond float range
        text = "overflow"
    return text + note

def setting_text(value):
    """A setting as tables and legends write it: "—" for none, 0.001 as "0.001", anything else as str."""
    if value is None:
        return "—"
    return f"{value:g}" if isinstance(value, float) else str(value)

def edit_order(error):
    """(kind, fraction) of a mask error, its sort key: the exact prior (None) first."""
    kind, _, fraction = (error or "").partition(":")
    return kind, float(fraction or 0)

def data_label(result):
    """"<data folder> <8 hex of the fingerprint>" of a run on files (corpora, images), else None: generated
    data (Boolean, arithmetic) follow from the task, the config and the seed."""
    if FAMILY_OF[result["task"]] in ("boolean", "arithmetic") or not result.get("data_fingerprint"):
        return None
    digest = hashlib.sha256(json.dumps(result["data_fingerprint"], sort_keys=True).encode()).hexdigest()
    folder = os.path.basename(os.path.normpath(result.get("data_dir") or ""))
    return f"{folder} {digest[:8]}".strip()

def settings_of(result):
    """{column: value} of a run's settings but its seed, in table.md's order: the task (its mask variant
    in brackets), train frac, init, the mask's settings (A: --mask-magnitude; prior: "<source run>, τ
    <TAU>" of --mask-from, else None), data (data_label), then every other config key by its name."""
    config = result["config"]
    task, variant, source = result["task"], config.get("mask_variant"), config.get("mask_from")
    settings = {"task": f"{task} ({variant})" if variant else task, "train frac": config.get("train_frac"),
                "init": result["init"], "A": config.get("mask_magnitude"),
                "mask decay": config.get("mask_decay") or 0.0, "mask error": config.get("mask_error"),
                "mask lr": config.get("mask_lr"), "prior": None, "data": data_label(result)}
    if source:                 # the learned prior's keys (mask_from_*, mask_density) follow from these two
        settings["prior"] = f"{os.path.basename(os.path.abspath(source))}, τ {config['mask_threshold']:g}"
    said = ("train_frac", "mask_magnitude", "mask_decay", "mask_error", "mask_lr", "mask_variant",
            "mask_threshold", "mask_density")
    for key, value in sorted(config.items()):
        if key not in said and not key.startswith("mask_from"):
            settings[key.replace("_", " ")] = value
    return settings

def setting_texts(result):
    """settings_of(result) as table.md and the chart legends write it; the prior: its source, "hand-made"
    (the task's own, in M) or "—" (none); the mask error: "none" for the exact prior."""
    texts = {column: setting_text(value) for column, value in settings_of(result).items()}
    if result["config"].get("mask_error") is None:
        texts["mask error"] = "none"
    if not result["config"].get("mask_from"):   # a result.json written before "mask_prior": the mask inits
        mask_prior = result.get("mask_prior", result["init"] in ("mask", "mask-fixed", "mask-hadamard"))
        texts["prior"] = "hand-made" if mask_prior else "—"
    return texts

def group_runs(results, init_order):
    """[(settings_of, its runs, seeds rising)] per key, in the tables' order: task, train frac, A,
    mask decay, mask error, init, prior, mask lr, data, then the rest of the config."""
    def order(result):
        s = settings_of(result)
        return (list(FAMILY_OF).index(result["task"]), s["train frac"] or 0, s["A"] or 0, s["mask decay"],
                edit_order(s["mask error"]), init_order.index(result["init"]), s["prior"] or "",
                s["mask lr"] or 0, s["data"] or "", json.dumps(result["config"], sort_keys=True), result["seed"])
    groups = {}
    for r in sorted(results, key=order):
        key = (r["task"], r["init"], json.dumps(r["config"], sort_keys=True), data_label(r))   # the one key
        groups.setdefault(key, []).append(r)
    return [(settings_of(runs[0]), runs) for runs in groups.values()]

def varied(settings):
    """The columns, in settings' order, whose value differs between two of these settings of one task."""
    by_task = {}
    for s in settings:
        by_task.setdefault(s["task"], []).append(s)
    columns = dict.fromkeys(column for s in settings for column in s)
    return [c for c in columns if any(len({json.dumps(s.get(c)) for s in same}) > 1 for same in by_task.values())]

# Each family's columns: (header, key of "final": mean ± std over seeds, or a function (the finished
# runs' result.json dicts, settings_of) -> text). The paper's numbers stand beside its own setting only,
# with what a run changed of its preset (result.json's preset_changes) said beside them.
def paper(table, i=None):
    """A column of the paper's numbers from table (its i-th number per cell, if i is given)."""
    def column(done, s):
        own_setting = not (s["mask error"] or s["prior"]) and s["train frac"] == ARITHMETIC_TRAIN_FRAC.get(s["task"])
        number = table.get((s["task"], s["init"])) if own_setting else None
        cell = fmt(number[i] if number and i is not None else number)
        changes = (done[0].get("preset_changes") or {}) if done and number else {}
        said = [f"{key.replace('_', ' ')} {setting_text(ours)}, not the preset's {setting_text(theirs)}"
                for key, (ours, theirs) in sorted(changes.items())]
        return f"{cell} (this run: {'; '.join(said)})" if said else cell
    return column

def closer(final):
    """A Boolean run's unseen predictions lie closer to the target than to the MDI (Section 5.1)."""
    return final["unseen_loss"] < final["unseen_mse_to_mdi"]

# A Boolean run fitted its training set when its training MSE is below 1 % of the variance of the target
# over the seen points (R^2 > 0.99): a constant predictor (MSE = that variance) or a run cut short is not
# counted as having learned the target, however its unseen predictions fall.
FIT_FRACTION = 0.01

def fitted(result):
    seen_variance = boolean_dataset(result["task"])["y_train"].var(unbiased=False).item()
    loss = result["final"].get("train_loss")
    return loss is not None and loss < FIT_FRACTION * seen_variance

def learned_target(done, s):
    """Table 1's "target": the seeds that fit their training set and extrapolate nearer the target."""
    return f"{sum(closer(r['final']) and fitted(r) for r in done)}/{len(done)}"

def plain(*keys):
    """Columns headed by their keys, spaced: "prior mass init" for prior_mass_init."""
    return [(key.replace("_", " "), key) for key in keys]

PRIOR_MASS_COLUMNS = plain("prior_mass_init", "prior_mass_final")
PERSISTENCE_COLUMNS = PRIOR_MASS_COLUMNS + plain("pattern_corr_init", "pattern_corr_final", "mask_drift")
# With an edited or learned prior: the attention mass on the task's exact pattern as well.
TRUE_MASS_COLUMNS = plain("true_prior_mass_init", "true_prior_mass_final")
BOOLEAN_COLUMNS = [
    *plain("train_loss", "test_loss"), ("test acc (%)", "test_acc"),
    ("unseen MSE to target", "unseen_loss"), ("unseen MSE to MDI", "unseen_mse_to_mdi"),
    ("learned target", learned_target),
    ("paper loss", paper(PAPER_BOOLEAN, 0)), ("paper acc (%)", paper(PAPER_BOOLEAN, 1))]
ARITHMETIC_COLUMNS = [
    ("seq acc (%)", "seq_acc"), ("digit acc (%)", "digit_acc"), *plain("test_loss", "train_loss"),
    *PRIOR_MASS_COLUMNS, ("paper seq acc", paper(PAPER_ARITHMETIC, 0)),
    ("paper digit acc", paper(PAPER_ARITHMETIC, 1)), ("paper loss", paper(PAPER_ARITHMETIC, 2))]
LM_COLUMNS = [*plain("val_ppl", "test_ppl"), ("train tokens/s", "tokens_per_second"),
              *plain("mask_drift"), ("paper val ppl", paper(PAPER_LM, 0)),
              ("paper test ppl", paper(PAPER_LM, 1))]
VISION_COLUMNS = [("best top-1 (%)", "best_top1"), ("final top-1 (%)", "top1"), *PRIOR_MASS_COLUMNS,
                  *plain("mask_drift"), ("train images/s", "images_per_second"),
                  ("paper best top-1 (%)", paper(PAPER_VISION))]
HEADER = {key: header for columns in (BOOLEAN_COLUMNS, ARITHMETIC_COLUMNS, LM_COLUMNS, VISION_COLUMNS)
          for header, key in columns if isinstance(key, str)}
# The numbers summary_line prints of a run, in this order, named by their headers.
SUMMARY = {"boolean": ("test_loss", "test_acc", "unseen_loss", "unseen_mse_to_mdi"),
           "arithmetic": ("seq_acc", "digit_acc", "test_loss", "train_loss"),
           "language": ("val_ppl", "test_ppl", "tokens_per_second"),
           "vision": ("top1", "best_top1", "test_loss", "images_per_second")}

def markdown_table(results, columns, init_order):
    """A row per key, mean ± std over its seeds; the setting columns (see the top of this section),
    "seeds" (finished / all), then the family's columns."""
    rows = group_runs(results, init_order)
    settings = [s for s, _ in rows]
    apart = varied(settings)
    every = dict.fromkeys(c for s in settings for c in s)     # every setting, in settings_of's order
    shown = [c for c in every if c in ("task", "init") or c in apart
             or c in ALWAYS_SHOWN and any(s[c] for s in settings)]
    header = [*shown, "seeds", *[h for h, _ in columns]]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for s, runs in rows:
        done = [r for r in runs if r["status"] == "done"]
        texts = setting_texts(runs[0])
        cells = [texts.get(c, "—") for c in shown] + [f"{len(done)}/{len(runs)}"]
        for _, how in columns:
            cells.append(how(done, s) if callable(how) else mean_std([r["final"].get(how) for r in done]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

def summary_line(result):
    """A finished run in one line: its SUMMARY numbers by their headers, prior masses, seconds, sample."""
    f, c, family = result["final"], result["config"], FAMILY_OF[result["task"]]
    head = [result["task"], result["init"], f"seed {result['seed']}"]
    if c.get("mask_error"):
        head.append(f"prior {c['mask_error']}")
    if c.get("mask_from"):
        head.append(f"prior from {settings_of(result)['prior']}")
    if family == "arithmetic":
        head.append(f"train frac {c['train_frac']:g}")
    notes = {}                                       # said after a number
    if family == "boolean":
        fit = "" if fitted(result) else "; the training set is not fitted"
        notes["unseen_mse_to_mdi"] = f" (closer to the {'target' if closer(f) else 'MDI'}{fit})"
    if family == "arithmetic":
        notes["test_loss"] = f" on {result['eval_pairs']} held-out pairs"
    if family == "language" and f["test_is_val"]:
        notes["test_ppl"] = " (= val)"
    said = []
    for key in SUMMARY[family]:
        value = fmt(f[key])                          # KeyError: not a result of train.py
        if f[key] is not None and "(%)" in HEADER[key]:
            value = f"{f[key]:.2f}%"
        said.append(f"{HEADER[key].replace(' (%)', '').removeprefix('final ')} {value}{notes.get(key, '')}")
    if "warmup_shortened_from" in c:
        said.append(f"warmup shortened from {c['warmup_shortened_from']} to {c['warmup_epochs']} epochs")
    masses = ["prior_mass"] if f.get("prior_mass_init") is not None else []
    if f.get("true_prior_mass_init") is not None and (c.get("mask_error") or c.get("mask_from")):
        masses.append("true_prior_mass")
    said += [f"{key.replace('_', ' ')} {f[key + '_init']:.2f} -> {f[key + '_final']:.2f}" for key in masses]
    sample = f"\n  sample: {f['sample'][:300]!r}" if "sample" in f else ""
    return f"{' / '.join(head)}: {', '.join(said)}, {result['seconds']:.0f} s{sample}"

# Line charts (line_chart): rows of Panels, a legend beside a row; a line = mean, band = range over seeds.
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#17becf", "#bcbd22"]   # an init's colour: by its place in the order the caller gives
DASHES = ["", "7,4", "2,3", "9,3,2,3"]        # SVG stroke-dasharray: solid, dashed, dotted, dash-dot

def colour(init, init_order):
    return COLOURS[init_order.index(init) % len(COLOURS)]

# lines [(label, colour, dash, [(x, mean, lowest, highest)])]; x: "linear" (from 0), "log" (ticks at
# the data's x, written by tick) or category names (x indexes them, "\n" breaks one); y: (lo, hi) or
# None (0 to 100 for a "(%)" label, else the data's range, log across a factor of ten).
Panel = namedtuple("Panel", "lines x_label y_label title x y tick",
                   defaults=("", "linear", None, "{:g}".format))

def seed_band(by_x):
    """{x: the seeds' values} -> [(x, mean, lowest, highest)], x rising: a line and its band."""
    return [(x, statistics.fmean(v), min(v), max(v)) for x, v in sorted(by_x.items())]

def bands(points):
    """{panel: {line: seed_band}} of (panel, line, x, value) points, in their order; a value that is None
    or not finite is left out."""
    values = {}
    for panel, line, x, value in points:
        if value is not None and math.isfinite(value):
            values.setdefault(panel, {}).setdefault(line, {}).setdefault(x, []).append(value)
    return {panel: {line: seed_band(by_x) for line, by_x in lines.items()} for panel, lines in values.items()}

def nice_ticks(lo, hi, log=False, whole=False):
    """Round ticks in [lo, hi]: steps of 1, 2 or 5 x 10^k, about five (whole: steps >= 1, for epochs
    and iterations); log: powers of ten (and 2, 5 times them across < 3 decades)."""
    if log:
        decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        mantissas = (1,) if len(decades) > 3 else (1, 2, 5)
        return [m * 10.0 ** k for k in decades for m in mantissas if lo <= m * 10.0 ** k <= hi]
    raw = max((hi - lo) / 5, 1.0 if whole else 0.0) or 1.0
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw * 0.999)
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [t for t in (round(k * step, 10) for k in range(first, last + 1)) if lo <= t <= hi]

def pixel(value, lo, hi, start, end, log=False):
    """The pixel of a value: [lo, hi] onto [start, end], on a linear or a log scale."""
    f = math.log10 if log else float
    return start + (f(value) - f(lo)) / ((f(hi) - f(lo)) or 1) * (end - start)

def svg_text(x, y, content, **attributes):
    """<text> of the escaped content at (x, y), attributes by Python names (text_anchor: text-anchor)."""
    more = "".join(f' {key.replace("_", "-")}="{value}"' for key, value in attributes.items())
    return f'<text x="{x}" y="{y}"{more}>{escape(content)}</text>'

def svg_file(width, height, parts, background=""):
    """The SVG file of line_chart and heatmap_svg: the parts in 11 px sans-serif, on a background."""
    fill = f'<rect width="100%" height="100%" fill="{background}"/>' if background else ""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">{fill}' + "".join(parts) + "</svg>\n")

def stroke(colour, dash):
    return f'stroke="{colour}" stroke-width="2" stroke-dasharray="{dash or "none"}"'

def chart_panel(p, x0, y0, width, height):
    """A Panel at (x0, y0) as an SVG group: its title, axes, grey lines at the ticks, labels, lines."""
    left, right, top, bottom = 64, width - 14, 24 if p.title else 8, height - 46
    points = [point for *_, pts in p.lines for point in pts]
    ys = [v for point in points for v in point[1:]]
    percent = "(%)" in p.y_label
    log = p.y is None and not percent and min(ys) > 0 and max(ys) >= 10 * min(ys)
    if p.y:                                  # the y range: given, 0-100 %, a decade and more (log),
        lo, hi = p.y                         # or the data's with a margin, from 0 if all are >= 0
    elif percent:
        lo, hi = 0.0, 100.0
    elif log:
        lo, hi = min(ys) / 1.15, max(ys) * 1.15
    else:
        pad = (max(ys) - min(ys)) * 0.06 or abs(max(ys)) * 0.1 or 1.0
        lo, hi = min(ys) - pad, max(ys) + pad
        if min(ys) >= 0:
            lo = max(lo, 0.0)
    y_ticks = nice_ticks(lo, hi, log)
    if isinstance(p.x, list):                # categories, evenly spaced
        x_ticks, tick_texts = range(len(p.x)), p.x
    else:                                    # log: the data's own x; linear: from 0
        xs = sorted({x for x, *_ in points}) if p.x == "log" else [0, max(x for x, *_ in points) or 1]
        x_ticks = xs if p.x == "log" else nice_ticks(0, xs[-1], whole=True)
        tick_texts = [p.tick(x) for x in x_ticks]
    def px(x):                               # a category's centre, or x on the panel's own range
        if isinstance(p.x, list):
            return left + (x + 0.5) / len(p.x) * (right - left)
        return pixel(x, xs[0], xs[-1], left, right, p.x == "log")
    def py(y):
        return pixel(y, lo, hi, bottom, top, log)
    def path(pts):                           # "x,y x,y ..." in pixels
        return " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
    middle, centre = (top + bottom) / 2, (left + right) / 2
    parts = [f'<g transform="translate({x0},{y0})">',
             svg_text(centre, 16, p.title, text_anchor="middle", font_size=13)]
    parts += [f'<path d="M{px(x):.1f},{top}V{bottom}" stroke="#e4e4e4"/>' for x in x_ticks]
    parts += [f'<path d="M{left},{py(y):.1f}H{right}" stroke="#e4e4e4"/>' for y in y_ticks]
    parts.append(f'<path d="M{left},{top}V{bottom}H{right}" fill="none" stroke="black"/>')
    for x, text in zip(x_ticks, tick_texts):
        spans = [f'<tspan x="{px(x):.1f}" dy="{12 * (i > 0)}">{escape(line)}</tspan>'
                 for i, line in enumerate(text.split("\n"))]
        parts.append(f'<text x="{px(x):.1f}" y="{bottom + 14}" text-anchor="middle">{"".join(spans)}</text>')
    parts += [svg_text(left - 5, f"{py(y) + 4:.1f}", f"{y:g}".replace("e-0", "e-"), text_anchor="end")
              for y in y_ticks]
    parts += [svg_text(centre, bottom + 40, p.x_label, text_anchor="middle"),
              svg_text(14, middle, p.y_label + (", log scale" if log else ""),
                       transform=f"rotate(-90 14 {middle})", text_anchor="middle")]
    for label, colour, dash, pts in p.lines:
        if any(low != high for *_, low, high in pts):
            outline = [(x, high) for x, *_, high in pts] + [(x, low) for x, _, low, _ in reversed(pts)]
            parts.append(f'<polygon points="{path(outline)}" fill="{colour}" fill-opacity="0.18" stroke="none"/>')
        parts.append(f'<polyline points="{path([(x, m) for x, m, *_ in pts])}" fill="none" '
                     f'{stroke(colour, dash)}><title>{escape(label)}</title></polyline>')
        parts += [f'<circle cx="{px(x):.1f}" cy="{py(m):.1f}" r="2.5" fill="{colour}"/>'
                  for x, m, *_ in pts if len(pts) <= 30]   # every evaluation, and a line of one point
    return "".join(parts) + "</g>"

def line_chart(rows, caption="", width=360, height=250):
    """The one line-chart writer: an SVG of rows under a caption, each a heading ("" or (name, note)),
    Panels side by side (None: a gap) and a legend (None or (title, [(colour, dash, text)])) right of it."""
    parts, y, figure_width = [svg_text(10, 20, caption, font_size=13)], 34 if caption else 0, 0
    for heading, panels, legend in rows:
        if heading:
            name, note = heading
            parts += [svg_text(10, y + 14, name, font_size=14, font_weight="bold"),
                      svg_text(18 + 9 * len(name), y + 14, note)]
            y += 22
        parts += [chart_panel(p, i * width, y, width, height) for i, p in enumerate(panels) if p]
        x, (title, entries) = len(panels) * width + 6, legend or ("", [])
        parts.append(svg_text(x, y + 18, title, font_size=12))
        parts += [f'<path d="M{x},{y + 36 + 18 * i}h26" {stroke(colour, dash)}/>'
                  + svg_text(x + 32, y + 40 + 18 * i, text) for i, (colour, dash, text) in enumerate(entries)]
        figure_width = max(figure_width, x + 40 + 7 * max([len(text) for *_, text in entries], default=-6))
        y += max(height, 44 + 18 * len(entries))
    return svg_file(figure_width, y, parts, background="white")

# curves.svg: per task the training loss and the main metric against the epoch or iteration.
LOSS_LABELS = {"boolean": "training loss (MSE)", "arithmetic": "training loss (cross-entropy / digit)",
               "language": "training loss (cross-entropy / token)", "vision": "training loss (cross-entropy)"}

def main_metric(task):
    """(history key, axis label) of the task's main metric, as its table reports it."""
    if FAMILY_OF[task] == "boolean" and BOOLEAN_TASKS[task] is None:     # threesym: no accuracy
        return "test_loss", "test loss (MSE), whole cube"
    return {"boolean": ("test_acc", "test accuracy (%), whole cube"),
            "arithmetic": ("sample_seq_acc", "held-out seq acc (%), 10,000 pairs"),
            "language": ("val_ppl", "validation perplexity"),
            "vision": ("test_top1", "test top-1 accuracy (%)")}[FAMILY_OF[task]]

def mean_band(histories, key):
    """seed_band of key over the seeds' finite values, at each epoch or iteration where some have one."""
    def is_number(value):            # a hand-edited history may hold anything
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    values = {}
    for entry in (e for history in histories for e in history):
        x, value = entry.get("iter", entry.get("epoch")), entry.get(key)
        if is_number(x) and is_number(value):
            values.setdefault(x, []).append(value)
    return seed_band(values)

def curves_svg(results, init_order):
    """curves.svg: a row per task, a line per table row (a colour per init, a dash per setting of it)."""
    drawable = [r for r in results if r["status"] == "done" and isinstance(r.get("history"), list)
                and r["history"] and all(isinstance(e, dict) for e in r["history"])]
    by_task, task_of = {}, {}                         # task label -> init -> its rows; label -> task
    for s, runs in group_runs(drawable, init_order):
        by_task.setdefault(s["task"], {}).setdefault(s["init"], []).append((s, runs))
        task_of[s["task"]] = runs[0]["task"]
    rows = []
    for label, by_init in by_task.items():
        inits = sorted(by_init, key=init_order.index)
        apart = [c for c in varied([s for init in inits for s, _ in by_init[init]]) if c != "init"]
        lines = []
        for init in inits:
            for i, (s, runs) in enumerate(by_init[init]):
                texts = setting_texts(runs[0])
                name = " ".join([init, *[f"{c} {texts.get(c, '—')}" for c in apart]])
                lines.append((name, colour(init, init_order), DASHES[i % len(DASHES)], [r["history"] for r in runs]))
        iterations = any("iter" in h[0] for *_, histories in lines for h in histories)
        family, charts = FAMILY_OF[task_of[label]], []
        for key, y_label in (("train_loss", LOSS_LABELS[family]), main_metric(task_of[label])):
            drawn = [(name, hue, dash, mean_band(histories, key)) for name, hue, dash, histories in lines]
            drawn = [line for line in drawn if line[3]]
            if drawn:
                charts.append(Panel(drawn, "iteration (optimizer steps)" if iterations else "epoch", y_label))
        legend = [(hue, dash, f"{name} ({len(hs)} seed{'s' * (len(hs) > 1)})") for name, hue, dash, hs in lines]
        rows.append(((label, f"{'Boolean' if family == 'boolean' else family} task"), charts, ("", legend)))
    caption = ("Training curves (the histories in result.json): line = mean over seeds, shaded band = "
               "lowest to highest seed")
    return line_chart(rows, caption, width=380) if rows else None

# The sweep figures: a number of the finished runs' "final" dicts against a swept setting.
def accuracy(task):
    """(key of "final", axis label) of a task's accuracy in the sweep figures (threesym: test loss)."""
    if FAMILY_OF[task] == "arithmetic":
        return "seq_acc", "held-out seq acc (%)"
    return ("test_acc", "test acc (%)") if BOOLEAN_TASKS[task] else ("test_loss", "test loss")

def percent(fraction):
    return f"{100 * fraction:g}%"

def sweep_figure(rows, init_order, column, x_label, keys, tick="{:g}".format):
    """A row per key of "final" (None: the task's accuracy), a panel per task, a line per init,
    against the setting column on a log axis; None unless a line has two values of it."""
    figure, inits = [], [i for i in init_order if i in {s["init"] for s, _ in rows}]
    for key in keys:
        points = []                                   # (panel, line, x, y) of every finished run
        for s, runs in rows:
            task = runs[0]["task"]
            for r in runs:
                if r["status"] == "done" and s[column] is not None:
                    points.append(((task, s["task"]), s["init"], s[column], r["final"].get(key or accuracy(task)[0])))
        panels = []
        for (task, title), lines in bands(points).items():
            drawn = [(init, colour(init, init_order), "", pts) for init, pts in lines.items()]
            panels.append(Panel(drawn, x_label, HEADER.get(key, key) if key else accuracy(task)[1], title, "log",
                                tick=tick))
        legend = ("", [(colour(init, init_order), "", init) for init in inits])
        figure.append(("", panels, None if figure else legend))
    swept = any(len(pts) > 1 for _, panels, _ in figure for p in panels for *_, pts in p.lines)
    return line_chart(figure) if swept else None

def imperfect_figure(rows, init_order):
    """imperfect_prior.svg (Appendix "Why Not Just Fix the Mask?": can a learnable mask "refine or
    correct imperfect initial patterns"?): per task and A the accuracy and true prior mass after
    training against --mask-error, mask (a dash per mask lr) vs mask-fixed; grey: the mass at init."""
    rows = [(s, runs) for s, runs in rows if s["init"] in ("mask", "mask-fixed")
            and not (s["mask decay"] or s["prior"])
            and FAMILY_OF[runs[0]["task"]] in ("boolean", "arithmetic")]      # the families --mask-error edits
    if not any(s["mask error"] for s, _ in rows):
        return None
    edits = sorted({s["mask error"] for s, _ in rows}, key=edit_order)
    mask_lrs = {s["mask lr"] for s, _ in rows if s["init"] == "mask"}
    lrs = sorted(lr for lr in mask_lrs if lr is not None)
    if None in mask_lrs:                              # the model's lr first
        lrs.insert(0, None)
    looks = {("mask", lr): (colour("mask", init_order), DASHES[i % len(DASHES)],
                            f"mask, mask lr {'= lr' if lr is None else f'{lr:g}'}") for i, lr in enumerate(lrs)}
    looks[("mask-fixed", None)] = (colour("mask-fixed", init_order), "", "mask-fixed")
    looks["at init"] = ("#999999", "2,2", "at init (mask, mask-fixed)")
    at_init, after, acc = [], [], []                  # (panel, line, x: the edit's place, y) per finished run
    for s, runs in rows:
        task, x = runs[0]["task"], edits.index(s["mask error"])
        panel, line = (task, s["task"], s["A"]), (s["init"], s["mask lr"])
        for f in [r["final"] for r in runs if r["status"] == "done"]:
            at_init.append((panel, "at init", x, f.get("true_prior_mass_init", f.get("prior_mass_init"))))
            after.append((panel, line, x, f.get("true_prior_mass_final", f.get("prior_mass_final"))))
            acc.append((panel, line, x, f.get(accuracy(task)[0])))
    mass = bands(at_init)                             # one grey line: mask's mass at init is mask-fixed's
    for p, lines in bands(after).items():
        mass.setdefault(p, {}).update(lines)          # drawn over the grey line
    acc = bands(acc)
    ticks = [f"{kind}\n{100 * p:g}%" if kind else "exact" for kind, p in map(edit_order, edits)]
    figure = []
    for a in sorted({a for *_, a in acc}, reverse=True):
        for sweep in (acc, mass):
            panels = []
            for task, label in dict.fromkeys(p[:2] for p in acc):
                lines = sweep.get((task, label, a))
                if not lines:
                    panels.append(None)               # a gap
                    continue
                y_label, y = accuracy(task)[1], None
                if sweep is mass:                     # from the lowest mass's tenth (at most 0.9) to 1
                    lowest = min(low for pts in lines.values() for _, _, low, _ in pts)
                    y_label, y = "true prior mass", (min(0.9, math.floor(10 * lowest) / 10), 1.0)
                drawn = [(looks[k][2], *looks[k][:2], pts) for k, pts in lines.items()]
                panels.append(Panel(drawn, "edit of the prior (--mask-error)", y_label, f"{label}, A = {a:g}",
                                    ticks, y))
            figure.append(("", panels, None if figure else ("lines: mean over seeds", list(looks.values()))))
    return line_chart(figure, width=400, height=270)

def result_tables(results, init_order):
    """table.md's markdown, per family its tables, and {file name: SVG} of the figures it can draw."""
    families = {FAMILY_OF[r["task"]] for r in results}
    edited = any(r["config"].get("mask_error") for r in results)
    truth = TRUE_MASS_COLUMNS if edited or any(r["config"].get("mask_from") for r in results) else []
    sections = []
    for family, title, columns in (
            ("boolean", "Results", BOOLEAN_COLUMNS),
            ("boolean", "Persistence of the prior", PERSISTENCE_COLUMNS + truth),
            ("language", "Perplexity", LM_COLUMNS), ("vision", "Best top-1 accuracy", VISION_COLUMNS + truth),
            ("arithmetic", "Arithmetic", ARITHMETIC_COLUMNS + truth)):
        if family in families:
            table = markdown_table([r for r in results if FAMILY_OF[r["task"]] == family], columns, init_order)
            sections.append(f"## {title}\n\n{table}\n")
    rows = group_runs(results, init_order)
    arithmetic = [(s, runs) for s, runs in rows if FAMILY_OF[runs[0]["task"]] == "arithmetic" and not s["prior"]]
    # "Does the mask learn?" with the exact hand-made prior, at the model's lr, no decay on M
    boolean = [(s, runs) for s, runs in rows if FAMILY_OF[runs[0]["task"]] == "boolean"]
    masks = [(s, runs) for s, runs in boolean if s["init"] in ("mask", "mask-fixed")
             and not (s["mask decay"] or s["mask error"] or s["mask lr"] or s["prior"])]
    figures = {"curves.svg": curves_svg(results, init_order),
               # Figure "Test sequence accuracy under varying training fractions"
               "data_efficiency.svg": sweep_figure(arithmetic, init_order, "train frac", "train fraction",
                                                   [None], percent),
               # accuracy and mask drift against A, learnable vs fixed M (edited priors: the next one)
               "mask_magnitude.svg": None if edited else sweep_figure(
                   masks, init_order, "A", "mask magnitude A", [None, "mask_drift"]),
               "imperfect_prior.svg": imperfect_figure(rows, init_order)}
    return "\n".join(sections), {name: svg for name, svg in figures.items() if svg}

# === 7. Pictures: heat maps of attention maps and mask biases (attention.svg, persistence figure) =
VIRIDIS = torch.tensor([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
                       dtype=torch.float32) / 255    # five anchors of the viridis colour map

def colormap(t):
    """t in [0, 1], any shape -> RGB in [0, 1], shape t.shape + (3,); NaN is drawn as 0."""
    pos = t.nan_to_num(0.0).clamp(0, 1) * (len(VIRIDIS) - 1)
    lo = pos.floor().long().clamp(max=len(VIRIDIS) - 2)
    frac = (pos - lo)[..., None]
    return VIRIDIS[lo] * (1 - frac) + VIRIDIS[lo + 1] * frac

def heatmap_png(grid, lo, hi, gap=4):
    """PNG bytes of a (rows, cols, n, n) grid of matrices, lo purple to hi yellow, by make_grid."""
    from torchvision.io import encode_png
    from torchvision.utils import make_grid
    cell = max(1, 128 // grid.shape[-1])
    rgb = colormap((grid.detach().float().cpu() - lo) / (hi - lo))       # (R, C, n, n, 3)
    rgb = rgb.repeat_interleave(cell, 2).repeat_interleave(cell, 3)       # (R, C, n*cell, n*cell, 3)
    image = make_grid(rgb.flatten(0, 1).permute(0, 3, 1, 2), nrow=grid.shape[1], padding=gap, pad_value=1.0)
    with warnings.catch_warnings():   # torchvision 0.29 marks its image codecs as deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return bytes(encode_png((image * 255).round().to(torch.uint8)).tolist())

def heatmap_svg(bands, notes, gap=4, left=64):
    """The one heat-map writer: bands of blocks (title, grid (R, C, n, n), lo, hi, meaning) one under
    another, a block's panels layers down and heads across, over a colour bar lo to hi; notes below."""
    stops = "".join(f'<stop offset="{i / 4}" stop-color="rgb{tuple(int(255 * c) for c in rgb.tolist())}"/>'
                    for i, rgb in enumerate(VIRIDIS))   # colormap's anchors, linearly between
    parts, y, width = [f'<defs><linearGradient id="viridis">{stops}</linearGradient></defs>'], 0, 0
    for band in bands:
        y, x, tallest = y + 44, left, 0
        for title, grid, lo, hi, meaning in band:
            rows, cols, n, _ = grid.shape
            side = max(1, 128 // n) * n                           # one panel's pixels
            w, h = cols * (side + gap) + gap, rows * (side + gap) + gap
            centres = [gap + i * (side + gap) + side / 2 for i in range(max(rows, cols))]   # of the i-th panel
            png = base64.b64encode(heatmap_png(grid, lo, hi, gap)).decode()
            parts += [svg_text(x, y - 24, title, font_size=13),
                      f'<image x="{x}" y="{y}" width="{w}" height="{h}" href="data:image/png;base64,{png}"/>']
            parts += [svg_text(x + centres[c], y - 6, f"head {c + 1}", text_anchor="middle") for c in range(cols)]
            if x == left:
                parts += [svg_text(left - 6, y + centres[r], f"layer {r + 1}", text_anchor="end") for r in range(rows)]
            bar = min(w, 200)                                        # under the block: the colour bar
            parts += [f'<rect x="{x}" y="{y + h + 8}" width="{bar}" height="10" fill="url(#viridis)"/>',
                      svg_text(x, y + h + 30, fmt(lo, 3)),
                      svg_text(x + bar, y + h + 30, fmt(hi, 3), text_anchor="end"),
                      svg_text(x, y + h + 44, meaning)]
            x += max(w, 7 * len(title), 6 * len(meaning)) + 32     # room for the texts too
            tallest = max(tallest, h)
        y, width = y + tallest + 66, max(width, x)
    parts += [svg_text(left, y + 16 * i, line) for i, line in enumerate(notes)]
    return svg_file(width, y + 16 * len(notes), parts)

PANEL_NOTE = "In each panel row = query, column = key"
BLOCKS_NOTE = f"Blocks: rows = layers, columns = heads. {PANEL_NOTE}"
COLOURS_NOTE = "Colours: purple = the left end of the bar under the block, yellow = "

def persistence_figure(runs):
    """Figure "Comparison of attention patterns before and after training", per (label, run folder)."""
    blocks = [(f"{label}, {when} training", torch.load(f"{folder}/attention_{when}.pt")["attn"],
               0, 1, "mean attention weight") for label, folder in runs for when in ("before", "after")]
    return heatmap_svg([blocks], [f"{PANEL_NOTE}; token 0 is CLS."])

def learned_prior_figure(runs):
    """Priors side by side, per (label, run folder) of a mask init: its bias log sigmoid(s M) at init."""
    blocks = []
    for label, folder in runs:
        bias = torch.load(os.path.join(folder, "attention_before.pt"), weights_only=True)["bias"]
        if bias is None:
            raise ValueError(f"{folder}: a run without a mask has no prior to draw")
        blocks.append((f"{label}: log σ(s M) at init", bias, min(bias.min().item(), -1e-6), 0.0,
                       "bias added to the logits"))
    return heatmap_svg([blocks], [f"{BLOCKS_NOTE}.", f"{COLOURS_NOTE}0 (an open entry)."])

def snapshot_blocks(snapshots, key, what, meaning, centre=False):
    """{when: heat-map block} of each snapshot's key ("attn" or "bias"; centre: of its "centre" entry)
    that has one, on one colour range: attention from 0, a bias up to 0 (an open entry)."""
    maps = {}
    for when, snapshot in snapshots.items():
        source = snapshot.get("centre", {}) if centre else snapshot
        if source.get(key) is not None:
            maps[when] = source[key].float()
    if not maps:
        return {}
    values = torch.stack(list(maps.values()))
    values = values[values.isfinite()] if values.isfinite().any() else torch.zeros(1)
    if "attention" in meaning:
        lo, hi = 0.0, max(values.max().item(), 1e-6)
    else:
        lo, hi = min(values.min().item(), -1e-6), 0.0
    return {when: (f"{what}, {when} training", m, lo, hi, meaning) for when, m in maps.items()}

def attention_figure(snapshots, cls_token, causal=False):
    """A run's attention.svg: per snapshot (train.snapshot) the mean attention maps and a mask's bias;
    for a ViT a second band (Appendix "Attention Map For Image Classification"): the first test image's
    centre patch's attention and bias on the patch grid. None when there is nothing to draw."""
    whole = [snapshot_blocks(snapshots, "attn", "mean attention", "mean attention weight"),
             snapshot_blocks(snapshots, "bias", "mask bias log σ(s M)", "bias added to the logits")]
    centre = [snapshot_blocks(snapshots, "attn", "test image 1, centre patch: attention",
                              "attention weight on each patch", centre=True),
              snapshot_blocks(snapshots, "bias", "centre patch: mask bias", "bias on each patch", centre=True)]
    bands = []
    for pair in (whole, centre):              # per snapshot, its attention and then its bias
        band = [blocks[when] for when in snapshots for blocks in pair if when in blocks]
        if band:
            bands.append(band)
    notes = [f"{BLOCKS_NOTE}{'; position 0 is CLS' if cls_token else ''}."]
    if causal:
        notes.append("Causal: above the diagonal (key after query) the hard mask hides every key, "
                     "whatever the bias there.")
    if centre[0]:
        notes.append("Centre patch: its row of the map, CLS left out, laid out on the patch grid.")
    notes.append(f"{COLOURS_NOTE}the right end.")
    return heatmap_svg(bands, notes) if bands else None
