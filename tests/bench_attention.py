"""Benchmark: forward + backward time of the learnable-mask block over the vanilla block.

    python tests/bench_attention.py [--repeats 7] [--steps 20] [--threads N]

Not collected by pytest (the name does not start with test_). For each shape it builds a
MaskedSelfAttention with mode="learnable" (mask initialised from a pattern) and one with
mode="none" holding the same weights, then times `steps` forward+backward passes of each,
alternating the two `repeats` times, and prints the median time of each and their ratio.
The issue asks for a ratio of at most 1.10.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior  # noqa: E402

# (name, batch, tokens N, width, heads): the Boolean cpu and paper presets (N = 16, CLS + 15 bits)
# and a ViT-Tiny-sized sequence (N = 197 = 14 x 14 patches + CLS, width 192, 3 heads).
SHAPES = [
    ("boolean cpu preset", 256, 16, 64, 3),
    ("boolean paper preset", 256, 16, 256, 3),
    ("vit-tiny N=197", 32, 197, 192, 3),
]


def time_steps(module, x, steps):
    start = time.perf_counter()
    for _ in range(steps):
        module(x).square().mean().backward()
    return (time.perf_counter() - start) / steps


def bench(batch, n, dim, heads, repeats, steps):
    torch.manual_seed(0)
    pattern = torch.where(torch.rand(heads, n, n) < 0.2, maskprior.OPEN, maskprior.CLOSE)
    masked = maskprior.MaskedSelfAttention(dim, heads, n, mask_init=pattern, mode="learnable")
    vanilla = maskprior.MaskedSelfAttention(dim, heads, n, mode="none")
    vanilla.load_state_dict({k: v for k, v in masked.state_dict().items() if k != "mask"})
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
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} x {args.steps} forward+backward steps")
    print("| shape | batch x N x width, heads | mask (ms) | vanilla (ms) | ratio |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for name, batch, n, dim, heads in SHAPES:
        t_mask, t_vanilla = bench(batch, n, dim, heads, args.repeats, args.steps)
        worst = max(worst, t_mask / t_vanilla)
        print(f"| {name} | {batch} x {n} x {dim}, {heads} | {1e3 * t_mask:.2f} | "
              f"{1e3 * t_vanilla:.2f} | {t_mask / t_vanilla:.3f} |", flush=True)
    print(f"worst ratio {worst:.3f} ({'within' if worst <= 1.10 else 'ABOVE'} the 1.10 budget)")


if __name__ == "__main__":
    main()
