"""Train and evaluate the paper's experiments: one run, or a grid of runs and its tables.

    python train.py --task majority --init mask                    # Boolean GOTU, Section 5.1
    python train.py --task addition --init default mask            # arithmetic, Section 5.2
    python train.py --task lm --init mask                          # language, Appendix "Wiki-text"
    python train.py --task cifar10 --init impulse --data-dir data  # vision, Section 5.3
    python train.py --task images --data-dir DIR                   # your own images (text: --help)
    python train.py --summarize runs/grid                          # tables of finished runs

Read top to bottom (sections 1-7): one training loop for every family; a run is prior before -> train ->
prior after -> result.json. Uses maskprior.py (models, masks, QK baselines) and tasks.py (data, tables).
"""

import argparse
import contextlib
import hashlib
import fcntl
import importlib.util
import io
import itertools
import json
import math
import os
import pathlib
import signal
import statistics
import sys
import threading
import time
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import maskprior
import tasks

# === 1. Presets: the paper's setup tables ("paper") and a 2-core CPU version of each ("cpu") ======
# Boolean GOTU, Table "Training setup for Boolean tasks" (layers, heads, Adam, lr, batch, epochs; an unnamed
# schedule, cosine here). The rest is the aryol/GOTU code's model, which the paper builds on: width 256,
# coupled weight decay on every parameter but M (its decay: --mask-decay), positions and CLS drawn from
# N(0, 1) (pos_std, cls_std; nanoGPT's and timm's 0.02 and zero otherwise). "cpu" (heads of 21) keeps the
# small starts without weight decay: with the GOTU ones, 2parity's mask model predicts a constant at widths
# 64 and 128 (the README's Boolean section). cyclic3 gets the GOTU code's N(0, 1) positions, with which its
# vanilla model fits its training set (at 0.02 its training loss stays 6 after 60 epochs).
BOOLEAN_PRESETS = {
    "paper": {"epochs": 90, "lr": 1e-3, "batch_size": 256, "layers": 4, "heads": 3, "dim": 256,
              "head_dim": 64, "mlp_dim": 256, "optimizer": "adam", "weight_decay": 1e-3,
              "pos_std": 1.0, "cls_std": 1.0},
    "cpu": {"epochs": 10, "lr": 1e-3, "batch_size": 256, "layers": 4, "heads": 3, "dim": 64,
            "head_dim": None, "mlp_dim": 64, "optimizer": "adam", "weight_decay": 0.0,
            "pos_std": 0.02, "cls_std": 0.0},
}

# Three-digit arithmetic, Table "Arithmetic task setup" (cosine schedule); "cpu": width 128, heads of 32.
ARITHMETIC_PRESETS = {"paper": {"epochs": 50, "lr": 1e-3, "weight_decay": 1e-3, "batch_size": 256,
                                "layers": 6, "heads": 4, "dim": 256, "head_dim": 64, "mlp_dim": 256,
                                "optimizer": "adamw", "pos_std": 0.02}}
ARITHMETIC_PRESETS["cpu"] = {**ARITHMETIC_PRESETS["paper"], "layers": 4, "dim": 128, "head_dim": None,
                             "mlp_dim": 128}

# Language, Table "NLP task setup" (cosine, seed 1337, 5000 TinyStories / 3000 WikiText-2 iterations).
LM_PRESETS = {"paper": {"iters": 5000, "lr": 3e-4, "batch_size": 128, "layers": 12, "heads": 12, "dim": 512,
                        "block_size": 64, "dropout": 0.2, "weight_decay": 0.01, "optimizer": "adamw"}}
LM_PRESETS["cpu"] = {**LM_PRESETS["paper"], "iters": 1000, "lr": 1e-3, "batch_size": 32, "layers": 4,
                     "heads": 4, "dim": 128, "dropout": 0.1}

# Vision, Tables "Experimental setup for CIFAR10 / CIFAR100": vit_tiny_patch16_224, cosine after a linear
# warmup, AMP (bf16 here), CLS readout. Warmup start and cosine floor, not in the tables, are those of
# osiriszjq/structured_initialization's commands (ImageNet100's floor 1e-5). Table "Experimental setup for
# ImageNet100" (TASK_PRESETS): base lr scaled by the global batch over 512, cooldown epochs after the
# cosine at the floor (as timm does), seed 42, global average pool. "cpu": a CIFAR-native ViT, 64 patches.
VISION_PRESETS = {"paper": {
    "epochs": 400, "lr": 2e-3, "lr_base_size": None, "batch_size": 512, "warmup_epochs": 50,
    "cooldown_epochs": 0, "warmup_lr": 1e-6, "min_lr": 1e-6, "weight_decay": 0.05, "drop_path": 0.1,
    "label_smoothing": 0.1, "mixup": 0.8, "cutmix": 1.0, "randaugment": 9, "image_size": 224,
    "patch_size": 16, "layers": 12, "heads": 3, "dim": 192, "mlp_dim": 768, "pool": "cls",
    "optimizer": "adamw", "crop_scale": 0.08}}   # crop_scale: RandomResizedCrop's least area
VISION_PRESETS["cpu"] = {**VISION_PRESETS["paper"], "epochs": 10, "lr": 1e-3, "batch_size": 128,
                         "warmup_epochs": 1, "warmup_lr": 1e-5, "min_lr": 1e-5, "image_size": 32,
                         "patch_size": 4, "layers": 6, "dim": 96, "mlp_dim": 384}

# Per-task changes to a preset: (family, preset) -> {task: {key: value}}; cpu: small-data images.
TASK_PRESETS = {
    ("vision", "cpu"): {t: {"epochs": 40, "mixup": 0.0, "cutmix": 0.0, "crop_scale": 0.35}
                        for t in ("imagenet100", "images")},
    ("boolean", "cpu"): {"cyclic3": {"epochs": 20, "pos_std": 1.0}},
    ("arithmetic", "cpu"): {"multiplication": {"epochs": 20}},
    ("language", "paper"): {"tinystories": {"iters": 5000}, "wikitext2": {"iters": 3000}},
    ("vision", "paper"): {"imagenet100": {"epochs": 300, "lr": 1e-3, "lr_base_size": 512, "warmup_epochs": 5,
                                          "cooldown_epochs": 10, "min_lr": 1e-5, "pool": "avg"}},
}

# Table "NLP task setup" fixes seed 1337 and Table "Experimental setup for ImageNet100" seed 42.
PAPER_SEEDS = {"language": 1337, "imagenet100": 42}

# --init -> (MaskedSelfAttention's mode, where the prior goes: mask_inits, add_prior). The prior is always the
# task's own pattern ("the same prior, in M or in W_Q / W_K"), or in mask inits --mask-from's learned one.
INITS = {
    "default": ("none", None),                  # vanilla Transformer, no prior
    "mask": ("learnable", "mask"),              # the paper: learnable log sigmoid(M), M = pattern
    "mask-zero": ("learnable", "zero"),         # Appendix A.1: learnable, M = 0 (no preference)
    "mask-fixed": ("fixed", "mask"),            # Appendix A.2: the pattern, never trained
    "mask-hadamard": ("hadamard", "mask"),      # Appendix B: sigma(M) o softmax(...)
    "structured-svd": ("none", "svd"),          # pattern in W_Q/W_K, closed form (Zheng 2025)
    "structured-opt": ("none", "opt"),          # pattern in W_Q/W_K, fitted by Adam (Zheng 2024)
    "mimetic": ("none", "mimetic"),             # identity-like W_Q W_K^T (Trockman, Kolter 2023)
    "impulse": ("none", "svd"),                 # vision: the impulse pattern in W_Q/W_K by SVD
}
ENCODER_INITS = tuple(i for i in INITS if i != "impulse")
trains_mask = lambda init: INITS[init][0] in ("learnable", "hadamard")   # M trained (not mask-fixed)

# The four families (their tasks: tasks.FAMILY_OF): inits, the paper's mask magnitude A (open +A, closed -A).
FAMILIES = {
    "boolean": {"inits": ENCODER_INITS, "magnitude": maskprior.OPEN},
    "arithmetic": {"inits": ENCODER_INITS, "magnitude": maskprior.ARITHMETIC_OPEN},
    "language": {"inits": ("default", "mask", "mimetic"), "magnitude": maskprior.GPT_MASK_SCALE},
    "vision": {"inits": ("default", "mimetic", "impulse", "mask-fixed", "mask"), "magnitude": maskprior.OPEN},
}
PRESETS = {"boolean": BOOLEAN_PRESETS, "arithmetic": ARITHMETIC_PRESETS, "language": LM_PRESETS,
           "vision": VISION_PRESETS}
FAMILY_FLAGS = {"epochs": ("boolean", "arithmetic", "vision"), "train_frac": ("arithmetic",),  # flag: takers
                "head_dim": ("boolean", "arithmetic"), "pos_std": ("boolean", "arithmetic"),
                "cls_std": ("boolean",), "mlp_dim": ("boolean", "arithmetic", "vision"),
                "mask_variant": ("boolean",), "mask_error": ("boolean", "arithmetic"),
                "eval_size": ("arithmetic",),
                **dict.fromkeys(("iters", "block_size", "bpe_file"), ("language",)),
                **dict.fromkeys(("image_size", "patch_size", "warmup_epochs", "workers", "download",
                                 "compile", "model"), ("vision",))}
TIMM_INITS = ("default", "mask", "mask-fixed")  # --model timm: its ViT as is, or M by add_mask_prior

# === 2. Utilities: errors, files, lock, signals, checkpoints, --resume, torchrun, optimizer =======
class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit code 2."""

class Diverged(Exception):  # the training loss became NaN or infinite
    pass

class WriteError(Exception):
    """A file the run could not write (disk full, read-only, ...): the path and the OS's reason; exit 1."""
    def __init__(self, path, err):
        super().__init__(f"cannot write {path}: {err.strerror or err}")

class Interrupted(BaseException):
    """SIGINT / SIGTERM: main exits 128 + its number; a BaseException, so no `except Exception` eats it."""
    def __init__(self, signum, message):
        super().__init__(message)
        self.exit_code = 128 + signum

def write_atomic(path, data):
    """Bytes or text to path via a temporary file, fsync, rename: never half a file; OSError -> WriteError."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(err, OSError):
            raise WriteError(path, err) from None
        raise

def write_json(path, obj):
    write_atomic(path, json.dumps(obj, indent=2) + "\n")

def save_checkpoint(path, state):  # torch.save through write_atomic: never half a checkpoint
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getvalue())

def read_result(path, warn=True):
    """A result.json as a dict, or None (with a warning naming it, if warn) if it is damaged."""
    try:
        with open(path) as f:
            result = json.load(f)
        if not {"task", "init", "seed", "status", "config", "final"} <= set(result):
            raise ValueError("fields are missing")
        if result["status"] == "done":
            tasks.summary_line(result)           # the fields a table reads are all there
        return result
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        if warn:
            print(f"train.py: warning: skipped {path}: damaged or not a result of train.py ({err})",
                  file=sys.stderr)
        return None

@contextlib.contextmanager
def folder_lock(folder):
    """One writer per run folder: a flock on folder/.lock (holding the pid; the OS drops it when the process
    ends, kill -9 too); else UsageError. At the end .lock goes, and the folder if the lock made it and it
    stayed empty."""
    path, fd, made = os.path.join(folder, ".lock"), None, not os.path.isdir(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        while fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                raise UsageError(f"{folder} is in use by another train.py run (pid {holder}): wait "
                                 f"for it to end, or choose another --out") from None
            if not os.path.exists(path) or not os.path.samestat(os.fstat(fd), os.stat(path)):
                os.close(fd)    # the holder before us removed it between our open and our lock
                fd = None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException as err:
        if fd is not None:
            os.close(fd)
        if isinstance(err, OSError):
            raise UsageError(f"cannot write {err.filename or folder}: {err.strerror}") from None
        raise
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)     # removed while still locked, so that no one locks a stale file
            if made:            # a run refused before it wrote anything leaves no folder behind
                os.rmdir(folder)
        os.close(fd)

class Stop:
    """The SIGINT / SIGTERM handler, and where the run is. While the loop trains, a first signal only sets
    `signal` (the loop checkpoints its step, then stops); else, or at a second one, Interrupted is raised."""
    def __init__(self):
        self.pid, self.signal, self.training = os.getpid(), None, False
        self.start(None, False, False)
    def start(self, folder, grid, resuming):  # a new run in folder: nothing trained yet
        self.folder, self.grid, self.at = folder, grid, None       # at: "epoch 2 (step 34)"
        self.kept = "its checkpoint" if resuming else None        # what checkpoint.pt holds
    def __call__(self, signum, frame):
        if os.getpid() != self.pid:   # a DataLoader worker forked from us: as without this handler
            if signum == signal.SIGINT:
                raise KeyboardInterrupt     # on which torch's worker loop ends quietly
            os._exit(128 + signum)
        if self.training and self.signal is None:
            self.signal = signum
        else:
            raise self.interrupted(signum)
    def advice(self):  # what is on disk, and how to go on
        if self.kept:
            return f"{self.kept} is kept in {self.folder}: rerun with --resume"
        if self.grid:
            return f"{self.folder} has no checkpoint yet and starts over: rerun with --resume"
        return "no checkpoint was written, nothing to resume: rerun without --resume"
    def interrupted(self, signum=None):
        where = f"at {self.at}" if self.at else "before training started"
        return Interrupted(signum or self.signal, f"interrupted {where}; {self.advice()}")

@contextlib.contextmanager
def signals_caught(stop):
    """stop handles SIGINT and SIGTERM inside the block; the handlers from before are put back."""
    main = threading.current_thread() is threading.main_thread()   # only it may set handlers
    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)

def no_checkpoint(path):
    return UsageError(f"--resume: no checkpoint at {path}: run without --resume first")

def check_fingerprint(path, theirs, ours):
    """UsageError naming the first part of the data that differs; no fingerprint at all: a note."""
    if ours is None:
        return
    if theirs is None:
        print(f"train.py: note: {path} records no fingerprint of its data; the data is not checked",
              file=sys.stderr)
        return
    short = lambda v: "none" if v is None else v if len(v) <= 40 else v[:40] + "…"
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            raise UsageError(f"--resume: {path} was written by a run on other data: {key} "
                             f"{short(theirs.get(key))}, this run has {short(ours.get(key))}: use "
                             f"the same data, or another --out")

def load_checkpoint(path, meta):
    """The checkpoint at path, or UsageError: unreadable, not ours, or another run's (flags or data)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise no_checkpoint(path)
    except Exception as err:
        raise UsageError(f"--resume: {path} is damaged or not a checkpoint ({type(err).__name__}"
                         f"): delete it, or use another --out")
    if not isinstance(saved, dict) or not {"meta", "model", "state"} <= set(saved):
        raise UsageError(f"--resume: {path} is not a checkpoint written by train.py")
    theirs = {**saved["meta"], **saved["meta"]["config"]}
    for key, value in {**meta, **meta["config"]}.items():
        if key not in ("config", "data_fingerprint") and theirs.get(key) != value:
            raise UsageError(f"--resume: {path} was written by a run with {key} {theirs.get(key)!r}, "
                             f"this run has {value!r}: use the same flags, or another --out")
    check_fingerprint(path, saved["meta"].get("data_fingerprint"), meta.get("data_fingerprint"))
    return saved

def data_fingerprint(family, task, config, seed, data):
    """What --resume checks the data against (tasks.py, "Fingerprints"): generated tensors, or files."""
    if family not in ("boolean", "arithmetic"):
        return data["fingerprint"]
    d = tasks.boolean_dataset(task) if family == "boolean" else tasks.arithmetic_dataset(
        task, config["train_frac"], seed, config["eval_size"])
    return {name: tasks.tensors_sha256(d[f"x_{part}"], d[f"y_{part}"])
            for name, part in (("train set", "train"), ("eval set", "eval")) if f"x_{part}" in d}

def finished_run(out_dir, task, init, seed, config, fingerprint):
    """out_dir's result.json if it is this very run (task, init, seed, config, data), done; else None."""
    path = os.path.join(out_dir, "result.json")
    old = os.path.exists(path) and read_result(path)
    keys = ("task", "init", "seed", "config", "data_fingerprint")
    same = old and old["status"] == "done" and [old.get(k) for k in keys] == [
        task, init, seed, config, fingerprint]
    return old if same else None

def rng_states(exp, device):
    """Every random stream a step draws from: torch's CPU one, exp's generators, CUDA's (dropout)."""
    states = [torch.get_rng_state(), *[g.get_state() for g in exp.generators]]
    return states + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])

def set_rng_states(exp, device, states):
    torch.set_rng_state(states[0])
    for generator, state in zip(exp.generators, states[1:]):
        generator.set_state(state)
    if device.type == "cuda" and len(states) > 1 + len(exp.generators):
        torch.cuda.set_rng_state(states[-1], device)

Place = namedtuple("Place", "device rank world")    # where a process trains (torchrun: its rank)

def distributed_setup(device):
    """torchrun (WORLD_SIZE > 1): join the process group (NCCL on CUDA, gloo on the CPU); its Place."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Place(device, 0, 1)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Place(device, dist.get_rank(), world)

@contextlib.contextmanager
def subnormals_flushed(device):
    """On the CPU, floats below 1.2e-38 read as zero while a run trains: attention where M shuts pairs, and
    its gradients, are such subnormals, many times slower on x86 (tests/bench_denormal.py)."""
    was_on = (torch.tensor([torch.finfo(torch.float32).tiny]) / 4).item() == 0   # torch has no getter
    torch.set_flush_denormal(was_on or device.type == "cpu")
    try:
        yield
    finally:
        torch.set_flush_denormal(was_on)

def gather(obj, world):  # every rank's obj as a list indexed by rank ([obj] without torchrun)
    out = [obj] * world
    if world > 1:
        dist.all_gather_object(out, obj)
    return out

def agreed(values, world, device):
    """Under torchrun each value's maximum over the ranks: all ranks raise Diverged, or stop, at once."""
    if world == 1:
        return values
    flags = torch.tensor([float(v) for v in values], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [int(v) for v in flags.tolist()]

def make_optimizer(model, config):
    """Adam with coupled L2 on every parameter (aryol/GOTU's Boolean optimizer) or AdamW decaying weight
    matrices only (nanoGPT, timm). M is a group of its own: --mask-decay (default 0), --mask-lr."""
    groups = {"weights": [], "others": [], "mask": []}
    no_decay = {"pos", "cls", *getattr(model, "no_weight_decay", set)()}   # timm: pos_embed, cls_token
    for name, p in model.named_parameters():
        decays = config["optimizer"] == "adam" or (p.dim() >= 2 and name not in no_decay)
        if p.requires_grad:
            groups["mask" if name.endswith("mask") else "weights" if decays else "others"].append(p)
    decay = {"weights": config["weight_decay"], "others": 0.0, "mask": config["mask_decay"]}
    Optimizer = torch.optim.Adam if config["optimizer"] == "adam" else torch.optim.AdamW
    lrs = {"mask": config.get("mask_lr") or config["lr"]}
    return Optimizer([{"params": ps, "weight_decay": decay[g], "lr": lrs.get(g, config["lr"])}
                      for g, ps in groups.items() if ps])

# === 3. Command line: the flags, their checks, and each run's config ==============================
class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints the whole usage block; one line is enough
        raise UsageError(message)

def number(kind, strict=True):  # argparse type: a finite kind(text) > 0 (>= 0 when not strict)
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if not math.isfinite(value) or value < 0 or (strict and value == 0):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if strict else '>='} 0, got {text!r}")
        return value
    return parse

def build_parser():  # the command line in five groups, each list of choices printed once
    every_task = list(tasks.FAMILY_OF)
    p = Parser(prog="train.py", usage="python train.py [--task TASK ...] [--init INIT ...] [options]",
               description=__doc__.split("\n")[0], epilog=tasks.OWN_DATA_HELP,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    count, natural = number(int, strict=False), number(int)
    rate, share = number(float), number(float, strict=False)
    g = p.add_argument_group("what to run")
    g.add_argument("--task", nargs="+", default=["majority"], choices=every_task + ["all"],
                   metavar="TASK", help=f"{', '.join(every_task)}; all: the Boolean four")
    g.add_argument("--init", nargs="+", default=["mask"], choices=list(INITS), metavar="INIT",
                   help=f"{', '.join(INITS)} (default mask)")
    g.add_argument("--seed", type=count, default=0, help="random seed (default 0; paper: its own)")
    g.add_argument("--seeds", type=count, nargs="+", metavar="SEED", help="several seeds: a grid")
    g.add_argument("--preset", choices=["cpu", "paper"], default="cpu",
                   help="cpu (quick, default) or paper (the paper's tables)")
    g.add_argument("--summarize", metavar="DIR", help="train nothing: the tables of DIR's runs")
    g.add_argument("--model", choices=["maskprior", "timm"],
                   help="vision: maskprior.ViT (default) or timm's VisionTransformer, same shape")
    g = p.add_argument_group("the mask prior (inits mask, mask-fixed, mask-hadamard)")
    g.add_argument("--mask-magnitude", type=rate, nargs="+", metavar="A",
                   help="open +A, closed -A (GPT: scale s); several: a sweep")
    g.add_argument("--mask-decay", type=share, nargs="+", metavar="W",
                   help="weight decay on M alone (default 0); several: a sweep")
    g.add_argument("--mask-lr", type=rate, nargs="+", metavar="LR",
                   help="lr of M alone (default --lr); several: a sweep")
    g.add_argument("--mask-error", nargs="+", metavar="KIND:P",
                   help="extra|missing|moved:P edits the prior; none: exact")
    g.add_argument("--mask-from", metavar="DIR", help="M from the attention maps of the finished run DIR")
    g.add_argument("--mask-threshold", type=rate, nargs="+", metavar="TAU",
                   help="open where attention >= TAU / row's keys (default 1)")
    variants = sorted({v for choices in maskprior.BOOLEAN_MASK_VARIANTS.values() for v in choices})
    g.add_argument("--mask-variant", choices=variants,
                   help="2parity, cyclic3: the product over two layers (composed) or one (direct)")
    g = p.add_argument_group("overrides of the preset")
    for name, kind, text in (
            ("epochs", natural, "epochs (Boolean, arithmetic, vision)"),
            ("iters", natural, "optimizer steps (language)"), ("lr", rate, "learning rate"),
            ("batch-size", natural, "examples per step"), ("layers", natural, "Transformer layers"),
            ("heads", natural, "attention heads"), ("dim", natural, "model width"),
            ("head-dim", natural, "width of each head (default: dim / heads)"),
            ("mlp-dim", natural, "MLP hidden width (default: the preset's, or from --dim)"),
            ("pos-std", share, "std of the learned positions' start"),
            ("cls-std", share, "Boolean: std of the CLS token's start (0: zeros)"),
            ("weight-decay", share, "weight decay on all but M"),
            ("block-size", natural, "language: tokens per window"),
            ("image-size", natural, "vision: image side, pixels"),
            ("patch-size", natural, "vision: patch side, pixels"),
            ("warmup-epochs", count, "vision: epochs of lr warmup"),
            ("eval-every", natural, "rounds between evaluations and checkpoints")):
        g.add_argument(f"--{name}", type=kind, metavar="X" if kind in (rate, share) else "N", help=text)
    g = p.add_argument_group("data")
    g.add_argument("--train-frac", type=rate, nargs="+", metavar="F",
                   help="arithmetic: fraction of pairs to train on (a sweep)")
    g.add_argument("--eval-size", type=lambda t: t if t == "all" else natural(t), metavar="N",
                   help="arithmetic: held-out pairs scored, or all (100000)")
    g.add_argument("--data-dir", default="data", metavar="DIR",
                   help="where corpus and image files live (default data)")
    g.add_argument("--bpe-file", metavar="FILE", help="GPT-2's ranks file for tiktoken, offline")
    g.add_argument("--download", action="store_true", help="vision: fetch CIFAR if missing")
    g.add_argument("--workers", type=count, metavar="N", help="vision: loader processes")
    g = p.add_argument_group("output and resume")
    g.add_argument("--out", metavar="DIR", help="output folder (default runs/<run name> or runs/grid)")
    g.add_argument("--resume", action="store_true", help="continue from checkpoint.pt (a grid: all)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1")
    g.add_argument("--threads", type=natural, metavar="N", help="torch CPU threads")
    g.add_argument("--compile", action="store_true", help="vision: torch.compile the model")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p

def check_args(args, task_names):
    """One family per command; family-only flags and inits belong to it. Returns the family."""
    families = {tasks.FAMILY_OF[t] for t in task_names}
    if len(families) > 1:
        raise UsageError(f"--task: {' and '.join(sorted(families))} tasks cannot share one grid")
    family = families.pop()
    for flag, takers in FAMILY_FLAGS.items():
        value = getattr(args, flag)                 # None / False when not given (0 is given)
        if value is not None and value is not False and family not in takers:
            raise UsageError(f"--{flag.replace('_', '-')} applies to {' and '.join(takers)} tasks only")
    wrong = [i for i in args.init if i not in FAMILIES[family]["inits"]]
    if wrong:
        raise UsageError(f"--init {wrong[0]} is not available for {family} tasks "
                         f"(choose from {', '.join(FAMILIES[family]['inits'])})")
    try:   # --mask-error: 'none' -> None, KIND:FRACTION -> "kind:fraction" (config's mask_error)
        edits = [maskprior.parse_edit(text) for text in args.mask_error or ()]
        args.mask_error = args.mask_error and [e and "%s:%s" % e for e in edits]
    except ValueError as err:
        raise UsageError(f"argument --mask-error: {err}")
    if args.model == "timm":    # timm's ViT: no return_attn, so no QK inits and no --mask-from
        if set(args.init) - set(TIMM_INITS) or args.mask_from:
            raise UsageError(f"--model timm takes --init {', '.join(TIMM_INITS)}, no --mask-from")
        if importlib.util.find_spec("timm") is None:
            raise UsageError("--model timm needs timm: pip install timm")
    no_mask = [i for i in args.init if i not in tasks.MASK_PRIOR_INITS]
    if any(args.mask_error or ()) and no_mask:
        raise UsageError("--mask-error edits the mask prior: --init mask, mask-fixed or mask-hadamard only")
    if args.mask_lr and not any(map(trains_mask, args.init)):
        raise UsageError(f"--mask-lr: --init {' '.join(args.init)} has no trainable mask")
    if args.mask_from is not None:              # replaces a mask init's hand-made pattern
        if no_mask:
            raise UsageError(f"--mask-from: --init {no_mask[0]} has no mask prior to replace "
                             f"(mask, mask-fixed or mask-hadamard only)")
        if any(args.mask_error or ()):
            raise UsageError("--mask-from and --mask-error: a learned prior is not edited, give "
                             "one of the two")
        if args.out and os.path.realpath(args.out) == os.path.realpath(args.mask_from):
            raise UsageError(f"--out {args.out} is the --mask-from folder: the run would overwrite "
                             f"its source")
        args.mask_threshold = args.mask_threshold or [1.0]
    elif args.mask_threshold:
        raise UsageError("--mask-threshold applies with --mask-from only")
    out = args.out and pathlib.Path(args.out)
    try:
        existing = out and next(p for p in (out, *out.parents) if p.exists())   # out or a parent
    except OSError as err:        # a name over 255 bytes (ENAMETOOLONG), a loop of links, ...
        raise UsageError(f"--out {args.out}: {err.strerror}")
    if existing and not existing.is_dir():
        where = "" if existing == out else f": {existing}"
        raise UsageError(f"--out {args.out}{where} is a file, not a folder: name a folder")
    return family

# Flags whose values make a grid's axes (the sweeps: in tasks.run_name's order): a value given twice would
# train one run twice into one folder and count it twice in the table, so it runs once.
SWEEP_FLAGS = ("train_frac", "mask_magnitude", "mask_decay", "mask_error", "mask_lr", "mask_threshold")
GRID_FLAGS = ("task", "init", "seeds", *SWEEP_FLAGS)

def merge_repeats(args):
    """Each grid flag's repeated values merged (first order kept), with a note on stderr per flag."""
    show = lambda v: "none" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
    for flag in GRID_FLAGS:
        values = getattr(args, flag)
        if values and len(set(values)) < len(values):
            again = [v for i, v in enumerate(values) if v in values[:i]]
            print(f"train.py: note: --{flag.replace('_', '-')} {show(again[0])} is given more than "
                  f"once; each run is trained once", file=sys.stderr)
            setattr(args, flag, list(dict.fromkeys(values)))

# --mask-from names a finished run whose attention maps become M (use_learned_prior below).
def read_source(folder):
    """The finished run --mask-from names: (result.json, mean attention after (L, H, N, N), its sha256)."""
    bad = lambda why: UsageError(f"--mask-from {folder}: {why}")
    if not os.path.isdir(folder):
        raise bad("no such folder")
    path = os.path.join(folder, "result.json")
    if not os.path.isfile(path):
        raise bad("no result.json there: not a run folder of train.py")
    result = read_result(path, warn=False)
    if result is None:
        raise bad("result.json is damaged or not a result of train.py")
    if result["status"] != "done":
        raise bad(f"not a finished run (status {result['status']!r}): name a run whose result.json says done")
    try:
        with open(os.path.join(folder, "attention_after.pt"), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise bad("no attention_after.pt there: it holds the attention maps")
    try:   # a dict of tensors: nothing but tensors needs unpickling (weights_only)
        saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as err:
        raise bad(f"attention_after.pt is damaged or not one of train.py's ({type(err).__name__})")
    attn = saved.get("attn") if isinstance(saved, dict) else None
    if not isinstance(attn, torch.Tensor) or attn.dim() != 4 or attn.shape[-1] != attn.shape[-2]:
        raise bad("attention_after.pt holds no mean attention maps (a layers x heads x N x N "
                  "tensor under 'attn')")
    if not torch.isfinite(attn).all():
        raise bad("attention_after.pt's mean attention is not finite (NaN or inf)")
    return result, attn.float(), hashlib.sha256(raw).hexdigest()

def learned_prior_config(folder, tau, causal):
    """result.json config's record of the source run (the hash: --resume refuses a re-trained one)."""
    result, attn, digest = read_source(folder)
    learned = maskprior.learned_mask(attn, 1.0, tau, causal)
    return {"mask_from": os.path.normpath(folder), "mask_from_sha256": digest,
            "mask_from_task": result["task"], "mask_from_init": result["init"],
            "mask_from_train_frac": result["config"].get("train_frac"), "mask_from_seed": result["seed"],
            "mask_threshold": tau, "mask_density": maskprior.open_fraction(learned, causal)}

def check_vision_config(config):
    """Patches tile the image; a too long warmup is shortened; ImageNet100's lr x batch / 512."""
    if config["image_size"] % config["patch_size"]:
        raise UsageError(f"--image-size {config['image_size']} is not a multiple of the patch "
                         f"size {config['patch_size']}")
    if config["warmup_epochs"] >= config["epochs"]:
        config.update(warmup_shortened_from=config["warmup_epochs"], warmup_epochs=config["epochs"] - 1)
    if config["lr_base_size"]:
        config["lr"] = config["lr"] * config["batch_size"] / config["lr_base_size"]

def make_config(family, task, args, train_frac=None, magnitude=None, mask_decay=None, error=None,
                mask_lr=None, threshold=None):
    """The run's config: the preset, its per-task changes, the flags given, then derived keys."""
    config = {**PRESETS[family][args.preset], **TASK_PRESETS.get((family, args.preset), {}).get(task, {})}
    for key in ("epochs", "iters", "lr", "batch_size", "layers", "heads", "dim", "block_size",
                "image_size", "patch_size", "warmup_epochs", "weight_decay"):
        if getattr(args, key) is not None and key in config:
            config[key] = getattr(args, key)
    if args.dim is not None and "mlp_dim" in config:   # ViT MLPs are 4 x wide, encoders 1 x
        config.update(mlp_dim=4 * args.dim if family == "vision" else args.dim,
                      **({"head_dim": None} if "head_dim" in config else {}))
    for key in ("head_dim", "mlp_dim", "pos_std", "cls_std"):     # after --dim, which resets two
        if getattr(args, key) is not None and key in config:
            config[key] = getattr(args, key)
    if not config.get("head_dim") and config["dim"] < config["heads"]:
        raise UsageError(f"--dim {config['dim']} leaves no width for each of {config['heads']} heads")
    config.update(preset=args.preset, mask_decay=mask_decay or 0.0, mask_error=error, mask_lr=mask_lr,
                  mask_magnitude=magnitude or FAMILIES[family]["magnitude"])
    config["eval_every"] = args.eval_every or (max(1, config["iters"] // 5) if family == "language"
                                               else 1 if family == "vision" else 5)
    if args.mask_variant:
        if task not in maskprior.BOOLEAN_MASK_VARIANTS:
            raise UsageError(f"--mask-variant: {task} has one mask pattern only")
        config["mask_variant"] = args.mask_variant
    if family == "arithmetic":
        if train_frac and train_frac >= 1:
            raise UsageError(f"--train-frac must lie strictly between 0 and 1, got {train_frac:g}")
        config.update(train_frac=train_frac or tasks.ARITHMETIC_TRAIN_FRAC[task],
                      eval_size=None if args.eval_size == "all" else args.eval_size or 100_000)
    if family == "vision":
        check_vision_config(config)
        if args.model == "timm":               # maskprior.ViT's configs stay as they were
            config["model"] = "timm"
    if args.mask_from is not None:
        config.update(learned_prior_config(args.mask_from, threshold or 1.0, family == "language"))
    return config

def check_fits(family, config):
    """Refuse, before allocating, a model whose weights, Adam state and attention maps exceed the RAM."""
    L, H, D, B = (config[key] for key in ("layers", "heads", "dim", "batch_size"))
    longest_sum = 2 * tasks.OPERAND_DIGITS + max(tasks.ARITHMETIC_TASKS.values())   # operands, answer slots
    N = {"boolean": tasks.BOOLEAN_DIM + 1, "arithmetic": longest_sum, "language": config.get("block_size"),
         "vision": (config.get("image_size", 0) // config.get("patch_size", 1)) ** 2 + 1}[family]
    need = 4 * (4 * 12 * L * D * D + 3 * L * H * N * N * max(B, 64))
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        flag = {"language": f"--block-size {N}", "vision": f"--image-size {config.get('image_size')}"}
        raise UsageError(f"{flag.get(family, f'--dim {D}')}: {L} layers x {H} heads x {N} x {N} "
                         f"attention maps at width {D} need about {need / 2**30:.0f} GiB, this "
                         f"machine has {have / 2**30:.0f} GiB: choose a smaller model, batch or input")

def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r}")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: only cpu and cuda are supported")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device

# === 4. The experiment families: each setup returns an Experiment =================================
@dataclass
class Job:
    """One run of a command (main builds one per cell of its grid): what to train and where."""
    family: str
    task: str
    init: str
    seed: int
    config: dict                       # make_config: the preset, the flags, derived keys
    out_dir: str
    data: object = None                # language, vision: the corpus / images (load_data)
    fingerprint: Optional[dict] = None # what --resume checks the data against (data_fingerprint)
    resume: bool = False
    workers: Optional[int] = None      # vision: loader processes (default 8 on CUDA, 0 on the CPU)
    compile: bool = False              # vision: torch.compile
    progress: bool = True              # tqdm bars (on a terminal)
    def meta(self, world):  # what checkpoint.pt records of the run, for --resume to compare
        return {"task": self.task, "init": self.init, "seed": self.seed, "config": self.config,
                "world_size": world, "data_fingerprint": self.fingerprint}

@dataclass
class Experiment:
    """What a setup returns; a round: an epoch, or eval_every language iterations."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: object
    rounds: int                        # epochs, or evaluation intervals of a language run
    steps: int                         # optimizer steps in all (for the progress bar)
    batches: Callable                  # round -> iterable of that round's batches
    loss_of: Callable                  # (network, batch) -> scalar training loss
    evaluate: Callable                 # () -> metrics added to the history entry
    final: Callable                    # (state, world) -> result.json "final"
    eval_every: int = 1                # rounds between evaluations (and always after the last)
    unit: str = "epoch"                # the history's counter: "epoch" or "iter"
    probe: Optional[torch.Tensor] = None    # inputs the persistence numbers average attention over
    probe_batch: int = 4096
    pattern: Optional[torch.Tensor] = None  # the prior's (L, H, N, N) pattern, as edited or learned
    true_pattern: Optional[torch.Tensor] = None  # the task's exact pattern (persistence "true_")
    generators: tuple = ()             # random streams besides torch's own, kept by checkpoints
    info: dict = field(default_factory=dict)  # further result.json fields (init_seconds: QK init)

def scaled_pattern(pattern, config, family):
    """The pattern with open +A and closed -A, A = --mask-magnitude (the paper's A by default)."""
    return pattern * (config["mask_magnitude"] / FAMILIES[family]["magnitude"])

def add_prior(model, init, pattern, seed, svd_scales=None, pos_scale=maskprior.NORM_P):
    """Put a QK init's prior into W_Q / W_K, drawing from a generator seeded by seed; returns its
    seconds. pos_scale first scales the positions (maskprior.NORM_P; 1 for N(0, 1) positions)."""
    prior, generator, start = INITS[init][1], torch.Generator().manual_seed(seed), time.time()
    if prior == "svd":
        maskprior.structured_svd_init_(model, pattern, generator=generator, pos_scale=pos_scale,
                                       **(svd_scales or {}))
    elif prior == "opt":
        maskprior.structured_opt_init_(model, pattern, generator=generator, pos_scale=pos_scale)
    elif prior == "mimetic":
        maskprior.mimetic_init_(model, generator=generator)
    return time.time() - start

def mask_inits(init, pattern):
    """Each layer's initial M for init (INITS): the (L, H, N, N) pattern, zeros, or None (no M)."""
    return {"mask": pattern, "zero": torch.zeros_like(pattern)}.get(INITS[init][1])

# --- The prior learned from a trained model (--mask-from) ---------------------------------------
def use_learned_prior(exp, config):
    """After the usual setup, M := maskprior.learned_mask of the source's attention, +-A over the model's
    scale s; exp.pattern becomes the learned pattern, exp.true_pattern the hand-made one (GPT: neither)."""
    folder = config["mask_from"]
    _, attn, digest = read_source(folder)
    if digest != config["mask_from_sha256"]:
        raise UsageError(f"--mask-from {folder}: attention_after.pt changed while this run "
                         f"started: start it again")
    layers = maskprior.attention_modules(exp.model)                 # each M: (H, N, N)
    ours = (len(layers), *layers[0].mask.shape)
    if tuple(attn.shape) != ours:
        shape = lambda s: f"{s[0]} layers x {s[1]} heads x {s[2]} x {s[3]}"
        raise UsageError(f"--mask-from {folder}: its attention maps are {shape(attn.shape)}, this "
                         f"model's {shape(ours)}: the source needs the same --layers, --heads and "
                         f"sequence length")
    learned = maskprior.learned_mask(attn, config["mask_magnitude"] / layers[0].mask_scale,
                                     config["mask_threshold"], layers[0].causal)    # (L, H, N, N)
    with torch.no_grad():
        for attention, mask in zip(layers, learned):
            attention.mask.copy_(mask)
    if exp.pattern is not None:
        exp.true_pattern = exp.pattern if exp.true_pattern is None else exp.true_pattern
        exp.pattern = learned

def build_encoder(init, pattern, config, seed, device, svd_scales=None, **shape):
    """maskprior.Transformer on device with the init's prior, in M or in W_Q / W_K; (model, seconds)."""
    pos_std = config["pos_std"]                      # N(0, 1): the GOTU code's (BOOLEAN_PRESETS)
    model = maskprior.Transformer(
        masks=mask_inits(init, pattern), mode=INITS[init][0], dim=config["dim"], depth=config["layers"],
        heads=config["heads"], mlp_dim=config["mlp_dim"], head_dim=config["head_dim"], pos_std=pos_std,
        cls_std=config.get("cls_std", 0.0), **shape)
    # Structured inits scale positions drawn at 0.02 by NORM_P = 18 (to std 0.36) before their solve;
    # larger starts are scaled up to that std at most, never down (N(0, 1) positions: factor 1).
    pos_scale = maskprior.NORM_P if pos_std == 0 else min(maskprior.NORM_P, max(1.0, 0.36 / pos_std))
    seconds = add_prior(model, init, pattern, seed, svd_scales, pos_scale)
    return model.to(device), seconds

def cosine(optimizer, steps, floor=0.0):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=floor)

def encoder_experiment(model, x, y, seed, config, *functions, **fields):
    """Boolean / arithmetic: a cosine over all steps, each epoch all (x, y) in seeded shuffled batches."""
    steps = math.ceil(len(x) / config["batch_size"]) * config["epochs"]
    optimizer = make_optimizer(model, config)
    shuffle = torch.Generator().manual_seed(seed)
    batches = lambda epoch: ((x[idx], y[idx]) for idx in torch.randperm(
        len(x), generator=shuffle).split(config["batch_size"]))
    return Experiment(model, optimizer, cosine(optimizer, steps), config["epochs"], steps, batches,
                      *functions, eval_every=config["eval_every"], generators=(shuffle,), **fields)

# --- Boolean GOTU (Section 5.1, Table 1): train on the seen points, test on the whole cube -----
def boolean_setup(task, init, seed, config, device):
    data = tasks.boolean_dataset(task)
    exact = maskprior.boolean_mask(task, config["layers"], config["heads"],
                                   config.get("mask_variant"))                    # (L, H, N, N)
    pattern = maskprior.edited_prior(exact, config.get("mask_error"), seed, cls_row=True)
    model, seconds = build_encoder(init, scaled_pattern(pattern, config, "boolean"), config, seed,
                                   device, vocab_size=2, seq_len=tasks.BOOLEAN_DIM + 1, out_dim=1)
    def loss_of(net, batch):                     # the aryol/GOTU loss: MSE of the CLS readout
        return F.mse_loss(net(batch[0].to(device)).squeeze(-1), batch[1].to(device))
    def evaluate():                              # the whole cube, seen and unseen
        return tasks.boolean_metrics(task, tasks.boolean_predictions(model, data["x_test"]), data["x_test"])
    def final(state, world):                     # and the learned function's Fourier weights
        pred = tasks.boolean_predictions(model, data["x_test"])
        return {**tasks.boolean_metrics(task, pred, data["x_test"]),
                "train_loss": state["history"][-1]["train_loss"],
                "fourier": tasks.fourier_coefficients(pred, data["x_test"])}
    return encoder_experiment(
        model, tasks.boolean_tokens(data["x_train"]), data["y_train"], seed, config, loss_of,
        evaluate, final, probe=tasks.boolean_tokens(data["x_test"]), pattern=pattern,
        true_pattern=exact, info={"init_seconds": seconds})

# --- Three-digit arithmetic (Section 5.2): train on a seeded fraction, score held-out pairs ---
def arithmetic_setup(task, init, seed, config, device):
    data = tasks.arithmetic_dataset(task, config["train_frac"], seed, config["eval_size"])
    exact = maskprior.ARITHMETIC_MASKS[task](config["layers"], config["heads"])
    pattern = maskprior.edited_prior(exact, config.get("mask_error"), seed)       # (L, H, N, N)
    # Structured SVD on arithmetic opens with 10000 and closes with 0 (Table "Arithmetic task
    # setup"); the encoder reads a 10-way digit at every position, no CLS.
    model, seconds = build_encoder(
        init, scaled_pattern(pattern, config, "arithmetic"), config, seed, device,
        {"open_logit": 1e4, "noise_scale": 0.0}, vocab_size=tasks.ARITHMETIC_VOCAB,
        seq_len=pattern.shape[-1], out_dim=10, cls_token=False, readout="tokens")
    def loss_of(net, batch):                     # cross-entropy on the answer digits
        with tasks.autocast(device):
            logits = tasks.answer_logits(net, batch[0].to(device))               # (B, K, 10)
        return F.cross_entropy(logits.float().flatten(0, 1), batch[1].to(device).flatten())
    def sample_metrics():                        # the first 10k pairs during training
        logits = tasks.arithmetic_logits(model, data["x_eval"][:10_000])
        metrics = tasks.arithmetic_metrics(logits, data["y_eval"][:10_000])
        return {f"sample_{key}": value for key, value in metrics.items()}
    def final(state, world):                     # every evaluation pair at the end
        logits = tasks.arithmetic_logits(model, data["x_eval"])
        return {**tasks.arithmetic_metrics(logits, data["y_eval"]),
                "train_loss": state["history"][-1]["train_loss"]}
    return encoder_experiment(
        model, data["x_train"], data["y_train"], seed, config, loss_of, sample_metrics, final,
        probe=data["x_eval"][:4096], pattern=pattern, true_pattern=exact,
        info={"init_seconds": seconds, "train_pairs": len(data["x_train"]),
              "eval_pairs": data["eval_pairs"], "held_out_pairs": data["held_out_pairs"]})

# --- Language (Appendix "Wiki-text and Tiny-stories", Table "Perplexity (PPL) comparison") ---
def lm_setup(task, init, seed, config, device, data, rank):
    """A GPT with no prior, the causal relative-distance mask (M_ij = -max(i - j, 0), scale s = A)
    or mimetic W_Q / W_K; nanoGPT's random windows, one stream per rank; whole-split perplexity."""
    L, H, T = config["layers"], config["heads"], config["block_size"]
    masks = mask_inits(init, maskprior.relative_distance_mask(H, T).expand(L, -1, -1, -1))
    model = maskprior.GPT(data["vocab_size"], T, config["dim"], L, H, config["dropout"],
                          mode=INITS[init][0], masks=masks, mask_scale=config["mask_magnitude"])
    add_prior(model, init, None, seed)
    model.to(device)
    optimizer = make_optimizer(model, config)
    windows = torch.Generator().manual_seed(seed + 1000 * rank)
    torch.manual_seed(seed + 1000 * rank)        # dropout differs across ranks, as it should
    E, iters = config["eval_every"], config["iters"]
    def batches(r):                              # iterations (r - 1) E + 1 ... min(r E, iters)
        count = min(E, iters - (r - 1) * E)
        return (tasks.lm_batch(data["train"], T, config["batch_size"], windows) for _ in range(count))
    def loss_of(net, batch):
        with tasks.autocast(device):
            return net(batch[0].to(device), batch[1].to(device))[1]
    def validation():
        val_loss = tasks.lm_loss(model, data["val"], T)
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss)}
    def final(state, world):
        val_loss = state["history"][-1]["val_loss"]
        test_loss = val_loss if data["test_is_val"] else tasks.lm_loss(model, data["test"], T)
        prompt = data["val"][:T // 4][None].to(device)   # a short continuation, top-40 sampling
        sample = model.generate(prompt, 120, top_k=40,
                                generator=torch.Generator(device=device).manual_seed(seed))
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss), "test_loss": test_loss,
                "test_ppl": math.exp(test_loss), "test_is_val": data["test_is_val"],
                "tokens_per_second": state["samples"] * T * world / state["train_seconds"],
                "sample": data["decode"](sample[0].tolist())}
    # Where attention goes (attention_*.pt, what --mask-from reads): the first 64 validation windows.
    probe = torch.stack([data["val"][s:s + T] for s in range(0, len(data["val"]) - T, T)][:64])
    return Experiment(model, optimizer, cosine(optimizer, iters), math.ceil(iters / E), iters,
                      batches, loss_of, validation, final, unit="iter", probe=probe,
                      generators=(windows,), info=data.get("info", {}))

# --- Vision (Section 5.3, Table "Best Top-1 accuracy"; setup: Tables "Experimental setup for ..."
def vision_schedule(optimizer, config, steps_per_epoch):
    """Per-step lr (Tables "Experimental setup for ..."): linear warmup, cosine to min_lr, cooldown."""
    lr, warmup = optimizer.param_groups[0]["lr"], config["warmup_epochs"] * steps_per_epoch
    decay = (config["epochs"] - config["warmup_epochs"]) * steps_per_epoch
    floor, parts, milestones = min(config["min_lr"], lr), [], []
    if warmup:
        parts.append(torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=min(1.0, config["warmup_lr"] / lr), total_iters=warmup))
        milestones.append(warmup)
    parts.append(cosine(optimizer, decay, floor))
    if config["cooldown_epochs"]:
        parts.append(torch.optim.lr_scheduler.ConstantLR(
            optimizer, factor=floor / lr, total_iters=config["cooldown_epochs"] * steps_per_epoch))
        milestones.append(warmup + decay)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, parts, milestones)

def timm_vit(config, data, masks, mode):
    """--model timm: timm's VisionTransformer (qkv bias, drop path rising to drop_path, CLS or average
    pool) of the preset's shape; M, if any, put in by maskprior.add_mask_prior."""
    import timm
    model = timm.models.VisionTransformer(
        img_size=config["image_size"], patch_size=config["patch_size"], in_chans=data.get("channels", 3),
        num_classes=data["classes"], embed_dim=config["dim"], depth=config["layers"],
        num_heads=config["heads"], mlp_ratio=config["mlp_dim"] / config["dim"],
        drop_path_rate=config["drop_path"], global_pool="token" if config["pool"] == "cls" else "avg")
    if masks is not None:
        maskprior.add_mask_prior(model, masks, mode=mode)
    return model

def vision_setup(task, init, seed, config, device, data, rank, world, workers):
    """A ViT with the 3 x 3 impulse pattern as prior, in M or in W_Q / W_K (impulse); RandAugment,
    MixUp / CutMix, label smoothing, AdamW with vision_schedule; each epoch seeded by (seed, epoch, rank)."""
    from torchvision.ops import StochasticDepth
    L, H = config["layers"], config["heads"]
    pattern = maskprior.impulse_mask(L, H, config["image_size"] // config["patch_size"])
    rates = torch.linspace(0, config["drop_path"], L).tolist()   # drop path rising to 0.1
    masks = mask_inits(init, scaled_pattern(pattern, config, "vision"))
    if config.get("model") == "timm":
        model, pattern = timm_vit(config, data, masks, INITS[init][0]), None    # no return_attn
    else:
        model = maskprior.ViT(config["image_size"], config["patch_size"], data["classes"], config["dim"],
                              L, H, config["mlp_dim"], channels=data.get("channels", 3),
                              mode=INITS[init][0], masks=masks, pool=config["pool"],
                              drop_paths=[StochasticDepth(r, "row") for r in rates])
    seconds = add_prior(model, init, pattern, seed)
    model.to(device)
    if config["batch_size"] % world:
        raise UsageError(f"--batch-size {config['batch_size']} does not split over {world} processes")
    train_loader, test_loader, sampler = tasks.vision_loaders(
        data, config["batch_size"], rank, world, workers, seed, pin_memory=device.type == "cuda")
    if len(train_loader) == 0:
        raise UsageError(f"--batch-size {config['batch_size']} is larger than the training set "
                         f"({len(data['train'])} images)")
    optimizer = make_optimizer(model, config)
    rounds = config["epochs"] + config["cooldown_epochs"]
    mix = tasks.mixup_cutmix(data["classes"], config["mixup"], config["cutmix"])
    def batches(epoch):
        # Drop path, MixUp / CutMix and the augmentations draw from torch's generator or the loader's
        # workers: seeding both makes a run resumed at an epoch boundary repeat the uninterrupted one.
        sampler.set_epoch(epoch)
        epoch_seed = (seed * 100_003 + epoch) * 1_009 + rank
        torch.manual_seed(epoch_seed)
        train_loader.generator.manual_seed(epoch_seed)
        return train_loader
    def loss_of(net, batch):
        images, labels = (t.to(device, non_blocking=True) for t in batch)
        images, soft_targets = mix(images, labels)                     # (B, C, S, S), (B, classes)
        with tasks.autocast(device):
            logits = net(images)                                       # (B, classes)
        return F.cross_entropy(logits.float(), soft_targets, label_smoothing=config["label_smoothing"])
    def top1():    # top-1 % and mean cross-entropy on the whole test set, summed over the ranks
        correct, total, n = (sum(v) for v in zip(*gather(tasks.vision_scores(model, test_loader), world)))
        return {"test_top1": 100.0 * correct / n, "test_loss": total / n}
    def final(state, world):
        last = state["history"][-1]
        return {"top1": last["test_top1"], "test_loss": last["test_loss"],
                "best_top1": max(e["test_top1"] for e in state["history"] if "test_top1" in e),
                "train_loss": last["train_loss"],
                "images_per_second": state["samples"] * world / state["train_seconds"]}
    probe = None if pattern is None else torch.stack(       # fixed; timm's ViT: no attention maps
        [data["test"][i][0] for i in range(min(64, len(data["test"])))])
    return Experiment(model, optimizer, vision_schedule(optimizer, config, len(train_loader)), rounds,
                      rounds * len(train_loader), batches, loss_of, top1, final,
                      eval_every=config["eval_every"], probe=probe, probe_batch=16, pattern=pattern,
                      info={"init_seconds": seconds, **data.get("info", {})})

# === 5. The training loop: the same for every family ==============================================
def round_batches(exp, r, partial, device):
    """(round r's batches, losses so far, random states at its start). A round a checkpoint cut (partial)
    is drawn again from its start's states, done batches skipped, the cut's states put back."""
    if partial is None:
        round_start = rng_states(exp, device)       # before exp.batches, which may seed
        return iter(exp.batches(r)), [], round_start
    at_cut = rng_states(exp, device)
    set_rng_states(exp, device, partial["rngs"])
    batches = iter(exp.batches(r))
    for _ in range(partial["done"]):
        next(batches)
    set_rng_states(exp, device, at_cut)
    return batches, list(partial["losses"]), partial["rngs"]

def position(exp, r, step):  # where a run is: "epoch 3 (step 34)", or "iteration 37" for language
    return f"iteration {step}" if exp.unit == "iter" else f"epoch {r} (step {step})"

def train(exp, state, job, place, stop):
    """Rounds of optimizer steps, each ending in a history entry (every eval_every rounds with exp.evaluate())
    and a checkpoint. Diverged on a non-finite loss; a signal: a checkpoint of this step, then Interrupted."""
    device, rank, world = place
    net = DDP(exp.model) if world > 1 else exp.model
    net = torch.compile(net) if job.compile else net
    bar = tqdm(total=exp.steps, initial=state["step"], desc=f"{job.task}/{job.init}/seed{job.seed}",
               leave=False, dynamic_ncols=True,
               disable=None if job.progress and rank == 0 else True)   # None: off unless a terminal
    def keep(r, partial=None):
        """checkpoint.pt of this step (rank 0 writes); partial: a round cut after partial["done"]."""
        rngs = gather(rng_states(exp, device), world)
        if rank == 0:
            save_checkpoint(os.path.join(job.out_dir, "checkpoint.pt"), {
                "meta": job.meta(world), "model": exp.model.state_dict(),
                "optimizer": exp.optimizer.state_dict(), "schedule": exp.schedule.state_dict(),
                "rng": rngs, "state": state, "partial": partial})
        if world > 1:
            dist.barrier()
        stop.kept = f"the checkpoint of {position(exp, r, state['step'])}"
    for r in range(state["round"] + 1, exp.rounds + 1):
        batches, losses, round_start = round_batches(exp, r, state.pop("partial", None), device)
        for batch in batches:
            start = time.time()
            loss = exp.loss_of(net, batch)
            state["step"] += 1
            diverged, signum = agreed([not torch.isfinite(loss.detach()), stop.signal or 0], world, device)
            if diverged:
                raise Diverged(f"loss became {loss.item()} at step {state['step']} ({exp.unit} {r})")
            exp.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            exp.optimizer.step()
            exp.schedule.step()
            losses.append(loss.item())           # .item() waits for the step: timing is honest
            state["train_seconds"] += time.time() - start
            state["samples"] += len(batch[0])
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            stop.at = position(exp, r, state["step"])
            signum = signum if world > 1 else stop.signal   # torchrun: the one all ranks agreed on
            if signum:
                keep(r, {"round": r, "done": len(losses),
                         "ranks": gather({"losses": losses, "rngs": round_start}, world)})
                raise stop.interrupted(signum)
        train_loss = statistics.fmean(gather(statistics.fmean(losses), world))   # over the ranks
        entry = {exp.unit: state["step"] if exp.unit == "iter" else r, "train_loss": train_loss,
                 "lr": exp.schedule.get_last_lr()[0]}
        state["history"].append(entry)
        state["round"] = r
        evaluate = r % exp.eval_every == 0 or r == exp.rounds
        if evaluate:
            entry.update(exp.evaluate())         # evaluate and checkpoint every eval_every
        signum = agreed([stop.signal or 0], world, device)[0]   # one that came since the last step
        if evaluate or signum:
            keep(r)
        if signum:
            raise stop.interrupted(signum)
    if stop.signal:                 # came after the last checkpoint: it holds the whole run
        raise stop.interrupted()
    bar.close()

# === 6. One run: the prior before, training, the prior after, result.json and the pictures ========
def snapshot(exp, device):
    """The prior as the model holds it now: mean attention maps on the probe inputs and the mask
    bias log sigmoid(s M), both (L, H, N, N) or None; a ViT's centre patch on the first probe."""
    probe, model = exp.probe, exp.model
    attn = None if probe is None else maskprior.mean_attention(model, probe, device, exp.probe_batch)
    snap = {"attn": attn, "bias": maskprior.mask_biases(model)}
    if isinstance(model, maskprior.ViT):
        snap["centre"] = maskprior.centre_patch_maps(model, probe[:1], device)
    return snap

def save_pictures(out_dir, snapshots, model):
    """attention_<when>.pt of the newest snapshot; attention.svg (tasks.attention_figure) of all so far."""
    when = list(snapshots)[-1]
    save_checkpoint(os.path.join(out_dir, f"attention_{when}.pt"), snapshots[when])
    svg = tasks.attention_figure(snapshots, cls_token=getattr(model, "cls", None) is not None,
                                 causal=isinstance(model, maskprior.GPT))
    if svg:
        write_atomic(os.path.join(out_dir, "attention.svg"), svg)

def resume_from(checkpoint, meta, exp, place):
    """checkpoint.pt loaded into exp; returns its state (a cut round in state["partial"])."""
    saved = load_checkpoint(checkpoint, meta)
    exp.model.load_state_dict(saved["model"])
    exp.optimizer.load_state_dict(saved["optimizer"])
    exp.schedule.load_state_dict(saved["schedule"])
    set_rng_states(exp, place.device, saved["rng"][place.rank])
    state, cut = saved["state"], saved.get("partial")      # cut: the round a signal cut, if any
    if cut:
        state["partial"] = {"round": cut["round"], "done": cut["done"], **cut["ranks"][place.rank]}
    return state

def run(job, device, stop):
    """Build the job's experiment, snapshot its attention (before), train, snapshot (after), write
    result.json and the pictures to job.out_dir. Under torchrun rank 0 writes; the others return None."""
    device, rank, world = place = distributed_setup(device)
    torch.manual_seed(job.seed)                 # the same initial weights on every rank
    task, init, seed, config = job.task, job.init, job.seed, job.config
    common = (task, init, seed, config, device)
    workers = job.workers if job.workers is not None else 8 if device.type == "cuda" else 0
    exp = {"boolean": lambda: boolean_setup(*common),
           "arithmetic": lambda: arithmetic_setup(*common),
           "language": lambda: lm_setup(*common, job.data, rank),
           "vision": lambda: vision_setup(*common, job.data, rank, world, workers)}[job.family]()
    if config.get("mask_from"):                 # M from a trained run's attention, not by hand
        use_learned_prior(exp, config)
    state = {"round": 0, "step": 0, "history": [], "train_seconds": 0.0, "samples": 0}
    if job.resume:
        state = resume_from(os.path.join(job.out_dir, "checkpoint.pt"), job.meta(world), exp, place)
        stop.at = position(exp, state["partial"]["round"] if "partial" in state else state["round"],
                           state["step"])
        stop.kept = f"the checkpoint of {stop.at}"
    else:
        os.makedirs(job.out_dir, exist_ok=True)
        state["before"] = snapshot(exp, device)
        if rank == 0:
            save_pictures(job.out_dir, {"before": state["before"]}, exp.model)
    resumed_at = (state["step"] if exp.unit == "iter" else state["round"]) if job.resume else None
    result = {"task": task, "init": init, "seed": seed, "config": config, "device": str(device),
              "world_size": world, "status": "running", "seconds": None,
              "resumed_at": resumed_at, **exp.info, "data_fingerprint": job.fingerprint,
              "final": None, "history": state["history"]}
    start = time.time()
    try:
        stop.training = True            # a first signal now stops the loop after its step
        train(exp, state, job, place, stop)
    except Diverged as err:
        result.update(status="diverged", error=str(err), seconds=time.time() - start)
        if rank == 0:
            write_json(os.path.join(job.out_dir, "result.json"), result)
        raise
    finally:
        stop.training = False
    if rank != 0:
        return None
    after = snapshot(exp, device)
    save_pictures(job.out_dir, {"before": state["before"], "after": after}, exp.model)
    result["final"] = {**exp.final(state, world),
                       **maskprior.persistence_fields(state["before"], after, exp.pattern, exp.true_pattern)}
    result.update(status="done", seconds=time.time() - start)
    write_json(os.path.join(job.out_dir, "result.json"), result)
    return result

# === 7. Tables, and main: one run, or a grid of tasks x inits x seeds x each sweep's settings =====
def write_tables(root, results):
    """table.md under root (printed too), curves.svg and the SVG figures of the sweeps it holds."""
    text, figures = tasks.result_tables(results, list(INITS))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise WriteError(root, err) from None
    for name, content in {**figures, "table.md": text}.items():
        write_atomic(os.path.join(root, name), content)
    print(f"\n{text}\nwrote {os.path.join(root, 'table.md')}")

def summarize(root):
    """--summarize DIR: the tables of every run below DIR; a run found twice (a copied folder) counts
    once. Exit 1 when a damaged result.json was skipped, 2 when nothing could be read."""
    if not os.path.isdir(root):
        raise UsageError(f"--summarize {root}: "
                         f"{'not a folder' if os.path.exists(root) else 'no such folder'}")
    paths = [os.path.join(folder, "result.json") for folder, _, files in sorted(os.walk(root))
             if "result.json" in files]
    readable = [(path, r) for path in paths for r in [read_result(path)] if r is not None]
    if not readable:
        raise UsageError(f"--summarize: no readable result.json below {root}")
    first = {}                         # run -> (path, result.json) of its first copy
    for path, r in readable:
        run_id = json.dumps([r["task"], r["init"], r["seed"], r["config"]], sort_keys=True)
        if run_id in first:
            print(f"train.py: warning: {path} is the run of {first[run_id][0]} again (same task, "
                  f"init, seed and config): counted once", file=sys.stderr)
        first.setdefault(run_id, (path, r))
    try:
        write_tables(root, [r for _, r in first.values()])
    except WriteError as err:          # DIR itself cannot take the tables: a bad path
        raise UsageError(str(err))
    return 0 if len(readable) == len(paths) else 1

def load_data(family, task, config, args, device, cache):
    """The language corpus or vision data set, read once per grid (else None); rank 0 downloads."""
    if family == "language":
        if task not in cache:
            cache[task] = tasks.lm_dataset(task, args.data_dir, args.bpe_file)
        tasks.check_lm_splits(cache[task], config["block_size"])
        return cache[task]
    if family != "vision":
        return None
    key = (task, config["image_size"], config["randaugment"], config["crop_scale"])
    if key not in cache:
        _, rank, world = distributed_setup(device)
        if args.download and rank == 0:
            tasks.vision_dataset(task, args.data_dir, key[1], True, *key[2:])
        if world > 1 and args.download:
            dist.barrier()
        cache[key] = tasks.vision_dataset(task, args.data_dir, key[1], False, *key[2:])
    return cache[key]

def train_all(args, family, task_names, device, stop, grid_lock):
    """Every run of the command, each in its locked folder, then a grid's tables (grid_lock: its lock)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = args.seeds if args.seeds is not None else [args.seed]
    if args.seeds is None and args.seed == 0 and args.preset == "paper":
        seeds = [PAPER_SEEDS.get(family, PAPER_SEEDS.get(" ".join(task_names), 0))]
    sweeps = [getattr(args, flag) or [None] for flag in SWEEP_FLAGS]   # distinct values: merge_repeats
    first_a, first_lr = sweeps[1][0], sweeps[4][0]      # A only acts on M, --mask-lr on a trained M
    runs = [(t, i, s, (f, a, w, e, r if trains_mask(i) else None, tau))
            for t, f, a, w, e, r, tau, i, s in itertools.product(task_names, *sweeps, args.init, seeds)
            if (i in tasks.MASK_PRIOR_INITS or a == first_a) and (trains_mask(i) or r == first_lr)]
    grid, root = len(runs) > 1, args.out or "runs/grid"
    source = args.mask_from and os.path.basename(os.path.abspath(args.mask_from))
    results, failed, cache = [], 0, {}
    writer, root_locked = int(os.environ.get("RANK", "0")) == 0, False   # torchrun: rank 0 writes
    for task, init, seed, sweeps in runs:
        name = tasks.run_name(task, init, seed, args.mask_variant, *sweeps, source=source)
        out_dir = os.path.join(root, name) if grid else args.out or os.path.join("runs", name)
        checkpoint = os.path.join(out_dir, "checkpoint.pt")
        resume = args.resume and (not grid or os.path.exists(checkpoint))   # a grid: runs with a checkpoint
        stop.start(out_dir, grid, resume)
        config = make_config(family, task, args, *sweeps)
        data = load_data(family, task, config, args, device, cache)
        fingerprint = data_fingerprint(family, task, config, seed, data)
        check_fits(family, config)
        if args.resume and not grid and not os.path.isdir(out_dir):
            raise no_checkpoint(checkpoint)        # said before a folder is made for it
        if grid and writer and not root_locked:     # held until the grid's tables are written
            grid_lock.enter_context(folder_lock(root))
            root_locked = True
        try:
            with folder_lock(out_dir) if writer else contextlib.nullcontext():
                finished = args.resume and finished_run(out_dir, task, init, seed, config, fingerprint)
                if finished:                   # left as it is, every file
                    results.append(finished)
                    if not grid:
                        print(f"{task} / {init} / seed {seed}: already finished, nothing to resume; "
                              f"{out_dir} is left as it was")
                    continue
                job = Job(family, task, init, seed, config, out_dir, data, fingerprint, resume,
                          args.workers, args.compile, not args.no_progress)
                with subnormals_flushed(device):
                    result = run(job, device, stop)
        except Diverged as err:
            print(f"{task} / {init} / seed {seed}: stopped, {err}; what was saved is in {out_dir}",
                  file=sys.stderr)
            failed += 1
            results += [r for r in [read_result(os.path.join(out_dir, "result.json"))] if r]
            continue
        if result is not None:                 # None: a torchrun rank other than 0; rank 0 reports
            results.append(result)
            print(tasks.summary_line(result), flush=True)
            if not grid:
                print(f"wrote {os.path.join(out_dir, 'result.json')}")
    if dist.is_initialized():
        dist.destroy_process_group()
    if grid and results:
        write_json(os.path.join(root, "grid.json"), results)
        write_tables(root, results)
    return 1 if failed else 0

def main(argv=None):
    """Exit 0; 1 when a run diverged or a write failed; 2 for bad input or an output folder that cannot
    be made, written or locked; 130 / 143 on SIGINT / SIGTERM; each failure one line on stderr."""
    stop = Stop()
    try:
        args = build_parser().parse_args(argv)
        if args.summarize:
            return summarize(args.summarize)
        device = resolve_device(args.device)
        family = check_args(args, list(tasks.BOOLEAN_TASKS) if "all" in args.task else args.task)
        merge_repeats(args)
        task_names = list(tasks.BOOLEAN_TASKS) if "all" in args.task else args.task
        with signals_caught(stop), contextlib.ExitStack() as grid_lock:
            return train_all(args, family, task_names, device, stop, grid_lock)
    except (UsageError, tasks.DataError) as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:
        if int(os.environ.get("RANK", "0")) == 0:      # torchrun: every rank stops, rank 0 says so
            print(f"train.py: {err}", file=sys.stderr)
        return err.exit_code
    except WriteError as err:
        print(f"train.py: error: {err}; {stop.advice()}", file=sys.stderr)
        return 1

if __name__ == "__main__":
    sys.exit(main())
