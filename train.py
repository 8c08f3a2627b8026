"""Train and evaluate the paper's experiments: one run, or a grid of runs and its tables.

    python train.py --task majority --init mask                    # Boolean GOTU, Section 5.1
    python train.py --task addition --init default mask            # arithmetic, Section 5.2
    python train.py --task cifar10 --init impulse --data-dir data  # vision, Section 5.3
    python train.py --task lm --init mask                          # language, Appendix "Wiki-text"
    python train.py --task images --data-dir DIR                   # your own images (text: --help)
    python train.py --summarize runs/grid                          # tables of finished runs

Part A, the experiment, read beside the paper: the presets (its setup tables) and inits (Table 1's
rows), the optimizer, each family's setup, ONE training loop (`train`), one run (prior before ->
train -> prior after -> result.json), the command line and `main`. Part B, the run machinery behind
it: errors, atomic files, the folder lock, signals, checkpoints and --resume, data fingerprints, RNG
state, torchrun, threads and devices. Uses maskprior.py (models, masks, QK baselines) and tasks.py
(data, metrics, tables).
"""

import os
import signal
import sys

if __name__ == "__main__":   # Ctrl-C or SIGTERM while torch loads (seconds): one line, exit 130 / 143
    def interrupted_while_starting(signum, frame):
        print("train.py: interrupted while starting; nothing was written", file=sys.stderr)
        os._exit(128 + signum)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupted_while_starting)

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import io
import itertools
import json
import math
import pathlib
import re
import statistics
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

# ==================================================================================================
# Part A. The experiment
# ==================================================================================================

# === A.1 Presets: the paper's setup tables ("paper") and a 2-core CPU version of each ("cpu") =====
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

# === A.2 Inits: the rows of Table 1 and of the vision and language tables =========================
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
MASK_PRIOR_INITS = tuple(i for i, (_, prior) in INITS.items() if prior == "mask")   # M holds the prior

def trains_mask(init):
    """M is a parameter the optimizer moves (learnable and Hadamard; not mask-fixed, not vanilla)."""
    return INITS[init][0] in ("learnable", "hadamard")

# The four families (their tasks: tasks.FAMILY_OF): inits, the paper's mask magnitude A (open +A, closed -A).
FAMILIES = {
    "boolean": {"inits": ENCODER_INITS, "magnitude": maskprior.OPEN},
    "arithmetic": {"inits": ENCODER_INITS, "magnitude": maskprior.ARITHMETIC_OPEN},
    "language": {"inits": ("default", "mask", "mimetic"), "magnitude": maskprior.GPT_MASK_SCALE},
    "vision": {"inits": ("default", "mimetic", "impulse", "mask-fixed", "mask"), "magnitude": maskprior.OPEN},
}
PRESETS = {"boolean": BOOLEAN_PRESETS, "arithmetic": ARITHMETIC_PRESETS, "language": LM_PRESETS,
           "vision": VISION_PRESETS}

# === A.3 The optimizer ============================================================================
def make_optimizer(model, config):
    """Adam with coupled L2 on every parameter (aryol/GOTU's Boolean optimizer: weight decay enters the
    gradient, so Adam rescales it) or AdamW decaying weight matrices only (nanoGPT, timm). M is a group of
    its own, decayed by --mask-decay alone (default 0: decay pulls M toward the neutral mask, Appendix
    A.1, and so erodes the prior whose persistence is Section 6.1's point) at --mask-lr (default --lr)."""
    groups = {"weights": [], "others": [], "mask": []}
    no_decay = {"pos", "cls", *getattr(model, "no_weight_decay", set)()}   # timm: pos_embed, cls_token
    for name, p in model.named_parameters():
        decays = config["optimizer"] == "adam" or (p.dim() >= 2 and name not in no_decay)
        if not p.requires_grad:
            continue
        if name.endswith("mask"):
            groups["mask"].append(p)
        else:
            groups["weights" if decays else "others"].append(p)
    decay = {"weights": config["weight_decay"], "others": 0.0, "mask": config["mask_decay"]}
    lrs = {"weights": config["lr"], "others": config["lr"], "mask": config.get("mask_lr") or config["lr"]}
    Optimizer = torch.optim.Adam if config["optimizer"] == "adam" else torch.optim.AdamW
    return Optimizer([{"params": ps, "weight_decay": decay[g], "lr": lrs[g]} for g, ps in groups.items() if ps])

# === A.4 The experiment of each family: its data (built once), model, loss, evaluation ============
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
    net: Optional[torch.nn.Module] = None     # what the loop calls: the model, or its DDP / compiled form

def load_data(family, task, config, seed, args, device):
    """A run's data, built or read once per command (tasks.py's loaders cache it): the Boolean cube and
    seen set (Section 5.1), the arithmetic split of this seed (Section 5.2), a corpus (Appendix), an
    image set (Section 5.3)."""
    if family == "boolean":
        return tasks.boolean_dataset(task)
    if family == "arithmetic":
        return tasks.arithmetic_dataset(task, config["train_frac"], seed, config["eval_size"])
    if family == "language":
        data = tasks.lm_dataset(task, args.data_dir, args.bpe_file)
        tasks.check_lm_splits(data, config["block_size"])
        return data
    return vision_data(task, (config["image_size"], config["randaugment"], config["crop_scale"]), args, device)

# --- Boolean GOTU (Section 5.1, Table 1): train on the seen points, test on the whole cube -----
def boolean_setup(task, init, seed, config, device, data):
    exact = maskprior.boolean_mask(task, config["layers"], config["heads"],
                                   config.get("mask_variant"))                    # (L, H, N, N)
    pattern = exact
    if config.get("mask_error"):                                                  # KIND:P
        kind, fraction = config["mask_error"].split(":")
        pattern = maskprior.edit_pattern(exact, kind, float(fraction), seed, cls_row=True)
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
def arithmetic_setup(task, init, seed, config, device, data):
    exact = maskprior.ARITHMETIC_MASKS[task](config["layers"], config["heads"])
    pattern = exact                                                               # (L, H, N, N)
    if config.get("mask_error"):                                                  # KIND:P
        kind, fraction = config["mask_error"].split(":")
        pattern = maskprior.edit_pattern(exact, kind, float(fraction), seed)
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
    probe = None
    if pattern is not None:                     # fixed images; timm's ViT: no attention maps
        probe = torch.stack([data["test"][i][0] for i in range(min(64, len(data["test"])))])
    return Experiment(model, optimizer, vision_schedule(optimizer, config, len(train_loader)), rounds,
                      rounds * len(train_loader), batches, loss_of, top1, final,
                      eval_every=config["eval_every"], probe=probe, probe_batch=16, pattern=pattern,
                      info={"init_seconds": seconds, **data.get("info", {})})

# --- What the setups share: the encoder with its prior, its experiment, the data of vision runs ---
def encoder_experiment(model, x, y, seed, config, *functions, **fields):
    """Boolean / arithmetic: a cosine over all steps, each epoch all (x, y) in seeded shuffled batches."""
    steps = math.ceil(len(x) / config["batch_size"]) * config["epochs"]
    optimizer = make_optimizer(model, config)
    shuffle = torch.Generator().manual_seed(seed)
    batches = lambda epoch: ((x[idx], y[idx]) for idx in torch.randperm(
        len(x), generator=shuffle).split(config["batch_size"]))
    return Experiment(model, optimizer, cosine(optimizer, steps), config["epochs"], steps, batches,
                      *functions, eval_every=config["eval_every"], generators=(shuffle,), **fields)

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

def scaled_pattern(pattern, config, family):
    """The pattern with open +A and closed -A, A = --mask-magnitude (the paper's A by default)."""
    return pattern * (config["mask_magnitude"] / FAMILIES[family]["magnitude"])

def cosine(optimizer, steps, floor=0.0):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=floor)

def vision_data(task, key, args, device):
    """A vision data set (tasks.vision_dataset); under torchrun rank 0 downloads it first (--download)."""
    image_size, randaugment, crop_scale = key
    _, rank, world = distributed_setup(device)
    if args.download and rank == 0:
        tasks.vision_dataset(task, args.data_dir, image_size, True, randaugment, crop_scale)
    if world > 1 and args.download:
        dist.barrier()
    return tasks.vision_dataset(task, args.data_dir, image_size, False, randaugment, crop_scale)

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
    threads: Optional[int] = None      # torch CPU threads (choose_threads; --resume: the checkpoint's)
    threads_given: bool = False        # --threads was given
    data_dir: Optional[str] = None     # where its files were read (own data, corpora, images)
    def meta(self, world):  # what checkpoint.pt records of the run, for --resume to compare
        return {"task": self.task, "init": self.init, "seed": self.seed, "config": self.config,
                "world_size": world, "data_fingerprint": self.fingerprint}

# === A.5 The training loop: the same for every family =============================================
def train(exp, state, guard):
    """Rounds of minibatch steps (a round: an epoch, or eval_every language iterations), each step
    batch -> loss -> backward -> step -> lr schedule, each round ending in a history entry of its mean
    training loss and, every eval_every rounds and after the last, an evaluation. guard (Part B) owns
    the rest: it cuts a round a checkpoint interrupted back to its batches left, stops a NaN loss before
    its step (Diverged), keeps checkpoints, and on a signal saves the step under way and stops."""
    for r in range(state["round"] + 1, exp.rounds + 1):
        for batch in guard.batches(r, state):          # round r's batches (after a cut: those left)
            loss = exp.loss_of(exp.net, batch)          # forward: the family's training loss
            guard.check(loss, r, state)                 # NaN or infinite on any rank: Diverged
            exp.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            exp.optimizer.step()
            exp.schedule.step()                         # every setup's schedule steps per batch
            guard.stepped(loss, batch, r, state)        # its time, the bar; a signal: stop here
        entry = {exp.unit: state["step"] if exp.unit == "iter" else r,
                 "train_loss": guard.round_loss(), "lr": exp.schedule.get_last_lr()[0]}
        state["history"].append(entry)
        state["round"] = r
        evaluate = r % exp.eval_every == 0 or r == exp.rounds
        if evaluate:
            entry.update(exp.evaluate())                # e.g. Table 1's accuracy on the whole cube
            guard.report(entry)                         # a line a log keeps
        guard.round_done(r, state, evaluate)            # a checkpoint at each evaluation
    guard.finished()

# === A.6 One run: the prior before, training, the prior after (Section 6.1), result.json ==========
def run(job, device, stop):
    """Build the job's experiment, snapshot its attention (before), train, snapshot (after), write
    result.json and the pictures to job.out_dir. Under torchrun rank 0 writes; the others return None."""
    device, rank, world = place = distributed_setup(device)
    torch.manual_seed(job.seed)                 # the same initial weights on every rank
    exp = setup(job, place)
    if job.config.get("mask_from"):             # M from a trained run's attention, not by hand
        use_learned_prior(exp, job.config)
    exp.net = DDP(exp.model) if world > 1 else exp.model   # torchrun: gradients averaged over ranks
    exp.net = torch.compile(exp.net) if job.compile else exp.net
    state = {"round": 0, "step": 0, "history": [], "train_seconds": 0.0, "samples": 0,
             "threads": job.threads}
    if job.resume:                              # the checkpoint's weights, optimizer, RNG and state
        state = resume_from(os.path.join(job.out_dir, "checkpoint.pt"), job.meta(world), exp, place)
        state["threads"] = use_threads_of_checkpoint(state.get("threads"), job)
    else:                                       # the prior as initialised: Section 6.1's "before"
        os.makedirs(job.out_dir, exist_ok=True)
        state["before"] = snapshot(exp, device)
        if rank == 0:
            save_pictures(job.out_dir, {"before": state["before"]}, exp.model)
    torch.set_num_threads(state["threads"])
    resumed_at = None                           # where a resumed run picked up: its epoch, or iteration
    if job.resume:
        resumed_at = state["step"] if exp.unit == "iter" else state["round"]
    result = {"task": job.task, "init": job.init, "seed": job.seed, "config": job.config, "device": str(device),
              "threads": state["threads"], "data_dir": job.data_dir,
              "preset_changes": preset_changes(job.family, job.task, job.config),
              "mask_prior": job.init in MASK_PRIOR_INITS, "world_size": world, "status": "running",
              "seconds": None, "resumed_at": resumed_at, **exp.info, "data_fingerprint": job.fingerprint,
              "final": None, "history": state["history"]}
    start = time.time()
    try:
        with Guard(exp, state, job, place, stop) as guard:
            train(exp, state, guard)
    except Diverged as err:
        result.update(status="diverged", error=str(err), seconds=time.time() - start)
        if rank == 0:
            write_json(os.path.join(job.out_dir, "result.json"), result)
        raise
    if rank != 0:
        return None
    after = snapshot(exp, device)                 # the prior after training: does it persist?
    save_pictures(job.out_dir, {"before": state["before"], "after": after}, exp.model)
    result["final"] = {**exp.final(state, world),
                       **maskprior.persistence_fields(state["before"], after, exp.pattern, exp.true_pattern)}
    result.update(status="done", seconds=time.time() - start)
    result, not_finite = finite(result)          # result.json is strict JSON: null, and a note
    if not_finite:
        result["not_finite"] = not_finite
        print(f"train.py: warning: {job.task} / {job.init} / seed {job.seed}: not finite, stored as "
              f"null: {', '.join(f'{k} {v}' for k, v in not_finite.items())}", file=sys.stderr)
    write_json(os.path.join(job.out_dir, "result.json"), result)
    return result

def setup(job, place):
    """The job's Experiment from its family's setup (A.4)."""
    task, init, seed, config, data = job.task, job.init, job.seed, job.config, job.data
    if job.family == "boolean":
        return boolean_setup(task, init, seed, config, place.device, data)
    if job.family == "arithmetic":
        return arithmetic_setup(task, init, seed, config, place.device, data)
    if job.family == "language":
        return lm_setup(task, init, seed, config, place.device, data, place.rank)
    return vision_setup(task, init, seed, config, place.device, data, place.rank, place.world, job.workers)

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

# === A.7 The command line: the flags, a run's settings, its config; main ==========================
@dataclass(frozen=True)
class RunSettings:
    """One run of a command, a cell of its grid, by name: its task, init and seed, and the value of
    each swept setting (None: the flag was not given; the preset's, or the paper's, value holds)."""
    task: str
    init: str
    seed: int
    train_frac: Optional[float] = None     # --train-frac: the share of pairs trained on (arithmetic)
    mask_magnitude: Optional[float] = None  # --mask-magnitude: open +A, closed -A
    mask_decay: Optional[float] = None     # --mask-decay: weight decay on M alone
    mask_error: Optional[str] = None       # --mask-error: "kind:fraction" edits the prior
    mask_lr: Optional[float] = None        # --mask-lr: the lr of M alone
    mask_threshold: Optional[float] = None  # --mask-threshold: tau of a prior learned by --mask-from

    def folder(self, variant=None, source=None):
        """The run's folder name: <task>-<init>-seed<seed>, then each setting the command gave (defaults
        unnamed): -frac<f>, -<mask variant>, -A<A>, -wd<W>, -err-<kind><p>, -mlr<lr>, -from-<run>-tau<TAU>."""
        kind, fraction = tasks.edit_order(self.mask_error)
        given = [self.train_frac and f"frac{self.train_frac:g}", variant,
                 self.mask_magnitude and f"A{self.mask_magnitude:g}",
                 self.mask_decay is not None and f"wd{self.mask_decay:g}",
                 self.mask_error and f"err-{kind}{fraction:g}", self.mask_lr and f"mlr{self.mask_lr:g}",
                 source and f"from-{source}-tau{self.mask_threshold or 1:g}"]
        return "-".join([f"{self.task}-{self.init}-seed{self.seed}", *filter(None, given)])

# The flags whose values a grid sweeps, as RunSettings names them; each value given twice runs once.
SWEEPS = ("train_frac", "mask_magnitude", "mask_decay", "mask_error", "mask_lr", "mask_threshold")

# Family-only flags (flag: the families that take it), checked by check_args.
FAMILY_FLAGS = {"epochs": ("boolean", "arithmetic", "vision"), "train_frac": ("arithmetic",),
                "head_dim": ("boolean", "arithmetic"), "pos_std": ("boolean", "arithmetic"),
                "cls_std": ("boolean",), "mlp_dim": ("boolean", "arithmetic", "vision"),
                "mask_variant": ("boolean",), "mask_error": ("boolean", "arithmetic"),
                "eval_size": ("arithmetic",),
                **dict.fromkeys(("iters", "block_size", "bpe_file"), ("language",)),
                **dict.fromkeys(("image_size", "patch_size", "warmup_epochs", "workers", "download",
                                 "compile", "model"), ("vision",))}
TIMM_INITS = ("default", "mask", "mask-fixed")  # --model timm: its ViT as is, or M by add_mask_prior

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
    g.add_argument("--mask-error", nargs="+", type=mask_edit, metavar="KIND:P",
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

def mask_edit(text):
    """argparse type of --mask-error: "none" -> None (the exact prior), KIND:P -> "kind:p" with kind
    in maskprior.EDIT_KINDS and 0 < p <= 1."""
    if text == "none":
        return None
    kind, _, number = text.partition(":")
    try:
        fraction = float(number)
    except ValueError:
        fraction = math.nan
    if kind not in maskprior.EDIT_KINDS or not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"expected 'none' or KIND:FRACTION with KIND one of "
                                         f"{', '.join(maskprior.EDIT_KINDS)} and 0 < FRACTION <= 1, got {text!r}")
    return f"{kind}:{fraction}"

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
    if args.model == "timm":    # timm's ViT: no return_attn, so no QK inits and no --mask-from
        if set(args.init) - set(TIMM_INITS) or args.mask_from:
            raise UsageError(f"--model timm takes --init {', '.join(TIMM_INITS)}, no --mask-from")
        if importlib.util.find_spec("timm") is None:
            raise UsageError("--model timm needs timm: pip install timm")
    no_mask = [i for i in args.init if i not in MASK_PRIOR_INITS]
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
    elif args.mask_threshold:
        raise UsageError("--mask-threshold applies with --mask-from only")
    check_out(args.out)
    return family

def check_out(out):
    """UsageError for an --out that is, or lies below, a file, or a link to nothing."""
    out = out and pathlib.Path(out)
    try:
        existing = out and next(p for p in (out, *out.parents) if p.exists() or p.is_symlink())
    except OSError as err:        # a name over 255 bytes (ENAMETOOLONG), a loop of links, ...
        raise UsageError(f"--out {out}: {err.strerror}")
    if existing and not existing.exists():     # a link whose target is gone
        raise UsageError(f"--out {out}: {existing} is a link to {os.readlink(existing)}, which does "
                         f"not exist: make its target, or name another folder")
    if existing and not existing.is_dir():
        where = "" if existing == out else f": {existing}"
        raise UsageError(f"--out {out}{where} is a file, not a folder: name a folder")

def grid_values(args):
    """{flag: its values} for every grid axis (task, init, seeds and SWEEPS), each value once (a value
    given twice would train one run twice into one folder), with a note on stderr per repeated flag."""
    values = {"task": args.task, "init": args.init, "seeds": args.seeds}
    values.update({flag: getattr(args, flag) for flag in SWEEPS})
    if args.mask_from is not None and not values["mask_threshold"]:
        values["mask_threshold"] = [1.0]         # tau = 1: open where a key gets its share
    for flag, given in values.items():
        if given and len(set(given)) < len(given):
            again = next(v for i, v in enumerate(given) if v in given[:i])
            shown = "none" if again is None else tasks.setting_text(again)
            print(f"train.py: note: --{flag.replace('_', '-')} {shown} is given more than once; each "
                  f"run is trained once", file=sys.stderr)
            values[flag] = list(dict.fromkeys(given))
    return argparse.Namespace(**values)

def grid(args, family, task_names):
    """Every RunSettings the command asks for: tasks x sweeps x inits x seeds. A sweep of --mask-magnitude
    only acts on M (the other inits run once, at its first value), --mask-lr on a trained M."""
    values = grid_values(args)
    seeds = values.seeds if values.seeds is not None else [args.seed]
    if values.seeds is None and args.seed == 0 and args.preset == "paper":
        seeds = [PAPER_SEEDS.get(family, PAPER_SEEDS.get(" ".join(task_names), 0))]
    sweeps = {flag: getattr(values, flag) or [None] for flag in SWEEPS}
    runs = []
    for task, *swept, init, seed in itertools.product(task_names, *sweeps.values(), values.init, seeds):
        settings = dict(zip(SWEEPS, swept))
        if init not in MASK_PRIOR_INITS and settings["mask_magnitude"] != sweeps["mask_magnitude"][0]:
            continue
        if not trains_mask(init):
            if settings["mask_lr"] != sweeps["mask_lr"][0]:
                continue
            settings["mask_lr"] = None
        runs.append(RunSettings(task, init, seed, **settings))
    return runs

def make_config(family, settings, args):
    """The run's config (result.json "config"): the preset, its per-task changes, the flags given, the
    run's swept settings, then derived keys. Checks what only the whole config can tell."""
    task = settings.task
    config = {**PRESETS[family][args.preset], **TASK_PRESETS.get((family, args.preset), {}).get(task, {})}
    for key in ("epochs", "iters", "lr", "batch_size", "layers", "heads", "dim", "block_size",
                "image_size", "patch_size", "warmup_epochs", "weight_decay"):
        if getattr(args, key) is not None and key in config:
            config[key] = getattr(args, key)
    if args.dim is not None and "mlp_dim" in config:   # ViT MLPs are 4 x wide, encoders 1 x
        config["mlp_dim"] = 4 * args.dim if family == "vision" else args.dim
        if "head_dim" in config:
            config["head_dim"] = None                  # dim / heads
    for key in ("head_dim", "mlp_dim", "pos_std", "cls_std"):     # after --dim, which resets two
        if getattr(args, key) is not None and key in config:
            config[key] = getattr(args, key)
    if not config.get("head_dim") and config["dim"] < config["heads"]:
        raise UsageError(f"--dim {config['dim']} leaves no width for each of {config['heads']} heads")
    magnitude = settings.mask_magnitude or FAMILIES[family]["magnitude"]
    config.update(preset=args.preset, mask_decay=settings.mask_decay or 0.0, mask_error=settings.mask_error,
                  mask_lr=settings.mask_lr, mask_magnitude=magnitude)
    if family == "language" and magnitude * config["block_size"] > FLOAT32_MAX:
        raise UsageError(f"--mask-magnitude {magnitude:g}: the GPT's bias s M reaches s x {config['block_size']}"
                         f", past float32 ({FLOAT32_MAX:.3g}): choose a smaller scale")
    if args.eval_every:
        config["eval_every"] = args.eval_every
    elif family == "language":
        config["eval_every"] = max(1, config["iters"] // 5)     # five evaluations in a run
    else:
        config["eval_every"] = 1 if family == "vision" else 5   # vision every epoch, encoders every 5
    if args.mask_variant:
        if task not in maskprior.BOOLEAN_MASK_VARIANTS:
            raise UsageError(f"--mask-variant: {task} has one mask pattern only")
        config["mask_variant"] = args.mask_variant
    if family == "arithmetic":
        config["train_frac"] = check_train_frac(settings.train_frac, task)
        config["eval_size"] = None if args.eval_size == "all" else args.eval_size or 100_000
    if family == "vision":
        check_vision_config(config)
        if args.model == "timm":               # maskprior.ViT's configs stay as they were
            config["model"] = "timm"
    if args.mask_from is not None:
        config.update(learned_prior_config(args.mask_from, settings.mask_threshold or 1.0,
                                           family == "language"))
    return config

def check_train_frac(train_frac, task):
    """--train-frac (else the paper's, Table "Arithmetic task setup"): one pair or more trains, one or
    more is held out."""
    if train_frac and train_frac >= 1:
        raise UsageError(f"--train-frac must lie strictly between 0 and 1, got {train_frac:g}")
    fraction = train_frac or tasks.ARITHMETIC_TRAIN_FRAC[task]
    pairs = round(fraction * tasks.ALL_PAIRS)
    if not 1 <= pairs < tasks.ALL_PAIRS:
        raise UsageError(f"--train-frac {fraction:g} trains on {pairs:,} of the {tasks.ALL_PAIRS:,} "
                         f"pairs, holds out {tasks.ALL_PAIRS - pairs:,}: both need one or more "
                         f"(from {1 / tasks.ALL_PAIRS:g} to {1 - 1 / tasks.ALL_PAIRS:g})")
    return fraction

def preset_changes(family, task, config):
    """{setting: [this run's value, its preset's]} for each preset setting the flags changed: table.md
    says so beside the paper's numbers, which describe the preset."""
    preset = {**PRESETS[family][config["preset"]],
              **TASK_PRESETS.get((family, config["preset"]), {}).get(task, {})}
    return {key: [config[key], value] for key, value in preset.items() if config.get(key, value) != value}

def check_vision_config(config):
    """Patches tile the image; a too long warmup is shortened; ImageNet100's lr x batch / 512."""
    if config["image_size"] % config["patch_size"]:
        raise UsageError(f"--image-size {config['image_size']} is not a multiple of the patch "
                         f"size {config['patch_size']}")
    if config["warmup_epochs"] >= config["epochs"]:
        config.update(warmup_shortened_from=config["warmup_epochs"], warmup_epochs=config["epochs"] - 1)
    if config["lr_base_size"]:
        config["lr"] = config["lr"] * config["batch_size"] / config["lr_base_size"]

def train_all(args, family, task_names, device, stop, grid_lock):
    """Every run of the command, each in its locked folder, then a grid's tables (grid_lock: its lock).
    Every run's config, data and folder are checked before the first one trains."""
    runs = grid(args, family, task_names)
    is_grid, root = len(runs) > 1, args.out or "runs/grid"
    source = args.mask_from and os.path.basename(os.path.abspath(args.mask_from))
    writer = int(os.environ.get("RANK", "0")) == 0   # torchrun: rank 0 writes
    planned, loaded = [], {}                       # loaded: the data sets read up front, each once
    for settings in runs:
        name = settings.folder(args.mask_variant, source)
        out_dir = os.path.join(root, name) if is_grid else args.out or os.path.join("runs", name)
        config = make_config(family, settings, args)
        if family in ("language", "vision"):      # files: read (and checked) before any run starts
            data = load_data(family, settings.task, config, settings.seed, args, device)
            loaded[id(data)] = data
        check_fits(family, config)
        if writer:                                 # torchrun: rank 0 locks and writes, and checks
            check_folder(out_dir, settings.task, settings.init, settings.seed, config, args.resume, is_grid)
        planned.append((settings, config, out_dir))
    if is_grid and writer:
        check_grid_root(root)
    threads = choose_threads(args.threads, device)
    workers = args.workers                         # vision's loader processes: 8 beside a GPU, else 0
    if workers is None:
        workers = 8 if device.type == "cuda" else 0
    print(first_line(planned, task_names, device, threads[1], args, root if is_grid else planned[0][2],
                     loaded.values()), flush=True)
    results, failed, root_locked = [], 0, False
    for settings, config, out_dir in planned:
        task, init, seed = settings.task, settings.init, settings.seed
        checkpoint = os.path.join(out_dir, "checkpoint.pt")
        resume = args.resume and (not is_grid or os.path.exists(checkpoint))   # a grid: runs with one
        stop.start(out_dir, is_grid, resume)
        data = load_data(family, task, config, seed, args, device)
        fingerprint = data_fingerprint(family, data)
        if args.resume and not is_grid and not os.path.isdir(out_dir):
            raise no_checkpoint(checkpoint)        # said before a folder is made for it
        if is_grid and writer and not root_locked:   # held until the grid's tables are written
            grid_lock.enter_context(folder_lock(root))
            root_locked = True
        try:
            with folder_lock(out_dir) if writer else contextlib.nullcontext():
                finished = args.resume and finished_run(out_dir, task, init, seed, config, fingerprint)
                if finished:                   # left as it is, every file
                    results.append(finished)
                    if not is_grid:
                        print(f"{task} / {init} / seed {seed}: already finished, nothing to resume; "
                              f"{out_dir} is left as it was")
                    continue
                job = Job(family, task, init, seed, config, out_dir, data, fingerprint, resume, workers,
                          args.compile, not args.no_progress, threads[0], bool(args.threads),
                          None if family in ("boolean", "arithmetic") or task == "lm" else args.data_dir)
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
            if not is_grid:
                print(f"wrote {os.path.join(out_dir, 'result.json')}")
    if dist.is_initialized():
        dist.destroy_process_group()
    if is_grid and results:
        write_json(os.path.join(root, "grid.json"), results)
        write_tables(root, results)
    return 1 if failed else 0

def first_line(planned, task_names, device, threads, args, out, loaded):
    """What a command runs, where, with how many threads, and where its results go (and, for --task
    images, what the image tree holds)."""
    count = len(planned)
    line = (f"train.py: {count} run{'s' * (count > 1)} of {' '.join(task_names)} on {device_name(device)}, "
            f"{threads}, preset {args.preset}; results in {out}")
    for data in loaded:
        info = data.get("info", {}).get("data", {})
        if "train_images" in info:
            line += (f"; {info['train_images']:,} images to train, {info['eval_images']:,} held out, "
                     f"{len(info['classes'])} classes")
    return line

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
        run_id = json.dumps([r["task"], r["init"], r["seed"], r["config"], r.get("data_fingerprint")],
                            sort_keys=True)
        if run_id in first:
            print(f"train.py: warning: {path} is the run of {first[run_id][0]} again (same task, "
                  f"init, seed, config and data): counted once", file=sys.stderr)
        first.setdefault(run_id, (path, r))
    try:
        write_tables(root, [r for _, r in first.values()])
    except WriteError as err:          # DIR itself cannot take the tables: a bad path
        raise UsageError(str(err))
    return 0 if len(readable) == len(paths) else 1

def main(argv=None):
    """Exit 0; 1 when a run diverged or a write failed mid-run; 2 for bad input or an output folder that
    cannot be made, written or locked; 130 / 143 on SIGINT / SIGTERM; each failure one line on stderr."""
    stop = Stop()
    tasks.forget_data()                                # each command reads its data afresh
    if hasattr(sys.stdout, "reconfigure"):             # a path that is not UTF-8 prints, escaped
        sys.stdout.reconfigure(errors="backslashreplace")
    threads = torch.get_num_threads()                  # put back at the end (in-process callers)
    try:
        with signals_caught(stop):
            args = build_parser().parse_args(argv)
            if args.summarize:
                stop.summarizing = args.summarize
                return summarize(args.summarize)
            device = resolve_device(args.device)
            task_names = list(tasks.BOOLEAN_TASKS) if "all" in args.task else args.task
            family = check_args(args, task_names)
            with contextlib.ExitStack() as grid_lock:
                return train_all(args, family, task_names, device, stop, grid_lock)
    except (UsageError, tasks.DataError) as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:
        if int(os.environ.get("RANK", "0")) == 0:      # torchrun: every rank stops, rank 0 says so
            print(f"train.py: {err}", file=sys.stderr)
        return err.exit_code
    except WriteError as err:   # before any training (e.g. a full disk at the start): bad output, 2
        print(f"train.py: error: {err}; {stop.advice()}", file=sys.stderr)
        return 1 if stop.trained else 2
    finally:
        torch.set_num_threads(threads)

# ==================================================================================================
# Part B. The run machinery: what makes a run safe to stop, resume, compare and share
# ==================================================================================================

# --- Errors: each is one line on stderr (main) ---------------------------------------------------
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

# --- Files: written atomically, strict JSON, read back with their fields checked ----------------
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

def finite(obj, where=""):
    """(obj with every NaN or infinite float replaced by None, {where: "inf", ...} of those replaced):
    result.json stays strict JSON, which has no Infinity or NaN."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, {where: str(obj)}
    if not isinstance(obj, (dict, list)):
        return obj, {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    clean, bad = {}, {}
    for key, value in items:
        clean[key], more = finite(value, f"{where}.{key}" if where else str(key))
        bad.update(more)
    return (clean if isinstance(obj, dict) else list(clean.values())), bad

def write_json(path, obj):
    write_atomic(path, json.dumps(finite(obj)[0], indent=2, allow_nan=False) + "\n")

def save_checkpoint(path, state):  # torch.save through write_atomic: never half a checkpoint
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getvalue())

def read_result(path, warn=True):
    """A result.json as a dict, or None (with a warning naming it and the field, if warn) if it is
    damaged or hand-edited into something the tables cannot read."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        if not isinstance(result, dict):
            raise ValueError("not a JSON object")
        check_result(result)
        if result["status"] == "done":
            tasks.summary_line(result)           # the fields a table reads are all there
            tasks.settings_of(result)
        return result
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        if warn:
            print(f"train.py: warning: skipped {path}: damaged or not a result of train.py ({err})",
                  file=sys.stderr)
        return None

def check_result(result):
    """ValueError naming the first field of a result.json that the tables could not read."""
    for name in ("task", "init", "seed", "status", "config", "final"):
        if name not in result:
            raise ValueError(f"field {name} is missing")
    def number(value, finite=True):              # inf and NaN are shown in tables, not in a setting
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        return math.isfinite(value) or not finite
    config, final, done = result["config"], result["final"], result["status"] == "done"
    settings = config if isinstance(config, dict) else {}      # read below only if config passes
    numbers = final if isinstance(final, dict) else {}
    checks = [("task", result["task"] in tasks.FAMILY_OF, "a task of train.py"),
              ("init", result["init"] in INITS, "an init of train.py"),
              ("seed", isinstance(result["seed"], int) and number(result["seed"]) and result["seed"] >= 0,
               "a whole number >= 0"),
              ("status", result["status"] in ("done", "running", "diverged"), "done, running or diverged"),
              ("config", isinstance(config, dict), "an object"),
              ("final", isinstance(final, dict) or not done, "an object"),
              ("seconds", result.get("seconds") is None or number(result["seconds"]), "a number")]
    for key in ("train_frac", "mask_magnitude", "mask_decay", "mask_lr", "mask_threshold", "epochs", "lr"):
        checks.append((f"config.{key}", settings.get(key) is None or number(settings[key]), "a finite number"))
    for key in ("mask_error", "mask_variant", "mask_from"):
        checks.append((f"config.{key}", settings.get(key) is None or isinstance(settings[key], str), "text"))
    for key in tasks.HEADER if done else ():     # a table's numbers: a number, inf or NaN, or null
        checks.append((f"final.{key}", numbers.get(key) is None or number(numbers[key], False), "a number"))
    for name, fine, expected in checks:
        if not fine:
            value = result
            for part in name.split("."):
                value = value[part]
            raise ValueError(f"field {name} is {json.dumps(value)[:40]}, not {expected}")

@contextlib.contextmanager
def folder_lock(folder):
    """One writer per run folder: a flock on folder/.lock (holding the pid; the OS drops it when the process
    ends, kill -9 too); else UsageError. Once locked, the temporary files of a writer killed mid-write
    (write_atomic's <name>.tmp<pid>) are removed. At the end .lock goes, and the folder if the lock made
    it and it stayed empty."""
    path, fd, made = os.path.join(folder, ".lock"), None, not os.path.isdir(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        while fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise in_use(folder, fd) from None
            if not os.path.exists(path) or not os.path.samestat(os.fstat(fd), os.stat(path)):
                os.close(fd)    # the holder before us removed it between our open and our lock
                fd = None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        for name in os.listdir(folder):
            if re.fullmatch(r".+\.tmp\d+", name) and os.path.isfile(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
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

def in_use(folder, fd):
    """The UsageError for a folder whose lock (open as fd) another process holds, naming its pid."""
    holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
    return UsageError(f"{folder} is in use by another train.py run (pid {holder}): wait for it to end, "
                      f"or choose another --out")

def check_not_in_use(folder):
    """in_use's UsageError if a live run holds folder's lock (probed, not taken)."""
    try:
        fd = os.open(os.path.join(folder, ".lock"), os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise in_use(folder, fd) from None
    finally:
        os.close(fd)

RUN_FILES = ("result.json", "checkpoint.pt", "attention_before.pt", "attention_after.pt", "attention.svg")

def files_in(folder, names):
    return [name for name in names if os.path.isfile(os.path.join(folder, name))]

def grid_runs(folder):
    """The run folders directly below folder (a grid's root): those holding a run's files."""
    if not os.path.isdir(folder):
        return []
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and files_in(e.path, RUN_FILES))

def check_folder(folder, task, init, seed, config, resume, grid):
    """One run per folder: UsageError, before anything is written, when folder holds a grid (for a
    single run) or another run's files (without --resume any, with it those of another run)."""
    check_not_in_use(folder)
    if not grid and (files_in(folder, ("grid.json", "table.md")) or grid_runs(folder)):
        raise UsageError(f"--out {folder} holds a grid{grid_hint(folder)}")
    found = files_in(folder, RUN_FILES)
    if not found or resume and ("checkpoint.pt" in found or finished_run(folder, task, init, seed, config)):
        return                        # --resume checks the checkpoint's config and data at its turn
    raise UsageError(f"--out {folder} already holds a run ({', '.join(found)}): choose another --out"
                     f"{'' if resume else ', or add --resume to continue or keep it'}")

def check_grid_root(root):
    check_not_in_use(root)
    found = files_in(root, RUN_FILES)
    if found:
        raise UsageError(f"--out {root} holds a run ({', '.join(found)}), not a grid: choose another "
                         f"--out for the grid")

def grid_hint(folder):
    """What to do instead of one run in a grid's root: its own command, or one run's folder."""
    runs = grid_runs(folder)
    example = f", e.g. --out {os.path.join(folder, runs[0])}" if runs else ""
    return (f": continue the grid with its own command (its --task, --init, --seeds), or name one "
            f"run's folder{example}")

def finished_run(out_dir, task, init, seed, config, fingerprint=None):
    """out_dir's result.json if it is this very run (task, init, seed, config, and data unless
    fingerprint is None), done; else None."""
    path = os.path.join(out_dir, "result.json")
    old = os.path.exists(path) and read_result(path, warn=False)
    if not old or old["status"] != "done" or [old["task"], old["init"], old["seed"], old["config"]] != [
            task, init, seed, config]:
        return None
    return old if fingerprint is None or old.get("data_fingerprint") == fingerprint else None

# --- Signals: Ctrl-C and SIGTERM end a run with a checkpoint of its step and one line ----------
class Stop:
    """The SIGINT / SIGTERM handler, and where the run is. While the loop trains, a first signal only sets
    `signal` (the loop checkpoints its step, then stops); else, or at a second one, Interrupted is raised."""
    def __init__(self):
        self.pid, self.signal, self.training = os.getpid(), None, False
        self.trained = False          # any run of this command began training (a failed write: exit 1)
        self.summarizing = None       # --summarize's folder, while it writes the tables
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
        if self.summarizing:
            return Interrupted(signum or self.signal, f"interrupted while summarizing {self.summarizing}; "
                                                      f"its tables are as they were")
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

# --- The loop's guard: what the training loop does besides its steps ------------------------------
class Guard:
    """train's companion: the progress bar and evaluation lines, step timing, the loss checked before
    its step (NaN or inf on any rank: Diverged), checkpoints, and signals: a first SIGINT or SIGTERM lets
    the step under way finish, keeps a checkpoint of it and stops (Interrupted). A round a signal cut
    is drawn again from its start's random states, its done steps skipped: a resumed run repeats the
    uninterrupted one exactly."""
    def __init__(self, exp, state, job, place, stop):
        self.exp, self.state, self.job, self.place, self.stop = exp, state, job, place, stop
        self.started, self.losses, self.signum = time.time(), [], 0
        self.bar = tqdm(total=exp.steps, initial=state["step"], desc=f"{job.task}/{job.init}/seed{job.seed}",
                        leave=False, dynamic_ncols=True,
                        disable=None if job.progress and place.rank == 0 else True)  # None: a terminal only
        if job.resume:                          # where an interruption would leave the run
            cut = state.get("partial")
            stop.at = position(exp, cut["round"] if cut else state["round"], state["step"])
            stop.kept = f"the checkpoint of {stop.at}"

    def __enter__(self):
        self.stop.training = self.stop.trained = True    # a first signal now stops after its step
        return self

    def __exit__(self, *exc):
        self.stop.training = False

    def batches(self, r, state):
        """Round r's batches (after a cut: those left), timing each step from its batch on."""
        exp, device, cut = self.exp, self.place.device, state.pop("partial", None)
        self.round_start, self.losses = rng_states(exp, device), []   # before exp.batches, which may seed
        if cut:                                 # the round's start again, its done batches skipped
            at_cut = self.round_start
            self.round_start, self.losses = cut["rngs"], list(cut["losses"])
            set_rng_states(exp, device, cut["rngs"])
        batches = iter(exp.batches(r))
        if cut:
            for _ in range(cut["done"]):
                next(batches)
            set_rng_states(exp, device, at_cut)
        for batch in batches:
            self.step_start = time.time()
            yield batch

    def check(self, loss, r, state):
        """Count the step; Diverged on a non-finite loss (before its step: the weights stay finite). Under
        torchrun every rank agrees here on that and on a signal."""
        state["step"] += 1
        diverged, self.signum = agreed([not torch.isfinite(loss.detach()), self.stop.signal or 0],
                                       self.place.world, self.place.device)
        if diverged:
            raise Diverged(f"loss became {loss.item()} at step {state['step']} ({self.exp.unit} {r})")

    def stepped(self, loss, batch, r, state):
        """After a step: its loss and time, the bar; a signal that came: a checkpoint of this step, stop."""
        self.losses.append(loss.item())               # .item() waits for the step: timing is honest
        state["train_seconds"] += time.time() - self.step_start
        state["samples"] += len(batch[0])
        self.bar.update()
        self.bar.set_postfix(loss=f"{self.losses[-1]:.4f}")
        self.stop.at = position(self.exp, r, state["step"])
        signum = self.signum if self.place.world > 1 else self.stop.signal   # torchrun: the agreed one
        if signum:
            ranks = gather({"losses": self.losses, "rngs": self.round_start}, self.place.world)
            self.keep(r, {"round": r, "done": len(self.losses), "ranks": ranks})
            raise self.stop.interrupted(signum)

    def round_loss(self):                       # the round's mean training loss, over the ranks
        return statistics.fmean(gather(statistics.fmean(self.losses), self.place.world))

    def report(self, entry):                    # the evaluation's line, above the bar, flushed for logs
        if self.place.rank == 0:
            self.bar.write(progress_line(self.job, self.exp, entry, self.started))
            sys.stdout.flush()

    def round_done(self, r, state, evaluated):
        """A checkpoint after each evaluation, or now if a signal came since the last step; then stop."""
        signum = agreed([self.stop.signal or 0], self.place.world, self.place.device)[0]
        if evaluated or signum:
            self.keep(r)
        if signum:
            raise self.stop.interrupted(signum)

    def finished(self):
        if self.stop.signal:            # came after the last checkpoint: it holds the whole run
            raise self.stop.interrupted()
        self.bar.close()

    def keep(self, r, partial=None):
        """checkpoint.pt of this step (rank 0 writes); partial: a round cut after partial["done"]."""
        exp, state, (device, rank, world) = self.exp, self.state, self.place
        rngs = gather(rng_states(exp, device), world)
        if rank == 0:
            save_checkpoint(os.path.join(self.job.out_dir, "checkpoint.pt"), {
                "meta": self.job.meta(world), "model": exp.model.state_dict(),
                "optimizer": exp.optimizer.state_dict(), "schedule": exp.schedule.state_dict(),
                "rng": rngs, "state": state, "partial": partial})
        if world > 1:
            dist.barrier()
        self.stop.kept = f"the checkpoint of {position(exp, r, state['step'])}"

def progress_line(job, exp, entry, started):
    """One evaluation in a line: "majority/mask/seed0 epoch 5/10: train loss 0.0123, test accuracy
    87.50 %, 12 s" (seconds since this process began the run)."""
    key, label = tasks.main_metric(job.task)
    metric = tasks.fmt(entry.get(key))
    if entry.get(key) is not None and "(%)" in label:
        metric = f"{entry[key]:.2f} %"
    last = exp.steps if exp.unit == "iter" else exp.rounds
    return (f"{job.task}/{job.init}/seed{job.seed} {exp.unit} {entry[exp.unit]}/{last}: train loss "
            f"{tasks.fmt(entry['train_loss'])}, {label.split(' (')[0].split(',')[0]} {metric}, "
            f"{time.time() - started:.0f} s")

def position(exp, r, step):  # where a run is: "epoch 3 (step 34)", or "iteration 37" for language
    if exp.unit == "iter":
        return f"iteration {step}"
    return f"epoch {r} (step {step})"

# --- Checkpoints and --resume: the same flags, the same data, or one line -----------------------
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
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            raise UsageError(f"--resume: {path} was written by a run on other data: "
                             f"{data_difference(key, theirs.get(key), ours.get(key))}: use the same "
                             f"data, or another --out")

def data_difference(key, theirs, ours):
    """What differs in one part of a fingerprint, in words: "valid.txt differs", "3 images added under
    train/cat", "--bpe-file: none before, one now"."""
    if theirs is None or ours is None:
        return f"{key}: {'none before, one now' if theirs is None else 'there before, none now'}"
    counts = [re.match(r"(\d+) files, ", v) for v in (theirs, ours)]
    if all(counts) and counts[0].group(1) != counts[1].group(1):
        before, now = (int(m.group(1)) for m in counts)
        return f"{abs(now - before)} images {'added' if now > before else 'removed'} under {key}"
    return f"{key} differs"

def use_threads_of_checkpoint(saved, job):
    """--resume trains on with the checkpoint's thread count (the numbers depend on it in their last
    digits) unless --threads says otherwise (then a note when the two differ)."""
    if saved is None:
        return job.threads
    if not job.threads_given:
        return saved
    if job.threads != saved:
        print(f"train.py: note: {job.out_dir} was trained with {saved} threads, --threads {job.threads} "
              f"now: the numbers may differ from an uninterrupted run's in their last digits",
              file=sys.stderr)
    return job.threads

# --- Fingerprints of a run's data (checkpoint.pt and result.json): --resume refuses other data,
# --summarize never averages over two. Generated data (Boolean, arithmetic) by its tensors; files by
# their content and their paths relative to the data folder (a copy elsewhere, or a touched file, is the
# same data). tasks.py's loaders name what they read in data["sources"].
def data_fingerprint(family, data):
    """{part of the data: its digest}, e.g. {"train set": "sha256 ..."} or {"train/cat": "12 files, ..."}."""
    if family in ("boolean", "arithmetic"):
        parts = {"train set": "train", "eval set": "eval"}
        return {name: tensors_sha256(data[f"x_{part}"], data[f"y_{part}"])
                for name, part in parts.items() if f"x_{part}" in data}
    return {name: source_digest(source, data["root"]) for name, source in data["sources"].items()}

def source_digest(source, root):
    """A tensor's, a file's, or a list of files' digest; None stays None (e.g. no --bpe-file)."""
    if source is None:
        return None
    if isinstance(source, torch.Tensor):
        return tensors_sha256(source)
    if isinstance(source, str):
        return file_sha256(source)
    return files_listing(source, root)

def tensors_sha256(*tensors):
    """sha256 of the tensors' dtypes, shapes and bytes, as "sha256 <hex>"."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()       # kept alive while its memory is read below
        digest.update(f"{t.dtype} {tuple(t.shape)};".encode())
        digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return f"sha256 {digest.hexdigest()}"

def file_sha256(path):
    """sha256 of a file's content, read in 1 MiB pieces (a corpus can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return f"sha256 {digest.hexdigest()}"

def files_listing(paths, root):
    """"<count> files, <bytes> bytes, sha256 <hex>" over each path below root and its content's sha256
    (os.fsencode: a file name that is not UTF-8 is hashed by its bytes)."""
    digest, total = hashlib.sha256(), 0
    for path in paths:
        total += os.path.getsize(path)
        digest.update(os.fsencode(os.path.relpath(path, root)) + f"\t{file_sha256(path)}\n".encode())
    return f"{len(paths)} files, {total} bytes, sha256 {digest.hexdigest()}"

# --- Random streams: every one a step draws from, kept by checkpoints ----------------------------
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

# --- torchrun: one process per GPU (or CPU process, gloo), gradients averaged by DDP ------------
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

# --- The machine: device, threads, subnormal floats, memory -------------------------------------
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

def device_name(device):
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"

def choose_threads(given, device):
    """(torch CPU threads for new runs, how the first line says it): --threads, else the cores no other
    job keeps busy, at least one: torch's threads spin against other jobs, and a run at the default
    count on a busy machine can take many times as long."""
    if given:
        return given, f"{given} thread{'s' * (given > 1)} (--threads)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = busy_cores(cores)
    threads = max(1, min(torch.get_num_threads(), round(cores - busy)))
    return threads, f"{threads} thread{'s' * (threads > 1)} ({cores} cores, {busy:.1f} busy)"

def busy_cores(cores, seconds=0.5):
    """The cores other jobs use now: /proc/stat's busy time over half a second (Linux); elsewhere the
    1-minute load average, which lags (just after a job ends it still counts it)."""
    def times():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]          # all, idle + iowait
    try:
        total, idle = times()
        time.sleep(seconds)
        total2, idle2 = times()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    return cores * (1 - (idle2 - idle) / max(total2 - total, 1))

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

def check_fits(family, config):
    """Refuse, before allocating, a model whose weights, Adam state and attention maps exceed the RAM."""
    L, H, D, B = (config[key] for key in ("layers", "heads", "dim", "batch_size"))
    longest_sum = 2 * tasks.OPERAND_DIGITS + max(tasks.ARITHMETIC_TASKS.values())   # operands, answer slots
    N = {"boolean": tasks.BOOLEAN_DIM + 1, "arithmetic": longest_sum, "language": config.get("block_size"),
         "vision": (config.get("image_size", 0) // config.get("patch_size", 1)) ** 2 + 1}[family]
    maps_of = lambda batch: 4 * 3 * L * H * N * N * max(batch, 64)               # bytes
    weights, maps = 4 * 4 * 12 * L * D * D, maps_of(B)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if weights + maps > have:   # name the flag to change: width, input length, or else the batch
        inputs = {"language": f"--block-size {N}", "vision": f"--image-size {config.get('image_size')}"}
        if weights > maps:
            flag = f"--dim {D}"
        elif weights + maps_of(64) > have:
            flag = inputs.get(family, f"--layers {L}")
        else:
            flag = f"--batch-size {B}"
        raise UsageError(f"{flag}: {L} layers x {H} heads x {N} x {N} attention maps at width {D} need "
                         f"about {(weights + maps) / 2**30:.0f} GiB, this machine has "
                         f"{have / 2**30:.0f} GiB: choose a smaller model, batch or input")

# --- Flag types: one line for a bad value, never a traceback ------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints the whole usage block; one line is enough
        raise UsageError(message)

FLOAT32_MAX = torch.finfo(torch.float32).max     # 3.4e38: a setting past it is inf inside the model

def number(kind, strict=True):
    """argparse type: kind(text) > 0 (>= 0 when not strict), finite in float32 (a whole number below 2^63)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if not math.isfinite(value) or value < 0 or (strict and value == 0):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if strict else '>='} 0, got {text!r}")
        if value > (2 ** 63 - 1 if kind is int else FLOAT32_MAX):
            raise argparse.ArgumentTypeError(f"{text} is too large ({'2^63' if kind is int else 'float32'}"
                                             f" ends at {2 ** 63 - 1 if kind is int else FLOAT32_MAX:.3g})")
        return value
    return parse

if __name__ == "__main__":
    sys.exit(main())
