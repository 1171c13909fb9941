#!/usr/bin/env python3
"""scripts/ncu_by_kernel.py on a made-up ncu CSV: its preamble skipped, quoted numbers with
thousands separators read, launches of one kernel summed and divided by the steps, --exclude leaving kernels out,
--group's summary (first match wins, the rest as other), bad input refused in one line."""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ncu_by_kernel.py")
CSV = """==PROF== Connected to process 586 (/tmp/pack/bin/moe)
==WARNING== Note: Running with uncontrolled GPU caches.
"ID","Kernel Name","Block Size","dram__bytes.sum","gpu__time_duration.sum"
"","","","byte","ns"
"0","gemm_kernel(int)","(384, 1, 1)","1,000,000,000","2,000,000"
"1","small_kernel(float *)","(256, 1, 1)","4,000,000","1,000"
"2","gemm_kernel(int)","(384, 1, 1)","1,000,000,000","3,000,000"
"3","small_kernel(float *)","(256, 1, 1)","4,000,000","3,000"
"""


def run(text, *args):
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        f.write(text)
    try:
        return subprocess.run([sys.executable, SCRIPT, f.name, *args], capture_output=True, text=True)
    finally:
        os.unlink(f.name)


def main():
    failures = []
    r = run(CSV, "--steps", "2")
    lines = r.stdout.splitlines()
    if r.returncode != 0 or not lines or not lines[0].startswith("2.50 ms a step over 4 launches"):
        failures.append(f"total: rc {r.returncode}, {r.stdout!r} {r.stderr!r}")
    # gemm: 5 ms over 2 steps = 2.50 ms, 1 launch a step, 1 GB a step at 0.40 TB/s; first.
    gemm = [l for l in lines if "gemm_kernel" in l]
    if not gemm or gemm[0].split()[:4] != ["2.50", "1.0", "1.00", "0.40"] or lines[2] != gemm[0]:
        failures.append(f"gemm row: {gemm}")
    small = [l for l in lines if "small_kernel" in l]
    if not small or small[0].split()[:2] != ["0.00", "1.0"]:
        failures.append(f"small row: {small}")
    # --exclude: the matching kernel's launches leave the total and the rows, counted apart.
    ex = run(CSV, "--steps", "2", "--exclude", "gemm_")
    ex_lines = ex.stdout.splitlines()
    if (ex.returncode != 0 or not ex_lines or not ex_lines[0].startswith("0.00 ms a step over 2 launches")
            or "left out (--exclude gemm_): 2 launches, 5.00 ms in all" not in ex.stdout
            or any("gemm_kernel" in l for l in ex_lines[2:])):
        failures.append(f"--exclude: rc {ex.returncode}, {ex.stdout!r} {ex.stderr!r}")
    bad_re = run(CSV, "--exclude", "(")
    if bad_re.returncode == 0 or "not a regular expression" not in bad_re.stderr:
        failures.append(f"--exclude '(': rc {bad_re.returncode}, {bad_re.stderr!r}")
    # --group: the summary's rows, first match wins, the rest as other.
    grouped = run(CSV, "--steps", "2", "--group", "GEMMs=gemm", "--group", "everything=.", "--group", "none=x^")
    rows = {l.split()[-1]: l.split()[:3] for l in grouped.stdout.splitlines()[-4:]}  # the 4 groups
    if (grouped.returncode != 0 or rows.get("GEMMs") != ["2.50", "1.00", "99.9%"]
            or rows.get("everything") != ["0.00", "0.00", "0.1%"] or rows.get("none") != ["0.00", "0.00", "0.0%"]
            or rows.get("other") != ["0.00", "0.00", "0.0%"]):
        failures.append(f"--group: rc {grouped.returncode}, {grouped.stdout!r} {grouped.stderr!r}")
    bad_group = run(CSV, "--group", "nolabel")
    if bad_group.returncode == 0 or "is not LABEL=REGEX" not in bad_group.stderr:
        failures.append(f"--group nolabel: rc {bad_group.returncode}, {bad_group.stderr!r}")
    bad = run("no header here\n")
    if bad.returncode == 0 or len(bad.stderr.strip().splitlines()) != 1 or "no ncu CSV header" not in bad.stderr:
        failures.append(f"bad input: rc {bad.returncode}, {bad.stderr!r}")
    steps = run(CSV, "--steps", "0")
    if steps.returncode == 0 or "--steps must be > 0" not in steps.stderr:
        failures.append(f"--steps 0: rc {steps.returncode}, {steps.stderr!r}")
    for f in failures:
        print("FAIL:", f)
    print("ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
