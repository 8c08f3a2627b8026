"""Timing helpers shared by tests/bench_peers.py and tests/bench_attention_paths.py (not a test).

On a small machine shared with other jobs, a timing taken while another process ran is worthless
at 2 threads: OpenMP's threads wait at every barrier for the one the other process pushed off its
core. `timed` therefore also reports how many cores other processes used meanwhile (Linux: busy
jiffies of the machine in /proc/stat minus this process's own in /proc/self/stat), and
`clean_rounds` keeps timing until it has enough rounds taken while the rest of the machine was
idle (other processes below `max_other` cores on average).
"""
import os
import time

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _jiffies():
    """(busy jiffies of the whole machine, jiffies of this process), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return user + nice + system + irq + softirq + steal, int(fields[11]) + int(fields[12])


def timed(fn):
    """Run fn(); (wall seconds, cores other processes used meanwhile, None if unknown)."""
    before = _jiffies()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    after = _jiffies()
    if before is None or after is None:
        return seconds, None
    other = (after[0] - before[0]) - (after[1] - before[1])
    return seconds, max(0, other) / TICKS / seconds


def clean_rounds(fns, repeats, max_other=0.15, max_rounds=None):
    """Time every fn of the dict fns once per round, in turn (the first one rotating each round),
    until `repeats` rounds were clean (other processes below max_other cores during each of the
    round's samples) or max_rounds rounds have run (default 10 x repeats). Returns (clean rounds,
    all rounds), each a list of {name: seconds}; a round's samples were taken side by side, so
    ratios within a round are paired and slow drifts of the machine cancel out of them."""
    names = list(fns)
    clean, every = [], []
    for r in range(max_rounds or 10 * repeats):
        if len(clean) >= repeats:
            break
        times, dirty = {}, False
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, other = timed(fns[name])
            times[name] = seconds
            dirty = dirty or (other is not None and other > max_other)
        every.append(times)
        if not dirty:
            clean.append(times)
    return clean, every
