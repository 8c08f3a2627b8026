"""Damaged files and impossible sizes: each is exit code 2 (1 for --summarize, which still writes
the table of what it could read), exactly one line on stderr, no traceback, and every file that
was there before is left as it was (bytes and modification times)."""
import json
import os
import re
import shutil

import pytest
import torch

import maskprior
import tasks
import train
from helpers import BOOLEAN_TINY as TINY, files_of, one_line, random_bytes, result_of
from synthetic import write_tiny_ranks

TINY_LM = ["--iters", "2", "--layers", "1", "--heads", "2", "--dim", "8", "--block-size", "8",
           "--batch-size", "2", "--no-progress"]


# ------------------------------------------------------------------------------------------
# (a) --bpe-file: a file that is not a tiktoken ranks file
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory):
    """Tiny TinyStories train / valid files (as in test_language)."""
    root = tmp_path_factory.mktemp("stories")
    stories = [f"Once upon a time there was a cat number {i}." for i in range(30)]
    (root / tasks.TINYSTORIES_FILES[0]).write_text("\n<|endoftext|>\n".join(stories))
    (root / tasks.TINYSTORIES_FILES[1]).write_text("\n<|endoftext|>\n".join(stories[:5]))
    return root


def ranks_lines(pairs):
    import base64
    return "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in pairs)


BAD_RANKS = {
    "garbage text": "this is not a ranks file\nnor is this\n".encode(),
    "random bytes": random_bytes(4096),
    # parse as ranks lines, but tiktoken's Rust core panics on them (a PanicException, not an
    # Exception): two tokens with one rank, as a ranks file cut inside a line can leave ...
    "duplicate ranks": ranks_lines([(bytes([b]), b) for b in range(256)] + [(b"ab", 7)]).encode(),
    # ... and a ranks file without every single byte, which panics at the first unknown byte
    "single bytes missing": ranks_lines([(bytes([b]), b // 2) for b in range(0, 256, 2)]).encode(),
}


@pytest.mark.parametrize("kind", list(BAD_RANKS))
def test_bpe_file_that_is_not_a_ranks_file_is_exit_2_naming_it(kind, stories_dir, tmp_path,
                                                                run_cli):
    bpe = tmp_path / "gpt2.tiktoken"
    bpe.write_bytes(BAD_RANKS[kind])
    before = {**files_of(stories_dir), "bpe": files_of(tmp_path)}
    out = tmp_path / "run"
    proc = run_cli("--task", "tinystories", "--data-dir", str(stories_dir), "--bpe-file",
                      str(bpe), "--out", str(out), *TINY_LM)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert line.startswith(f"train.py: error: --bpe-file {bpe} is not a tiktoken ranks file"), line
    assert {**files_of(stories_dir), "bpe": files_of(tmp_path)} == before and not out.exists()


def test_the_tiny_ranks_file_itself_is_accepted_and_the_run_finishes(stories_dir, tmp_path,
                                                                      run_cli):
    """The control of the test above: the same command with a good ranks file (the 256 single
    bytes only, as tests use) trains and writes result.json. The model's vocabulary is GPT-2's
    50257 ids (<|endoftext|> is 50256), so its sample can hold ids the small ranks file cannot
    decode; the sample must still come out as text, not as tiktoken's KeyError."""
    bpe = write_tiny_ranks(tmp_path / "gpt2.tiktoken")
    out = tmp_path / "run"
    proc = run_cli("--task", "tinystories", "--data-dir", str(stories_dir), "--bpe-file", bpe,
                      "--out", str(out), *TINY_LM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = result_of(out)
    assert result["config"]["block_size"] == 8 and isinstance(result["final"]["sample"], str)


# ------------------------------------------------------------------------------------------
# (b) --resume from a checkpoint.pt that is damaged or belongs to another run
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished tiny majority / mask run: result.json, checkpoint.pt, pictures."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train.main(["--task", "majority", "--init", "mask", "--out", str(out), *TINY]) == 0
    return out


def damaged_copy(finished_run, tmp_path, damage):
    """A copy of the finished run as if killed after its last checkpoint (no result.json: a
    finished run is not resumed at all), whose checkpoint.pt is replaced by damage(its bytes)."""
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    os.remove(folder / "result.json")
    checkpoint = folder / "checkpoint.pt"
    checkpoint.write_bytes(damage(checkpoint.read_bytes()))
    return folder


def foreign_torch_file(data):
    """A file torch.load reads that train.py did not write: a bare state dict."""
    import io
    buffer = io.BytesIO()
    torch.save({"weights": torch.zeros(3)}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:len(data) // 2], "is damaged or not a checkpoint"),       # cut in half
    (lambda data: random_bytes(len(data), seed=1), "is damaged or not a checkpoint"),
    (lambda data: b"", "is damaged or not a checkpoint"),
    (foreign_torch_file, "is not a checkpoint written by train.py"),
], ids=["truncated", "random-bytes", "empty", "foreign-torch-file"])
def test_resume_from_a_damaged_checkpoint_is_exit_2_and_touches_nothing(
        finished_run, tmp_path, capsys, damage, message):
    folder = damaged_copy(finished_run, tmp_path, damage)
    before = files_of(folder)
    assert train.main(["--task", "majority", "--init", "mask", "--out", str(folder), "--resume",
                       *TINY]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"train.py: error: --resume: {folder / 'checkpoint.pt'} {message}"), line
    assert files_of(folder) == before


@pytest.mark.parametrize("flags, setting", [
    (["--task", "majority", "--init", "mask", "--dim", "16"], ("dim", "8", "16")),
    (["--task", "2parity", "--init", "mask"], ("task", "'majority'", "'2parity'")),
    (["--task", "majority", "--init", "default"], ("init", "'mask'", "'default'")),
    (["--task", "majority", "--init", "mask", "--seed", "3"], ("seed", "0", "3")),
    (["--task", "majority", "--init", "mask", "--mask-magnitude", "2"],
     ("mask_magnitude", "10.0", "2.0")),
], ids=["dim", "task", "init", "seed", "mask-magnitude"])
def test_resume_from_another_runs_checkpoint_is_exit_2_naming_the_setting(
        finished_run, tmp_path, capsys, flags, setting):
    """The checkpoint of a run with another --dim / --task / --init / ... is refused: the message
    names the file and the setting that differs, and checkpoint.pt and result.json stay as
    they were."""
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    before = files_of(folder)
    tiny = TINY[:2] + TINY[4:] if "--dim" in flags else TINY            # TINY less its --dim 8
    assert TINY[2:4] == ["--dim", "8"]
    assert train.main([*flags, "--out", str(folder), "--resume", *tiny]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"train.py: error: --resume: {folder / 'checkpoint.pt'} was written "), line
    name, theirs, ours = setting                  # "... written ... <name> <theirs>, this run
    written, this_run = line.split("this run has")  # has <ours>" (or name=value)
    assert re.search(rf"\b{name}\b", written) and theirs in written and ours in this_run, line
    assert files_of(folder) == before


# ------------------------------------------------------------------------------------------
# (c) --summarize over a folder with a damaged result.json
# ------------------------------------------------------------------------------------------

def not_ours(change):
    """result.json text of the finished run with change applied to its dict."""
    def damage(text):
        result = json.loads(text)
        change(result)
        return json.dumps(result)
    return damage


@pytest.mark.parametrize("damage", [
    lambda text: text[:len(text) // 2],                    # truncated mid-write
    lambda text: "[]",
    lambda text: "{}",
    lambda text: "null",
    lambda text: "",
    not_ours(lambda r: r.update(task="parity5")),          # every field, but no task of ours
    not_ours(lambda r: r.update(final={})),                # "done", but no metrics
], ids=["truncated", "list", "empty-dict", "null", "empty-file", "unknown-task", "final-empty"])
def test_summarize_skips_a_damaged_result_with_a_warning_and_exit_1(finished_run, tmp_path,
                                                                     capsys, damage):
    root = tmp_path / "runs"
    (root / "good").mkdir(parents=True)
    (root / "bad").mkdir()
    shutil.copy(finished_run / "result.json", root / "good" / "result.json")
    bad = root / "bad" / "result.json"
    bad.write_text(damage((finished_run / "result.json").read_text()))
    before = files_of(root)
    assert train.main(["--summarize", str(root)]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"train.py: warning: skipped {bad}: "), line
    table = (root / "table.md").read_text()
    rows = [row for row in table.splitlines() if row.startswith("| majority")]
    assert [row.split(" | ")[:3] for row in rows] == [["| majority", "mask", "1/1"]] * 2
    after = files_of(root)
    assert after.pop("table.md") and after.pop("curves.svg") and after == before


def test_summarize_with_nothing_readable_is_exit_2(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "result.json").write_text('{"task": ')
    before = files_of(tmp_path)
    assert train.main(["--summarize", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"train.py: warning: skipped {tmp_path / 'a' / 'result.json'}: ")
    assert lines[1:] == [f"train.py: error: --summarize: no readable result.json below {tmp_path}"]
    assert files_of(tmp_path) == before


# ------------------------------------------------------------------------------------------
# (d) --out naming a file
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("inits", [["mask"], ["mask", "default"]], ids=["run", "grid"])
def test_out_naming_an_existing_file_is_exit_2_and_leaves_it(tmp_path, capsys, inits):
    target = tmp_path / "notes.txt"
    target.write_text("my notes\n")
    before = files_of(tmp_path)
    assert train.main(["--task", "majority", "--init", *inits, "--out", str(target), *TINY]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"train.py: error: --out {target} is a file, not a folder: name a folder")
    assert files_of(tmp_path) == before


def test_out_below_an_existing_file_is_exit_2_and_leaves_it(tmp_path, capsys, monkeypatch):
    """--out notes.txt/run cannot be made (its parent is a file): refused like --out notes.txt,
    before any training (today: NotADirectoryError from os.makedirs in train.run)."""
    target = tmp_path / "notes.txt"
    target.write_text("my notes\n")
    before = files_of(tmp_path)
    assert train.main(["--task", "majority", "--init", "mask", "--out", str(target / "run"),
                       *TINY]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("train.py: error: --out") and str(target) in line, line
    assert files_of(tmp_path) == before


# ------------------------------------------------------------------------------------------
# (e) impossible sizes: refused before anything is allocated
# ------------------------------------------------------------------------------------------

@pytest.fixture
def no_allocation(monkeypatch):
    """Model construction fails the test: a size check must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the sizes were checked")
    for name in ("GPT", "ViT", "Transformer"):
        monkeypatch.setattr(maskprior, name, refuse)
    monkeypatch.setattr(maskprior, "impulse_mask", refuse)


def test_block_size_longer_than_a_split_is_exit_2_with_the_numbers(tmp_path, capsys, no_allocation):
    data = tasks.lm_dataset("lm")
    val = len(data["val"])
    assert val < 100_000 < len(data["train"])
    out = tmp_path / "run"
    assert train.main(["--task", "lm", "--block-size", "100000", "--iters", "1", "--out", str(out),
                       "--no-progress"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("train.py: error: --block-size 100000 "), line
    assert f"the val split holds ({val})" in line, line      # the split that is too short, its size
    assert not out.exists()


def test_attention_too_large_for_memory_is_exit_2_before_allocating(tmp_path, capsys, no_allocation):
    """A block of 20000 fits every split of the embedded corpus (val: 23313 tokens), but 64 layers
    x 64 heads x 20000 x 20000 attention maps for a batch of 100000 do not fit any machine."""
    out = tmp_path / "run"
    assert train.main(["--task", "lm", "--block-size", "20000", "--batch-size", "100000",
                       "--heads", "64", "--layers", "64", "--iters", "1", "--out", str(out),
                       "--no-progress"]) == 2
    line = one_line(capsys.readouterr().err)
    # float32 weights with gradients and Adam's moments, scores, probabilities and their gradient
    need = 4 * (4 * 12 * 64 * 128 ** 2 + 3 * 64 * 64 * 20000 ** 2 * 100000) / 2 ** 30
    assert line.startswith("train.py: error: --block-size 20000: "), line
    assert "64 layers x 64 heads x 20000 x 20000" in line and f"about {need:.0f} GiB" in line, line
    assert not out.exists()


def check_lm_sizes(block, batch=4, heads=2, layers=1, lengths=(1000, 200, 300)):
    config = {"block_size": block, "batch_size": batch, "heads": heads, "layers": layers}
    data = {split: torch.zeros(n, dtype=torch.long) for split, n in zip(("train", "val", "test"), lengths)}
    tasks.check_lm_splits(data, block)
    train.check_fits("language", {**config, "dim": 128})


def test_check_lm_sizes_on_long_streams():
    """Splits long enough for block 60000 (fake token streams): 64 x 64 heads of 60000 x 60000
    for a batch of 100000 are refused for memory, a small attention is accepted."""
    lengths = (10 ** 6, 2 * 10 ** 5, 2 * 10 ** 5)
    with pytest.raises(train.UsageError, match=r"--block-size 60000: .*64 layers x 64 heads x "
                                               r"60000 x 60000 attention maps at width 128 need "
                                               r"about \d+ GiB"):
        check_lm_sizes(60000, 100000, 64, 64, lengths)
    check_lm_sizes(64, 32, 4, 4, lengths)                    # the cpu preset's: 12 MiB


@pytest.mark.parametrize("split, length", [("train", 60), ("val", 30), ("test", 40)])
def test_check_lm_sizes_names_the_short_split_and_a_block_size_that_fits(split, length):
    lengths = {"train": 1000, "val": 200, "test": 300, split: length}
    with pytest.raises(tasks.DataError, match=rf"needs more tokens than the {split} split holds "
                                               rf"\({length}\)") as err:
        check_lm_sizes(length, lengths=tuple(lengths.values()))
    suggested = int(re.search(r"below (\d+)", str(err.value)).group(1))
    check_lm_sizes(suggested - 1, lengths=tuple(lengths.values()))   # the advice works


@pytest.mark.parametrize("args, number", [
    (["--task", "majority", "--dim", str(10 ** 12)], str(10 ** 12)),
    (["--task", "cifar10", "--image-size", "4096", "--patch-size", "4"], "4096"),
], ids=["boolean-width", "vision-image-size"])
def test_a_model_too_large_for_memory_is_exit_2_before_allocating(args, number, tmp_path, capsys,
                                                                  no_allocation, monkeypatch):
    """Like the language block size: a width or a patch grid whose weights or (L, H, N, N)
    attention cannot fit is one line, not an allocator traceback (a width of 10^12 needs 8 TB
    for the token embedding alone; a 4096 x 4096 image in 4 x 4 patches has N = 1048577
    tokens, a 12 TB impulse pattern per layer)."""
    out = tmp_path / "run"
    if "cifar10" in args:                 # a tiny CIFAR-10 that passes torchvision's MD5 check
        import torchvision.datasets.cifar
        from synthetic import write_synthetic_cifar10
        write_synthetic_cifar10(str(tmp_path), train_size=10, test_size=10)
        monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
        args = [*args, "--data-dir", str(tmp_path)]
    code = train.main([*args, "--epochs", "1", "--out", str(out), "--no-progress"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith("train.py: error:") and number in line, line
    assert not out.exists()
