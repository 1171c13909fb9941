#!/usr/bin/env python3
"""Converts parquet files (Hugging Face datasets, FineWeb, ...) to JSON Lines that
`moe train` reads through data.dir (data.extension = ".jsonl") and `moe tokenize` through
--input. Each row becomes one line {"text": ...} holding the row's text column.

    .deps/venv/bin/python scripts/parquet_to_jsonl.py --input data/train-*.parquet \
        --output /data/fineweb-jsonl [--column text] [--rows-per-file 100000]

Writes <output>/part_00000.jsonl, part_00001.jsonl, ... (each file written under a
temporary name and renamed when complete). Rows whose text is null are skipped and
counted. Needs pyarrow (pip install pyarrow; scripts/requirements-test.txt lists it).
Bad input: one line on stderr and exit code 2.
"""
import argparse
import glob
import json
import os
import sys


def fail(message):
    print(f"parquet_to_jsonl: error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="parquet files, directories or glob patterns")
    parser.add_argument("--output", required=True, help="folder for the .jsonl files")
    parser.add_argument("--column", default="text", help="the text column (default: text)")
    parser.add_argument("--field", default="text", help="the JSON field written (data.text_field; default: text)")
    parser.add_argument("--rows-per-file", type=int, default=100_000)
    args = parser.parse_args()
    if args.rows_per_file < 1:
        fail(f"--rows-per-file must be >= 1, got {args.rows_per_file}")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        fail("pyarrow is not installed (pip install pyarrow)")

    files = []
    for pattern in args.input:
        if os.path.isdir(pattern):
            files += sorted(glob.glob(os.path.join(pattern, "**", "*.parquet"), recursive=True))
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            matched = sorted(glob.glob(pattern))
            if not matched:
                fail(f"--input {pattern}: no such file, directory or matching files")
            files += matched
    if not files:
        fail("--input: no parquet files found")
    os.makedirs(args.output, exist_ok=True)

    part, rows_in_part, rows, skipped, out, tmp = 0, 0, 0, 0, None, None

    def close_part():
        nonlocal out, tmp, part
        if out is not None:
            out.close()
            os.replace(tmp, tmp[: -len(".tmp")])
            out, part = None, part + 1

    for path in files:
        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            fail(f"{path}: not a readable parquet file: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        if args.column not in parquet.schema_arrow.names:
            fail(f"{path}: no column '{args.column}' (--column; columns: {', '.join(parquet.schema_arrow.names)})")
        for batch in parquet.iter_batches(columns=[args.column], batch_size=8192):
            for text in batch.column(0).to_pylist():
                if text is None:
                    skipped += 1
                    continue
                if not isinstance(text, str):
                    fail(f"{path}: column '{args.column}' holds {type(text).__name__} values, not strings")
                if out is None:
                    tmp = os.path.join(args.output, f"part_{part:05d}.jsonl.tmp")
                    out, rows_in_part = open(tmp, "w", encoding="utf-8"), 0
                out.write(json.dumps({args.field: text}, ensure_ascii=False) + "\n")
                rows += 1
                rows_in_part += 1
                if rows_in_part >= args.rows_per_file:
                    close_part()
    close_part()
    print(f"parquet_to_jsonl: {rows} rows from {len(files)} files -> {part} files in {args.output}"
          f"{f' ({skipped} null rows skipped)' if skipped else ''}")


if __name__ == "__main__":
    main()
