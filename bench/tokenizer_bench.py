"""Encode throughput, side by side in one run: moe's BPE vs HF `tokenizers` (and tiktoken)
on the same vocabulary and corpus, for a list of thread counts.

  python3 bench/tokenizer_bench.py [--moe build/moe] [--corpus DIR] [--vocab 8192]
      [--tokenizer tok.json] [--threads 1,2,4,8,16] [--min-seconds 1] [--min-pass-mb 64]
      [--no-hf] [--no-tiktoken] [--independent]

Trains the vocabulary with `moe tokenizer train` (Llama-3 pattern) unless --tokenizer gives
one, writes a tiktoken rank file from it, checks that the three produce the same ids on
the corpus, then times each encoder on the documents held in memory. A pass encodes the
corpus's documents repeated whole N times, the fewest that make >= --min-pass-mb MB (moe
picks N, the others get the same N: the same list of documents for all three), so that a
pass on many threads is long against fork/join and the schedule's tail. Warm-up, then the
median of 3 samples, each sample as many whole passes as fill --min-seconds. moe: `moe
tokenizer bench` (documents cut into chunks, see ParallelEncoder; two warm-up passes);
HF: encode_batch in a fresh process per thread count (RAYON_NUM_THREADS); tiktoken:
encode_ordinary_batch(num_threads=N); each warmed up by one pass over the corpus once.
"""
import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHILD = r"""
import sys, time, json, math, statistics
from pathlib import Path
kind, spec, corpus, threads, ext, min_seconds, copies = sys.argv[1:8]
threads, min_seconds, copies = int(threads), float(min_seconds), int(copies)
files = sorted(p for p in Path(corpus).rglob("*" + ext) if p.is_file())
docs = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
nbytes = sum(len(d.encode("utf-8")) for d in docs) * copies
if kind == "hf":
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(spec)
    tok.encode_special_tokens = True
    run = lambda docs: sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
else:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    enc = tiktoken.Encoding(name="bench", pat_str=sys.argv[8], mergeable_ranks=load_tiktoken_bpe(spec), special_tokens={})
    run = lambda docs: sum(len(i) for i in enc.encode_ordinary_batch(docs, num_threads=threads))
t = time.perf_counter(); run(docs); first = time.perf_counter() - t  # warm-up: the corpus once
passes = max(1, math.ceil(min_seconds / (first * copies)))
docs = docs * copies  # the same str objects again, as moe repeats views of the same text
times = []
for _ in range(3):
    t = time.perf_counter()
    for _ in range(passes):
        tokens = run(docs)
    times.append((time.perf_counter() - t) / passes)
med = statistics.median(times)
print(json.dumps({"bytes": nbytes, "tokens": tokens, "seconds": med, "mb_per_s": nbytes / 1e6 / med}))
"""


def run_child(kind, spec, args, threads, copies, extra=()):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    out = subprocess.run([sys.executable, "-c", CHILD, kind, spec, args.corpus, str(threads), args.extension,
                          str(args.min_seconds), str(copies), *extra], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_moe(tokenizer, args, threads):
    out = subprocess.run([args.moe, "tokenizer", "bench", "--tokenizer", tokenizer, "--input", args.corpus,
                          "--extension", args.extension, "--threads", str(threads), "--repeats", "3",
                          "--min-pass-mb", str(args.min_pass_mb)], check=True, capture_output=True, text=True).stdout
    fields = dict(kv.split("=") for kv in out.strip().splitlines()[-1].split()[1:])
    result = {k: float(v) for k, v in fields.items()}
    for k in ("bytes", "tokens", "chunks", "copies", "corpus_bytes", "docs", "passes_per_sample"):
        result[k] = int(fields.get(k, 0))
    return result


def run_moe_independent(tokenizer, args, processes):
    """The host's ceiling for `processes` busy cores: that many single-thread moe benches at
    once (no shared state at all), their MB/s summed. Parallel moe at T threads against this
    separates what the encoder loses from what the machine loses (clocks, shared cores)."""
    cmd = [args.moe, "tokenizer", "bench", "--tokenizer", tokenizer, "--input", args.corpus, "--extension",
           args.extension, "--threads", "1", "--repeats", "3", "--min-pass-mb", str(args.min_pass_mb)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(processes)]
    rates = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
        fields = dict(kv.split("=") for kv in out.strip().splitlines()[-1].split()[1:])
        rates.append(float(fields["mb_per_s"]))
    return {"mb_per_s": sum(rates), "per_process": min(rates)}


def write_tiktoken_ranks(tok, path):
    """Our ids less the special token at id 0, byte-level strings -> bytes."""
    spec = json.load(open(tok))
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b), cs.append(256 + n)
            n += 1
    inverse = {chr(c): b for b, c in zip(bs, cs)}
    with open(path, "w") as f:
        for token, i in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
            if i == 0:
                continue
            f.write(base64.b64encode(bytes(inverse[c] for c in token)).decode() + f" {i - 1}\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moe", default="build/moe")
    p.add_argument("--corpus", default="/usr/share/doc/python3.11-doc/html/_sources")
    p.add_argument("--extension", default=".txt")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokenizer", help="an existing tokenizer.json (Llama-3 pattern, EOS at id 0); else trained")
    p.add_argument("--threads", help="comma-separated thread counts (default: 1 and all cores)")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="the all-cores thread count")
    p.add_argument("--min-seconds", type=float, default=1.0, help="HF/tiktoken: least time per timed sample")
    p.add_argument("--min-pass-mb", type=float, default=64.0,
                   help="repeat the documents whole until a pass holds >= this many MB, for all encoders (0: once)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF tokenizers columns")
    p.add_argument("--no-tiktoken", action="store_true", help="skip the tiktoken columns")
    p.add_argument("--independent", action="store_true",
                   help="also run T single-thread moe benches at once per thread count T: the host's ceiling")
    args = p.parse_args()
    threads_list = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, args.cores})
    with tempfile.TemporaryDirectory() as tmp:
        tok = args.tokenizer
        if not tok:
            tok = os.path.join(tmp, "tokenizer.json")
            subprocess.run([args.moe, "tokenizer", "train", "--vocab-size", str(args.vocab), "--input", args.corpus,
                            "--extension", args.extension, "--output", tok, "--pattern", "llama3"], check=True,
                           capture_output=True)
        ranks = os.path.join(tmp, "ranks.tiktoken")
        write_tiktoken_ranks(tok, ranks)
        nan = float("nan")
        rows = []
        for threads in threads_list:
            ours = run_moe(tok, args, threads)
            hf = {"mb_per_s": nan}
            if not args.no_hf:
                hf = run_child("hf", tok, args, threads, ours["copies"])
                assert ours["tokens"] == hf["tokens"], (ours, hf)
            tt_ours, tt = {"mb_per_s": nan}, {"mb_per_s": nan}
            if not args.no_tiktoken:
                tt_ours = run_moe(f"tiktoken:llama3:{ranks}", args, threads)
                try:
                    tt = run_child("tiktoken", ranks, args, threads, tt_ours["copies"], (LLAMA3,))
                    assert tt["tokens"] == tt_ours["tokens"], (tt, tt_ours)
                except subprocess.CalledProcessError as e:  # tiktoken not importable here
                    print(f"tiktoken unavailable: {e.stderr.strip().splitlines()[-1]}")
            ceiling = run_moe_independent(tok, args, threads) if args.independent else None
            ours["ceiling"] = ceiling
            rows.append((threads, ours, hf, tt, tt_ours))
            print(f"threads={threads}: moe {ours['mb_per_s']:.1f} MB/s ({ours['chunks']} chunks), "
                  f"HF {hf['mb_per_s']:.2f} MB/s", flush=True)
        base_ours, base_hf = rows[0][1]["mb_per_s"], rows[0][2]["mb_per_s"]
        first = rows[0][1]
        print(f"corpus {args.corpus}: {first['corpus_bytes'] / 1e6:.1f} MB; a pass: the documents {first['copies']} "
              f"times, {first['bytes'] / 1e6:.1f} MB, {first['tokens']} tokens "
              f"({'moe and HF identical' if not args.no_hf else 'HF not run'}), "
              f"vocab {len(json.load(open(tok))['model']['vocab'])}, "
              f"{len(os.sched_getaffinity(0))} cores visible, {os.cpu_count()} CPUs")
        print("| threads | moe BPE (tokenizer.json) | moe speedup | HF tokenizers | HF speedup | moe / HF "
              "| moe (tiktoken ranks) | tiktoken | moe / tiktoken |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for threads, ours, hf, tt, tt_ours in rows:
            print(f"| {threads} | {ours['mb_per_s']:.1f} MB/s | {ours['mb_per_s'] / base_ours:.2f}x "
                  f"({ours['mb_per_s'] / base_ours / threads * rows[0][0]:.0%}) | {hf['mb_per_s']:.2f} MB/s | "
                  f"{hf['mb_per_s'] / base_hf:.2f}x | {ours['mb_per_s'] / hf['mb_per_s']:.1f}x | "
                  f"{tt_ours['mb_per_s']:.1f} MB/s | {tt['mb_per_s']:.1f} MB/s | "
                  f"{tt_ours['mb_per_s'] / tt['mb_per_s']:.1f}x |")
        print(f"speedup: vs the first row ({rows[0][0]} thread(s)); in brackets the parallel efficiency")
        if args.independent:
            print("\nthe host's ceiling: T single-thread moe processes at once, MB/s summed (slowest process in "
                  "brackets); moe's T threads against it")
            print("| threads | moe, T threads | T processes of 1 thread | moe / ceiling |")
            print("| --- | --- | --- | --- |")
            for threads, ours, *_ in rows:
                c = ours["ceiling"]
                print(f"| {threads} | {ours['mb_per_s']:.1f} MB/s | {c['mb_per_s']:.1f} MB/s "
                      f"({c['per_process']:.1f}) | {ours['mb_per_s'] / c['mb_per_s']:.0%} |")
        print("\nmoe (tokenizer.json), where a timed pass goes (ParallelEncoder::Profile, means over the timed "
              "passes): serial preparation, parallel encoding (idle: the share of threads x encode time that threads "
              "were not encoding: late start, the schedule's tail), serial offsets, parallel copy and join; busy "
              "thread: MB/s of one thread while it encodes (falls with more threads if they slow each other down); "
              "misses: pieces per MB that a thread's piece cache did not hold (each thread's cache learns only from "
              "the text that thread encodes)")
        print("| threads | pass (median) | prep | encode (idle) | offsets | copy | busy thread | misses / MB | chunks |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for threads, ours, *_ in rows:
            print(f"| {threads} | {ours['seconds'] * 1e3:.1f} ms | {ours.get('prep_ms', nan):.3f} ms | "
                  f"{ours.get('encode_ms', nan):.1f} ms ({ours.get('idle_pct', nan):.1f}%) | "
                  f"{ours.get('offsets_ms', nan):.3f} ms | {ours.get('copy_ms', nan):.2f} ms | "
                  f"{ours.get('busy_thread_mb_per_s', nan):.1f} MB/s | {ours.get('cache_misses_per_mb', nan):.0f} | "
                  f"{ours['chunks']} |")


if __name__ == "__main__":
    main()
