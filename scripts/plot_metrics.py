#!/usr/bin/env python3
"""Plots runs' metrics.jsonl side by side: one panel per metric, one line per run.

  plot_metrics.py --out cmp.png --metric val_loss --metric max_imbalance \
      "fixed t=1=runs/a/metrics.jsonl" "bias=runs/b/metrics.jsonl"

A metric is a field of the `step` records (dotted for nested ones: `time_s.comm_wait`;
`layers.0.imbalance` is the first MoE layer's) or `val_loss` (the `val` records).
`--smooth N` averages step metrics over N steps. Needs matplotlib (scripts/requirements-test.txt).
"""
import argparse
import json
import sys


def field(record, dotted):
    value = record
    for part in dotted.split("."):
        if isinstance(value, list):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def series(path, metric):
    kind = "val" if metric == "val_loss" else "step"
    xs, ys = [], []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") != kind:
                continue
            value = field(record, metric)
            if value is not None:
                xs.append(record["step"])
                ys.append(value)
    return xs, ys


def smooth(ys, n):
    if n <= 1:
        return ys
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= n:
            total -= ys[i - n]
        out.append(total / min(i + 1, n))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--metric", action="append", required=True)
    parser.add_argument("--title", default="")
    parser.add_argument("--smooth", type=int, default=1)
    parser.add_argument("--logy", action="append", default=[], help="metrics drawn on a log scale")
    parser.add_argument("runs", nargs="+", help="LABEL=PATH/metrics.jsonl")
    args = parser.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for run in args.runs:
        label, sep, path = run.rpartition("=")
        if not sep or not label:
            sys.exit(f"plot_metrics: run '{run}' is not LABEL=PATH")
        runs.append((label, path))

    fig, axes = plt.subplots(1, len(args.metric), figsize=(5.5 * len(args.metric), 4), squeeze=False)
    for ax, metric in zip(axes[0], args.metric):
        drawn = 0
        for label, path in runs:
            xs, ys = series(path, metric)
            if not xs:
                continue
            ys = ys if metric == "val_loss" else smooth(ys, args.smooth)
            ax.plot(xs, ys, label=label, marker="o" if metric == "val_loss" else None, markersize=3)
            drawn += 1
        if drawn == 0:
            sys.exit(f"plot_metrics: no run has values for '{metric}'")
        ax.set_title(metric)
        ax.set_xlabel("step")
        if metric in args.logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_metrics: wrote {args.out}")


if __name__ == "__main__":
    main()
