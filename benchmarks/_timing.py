"""Interleaved timing: the median ratio of two measurements taken in alternation."""

import statistics
import time


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_ratio(candidate, baseline, repeats=15, warmup=2):
    """Median over `repeats` of time(candidate) / time(baseline), taken back to back."""
    for _ in range(warmup):
        candidate()
        baseline()
    ratios, cand, base = [], [], []
    for i in range(repeats):
        # Alternate which goes first, so drift and cache effects hit both alike.
        if i % 2:
            b = timed(baseline)
            c = timed(candidate)
        else:
            c = timed(candidate)
            b = timed(baseline)
        ratios.append(c / b)
        cand.append(c)
        base.append(b)
    return statistics.median(ratios), statistics.median(cand), statistics.median(base)


def report(label, goal, ratio, cand, base, unit="ms", scale=1e3):
    print(
        f"{label:<58} {ratio:6.3f}  (goal {goal})   "
        f"{cand * scale:9.3f} {unit} vs {base * scale:9.3f} {unit}"
    )


def interleaved_medians(runs: dict, repeats: int, warmup: bool = True) -> dict:
    """Each run's median time over `repeats` rounds, the runs taken in turn, the order rotated
    each round (so drift and cache effects hit them alike); first one round unmeasured."""
    if warmup:
        for run in runs.values():
            run()
    names = list(runs)
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(runs[name]))
    return {name: statistics.median(t) for name, t in times.items()}
