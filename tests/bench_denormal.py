"""Benchmark: a Boolean training step on CPU with subnormal floats flushed to zero and without.

    python tests/bench_denormal.py [--task 2parity] [--preset paper] [--mask-magnitude 100]
                                   [--checkpoint RUN/checkpoint.pt] [--steps 5] [--repeats 7]

Not collected by pytest (the name does not start with test_). A mask that shuts a pair with
log sigma(-A) puts about e^-A of the attention there; below 1.2e-38 (A > 87) those probabilities
and the gradients through them are subnormal floats, which x86 CPUs handle far slower than normal
ones. Training makes such values too (a trained 2parity mask run holds them in its W_Q / W_K
gradients), so either time a model at a large magnitude A from its first step, or pass a
checkpoint of a real run (`--checkpoint runs/x/checkpoint.pt`, same task, preset and init).
train.py sets torch.set_flush_denormal(True) on CPU; this prints the seconds per training step
with it on and off (median over `repeats` rounds of `steps` steps each, the two alternating
within a round, see bench_util.clean_rounds) and the median ratio off / on.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402
import train  # noqa: E402
from helpers import experiment, runs_of  # noqa: E402
from bench_util import clean_rounds  # noqa: E402


def subnormal_count(tensors):
    """How many entries of the tensors are nonzero and below the smallest normal float32."""
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((t != 0) & (t.abs() < tiny)).sum()) for t in tensors if t is not None)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="2parity")
    p.add_argument("--preset", choices=["cpu", "paper"], default="paper")
    p.add_argument("--mask-magnitude", type=float, default=100.0)
    p.add_argument("--checkpoint", help="checkpoint.pt of a --init mask run of the same task and preset")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-other", type=float, default=0.15,
                   help="keep rounds during which other processes used fewer cores than this")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cli = ["--task", args.task, "--init", "mask", "--preset", args.preset]
    if not args.checkpoint and args.mask_magnitude:
        cli += ["--mask-magnitude", str(args.mask_magnitude)]
    exp = experiment(*cli)
    if args.checkpoint:
        saved = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        exp.model.load_state_dict(saved["model"])
        exp.optimizer.load_state_dict(saved["optimizer"])
    batches = iter(exp.batches(0))

    def step():
        loss = exp.loss_of(exp.model, next(batches))
        exp.optimizer.zero_grad()
        loss.backward()
        exp.optimizer.step()

    def steps(flush):
        def run():
            torch.set_flush_denormal(flush)
            for _ in range(args.steps):
                step()
        return run

    torch.set_flush_denormal(False)
    step()
    grads = [q.grad for q in exp.model.parameters()]
    print(f"{args.task}, {args.preset} preset, "
          + (f"from {args.checkpoint}" if args.checkpoint else f"mask magnitude {args.mask_magnitude:g}")
          + f", {args.threads} thread(s): {subnormal_count(grads):,} subnormal gradient entries "
          f"of {sum(g.numel() for g in grads if g is not None):,}")
    clean, every = clean_rounds({"flush on": steps(True), "flush off": steps(False)}, args.repeats,
                                max_other=args.max_other)
    rounds = clean or every
    on = statistics.median(r["flush on"] for r in rounds) / args.steps
    off = statistics.median(r["flush off"] for r in rounds) / args.steps
    ratio = statistics.median(r["flush off"] / r["flush on"] for r in rounds)
    print(f"s/step: flush on {on:.3f}, off {off:.3f}; off / on {ratio:.2f} (median of "
          f"{len(rounds)} rounds, {'clean' if clean else 'NOT clean: the machine was busy'})")


if __name__ == "__main__":
    main()
