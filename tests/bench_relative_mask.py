"""Benchmark: what a relative M saves (issue 65): M's parameters and the peak memory of one training
step (forward, backward, AdamW step) of a Llama-shaped attention layer, 8 heads of 64 (width 512),
causal, batch 1, at 1,024, 4,096 and 8,192 tokens: M dense (8, n, n) against relative (8, n), one
logit per distance 0..n - 1 back, learnable, and the relative M fixed (ALiBi's kind).

    python tests/bench_relative_mask.py [--lengths 1024 4096 8192] [--limit-gb 8] [--threads 1]

Not collected by pytest. Each (length, M) runs in a subprocess of its own, which builds
maskprior.MaskedSelfAttention(512, 8, n, causal=True) with its M, takes one AdamW step on a random
(1, n, 512) input, and reports its peak resident memory (getrusage's ru_maxrss) against the same
process's before the layer was built: the layer's weights, M, its gradient, AdamW's two states and
the step's activations; and "state", what the layer keeps between steps (weights, gradients, AdamW's
two states, counted tensor by tensor), the part that grows with the layers of a model. The lengths
run in order; before each one past the first two the peak is predicted from the two before it as
a + b n^2 (the (n, n) terms dominate), and a config whose prediction exceeds --limit-gb is skipped
with the prediction printed (a shared 24 GB machine).
What this measures on the CPU: a learnable M (dense or relative) gives the bias a gradient, so the
attention is written out ((1, 8, n, n) logits, probabilities and the bias itself); a fixed M's bias
takes torch's fused kernel, which still reads the bias written out as (1, 8, n, n).
"""
import argparse
import json
import os
import resource
import subprocess
import sys

HEADS, HEAD_DIM = 8, 64


def child(n, kind, threads):
    """One config in this process; prints a JSON line: M's parameters, peak RSS over the baseline."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import maskprior
    torch.set_num_threads(threads)
    x = torch.randn(1, n, HEADS * HEAD_DIM)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mask = (maskprior.relative_distance_mask(HEADS, n, relative=kind != "dense"))     # (8, n, n) or (8, n)
    layer = maskprior.MaskedSelfAttention(HEADS * HEAD_DIM, HEADS, n, mask_init=mask, causal=True,
                                          mode="fixed" if kind == "relative-fixed" else "learnable",
                                          mask_scale=maskprior.GPT_MASK_SCALE)
    del mask
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(x).square().mean().backward()
    optimizer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # what the layer keeps between steps, counted tensor by tensor: weights, gradients, AdamW's states
    kept = [t for p in layer.parameters() for t in (p, p.grad) if t is not None]
    kept += [t for state in optimizer.state.values() for t in state.values() if t.dim()]
    print(json.dumps({"n": n, "kind": kind, "mask_parameters": layer.mask.numel(),
                      "state_gb": sum(t.numel() * t.element_size() for t in kept) / 1e9,
                      "peak_gb": (peak - base) * 1024 / 1e9}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--kinds", nargs="+", default=["dense", "relative", "relative-fixed"])
    p.add_argument("--limit-gb", type=float, default=8.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", nargs=2, metavar=("N", "KIND"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(int(args.child[0]), args.child[1], args.threads)
    print(f"one AdamW step of MaskedSelfAttention({HEADS * HEAD_DIM}, {HEADS} heads of {HEAD_DIM}, causal), "
          f"batch 1, {args.threads} thread(s); peak RSS over the process's start")
    print(f"{'tokens':>7} {'M':>15} {'M parameters':>14} {'state GB':>9} {'peak GB':>8}")
    seen = {kind: [] for kind in args.kinds}                    # kind -> [(n, peak GB)]
    for n in args.lengths:
        for kind in args.kinds:
            done = seen[kind]
            if len(done) >= 2:                                  # a + b n^2 through the last two
                (n1, g1), (n2, g2) = done[-2:]
                b = (g2 - g1) / (n2 ** 2 - n1 ** 2)
                predicted = g2 + b * (n ** 2 - n2 ** 2)
                if predicted > args.limit_gb:
                    print(f"{n:>7} {kind:>15} {'':>14} skipped: predicted {predicted:.1f} GB > --limit-gb "
                          f"{args.limit_gb:g}")
                    continue
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(n), kind,
                                   "--threads", str(args.threads)], capture_output=True, text=True)
            if proc.returncode:
                print(f"{n:>7} {kind:>15} failed: {proc.stderr.strip().splitlines()[-1]}")
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            done.append((n, row["peak_gb"]))
            print(f"{n:>7} {kind:>15} {row['mask_parameters']:>14,} {row['state_gb']:>9.3f} {row['peak_gb']:>8.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
