"""No run mixes, loses or misreports data: one writer per folder (a lock, tried with two real
processes), --resume checks the config and the data it continues and leaves a finished run as it
is, repeated grid values are merged, --summarize never averages different configs, a failed
write (a fault injected at the write) and an interruption (SIGINT / SIGTERM) each end in one
line, keep the last good checkpoint, and resume to the uninterrupted run's numbers."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from helpers import (BOOLEAN_TINY as TINY, ROOT, files_of, interrupt_then_resume, one_line, result_of, runs_of,
                     same_weights, train_raising)
from synthetic import write_text_files, write_tiny_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

MAJORITY = ["--task", "majority", "--init", "mask", *TINY]
# 6 optimizer steps an epoch (24576 seen points in batches of 4096), so a signal can come mid-epoch
SIX_STEPS = ["--task", "majority", "--init", "mask", *TINY, "--batch-size", "4096"]


def train_py(*args):
    """`python train.py *args` started in the background (one thread), output piped."""
    env = {key: value for key, value in os.environ.items() if key != "TIKTOKEN_CACHE_DIR"}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args, "--threads", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path, proc, limit=300):
    """Until path exists (the process is then past that point), or fail if the process ends."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear in {limit} s"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------
# 1. One writer per folder
# ------------------------------------------------------------------------------------------

def test_a_second_run_on_a_busy_folder_is_refused_and_kill_9_frees_it(tmp_path, capsys):
    """Process A trains (a run that would take hours); B, this test's process, on A's folder
    exits 2 naming A's pid, and leaves A running; A killed with SIGKILL leaves its .lock file,
    which the OS has unlocked: the next run on the folder is refused for A's files, not the lock,
    and goes ahead once they are gone."""
    out = tmp_path / "run"
    a = train_py(*MAJORITY, "--epochs", "100000", "--eval-every", "1", "--out", str(out))
    try:
        wait_for(out / "checkpoint.pt", a)
        assert train.main([*MAJORITY, "--init", "default", "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and one_line(captured.err) == (
            f"train.py: error: {out} is in use by another train.py run (pid {a.pid}): wait for it "
            f"to end, or choose another --out")
        assert a.poll() is None
    finally:
        a.kill()
        a.communicate()
    assert (out / ".lock").read_text() == f"{a.pid}\n"        # left behind by kill -9
    capsys.readouterr()
    assert train.main([*MAJORITY, "--init", "default", "--out", str(out)]) == 2
    assert "already holds a run (checkpoint.pt, " in one_line(capsys.readouterr().err)
    for name in train.RUN_FILES:
        if (out / name).exists():
            os.remove(out / name)
    assert train.main([*MAJORITY, "--init", "default", "--out", str(out)]) == 0
    assert result_of(out)["init"] == "default"
    assert not (out / ".lock").exists()


def test_sigterm_to_a_real_run_is_one_line_exit_143_and_a_checkpoint_of_that_step(tmp_path):
    out = tmp_path / "run"
    a = train_py(*MAJORITY, "--epochs", "100000", "--eval-every", "1", "--out", str(out))
    try:
        wait_for(out / "checkpoint.pt", a)
        a.send_signal(signal.SIGTERM)
        stdout, stderr = a.communicate(timeout=300)
    finally:
        a.kill()
    assert a.returncode == 143
    line = one_line(stderr)
    match = re.fullmatch(rf"train.py: interrupted at epoch (\d+) \(step (\d+)\); the checkpoint of "
                         rf"epoch \1 \(step \2\) is kept in {out}: rerun with --resume", line)
    assert match, line
    saved = torch.load(out / "checkpoint.pt", weights_only=False)
    assert saved["state"]["step"] == int(match.group(2))
    assert not (out / ".lock").exists() and not [p for p in os.listdir(out) if ".tmp" in p]


def test_a_held_folder_refuses_runs_and_grids_other_folders_run_side_by_side(tmp_path, capsys):
    busy, free = tmp_path / "busy", tmp_path / "free"
    with train.folder_lock(str(busy)):
        assert train.main([*MAJORITY, "--out", str(free)]) == 0
        for inits in (["mask"], ["mask", "default"]):              # a run, a grid
            capsys.readouterr()
            assert train.main([*MAJORITY, "--init", *inits, "--out", str(busy)]) == 2
            assert one_line(capsys.readouterr().err) == (
                f"train.py: error: {busy} is in use by another train.py run (pid {os.getpid()}): "
                f"wait for it to end, or choose another --out")
        assert os.listdir(busy) == [".lock"]
    assert not busy.exists()       # the lock made the folder, nothing was written: gone


# ------------------------------------------------------------------------------------------
# 2. --resume checks the data; a finished run is left as it is
# ------------------------------------------------------------------------------------------

TINY_TEXT = ["--task", "text", "--init", "mask", "--iters", "4", "--eval-every", "2", "--dim", "16",
             "--layers", "1", "--heads", "2", "--block-size", "16", "--batch-size", "4", "--no-progress"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A finished --task text run on DIR/corpus, byte tokens."""
    root = tmp_path_factory.mktemp("text")
    corpus = write_text_files(str(root / "corpus"))
    assert train.main([*TINY_TEXT, "--data-dir", corpus, "--out", str(root / "run")]) == 0
    return root


@pytest.mark.parametrize("change, message", [
    ("other text", ": train.txt differs: "),
    ("bpe file", ": --bpe-file: none before, one now: "),
])
def test_resume_on_other_data_is_exit_2_naming_the_file_and_touches_nothing(text_run, tmp_path,
                                                                            capsys, change, message):
    """The same flags, but another --data-dir whose train.txt differs by one character, or a
    --bpe-file the run did not have: refused in one line, every file left as it was."""
    run = tmp_path / "run"
    shutil.copytree(text_run / "run", run)
    corpus = str(text_run / "corpus")
    flags = ["--data-dir", corpus]
    if change == "other text":
        corpus = shutil.copytree(corpus, tmp_path / "other")
        text = (corpus / "train.txt").read_text()
        (corpus / "train.txt").write_text(text[:-1] + "!")
        flags = ["--data-dir", str(corpus)]
    else:
        flags += ["--bpe-file", write_tiny_ranks(tmp_path / "gpt2.tiktoken")]
    before = files_of(run)
    assert train.main([*TINY_TEXT, *flags, "--out", str(run), "--resume"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"train.py: error: --resume: {run / 'checkpoint.pt'} was written by a run "
                           f"on other data: "), line
    assert message in line and line.endswith(": use the same data, or another --out"), line
    assert files_of(run) == before


def test_resume_on_a_copy_of_the_same_data_elsewhere_is_accepted(text_run, tmp_path, capsys):
    """The fingerprint is the files' content below --data-dir, not where they are: an identical
    copy is the same data (here: a finished run, so nothing to do)."""
    run = tmp_path / "run"
    shutil.copytree(text_run / "run", run)
    copy = shutil.copytree(text_run / "corpus", tmp_path / "copy")
    assert train.main([*TINY_TEXT, "--data-dir", str(copy), "--out", str(run), "--resume"]) == 0
    assert "already finished" in capsys.readouterr().out


def test_the_fingerprint_is_in_result_json_and_the_checkpoint(text_run):
    result = result_of(text_run / "run")
    saved = torch.load(text_run / "run" / "checkpoint.pt", weights_only=False)
    assert set(result["data_fingerprint"]) == {"train.txt", "valid.txt", "--bpe-file"}
    assert result["data_fingerprint"]["train.txt"].startswith("sha256 ")
    assert saved["meta"]["data_fingerprint"] == result["data_fingerprint"]


@pytest.mark.parametrize("family_args", [MAJORITY, ["--task", "addition", "--init", "mask", *TINY,
                                                    "--train-frac", "0.01", "--eval-size", "100"]],
                         ids=["boolean", "arithmetic"])
def test_generated_data_other_than_the_checkpoints_is_refused(family_args, tmp_path, capsys,
                                                              monkeypatch):
    """Boolean and arithmetic data are built from the task, fraction and seed: their tensors'
    hash is checked too (here: a train set that differs in one label)."""
    out = tmp_path / "run"
    assert train.main([*family_args, "--out", str(out), "--epochs", "2", "--eval-every", "1"]) == 0
    os.remove(out / "result.json")                        # as if killed after its last checkpoint
    before = files_of(out)
    name = "boolean_dataset" if "majority" in family_args else "arithmetic_dataset"
    real = getattr(train.tasks, name)

    def one_label_changed(*args, **kwargs):
        data = dict(real(*args, **kwargs))              # a copy: the loader keeps its own (cached)
        data["y_train"] = data["y_train"].clone()
        data["y_train"][0] = -data["y_train"][0] if name == "boolean_dataset" else 9 - data["y_train"][0]
        return data
    monkeypatch.setattr(train.tasks, name, one_label_changed)
    assert train.main([*family_args, "--out", str(out), "--epochs", "2", "--eval-every", "1",
                       "--resume"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "was written by a run on other data: train set differs: " in line, line
    assert files_of(out) == before


def test_resume_of_a_finished_run_says_so_and_leaves_every_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main([*MAJORITY, "--out", str(out)]) == 0
    before = files_of(out)
    capsys.readouterr()
    assert train.main([*MAJORITY, "--out", str(out), "--resume"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1:] == [f"majority/mask/seed0: already finished, nothing to "
                                             f"resume; {out} is left as it was"] and captured.err == ""
    assert files_of(out) == before


# ------------------------------------------------------------------------------------------
# 3. Repeated grid values are merged
# ------------------------------------------------------------------------------------------

def test_repeated_seeds_train_once_with_a_note_and_the_table_counts_them_once(tmp_path, capsys):
    assert train.main([*MAJORITY, "--seeds", "0", "1", "0", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "train.py: note: --seeds 0 is given more than once; each run is trained once\n"
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert [r["seed"] for r in grid] == [0, 1]
    rows = [r for r in (tmp_path / "table.md").read_text().splitlines() if r.startswith("| majority")]
    assert all(" | 2/2 | " in row for row in rows) and len(rows) == 2


def test_every_grid_flag_merges_its_repeats_with_one_note_each(capsys):
    runs = runs_of("--task", "addition", "addition", "--init", "mask", "mask-fixed", "mask", "--seeds", "3", "3",
                   "--train-frac", "0.1", "0.10", "--mask-magnitude", "2", "2.0", "--mask-decay", "0", "0",
                   "--mask-error", "none", "missing:0.1", "missing:0.10", "--mask-lr", "0.01", "0.01")
    # every value once: mask at both errors, mask-fixed (no trained M, so no mask lr) at both errors
    assert [(r.task, r.init, r.seed, r.config["train_frac"], r.config["mask_magnitude"], r.config["mask_decay"],
             r.config["mask_error"], r.config["mask_lr"]) for r in runs] == [
        ("addition", init, 3, 0.1, 2.0, 0.0, error, 0.01 if init == "mask" else None)
        for error in (None, "missing:0.1") for init in ("mask", "mask-fixed")]
    assert len({r.folder for r in runs}) == len(runs)
    notes = capsys.readouterr().err.splitlines()
    assert notes == [f"train.py: note: --{flag} {value} is given more than once; each run is trained once"
                     for flag, value in (("task", "addition"), ("init", "mask"), ("seeds", "3"),
                                         ("train-frac", "0.1"), ("mask-magnitude", "2"),
                                         ("mask-decay", "0"), ("mask-error", "missing:0.1"),
                                         ("mask-lr", "0.01"))]


# ------------------------------------------------------------------------------------------
# 4. --summarize never averages different configs
# ------------------------------------------------------------------------------------------

def test_summarize_shows_each_config_as_its_own_row_and_counts_a_copy_once(tmp_path, capsys):
    """A 1-epoch and a 2-epoch seed-0 run, a 2-epoch seed-1 run, and a copy of the 2-epoch seed-0
    folder: two rows, epochs 1 (1/1) and 2 (2/2) in an "epochs" column, and a warning for the copy."""
    for folder, flags in (("e1", ["--epochs", "1"]), ("e2", ["--epochs", "2"]),
                          ("e2s1", ["--epochs", "2", "--seed", "1"])):
        assert train.main([*MAJORITY, *flags, "--out", str(tmp_path / folder)]) == 0
    shutil.copytree(tmp_path / "e2", tmp_path / "e2copy")
    capsys.readouterr()
    assert train.main(["--summarize", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err == (f"train.py: warning: {tmp_path / 'e2copy' / 'result.json'} is the run of "
                   f"{tmp_path / 'e2' / 'result.json'} again (same task, init, seed, config and "
                   f"data): counted once\n")
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("## Boolean tasks (Section 5.1, Table 1)\n\n| task | init | epochs | seeds | train loss |")
    rows = [row.split(" | ")[:4] for row in table.splitlines() if row.startswith("| majority")]
    assert rows == [["| majority", "mask", "1", "1/1"], ["| majority", "mask", "2", "2/2"]] * 2
    curves = (tmp_path / "curves.svg").read_text()
    assert "mask, epochs 1 (1 seed)" in curves and "mask, epochs 2 (2 seeds)" in curves


def test_summarize_of_a_path_that_does_not_exist_is_one_line(tmp_path, capsys):
    assert train.main(["--summarize", str(tmp_path / "nowhere")]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"train.py: error: --summarize {tmp_path / 'nowhere'}: no such folder")


# ------------------------------------------------------------------------------------------
# 5. Write failures: one line, no temporary files, the last good checkpoint kept
# ------------------------------------------------------------------------------------------

class FullDisk:
    """A file opened for writing whose write stores half the bytes, then fails with ENOSPC."""
    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def disk_full_at(monkeypatch, name, count=1):
    """train.py's writes of the file `name` fail (FullDisk) from its count-th write on."""
    writes = []

    def opener(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if "w" in mode and os.path.basename(str(path)).startswith(name + ".tmp"):
            writes.append(path)
            if len(writes) >= count:
                return FullDisk(f)
        return f
    monkeypatch.setattr(train, "open", opener, raising=False)


def test_a_full_disk_mid_run_is_one_line_exit_1_and_keeps_the_last_checkpoint(tmp_path, capsys,
                                                                            monkeypatch):
    """The checkpoint of epoch 2 cannot be written: exit 1, one line naming the file and the
    cause and what is kept; no temporary file; checkpoint.pt is epoch 1's, from which --resume
    ends where the uninterrupted run does. Then the same at the resumed run's result.json."""
    args = [*SIX_STEPS, "--epochs", "3", "--eval-every", "1"]
    assert train.main([*args, "--out", str(tmp_path / "whole")]) == 0
    out = tmp_path / "run"
    disk_full_at(monkeypatch, "checkpoint.pt", count=2)
    capsys.readouterr()
    assert train.main([*args, "--out", str(out)]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"train.py: error: cannot write {out / 'checkpoint.pt'}: No space left on device; the "
        f"checkpoint of epoch 1 (step 6) is kept in {out}: rerun with --resume")
    assert not [p for p in os.listdir(out) if ".tmp" in p] and not (out / "result.json").exists()
    assert torch.load(out / "checkpoint.pt", weights_only=False)["state"]["round"] == 1
    disk_full_at(monkeypatch, "result.json")
    assert train.main([*args, "--out", str(out), "--resume"]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"train.py: error: cannot write {out / 'result.json'}: No space left on device; the "
        f"checkpoint of epoch 3 (step 18) is kept in {out}: rerun with --resume")
    assert not [p for p in os.listdir(out) if ".tmp" in p] and not (out / "result.json").exists()
    monkeypatch.undo()
    assert train.main([*args, "--out", str(out), "--resume"]) == 0
    whole, resumed = (result_of(tmp_path / run) for run in ("whole", "run"))
    assert resumed["history"] == whole["history"] and resumed["final"] == whole["final"]


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
@pytest.mark.parametrize("where", ["folder", "lock file"])
def test_an_output_folder_that_cannot_be_written_is_exit_2_and_one_line(tmp_path, capsys, monkeypatch,
                                                                       code, where):
    """A read-only parent (the folder cannot be made) or a read-only --out (the lock file cannot
    be made), injected: CI runs as root, which chmod does not stop. Nothing is written."""
    out = tmp_path / "run"
    failing = str(out) if where == "folder" else str(out / ".lock")
    real = {"folder": os.makedirs, "lock file": os.open}[where]

    def refuse(path, *args, **kwargs):
        if str(path) == failing:
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "makedirs" if where == "folder" else "open", refuse)
    assert train.main([*MAJORITY, "--out", str(out)]) == 2
    assert one_line(capsys.readouterr().err) == f"train.py: error: cannot write {failing}: {os.strerror(code)}"
    assert not out.exists() if where == "folder" else os.listdir(out) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("read_only", ["out", "parent"])
def test_read_only_folders_for_real(tmp_path, capsys, read_only):
    """As a user other than root: a read-only --out, or --out below a read-only folder."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    out = folder if read_only == "out" else folder / "run"
    try:
        assert train.main([*MAJORITY, "--out", str(out)]) == 2
        assert one_line(capsys.readouterr().err) == (
            f"train.py: error: cannot write {out / '.lock' if read_only == 'out' else out}: "
            f"Permission denied")
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o700)


def test_a_name_over_255_bytes_is_exit_2_and_one_line(tmp_path, capsys):
    out = tmp_path / ("a" * 300) / "run"
    assert train.main([*MAJORITY, "--out", str(out)]) == 2
    assert one_line(capsys.readouterr().err) == f"train.py: error: --out {out}: File name too long"


def test_write_atomic_removes_its_temporary_file_on_any_failure(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    path.write_text("the good one\n")
    disk_full_at(monkeypatch, "result.json")
    with pytest.raises(train.WriteError, match=f"cannot write {path}: No space left on device"):
        train.write_atomic(str(path), "x" * 1000)
    monkeypatch.undo()

    def interrupted_rename(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", interrupted_rename)
    with pytest.raises(KeyboardInterrupt):
        train.write_atomic(str(path), "y" * 1000)
    assert os.listdir(tmp_path) == ["result.json"] and path.read_text() == "the good one\n"


# ------------------------------------------------------------------------------------------
# 6. Ctrl-C and SIGTERM: one line, a checkpoint of that step, an exact resume
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_epoch_before_the_first_checkpoint_resumes_exactly(tmp_path, monkeypatch, capsys,
                                                                       signum):
    """--epochs 2 with --eval-every 5: no checkpoint before the end. A signal during step 3 (of 6
    in epoch 1) stops after that step with a checkpoint of it, and --resume ends with the
    uninterrupted run's history, metrics and weights."""
    args = [*SIX_STEPS, "--epochs", "2", "--eval-every", "5"]
    whole, resumed, line, weights = interrupt_then_resume(args, tmp_path, monkeypatch, capsys, 3, signum)
    assert line == (f"train.py: interrupted at epoch 1 (step 3); the checkpoint of epoch 1 (step 3) "
                    f"is kept in {tmp_path / 'stopped'}: rerun with --resume")
    assert resumed["history"] == whole["history"] and resumed["final"] == whole["final"]
    assert same_weights(*weights)


def test_a_signal_in_the_last_step_of_an_epoch_resumes_exactly(tmp_path, monkeypatch, capsys):
    args = [*SIX_STEPS, "--epochs", "2", "--eval-every", "1"]
    whole, resumed, line, weights = interrupt_then_resume(args, tmp_path, monkeypatch, capsys, 6)
    assert "interrupted at epoch 1 (step 6); the checkpoint of epoch 1 (step 6) is kept" in line
    assert resumed["history"] == whole["history"] and resumed["final"] == whole["final"]
    assert same_weights(*weights)


def test_a_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """Two signals in step 8 (epoch 2): the second stops inside the step, no checkpoint of it;
    checkpoint.pt stays epoch 1's, from which --resume ends as the uninterrupted run."""
    args = [*SIX_STEPS, "--epochs", "2", "--eval-every", "1"]
    assert train.main([*args, "--out", str(tmp_path / "whole")]) == 0
    real_train = train.train
    monkeypatch.setattr(train, "train", train_raising(real_train, 8, signal.SIGINT, signal.SIGINT))
    out = tmp_path / "run"
    capsys.readouterr()
    assert train.main([*args, "--out", str(out)]) == 130
    assert one_line(capsys.readouterr().err) == (
        f"train.py: interrupted at epoch 2 (step 7); the checkpoint of epoch 1 (step 6) is kept in "
        f"{out}: rerun with --resume")
    assert torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"] == 6
    monkeypatch.setattr(train, "train", real_train)
    assert train.main([*args, "--out", str(out), "--resume"]) == 0
    whole, resumed = (result_of(tmp_path / run) for run in ("whole", "run"))
    assert resumed["history"] == whole["history"] and resumed["final"] == whole["final"]


@pytest.mark.parametrize("grid", [False, True])
def test_a_signal_before_training_says_there_is_nothing_to_resume(tmp_path, monkeypatch, capsys, grid):
    real_setup = train.FAMILIES["boolean"]["setup"]

    def setup_then_signal(*args):
        signal.raise_signal(signal.SIGTERM)
        return real_setup(*args)
    monkeypatch.setitem(train.FAMILIES["boolean"], "setup", setup_then_signal)
    out = tmp_path / "run"
    inits = ["mask", "default"] if grid else ["mask"]
    assert train.main([*MAJORITY, "--init", *inits, "--out", str(out)]) == 143
    folder = out / "majority-mask-seed0" if grid else out
    advice = (f"{folder} has no checkpoint yet and starts over: rerun with --resume" if grid else
              "no checkpoint was written, nothing to resume: rerun without --resume")
    assert one_line(capsys.readouterr().err) == f"train.py: interrupted before training started; {advice}"
    assert not [p for p in out.rglob("*") if p.is_file()]        # not even the lock file
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL      # the handlers are put back
