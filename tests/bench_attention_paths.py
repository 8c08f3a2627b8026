"""Benchmark: where F.scaled_dot_product_attention (SDPA) beats the written-out softmax path of
MaskedSelfAttention on this machine: the sweep behind the rule in MaskedSelfAttention.forward (sdpa_cpu_min_tokens).

    python tests/bench_attention_paths.py [--threads 1 2] [--repeats 5] [--sample-seconds 0.25]
                                          [--tokens 4096] [--lengths 8 16 ...] [--head-dims 21 32 64]

Not collected by pytest (the name does not start with test_). For each sequence length N, head
size d (3 heads, width 3 d) and kind of attention it times forward + backward of one
MaskedSelfAttention (batch = tokens // N, so every row holds about the same work), once forced
onto SDPA and once onto the plain path, alternating, and prints the best time of each over
`repeats` clean samples (samples during which other processes used the machine are dropped, see
bench_util.py; the best, not the median, since interference only ever adds time) and the ratio
SDPA / plain (above 1: plain is faster). Kinds:
  none       vanilla attention: SDPA's fused CPU kernel
  fixed      a mask without gradient (mode "fixed"): the fused kernel with a float attn_mask
  learnable  the trained mask: the mask needs a gradient, so SDPA runs its math kernel
  causal     vanilla causal attention (the default GPT): the fused kernel with is_causal
  causal+M   causal with a learnable mask (the GPT mask prior): the math kernel
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior  # noqa: E402
from bench_util import clean_rounds  # noqa: E402

KINDS = {"none": ("none", False), "fixed": ("fixed", False), "learnable": ("learnable", False),
         "causal": ("none", True), "causal+M": ("learnable", True)}


def time_steps(module, x, steps):
    start = time.perf_counter()
    for _ in range(steps):
        module(x).square().mean().backward()
    return (time.perf_counter() - start) / steps


def bench(kind, n, head_dim, tokens, repeats, sample_seconds, max_other, max_rounds=None,
          heads=3):
    """Best seconds per forward+backward of each path over `repeats` clean samples of about
    sample_seconds each (bench_util.clean_rounds); ({path: seconds}, batch, clean rounds)."""
    mode, causal = KINDS[kind]
    torch.manual_seed(0)
    mask = None if mode == "none" else 4 * torch.randn(heads, n, n)
    module = maskprior.MaskedSelfAttention(heads * head_dim, heads, n, head_dim, mask_init=mask, mode=mode,
                                           causal=causal)
    x = torch.randn(max(1, tokens // n), n, heads * head_dim, requires_grad=True)

    def run(path, steps):      # MaskedSelfAttention.path forces one path: "fused" or "written"
        module.path = "fused" if path == "sdpa" else "written"
        time_steps(module, x, steps)

    for path in ("sdpa", "plain", "sdpa", "plain"):  # warm-up
        run(path, 1)
    start = time.perf_counter()
    run("plain", 3)
    steps = max(1, round(sample_seconds / ((time.perf_counter() - start) / 3)))
    clean, every = clean_rounds({path: (lambda path=path: run(path, steps)) for path in
                                 ("sdpa", "plain")}, repeats, max_other, max_rounds)
    best = {path: min(r[path] for r in clean or every) / steps for path in ("sdpa", "plain")}
    return best, len(x), len(clean)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sample-seconds", type=float, default=0.25,
                   help="length of one timed sample (long enough for /proc's 10 ms ticks)")
    p.add_argument("--max-other", type=float, default=0.15,
                   help="count only samples during which other processes used at most this many "
                        "cores (2 or more: count every sample)")
    p.add_argument("--max-rounds", type=int,
                   help="give up on clean samples after this many rounds (default 10 x repeats)")
    p.add_argument("--tokens", type=int, default=4096, help="batch x N of every shape")
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 48, 64, 96, 128, 256])
    p.add_argument("--head-dims", type=int, nargs="+", default=[21, 32, 64])
    p.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; per path the best of {args.repeats} clean samples of about "
          f"{args.sample_seconds} s of forward+backward steps of one MaskedSelfAttention (3 heads),"
          f" batch x N = {args.tokens}")
    print("| threads | kind | N | head dim | batch | SDPA (ms) | plain (ms) | SDPA / plain "
          "| clean samples |")
    print("|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for kind in args.kinds:
            for d in args.head_dims:
                for n in args.lengths:
                    best, batch, clean = bench(kind, n, d, args.tokens, args.repeats,
                                               args.sample_seconds, args.max_other,
                                               args.max_rounds)
                    t_sdpa, t_plain = best["sdpa"], best["plain"]
                    print(f"| {threads} | {kind} | {n} | {d} | {batch} | {1e3 * t_sdpa:.2f} | "
                          f"{1e3 * t_plain:.2f} | {t_sdpa / t_plain:.2f} | {clean} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
