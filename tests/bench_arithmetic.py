"""Benchmark: is arithmetic evaluation bound by matrix multiplication, not by Python?

    python tests/bench_arithmetic.py [--task multiplication] [--pairs 50000] [--repeats 5]
                                     [--threads N] [--batch 4096]

Not collected by pytest. Builds the paper preset's encoder (Table "Arithmetic task setup":
6 layers, 4 heads of 64, width 256, MLP 256), for the default and the mask init, and times
tasks.arithmetic_logits (the evaluation path of every run) over held-out pairs. It prints:

  * evaluation throughput, pairs/s (median of `repeats` passes);
  * the FLOP rate this implies, counting the matrix products of the forward pass
    (q/k/v/output projections, Q K^T, A V, MLP, readout head; 2 FLOPs per multiply-add);
  * the machine's fp32 matmul rate measured in the same run (torch.mm of 1024 x 1024, same
    thread count), and the fraction of it the evaluation reaches. The issue asks for >= 0.5.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402
import train  # noqa: E402
from helpers import experiment, runs_of  # noqa: E402


def matmul_rate(repeats, size=1024):
    """The machine's fp32 matmul rate: FLOP/s of torch.mm on two size x size matrices, best of
    `repeats` timings of 20 products (the best, not the median, so that a moment of other load
    cannot make the denominator small and the fraction flattering)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b)
        times.append((time.perf_counter() - start) / 20)
    return 2 * size ** 3 / min(times)


def flops_per_pair(config, n_tokens):
    """Forward-pass FLOPs of one pair (all n_tokens positions go through every layer)."""
    d, heads, mlp = config["dim"], config["heads"], config["mlp_dim"]
    inner = heads * (config["head_dim"] or d // heads)
    per_token_layer = (2 * d * 3 * inner            # q, k, v
                       + 2 * inner * d              # output projection
                       + 2 * 2 * n_tokens * inner   # Q K^T and A V, this token's row
                       + 2 * 2 * d * mlp)           # MLP in and out
    return n_tokens * (config["layers"] * per_token_layer + 2 * d * 10)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="multiplication", choices=list(tasks.ARITHMETIC_TASKS))
    p.add_argument("--pairs", type=int, default=50_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = ["--task", args.task, "--preset", "paper", "--eval-size", "1000"]
    config = runs_of(*flags)[0].config
    data = tasks.arithmetic_dataset(args.task, 0.03, seed=0, eval_size=args.pairs)
    x = data["x_eval"]
    flops = flops_per_pair(config, x.shape[1])
    peak = matmul_rate(args.repeats)
    rates = {}
    print(f"{args.task}, paper preset, {len(x)} pairs, batch {args.batch}, "
          f"{flops / 1e6:.1f} MFLOP per pair")
    device = torch.device("cpu")
    for init in ("default", "mask"):
        torch.manual_seed(0)
        model = experiment(*flags, "--init", init, data=data).model
        tasks.arithmetic_logits(model, x[:args.batch], args.batch)          # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tasks.arithmetic_logits(model, x, args.batch)
            times.append(time.perf_counter() - start)
        rates[init] = len(x) / statistics.median(times)
    peak = max(peak, matmul_rate(args.repeats))     # measured again after, the larger kept
    print(f"{torch.get_num_threads()} threads; torch.mm 1024x1024 fp32: {peak / 1e9:.1f} GFLOP/s "
          f"(best of before and after)")
    for init, rate in rates.items():
        print(f"  {init:8s} {rate:9.0f} pairs/s  {rate * flops / 1e9:6.1f} GFLOP/s  "
              f"fraction of matmul rate {rate * flops / peak:.2f}")


if __name__ == "__main__":
    main()
