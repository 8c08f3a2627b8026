"""Benchmark: forward + backward time of the learnable-mask block over the vanilla block.

    python tests/bench_attention.py [--repeats 7] [--steps 20] [--threads N]

Not collected by pytest (the name does not start with test_). For each shape it builds a
MaskedSelfAttention with mode="learnable" (mask initialised from a pattern) and one with
mode="none" holding the same weights, then times `steps` forward+backward passes of each,
alternating the two `repeats` times, and prints the median time of each and their ratio.
The issue asks for a ratio of at most 1.10. Both the attention module alone and the whole
pre-LN block (attention + MLP) are timed.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior  # noqa: E402

# (name, batch, tokens N, width, heads, MLP width): the Boolean cpu and paper presets (N = 16,
# CLS + 15 bits) and a ViT-Tiny-sized sequence (N = 197 = 14 x 14 patches + CLS, width 192,
# 3 heads, MLP 768).
SHAPES = [
    ("boolean cpu preset", 256, 16, 64, 3, 64),
    ("boolean paper preset", 256, 16, 256, 3, 256),
    ("vit-tiny N=197", 32, 197, 192, 3, 768),
]


def time_steps(module, x, steps):
    start = time.perf_counter()
    for _ in range(steps):
        y = module(x)
        if isinstance(y, tuple):         # a Block returns (x, attention or None)
            y = y[0]
        y.square().mean().backward()
    return (time.perf_counter() - start) / steps


def build(kind, mode, n, dim, heads, mlp, pattern):
    """The attention module alone, or a whole pre-LN Transformer block (attention + MLP)."""
    if kind == "attention":
        return maskprior.MaskedSelfAttention(dim, heads, n, mask_init=pattern, mode=mode)
    return maskprior.Block(dim, heads, n, mlp, mask_init=pattern, mode=mode)


def bench(kind, batch, n, dim, heads, mlp, repeats, steps):
    torch.manual_seed(0)
    pattern = torch.where(torch.rand(heads, n, n) < 0.2, maskprior.OPEN, maskprior.CLOSE)
    masked = build(kind, "learnable", n, dim, heads, mlp, pattern)
    vanilla = build(kind, "none", n, dim, heads, mlp, None)
    vanilla.load_state_dict({k: v for k, v in masked.state_dict().items() if not k.endswith("mask")})
    x = torch.randn(batch, n, dim, requires_grad=True)
    for module in (masked, vanilla):  # warm-up
        time_steps(module, x, 3)
    times = {"mask": [], "vanilla": []}
    for _ in range(repeats):
        times["mask"].append(time_steps(masked, x, steps))
        times["vanilla"].append(time_steps(vanilla, x, steps))
    return statistics.median(times["mask"]), statistics.median(times["vanilla"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} x {args.steps} forward+backward steps")
    print("| module | shape | batch x N x width, heads | mask (ms) | vanilla (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for kind in ("attention", "block"):
        worst = 0.0
        for name, batch, n, dim, heads, mlp in SHAPES:
            t_mask, t_vanilla = bench(kind, batch, n, dim, heads, mlp, args.repeats, args.steps)
            worst = max(worst, t_mask / t_vanilla)
            print(f"| {kind} | {name} | {batch} x {n} x {dim}, {heads} | {1e3 * t_mask:.2f} | "
                  f"{1e3 * t_vanilla:.2f} | {t_mask / t_vanilla:.3f} |", flush=True)
        summary.append(f"{kind}: worst ratio {worst:.3f} "
                       f"({'within' if worst <= 1.10 else 'ABOVE'} the 1.10 budget)")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
