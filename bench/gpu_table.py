#!/usr/bin/env python3
"""Merge the JSON lines of gpu_bench (impl "boostr") and gpu_torch.py
(impls "sdpa", "flex") into one table of TFLOP/s per (variant, S, D), with
the ratios boostr/sdpa and boostr/flex (> 1: boostr faster), forward and
forward+backward.

usage: gpu_table.py FILE... (lines that are not JSON objects are ignored)
"""

import json
import sys

ORDER = ["causal", "sliding_window", "alibi", "softcap"]


def load(paths):
    rows = {}
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(r, dict) or "impl" not in r:
                    continue
                rows[(r["impl"], r["variant"], int(r["S"]), int(r["D"]))] = r
    return rows


def fmt(x, spec):
    if x is None:
        return "-".rjust(int(spec.split(".")[0]))
    return format(x, spec)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows = load(sys.argv[1:])
    if not rows:
        sys.exit("gpu_table: no measurements found")
    keys = sorted(
        {(v, s, d) for (_, v, s, d) in rows},
        key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[0], k[1], k[2]),
    )
    dtypes = sorted({r.get("dtype", "?") for r in rows.values()})
    print(f"TFLOP/s over visible pairs ({', '.join(dtypes)}); ratio = boostr / other, > 1 means boostr is faster")
    for phase, field in [("forward", "fwd_tflops"), ("forward+backward", "fwdbwd_tflops")]:
        print(f"\n{phase}")
        header = f"{'variant':<15} {'S':>5} {'D':>4} {'boostr':>8} {'sdpa':>8} {'flex':>8} {'b/sdpa':>7} {'b/flex':>7}"
        print(header)
        print("-" * len(header))
        for v, s, d in keys:
            val = {impl: rows.get((impl, v, s, d), {}).get(field) for impl in ("boostr", "sdpa", "flex")}
            b = val["boostr"]
            ratio = {
                o: (b / val[o] if b is not None and val[o] else None) for o in ("sdpa", "flex")
            }
            print(
                f"{v:<15} {s:>5} {d:>4} {fmt(b, '8.1f')} {fmt(val['sdpa'], '8.1f')} "
                f"{fmt(val['flex'], '8.1f')} {fmt(ratio['sdpa'], '7.2f')} {fmt(ratio['flex'], '7.2f')}"
            )
    notes = sorted({(r["impl"], r["variant"], r["note"]) for r in rows.values() if r.get("note")})
    if notes:
        print("\nbaselines:")
        for impl, v, note in notes:
            print(f"  {impl:<5} {v:<15} {note}")


if __name__ == "__main__":
    main()
