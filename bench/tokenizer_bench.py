"""Encode throughput, side by side in one run: moe's BPE vs HF `tokenizers` (and tiktoken)
on the same vocabulary and corpus, with 1 thread and with all cores.

  .deps/venv/bin/python bench/tokenizer_bench.py [--moe build/moe] [--corpus DIR] [--vocab 8192]

Trains the vocabulary with `moe tokenizer train` (Llama-3 pattern), writes a tiktoken rank
file from it, checks that the three produce the same ids on the corpus, then times each
encoder on the documents held in memory: one warm-up pass, the median of 3 timed passes.
HF runs encode_batch in a fresh process per thread count (RAYON_NUM_THREADS);
tiktoken runs encode_ordinary_batch(num_threads=N).
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
import sys, time, json, statistics
from pathlib import Path
kind, spec, corpus, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
files = sorted(p for p in Path(corpus).rglob("*.txt") if p.is_file())
docs = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
nbytes = sum(len(d.encode("utf-8")) for d in docs)
if kind == "hf":
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(spec)
    tok.encode_special_tokens = True
    run = lambda: sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
else:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    enc = tiktoken.Encoding(name="bench", pat_str=sys.argv[5], mergeable_ranks=load_tiktoken_bpe(spec), special_tokens={})
    run = lambda: sum(len(i) for i in enc.encode_ordinary_batch(docs, num_threads=threads))
tokens = run()
times = []
for _ in range(3):
    t = time.perf_counter(); tokens = run(); times.append(time.perf_counter() - t)
med = statistics.median(times)
print(json.dumps({"bytes": nbytes, "tokens": tokens, "seconds": med, "mb_per_s": nbytes / 1e6 / med}))
"""


def run_child(kind, spec, corpus, threads, extra=()):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    out = subprocess.run([sys.executable, "-c", CHILD, kind, spec, corpus, str(threads), *extra], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_moe(moe, tokenizer, corpus, threads):
    out = subprocess.run([moe, "tokenizer", "bench", "--tokenizer", tokenizer, "--input", corpus, "--extension", ".txt",
                          "--threads", str(threads)], check=True, capture_output=True, text=True).stdout
    fields = dict(kv.split("=") for kv in out.strip().split()[1:])
    return {"bytes": int(fields["bytes"]), "tokens": int(fields["tokens"]), "seconds": float(fields["seconds"]),
            "mb_per_s": float(fields["mb_per_s"])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moe", default="build/moe")
    p.add_argument("--corpus", default="/usr/share/doc/python3.11-doc/html/_sources")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="the all-cores thread count")
    args = p.parse_args()
    cores = args.cores
    with tempfile.TemporaryDirectory() as tmp:
        tok = os.path.join(tmp, "tokenizer.json")
        subprocess.run([args.moe, "tokenizer", "train", "--vocab-size", str(args.vocab), "--input", args.corpus,
                        "--extension", ".txt", "--output", tok, "--pattern", "llama3"], check=True, capture_output=True)
        spec = json.load(open(tok))
        # tiktoken ranks: our ids less the special token at id 0 (byte-level strings -> bytes).
        inverse = {}
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b), cs.append(256 + n)
                n += 1
        inverse = {chr(c): b for b, c in zip(bs, cs)}
        ranks = os.path.join(tmp, "ranks.tiktoken")
        with open(ranks, "w") as f:
            for token, i in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
                if i == 0:
                    continue
                f.write(base64.b64encode(bytes(inverse[c] for c in token)).decode() + f" {i - 1}\n")
        rows = []
        for threads in sorted({1, cores}):
            ours = run_moe(args.moe, tok, args.corpus, threads)
            hf = run_child("hf", tok, args.corpus, threads)
            tt_ours = run_moe(args.moe, f"tiktoken:llama3:{ranks}", args.corpus, threads)
            try:
                tt = run_child("tiktoken", ranks, args.corpus, threads, (LLAMA3,))
                assert tt["tokens"] == tt_ours["tokens"], (tt, tt_ours)
            except subprocess.CalledProcessError as e:  # tiktoken not importable here
                print(f"tiktoken unavailable: {e.stderr.strip().splitlines()[-1]}")
                tt = {"mb_per_s": float("nan"), "tokens": tt_ours["tokens"]}
            assert ours["tokens"] == hf["tokens"], (ours, hf)
            rows.append((threads, ours, hf, tt, tt_ours))
        print(f"corpus {args.corpus}: {rows[0][1]['bytes'] / 1e6:.1f} MB, vocab {args.vocab}, {cores} cores")
        print("| threads | moe BPE (tokenizer.json) | HF tokenizers | moe / HF | moe (tiktoken ranks) | tiktoken | moe / tiktoken |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for threads, ours, hf, tt, tt_ours in rows:
            print(f"| {threads} | {ours['mb_per_s']:.1f} MB/s | {hf['mb_per_s']:.1f} MB/s | "
                  f"{ours['mb_per_s'] / hf['mb_per_s']:.2f}x | {tt_ours['mb_per_s']:.1f} MB/s | {tt['mb_per_s']:.1f} MB/s | "
                  f"{tt_ours['mb_per_s'] / tt['mb_per_s']:.2f}x |")
        if len(rows) > 1:
            print(f"moe scaling 1 -> {cores} threads: {rows[-1][1]['mb_per_s'] / rows[0][1]['mb_per_s']:.2f}x; "
                  f"HF: {rows[-1][2]['mb_per_s'] / rows[0][2]['mb_per_s']:.2f}x")
        print(f"tokens: {rows[0][1]['tokens']} (moe and HF identical), tiktoken-rank ids: {rows[0][3]['tokens']} (identical)")


if __name__ == "__main__":
    main()
