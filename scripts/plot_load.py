#!/usr/bin/env python3
"""Plot the load program's CSV as one SVG, with no third-party dependency.

    cargo run --release -p idempotent-examples --bin load -- --runs 5 --csv target/load.csv
    python3 scripts/plot_load.py target/load.csv benchmarks/load.svg

For every store and concurrency it takes, within each run, first/s / raw/s and replay/s / raw/s
(the raw baseline measured in the same run), then the median over the runs, and draws them as
bars next to the ideal: 0.5 for a first execution (two round trips), 1.0 for a replay (one).
It also prints those medians as a Markdown table.
"""

import csv
import statistics
import sys
from collections import defaultdict

STORES = ["memory", "redis", "redis-cluster", "redis-cluster-wait", "postgres", "mysql", "sqlite"]
COLOURS = {"first": "#3b6ea8", "replay": "#e08a2c"}


def load(path):
    """{(store, concurrency): {run: {phase: row}}}"""
    runs = defaultdict(lambda: defaultdict(dict))
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = (row["store"], int(row["concurrency"]))
            runs[key][int(row["run"])][row["phase"]] = row
    return runs


def medians(runs):
    """{(store, concurrency): {name: median}} with per-run ratios."""
    out = {}
    for key, by_run in runs.items():
        complete = [r for r in by_run.values() if {"raw", "first", "replay"} <= r.keys()]
        if not complete:
            continue
        rate = lambda r, p: float(r[p]["ops_per_s"])
        p50 = lambda r, p: float(r[p]["p50_us"])
        out[key] = {
            "runs": len(complete),
            "raw": statistics.median(rate(r, "raw") for r in complete),
            "first": statistics.median(rate(r, "first") for r in complete),
            "replay": statistics.median(rate(r, "replay") for r in complete),
            "first_ratio": statistics.median(rate(r, "first") / rate(r, "raw") for r in complete),
            "replay_ratio": statistics.median(rate(r, "replay") / rate(r, "raw") for r in complete),
            "first_latency": statistics.median(p50(r, "first") / (2 * p50(r, "raw")) for r in complete),
            "replay_latency": statistics.median(p50(r, "replay") / p50(r, "raw") for r in complete),
        }
    return out


def order(keys):
    rank = {s: i for i, s in enumerate(STORES)}
    return sorted(keys, key=lambda k: (rank.get(k[0], len(STORES)), k[0], k[1]))


def table(stats):
    lines = [
        "| store | conc. | runs | raw/s | first/s | replay/s | first÷raw (ideal 0.50) | replay÷raw (ideal 1.00) "
        "| first p50 ÷ 2·raw p50 | replay p50 ÷ raw p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in order(stats):
        s = stats[key]
        lines.append(
            f"| {key[0]} | {key[1]} | {s['runs']} | {s['raw']:.0f} | {s['first']:.0f} | {s['replay']:.0f} "
            f"| {s['first_ratio']:.2f} | {s['replay_ratio']:.2f} | {s['first_latency']:.2f} | {s['replay_latency']:.2f} |"
        )
    return "\n".join(lines)


def esc(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def svg(stats):
    keys = order(stats)
    bar, gap, group_gap = 14, 6, 22
    left, top, height = 60, 60, 300
    stores = []
    for store, _ in keys:
        if store not in stores:
            stores.append(store)
    width = max(760, left + 20 + sum(
        len([k for k in keys if k[0] == s]) * (2 * bar + gap) + group_gap for s in stores
    ))
    ymax = max(1.5, max(max(stats[k]["first_ratio"], stats[k]["replay_ratio"]) for k in keys) * 1.1)
    y = lambda v: top + height - v / ymax * height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + 70}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left}" y="20" font-size="14" font-weight="bold">'
        "#[idempotent] ops/s \u00f7 the store's raw write ops/s (same run; median of runs)</text>",
        f'<text x="{left}" y="36" fill="#555">Dashed: the ideal for two round trips (first execution, 0.5) and one '
        "(replay, 1.0). Memory has no round trip.</text>",
    ]
    tick = 0.0
    while tick <= ymax + 1e-9:
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:.2f}</text>')
        tick += 0.25
    out.append(
        f'<text transform="translate(16,{top + height / 2}) rotate(-90)" text-anchor="middle">ops/s ÷ raw ops/s</text>'
    )
    x = left + 10
    for store in stores:
        start = x
        for key in [k for k in keys if k[0] == store]:
            s = stats[key]
            for i, phase in enumerate(["first", "replay"]):
                value = s[f"{phase}_ratio"]
                bx = x + i * bar
                out.append(
                    f'<rect x="{bx}" y="{y(value):.1f}" width="{bar - 1}" height="{y(0) - y(value):.1f}" '
                    f'fill="{COLOURS[phase]}"><title>{esc(store)} c={key[1]} {phase}: {value:.2f}</title></rect>'
                )
            out.append(
                f'<text x="{x + bar}" y="{y(0) + 14:.1f}" text-anchor="middle" fill="#555">c={key[1]}</text>'
            )
            x += 2 * bar + gap
        out.append(
            f'<text x="{(start + x - gap) / 2:.1f}" y="{y(0) + 32:.1f}" text-anchor="middle" '
            f'font-weight="bold">{esc(store)}</text>'
        )
        x += group_gap
    for value, phase in [(0.5, "first"), (1.0, "replay")]:
        out.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            f'stroke="{COLOURS[phase]}" stroke-dasharray="5,4"/>'
        )
    legend_y = top + height + 55
    legend = [("first", "first executions/s ÷ raw/s (ideal 0.5)"), ("replay", "replays/s ÷ raw/s (ideal 1.0)")]
    for i, (phase, label) in enumerate(legend):
        lx = left + i * 280
        out.append(f'<rect x="{lx}" y="{legend_y - 10}" width="12" height="12" fill="{COLOURS[phase]}"/>')
        out.append(f'<text x="{lx + 18}" y="{legend_y}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit("usage: plot_load.py LOAD.csv [OUT.svg]")
    stats = medians(load(argv[1]))
    if not stats:
        sys.exit(f"{argv[1]}: no complete run (raw, first and replay) found")
    print(table(stats))
    if len(argv) == 3:
        with open(argv[2], "w") as f:
            f.write(svg(stats))
        print(f"\nwrote {argv[2]}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
