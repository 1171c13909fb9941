#!/usr/bin/env python3
"""Checks that every #include under src/ looks down the layer order of docs/ARCHITECTURE.md.

A file in src/<layer>/ (its cuda/ subfolder included) may include headers of its own layer
and of layers below it; layers of equal rank (data, obs) may not include each other.
`--graph` prints the folder-to-folder include counts instead (upward edges marked).
Exit status 1 when an include looks up, naming each one as file:line.
"""
import pathlib
import re
import sys

# Lowest first; one tuple is one rank.
LAYERS = [("core",), ("config",), ("kernels",), ("moe",), ("model",), ("optim",), ("dist",),
          ("data", "obs"), ("train",), ("cli",)]
RANK = {name: rank for rank, group in enumerate(LAYERS) for name in group}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/')


def edges(src):
    for path in sorted(src.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh", ".in"):
            continue
        layer = path.relative_to(src).parts[0]
        if layer not in RANK:
            yield path, 0, layer, None  # a folder the order does not know
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = INCLUDE.match(line)
            if match and match.group(1) in RANK:
                yield path, number, layer, match.group(1)


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    src = root / "src"
    graph = "--graph" in sys.argv
    counts, bad = {}, []
    for path, number, layer, target in edges(src):
        where = f"{path.relative_to(root)}:{number}"
        if target is None:
            bad.append(f"{where}: src/{layer}/ is not in the layer order (scripts/check_layers.py, docs/ARCHITECTURE.md)")
            continue
        if target == layer:
            continue
        counts[(layer, target)] = counts.get((layer, target), 0) + 1
        if RANK[target] >= RANK[layer]:
            bad.append(f"{where}: {layer} includes {target}/ (a layer at or above its own)")
    if graph:
        for (layer, target), n in sorted(counts.items(), key=lambda kv: (RANK[kv[0][0]], RANK[kv[0][1]])):
            up = "  UPWARD" if RANK[target] >= RANK[layer] else ""
            print(f"{layer:8} -> {target:8} {n:4}{up}")
        print(f"{sum(1 for (l, t) in counts if RANK[t] >= RANK[l])} upward folder edges, "
              f"{len(bad)} upward includes")
        return 0
    for line in bad:
        print(line)
    if bad:
        order = " < ".join("/".join(group) for group in LAYERS)
        print(f"check_layers: {len(bad)} include(s) against the layer order {order}")
        return 1
    print(f"check_layers: every include under src/ looks down ({' < '.join('/'.join(g) for g in LAYERS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
