#!/usr/bin/env python3
"""Instructions along one path through a kernel's SASS: a static count per pass of a loop.

Walks a `cuobjdump -sass` / `nvdisasm` listing from one address to another, following
unconditional branches and, at each conditional one, the decision given for its address
(--taken / --not-taken); stops with the branch's text if a decision is missing, so the
path is always the one asked for. Counts every issued instruction (predicated-off ones
issue too; `@!PT` placeholders do not) and prints the total and the opcodes' counts.

  python3 scripts/sass_hot_path.py k.sass --start 1350 --end 6ef0 \
      --taken 17f0,3a00 --not-taken 1490,3430
(addresses as the listing's /*1350*/, hex; docs/PROFILING.md "A kernel's instructions
without a GPU" says where the listing comes from.)
"""
import argparse
import collections
import re
import sys

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def parse(lines):
    """The listing as [(address, text)] in order and each label's index into it."""
    code, labels = [], {}
    for line in lines:
        label = LABEL.match(line)
        if label:
            labels[label.group(1)] = len(code)
            continue
        m = INSTRUCTION.match(line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    return code, labels


def walk(code, labels, start, end, taken, not_taken, limit=100000):
    index = {address: i for i, (address, _) in enumerate(code)}
    if start not in index or end not in index:
        sys.exit(f"sass_hot_path: no instruction at {start:x} or {end:x}")
    i, counts = index[start], collections.Counter()
    for _ in range(limit):
        address, text = code[i]
        if text.startswith("@!PT"):  # never issued
            i += 1
            continue
        predicated = PREDICATE.match(text) is not None
        opcode = PREDICATE.sub("", text).split()[0]
        counts[opcode.split(".")[0]] += 1
        if address == end:
            return counts
        if opcode.startswith("BRA"):
            target = TARGET.search(text)
            conditional = predicated or ", `" in text  # BRA.DIV UR, and BRA P, carry a condition too
            if target and (not conditional or address in taken):
                i = labels[target.group(1)]
                continue
            if conditional and address not in not_taken:
                sys.exit(f"sass_hot_path: decide the branch at {address:x}: {text}")
        elif opcode.startswith("EXIT") and not predicated:
            sys.exit(f"sass_hot_path: the path exits at {address:x} before {end:x}")
        i += 1
    sys.exit("sass_hot_path: no end after %d instructions (a loop on the path?)" % limit)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("listing")
    parser.add_argument("--start", required=True, help="first instruction's address (hex)")
    parser.add_argument("--end", required=True, help="last instruction's address (hex), counted")
    parser.add_argument("--taken", default="", help="conditional branches taken (hex addresses, comma-separated)")
    parser.add_argument("--not-taken", default="", help="conditional branches falling through")
    parser.add_argument("--top", type=int, default=25, help="opcodes to list")
    args = parser.parse_args()
    hexes = lambda s: {int(x, 16) for x in s.split(",") if x}
    with open(args.listing) as f:
        code, labels = parse(f)
    counts = walk(code, labels, int(args.start, 16), int(args.end, 16), hexes(args.taken), hexes(args.not_taken))
    print(f"{sum(counts.values())} instructions")
    print(", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))


if __name__ == "__main__":
    main()
