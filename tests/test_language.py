"""The GPT with a causal relative-distance mask prior, the language data, and language runs:
offline corpus, a tiny tiktoken encoding, whole-split perplexity, checkpoint and --resume."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import maskprior
import tasks
import train
from helpers import ROOT, experiment, interrupt_then_resume, kill_then_resume, result_of, same_weights
from synthetic import write_tiny_ranks

TINY_LM = ["--iters", "8", "--eval-every", "4", "--layers", "1", "--heads", "2", "--dim", "16",
           "--block-size", "16", "--batch-size", "4", "--no-progress"]


def test_relative_distance_mask_and_its_bias():
    m = maskprior.relative_distance_mask(3, 5)
    assert m.shape == (3, 5, 5)
    for i in range(5):
        for j in range(5):
            assert m[1, i, j] == -max(i - j, 0)
    gpt = maskprior.GPT(32, 5, 8, 2, 3, mode="learnable", masks=m.expand(2, -1, -1, -1))
    block = maskprior.attention_modules(gpt)[0]
    bias = block.logit_bias(block.mask, 5, block.mask_scale).detach()
    torch.testing.assert_close(bias, F.logsigmoid(10.0 * m))   # log sigmoid(s M), s = 10
    assert bias[0, 3, 3] == pytest.approx(-math.log(2)) and bias[0, 3, 2] < -9.9


def lm_model(init, vocab_size, layers, heads, block_size, dim):
    """The GPT that train.lm_setup builds for init (dropout 0), on a fake corpus of vocab_size."""
    flags = ["--task", "lm", "--init", init, "--layers", str(layers), "--heads", str(heads),
             "--block-size", str(block_size), "--dim", str(dim)]
    tokens = torch.randint(0, vocab_size, (4 * block_size,))
    data = {"train": tokens, "val": tokens, "test": tokens, "vocab_size": vocab_size,
            "decode": tasks.Tokenizer().decode, "test_is_val": False}
    torch.manual_seed(0)
    return experiment(*flags, data=data, dropout=0.0).model


@pytest.mark.parametrize("init", ["default", "mask", "mimetic"])
def test_gpt_is_causal_and_trains(init):
    gpt = lm_model(init, 50, layers=2, heads=2, block_size=12, dim=16)
    x = torch.randint(0, 50, (3, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 50                       # change the future only
    torch.testing.assert_close(gpt(x)[:, :7], gpt(y)[:, :7])
    assert not torch.allclose(gpt(x)[:, 7:], gpt(y)[:, 7:])
    logits, loss = gpt(x[:, :-1], x[:, 1:])
    assert logits.shape == (3, 11, 50) and loss.item() == pytest.approx(math.log(50), rel=0.1)
    loss.backward()
    mask = maskprior.attention_modules(gpt)[0].mask
    assert (mask is not None) == (init == "mask")
    if mask is not None:
        assert mask.grad is not None and mask.grad.abs().sum() > 0
    assert gpt.generate(x[:, :4], 20).shape == (3, 24)


def test_embedded_corpus_and_byte_tokens():
    """lm: pydoc_data.topics joined in key order, its UTF-8 bytes, the last 5 % test, 5 % before it val."""
    import pydoc_data.topics
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    assert len(text) > 400_000 and "lambda" in text
    data = tasks.lm_dataset("lm")
    assert data["vocab_size"] == 256 and not data["test_is_val"]
    stream = torch.cat([data[s] for s in ("train", "val", "test")])
    assert stream.tolist() == list(text.encode("utf-8"))
    assert len(data["val"]) == len(data["test"]) == int(0.05 * len(stream))
    assert data["decode"](data["train"][:200].tolist()) == text.encode()[:200].decode()
    assert data["decode"](list("é".encode()) + [0xE9]) == "é\ufffd"         # a stray byte: U+FFFD


class NextToken(torch.nn.Module):
    """A language model that predicts token + 1 (logits 50 there, 0 elsewhere) and records its inputs."""
    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size, self.seen, self.weight = vocab_size, [], torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        self.seen.append(x.clone())
        return 50.0 * F.one_hot((x + 1) % self.vocab_size, self.vocab_size).float()


def test_windows_predict_every_token_once_and_batches_are_shifted():
    """lm_loss reads the split in consecutive windows of 5 (the last padded): every token but the last
    is an input once, in order, and every target is the next token (the loss of predicting token + 1 is 0)."""
    tokens = torch.arange(1, 24)                   # 23 tokens; padding is token 0
    model = NextToken(30)
    assert tasks.lm_loss(model, tokens, 5, batch=2) == pytest.approx(0.0, abs=1e-12)
    inputs = torch.cat(model.seen)                 # (5, 5): windows in batches of 2
    assert inputs.shape == (5, 5)
    assert inputs.flatten().tolist() == list(range(1, 23)) + [0] * 3
    backwards = tokens.flip(0)                     # every target is token - 1: each costs 50
    assert tasks.lm_loss(NextToken(30), backwards, 5) == pytest.approx(50.0, rel=1e-4)
    bx, by = tasks.lm_batch(tokens, 5, 7, torch.Generator().manual_seed(0))
    assert bx.shape == by.shape == (7, 5)
    torch.testing.assert_close(by, bx + 1)


def test_whole_split_loss_equals_the_mean_over_every_token():
    gpt = lm_model("mask", 30, layers=1, heads=2, block_size=8, dim=16)
    tokens = torch.randint(0, 30, (50,))
    losses = []
    for start in range(0, 49, 8):                     # by hand: each window from scratch
        x, y = tokens[start:start + 8][:len(tokens) - 1 - start], tokens[start + 1:start + 9]
        losses += F.cross_entropy(gpt(x[None])[0], y, reduction="none").tolist()
    assert len(losses) == 49
    assert tasks.lm_loss(gpt, tokens, 8, batch=3) == pytest.approx(
        sum(losses) / 49, rel=1e-5)


def test_tiny_tiktoken_encoding_and_tinystories_files(tmp_path):
    bpe = write_tiny_ranks(tmp_path / "tiny.tiktoken")
    enc = tasks.Tokenizer(gpt2=True, bpe_file=bpe).encoding
    assert enc.encode_ordinary("Hi there") == list(b"Hi there") and enc.eot_token == 50256
    stories = [f"Once upon a time there was a cat number {i}." for i in range(30)]
    (tmp_path / tasks.TINYSTORIES_FILES[0]).write_text("\n<|endoftext|>\n".join(stories))
    (tmp_path / tasks.TINYSTORIES_FILES[1]).write_text("\n<|endoftext|>\n".join(stories[:5]))
    data = tasks.lm_dataset("tinystories", str(tmp_path), bpe, train_stories=12, val_stories=2)
    assert (data["train"] == 50256).sum() == 12 and (data["val"] == 50256).sum() == 2
    assert data["test_is_val"] and data["vocab_size"] == 50257
    assert data["decode"](data["train"][:16].tolist()) == stories[0][:16]


def test_wikitext2_splits(tmp_path):
    bpe = write_tiny_ranks(tmp_path / "tiny.tiktoken")
    os.makedirs(tmp_path / "wikitext-2-raw")
    for name, text in zip(tasks.WIKITEXT2_FILES, (" = Train = \n words " * 20, " val ", " test text ")):
        (tmp_path / name).write_text(text)
    data = tasks.lm_dataset("wikitext2", str(tmp_path), bpe)
    assert len(data["val"]) == 5 and len(data["test"]) == 11 and not data["test_is_val"]


def test_missing_files_are_one_clear_message(tmp_path):
    with pytest.raises(tasks.DataError, match="TinyStoriesV2-GPT4-train.txt"):
        tasks.lm_dataset("tinystories", str(tmp_path), None)
    with pytest.raises(tasks.DataError, match="wiki.train.raw"):
        tasks.lm_dataset("wikitext2", str(tmp_path), None)
    with pytest.raises(tasks.DataError, match="--bpe-file"):
        tasks.Tokenizer(gpt2=True, bpe_file=str(tmp_path / "missing.tiktoken"))


def test_lm_run_writes_perplexities_sample_and_mask_pictures(tmp_path, run_cli, attention_svg):
    proc = run_cli("--task", "lm", "--init", "mask", "--out", str(tmp_path), *TINY_LM)
    assert proc.returncode == 0, proc.stderr
    assert "lm/mask/seed0: val ppl" in proc.stdout and "sample:" in proc.stdout
    result = result_of(tmp_path)
    final = result["final"]
    assert final["val_ppl"] == pytest.approx(math.exp(final["val_loss"]))
    assert final["test_ppl"] == pytest.approx(math.exp(final["test_loss"]))
    assert 1 < final["val_ppl"] < 256 * 2 and isinstance(final["sample"], str)
    assert [h["iter"] for h in result["history"]] == [4, 8]
    assert (tmp_path / "checkpoint.pt").exists()
    # attention.svg: the mean attention over the first validation windows beside the bias, before
    # and after; it says what is causal; no attention lands above the diagonal (key after query)
    texts, titles, panels = attention_svg(tmp_path)
    assert titles == [f"{what}, {when} training" for when in ("before", "after")
                      for what in ("mean attention", "mask bias log σ(s M)")]
    assert "layer 1" in texts and "head 2" in texts and any("Causal" in t for t in texts)
    after = torch.load(tmp_path / "attention_after.pt", weights_only=True)["attn"]   # (1, 2, 16, 16)
    assert after.shape == (1, 2, 16, 16) and (after.triu(1) == 0).all()
    assert torch.allclose(after.sum(-1), torch.ones(1, 2, 16))
    # the relative-bias profile: log sigmoid(10 * -d) at distance d before training
    block = result["config"]["block_size"]
    profile = final["bias_by_distance_init"]
    assert len(profile) == len(final["bias_by_distance_final"]) == block
    assert profile[:3] == pytest.approx([-math.log(2), -10 - math.log1p(math.exp(-10)),
                                         -20 - math.log1p(math.exp(-20))], rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--task", "lm", "--init", "structured-svd"], "--init structured-svd is not available"),
    (["--task", "lm", "--epochs", "3"], "--epochs applies to boolean and arithmetic and vision tasks only"),
    (["--task", "majority", "--iters", "5"], "--iters applies to language tasks only"),
    (["--task", "lm", "majority"], "cannot share one grid"),
    (["--task", "lm", "--resume", "--out", "/nonexistent/run"],
     "no checkpoint at /nonexistent/run/checkpoint.pt"),
    (["--task", "tinystories", "--data-dir", "/nonexistent/data"],
     "expected /nonexistent/data/TinyStoriesV2-GPT4-train.txt"),
])
def test_language_bad_input_exits_2_with_one_line(args, message, capsys, monkeypatch):
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    assert train.main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_killed_run_resumes_and_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    args = ["--task", "lm", "--init", "mask", "--iters", "12", *TINY_LM[2:]]
    whole, resumed = kill_then_resume(args, tmp_path, monkeypatch)   # killed at iteration 4
    assert resumed["history"] == whole["history"]
    assert resumed["final"]["val_loss"] == whole["final"]["val_loss"]
    assert resumed["final"]["sample"] == whole["final"]["sample"]
    # resumed_at counts in the history's unit: the iteration of the checkpoint (4), as "iter"
    # does, not the evaluation round (1)
    assert resumed["resumed_at"] == 4 == resumed["history"][0]["iter"]


def test_a_signal_mid_round_resumes_exactly(tmp_path, monkeypatch, capsys):
    """SIGINT during iteration 6 (of the round 5-8): a checkpoint of iteration 6; resumed, the
    rest of the round draws the windows and the dropout of the uninterrupted run."""
    args = ["--task", "lm", "--init", "mask", *TINY_LM]
    whole, resumed, line, weights = interrupt_then_resume(args, tmp_path, monkeypatch, capsys, 6)
    assert line == (f"train.py: interrupted at iteration 6; the checkpoint of iteration 6 is kept in "
                    f"{tmp_path / 'stopped'}: rerun with --resume")
    assert resumed["history"] == whole["history"]
    assert resumed["final"]["val_loss"] == whole["final"]["val_loss"]
    assert resumed["final"]["sample"] == whole["final"]["sample"]
    assert same_weights(*weights)


def test_torchrun_two_cpu_processes_with_gloo(tmp_path):
    """The DistributedDataParallel path on the CPU: 2 processes, gloo, one result from rank 0.
    Then a SIGINT that reaches rank 1 alone, in step 6: both ranks stop after that step (exit
    130, one line, from rank 0) with a checkpoint of it, and --resume ends as the run above."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TIKTOKEN_CACHE_DIR", None)
    launcher = tmp_path / "train_with_a_signal.py"   # train.py, rank 1's step 6 raising SIGINT
    launcher.write_text(
        "import os, runpy, signal, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import train\n"
        "real_train, steps = train.train, []\n"
        "def train_with_a_signal(run, exp, *rest):\n"
        "    real_loss = exp.loss_of\n"
        "    def loss_of(net, batch):\n"
        "        steps.append(1)\n"
        "        if len(steps) == 6 and os.environ['RANK'] == '1' and '--resume' not in sys.argv:\n"
        "            signal.raise_signal(signal.SIGINT)\n"
        "        return real_loss(net, batch)\n"
        "    exp.loss_of = loss_of\n"
        "    return real_train(run, exp, *rest)\n"
        "train.train = train_with_a_signal\n"
        "code = train.main()\n"
        f"open(os.path.join({str(tmp_path)!r}, 'exit' + os.environ['RANK']), 'w').write(str(code))\n"
        "sys.exit(code)\n")
    torchrun = lambda script, out, *flags: subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         script, "--task", "lm", "--init", "mask", "--out", str(out), *TINY_LM, *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    proc = torchrun(os.path.join(ROOT, "train.py"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("lm/mask/seed0: val ppl") == 1      # rank 0 reports, once
    result = result_of(tmp_path)
    assert result["world_size"] == 2 and [h["iter"] for h in result["history"]] == [4, 8]
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert len(saved["rng"]) == 2                    # every rank's RNGs: torch's, the windows'
    assert not torch.equal(saved["rng"][0][1], saved["rng"][1][1])
    assert saved["state"]["step"] == 8 and saved["meta"]["world_size"] == 2
    stopped = tmp_path / "stopped"
    proc = torchrun(str(launcher), stopped)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py")]
    assert lines == [f"train.py: interrupted at iteration 6; the checkpoint of iteration 6 is kept "
                     f"in {stopped}: rerun with --resume"], proc.stderr[-2000:]
    assert [(tmp_path / f"exit{rank}").read_text() for rank in (0, 1)] == ["130", "130"]
    partial = torch.load(stopped / "checkpoint.pt", weights_only=False)["partial"]
    assert (partial["round"], partial["done"], [len(r["losses"]) for r in partial["ranks"]]) == (2, 2, [2, 2])
    proc = torchrun(str(launcher), stopped, "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = result_of(stopped)
    assert resumed["history"] == result["history"] and resumed["final"]["val_loss"] == result["final"]["val_loss"]
    weights = [torch.load(out / "checkpoint.pt", weights_only=False)["model"] for out in (tmp_path, stopped)]
    assert same_weights(*weights)
