"""Train and evaluate the paper's experiments: one run, or a grid of runs and its tables.

    python train.py --task majority --init mask                    # Boolean GOTU, Section 5.1
    python train.py --task addition --init default mask            # arithmetic, Section 5.2
    python train.py --task cifar10 --init impulse --data-dir data  # vision, Section 5.3
    python train.py --task lm --init mask                          # language, Appendix "Wiki-text"
    python train.py --task images --data-dir DIR                   # your own images (text: --help)
    python train.py --summarize runs/grid                          # tables of finished runs
    python train.py --summarize runs/grid --figure attention F.svg # a README figure (section "Figures")

Read top to bottom beside the paper:
  1. Presets: the paper's setup tables ("paper") and a 2-core CPU version of each ("cpu").
  2. Inits: the columns of Table 1 and of the vision tables, the rows of the perplexity table.
  3. An experiment: the ONE record (`Experiment`) every family's setup builds for the loop.
  4. The experiment of each family: its model with the prior, optimizer, batches, loss and evaluation.
  5. THE training loop (`train`), the same for every family, every step in view.
  6. One run: the prior before, training, the prior after (Section 6.1), result.json.
  7. The command line: the flags, ONE record per run (`Run`), the runs they ask for (`plan`), a grid, `main`.
  8. The machinery behind it: errors, atomic files, the folder lock, checkpoints, data fingerprints,
     signals, torchrun, the machine.
Uses maskprior.py (models, masks, QK baselines) and tasks.py (data, metrics, tables).

The experiment itself is met in sections 4-6: a family's setup (boolean_setup: Table 1) builds the
model with its prior, the loop trains it, execute measures the prior before and after. Sections 7-8
only get a run there and keep it safe; each of their definitions says first what it is for. One run,
followed (python train.py --task majority --init mask; comments marked "->" say where a call goes):
  main, train_all (7) -> plan, make_config (7): one Run (7) -> load_data (4) -> tasks.boolean_dataset
  -> execute (6) -> boolean_setup (4): maskprior.boolean_mask, prior, build_encoder, encoder_experiment
  -> picture "before" (6) -> train (5), calling the setup's batches and loss_of (4) -> picture "after",
  persistence_fields, result.json (6); its last line names the files the run wrote.
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

# === 1. Presets: the paper's setup tables ("paper") and a 2-core CPU version of each ("cpu") =======
# Boolean GOTU, Table "Training setup for Boolean tasks" (layers, heads, Adam, lr, batch, epochs; an unnamed
# schedule, cosine here). The rest is the aryol/GOTU code's model, which the paper builds on: width 256,
# coupled weight decay on every parameter but M (its decay: --mask-decay), positions and CLS drawn from
# N(0, 1) (pos_std, cls_std; nanoGPT's and timm's 0.02 and zero otherwise). "cpu" (heads of 21) keeps the
# small starts without weight decay: with the GOTU ones, 2parity's mask model predicts a constant at width
# 64 (the README's "What decides target or MDI"). cyclic3 gets the GOTU code's N(0, 1) positions
# (TASK_PRESETS), for its vanilla model to fit its training set.
#
# "paper" takes the table's 4 layers and 3 heads with the GOTU code's heads of 64 (3 x 64 = 192 of the 256
# channels) and an MLP as wide as the model. "cpu" is the same depth and heads at width 64 (head_dim None:
# dim // heads = 21 channels a head) and 10 epochs (cyclic3 20) instead of 90, sized for a 2-core CPU: an
# epoch is every seen point of the 2^15 cube once (24,576 for majority), 96 steps of 256.
# Where a reader picks `--preset paper` for Table 1: here it does not give Table 1's mask column. At
# seed 0 every mask run fits its seen points and lands on the MDI side, as the default does; the
# positions' N(0, 1) start decides that (for majority the width too: the README's "Table 1 at the
# `paper` preset" and "What decides target or MDI"). The `cpu` preset is where the mask reaches the target.
BOOLEAN_PRESETS = {
    "paper": {"epochs": 90, "lr": 1e-3, "batch_size": 256, "layers": 4, "heads": 3, "dim": 256,
              "head_dim": 64, "mlp_dim": 256, "optimizer": "adam", "weight_decay": 1e-3,
              "pos_std": 1.0, "cls_std": 1.0},
    "cpu": {"epochs": 10, "lr": 1e-3, "batch_size": 256, "layers": 4, "heads": 3, "dim": 64,
            "head_dim": None, "mlp_dim": 64, "optimizer": "adam", "weight_decay": 0.0,
            "pos_std": 0.02, "cls_std": 0.0},
}

# Three-digit arithmetic, Table "Arithmetic task setup": "paper" holds its model and training rows as
# the table gives them, "Positional encoding learnable" starting at N(0, 0.02^2) (nanoGPT's and timm's:
# the table names no start), its "Scheduler cosine" in encoder_experiment. Its other rows live where
# they act: the train fractions in tasks.ARITHMETIC_TRAIN_FRAC beside the data, the mask's open / close
# in maskprior.ARITHMETIC_OPEN, the Opt fit's steps in structured_opt_init_, the SVD targets in
# arithmetic_setup. "cpu": 4 layers at width 128 (heads of 32), the paper's epochs; multiplication 20
# (TASK_PRESETS): its train fraction is 7.5 times addition's, so 20 epochs are still more steps.
ARITHMETIC_PRESETS = {"paper": {"epochs": 50, "lr": 1e-3, "weight_decay": 1e-3, "batch_size": 256,
                                "layers": 6, "heads": 4, "dim": 256, "head_dim": 64, "mlp_dim": 256,
                                "optimizer": "adamw", "pos_std": 0.02}}
ARITHMETIC_PRESETS["cpu"] = {**ARITHMETIC_PRESETS["paper"], "layers": 4, "dim": 128, "head_dim": None,
                             "mlp_dim": 128}

# Language, Table "NLP task setup": "paper" holds its model and training rows, its seed in PAPER_SEEDS and
# each corpus's "Max iters" in TASK_PRESETS. The table names no weight decay: 0.01 is torch's AdamW
# default, which the Tiny-Stories-GPT code the paper builds on takes (AdamW(model.parameters(), lr=3e-4));
# here it decays the weight matrices and the token embedding only (maskprior.param_groups), never M.
# "cpu": a GPT of 4 layers at width 128, sized for a 2-core CPU.
LM_PRESETS = {"paper": {"iters": 5000, "lr": 3e-4, "batch_size": 128, "layers": 12, "heads": 12, "dim": 512,
                        "block_size": 64, "dropout": 0.2, "weight_decay": 0.01, "optimizer": "adamw",
                        "no_pos": False}}
LM_PRESETS["cpu"] = {**LM_PRESETS["paper"], "iters": 1000, "lr": 1e-3, "batch_size": 32, "layers": 4,
                     "heads": 4, "dim": 128, "dropout": 0.1}

# Vision, Tables "Experimental setup for CIFAR10 / CIFAR100": vit_tiny_patch16_224, cosine after a linear
# warmup, AMP (bf16 here), CLS readout. Warmup start and cosine floor, not in the tables, are those of
# osiriszjq/structured_initialization's commands (ImageNet100's floor 1e-5). Table "Experimental setup for
# ImageNet100" (TASK_PRESETS): base lr scaled by the global batch over 512, cooldown epochs after the
# cosine at the floor (as timm does), seed 42, global average pool. "cpu": a CIFAR-native ViT, 32 x 32
# images in 4 x 4 patches (an 8 x 8 grid, 64 patches and CLS), 6 layers of 3 heads at width 96, batch 128,
# lr 1e-3, 10 epochs, the first a warmup; the augmentations and regularisers stay the tables'.
VISION_PRESETS = {"paper": {
    "epochs": 400, "lr": 2e-3, "lr_base_size": None, "batch_size": 512, "warmup_epochs": 50,
    "cooldown_epochs": 0, "warmup_lr": 1e-6, "min_lr": 1e-6, "weight_decay": 0.05, "drop_path": 0.1,
    "label_smoothing": 0.1, "mixup": 0.8, "cutmix": 1.0, "randaugment": 9, "image_size": 224,
    "patch_size": 16, "layers": 12, "heads": 3, "dim": 192, "mlp_dim": 768, "pool": "cls",
    "optimizer": "adamw", "crop_scale": 0.08}}   # crop_scale: RandomResizedCrop's least area
VISION_PRESETS["cpu"] = {**VISION_PRESETS["paper"], "epochs": 10, "lr": 1e-3, "batch_size": 128,
                         "warmup_epochs": 1, "warmup_lr": 1e-5, "min_lr": 1e-5, "image_size": 32,
                         "patch_size": 4, "layers": 6, "dim": 96, "mlp_dim": 384}

# Per-task changes to a preset: (family, preset) -> {task: {key: value}}, merged over the preset by
# make_config (section 7) and reported in result.json's preset_changes. The "cpu" ones: small image sets
# (ImageNet100 read at 32 x 32, the user's own images) train longer, without MixUp / CutMix and with a
# milder crop; cyclic3 (with the GOTU positions, above) gets 20 epochs to fit, multiplication 20 (above).
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

# === 2. Inits: the columns of Table 1 and of the vision tables, the perplexity table's rows =======
# "We compare two ways of injecting the same structural prior into attention" (Figure 1): --init ->
# (MaskedSelfAttention's mode, where the prior goes). The prior is always the task's own pattern, in M or
# in W_Q / W_K, or in the mask inits --mask-from's learned one.
# Table 1's columns are default, structured-svd, structured-opt and mask; Table "Ablation on mask
# initialization" adds mask-zero, Table "Best Top-1 accuracy" (vision) default, mimetic, impulse and mask,
# its ablation mask-fixed; Table "Perplexity (PPL) comparison" default, mask and mimetic.
INITS = {
    "default": ("none", None),                  # vanilla Transformer, no prior
    "mask": ("learnable", "mask"),              # the paper: learnable log sigmoid(s M), M = pattern
    "mask-zero": ("learnable", "zero"),         # Appendix A.1: learnable, M = 0 (no preference)
    "mask-fixed": ("fixed", "mask"),            # Appendix A.2: the pattern, never trained
    "mask-hadamard": ("hadamard", "mask"),      # Appendix B: sigma(M) o softmax(...)
    "structured-svd": ("none", "svd"),          # pattern in W_Q/W_K, closed form (Zheng 2025)
    "structured-opt": ("none", "opt"),          # pattern in W_Q/W_K, fitted by Adam (Zheng 2024)
    "mimetic": ("none", "mimetic"),             # identity-like W_Q W_K^T (Trockman, Kolter 2023)
    "impulse": ("none", "svd"),                 # vision: the impulse pattern in W_Q/W_K by SVD
    "mask-relative": ("learnable", "relative"),        # language: mask's prior, one M logit per distance
    "mask-relative-fixed": ("fixed", "relative"),      # the same, never trained (ALiBi's kind of prior)
}
# Which inits a flag or a family takes: the Boolean and arithmetic encoders take all but impulse (the
# vision name of the SVD solve) and the relative ones (language's: its prior is a function of distance);
# --mask-error, --mask-from and a --mask-magnitude sweep act where M holds the pattern; --mask-lr where M
# trains.
ENCODER_INITS = tuple(i for i in INITS if i != "impulse" and INITS[i][1] != "relative")
MASK_PRIOR_INITS = tuple(i for i, (_, prior) in INITS.items() if prior == "mask")
TRAINED_MASK_INITS = tuple(i for i, (mode, _) in INITS.items() if mode in ("learnable", "hadamard"))
TIMM_INITS = ("default", "mask", "mask-fixed")  # --model timm: its ViT as is, or M by add_mask_prior

# === 3. An experiment: what each family's setup builds for the loop ==============================
# The paper runs four families of experiments (Sections 5.1-5.3 and Appendix "Wiki-text and Tiny-stories"),
# each with its own model, data, loss and metrics but the same shape of training: minibatch steps, an
# evaluation now and then, the prior measured before and after. So each family has a setup function
# (FAMILIES[family]["setup"], called by execute in section 6) that returns one Experiment, and the loop
# (section 5) runs any Experiment without knowing its task: the forward pass it calls is the setup's
# loss_of, the evaluation its evaluate, result.json's numbers its final.
@dataclass
class Experiment:
    """What a family's setup builds for the loop. A round is an epoch, or eval_every language iterations."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: object                   # an lr scheduler, stepped after every optimizer step
    rounds: int                        # epochs, or evaluation intervals of a language run
    steps: int                         # optimizer steps in all (the progress bar's total)
    batches: Callable                  # round -> that round's batches
    loss_of: Callable                  # (network, batch) -> scalar training loss: the forward pass
    evaluate: Callable                 # () -> metrics added to the round's history entry
    final: Callable                    # (state, world) -> result.json's "final" numbers
    eval_every: int = 1                # rounds between evaluations (and always after the last)
    unit: str = "epoch"                # the history's counter: "epoch" or "iter"
    probe: Optional[torch.Tensor] = None    # inputs the persistence numbers average attention over
    probe_batch: int = 4096
    pattern: Optional[torch.Tensor] = None  # the prior's (L, H, N, N) pattern, as edited or learned
    true_pattern: Optional[torch.Tensor] = None  # the task's exact pattern (persistence "true_")
    generators: tuple = ()             # random streams besides torch's own, kept by checkpoints
    info: dict = field(default_factory=dict)  # further result.json fields (init_seconds: QK init)

# === 4. The experiment of each family: its model with the prior, batches, loss and evaluation =======
# --- Boolean GOTU (Section 5.1, Table 1): train on the seen points, test on the whole cube -----------
def boolean_setup(run, data, place):
    """Section 5.1 as one experiment: the GOTU encoder over 15 bits and a CLS token, the task's pattern
    as its prior, MSE on the seen points; Table 1's loss and accuracy on the whole cube."""
    device, config = place.device, run.config
    # The prior of Figure "Visualization of task-specific mask design" (i) and Appendix "Design of Mask
    # Pattern": maskprior.boolean_mask, one (H, N, N) pattern per layer over maskprior.Transformer's
    # Boolean positions; 2parity and cyclic3 also come as a "direct" or "composed" (Principle 4)
    # variant. cls_row: --mask-error edits the CLS query row apart from the bits' rows (Principle 2;
    # maskprior.edit_pattern says how).
    exact = maskprior.boolean_mask(run.task, config["layers"], config["heads"],
                                   config.get("mask_variant"))                    # (L, H, N, N)
    pattern, masks = prior(run, exact, cls_row=True)
    # As aryol/GOTU's TokenTransformer (maskprior.Transformer's Boolean layout), one real number read
    # from CLS: the tasks are regressions (threesym's f is real, cyclic3's a sum of 15 signs), not
    # classifications.
    model, seconds = build_encoder(run, pattern, masks, device, vocab_size=2, seq_len=tasks.BOOLEAN_DIM + 1,
                                   out_dim=1)
    # data (tasks.boolean_dataset, tasks.py section 1): x_train (P, 15), every seen point of {-1, +1}^15,
    # y_train (P,) f there; x_test (32768, 15), the whole cube. Section 5.1: "We use the full dataset
    # (including both seen and unseen samples) for testing, while training is restricted to the seen
    # subset." The metrics add the unseen part alone and how close it lies to the MDI (unseen_mse_to_mdi).
    def loss_of(net, batch):                     # the aryol/GOTU loss: MSE of the CLS readout
        return F.mse_loss(net(batch[0].to(device)).squeeze(-1), batch[1].to(device))
    def evaluate():
        return tasks.boolean_metrics(run.task, tasks.boolean_predictions(model, data["x_test"]), data["x_test"])
    # At the end also the GOTU code's own measure of which function was learned: its Fourier coefficients
    # on the monomials of x0, x1, x2, exact on the enumerated cube. Majority's f has x0x1x2 at -1/2 and
    # no pairs; its MDI has none of x0x1x2 and x0x2, x1x2 at -1/2 each.
    def final(state, world):
        pred = tasks.boolean_predictions(model, data["x_test"])
        return {**tasks.boolean_metrics(run.task, pred, data["x_test"]),
                "train_loss": state["history"][-1]["train_loss"],
                "fourier": tasks.fourier_coefficients(pred, data["x_test"])}
    # The persistence numbers (Section 6.1) average attention over the whole cube; they are measured on
    # the pattern the run started from and, when --mask-error edited it, on the exact one too.
    return encoder_experiment(
        run, model, tasks.boolean_tokens(data["x_train"]), data["y_train"], loss_of, evaluate, final,
        probe=tasks.boolean_tokens(data["x_test"]), pattern=pattern, true_pattern=exact,
        info={"init_seconds": seconds})

# --- Three-digit arithmetic (Section 5.2): train on a seeded fraction, score held-out pairs -----------
def arithmetic_setup(run, data, place):
    """Section 5.2 as one experiment: an encoder that writes every answer digit in one forward pass,
    the digit-interaction mask as its prior, cross-entropy per digit; Table "Performance of arithmetic
    tasks"'s sequence and digit accuracy on held-out pairs."""
    device, config = place.device, run.config
    # The prior of Figure "Visualization of task-specific mask design" (ii): maskprior.mask_addition or
    # mask_multiplication, (L, H, 6 + K, 6 + K) over the six operand digits and the K answer slots,
    # open and closed at maskprior.ARITHMETIC_OPEN / _CLOSE. Head h takes role h mod 4 of the algorithm
    # (Principle 3; maskprior's _arithmetic_mask lists the four).
    exact = maskprior.ARITHMETIC_MASKS[run.task](config["layers"], config["heads"])
    pattern, masks = prior(run, exact)                                              # (L, H, N, N)
    # Structured SVD solves here for the paper's open 10000 and closed 0 (Table "Arithmetic task setup"),
    # not for the reference code's targets (structured_svd_init_'s defaults). "The Transformer predicts
    # the full output sequence in a single forward pass" (Section 5.2): one token per digit, no CLS, a
    # digit read out at every position, of which the loss and the metrics keep the K answer slots
    # (tasks.answer_logits).
    model, seconds = build_encoder(
        run, pattern, masks, device, {"open_logit": 1e4, "noise_scale": 0.0}, vocab_size=tasks.ARITHMETIC_VOCAB,
        seq_len=pattern.shape[-1], out_dim=10, cls_token=False, readout="tokens")
    # data (tasks.arithmetic_dataset, tasks.py section 2): of the 10^6 pairs (a, b), a seeded fraction
    # (--train-frac, by default the table's, tasks.ARITHMETIC_TRAIN_FRAC) trains: x_train (P, 6 + K)
    # tokens, least significant digit first, y_train (P, K) the answer's digits. x_eval, y_eval: a
    # seeded sample of the held-out pairs (--eval-size).
    def loss_of(net, batch):                     # cross-entropy on the answer digits
        with tasks.autocast(device):
            logits = tasks.answer_logits(net, batch[0].to(device))               # (B, K, 10)
        return F.cross_entropy(logits.float().flatten(0, 1), batch[1].to(device).flatten())
    # Table "Performance of arithmetic tasks" reports sequence accuracy (every digit right), digit
    # accuracy and loss. During training they are measured on a prefix of the evaluation pairs
    # (history's sample_*), to keep evaluations cheap; the final numbers on every evaluation pair.
    def sample_metrics():
        logits = tasks.arithmetic_logits(model, data["x_eval"][:10_000])
        metrics = tasks.arithmetic_metrics(logits, data["y_eval"][:10_000])
        return {f"sample_{key}": value for key, value in metrics.items()}
    def final(state, world):
        logits = tasks.arithmetic_logits(model, data["x_eval"])
        return {**tasks.arithmetic_metrics(logits, data["y_eval"]),
                "train_loss": state["history"][-1]["train_loss"]}
    return encoder_experiment(
        run, model, data["x_train"], data["y_train"], loss_of, sample_metrics, final,
        probe=data["x_eval"][:4096], pattern=pattern, true_pattern=exact,
        info={"init_seconds": seconds, "train_pairs": len(data["x_train"]),
              "eval_pairs": data["eval_pairs"], "held_out_pairs": data["held_out_pairs"]})

# --- Language (Appendix "Wiki-text and Tiny-stories", Table "Perplexity (PPL) comparison") -----------
def lm_setup(run, data, place):
    """A GPT with no prior, the causal relative-distance mask (M_ij = -max(i - j, 0), scale s = A)
    or mimetic W_Q / W_K; nanoGPT's random windows, one stream per rank; whole-split perplexity."""
    device, config, seed = place.device, run.config, run.seed
    L, H, T = config["layers"], config["heads"], config["block_size"]
    # The appendix's prior, maskprior.relative_distance_mask (its comment quotes the paper), the same
    # (H, T, T) mask in every layer. Unlike the other families A is not M's size but the GPT's scale s
    # (mask_scale), so prior() returns M as built, and --mask-magnitude sets s. A distance is not an
    # open / closed pattern, so the Experiment gets none: the persistence numbers are the bias at each
    # distance and M's drift.
    relative = maskprior.relative_distance_mask(H, T).expand(L, -1, -1, -1)         # (L, H, T, T)
    _, masks = prior(run, relative)
    if INITS[run.init][1] == "relative":   # the same prior as one logit per head and distance 0..T - 1 back
        masks = maskprior.relative_distance_mask(H, T, relative=True).expand(L, -1, -1)       # (L, H, T)
    # maskprior.GPT: nanoGPT's decoder (its docstring says where Tiny-Stories-GPT, the paper's code,
    # differs). mimetic writes its identity-like W_Q W_K^T after the build (qk_prior), Table "Perplexity
    # (PPL) comparison"'s third row.
    model = maskprior.GPT(data["vocab_size"], T, config["dim"], L, H, config["dropout"],
                          mode=INITS[run.init][0], masks=masks, mask_scale=config["mask_magnitude"],
                          positions=not config["no_pos"])
    qk_prior(model, run.init, None, seed)
    model.to(device)
    optimizer = make_optimizer(model, config)
    # Batches as nanoGPT's get_batch: batch_size windows of T tokens at random starts of the train
    # stream, (B, T) inputs and their next tokens (B, T). The starts come from a generator of their own
    # (a checkpoint keeps it: a resumed run draws the same windows), seeded per rank under torchrun.
    windows = torch.Generator().manual_seed(seed + 1000 * place.rank)
    torch.manual_seed(seed + 1000 * place.rank)  # dropout differs across ranks, as it should
    # The table counts iterations, not epochs: a round of the loop is eval_every iterations (FAMILIES'
    # default), the last round what is left.
    E, iters = config["eval_every"], config["iters"]
    def batches(r):                              # iterations (r - 1) E + 1 ... min(r E, iters)
        count = min(E, iters - (r - 1) * E)
        return (tasks.lm_batch(data["train"], T, config["batch_size"], windows) for _ in range(count))
    def loss_of(net, batch):
        with tasks.autocast(device):
            return net(batch[0].to(device), batch[1].to(device))[1]
    # Perplexity = exp(mean next-token loss) over every token of a split (tasks.lm_loss says why not
    # random batches). TinyStories has no test split: Table "NLP task setup"'s "validation fallback"
    # (test_is_val).
    def validation():
        val_loss = tasks.lm_loss(model, data["val"], T)
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss)}
    def final(state, world):
        val_loss = state["history"][-1]["val_loss"]
        test_loss = val_loss if data["test_is_val"] else tasks.lm_loss(model, data["test"], T)
        prompt = data["val"][:T // 4][None].to(device)   # (1, T / 4)
        sample = model.generate(prompt, 120, top_k=40, generator=torch.Generator(device=device).manual_seed(seed))
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss), "test_loss": test_loss,
                "test_ppl": math.exp(test_loss), "test_is_val": data["test_is_val"],
                "tokens_per_second": state["samples"] * T * world / state["train_seconds"],
                "sample": data["decode"](sample[0].tolist())}
    # Where attention goes (attention_*.pt, what --mask-from reads): the first 64 validation windows.
    probe = torch.stack([data["val"][s:s + T] for s in range(0, len(data["val"]) - T, T)][:64])
    # The table's "cosine": over all iterations, to zero, without warmup (the table names none). The
    # paper's code, Tiny-Stories-GPT, has no schedule at all: a constant lr.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, iters)
    return Experiment(model, optimizer, schedule, math.ceil(iters / E), iters, batches, loss_of, validation,
                      final, unit="iter", probe=probe, generators=(windows,), info=data.get("info", {}))

# --- Vision (Section 5.3, Table "Best Top-1 accuracy"; setup: Tables "Experimental setup for ...") ---
def vision_setup(run, data, place):
    """A ViT with the 3 x 3 impulse pattern as prior, in M or in W_Q / W_K (impulse); RandAugment,
    MixUp / CutMix, label smoothing, AdamW with vision_schedule; each epoch seeded by (seed, epoch, rank)."""
    from torchvision.ops import StochasticDepth
    device, rank, world = place
    config, seed = run.config, run.seed
    L, H = config["layers"], config["heads"]
    # Section 5.3: "Following [Zheng et al. 2025], we adopt an impulse filter pattern to initialize our
    # masks": maskprior.impulse_mask gives head h one neighbour of the 3 x 3 window (identity, up, right
    # for ViT-Tiny's 3 heads) over the grid x grid patches, CLS first, N = grid^2 + 1 (maskprior.ViT's
    # layout). The impulse init puts the same pattern into W_Q / W_K by the SVD solve
    # (Table "Best Top-1 accuracy"'s Impulse column), mask-fixed keeps it frozen in M (Appendix A.2's
    # Fixed Mask). A --mask-from prior is also measured against the impulse, the prior it replaces.
    exact = maskprior.impulse_mask(L, H, config["image_size"] // config["patch_size"])   # (L, H, N, N)
    pattern, masks = prior(run, exact)
    true_pattern = exact if config.get("mask_from") else None
    # The tables' "Drop path 0.1" as timm spreads it: 0 in the first block, rising linearly to the rate.
    rates = torch.linspace(0, config["drop_path"], L).tolist()   # (L,) one rate a block
    if config.get("model") == "timm":            # timm's VisionTransformer of the preset's shape, M put
        import timm                              # in by add_mask_prior; no return_attn: no attention maps
        model = timm.models.VisionTransformer(
            img_size=config["image_size"], patch_size=config["patch_size"], in_chans=data.get("channels", 3),
            num_classes=data["classes"], embed_dim=config["dim"], depth=L, num_heads=H,
            mlp_ratio=config["mlp_dim"] / config["dim"], drop_path_rate=config["drop_path"],
            global_pool="token" if config["pool"] == "cls" else "avg")
        if masks is not None:
            maskprior.add_mask_prior(model, masks, mode=INITS[run.init][0])
        pattern = None
    else:
        model = maskprior.ViT(config["image_size"], config["patch_size"], data["classes"], config["dim"],
                              L, H, config["mlp_dim"], channels=data.get("channels", 3),
                              mode=INITS[run.init][0], masks=masks, pool=config["pool"],
                              drop_paths=[StochasticDepth(r, "row") for r in rates])
    seconds = qk_prior(model, run.init, pattern, seed)
    model.to(device)
    # The tables' batch is the global batch, which tasks.vision_loaders splits over the torchrun ranks;
    # DDP averages the gradients.
    if config["batch_size"] % world:
        raise UsageError(f"--batch-size {config['batch_size']} does not split over {world} processes")
    train_loader, test_loader, sampler = tasks.vision_loaders(
        data, config["batch_size"], rank, world, run.workers, seed, pin_memory=device.type == "cuda")
    if len(train_loader) == 0:
        raise UsageError(f"--batch-size {config['batch_size']} is larger than the training set "
                         f"({len(data['train'])} images)")
    optimizer = make_optimizer(model, config)
    rounds = config["epochs"] + config["cooldown_epochs"]
    # The tables' augmentation in three places: RandAugment and the crops in the loader
    # (tasks.vision_transform), MixUp / CutMix per batch on the device (tasks.mixup_cutmix, timm's switch
    # between the two), label smoothing in the loss, on the mixed soft targets.
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
    # Table "Best Top-1 accuracy" reports the best epoch's test accuracy, as timm's train.py tracks it:
    # every eval_every epochs the whole test set, each rank scoring its share and the sums added.
    def top1():    # top-1 % and mean cross-entropy on the whole test set, summed over the ranks
        correct, total, n = (sum(v) for v in zip(*gather(tasks.vision_scores(model, test_loader), world)))
        return {"test_top1": 100.0 * correct / n, "test_loss": total / n}
    def final(state, world):
        last = state["history"][-1]
        return {"top1": last["test_top1"], "test_loss": last["test_loss"],
                "best_top1": max(e["test_top1"] for e in state["history"] if "test_top1" in e),
                "train_loss": last["train_loss"],
                "images_per_second": state["samples"] * world / state["train_seconds"]}
    # The attention maps (Appendix "Attention Map For Image Classification") and persistence numbers
    # average over the first 64 test images, 16 at a time: at 224 px a layer's maps are (16, 3, 197, 197).
    probe = None
    if pattern is not None:                     # fixed test images: the attention maps' inputs
        probe = torch.stack([data["test"][i][0] for i in range(min(64, len(data["test"])))])
    return Experiment(model, optimizer, vision_schedule(optimizer, config, len(train_loader)), rounds,
                      rounds * len(train_loader), batches, loss_of, top1, final,
                      eval_every=config["eval_every"], probe=probe, probe_batch=16, pattern=pattern,
                      true_pattern=true_pattern, info={"init_seconds": seconds, **data.get("info", {})})

def vision_schedule(optimizer, config, steps_per_epoch):
    """Per-step lr (Tables "Experimental setup for ..."): linear warmup, cosine to min_lr, cooldown."""
    # timm's cosine scheduler as torch schedulers chained by SequentialLR, stepped after every batch:
    # LinearLR from warmup_lr up to lr over the warmup epochs, a cosine from lr to min_lr over the other
    # training epochs, then ConstantLR holding min_lr for the cooldown epochs (VISION_PRESETS and
    # TASK_PRESETS give each), which end the run. A floor above lr would raise the lr: it is capped at lr.
    lr, warmup = optimizer.param_groups[0]["lr"], config["warmup_epochs"] * steps_per_epoch
    decay = (config["epochs"] - config["warmup_epochs"]) * steps_per_epoch
    floor, parts, milestones = min(config["min_lr"], lr), [], []
    if warmup:
        parts.append(torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=min(1.0, config["warmup_lr"] / lr), total_iters=warmup))
        milestones.append(warmup)
    parts.append(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, decay, eta_min=floor))
    if config["cooldown_epochs"]:
        parts.append(torch.optim.lr_scheduler.ConstantLR(
            optimizer, factor=floor / lr, total_iters=config["cooldown_epochs"] * steps_per_epoch))
        milestones.append(warmup + decay)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, parts, milestones)

# --- What the setups share: the prior (hand-made, edited or learned), the encoder, the optimizer, batches
def prior(run, exact, cls_row=False):
    """(pattern, M's start) of a run. pattern (L, H, N, N), what the prior starts from and the persistence
    numbers measure: the task's exact one, edited by --mask-error (Appendix A.2: maskprior.edit_pattern,
    seeded by the run's seed; cls_row: the Boolean CLS row is edited apart), or learned from --mask-from's
    run. M's start for the run's init (INITS): the pattern with open +A and closed -A, A = --mask-magnitude
    (the GPT's M as it is, its bias scale s = A; a learned prior is +-A already), zeros (mask-zero), or
    None (no M)."""
    config, kind = run.config, INITS[run.init][1]
    # Appendix A.2 asks whether a learnable mask can "refine or correct imperfect initial patterns":
    # --mask-error makes one by a seeded edit of the exact pattern, --mask-from takes one learned from
    # another run; check_args allows both with the mask inits only.
    pattern = exact
    if config.get("mask_from"):
        pattern = learned_prior(run, exact.shape)
    elif config.get("mask_error"):
        edit, fraction = config["mask_error"].split(":")
        pattern = maskprior.edit_pattern(exact, edit, float(fraction), run.seed, cls_row)
    if kind == "zero":
        return pattern, torch.zeros_like(pattern)
    if kind != "mask":
        return pattern, None
    # A hand-made pattern comes at the family's A (FAMILIES' "magnitude"), rescaled to --mask-magnitude's.
    if config.get("mask_from") or run.family == "language":
        return pattern, pattern
    return pattern, pattern * (config["mask_magnitude"] / FAMILIES[run.family]["magnitude"])

def build_encoder(run, pattern, masks, device, svd_scales=None, **shape):
    """maskprior.Transformer on device with the init's prior, in M or in W_Q / W_K; (model, seconds)."""
    # The Boolean and arithmetic families share one encoder, aryol/GOTU's TokenTransformer (embedding,
    # optional CLS, learned positions, pre-LN blocks, a linear readout); `shape` holds what differs:
    # vocabulary, sequence length, output width, CLS and readout. masks: M's start (None: no M), and
    # mode (INITS) says whether M trains. svd_scales: the family's targets for the structured-SVD solve
    # (SVD_FLAGS), which --svd-open / --svd-noise replace.
    config, init = run.config, run.init
    pos_std = config["pos_std"]                      # the preset's (BOOLEAN_PRESETS says why)
    model = maskprior.Transformer(
        masks=masks, mode=INITS[init][0], dim=config["dim"], depth=config["layers"],
        heads=config["heads"], mlp_dim=config["mlp_dim"], head_dim=config["head_dim"], pos_std=pos_std,
        cls_std=config.get("cls_std", 0.0), **shape)
    # Structured inits scale positions drawn at 0.02 by maskprior.NORM_P (to std 0.36) before their solve;
    # larger starts are scaled up to that std at most, never down (N(0, 1) positions: factor 1).
    # --pos-scale, --svd-open and --svd-noise replace these choices and the family's solve targets.
    pos_scale = maskprior.NORM_P if pos_std == 0 else min(maskprior.NORM_P, max(1.0, 0.36 / pos_std))
    pos_scale = config.get("pos_scale", pos_scale)
    svd_scales = {**(svd_scales or {}), **{name: config[key] for key, name in SVD_FLAGS.items() if key in config}}
    seconds = qk_prior(model, init, pattern, run.seed, svd_scales, pos_scale)
    return model.to(device), seconds

# The structured-SVD solve's targets a command may set (config key -> structured_svd_init_'s argument):
# the logit T_h of an open entry and the noise on the closed ones. Boolean runs solve with the reference
# code's values (structured_svd_init_'s defaults), arithmetic runs with the table's (arithmetic_setup).
SVD_FLAGS = {"svd_open": "open_logit", "svd_noise": "noise_scale"}

# The flags of the structured solve (the encoders' QK baselines), --pos-scale beside the SVD targets; a
# run's config holds them when given.
STRUCTURED_FLAGS = ("pos_scale", *SVD_FLAGS)

def qk_prior(model, init, pattern, seed, svd_scales=None, pos_scale=maskprior.NORM_P):
    """Put a QK init's prior into W_Q / W_K (Sections 2.1, 5.1), drawing from a generator seeded by seed;
    returns its seconds. pos_scale first scales the positions (NORM_P; 1 for N(0, 1) positions)."""
    # structured-svd and impulse: W_Q, W_K solved in closed form per layer and head so that the logits
    # on the (scaled) positions approximate the pattern (Zheng et al. 2025); structured-opt: fitted by
    # Adam (Zheng et al. 2024; its steps and lr: structured_opt_init_); mimetic: identity-like W_Q W_K^T
    # with no pattern (Trockman and Kolter). The mask inits and default do nothing here.
    # The seconds are result.json's init_seconds: the Opt fit costs time the other inits do not.
    prior, generator, start = INITS[init][1], torch.Generator().manual_seed(seed), time.time()
    if prior == "svd":
        maskprior.structured_svd_init_(model, pattern, generator=generator, pos_scale=pos_scale, **(svd_scales or {}))
    elif prior == "opt":
        maskprior.structured_opt_init_(model, pattern, generator=generator, pos_scale=pos_scale)
    elif prior == "mimetic":
        maskprior.mimetic_init_(model, generator=generator)
    return time.time() - start

# The optimizer each table names: Adam for the Boolean tasks (Table "Training setup for Boolean tasks"),
# AdamW for arithmetic, language and vision (Tables "Arithmetic task setup", "NLP task setup" and
# "Experimental setup for ...").
def make_optimizer(model, config):
    """Adam with coupled L2 on every parameter (aryol/GOTU's Boolean optimizer: weight decay enters the
    gradient, so Adam rescales it) or AdamW decaying weight matrices only (nanoGPT, timm). M is a group of
    its own (maskprior.param_groups), decayed by --mask-decay alone (default 0: decay pulls M toward the
    neutral mask, Appendix A.1, and so erodes the prior whose persistence is Section 6.1's point) at
    --mask-lr (default --lr)."""
    groups = maskprior.param_groups(model, config["weight_decay"], config["mask_decay"],
                                    mask_lr=config.get("mask_lr"), decay_all=config["optimizer"] == "adam")
    Optimizer = torch.optim.Adam if config["optimizer"] == "adam" else torch.optim.AdamW
    return Optimizer(groups, lr=config["lr"])

def encoder_experiment(run, model, x, y, *functions, **fields):
    """Boolean / arithmetic: a cosine over all steps, each epoch all (x, y) in seeded shuffled batches."""
    # An epoch is every training example once (tasks.py section 1: where aryol/GOTU differs), in a
    # fresh order. The order comes from a generator seeded by the run's seed and kept by checkpoints, so a
    # resumed run draws the orders the uninterrupted one would. The cosine (the arithmetic table's "cosine"; the
    # Boolean setup's "learning rate scheduler") runs over every step of every epoch, from lr to 0, without
    # warmup. *functions: the setup's loss_of, evaluate and final.
    config = run.config
    steps = math.ceil(len(x) / config["batch_size"]) * config["epochs"]
    optimizer = make_optimizer(model, config)
    shuffle = torch.Generator().manual_seed(run.seed)
    def batches(epoch):
        order = torch.randperm(len(x), generator=shuffle)     # (P,)
        return ((x[idx], y[idx]) for idx in order.split(config["batch_size"]))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    return Experiment(model, optimizer, schedule, config["epochs"], steps, batches, *functions,
                      eval_every=config["eval_every"], generators=(shuffle,), **fields)

# --- A prior learned from a trained model (--mask-from; the paper's Limitations) -----------------------
def learned_prior(run, shape):
    """M's start from the finished run --mask-from names: maskprior.learned_mask of its mean attention
    after training, +-A over the model's bias scale s (the GPT's: s = A, so +-1, causal); shape
    (L, H, N, N) is the model's, which the source's maps must have."""
    config = run.config
    causal = run.family == "language"
    magnitude = 1.0 if causal else config["mask_magnitude"]
    # The source's digest was recorded when the command started (make_config); a source retrained since
    # would give this run a prior its config does not describe.
    _, attn, digest = read_source(config["mask_from"])
    if digest != config["mask_from_sha256"]:
        raise UsageError(f"--mask-from {config['mask_from']}: attention_after.pt changed while this run "
                         f"started: start it again")
    if tuple(attn.shape) != tuple(shape):
        theirs, ours = (f"{s[0]} layers x {s[1]} heads x {s[2]} x {s[3]}" for s in (attn.shape, shape))
        raise UsageError(f"--mask-from {config['mask_from']}: its attention maps are {theirs}, this model's "
                         f"{ours}: the source needs the same --layers, --heads and sequence length")
    return maskprior.learned_mask(attn, magnitude, config["mask_threshold"], causal)

def read_source(folder):
    """The finished run --mask-from names: (result.json, mean attention after (L, H, N, N), its sha256)."""
    def bad(why):
        return UsageError(f"--mask-from {folder}: {why}")
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
        raise bad("attention_after.pt holds no mean attention maps (a layers x heads x N x N tensor under 'attn')")
    if not torch.isfinite(attn).all():
        raise bad("attention_after.pt's mean attention is not finite (NaN or inf)")
    return result, attn.float(), hashlib.sha256(raw).hexdigest()

# The four families: their presets, inits, the paper's mask magnitude A (open +A, closed -A; the GPT's
# scale s), rounds between evaluations (language: five evaluations a run), the flags only they take
# beside their preset's keys, whether their data is read from files, and their setup.
# A: maskprior's constants block, where each is quoted from the paper. Vision evaluates every epoch (the
# best epoch is the table's number), the encoders every 5; language's None becomes a fifth of the
# iterations (make_config). "setup" is what execute (section 6) calls to build the run.
FAMILIES = {
    "boolean": {"presets": BOOLEAN_PRESETS, "inits": ENCODER_INITS, "magnitude": maskprior.OPEN,
                "eval_every": 5, "takes": ("mask_variant", "mask_error", *STRUCTURED_FLAGS), "files": False,
                "setup": boolean_setup},
    "arithmetic": {"presets": ARITHMETIC_PRESETS, "inits": ENCODER_INITS, "magnitude": maskprior.ARITHMETIC_OPEN,
                   "eval_every": 5, "takes": ("train_frac", "eval_size", "mask_error", *STRUCTURED_FLAGS),
                   "files": False, "setup": arithmetic_setup},
    "language": {"presets": LM_PRESETS, "inits": ("default", "mask", "mimetic", "mask-relative", "mask-relative-fixed"),
                 "magnitude": maskprior.GPT_MASK_SCALE, "eval_every": None, "takes": ("bpe_file",),
                 "files": True, "setup": lm_setup},
    "vision": {"presets": VISION_PRESETS, "inits": ("default", "mimetic", "impulse", "mask-fixed", "mask"),
               "magnitude": maskprior.OPEN, "eval_every": 1,
               "takes": ("download", "workers", "compile", "model"), "files": True, "setup": vision_setup},
}

def load_data(run):
    """The run's data from tasks.py, whose loaders keep what they built or read: a grid reads its files
    once. The Boolean cube and seen set (Section 5.1), the arithmetic split of this seed (Section 5.2),
    a corpus (Appendix), an image set (Section 5.3; under torchrun rank 0 downloads it first)."""
    config = run.config
    # Generated data (the Boolean cube, the arithmetic pairs) is built in memory, tensors of the shapes
    # the setups above describe; corpora and images are read from --data-dir (tasks.py sections 3, 4).
    if run.family == "boolean":
        return tasks.boolean_dataset(run.task)
    if run.family == "arithmetic":
        return tasks.arithmetic_dataset(run.task, config["train_frac"], run.seed, config["eval_size"])
    if run.family == "language":
        data = tasks.lm_dataset(run.task, run.data_dir, run.bpe_file)
        tasks.check_lm_splits(data, config["block_size"])
        return data
    _, rank, world = distributed_setup(run.device)
    arguments = (run.task, run.data_dir, config["image_size"])
    if run.download and rank == 0:
        tasks.vision_dataset(*arguments, True, config["randaugment"], config["crop_scale"])
    if run.download and world > 1:
        dist.barrier()
    return tasks.vision_dataset(*arguments, False, config["randaugment"], config["crop_scale"])

# === 5. The training loop: the same for every family ===============================================
# One loop for every experiment of the paper, read top to bottom as nanoGPT's: a batch, the forward pass
# (the setup's loss_of), backward, an optimizer step, the schedule's step. The task lives in the
# Experiment (section 4); what the loop adds is what makes a long run safe: a NaN stops it at the step
# where it appears, a signal stops it with a checkpoint from which --resume repeats the uninterrupted
# run exactly, and under torchrun every rank takes both decisions at the same step (agreed, section 8).
def train(run, exp, net, state, place, stop):
    """Rounds state["round"] + 1 .. exp.rounds (a round: an epoch, or eval_every language iterations);
    each ends in a history entry, every eval_every rounds (and after the last) in an evaluation and a
    checkpoint. state, listed below, is what checkpoints keep."""
    device, rank, world = place
    bar = tqdm(total=exp.steps, initial=state["step"], desc=run.name, leave=False, dynamic_ncols=True,
               disable=None if run.progress and rank == 0 else True)   # None: on a terminal only
    started = time.time()
    # What `state` holds here (built by execute, section 6, or read back by resume_from, section 8; every
    # key goes into checkpoint.pt whole, so a resumed run goes on from the same numbers):
    #   round          the last round finished, 0 before the first: the loop starts at round + 1
    #   step           optimizer steps done over all rounds (the bar's position)
    #   history        one entry a round: {"epoch" or "iter": n, "train_loss", "lr"}, plus the setup's
    #                  evaluate() metrics every eval_every rounds; result.json's "history" is this list
    #   train_seconds  seconds spent in steps alone, evaluations left out: final's throughput
    #   samples        training examples this rank has stepped on (final's images or tokens a second)
    #   threads        the torch CPU threads the run trains with (a resumed run keeps its checkpoint's)
    #   before         picture() of the prior before training (section 6): {"attn", "bias"[, "centre"]}
    #   partial        only in a run resumed inside a round a signal cut: {"round", "done": its steps
    #                  taken, "losses": theirs, "rngs": the random states at the round's start}; the loop
    #                  pops it and replays the round up to where it was cut
    for r in range(state["round"] + 1, exp.rounds + 1):
        if "partial" in state:                         # resumed inside round r: skip its done steps
            batches, losses, round_start = replay(exp, r, state.pop("partial"), device)
        else:                                          # the random states before exp.batches, which may
            round_start = rng_states(exp, device)      # seed: a round cut later is replayed from them
            # -> the setup's batches (section 4): encoder_experiment's shuffled epoch, lm_setup's random
            # windows, vision_setup's loader
            batches, losses = iter(exp.batches(r)), []
        for batch in batches:
            step_start = time.time()
            # -> the setup's loss_of (section 4), e.g. boolean_setup's MSE of the CLS readout. net is
            # exp.model itself, or its DDP (torchrun) or torch.compile wrapper (execute, section 6).
            loss = exp.loss_of(net, batch)             # a scalar
            if agreed([not torch.isfinite(loss.detach())], world, device)[0]:    # on any rank
                raise Diverged(f"loss became {loss.item()} at step {state['step'] + 1} ({exp.unit} {r})")
            exp.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            exp.optimizer.step()
            exp.schedule.step()                        # every setup's schedule steps per batch
            losses.append(loss.item())                 # .item() waits for the step: timing is honest
            state["step"] += 1
            state["train_seconds"] += time.time() - step_start
            state["samples"] += len(batch[0])
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3g}")      # 3 digits: 1.23e-07 too
            signum = agreed([stop.signal or 0], world, device)[0]      # a signal, on any rank
            if signum:                                 # a checkpoint of this step, then stop
                cut = {"round": r, "done": len(losses),
                       "ranks": gather({"losses": losses, "rngs": round_start}, world)}
                keep_checkpoint(run, exp, state, place, cut)
                raise Interrupted(signum, position(exp.unit, r, state["step"]))
        entry = {exp.unit: state["step"] if exp.unit == "iter" else r,
                 "train_loss": statistics.fmean(gather(statistics.fmean(losses), world)),
                 "lr": exp.schedule.get_last_lr()[0]}
        state["history"].append(entry)
        evaluated = r % exp.eval_every == 0 or r == exp.rounds
        if evaluated:
            # -> the setup's evaluate (section 4); every rank evaluates, rank 0 prints
            entry.update(exp.evaluate())               # e.g. Table 1's accuracy on the whole cube
            # A line a log keeps, above the bar: "majority/mask/seed0 epoch 5/10: train loss 0.0123, test
            # acc (%) 87.5, 12 s" (seconds since this process began the run), in tasks.LABELS' words.
            key, label = tasks.main_metric(run.task)
            last = exp.steps if exp.unit == "iter" else exp.rounds
            if rank == 0:
                bar.write(f"{run.name} {exp.unit} {entry[exp.unit]}/{last}: train loss "
                          f"{tasks.fmt(entry['train_loss'])}, {label} {tasks.fmt(entry.get(key))}, "
                          f"{time.time() - started:.0f} s")
                sys.stdout.flush()
        # The round is done; a checkpoint after every evaluation (and at a signal) is where --resume
        # picks up.
        state["round"] = r
        signum = agreed([stop.signal or 0], world, device)[0]          # a signal since the last step
        if evaluated or signum:
            keep_checkpoint(run, exp, state, place)
        if signum:
            raise Interrupted(signum, position(exp.unit, r, state["step"]))
    if stop.signal:                                    # after the last checkpoint, which holds the run
        raise Interrupted(stop.signal, position(exp.unit, exp.rounds, state["step"]))
    bar.close()

def replay(exp, r, cut, device):
    """Resume inside a round (signals, --resume): a round a signal cut (a checkpoint's "partial"), drawn
    again from the random states at its start, its done batches skipped, the states of now put back;
    (batches left, their losses, the round's start). A resumed run repeats the uninterrupted one exactly."""
    now = rng_states(exp, device)
    set_rng_states(exp, device, cut["rngs"])
    batches = iter(exp.batches(r))
    for _ in range(cut["done"]):
        next(batches)
    set_rng_states(exp, device, now)
    return batches, list(cut["losses"]), cut["rngs"]

def keep_checkpoint(run, exp, state, place, cut=None):
    """Resume: checkpoint.pt of this step (rank 0 writes): weights, optimizer, schedule, every rank's
    random states, state; cut: a round a signal cut after cut["done"] steps."""
    device, rank, world = place
    rngs = gather(rng_states(exp, device), world)
    if rank == 0:
        save_checkpoint(run.checkpoint, {
            "meta": run.meta(world), "model": exp.model.state_dict(),
            "optimizer": exp.optimizer.state_dict(), "schedule": exp.schedule.state_dict(),
            "rng": rngs, "state": state, "partial": cut})
    if world > 1:
        dist.barrier()

def position(unit, r, step):
    """Messages (signals, resume): where a run is, in words: "epoch 3 (step 34)", or "iteration 37" for
    language."""
    return f"iteration {step}" if unit == "iter" else f"epoch {r} (step {step})"

# === 6. One run: the prior before, training, the prior after (Section 6.1), result.json ============
# Section 6.1 asks whether a prior persists: "mask-based priors are more persistent during optimization",
# where QK initializations "quickly forget the imposed prior" (Section 5.1), as Figure "Comparison of
# attention patterns before and after training" shows for one head. So every run measures where its
# attention goes twice, on the same probe inputs: once as initialised and once after training. The two
# snapshots give result.json's persistence numbers beside the task's own (Tables 1-3, 6) and the pictures
# in attention.svg. A run ends in one result.json, written atomically once training ends (or diverges).
def execute(run, data, place, stop):
    """Build the run's experiment, snapshot its attention (before), train, snapshot (after), write
    result.json and the pictures to run.folder. Under torchrun rank 0 writes; the others return None."""
    device, rank, world = place
    torch.manual_seed(run.seed)                 # the same initial weights on every rank
    # -> the family's setup, section 4 (for --task majority: boolean_setup): model, prior, optimizer, data
    exp = FAMILIES[run.family]["setup"](run, data, place)
    net = DDP(exp.model) if world > 1 else exp.model   # torchrun: gradients averaged over ranks
    net = torch.compile(net) if run.compile else net
    # The loop's state, every key of which train (section 5) declares; "before" is added below.
    state = {"round": 0, "step": 0, "history": [], "train_seconds": 0.0, "samples": 0, "threads": run.threads}
    resumed_at = None                           # where a resumed run picks up: its epoch, or iteration
    # --resume (-> resume_from, section 8) puts the checkpoint's weights, optimizer, schedule and random
    # states into exp and returns its state, "before" included: the snapshot is never taken twice.
    if run.resume and (not run.grid or os.path.exists(run.checkpoint)):   # a grid: runs with one
        state = resume_from(run.checkpoint, run.meta(world), exp, place)
        resumed_at = state["step"] if exp.unit == "iter" else state["round"]
        cut = state.get("partial")              # the run's first line: where it goes on
        at = position(exp.unit, cut["round"] if cut else state["round"], state["step"])
        if rank == 0:
            print(f"{run.name}: goes on from the checkpoint of {at}", flush=True)
        # The checkpoint's thread count (the numbers depend on it in their last digits), unless
        # --threads says otherwise: then a note when the two differ.
        saved = state.get("threads") or run.threads
        state["threads"] = run.threads if run.threads_given else saved
        if state["threads"] != saved:
            print(f"train.py: note: {run.folder} was trained with {saved} threads, --threads {run.threads} "
                  f"now: the numbers may differ from an uninterrupted run's in their last digits",
                  file=sys.stderr)
    else:                                       # the prior as initialised: Section 6.1's "before"
        os.makedirs(run.folder, exist_ok=True)
        state["before"] = picture(run, exp, place, {}, "before")
    torch.set_num_threads(state["threads"])
    # What the flags changed of the preset, {setting: [this run's, the preset's]}: table.md says it
    # beside the paper's numbers, which describe the preset.
    preset = {**FAMILIES[run.family]["presets"][run.config["preset"]],
              **TASK_PRESETS.get((run.family, run.config["preset"]), {}).get(run.task, {})}
    changes = {key: [run.config[key], value] for key, value in preset.items() if run.config.get(key, value) != value}
    # result.json: which run (task, init, seed, config, the data's fingerprint), where it ran, what the
    # setup adds (exp.info, e.g. init_seconds); "final" stays None and status "running" until training
    # ends. history is state's own list, so it grows as the loop appends to it.
    result = {"task": run.task, "init": run.init, "seed": run.seed, "config": run.config,
              "device": str(device), "threads": state["threads"], "data_dir": data.get("root"),
              "preset_changes": changes, "mask_prior": run.init in MASK_PRIOR_INITS,
              "world_size": world, "status": "running", "seconds": None, "resumed_at": resumed_at,
              **exp.info, "data_fingerprint": run.fingerprint, "final": None, "history": state["history"]}
    start = time.time()
    stop.training = stop.trained = True         # a first signal now waits for the step's end
    try:
        train(run, exp, net, state, place, stop)    # -> the loop, section 5
    except Diverged as err:                     # a NaN loss: result.json says where; the command exits 1
        result.update(status="diverged", error=str(err), seconds=time.time() - start)
        if rank == 0:
            write_atomic(os.path.join(run.folder, "result.json"), json_text(result))
        raise
    except Interrupted as err:                  # a second signal, inside a step: where the run was
        err.at = err.at or position(exp.unit, state["round"] + 1, state["step"])
        raise
    finally:
        stop.training = False
    if rank != 0:
        return None
    # Section 6.1's measurement again, after training, and the numbers that compare the two
    # (-> maskprior.persistence_fields; maskprior.py section 5 defines prior mass, pattern correlation
    # and mask drift). With them the setup's own numbers (exp.final, section 4: for majority Table 1's
    # loss and accuracy and the Fourier weights).
    after = picture(run, exp, place, {"before": state["before"]}, "after")   # does the prior persist?
    result["final"] = {**exp.final(state, world),
                       **maskprior.persistence_fields(state["before"], after, exp.pattern, exp.true_pattern)}
    # -> tasks.on_target (tasks.py section 1 states the rule): on the target f, not on the MDI
    verdict = tasks.on_target(result)           # None outside the Boolean tasks
    if verdict is not None:
        result["final"]["on_target"] = verdict
    result.update(status="done", seconds=time.time() - start)
    result, not_finite = finite(result)         # result.json is strict JSON: null, and a note
    if not_finite:
        result["not_finite"] = not_finite
        print(f"train.py: warning: {run.name}: not finite, stored as null: "
              f"{', '.join(f'{k} {v}' for k, v in not_finite.items())}", file=sys.stderr)
    # -> write_atomic and json_text (section 8); the run's line in tasks.py's words (tasks.summary_line,
    # tasks.py section 5), then the last line of a one-run command
    write_atomic(os.path.join(run.folder, "result.json"), json_text(result))
    print(tasks.summary_line(result), flush=True)
    if not run.grid:                            # the last line: every file the run wrote
        written = [name for name in RUN_FILES if os.path.isfile(os.path.join(run.folder, name))]
        print(f"wrote {', '.join(written)} in {run.folder}")
    return result

def picture(run, exp, place, snapshots, when):
    """The prior as the model holds it now (when: "before" or "after" training), returned: mean attention
    maps on the probe inputs and the mask bias log sigmoid(s M), both (L, H, N, N) or None, a ViT's centre
    patch on the first probe. Rank 0 writes it to attention_<when>.pt, and attention.svg of every
    snapshot so far (tasks.attention_figure)."""
    # The two quantities of Section 6.1: where attention goes, each layer's and head's map averaged over
    # the probe inputs (maskprior.mean_attention, maskprior.py section 5), and the prior itself, the
    # bias log sigmoid(s M) that M adds (None without M). Figure "Comparison of attention patterns before
    # and after training" draws the first, Figures "Initial mask logits" and "Relative mask bias before
    # and after training" the second. A ViT also keeps the centre patch's row on one image as a 2-D map
    # (Appendix "Attention Map For Image Classification").
    probe, model, device = exp.probe, exp.model, place.device
    attn = None if probe is None else maskprior.mean_attention(model, probe, device, exp.probe_batch)
    snapshots[when] = {"attn": attn, "bias": maskprior.mask_biases(model)}
    if isinstance(model, maskprior.ViT):
        snapshots[when]["centre"] = maskprior.centre_patch_maps(model, probe[:1], device)
    if place.rank == 0:
        save_checkpoint(os.path.join(run.folder, f"attention_{when}.pt"), snapshots[when])
        svg = tasks.attention_figure(snapshots, cls_token=getattr(model, "cls", None) is not None,
                                     causal=isinstance(model, maskprior.GPT))
        if svg:
            write_atomic(os.path.join(run.folder, "attention.svg"), svg)
    return snapshots[when]

# === 7. The command line: the flags, the runs they ask for, a grid; main ============================
@dataclass
class Run:
    """One run of a command (a cell of its grid), everything it needs in one record, as nanoGPT keeps its
    settings in one place; plan() builds it from the command line. config is what the paper's setup tables
    set and what result.json records: the preset, the task's changes to it and the flags given, merged once
    (make_config). The other fields say where the run reads and writes and how the machine runs it; they
    leave its numbers alone (threads: up to their last digits)."""
    # Which run: result.json's task, init, seed and config, and the folder it writes
    family: str                        # boolean, arithmetic, language or vision (FAMILIES)
    task: str
    init: str
    seed: int
    config: dict
    folder: str                        # result.json, checkpoint.pt and the pictures go here
    # How --resume treats it
    grid: bool = False                 # one cell of a grid: --resume continues it only if it has a checkpoint
    resume: bool = False               # --resume
    # Where its data is read
    data_dir: str = "data"             # where corpora and images are read (--data-dir)
    bpe_file: Optional[str] = None     # GPT-2's ranks file (--bpe-file)
    download: bool = False             # vision: fetch CIFAR (--download)
    # How this machine runs it
    workers: int = 0                   # vision: loader processes (8 beside a GPU, else 0)
    compile: bool = False              # vision: torch.compile (--compile)
    progress: bool = True              # tqdm's bar, on a terminal
    threads: int = 1                   # torch CPU threads (--threads, else the free cores)
    threads_given: bool = False        # --threads was given (--resume otherwise keeps the checkpoint's)
    device: torch.device = torch.device("cpu")   # --device (torchrun: each rank its own GPU)
    # Set by train_all once the data is read (section 8: data fingerprints)
    fingerprint: Optional[dict] = None  # the digest of its data (data_fingerprint), once it is read

    @property
    def name(self):
        """"majority/mask/seed0": how the progress bar, the log lines and the messages name the run."""
        return f"{self.task}/{self.init}/seed{self.seed}"

    @property
    def checkpoint(self):
        """Where keep_checkpoint writes the run's state and --resume reads it back (section 8)."""
        return os.path.join(self.folder, "checkpoint.pt")

    def meta(self, world):
        """Resume: what checkpoint.pt records of the run, for --resume to compare with the command that resumes."""
        return {"task": self.task, "init": self.init, "seed": self.seed, "config": self.config,
                "world_size": world, "data_fingerprint": self.fingerprint}

    def finished(self):
        """Resume (a finished run is left as it is): the folder's result.json if it is this very run (task,
        init, seed, config, and data once read), done; else None."""
        old = read_result(os.path.join(self.folder, "result.json"), warn=False)   # None: none, or damaged
        if not old or old["status"] != "done":
            return None
        if [old["task"], old["init"], old["seed"], old["config"]] != [self.task, self.init, self.seed, self.config]:
            return None
        if self.fingerprint is not None and old.get("data_fingerprint") != self.fingerprint:
            return None
        return old

    def kept(self):
        """Signals and failed writes, the advice of the last line: what is on disk of a run that stopped,
        and what to do: read from its folder."""
        saved = None
        with contextlib.suppress(UsageError):      # none, or damaged: as if there were none
            saved = load_checkpoint(self.checkpoint)
        if saved is not None:
            state, cut = saved["state"], saved.get("partial")
            unit = "iter" if self.family == "language" else "epoch"
            at = position(unit, cut["round"] if cut else state["round"], state["step"])
            return f"the checkpoint of {at} is kept in {self.folder}: rerun with --resume"
        if self.grid:
            return f"{self.folder} has no checkpoint yet and starts over: rerun with --resume"
        return "no checkpoint was written, nothing to resume: rerun without --resume"

# Grids: the flags whose values a grid sweeps, by config key; each value given twice runs once.
SWEEPS = ("train_frac", "mask_magnitude", "mask_decay", "mask_error", "mask_lr", "mask_threshold")

def build_parser():
    """The command line: every flag, in five groups (what to run, the mask prior, overrides of the
    preset, data, output and resume); each list of choices printed once in --help."""
    every_task = list(tasks.FAMILY_OF)
    p = Parser(prog="train.py", usage="python train.py [--task TASK ...] [--init INIT ...] [options]",
               description=__doc__.split("\n")[0], epilog=tasks.OWN_DATA_HELP,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    count, natural = number(int, strict=False), number(int)
    rate, share = number(float), number(float, strict=False)
    g = p.add_argument_group("what to run")
    g.add_argument("--task", nargs="+", default=["majority"], choices=every_task + ["all"], metavar="TASK",
                   help=f"{', '.join(every_task)}; all: the Boolean four")
    g.add_argument("--init", nargs="+", default=["mask"], choices=list(INITS), metavar="INIT",
                   help=f"{', '.join(INITS)} (default mask)")
    one_or_many = g.add_mutually_exclusive_group()     # --seed beside --seeds: exit 2, not one dropped
    one_or_many.add_argument("--seed", type=count, default=0, help="random seed (default 0; with --preset paper "
                             "the paper's: 1337 for language, 42 for imagenet100)")
    one_or_many.add_argument("--seeds", type=count, nargs="+", metavar="SEED",
                             help="several seeds: a grid (not with --seed)")
    g.add_argument("--preset", choices=["cpu", "paper"], default="cpu", help="cpu (quick, default) or paper "
                   "(the paper's tables)")
    g.add_argument("--summarize", metavar="DIR", help="train nothing: the tables of DIR's runs (no other flag "
                   "but --figure)")
    g.add_argument("--figure", nargs=2, metavar=("NAME", "FILE"), help="train nothing: figure NAME of DIR into FILE")
    g.add_argument("--model", choices=["maskprior", "timm"], help="vision: maskprior.ViT (default) or timm's "
                   "VisionTransformer, same shape")
    g = p.add_argument_group("the mask prior (inits mask, mask-fixed, mask-hadamard)")
    for name, kind, metavar, text in (         # several values: a sweep (SWEEPS)
            ("mask-magnitude", rate, "A", "open +A, closed -A (GPT: scale s); several: a sweep"),
            ("mask-decay", share, "W", "weight decay on M alone (default 0); several: a sweep"),
            ("mask-lr", rate, "LR", "lr of M alone (default --lr); several: a sweep"),
            ("mask-error", mask_edit, "KIND:P", "extra|missing|moved:P edits the prior; none: exact")):
        g.add_argument(f"--{name}", type=kind, nargs="+", metavar=metavar, help=text)
    g.add_argument("--mask-from", metavar="DIR", help="M from the attention maps of the finished run DIR")
    g.add_argument("--mask-threshold", type=rate, nargs="+", metavar="TAU", help="open where attention >= "
                   "TAU / row's keys (default 1)")
    g.add_argument("--mask-variant", choices=["composed", "direct"], help="2parity, cyclic3: the product "
                   "over two layers (composed) or one (direct)")
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
            ("pos-scale", rate, "structured inits: positions x X before the solve (default 18, 1 for N(0, 1))"),
            ("svd-open", rate, "structured-svd: the solve's open logit (Boolean 1000, arithmetic 10000)"),
            ("svd-noise", share, "structured-svd: noise on the closed logits (Boolean 3, arithmetic 0)"),
            ("block-size", natural, "language: tokens per window"),
            ("image-size", natural, "vision: image side, pixels"),
            ("patch-size", natural, "vision: patch side, pixels"),
            ("warmup-epochs", count, "vision: epochs of lr warmup"),
            ("eval-every", natural, "rounds between evaluations and checkpoints")):
        g.add_argument(f"--{name}", type=kind, metavar="X" if kind in (rate, share) else "N", help=text)
    g.add_argument("--no-pos", action="store_true", help="language: no learned positions (the mask prior alone)")
    g = p.add_argument_group("data")
    g.add_argument("--train-frac", type=rate, nargs="+", metavar="F", help="arithmetic: fraction of pairs to "
                   "train on (a sweep)")
    g.add_argument("--eval-size", type=number(int, words=("all",)), metavar="N",
                   help="arithmetic: held-out pairs scored, or all (100000)")
    g.add_argument("--data-dir", default="data", metavar="DIR", help="where corpus and image files live "
                   "(default data)")
    g.add_argument("--bpe-file", metavar="FILE", help="GPT-2's ranks file for tiktoken, offline")
    g.add_argument("--download", action="store_true", help="vision: fetch CIFAR if missing")
    g.add_argument("--workers", type=count, metavar="N", help="vision: loader processes")
    g = p.add_argument_group("output and resume")
    g.add_argument("--out", metavar="DIR", help="a single run writes into DIR (default runs/<run name>); a grid "
                   "each run into DIR/<task>-<init>-seed<N>[-<setting>] (default runs/grid)")
    g.add_argument("--resume", action="store_true", help="continue from checkpoint.pt (a grid: all)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1")
    g.add_argument("--threads", type=natural, metavar="N", help="torch CPU threads")
    g.add_argument("--compile", action="store_true", help="vision: torch.compile the model")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p

def mask_edit(text):
    """The command line, --mask-error (Appendix A.2's imperfect priors): its argparse type. "none" -> None (the
    exact prior); "KIND:P" -> "kind:p" with kind in maskprior.EDIT_KINDS and 0 < p <= 1 (the float's own text:
    "moved:1" -> "moved:1.0")."""
    if text == "none":
        return None
    kind, _, number = text.partition(":")
    try:
        fraction = float(number)
    except ValueError:
        fraction = math.nan
    if kind not in maskprior.EDIT_KINDS or not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(
            f"expected 'none' or KIND:FRACTION with KIND one of {', '.join(maskprior.EDIT_KINDS)} and "
            f"0 < FRACTION <= 1, got {text!r}")
    return f"{kind}:{fraction}"

def plan(args):
    """The command line -> runs, and grids: the runs a command asks for, one Run each: tasks x sweeps x inits x
    seeds, each value once (a value given twice would train one run twice into one folder: a note on stderr). A
    sweep of --mask-magnitude only acts on M (the other inits run once, at its first value), --mask-lr on a
    trained M."""
    device = resolve_device(args.device)        # -> section 8, the machine
    task_names = list(tasks.BOOLEAN_TASKS) if "all" in args.task else args.task
    family = check_args(args, task_names)       # -> below: every refusal comes before anything is built
    axes = {"task": task_names, "init": args.init, "seeds": args.seeds,
            **{key: getattr(args, key) for key in SWEEPS}}
    if args.mask_from is not None and not axes["mask_threshold"]:
        axes["mask_threshold"] = [1.0]          # tau = 1: open where a key gets its share
    for flag, given in axes.items():
        if given and len(set(given)) < len(given):
            again = next(v for i, v in enumerate(given) if v in given[:i])
            shown = "none" if again is None else str(again)
            if isinstance(again, float):
                shown = f"{again:g}"
            print(f"train.py: note: --{flag.replace('_', '-')} {shown} is given more than once; each "
                  f"run is trained once", file=sys.stderr)
            axes[flag] = list(dict.fromkeys(given))
    seeds = axes["seeds"] or [args.seed]
    if args.seeds is None and args.seed == 0 and args.preset == "paper":
        seeds = [PAPER_SEEDS.get(family, PAPER_SEEDS.get(" ".join(task_names), 0))]
    sweeps = {key: axes[key] or [None] for key in SWEEPS}
    cells = []
    for task, *swept, init, seed in itertools.product(axes["task"], *sweeps.values(), axes["init"], seeds):
        settings = dict(zip(SWEEPS, swept))
        if init not in MASK_PRIOR_INITS and settings["mask_magnitude"] != sweeps["mask_magnitude"][0]:
            continue
        if init not in TRAINED_MASK_INITS:
            if settings["mask_lr"] != sweeps["mask_lr"][0]:
                continue
            settings["mask_lr"] = None
        cells.append((task, init, seed, settings))
    grid = len(cells) > 1
    workers = args.workers
    if workers is None:                         # vision's loader processes: 8 beside a GPU, else none
        workers = 8 if device.type == "cuda" else 0
    # One Run (above) a cell, its config merged once by make_config (below); a single run's folder is
    # runs/<name> (majority with the mask init: runs/majority-mask-seed0), a grid's cells sit under one root.
    runs = []
    for task, init, seed, settings in cells:
        name = folder_name(task, init, seed, settings, args)
        if grid:
            folder = os.path.join(args.out or "runs/grid", name)
        else:
            folder = args.out or os.path.join("runs", name)
        runs.append(Run(family, task, init, seed, make_config(family, task, settings, args), folder, grid,
                        resume=args.resume, data_dir=args.data_dir, bpe_file=args.bpe_file,
                        download=args.download, workers=workers, compile=args.compile,
                        progress=not args.no_progress, threads_given=bool(args.threads), device=device))
    return runs

def folder_name(task, init, seed, settings, args):
    """Output folders: a run's folder name, <task>-<init>-seed<seed>, then each setting the command gave
    (defaults unnamed): -frac<f>, -<mask variant>, -A<A>, -wd<W>, -err-<kind><p>, -mlr<lr>, -from-<run>-tau<TAU>."""
    parts = [f"{task}-{init}-seed{seed}"]
    if settings["train_frac"]:
        parts.append(f"frac{settings['train_frac']:g}")
    if args.mask_variant:
        parts.append(args.mask_variant)
    if settings["mask_magnitude"]:
        parts.append(f"A{settings['mask_magnitude']:g}")
    if settings["mask_decay"] is not None:
        parts.append(f"wd{settings['mask_decay']:g}")
    if settings["mask_error"]:
        kind, fraction = settings["mask_error"].split(":")
        parts.append(f"err-{kind}{float(fraction):g}")
    if settings["mask_lr"]:
        parts.append(f"mlr{settings['mask_lr']:g}")
    if args.mask_from:
        source = os.path.basename(os.path.abspath(args.mask_from))
        parts.append(f"from-{source}-tau{settings['mask_threshold'] or 1:g}")
    return "-".join(parts)

def check_args(args, task_names):
    """Bad input as one line (exit 2), before anything is built or written: one family per command; the flags it
    takes (its preset's keys and FAMILIES' "takes") and its inits. Returns the family."""
    families = {tasks.FAMILY_OF[t] for t in task_names}
    if len(families) > 1:
        raise UsageError(f"--task: {' and '.join(sorted(families))} tasks cannot share one grid")
    family = families.pop()
    for flag, value in vars(args).items():         # a flag not every family takes: this one's?
        takers = [f for f, about in FAMILIES.items() if flag in about["presets"]["cpu"] or flag in about["takes"]]
        given = value is not None and value is not False   # None / False when not given (0 is given)
        if given and takers and family not in takers:
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
    for key in STRUCTURED_FLAGS:                # the solve's settings: every init must have that solve
        takers = ("structured-svd",) if key in SVD_FLAGS else ("structured-svd", "structured-opt")
        other = [i for i in args.init if i not in takers]
        if getattr(args, key) is not None and other:
            raise UsageError(f"--{key.replace('_', '-')} sets the {' or '.join(takers)} solve: "
                             f"--init {other[0]} has none")
    no_mask = [i for i in args.init if i not in MASK_PRIOR_INITS]
    if any(args.mask_error or ()) and no_mask:
        raise UsageError("--mask-error edits the mask prior: --init mask, mask-fixed or mask-hadamard only")
    if args.mask_lr and not set(args.init) & set(TRAINED_MASK_INITS):
        raise UsageError(f"--mask-lr: --init {' '.join(args.init)} has no trainable mask")
    if args.mask_from is not None:              # replaces a mask init's hand-made pattern
        if no_mask:
            raise UsageError(f"--mask-from: --init {no_mask[0]} has no mask prior to replace "
                             f"(mask, mask-fixed or mask-hadamard only)")
        if any(args.mask_error or ()):
            raise UsageError("--mask-from and --mask-error: a learned prior is not edited, give one of the two")
        if args.out and os.path.realpath(args.out) == os.path.realpath(args.mask_from):
            raise UsageError(f"--out {args.out} is the --mask-from folder: the run would overwrite its source")
    elif args.mask_threshold:
        raise UsageError("--mask-threshold applies with --mask-from only")
    out = args.out and pathlib.Path(args.out)   # not a file, not below one, not a link to nothing
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
    return family

def make_config(family, task, settings, args):
    """Settings: a run's config (result.json's "config"), merged once: the preset, its per-task changes, the
    flags given (--dim also sets the MLP's width and the heads' share), the run's swept settings, then derived
    keys. Checks what only the whole config can tell."""
    config = {**FAMILIES[family]["presets"][args.preset],
              **TASK_PRESETS.get((family, args.preset), {}).get(task, {})}
    if args.dim is not None and "mlp_dim" in config:   # ViT MLPs are 4 x wide, encoders 1 x
        config["mlp_dim"] = 4 * args.dim if family == "vision" else args.dim
        if "head_dim" in config:
            config["head_dim"] = None                  # dim / heads
    config.update({key: getattr(args, key) for key in config if getattr(args, key, None) is not None})
    config.update({key: getattr(args, key) for key in STRUCTURED_FLAGS if getattr(args, key, None) is not None})
    if not config.get("head_dim") and config["dim"] < config["heads"]:
        raise UsageError(f"--dim {config['dim']} leaves no width for each of {config['heads']} heads")
    magnitude = settings["mask_magnitude"] or FAMILIES[family]["magnitude"]
    config.update(preset=args.preset, mask_decay=settings["mask_decay"] or 0.0,
                  mask_error=settings["mask_error"], mask_lr=settings["mask_lr"], mask_magnitude=magnitude)
    if "block_size" in config and magnitude * config["block_size"] > FLOAT32_MAX:
        raise UsageError(f"--mask-magnitude {magnitude:g}: the GPT's bias s M reaches s x {config['block_size']}"
                         f", past float32 ({FLOAT32_MAX:.3g}): choose a smaller scale")
    config["eval_every"] = args.eval_every or FAMILIES[family]["eval_every"] or max(1, config["iters"] // 5)
    if args.mask_variant:
        if task not in maskprior.BOOLEAN_MASK_VARIANTS:
            raise UsageError(f"--mask-variant: {task} has one mask pattern only")
        config["mask_variant"] = args.mask_variant
    if "train_frac" in FAMILIES[family]["takes"]:     # one pair or more trains, one or more is held out
        fraction = settings["train_frac"] or tasks.ARITHMETIC_TRAIN_FRAC[task]   # the paper's, by default
        if fraction >= 1:
            raise UsageError(f"--train-frac must lie strictly between 0 and 1, got {fraction:g}")
        pairs, total = round(fraction * tasks.ALL_PAIRS), tasks.ALL_PAIRS
        if not 1 <= pairs < total:
            raise UsageError(f"--train-frac {fraction:g} trains on {pairs:,} of the {total:,} pairs, holds out "
                             f"{total - pairs:,}: both need one or more (from {1 / total:g} to {1 - 1 / total:g})")
        config["train_frac"] = fraction
        config["eval_size"] = None if args.eval_size == "all" else args.eval_size or 100_000
    if "image_size" in config:                     # vision: patches tile the image; a too long warmup is
        if config["image_size"] % config["patch_size"]:   # shortened; ImageNet100's lr x batch / 512
            raise UsageError(f"--image-size {config['image_size']} is not a multiple of the patch "
                             f"size {config['patch_size']}")
        if config["warmup_epochs"] >= config["epochs"]:
            config.update(warmup_shortened_from=config["warmup_epochs"], warmup_epochs=config["epochs"] - 1)
        if config["lr_base_size"]:
            config["lr"] = config["lr"] * config["batch_size"] / config["lr_base_size"]
    if args.model == "timm":                       # maskprior.ViT's configs stay as they were
        config["model"] = "timm"
    if args.mask_from is not None:                 # the source run (the hash: --resume refuses a re-trained one)
        result, attn, digest = read_source(args.mask_from)
        tau, causal = settings["mask_threshold"] or 1.0, "block_size" in config
        config.update(mask_from=os.path.normpath(args.mask_from), mask_from_sha256=digest,
                      mask_from_task=result["task"], mask_from_init=result["init"],
                      mask_from_train_frac=result["config"].get("train_frac"), mask_from_seed=result["seed"],
                      mask_threshold=tau,
                      mask_density=maskprior.open_fraction(maskprior.learned_mask(attn, 1.0, tau, causal), causal))
    return config

def train_all(args, stop):
    """One command, from its runs to its tables: every run of the command, each in its locked folder, then a
    grid's tables (the grid's folder locked too). Every run's config, data and folder are checked before the
    first one trains."""
    # -> plan (above): the flags become Runs, one per cell of the grid (the Run record, above)
    runs = plan(args)
    device, grid = runs[0].device, runs[0].grid
    root = args.out or "runs/grid"
    writer = int(os.environ.get("RANK", "0")) == 0   # torchrun: rank 0 writes
    for run in runs:
        if FAMILIES[run.family]["files"]:          # files: read (and checked) before any run starts
            load_data(run)
        check_fits(run.family, run.config)         # -> section 8, the machine's memory
        if writer:                                 # torchrun: rank 0 locks and writes, and checks
            check_folder(run.folder, run)
    if grid and writer:
        check_folder(root)
    threads, said = choose_threads(args.threads, device)
    machine = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"
    line = (f"train.py: {len(runs)} run{'s' * (len(runs) > 1)} of {' '.join(dict.fromkeys(r.task for r in runs))}"
            f" on {machine}, {said}, preset {args.preset}; results in {root if grid else runs[0].folder}")
    for data in {id(d): d for d in (load_data(r) for r in runs if FAMILIES[r.family]["files"])}.values():
        info = data.get("info", {}).get("data", {})
        if "train_images" in info:
            line += (f"; {info['train_images']:,} images to train, {info['eval_images']:,} held out, "
                     f"{len(info['classes'])} classes")
    print(line, flush=True)
    results, failed = [], 0
    with folder_lock(root) if grid and writer else contextlib.nullcontext():   # until its tables are written
        for run in runs:
            run.threads = threads
            # -> load_data (section 4) -> tasks.py's loader (majority: tasks.boolean_dataset, section 1),
            # read once per command; its fingerprint (section 8) goes into checkpoint.pt and result.json
            data = load_data(run)
            run.fingerprint = data_fingerprint(data)
            if run.resume and not grid and not os.path.isdir(run.folder):
                raise UsageError(f"--resume: no checkpoint at {run.checkpoint}: run without --resume first")
            try:
                with folder_lock(run.folder) if writer else contextlib.nullcontext():
                    result = run.resume and run.finished()   # a finished run is left as it is, every file
                    if result and not grid:
                        print(f"{run.name}: already finished, nothing to resume; {run.folder} is left as it was")
                    elif not result:                 # -> execute, section 6: the run itself
                        with subnormals_flushed(device):
                            result = execute(run, data, distributed_setup(device), stop)
            except Diverged as err:
                print(f"{run.name}: stopped, {err}; what was saved is in {run.folder}", file=sys.stderr)
                failed += 1
                result = read_result(os.path.join(run.folder, "result.json"))
            except (Interrupted, WriteError) as err:   # what to do next: read from what is on disk
                err.advice = run.kept()
                raise
            if result is not None:                 # None: a torchrun rank other than 0; rank 0 reports
                results.append(result)
        if dist.is_initialized():
            dist.destroy_process_group()
        if grid and results:
            try:
                write_tables(root, results, grid=True)
            except WriteError as err:
                err.advice = runs[-1].kept()
                raise
    return 1 if failed else 0

def write_tables(root, results, grid=False):
    """Reports (a grid's end, --summarize): table.md under root (printed too), curves.svg and the SVG figures of
    the sweeps it holds; a grid's (grid) also grid.json, its runs' result.json in one list. The last line names
    every file written."""
    text, figures = tasks.result_tables(results, list(INITS))
    files = {"grid.json": json_text(results)} if grid else {}
    files.update({"table.md": text, **figures})
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise WriteError(root, err) from None
    for name, content in files.items():
        write_atomic(os.path.join(root, name), content)
    print(f"\n{text}\nwrote {', '.join(files)} in {root}")

def summarize(root, figure=None):
    """Reports without training (--summarize DIR): the tables of every run below DIR, or with figure (--figure
    NAME FILE) that figure of them (draw_figure); a run found twice (a copied folder) counts once. Exit 1 when a
    damaged result.json was skipped, 2 when nothing could be read."""
    if not os.path.isdir(root):
        raise UsageError(f"--summarize {root}: {'not a folder' if os.path.exists(root) else 'no such folder'}")
    paths = [os.path.join(folder, "result.json") for folder, _, files in sorted(os.walk(root))
             if "result.json" in files]
    readable = [(path, r) for path in paths for r in [read_result(path)] if r is not None]
    if not readable:
        raise UsageError(f"--summarize: no readable result.json below {root}")
    first = {}                         # run -> (path, result.json) of its first copy
    for path, r in readable:
        run_id = json.dumps([r["task"], r["init"], r["seed"], r["config"], r.get("data_fingerprint")], sort_keys=True)
        if run_id in first:
            print(f"train.py: warning: {path} is the run of {first[run_id][0]} again (same task, "
                  f"init, seed, config and data): counted once", file=sys.stderr)
        first.setdefault(run_id, (path, r))
    try:
        if figure:                     # --figure NAME FILE: that figure of the runs instead of the tables
            draw_figure(*figure, [(os.path.dirname(path), r) for path, r in first.values()])
        else:
            write_tables(root, [r for _, r in first.values()])
    except WriteError as err:          # DIR itself cannot take the tables: a bad path
        raise UsageError(str(err))
    return 0 if len(readable) == len(paths) else 1

# The README's figures/ (section "Figures"): counterparts of the paper's Figures 1-11 and 14 and our studies'
# figures, each written by one command, --figure NAME FILE, from the runs below --summarize DIR or, for the first
# three, from maskprior's constructors alone: the Boolean and arithmetic patterns at the `paper` presets' layers
# and heads, and one ViT layer of 9 heads, a head per impulse offset, on a 4 x 4 patch grid for legibility:
#   masks      Figure 2, "mask patterns" of the logical and the arithmetic tasks: every layer and head, open or
#              closed
#   logits     Figure "Initial mask logits": M of the first layer, a row a task, a column a head
#   impulse    Figure "Structured initialization for vision Transformers": each head's 3 x 3 impulse filter
#              (the centre patch's row of M on a 3 x 3 grid) above its attention mask M on a 4 x 4 grid
#   attention  Figures 1 and 5, "Comparison of attention patterns before and after training": a band a run,
#              its mean attention before | after, titled with its prior mass (Section 6.1), and the change
#   bias       Figures "Learned mask" and "Relative mask bias before and after training" (the GPT's bias at
#              distance i - j lies on the (i - j)-th diagonal), figures/learned_prior.svg: a mask run's bias
#              log sigmoid(s M) before | after, and the change, on its own scale: M moves little (Theorem 1)
#   centre     Figures "Attention maps for the first validation sample": a ViT run's centre-patch maps
#   boolean    Figure 3, Boolean test loss and accuracy: a panel per task, a dot per init (tasks.figure)
#   the rest   the figures a grid writes (tasks.result_tables): curves (Figures 7, 14), data_efficiency
#              (Figure 4), mask_magnitude, imperfect_prior
# A heat map draws each row of table.md (task, init, settings) once, at its lowest seed; a label names the
# settings table.md always shows (tasks.ALWAYS_SHOWN: train frac, mask from, ...) where a run sets them.
FIGURES = ("masks", "logits", "impulse", "attention", "bias", "centre", "boolean", "curves", "data_efficiency",
           "mask_magnitude", "imperfect_prior")
MEANING = {"attention": "mean attention weight", "bias": "bias log σ(s M)", "centre": "centre patch's attention"}

def draw_figure(name, out, found=None):
    """--figure NAME FILE (FIGURES above): writes FILE from found, [(run folder, result.json)] of --summarize DIR,
    or for masks, logits and impulse from the constructors. UsageError: another NAME, or nothing to draw."""
    rows = {}                                  # table.md's rows: settings -> their runs, seeds up, with the folder
    def order(run):                            # by task, init (INITS), seed
        return list(tasks.FAMILY_OF).index(run[1]["task"]), list(INITS).index(run[1]["init"]), run[1]["seed"]
    for folder, r in sorted(found or [], key=order):
        settings = tasks.settings_of(r)
        rows.setdefault(json.dumps(settings), (settings, []))[1].append({**r, "folder": folder})
    rows, bands, svg = list(rows.values()), [], None
    # Section 4.2's patterns (Appendix "Design of Mask Pattern"), the logits M a mask run starts from, (L, H, N, N)
    boolean, arithmetic = ((p["paper"]["layers"], p["paper"]["heads"]) for p in (BOOLEAN_PRESETS, ARITHMETIC_PRESETS))
    patterns = {t: maskprior.boolean_mask(t, *boolean) for t in maskprior.BOOLEAN_MASKS}
    patterns.update({t: make(*arithmetic) for t, make in maskprior.ARITHMETIC_MASKS.items()})
    if name == "masks":                        # Figure 2: a band of the logical tasks, one of the arithmetic
        blocks = [(t, (m > 0).float(), 0, 1, "yellow: open (+A), purple: closed (-A)") for t, m in patterns.items()]
        bands = [blocks[:len(maskprior.BOOLEAN_MASKS)], blocks[len(maskprior.BOOLEAN_MASKS):]]
    if name == "logits":                       # Figure 6: the logits M each task starts from
        bands = [[(f"{t}: M, layer 1", m[:1], -m.max().item(), m.max().item(), "logit")] for t, m in patterns.items()]
    if name == "impulse":                      # Figure 9; on a 3 x 3 grid the centre patch (position 5) reads it
        filters = maskprior.impulse_mask(1, 9, 3)[:, :, 5, 1:].unflatten(-1, (3, 3))      # (1, 9, 3, 3)
        bands = [[("3 x 3 impulse filters", filters, maskprior.CLOSE, maskprior.OPEN, "yellow: the filter's 1")],
                 [("their masks M on 4 x 4 patches and CLS", maskprior.impulse_mask(1, 9, 4),   # (1, 9, 17, 17)
                   maskprior.CLOSE, maskprior.OPEN, "logit")]]
    # Figures 1 and 5 (attention), 8 and 10 (bias), 11 (centre): each run's before | after | change
    for settings, runs in rows if name in ("attention", "bias", "centre") else []:
        r, whens = runs[0], (("before", "init"), ("after", "final"))     # the lowest seed; its prior mass keys
        snaps = [torch.load(os.path.join(r["folder"], f"attention_{w}.pt"), weights_only=True) for w, _ in whens]
        maps = [(s.get("centre") or {} if name == "centre" else s).get("bias" if name == "bias" else "attn")
                for s in snaps]                # (L, H, N, N) each; a ViT's centre patch (L, H, grid, grid)
        if None in maps:                       # a run without M has no bias, a run of no ViT no centre patch
            continue
        label = " ".join([r["task"], r["init"], *(f"{c} {settings[c]}" for c in tasks.ALWAYS_SHOWN
                                                  if settings[c] not in tasks.UNSET)])
        lo, hi = min(0.0, *(m.min().item() for m in maps)), max(0.0, *(m.max().item() for m in maps))
        bands.append([(f"{label}, {w} training: prior mass {tasks.fmt(r['final'].get(f'prior_mass_{k}'), 2)}",
                       m, lo, hi, MEANING[name]) for (w, k), m in zip(whens, maps)])
        moved = max((maps[1] - maps[0]).abs().max().item(), 1e-12)   # the change, on its own range around 0
        bands[-1].append((f"{label}, after - before", maps[1] - maps[0], -moved, moved, "change, teal: none"))
    if name == "boolean":                      # Figure 3: a dot per init, a panel per task
        svg = tasks.figure([(s, runs) for s, runs in rows if runs[0]["task"] in tasks.BOOLEAN_TASKS], list(INITS),
                           "init", ["test_loss", "test_acc"], "Boolean test loss and accuracy by init")
    if name in FIGURES[7:]:                    # a grid's own charts (Figures 4, 7, 14; our studies): table.md's writer
        svg = tasks.result_tables([r for _, runs in rows for r in runs], list(INITS))[1].get(f"{name}.svg")
    notes = [f"{tasks.BLOCKS_NOTE}."] + ([tasks.CENTRE_NOTE] if name == "centre" else [])
    svg = svg or (tasks.heatmap_svg(bands, notes) if bands else None)
    if svg is None:
        raise UsageError(f"--figure {name}: nothing to draw; NAME: {', '.join(FIGURES)} (--help)")
    try:
        write_atomic(out, svg)
    except WriteError as err:                  # FILE's folder cannot take it: a bad path
        raise UsageError(str(err)) from None
    print(f"wrote {out}")

def main(argv=None):
    """The entry point (python train.py ...; the path of one run starts here) and its exit codes: 0; 1 when a
    run diverged or a write failed mid-run; 2 for bad input or an output folder that cannot be made, written or
    locked; 130 / 143 on SIGINT / SIGTERM; each failure one line on stderr."""
    stop = Stop()
    tasks.forget_data()                                # each command reads its files afresh
    if hasattr(sys.stdout, "reconfigure"):             # a path that is not UTF-8 prints, escaped
        sys.stdout.reconfigure(errors="backslashreplace")
    threads = torch.get_num_threads()                  # put back at the end (in-process callers)
    handlers = {}
    if threading.current_thread() is threading.main_thread():   # only it may set signal handlers
        handlers = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    # -> train_all (above), where the path of one run goes on; the module docstring follows it to the end.
    args = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.summarize or args.figure:
            # The tables and figures are of the runs DIR holds, as they were trained, or (--figure alone) of the
            # constructors: a flag of what to train would be ignored.
            given = [key for key, value in vars(args).items()
                     if key not in ("summarize", "figure") and value != parser.get_default(key)]
            if given:
                said = "its tables are of the runs DIR holds, as they were trained" if args.summarize else \
                    "it draws the mask constructors' patterns"
                raise UsageError(f"{'--summarize' if args.summarize else '--figure'} takes no other flag "
                                 f"(--{given[0].replace('_', '-')} given): {said}")
            if not args.summarize:                     # the constructors' figures: no run to read
                return draw_figure(*args.figure) or 0
            return summarize(args.summarize, args.figure)
        return train_all(args, stop)
    except (UsageError, tasks.DataError) as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:
        message = str(err)
        if args is not None and args.summarize:
            message = f"interrupted while summarizing {args.summarize}; its tables are as they were"
        if int(os.environ.get("RANK", "0")) == 0:      # torchrun: every rank stops, rank 0 says so
            print(f"train.py: {message}", file=sys.stderr)
        return 128 + err.signum
    except WriteError as err:   # before any training (e.g. a full disk at the start): bad output, 2
        print(f"train.py: error: {err}; {err.advice}", file=sys.stderr)
        return 1 if stop.trained else 2
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        torch.set_num_threads(threads)

# === 8. The machinery: what makes a run safe to stop, resume, compare and share ====================
# --- Errors: each is one line on stderr (main) ------------------------------------------------------
class UsageError(Exception):
    """Errors: bad input from the user (a flag, a folder, data): one line on stderr, exit code 2."""

class Diverged(Exception):
    """Errors: the training loss became NaN or infinite (the loop's check, on any rank): result.json says
    "diverged", a grid goes on with its next run, the command exits 1."""

class WriteError(Exception):
    """Errors, atomic writes: a file the run could not write (disk full, read-only, ...): the path and the OS's
    reason; exit 1. advice: what is kept on disk, and what to do (kept())."""
    def __init__(self, path, err):
        super().__init__(f"cannot write {path}: {err.strerror or err}")
        self.advice = "no checkpoint was written, nothing to resume: rerun without --resume"

class Interrupted(BaseException):
    """Signals: SIGINT / SIGTERM; main exits 128 + its number with one line; a BaseException, so no `except
    Exception` eats it. at: where the run was ("epoch 3 (step 34)"); advice: what is kept (kept())."""
    def __init__(self, signum, at=None):
        super().__init__(signum)
        self.signum, self.at = signum, at
        self.advice = "no checkpoint was written, nothing to resume: rerun without --resume"

    def __str__(self):
        where = f"at {self.at}" if self.at else "before training started"
        return f"interrupted {where}; {self.advice}"

class Stop:
    """Signals: the SIGINT / SIGTERM handler. While a run trains, a first signal only sets `signal` (the loop
    checkpoints its step, then stops); else, or at a second one, Interrupted is raised at once."""
    def __init__(self):
        self.pid, self.signal, self.training = os.getpid(), None, False
        self.trained = False          # a run of this command began training (a failed write: exit 1)

    def __call__(self, signum, frame):
        if os.getpid() != self.pid:   # a DataLoader worker forked from us: as without this handler
            if signum == signal.SIGINT:
                raise KeyboardInterrupt     # on which torch's worker loop ends quietly
            os._exit(128 + signum)
        if self.training and self.signal is None:
            self.signal = signum
        else:
            raise Interrupted(signum)

# --- Files: written atomically, strict JSON, read back with their fields checked --------------------
def write_atomic(path, data):
    """Atomic writes: bytes or text to path via a temporary file, fsync, rename: never half a file, even
    when the process is killed mid-write; OSError -> WriteError."""
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
    """Strict JSON (result.json, grid.json), which has no Infinity or NaN: (obj with every NaN or infinite float
    replaced by None, {where: "inf", ...} of those replaced)."""
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

def json_text(obj):
    """Strict JSON: the text of result.json and grid.json (JSON has no Infinity or NaN)."""
    return json.dumps(finite(obj)[0], indent=2, allow_nan=False) + "\n"

def save_checkpoint(path, state):
    """Atomic writes: torch.save through write_atomic, never half a checkpoint.pt or attention_*.pt."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getvalue())

def read_result(path, warn=True):
    """Reading results back (--summarize, --resume, --mask-from): a result.json as a dict, or None (with a
    warning naming it and the field, if warn) if it is damaged or hand-edited into something the tables cannot
    read."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        if not isinstance(result, dict):
            raise ValueError("not a JSON object")
        # ValueError naming the first field that the tables could not read
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
        for key in tasks.LABELS if done else ():     # a table's numbers: a number, inf or NaN, or null
            checks.append((f"final.{key}", numbers.get(key) is None or number(numbers[key], False), "a number"))
        for name, fine, expected in checks:
            if not fine:
                value = result
                for part in name.split("."):
                    value = value[part]
                raise ValueError(f"field {name} is {json.dumps(value)[:40]}, not {expected}")
        if result["status"] == "done":
            tasks.summary_line(result)           # the fields a table reads are all there
            tasks.settings_of(result)
        return result
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        if warn:
            print(f"train.py: warning: skipped {path}: damaged or not a result of train.py ({err})", file=sys.stderr)
        return None

# --- One writer per folder: the lock, and what a folder may already hold ----------------------------
# The folder lock and a run's last line: the files a run writes in its folder.
RUN_FILES = ("result.json", "checkpoint.pt", "attention_before.pt", "attention_after.pt", "attention.svg")

@contextlib.contextmanager
def folder_lock(folder):
    """The folder lock: one writer per run folder, a flock on folder/.lock (holding the pid; the OS drops it
    when the process ends, kill -9 too); else UsageError. Once locked, the temporary files of a writer killed
    mid-write (write_atomic's <name>.tmp<pid>) are removed. At the end .lock goes, and the folder if the lock
    made it and it stayed empty."""
    path, fd, made = os.path.join(folder, ".lock"), None, not os.path.isdir(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        while fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:       # another process holds it: name its pid
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                raise UsageError(f"{folder} is in use by another train.py run (pid {holder}): wait for it to end, "
                                 f"or choose another --out") from None
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

def check_folder(folder, run=None):
    """The folder lock, checked before anything is written: one run per folder. UsageError when a live run holds
    folder's lock (probed, not taken), or folder holds another thing: for a grid's root (run None) a run's
    files; for a run a grid, or another run's files (with --resume: files but its checkpoint or this finished
    run)."""
    with contextlib.suppress(OSError):  # no lock file (OSError on open): no run holds the folder
        fd = os.open(os.path.join(folder, ".lock"), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            raise UsageError(f"{folder} is in use by another train.py run (pid {holder}): wait for it to end, "
                             f"or choose another --out") from None
        finally:
            os.close(fd)
    found = [name for name in RUN_FILES if os.path.isfile(os.path.join(folder, name))]
    if run is None:
        if found:
            raise UsageError(f"--out {folder} holds a run ({', '.join(found)}), not a grid: choose another "
                             f"--out for the grid")
        return
    runs = []                           # run folders directly below: folder is a grid's root
    if os.path.isdir(folder):
        runs = sorted(e.name for e in os.scandir(folder)
                      if e.is_dir() and any(os.path.isfile(os.path.join(e.path, n)) for n in RUN_FILES))
    grid_files = [n for n in ("grid.json", "table.md") if os.path.isfile(os.path.join(folder, n))]
    # table.md beside a run's own files is that run's --summarize, not a grid: the run's folder stays its own.
    if not run.grid and (runs or grid_files and not found):
        example = f", e.g. --out {os.path.join(folder, runs[0])}" if runs else ""
        raise UsageError(f"--out {folder} holds a grid: continue the grid with its own command (its --task, "
                         f"--init, --seeds), or name one run's folder{example}")
    if not found or run.resume and ("checkpoint.pt" in found or run.finished()):
        return                        # --resume checks the checkpoint's config and data at its turn
    raise UsageError(f"--out {folder} already holds a run ({', '.join(found)}): choose another --out"
                     f"{'' if run.resume else ', or add --resume to continue or keep it'}")

# --- Checkpoints and --resume: the same flags, the same data, or one line ---------------------------
def resume_from(checkpoint, meta, exp, place):
    """Resume: checkpoint.pt loaded into exp after checking it is this run's (flags and data); returns its state
    (a round a signal cut in state["partial"], this rank's part of it)."""
    saved = load_checkpoint(checkpoint, meta)
    exp.model.load_state_dict(saved["model"])
    exp.optimizer.load_state_dict(saved["optimizer"])
    exp.schedule.load_state_dict(saved["schedule"])
    set_rng_states(exp, place.device, saved["rng"][place.rank])
    state, cut = saved["state"], saved.get("partial")
    if cut:
        state["partial"] = {"round": cut["round"], "done": cut["done"], **cut["ranks"][place.rank]}
    return state

def load_checkpoint(path, meta=None):
    """Resume, and what a stopped run keeps (Run.kept): the checkpoint at path, or UsageError: missing,
    unreadable, not train.py's, or (given the meta of this run) another run's: other flags, or other data."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise UsageError(f"--resume: no checkpoint at {path}: run without --resume first")
    except Exception as err:
        raise UsageError(f"--resume: {path} is damaged or not a checkpoint ({type(err).__name__}"
                         f"): delete it, or use another --out")
    if not isinstance(saved, dict) or not {"meta", "model", "state"} <= set(saved):
        raise UsageError(f"--resume: {path} is not a checkpoint written by train.py")
    if meta is None:
        return saved
    theirs = {**saved["meta"], **saved["meta"]["config"]}
    for key, value in {**meta, **meta["config"]}.items():
        if key not in ("config", "data_fingerprint") and theirs.get(key) != value:
            raise UsageError(f"--resume: {path} was written by a run with {key} {theirs.get(key)!r}, "
                             f"this run has {value!r}: use the same flags, or another --out")
    # The data: UsageError naming the first part that differs ("valid.txt differs", "3 images added under
    # train/cat", "--bpe-file: none before, one now"); a checkpoint with no fingerprint at all: a note.
    theirs, ours = saved["meta"].get("data_fingerprint"), meta.get("data_fingerprint")
    if ours is None:
        return saved
    if theirs is None:
        print(f"train.py: note: {path} records no fingerprint of its data; the data is not checked", file=sys.stderr)
        return saved
    for key in sorted(set(theirs) | set(ours)):
        before, now = theirs.get(key), ours.get(key)
        if before == now:
            continue
        if before is None or now is None:
            difference = f"{key}: {'none before, one now' if before is None else 'there before, none now'}"
        elif isinstance(before, dict) and isinstance(now, dict) and before["files"] != now["files"]:
            change = "added" if now["files"] > before["files"] else "removed"
            difference = f"{abs(now['files'] - before['files'])} images {change} under {key}"
        else:
            difference = f"{key} differs"
        raise UsageError(f"--resume: {path} was written by a run on other data: {difference}: use the "
                         f"same data, or another --out")
    return saved

# --- Fingerprints of a run's data (checkpoint.pt and result.json): --resume refuses other data,
# --summarize never averages over two. Generated data (Boolean, arithmetic) by its tensors; files by
# their content and their paths relative to the data folder (a copy elsewhere, or a touched file, is the
# same data). tasks.py's loaders name what they read in data["sources"].
def data_fingerprint(data):
    """Data fingerprints: {part of the data: its digest}: {"train set": "sha256 ..."} of generated tensors; of
    files "sha256 ..." for one, {"files": 12, "bytes": 3456, "sha256": ...} for a list, None for none (no
    --bpe-file)."""
    if "sources" not in data:           # Boolean, arithmetic
        parts = {"train set": "train", "eval set": "eval"}
        return {name: digest_of(data[f"x_{part}"], data[f"y_{part}"]) for name, part in parts.items()
                if f"x_{part}" in data}
    fingerprint = {}
    for name, source in data["sources"].items():
        if source is None:
            fingerprint[name] = None
        elif isinstance(source, (str, torch.Tensor)):
            fingerprint[name] = digest_of(source)
        else:                           # a list of files below the data folder
            listing = hashlib.sha256()
            for path in source:
                listing.update(os.fsencode(os.path.relpath(path, data["root"])) + f"\t{digest_of(path)}\n".encode())
            fingerprint[name] = {"files": len(source), "bytes": sum(map(os.path.getsize, source)),
                                 "sha256": listing.hexdigest()}
    return fingerprint

def digest_of(*sources):
    """Data fingerprints: "sha256 <hex>" of tensors (their dtypes, shapes and bytes) or of one file's content
    (read in 1 MiB pieces: a corpus can be gigabytes)."""
    digest = hashlib.sha256()
    for source in sources:
        if isinstance(source, str):
            with open(source, "rb") as f:
                for piece in iter(lambda: f.read(1 << 20), b""):
                    digest.update(piece)
            continue
        t = source.detach().cpu().contiguous()   # kept alive while its memory is read below
        digest.update(f"{t.dtype} {tuple(t.shape)};".encode())
        digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return f"sha256 {digest.hexdigest()}"

# --- Random streams: every one a step draws from, kept by checkpoints --------------------------------
def rng_states(exp, device):
    """Resume, exactly (checkpoints keep them): every random stream a step draws from: torch's CPU one, exp's
    generators, CUDA's (dropout)."""
    states = [torch.get_rng_state(), *[g.get_state() for g in exp.generators]]
    return states + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])

def set_rng_states(exp, device, states):
    """Resume, exactly: the streams rng_states took put back, in its order (CUDA's on a CUDA run only)."""
    torch.set_rng_state(states[0])
    for generator, state in zip(exp.generators, states[1:]):
        generator.set_state(state)
    if device.type == "cuda" and len(states) > 1 + len(exp.generators):
        torch.cuda.set_rng_state(states[-1], device)

# --- torchrun: one process per GPU (or CPU process, gloo), gradients averaged by DDP ----------------
# torchrun: where a process trains, its device, rank and the number of ranks ((device, 0, 1) alone).
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

def gather(obj, world):
    """torchrun: every rank's obj as a list indexed by rank ([obj] without torchrun)."""
    out = [obj] * world
    if world > 1:
        dist.all_gather_object(out, obj)
    return out

def agreed(values, world, device):
    """torchrun: each value's maximum over the ranks: all ranks raise Diverged, or stop, at once."""
    if world == 1:
        return values
    flags = torch.tensor([float(v) for v in values], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [int(v) for v in flags.tolist()]

# --- The machine: device, threads, subnormal floats, memory ------------------------------------------
def resolve_device(name):
    """The machine (--device): auto is CUDA when there is one; a device this machine lacks is one line."""
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

def choose_threads(given, device):
    """The machine, threads on a shared machine: (torch CPU threads for new runs, how the first line says it):
    --threads, else the cores no other job keeps busy, at least one: torch's threads spin against other jobs,
    and a run at the default count on a busy machine can take many times as long."""
    if given:
        return given, f"{given} thread{'s' * (given > 1)} (--threads)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # The cores other jobs use now: /proc/stat's busy time over half a second (Linux); elsewhere the
    # 1-minute load average, which lags (just after a job ends it still counts it).
    try:
        readings = []
        for pause in (0.5, 0):
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            readings.append((sum(fields), fields[3] + fields[4]))          # all, idle + iowait
            time.sleep(pause)
        (total, idle), (total2, idle2) = readings
        busy = cores * (1 - (idle2 - idle) / max(total2 - total, 1))
    except (OSError, ValueError, IndexError):
        busy = os.getloadavg()[0]
    threads = max(1, min(torch.get_num_threads(), round(cores - busy)))
    return threads, f"{threads} thread{'s' * (threads > 1)} ({cores} cores, {busy:.1f} busy)"

@contextlib.contextmanager
def subnormals_flushed(device):
    """The machine, speed on the CPU: floats below 1.2e-38 read as zero while a run trains: attention where M
    shuts pairs, and its gradients, are such subnormals, many times slower on x86 (tests/bench_denormal.py)."""
    was_on = (torch.tensor([torch.finfo(torch.float32).tiny]) / 4).item() == 0   # torch has no getter
    torch.set_flush_denormal(was_on or device.type == "cpu")
    try:
        yield
    finally:
        torch.set_flush_denormal(was_on)

def check_fits(family, config):
    """The machine, memory: refuse, before allocating, a model whose weights, Adam state and attention maps
    exceed the RAM."""
    L, H, D, B = (config[key] for key in ("layers", "heads", "dim", "batch_size"))
    longest_sum = 2 * tasks.OPERAND_DIGITS + max(tasks.ARITHMETIC_TASKS.values())   # operands, answer slots
    N = {"boolean": tasks.BOOLEAN_DIM + 1, "arithmetic": longest_sum, "language": config.get("block_size"),
         "vision": (config.get("image_size", 0) // config.get("patch_size", 1)) ** 2 + 1}[family]
    per_example = 4 * 3 * L * H * N * N   # bytes of one example's attention maps, kept for the backward
    weights, maps = 4 * 4 * 12 * L * D * D, per_example * max(B, 64)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if weights + maps > have:   # name the flag to change: width, input length, or else the batch
        inputs = {"language": f"--block-size {N}", "vision": f"--image-size {config.get('image_size')}"}
        if weights > maps:
            flag = f"--dim {D}"
        elif weights + per_example * 64 > have:
            flag = inputs.get(family, f"--layers {L}")
        else:
            flag = f"--batch-size {B}"
        raise UsageError(f"{flag}: {L} layers x {H} heads x {N} x {N} attention maps at width {D} need "
                         f"about {(weights + maps) / 2**30:.0f} GiB, this machine has "
                         f"{have / 2**30:.0f} GiB: choose a smaller model, batch or input")

# --- Flag types: one line for a bad value, never a traceback ----------------------------------------
class Parser(argparse.ArgumentParser):
    """Flags: argparse whose errors are one line (UsageError, exit 2)."""
    def error(self, message):  # argparse prints the whole usage block; one line is enough
        raise UsageError(message)

# Flags: the largest value a float setting may take (number, make_config).
FLOAT32_MAX = torch.finfo(torch.float32).max     # 3.4e38: a setting past it is inf inside the model

def number(kind, strict=True, words=()):
    """Flags, one line for a bad value: the argparse type kind(text) > 0 (>= 0 when not strict), finite in
    float32 (a whole number below 2^63), or one of words (--eval-size all)."""
    def parse(text):
        if text in words:
            return text
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
