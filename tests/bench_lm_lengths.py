"""Trained short, read long: a finished language run's validation perplexity at multiples of its
training length, and where its prior and its attention went (issue 65).

    python tests/bench_lm_lengths.py RUN [RUN ...] [--lengths 1 2 4] [--threads 1]

Not collected by pytest. RUN: a folder train.py wrote for --task lm (result.json, checkpoint.pt,
attention_before.pt, attention_after.pt). The model is rebuilt as train.py builds it (its init,
preset, --no-pos) and given checkpoint.pt's weights; then for each length m x T (T the block size)
the whole validation split is scored in consecutive windows of m x T tokens (tasks.lm_loss, as the
run's own val ppl at m = 1). A model with learned positions, or a dense M, refuses m > 1: "refused".
Longer windows give the average token more context ((m T - 1) / 2 tokens), so a model that uses
it scores lower; one that breaks past its training length scores higher.
Then, from attention_before.pt / attention_after.pt (train.py's probe: the first 64 validation
windows of T tokens): the attention mass on distance 0 (the diagonal, the one entry the GPT prior
log sigmoid(10 M) leaves near 0: -0.69 against -10 one step back) and the mean distance attended,
over layers, heads and query rows; and the bias log sigmoid(s M) at distances 0..3 and T - 1, averaged
over layers and heads, then per layer and head (the counterpart of Figure "Relative mask bias before
and after training", one curve per head), each averaged over query rows. Prints one block per run.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402
from helpers import experiment  # noqa: E402


def by_distance(maps):
    """(L, H, N, N) -> (L, H, N): each layer's and head's mean over query rows of the entries at each
    distance d = i - j = 0..N - 1."""
    n = maps.shape[-1]
    return torch.stack([maps[..., torch.arange(d, n), torch.arange(0, n - d)].mean(-1) for d in range(n)], -1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for folder in args.runs:
        with open(os.path.join(folder, "result.json")) as f:
            result = json.load(f)
        config = result["config"]
        flags = ["--task", result["task"], "--init", result["init"], "--preset", config["preset"],
                 *(["--no-pos"] if config.get("no_pos") else [])]
        exp = experiment(*flags, **{**config, "dropout": 0.0})           # the run's shape, its weights next
        exp.model.load_state_dict(torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=False)["model"])
        data = tasks.lm_dataset(result["task"])
        T = config["block_size"]
        print(f"{folder}: {result['task']} {result['init']} seed {result['seed']}, "
              f"no_pos {bool(config.get('no_pos'))}, run's val ppl {result['final']['val_ppl']:.3f}")
        for m in args.lengths:
            try:
                ppl = f"{math.exp(tasks.lm_loss(exp.model, data['val'], m * T)):.3f}"
            except ValueError as err:
                ppl = f"refused ({err})"
            print(f"  val ppl at {m} x {T} = {m * T} tokens: {ppl}")
        snapshots = {when: torch.load(os.path.join(folder, f"attention_{when}.pt"), weights_only=True)
                     for when in ("before", "after")}
        for when, snapshot in snapshots.items():
            attn = snapshot["attn"]                                     # (L, H, N, N), rows sum to 1
            n = attn.shape[-1]
            i = torch.arange(n)
            distance = (i[:, None] - i[None, :]).clamp(min=0).float()
            print(f"  {when}: attention mass on distance 0 {by_distance(attn)[..., 0].mean():.4f}, "
                  f"mean distance attended {(attn * distance).sum(-1).mean():.3f}")
            if snapshot["bias"] is not None:
                curves = by_distance(snapshot["bias"])                  # (L, H, N)
                print(f"    bias at d = 0, 1, 2, 3 and {n - 1}, mean over layers and heads: "
                      + " ".join(f"{curves[..., d].mean():.2f}" for d in (0, 1, 2, 3, n - 1)))
                for layer, heads in enumerate(curves):                  # one curve per layer and head
                    shown = " | ".join(" ".join(f"{row[d]:.2f}" for d in (0, 1, 2, n - 1)) for row in heads)
                    print(f"    layer {layer}, heads at d = 0 1 2 {n - 1}: {shown}")


if __name__ == "__main__":
    main()
