"""Benchmark: what add_mask_prior costs a model, patched over unpatched (the README's speed table).

    python tests/bench_add_mask_prior.py [--threads 1 2] [--repeats 15] [--steps 3] [--only NAME ...]
                                         [--flush-denormal]

Not collected by pytest. Needs the test extras (timm, transformers; torchvision is in requirements.txt).
Each NAME builds one model from one seed, the stock one and a deep copy patched by
maskprior.add_mask_prior (M learnable, the prior of the README's examples), and times the two side
by side: each round times `steps` calls of each (which one starts alternates round by round,
bench_util.clean_rounds), and the table gives the median over the rounds of the paired ratio
patched / unpatched, with its quartiles (above 1: the prior costs time), and each one's median ms
per training step or per generated token. Rounds during which other processes used more than
--max-other cores (read from /proc) are dropped, up to --max-rounds; if fewer than --repeats were
clean, every round counts. Both run the model's default attention: the stock model its own (SDPA
in transformers, timm and torch), the patched one what add_mask_prior gives it.

  gpt2             training step (forward, backward, AdamW on param_groups): GPT2LMHeadModel, 4 layers,
                   width 128, 4 heads, vocabulary 256, batch 8 x 128 tokens; M relative_distance_mask
                   (N = 128) under GPT_MASK_SCALE
  llama            the same for the README's Llama at width 256: LlamaForCausalLM, 4 layers, 4 heads,
                   MLP 512, vocabulary 256, batch 8 x 128 tokens; M as for gpt2
  timm_vit         the same for the README's timm VisionTransformer at width 256: 48 px images, patch
                   4 (CLS + 12 x 12 patches, N = 145), 4 layers, 4 heads, MLP 1024, batch 8,
                   cross-entropy on 10 classes; M impulse_mask(4, 4, 12)
  torchvision_vit  the same for the README's torchvision VisionTransformer, same shape
  gpt2_generate    cached greedy generation, ms per new token: gpt2's model, one prompt of 8 tokens,
                   120 new tokens (dynamic cache)
  llama_generate   the same for llama's model

The README's speed table quotes this table, run with --threads 1 2 --repeats 21 --steps 3 on the
2-core CPU with nothing else running. The cost of the rule that a forward reads M as it is (no
log-sigmoid table kept between steps), --threads 1 --only gpt2_generate llama_generate on the idle CPU,
the code before it (f5b65aa, the table kept) and this code in turn, three runs each and the full run's:
GPT-2 1.102, 1.073, 1.103 before, 1.102, 1.081, 1.213 and 1.162 after (medians 1.102, 1.13); Llama
1.107, 1.096, 1.030 before, 1.087, 1.059, 1.149 and 1.103 after (medians 1.096, 1.095): the runs of
one code differ by up to 0.13, more than the two codes' medians. On the shared CPU earlier: with the
table GPT-2 1.072 and 1.111, Llama 1.085 and 1.093; without it 1.171, 1.158, 1.159 and 1.098, 1.150,
1.142; with one position hook a step (below), the CPU shared with two other jobs, GPT-2 1.178, 1.073,
1.144 against 1.125, 1.145, 1.143, Llama 1.129, 1.090, 1.117 against 1.078, 1.069, 1.053.
--flush-denormal sets torch.set_flush_denormal(True) first (as train.py runs); it changed no ratio
beyond the rounds' spread. Between runs of the same command the GPT-2 training ratio moves by up to
0.04 (the quartiles show the spread of one run's rounds).

Where the rest goes. Training (gpt2, one thread, one piece switched off at a time, paired in one
process): M fixed (the fused kernel, the bias in its mask) 1.010; M's log sigmoid recomputed each step
but its gradient cut 1.014; M trained but left out of AdamW 1.044; all of it 1.05-1.09 (reruns of this
bench's gpt2 row: 1.053, 1.060, 1.078, 1.089, 1.090). AdamW on M's 262,144 entries (a quarter of this model's
parameters) costs about 1.5 ms of an 87 ms step, and M's gradient about 2.6 ms: the CPU's fused kernels
give none for a mask, so a trained M takes the softmax written out, a causal layer's in blocks of 64
query rows. Profiled (torch.profiler, per step): the written-out products and softmax, forward and
backward, take about what the fused kernel does (10.9 ms against 12.7 ms); the rest is elementwise work
on M and the blocks. Two things of this CPU make that work dearer: M's gradient is zero on the future's
triangle and wherever the prior leaves no attention (e^-10d underflows past 10 positions back: 93 % of
its entries after 3 steps), so AdamW's square root meets zeros, which torch's CPU sqrt takes about 5
times longer than other floats (117 against 24 us for 65,536 entries; subnormals 30 times, flushed or
not); and e^-90, the attention the GPT prior leaves 9 positions back, is subnormal, which doubles the
softmax (1.95 against 0.86 ms a step with --flush-denormal; the ratio moved by less than the runs'
spread). Tried, no gain: a hand-written backward for the log sigmoid, the blocks as 3-D bmm calls (0.2 %
or less), M's group on fused AdamW, and torch.compile of both models (inductor, 21 paired rounds: 1.104,
the attention still written out for M's gradient).
Generation: a cached token pays about 20 us a layer against the layer's 180 us at these widths (timed
inside the GPT-2 model): the pre-hook 11-13 us (its parts: the config and arguments 1.6, the cache's two
offset calls 2.0, the position check 1.3, M's row read from a log-sigmoid table kept between steps 4.7),
torch's dispatch of a hook 3-5 us (the forward set on the instance instead: 2.7 % less in a decode loop,
not kept: a deep copy's forward would call the original layer), the masked kernel 1.6 more than the
unmasked one. No table is kept, as no key tells every writer of M: the row's log sigmoid, computed at
each step, costs two kernel calls beside the view (paired in one process, 31 rounds on the shared CPU,
that put gpt2_generate's ratio at 1.139 against the table's 1.100, llama_generate's at 1.065 against
1.055). Those two calls (GPT-2, one thread, the CPU shared with two other jobs): in a loop of one call,
the row's view 1.2-1.9 us, s * M's row 2.9-3.1 (1.3 with s a 0-dim tensor: the rest wraps the Python
float), F.logsigmoid 2.1 us at 64 entries, 4.4 at 256, 6.9 at 512 (its CPU kernel takes log1p entry by
entry); inside generation (perf_counter_ns around each call, medians, the code before and after a change
patched into two copies of one model in one process, generating in turn), a layer's pre-hook took 38-62
us, 23-27 less with the table, 5 less without the product alone, 9 less without the log sigmoid alone;
two copies of the same code differed by up to 2. No torch kernel gives log sigmoid(s x) in one call
where s != 1 (F.softplus(x, beta=-s) gives it divided by s), so s = 1 alone skips the product (not
this bench: its s is GPT_MASK_SCALE). Tried, no gain: the log(sigmoid) form clamped at log eps and
capped by x (four calls, 7.6-8.8 us at these rows, s included, against 5.3-10.1), s as a 0-dim tensor
kept beside mask_scale (inside generation the pre-hook moved by 1.2 us, less than two same copies'
1.8), and the Python of a layer's path (the output_capturing import 0.36 us, a look-up 0.1-0.5): below
what these runs resolve. The hook that keeps a model call's position_ids (_remember_positions) sits on
the models whose record a layer reads (GPT2Model, LlamaModel, not the LM-head model around each): one
hook a step, not two (the hook's dispatch and the call, about 2 us in a loop); paired in one process
(60 rounds of one generation, thread time), the code with it over the code before it: GPT-2 0.953 and
0.976, two same copies 0.986, within the spread. The stock model's attention function spends as much
Python as ours (12.4 us each in a loop), so only fewer Python calls a layer or a fused kernel would take
the rest: a prototype that finds the positions once per model call and has no per-layer hook (dynamic
cache only, not shipped) gave 1.05-1.06 (GPT-2 1.061 / 1.052 at 1 / 2 threads, Llama 1.050 at 1).
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior  # noqa: E402
from bench_util import clean_rounds  # noqa: E402

BATCH, TOKENS, VOCAB, PROMPT, NEW_TOKENS = 8, 128, 256, 8, 120


def gpt2():
    import transformers as T
    config = T.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=TOKENS, vocab_size=VOCAB, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return T.GPT2LMHeadModel(config), maskprior.relative_distance_mask(4, TOKENS), maskprior.GPT_MASK_SCALE


def llama():
    import transformers as T
    config = T.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=TOKENS, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    return T.LlamaForCausalLM(config), maskprior.relative_distance_mask(4, TOKENS), maskprior.GPT_MASK_SCALE


def timm_vit():
    import timm
    model = timm.models.VisionTransformer(img_size=48, patch_size=4, embed_dim=256, depth=4, num_heads=4,
                                          num_classes=10)
    return model, maskprior.impulse_mask(depth=4, heads=4, grid=12), 1.0


def torchvision_vit():
    import torchvision
    model = torchvision.models.VisionTransformer(image_size=48, patch_size=4, num_layers=4, num_heads=4,
                                                 hidden_dim=256, mlp_dim=1024, num_classes=10)
    return model, maskprior.impulse_mask(depth=4, heads=4, grid=12), 1.0


def training(build):
    """{"unpatched", "patched"}: a function each that runs one training step."""
    torch.manual_seed(0)
    stock, mask, scale = build()
    patched = copy.deepcopy(stock)
    maskprior.add_mask_prior(patched, mask, scale=scale)
    if build in (timm_vit, torchvision_vit):
        data = torch.randn(BATCH, 3, 48, 48), torch.randint(0, 10, (BATCH,))
        loss = lambda model: F.cross_entropy(model(data[0]), data[1])                    # noqa: E731
    else:
        ids = torch.randint(1, VOCAB, (BATCH, TOKENS))
        loss = lambda model: model(input_ids=ids, labels=ids, use_cache=False).loss       # noqa: E731

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        loss(model).backward()
        optimizer.step()

    steps = {}
    for label, model in (("unpatched", stock.train()), ("patched", patched.train())):
        optimizer = torch.optim.AdamW(maskprior.param_groups(model, weight_decay=0.01), lr=1e-4)
        steps[label] = lambda model=model, optimizer=optimizer: step(model, optimizer)
    return steps


def generation(build):
    """{"unpatched", "patched"}: a function each that generates NEW_TOKENS tokens with the cache."""
    torch.manual_seed(0)
    stock, mask, scale = build()
    patched = copy.deepcopy(stock)
    maskprior.add_mask_prior(patched, mask, scale=scale)
    prompt = torch.randint(1, VOCAB, (1, PROMPT))
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)

    def generate(model):
        with torch.no_grad():
            assert model.generate(prompt, **settings).shape[-1] == PROMPT + NEW_TOKENS
    return {label: lambda model=model.eval(): generate(model) for label, model in
            (("unpatched", stock), ("patched", patched))}


BENCHES = {"gpt2": (training, gpt2), "llama": (training, llama), "timm_vit": (training, timm_vit),
           "torchvision_vit": (training, torchvision_vit), "gpt2_generate": (generation, gpt2),
           "llama_generate": (generation, llama)}


def quartiles(values):
    return statistics.quantiles(values, n=4, method="inclusive")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=3, help="training steps (or generations) per sample")
    p.add_argument("--only", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    p.add_argument("--max-other", type=float, default=0.15,
                   help="count only rounds during which other processes used at most this many cores")
    p.add_argument("--max-rounds", type=int, help="give up on clean rounds after this many (default 3 x repeats)")
    p.add_argument("--flush-denormal", action="store_true",
                   help="torch.set_flush_denormal(True), as train.py runs: subnormal floats read as 0")
    args = p.parse_args(argv)
    torch.set_flush_denormal(args.flush_denormal)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {args.repeats} paired rounds of {args.steps} "
          f"calls each; subnormals flushed: {args.flush_denormal}; ratio = patched / unpatched, median (quartiles)")
    print("| bench | threads | unpatched (ms) | patched (ms) | ratio | clean / all rounds | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name in args.only:
        kind, build = BENCHES[name]
        calls = kind(build)
        per = args.steps * (NEW_TOKENS if kind is generation else 1)       # ms per step or per new token
        for threads in args.threads:
            torch.set_num_threads(threads)
            for call in calls.values():                                      # warm-up
                call()
                call()
            fns = {label: (lambda call=call: [call() for _ in range(args.steps)]) for label, call in calls.items()}
            start = time.perf_counter()
            clean, every = clean_rounds(fns, args.repeats, args.max_other, args.max_rounds or 3 * args.repeats)
            rounds = clean if len(clean) >= args.repeats else every
            ms = {label: 1e3 * statistics.median(r[label] for r in rounds) / per for label in calls}
            q = quartiles([r["patched"] / r["unpatched"] for r in rounds])
            print(f"| {name} | {threads} | {ms['unpatched']:.2f} | {ms['patched']:.2f} | {q[1]:.3f} "
                  f"({q[0]:.3f}-{q[2]:.3f}) | {len(clean)} / {len(every)} | {time.perf_counter() - start:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
