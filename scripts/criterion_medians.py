#!/usr/bin/env python3
"""Collect the `overhead` criterion benchmark over several runs and print medians.

    cargo bench -p idempotent-runtime --bench overhead --no-run
    python3 scripts/criterion_medians.py 3        # runs the bench 3 times, then prints the table

Each run's estimate is criterion's median time per call (target/criterion/<group>/<bench>/new/
estimates.json); the table gives the median of those over the runs, their range, and the
overhead of `#[idempotent]` and of the naive approach over the bare fn, computed within each run.
A second table gives `#[idempotent]` over the naive map, taken within each run: each run's value
and their median (the ratio issue 23 sets its targets in). Standard library only.
"""

import json
import os
import statistics
import subprocess
import sys

GROUPS = ["first_execution", "replay", "contention"]
BENCHES = ["bare", "idempotent_memory", "naive_check_execute_insert"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def estimate(group, bench):
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    path = os.path.join(target, "criterion", group, bench, "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["median"]["point_estimate"]


def main(argv):
    runs = int(argv[1]) if len(argv) > 1 else 3
    results = []  # one {(group, bench): ns} per run
    for run in range(runs):
        print(f"run {run + 1}/{runs} ...", file=sys.stderr)
        subprocess.run(
            ["cargo", "bench", "-q", "-p", "idempotent-runtime", "--bench", "overhead"],
            cwd=ROOT,
            check=True,
            stdout=sys.stderr,
        )
        results.append({(g, b): estimate(g, b) for g in GROUPS for b in BENCHES})

    def med(f):
        values = [f(r) for r in results]
        return statistics.median(values), min(values), max(values)

    print(f"| group | bench | median ns/call ({runs} runs) | range | over bare (median of per-run differences) |")
    print("|---|---|---:|---:|---:|")
    for g in GROUPS:
        for b in BENCHES:
            m, lo, hi = med(lambda r: r[(g, b)])
            if b == "bare":
                over = "—"
            else:
                d, dlo, dhi = med(lambda r: r[(g, b)] - r[(g, "bare")])
                over = f"{d:.1f} ns ({dlo:.1f} to {dhi:.1f})"
            print(f"| {g} | {b} | {m:.1f} | {lo:.1f} to {hi:.1f} | {over} |")

    print()
    print("| group | `#[idempotent]` ÷ naive map (median) | per run |")
    print("|---|---:|---|")
    for g in GROUPS:
        ratios = [r[(g, "idempotent_memory")] / r[(g, "naive_check_execute_insert")] for r in results]
        per_run = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"| {g} | {statistics.median(ratios):.2f} | {per_run} |")


if __name__ == "__main__":
    main(sys.argv)
