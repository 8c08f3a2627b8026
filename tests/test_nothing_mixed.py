"""Nothing mixed, nothing dropped, no traceback: a run's identity holds its data (--summarize never
averages two corpora, --resume names what changed), one run per folder also without --resume,
image trees read each file once (links, loops, 16-bit and float images, names that are not
UTF-8), strict JSON with non-finite numbers, damaged result.json files skipped by name and field,
signals at any moment, the messages of the smaller findings, and output a log can follow."""
import io
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
from PIL import Image

import tasks
import train
from helpers import BOOLEAN_TINY as TINY, ROOT, files_of, one_line, result_of
from synthetic import SHAPES, write_image_tree, write_text_files

pytestmark = pytest.mark.usefixtures("one_thread")

MAJORITY = ["--task", "majority", "--init", "mask", *TINY]
TINY_TEXT = ["--task", "text", "--init", "mask", "--iters", "4", "--eval-every", "2", "--dim", "16",
             "--layers", "1", "--heads", "2", "--block-size", "16", "--batch-size", "4", "--no-progress",
             "--threads", "1"]
TINY_IMAGES = ["--task", "images", "--init", "default", "--image-size", "8", "--patch-size", "4", "--dim",
               "12", "--layers", "1", "--heads", "2", "--batch-size", "8", "--epochs", "1", "--no-progress",
               "--threads", "1"]


def strict_json(path):
    """The file parsed as strict JSON: Infinity and NaN tokens are an error."""
    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")
    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=refuse)


# ------------------------------------------------------------------------------------------
# 1. The data is part of a run's identity
# ------------------------------------------------------------------------------------------

def test_summarize_keeps_runs_on_two_corpora_apart(tmp_path, capsys):
    """Two --task text runs, same flags and seed, on two corpora: two rows with a data column, no
    "counted once"; seeds 0 and 1 on one corpus average into one row."""
    one = write_text_files(str(tmp_path / "corpus-a"))
    two = write_text_files(str(tmp_path / "corpus-b"), train_chars=4100)
    runs = tmp_path / "runs"
    for name, corpus, seed in (("a0", one, 0), ("b0", two, 0), ("a1", one, 1)):
        assert train.main([*TINY_TEXT, "--data-dir", corpus, "--seed", str(seed),
                           "--out", str(runs / name)]) == 0
    capsys.readouterr()
    assert train.main(["--summarize", str(runs)]) == 0
    assert "counted once" not in capsys.readouterr().err
    rows = [row.split(" | ") for row in (runs / "table.md").read_text().split("## Persistence")[0].splitlines()
            if row.startswith("| text")]
    header = (runs / "table.md").read_text().splitlines()[2].split(" | ")
    assert "data" in header, header
    data, seeds = header.index("data"), header.index("seeds")
    cells = sorted((row[data].split()[0], row[seeds]) for row in rows)
    assert cells == [("corpus-a", "2/2"), ("corpus-b", "1/1")], rows
    persistence = (runs / "table.md").read_text().split("## Persistence")[1].splitlines()
    assert sorted(row.split(" | ")[seeds] for row in persistence if row.startswith("| text")) == ["1/1", "2/2"]


# ------------------------------------------------------------------------------------------
# 2. One run per folder, also without --resume
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("second", [["--task", "2parity"], ["--init", "mask", "default"]],
                         ids=["another run", "a grid"])
def test_a_run_into_a_folder_holding_another_run_is_refused_and_changes_nothing(tmp_path, capsys,
                                                                               second):
    out = tmp_path / "run"
    assert train.main([*MAJORITY, "--out", str(out)]) == 0
    before = files_of(out)
    capsys.readouterr()
    code = train.main([*MAJORITY, *second, "--out", str(out)])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and files_of(out) == before, line
    if "default" in second:
        assert line == f"train.py: error: --out {out} holds a run (" + ", ".join(
            train.RUN_FILES) + "), not a grid: choose another --out for the grid"
    else:
        assert line == (f"train.py: error: --out {out} already holds a run (" + ", ".join(train.RUN_FILES)
                        + "): choose another --out, or add --resume to continue or keep it")


def test_a_single_run_into_a_grids_folder_names_the_grid_and_a_run_folder(tmp_path, capsys):
    grid = tmp_path / "grid"
    assert train.main([*MAJORITY, "--init", "mask", "default", "--out", str(grid)]) == 0
    before = files_of(grid)
    for resume in ([], ["--resume"]):
        capsys.readouterr()
        assert train.main([*MAJORITY, "--out", str(grid), *resume]) == 2
        line = one_line(capsys.readouterr().err)
        assert line == (f"train.py: error: --out {grid} holds a grid: continue the grid with its own "
                        f"command (its --task, --init, --seeds), or name one run's folder, e.g. --out "
                        f"{grid / 'majority-default-seed0'}"), line
    assert files_of(grid) == before


def test_leftover_temporary_files_are_removed_when_the_folder_is_next_locked(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("checkpoint.pt.tmp4242", "result.json.tmp7"):
        (out / name).write_bytes(b"half a file")        # as a writer killed by kill -9 leaves it
    (out / "notes.tmp").write_text("the user's")        # not write_atomic's pattern: kept
    with train.folder_lock(str(out)):
        assert sorted(os.listdir(out)) == [".lock", "notes.tmp"]


# ------------------------------------------------------------------------------------------
# 3. Image folders: each file once, nothing both trained on and held out, every mode in range
# ------------------------------------------------------------------------------------------

def image_info(data_dir):
    data = tasks.image_folder_dataset(str(data_dir), 8)
    return data, data["info"]["data"]


def test_a_symlink_loop_in_a_class_folder_reads_each_image_once(tmp_path):
    root = write_image_tree(str(tmp_path / "split"), SHAPES[:2], 4, 8, "L", eval_per_class=2)
    os.symlink(".", os.path.join(root, "train", "disc", "loop"))
    _, info = image_info(root)
    assert (info["train_images"], info["eval_images"]) == (8, 4)


def test_one_folder_layout_with_a_loop_never_trains_on_a_held_out_image(tmp_path):
    root = write_image_tree(str(tmp_path / "one"), SHAPES[:2], 10, 8, "L", layout="one folder")
    os.symlink(".", os.path.join(root, "disc", "loop"))
    data, info = image_info(root)
    assert (info["train_images"], info["eval_images"]) == (18, 2)
    real = lambda dataset: {os.path.realpath(p) for p, _ in dataset.samples}
    assert not real(data["train"]) & real(data["test"])


def test_a_held_out_file_that_is_also_trained_on_is_refused_in_one_line(tmp_path, capsys):
    root = write_image_tree(str(tmp_path / "split"), SHAPES[:2], 3, 8, "L", eval_per_class=1)
    os.symlink(os.path.join(root, "train", "disc", "0.png"), os.path.join(root, "val", "disc", "9.png"))
    assert train.main([*TINY_IMAGES, "--data-dir", root, "--out", str(tmp_path / "run")]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (f"train.py: error: images: {root}/val/disc/9.png is held out and also trained on "
                    f"(as {root}/train/disc/0.png): a file may be in one of the two only")


@pytest.mark.parametrize("mode, dark, bright, full", [
    ("I;16", 2000, 60000, 65535.0),           # 16-bit: 255 v / 65535
    ("F", 0.1, 0.9, 1.0),                     # floats in [0, 1]: 255 v
    ("F", 100.0, 50000.0, 65535.0),           # floats past 255: read in the 16-bit range
])
def test_wide_grey_images_are_scaled_to_8_bits_not_clipped(tmp_path, mode, dark, bright, full):
    """Two classes of constant images, dark and bright, in a mode wider than 8 bits: PIL's own
    convert("L") clips both to 255; read here, each is 255 v / range (to the nearest level)."""
    suffix = ".png" if mode != "F" else ".tiff"             # PNG has no float mode
    for name, value in (("dark", dark), ("bright", bright)):
        for split in ("train", "val"):
            os.makedirs(tmp_path / split / name)
            Image.new(mode, (8, 8), value).save(tmp_path / split / name / f"0{suffix}")
    data, info = image_info(tmp_path)
    assert info["channels"] == 1 and info["wide_range"] == full
    as_read = tasks.ImageFiles(data["test"].samples, data["test"].classes, "L", lambda image: image,
                               info["wide_range"])           # the PIL image before any transform
    for image, label in as_read:
        value = dark if as_read.classes[label] == "dark" else bright
        low, high = image.getextrema()
        assert low == high and abs(low - 255 * value / full) <= 1, (value, low)


def test_an_image_whose_name_is_not_utf8_is_read_and_fingerprinted(tmp_path, capsys):
    root = write_image_tree(str(tmp_path / "split"), SHAPES[:2], 4, 8, "L", eval_per_class=1)
    odd = os.path.join(root, "train", "disc", os.fsdecode(b"caf\xe9.png"))  # Latin-1, not UTF-8
    shutil.copy(os.path.join(root, "train", "disc", "0.png"), odd)
    out = tmp_path / "run"
    assert train.main([*TINY_IMAGES, "--data-dir", root, "--out", str(out)]) == 0
    result = result_of(out)
    assert result["data"]["train_images"] == 9 and "train/disc" in result["data_fingerprint"]


# ------------------------------------------------------------------------------------------
# 4. Numbers: strict JSON, non-finite values said and shown, bounded flags
# ------------------------------------------------------------------------------------------

def test_finite_replaces_every_non_finite_number_and_names_where():
    clean, bad = train.finite({"a": 1.5, "b": [float("inf"), 2], "c": {"d": float("nan"), "e": "x"}})
    assert clean == {"a": 1.5, "b": [None, 2], "c": {"d": None, "e": "x"}}
    assert bad == {"b.0": "inf", "c.d": "nan"}


def test_an_infinite_persistence_number_is_null_in_result_json_and_said_in_one_line(tmp_path, capsys):
    """--mask-lr 1e30 (two seeds) sends M to infinity: both result.json files and grid.json are
    strict JSON with mask_drift null, a warning line each says so, and the grid's tables and a
    later --summarize are written, the drift shown as n/a."""
    out = tmp_path / "grid"
    code = train.main([*MAJORITY, "--mask-lr", "1e30", "--seeds", "0", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    for seed in (0, 1):
        result = strict_json(out / f"majority-mask-seed{seed}-mlr1e+30" / "result.json")
        assert result["final"]["mask_drift"] is None and "final.mask_drift" in result["not_finite"]
        assert f"majority/mask/seed{seed}: not finite, stored as null: " in err
    strict_json(out / "grid.json")
    assert train.main(["--summarize", str(out)]) == 0
    row = next(r for r in (out / "table.md").read_text().split("## Persistence")[1].splitlines()
               if r.startswith("| majority"))
    assert row.rstrip(" |").endswith("n/a"), row


def test_tables_show_inf_and_missing_values_as_such():
    assert tasks.mean_std([1.0, 3.0]) == "2 ± 1.4"
    assert tasks.mean_std([1.0, float("inf"), None]) == "1 ± 0 (2 of 3: inf, n/a)"
    assert tasks.mean_std([None, None]) == "n/a"
    assert tasks.mean_std([1e308, 1e308]) == "overflow"


@pytest.mark.parametrize("args, message", [
    (["--mask-magnitude", "1e39"], "argument --mask-magnitude: 1e39 is too large (float32 ends at 3.4e+38)"),
    (["--lr", "1e300"], "argument --lr: 1e300 is too large (float32 ends at 3.4e+38)"),
    (["--seed", str(2 ** 70)], f"argument --seed: {2 ** 70} is too large (2^63 ends at 9.22e+18)"),
])
def test_numbers_past_float32_or_int64_are_one_line(args, message, capsys):
    assert train.main([*MAJORITY, *args]) == 2
    assert one_line(capsys.readouterr().err) == f"train.py: error: {message}"


# ------------------------------------------------------------------------------------------
# 5. --summarize skips a damaged or hand-edited result.json by name and field
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    for seed in (0, 1):
        assert train.main([*MAJORITY, "--seed", str(seed), "--out", str(root / f"s{seed}")]) == 0
    return root


@pytest.mark.parametrize("field, value, said", [
    ("seed", "one", 'field seed is "one", not a whole number >= 0'),
    ("seed", None, "field seed is null, not a whole number >= 0"),
    ("init", "magic", 'field init is "magic", not an init of train.py'),
    ("config.mask_magnitude", "ten", 'field config.mask_magnitude is "ten", not a finite number'),
    ("final.test_acc", "high", 'field final.test_acc is "high", not a number'),
])
def test_summarize_skips_a_hand_edited_result_naming_file_and_field(two_runs, tmp_path, capsys,
                                                                   field, value, said):
    root = shutil.copytree(two_runs, tmp_path / "runs")
    path = root / "s1" / "result.json"
    result = result_of(root / "s1")
    *parents, last = field.split(".")
    target = result
    for key in parents:
        target = target[key]
    target[last] = value
    path.write_text(json.dumps(result))
    capsys.readouterr()
    assert train.main(["--summarize", str(root)]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"train.py: warning: skipped {path}: damaged or not a result of train.py ({said})")
    assert "| majority | mask | 1/1 |" in (root / "table.md").read_text()


def test_summarize_reads_an_old_result_with_an_infinity_token(two_runs, tmp_path, capsys):
    root = shutil.copytree(two_runs, tmp_path / "runs")
    path = root / "s1" / "result.json"
    path.write_text(path.read_text().replace('"mask_drift": ', '"mask_drift": Infinity, "was": ', 1))
    assert train.main(["--summarize", str(root)]) == 0
    table = (root / "table.md").read_text()
    assert "(1 of 2: inf)" in table


# ------------------------------------------------------------------------------------------
# 6. Signals at any moment: one line, 130 / 143, no temporary file
# ------------------------------------------------------------------------------------------

def test_sigterm_during_summarize_is_one_line_exit_143_and_leaves_no_temporary_file(two_runs, tmp_path,
                                                                                   capsys, monkeypatch):
    """SIGTERM arrives while curves.svg's temporary file is written (after its fsync)."""
    root = shutil.copytree(two_runs, tmp_path / "runs")
    real_fsync = os.fsync

    def fsync_then_signal(fd):
        real_fsync(fd)
        if any(name.startswith("curves.svg.tmp") for name in os.listdir(root)):
            signal.raise_signal(signal.SIGTERM)
    monkeypatch.setattr(os, "fsync", fsync_then_signal)
    assert train.main(["--summarize", str(root)]) == 143
    assert one_line(capsys.readouterr().err) == (
        f"train.py: interrupted while summarizing {root}; its tables are as they were")
    assert not [name for name in os.listdir(root) if ".tmp" in name]


def caught_signals(pid):
    """The signals process pid has handlers for (/proc/PID/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    return {s for s in (signal.SIGINT, signal.SIGTERM) if mask >> (s - 1) & 1}


def test_sigint_while_torch_imports_is_one_line_exit_130():
    """The signal comes as soon as train.py's first lines have set its handlers (Python itself
    catches only SIGINT; SIGTERM caught means ours are set), while torch imports (seconds)."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--task", "majority"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while signal.SIGTERM not in caught_signals(proc.pid):
        assert proc.poll() is None
        time.sleep(0.001)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and out == ""
    assert one_line(err) == "train.py: interrupted while starting; nothing was written"


# ------------------------------------------------------------------------------------------
# 7. --resume of an images run: content, not modification times; what changed, in words
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def images_run(tmp_path_factory):
    """A finished 2-epoch images run (then its result.json removed: as if killed at epoch 2)."""
    root = tmp_path_factory.mktemp("images")
    data = write_image_tree(str(root / "data"), SHAPES[:2], 6, 8, "L", eval_per_class=2)
    out = root / "run"
    assert train.main([*TINY_IMAGES, "--epochs", "2", "--data-dir", data, "--out", str(out)]) == 0
    os.remove(out / "result.json")
    return root


def test_resume_accepts_a_copied_and_touched_image_tree(images_run, tmp_path):
    out = shutil.copytree(images_run / "run", tmp_path / "run")
    copy = shutil.copytree(images_run / "data", tmp_path / "copy", copy_function=shutil.copyfile)
    os.utime(copy / "train" / "disc" / "0.png", (0, 0))
    assert train.main([*TINY_IMAGES, "--epochs", "2", "--data-dir", str(copy), "--out", str(out),
                       "--resume"]) == 0


def test_resume_names_the_class_folder_that_gained_images(images_run, tmp_path, capsys):
    out = shutil.copytree(images_run / "run", tmp_path / "run")
    data = shutil.copytree(images_run / "data", tmp_path / "data")
    for n in range(3):
        shutil.copy(data / "train" / "ring" / "0.png", data / "train" / "ring" / f"new{n}.png")
    before = files_of(out)
    assert train.main([*TINY_IMAGES, "--epochs", "2", "--data-dir", str(data), "--out", str(out),
                       "--resume"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"train.py: error: --resume: {out / 'checkpoint.pt'} was written by a run on other data: 3 "
        f"images added under train/ring: use the same data, or another --out")
    assert files_of(out) == before


# ------------------------------------------------------------------------------------------
# 8. The smaller findings: each message names the real cause
# ------------------------------------------------------------------------------------------

def test_a_full_disk_before_training_is_exit_2(tmp_path, capsys, monkeypatch):
    real = train.save_checkpoint

    def no_space(path, state):
        raise train.WriteError(path, OSError(28, "No space left on device"))
    monkeypatch.setattr(train, "save_checkpoint", no_space)      # attention_before.pt, at the start
    out = tmp_path / "run"
    assert train.main([*MAJORITY, "--out", str(out)]) == 2
    assert one_line(capsys.readouterr().err).startswith(
        f"train.py: error: cannot write {out / 'attention_before.pt'}: No space left on device")


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "100000000000"], "--batch-size 100000000000: "),
    (["--task", "addition", "--train-frac", "1e-300"],
     "--train-frac 1e-300 trains on 0 of the 1,000,000 pairs, holds out 1,000,000: both need one or "
     "more (from 1e-06 to 0.999999)"),
])
def test_messages_name_the_flag_at_fault(args, message, capsys):
    assert train.main([*MAJORITY, *args]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"train.py: error: {message}"), line


def test_a_dangling_out_link_and_a_bpe_folder_are_named(tmp_path, capsys):
    link = tmp_path / "link"
    os.symlink(tmp_path / "gone", link)
    assert train.main([*MAJORITY, "--out", str(link)]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"train.py: error: --out {link}: {link} is a link to {tmp_path / 'gone'}, which does not "
        f"exist: make its target, or name another folder")
    corpus = write_text_files(str(tmp_path / "corpus"))
    assert train.main([*TINY_TEXT, "--data-dir", corpus, "--bpe-file", str(tmp_path),
                       "--out", str(tmp_path / "run")]) == 2
    assert one_line(capsys.readouterr().err).startswith(
        f"train.py: error: --bpe-file {tmp_path} is a folder: name the ranks file in it")


# ------------------------------------------------------------------------------------------
# 9. Output a log can follow; threads that fit the machine
# ------------------------------------------------------------------------------------------

def test_a_log_gets_a_first_line_and_one_line_per_evaluation(tmp_path):
    """stdout a pipe (not a terminal): no progress bar, the first line says device, threads,
    preset and folder, then a line per evaluation (epochs 2, 4, 5 of --eval-every 2)."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *MAJORITY, "--epochs", "5",
                           "--eval-every", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"train.py: 1 run of majority on cpu, 1 thread (--threads), preset cpu; "
                        f"results in {out}")
    evaluations = [re.fullmatch(r"majority/mask/seed0 epoch (\d)/5: train loss \S+, test acc \(%\) "
                                r"\d+(\.\d+)?, \d+ s", line) for line in lines[1:4]]
    assert all(evaluations) and [int(m.group(1)) for m in evaluations] == [2, 4, 5], lines
    assert "\r" not in proc.stdout + proc.stderr            # no bar


def no_proc_stat(path):
    raise OSError("no /proc/stat here")


@pytest.mark.parametrize("cores, busy, threads", [(2, 0.1, 2), (2, 1.2, 1), (2, 6.7, 1), (8, 3.0, 5)])
def test_threads_are_the_cores_other_jobs_leave_free(monkeypatch, cores, busy, threads):
    """Without /proc/stat the busy cores are the 1-minute load average; the threads: the cores left,
    at least one, at most torch's own default."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(train, "open", no_proc_stat, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, 0.0, 0.0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)       # torch's own default, the cap
    assert train.choose_threads(None, torch.device("cpu")) == (
        threads, f"{threads} thread{'s' * (threads > 1)} ({cores} cores, {busy:.1f} busy)")
    assert train.choose_threads(3, torch.device("cpu")) == (3, "3 threads (--threads)")


def test_busy_cores_are_the_share_of_time_not_idle_over_the_sample(monkeypatch):
    """Two readings of /proc/stat's cpu line (user nice system idle iowait ...) half a second apart:
    1000 jiffies pass, 250 of them idle or waiting on I/O, so 3 of 4 cores are busy and 1 is free."""
    readings = iter(["cpu  100 0 100 700 100 0 0\n", "cpu  500 0 450 900 150 0 0\n"])
    pauses = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr(train, "open", lambda path: io.StringIO(next(readings)), raising=False)
    monkeypatch.setattr(train.time, "sleep", pauses.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert train.choose_threads(None, torch.device("cpu")) == (1, "1 thread (4 cores, 3.0 busy)")
    assert sum(pauses) == 0.5


def test_resume_without_threads_keeps_the_checkpoints_thread_count(tmp_path, monkeypatch):
    at = MAJORITY.index("--threads")
    args = MAJORITY[:at] + MAJORITY[at + 2:] + ["--epochs", "2", "--eval-every", "1"]
    out = tmp_path / "run"
    monkeypatch.setattr(train, "choose_threads", lambda given, device: (1, "1 thread"))
    assert train.main([*args, "--out", str(out)]) == 0
    os.remove(out / "result.json")
    monkeypatch.setattr(train, "choose_threads", lambda given, device: (2, "2 threads"))
    assert train.main([*args, "--out", str(out), "--resume"]) == 0
    assert result_of(out)["threads"] == 1


# ------------------------------------------------------------------------------------------
# 10. table.md: "on target" only for seeds that fit their training set
# ------------------------------------------------------------------------------------------

def test_a_constant_predictor_is_not_counted_as_on_the_target():
    """2parity's seen targets have variance 8/9 (x0 x1 is -1 on 1 of the 3 seen quarters): a run
    at that training MSE predicts a constant, whatever its accuracy; fitted: below 1 % of it. The
    table's "on target" column counts the seeds on the target, by tasks.on_target."""
    threshold = 0.01 * 8 / 9
    for loss, fits in ((threshold * (1 - 1e-6), True), (threshold * (1 + 1e-6), False)):
        assert tasks.on_target({"task": "2parity", "final": {"train_loss": loss, "test_acc": 100.0}}) == fits
    def run(seed, train_loss):
        return {"task": "2parity", "init": "mask", "seed": seed, "status": "done", "config": {},
                "final": {"train_loss": train_loss, "test_acc": 100.0}}
    table, _ = tasks.result_tables([run(0, 1e-4), run(1, 0.889)], list(train.INITS))
    header, _, row = table.splitlines()[2:5]
    assert row.split(" | ")[header.split(" | ").index("on target")] == "1/2"
