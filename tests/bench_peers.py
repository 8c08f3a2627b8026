"""Benchmark: a full training step (forward, backward, optimizer) of our models beside the
same-size vanilla model of the library each experiment family comes from.

    python tests/bench_peers.py [--repeats 21] [--steps 5] [--threads 2] [--only boolean|vit|gpt]
                               [--hf-attn default|sdpa|eager] [--sdpa-cpu-min-tokens N]

Not collected by pytest (the name does not start with test_). Needs the peers of
tests/requirements-bench.txt (vit-pytorch, timm, transformers), never the project itself.

  boolean  maskprior.Transformer (default = mode "none"; mask = mode "learnable" with
           boolean_mask("majority", ...)) against vit-pytorch's vit_pytorch.vit.Transformer with the
           same embedding, CLS token, positions and LayerNorm + Linear readout on CLS (the GOTU
           code's TokenTransformer), dim_head = our head size; batch 256, N = 16 (CLS + 15 bits),
           4 layers, 3 heads, scalar output, MSE, Adam lr 1e-3. Two widths: the cpu preset (64,
           heads of 21, MLP 64) and the paper's (256, heads of 64, MLP 256).
  vit      maskprior.ViT (default; mask = impulse_mask, mode "learnable") against timm's
           VisionTransformer at the vision cpu preset: 32 x 32 images, patch 4 (N = 65), width 96,
           depth 6, 3 heads, MLP 384, qkv_bias, 10 classes, CLS readout, drop path 0 on both,
           batch 128, cross-entropy, AdamW lr 1e-3, weight decay 0.05.
  gpt      maskprior.GPT (default; mask = relative_distance_mask, mode "learnable") against
           Hugging Face's GPT2LMHeadModel at the language cpu preset: vocab 256, block 64, width
           128, 4 layers, 4 heads, dropout 0 on both, batch 32, next-token cross-entropy, AdamW
           lr 1e-3, weight decay 0.01. --hf-attn picks GPT-2's attention (its default is "sdpa").

Every model of a group is built once and warmed up; then each round times `steps` training
steps of every model, side by side (the starting model rotating each round), `repeats` rounds in
one process. The table gives each model's median ms per step and, for each of ours, the median
of the per-round ratios ours / peer with its quartiles in brackets (below 1 = ours faster): the
ratios are paired within a round, so the machine's slow drifts in speed (here up to 30 % between
runs minutes apart) cancel out of them. Rounds during which other processes used the machine
(more than --max-other cores, read from /proc) are dropped; the last column says how many of the
rounds taken were clean. If fewer than 3 were, every round counts.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior  # noqa: E402
from bench_util import clean_rounds  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Boolean: the GOTU code's TokenTransformer on vit-pytorch's Transformer
# ---------------------------------------------------------------------------------------------

class VitPytorchEncoder(nn.Module):
    """nn.Embedding(2, dim), CLS, learned positions, vit_pytorch.vit.Transformer, LN + Linear on
    CLS: the GOTU code's TokenTransformer."""

    def __init__(self, seq_len, dim, depth, heads, dim_head, mlp_dim, out_dim=1):
        super().__init__()
        from vit_pytorch.vit import Transformer
        self.embed = nn.Embedding(2, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(0.02 * torch.randn(1, seq_len, dim))
        self.transformer = Transformer(dim, depth, heads, dim_head, mlp_dim)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, out_dim))

    def forward(self, tokens):
        x = self.embed(tokens)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos
        return self.head(self.transformer(x)[:, 0])


def boolean_group(width):
    """(name, {label: (model, step data, loss fn, optimizer)}) at the cpu or paper width."""
    batch, bits, depth, heads = 256, 15, 4, 3
    dim, head_dim, mlp = (64, None, 64) if width == "cpu" else (256, 64, 256)
    dim_head = head_dim or dim // heads
    n = bits + 1
    tokens = torch.randint(0, 2, (batch, bits))
    target = torch.randn(batch)
    masks = maskprior.boolean_mask("majority", depth, heads)

    def ours(mode):
        return maskprior.Transformer(2, n, dim, depth, heads, mlp, 1, head_dim=head_dim,
                                     masks=masks if mode == "learnable" else None, mode=mode)

    def loss(model):
        return F.mse_loss(model(tokens).squeeze(-1), target)

    models = {"peer": VitPytorchEncoder(n, dim, depth, heads, dim_head, mlp),
              "ours default": ours("none"), "ours mask": ours("learnable")}
    runs = {k: (m, loss, torch.optim.Adam(m.parameters(), lr=1e-3)) for k, m in models.items()}
    name = (f"boolean {width}: B {batch}, N {n}, width {dim}, {depth} x {heads} heads of "
            f"{dim_head}, MLP {mlp}")
    return name, "vit-pytorch Transformer", runs


# ---------------------------------------------------------------------------------------------
# Vision: timm's VisionTransformer
# ---------------------------------------------------------------------------------------------

def vit_group():
    batch, image, patch, dim, depth, heads, mlp, classes = 128, 32, 4, 96, 6, 3, 384, 10
    from timm.models.vision_transformer import VisionTransformer
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))
    grid = image // patch
    masks = maskprior.impulse_mask(depth, heads, grid)

    def ours(mode):
        return maskprior.ViT(image, patch, classes, dim, depth, heads, mlp,
                             masks=masks if mode == "learnable" else None, mode=mode)

    def loss(model):
        return F.cross_entropy(model(images), labels)

    peer = VisionTransformer(img_size=image, patch_size=patch, num_classes=classes, embed_dim=dim,
                             depth=depth, num_heads=heads, mlp_ratio=mlp / dim, qkv_bias=True,
                             drop_path_rate=0.0, global_pool="token")
    fused = peer.blocks[0].attn.fused_attn
    models = {"peer": peer, "ours default": ours("none"), "ours mask": ours("learnable")}
    runs = {k: (m, loss, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05))
            for k, m in models.items()}
    name = (f"vit cpu: B {batch}, {image}px patch {patch} (N {grid * grid + 1}), width {dim}, "
            f"{depth} x {heads} heads of {dim // heads}, MLP {mlp}")
    return name, f"timm VisionTransformer ({'SDPA' if fused else 'written-out'} attention)", runs


# ---------------------------------------------------------------------------------------------
# Language: Hugging Face's GPT-2
# ---------------------------------------------------------------------------------------------

def gpt_group(hf_attn):
    batch, block, vocab, dim, depth, heads = 32, 64, 256, 128, 4, 4
    from transformers import GPT2Config, GPT2LMHeadModel
    data = torch.randint(0, vocab, (batch, block + 1))
    x, y = data[:, :-1], data[:, 1:]
    masks = maskprior.relative_distance_mask(heads, block).expand(depth, -1, -1, -1)

    def ours(mode):
        return maskprior.GPT(vocab, block, dim, depth, heads, dropout=0.0, mode=mode,
                             masks=masks if mode == "learnable" else None)

    def loss_ours(model):
        return model(x, y)[1]

    def loss_hf(model):
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    config = GPT2Config(n_embd=dim, n_layer=depth, n_head=heads, n_positions=block,
                        vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    kwargs = {} if hf_attn == "default" else {"attn_implementation": hf_attn}
    peer = GPT2LMHeadModel(config, **kwargs) if kwargs else GPT2LMHeadModel(config)
    if kwargs:   # older transformers take attn_implementation only through from_config
        peer.config._attn_implementation = hf_attn
    impl = peer.config._attn_implementation
    models = {"peer": peer, "ours default": ours("none"), "ours mask": ours("learnable")}
    runs = {k: (m, loss_hf if k == "peer" else loss_ours,
                torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01))
            for k, m in models.items()}
    name = (f"gpt cpu: B {batch}, block {block}, vocab {vocab}, width {dim}, {depth} x {heads} "
            f"heads of {dim // heads}, MLP {4 * dim}")
    return name, f"HF GPT2LMHeadModel (attn_implementation={impl!r})", runs


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def train_steps(model, loss_fn, optimizer, steps):
    """Seconds per step over `steps` full training steps."""
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model).backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def quartiles(values):
    """(lower quartile, median, upper quartile) of a list of numbers."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def bench(runs, repeats, steps, max_other=0.15, max_rounds=None, warmup=3):
    """Time `repeats` rounds of `steps` steps of each run, the runs side by side in each round
    (bench_util.clean_rounds; only rounds during which other processes used at most max_other
    cores count, unless fewer than 3 were clean). Returns ({label: median seconds per step},
    {label: quartiles of the paired ratio label / peer over the rounds}, clean rounds, rounds)."""
    for label in runs:
        train_steps(*runs[label], warmup)
    fns = {label: (lambda run=run: train_steps(*run, steps)) for label, run in runs.items()}
    clean, every = clean_rounds(fns, repeats, max_other, max_rounds)
    rounds = clean if len(clean) >= min(3, repeats) else every
    seconds = {label: statistics.median(r[label] for r in rounds) / steps for label in runs}
    ratios = {label: quartiles([r[label] / r["peer"] for r in rounds])
              for label in runs if label != "peer"}
    return seconds, ratios, len(clean), len(every)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=["boolean", "vit", "gpt"])
    p.add_argument("--max-other", type=float, default=0.15,
                   help="count only samples during which other processes used at most this many "
                        "cores (Linux /proc; 2 or more: count every sample)")
    p.add_argument("--max-rounds", type=int,
                   help="give up on clean samples after this many rounds (default 10 x repeats)")
    p.add_argument("--sdpa-cpu-min-tokens", type=int,
                   help="override MaskedSelfAttention.sdpa_cpu_min_tokens (0: SDPA's fused CPU "
                        "kernel wherever it runs), to see the rule's effect on a whole step")
    p.add_argument("--hf-attn", choices=["default", "sdpa", "eager"], default="default",
                   help="GPT-2's attn_implementation (default: the library's default, sdpa)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.sdpa_cpu_min_tokens is not None:
        maskprior.MaskedSelfAttention.sdpa_cpu_min_tokens = args.sdpa_cpu_min_tokens
    builders = {"boolean": [lambda: boolean_group("cpu"), lambda: boolean_group("paper")],
                "vit": [vit_group], "gpt": [lambda: gpt_group(args.hf_attn)]}
    families = [args.only] if args.only else list(builders)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"load average {load[0]:.2f} at start; {args.repeats} rounds of {args.steps} training "
          f"steps per model, side by side; SDPA on the CPU from N = "
          f"{maskprior.MaskedSelfAttention.sdpa_cpu_min_tokens}")
    print("| shape | peer | peer (ms) | ours default (ms) | ours mask (ms) | default / peer "
          "| mask / peer | clean / all rounds |")
    print("|---|---|---|---|---|---|---|---|")
    for family in families:
        for build in builders[family]:
            torch.manual_seed(0)
            name, peer_name, runs = build()
            seconds, ratios, clean, rounds = bench(runs, args.repeats, args.steps, args.max_other,
                                                   args.max_rounds)
            ms = {label: f"{1e3 * sec:.1f}" for label, sec in seconds.items()}
            ratio = {label: f"{q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f})" for label, q in ratios.items()}
            print(f"| {name} | {peer_name} | {ms['peer']} | {ms['ours default']} "
                  f"| {ms['ours mask']} | {ratio['ours default']} | {ratio['ours mask']} "
                  f"| {clean} / {rounds} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
