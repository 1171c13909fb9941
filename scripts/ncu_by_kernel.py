#!/usr/bin/env python3
"""Kernel time by kernel, from Nsight Compute's raw CSV of a `moe bench` run.

On the GPU machine (docs/PROFILING.md, "Where a step goes, kernel by kernel"):
  ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,dram__bytes.sum \
      --csv --page raw moe bench -c CONFIG --warmup 1 --steps 1 > run.csv
then here: `python3 scripts/ncu_by_kernel.py run.csv --steps 2`. Each kernel is replayed
alone at the board's full clock, so the sum is below a power-capped step's time.
`--exclude split_kernel` leaves out the master weights' one-time upload, which the
division by --steps would otherwise count as part of each step. `--group LABEL=REGEX`
(repeatable) adds a table of kernel groups: each kernel in the first group whose regular
expression its name matches, the rest as "other".
"""
import argparse
import collections
import csv
import re
import sys


def read_rows(path):
    """The kernel rows of an ncu raw CSV: ncu's own lines before the header are skipped."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"ID"')]
    if not starts:
        sys.exit(f"ncu_by_kernel: {path}: no ncu CSV header (a line starting with \"ID\")")
    rows = list(csv.reader(lines[starts[0]:]))
    header, units = rows[0], rows[1]
    for column in ("Kernel Name", "gpu__time_duration.sum"):
        if column not in header:
            sys.exit(f"ncu_by_kernel: {path}: no column {column!r} (run ncu with --metrics gpu__time_duration.sum)")
    return header, units, rows[2:]


def number(text):
    return float(text.replace(",", ""))


def by_kernel(path, width, exclude=None):
    header, units, rows = read_rows(path)
    name_at, time_at = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    bytes_at = header.index("dram__bytes.sum") if "dram__bytes.sum" in header else None
    to_ms = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "nsecond": 1e-6}.get(units[time_at])
    if to_ms is None:
        sys.exit(f"ncu_by_kernel: {path}: unknown time unit {units[time_at]!r}")
    to_gb = None
    if bytes_at is not None:
        to_gb = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0}.get(units[bytes_at])
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    left_out = [0, 0.0]
    for row in rows:
        if exclude is not None and exclude.search(row[name_at]):
            left_out[0] += 1
            left_out[1] += number(row[time_at]) * to_ms
            continue
        g = groups[row[name_at][:width]]
        g[0] += 1
        g[1] += number(row[time_at]) * to_ms
        if to_gb is not None:
            g[2] += number(row[bytes_at]) * to_gb
    return groups, to_gb is not None, left_out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --csv --page raw output")
    parser.add_argument("--steps", type=float, default=1.0, help="steps the run profiled (times are divided by it)")
    parser.add_argument("--top", type=int, default=40, help="kernels to list")
    parser.add_argument("--width", type=int, default=100, help="characters of the kernel name to group by")
    parser.add_argument("--exclude", metavar="REGEX",
                        help="leave out kernels whose name matches, e.g. split_kernel: the one-time upload of the "
                             "master weights, which no step runs")
    parser.add_argument("--group", metavar="LABEL=REGEX", action="append", default=[],
                        help="a group of kernels for the summary table (repeatable; first match wins)")
    args = parser.parse_args()
    if args.steps <= 0:
        sys.exit(f"ncu_by_kernel: --steps must be > 0, got {args.steps}")
    try:
        exclude = re.compile(args.exclude) if args.exclude else None
    except re.error as e:
        sys.exit(f"ncu_by_kernel: --exclude {args.exclude!r} is not a regular expression: {e}")
    kinds = []
    for spec in args.group:
        label, sep, pattern = spec.partition("=")
        if not sep or not label:
            sys.exit(f"ncu_by_kernel: --group {spec!r} is not LABEL=REGEX")
        try:
            kinds.append((label, re.compile(pattern)))
        except re.error as e:
            sys.exit(f"ncu_by_kernel: --group {spec!r}: not a regular expression: {e}")
    groups, have_bytes, left_out = by_kernel(args.csv, args.width, exclude)
    total = sum(g[1] for g in groups.values()) / args.steps
    print(f"{total:.2f} ms a step over {sum(g[0] for g in groups.values())} launches")
    if exclude is not None:
        print(f"left out (--exclude {args.exclude}): {left_out[0]} launches, {left_out[1]:.2f} ms in all")
    print("   ms/step  launches/step" + ("   GB/step   TB/s" if have_bytes else "") + "  kernel")
    for name, (count, ms, gb) in sorted(groups.items(), key=lambda kv: -kv[1][1])[: args.top]:
        rate = f"  {gb / args.steps:8.2f} {gb / ms:6.2f}" if have_bytes and ms > 0 else ""
        print(f"{ms / args.steps:10.2f} {count / args.steps:14.1f}{rate}  {name}")
    if kinds:
        sums = {label: [0.0, 0.0] for label, _ in kinds + [("other", None)]}
        for name, (count, ms, gb) in groups.items():
            label = next((label for label, pattern in kinds if pattern.search(name)), "other")
            sums[label][0] += ms
            sums[label][1] += gb
        print("   ms/step" + ("   GB/step" if have_bytes else "") + "  share  group")
        for label, (ms, gb) in sorted(sums.items(), key=lambda kv: -kv[1][0]):
            share = 100.0 * ms / args.steps / total if total > 0 else 0.0
            print(f"{ms / args.steps:10.2f}" + (f" {gb / args.steps:9.2f}" if have_bytes else "") +
                  f" {share:5.1f}%  {label}")


if __name__ == "__main__":
    main()
