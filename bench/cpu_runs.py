#!/usr/bin/env python3
"""Medians over several runs of `bench/cpu_vs_torch.py`, cell by cell.

On a shared machine one run's ratio for a cell moves by ±20% from run to
run, so a single run can put a cell on either side of a threshold. This
script reads the `--json` files of several complete runs and prints, per
cell, the median over the runs of each run's GFLOP/s on both sides and of
each run's own ratio (each ratio comes from one run, whose two sides were
interleaved): the throughputs of the run with the median ratio, that
ratio, and the lowest and highest; then, per target of the
comparison, how many cells meet it by their median ratio and how many in
each run.

    for i in 1 2 3; do python3 bench/cpu_vs_torch.py --json run$i.json; done
    python3 bench/cpu_runs.py run1.json run2.json run3.json

Needs nothing beyond the Python standard library.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_vs_torch import flops  # noqa: E402  (the same FLOP count as the comparison)


def gf(flops, seconds):
    return flops / seconds / 1e9 if seconds else None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def load(paths):
    runs = []
    for path in paths:
        with open(path) as fh:
            runs.append(json.load(fh))
    return runs


def cells(runs, section, key, value):
    """{key(record): [value(record, run) per run]} for the records of `section`."""
    out = {}
    for run in runs:
        extra = {"gemm": gemm_gf(run)}
        for r in run:
            if r["section"] == section:
                out.setdefault(key(r), []).append(value(r, extra))
    return out


def gemm_gf(run):
    for r in run:
        if r["section"] == "gemm" and r["kernel"] == "gemm-crate-f32":
            return gf(2 * 4096 ** 3, r["seconds"])
    return None


def ratio_cell(samples):
    """From per-run (boostr GFLOP/s, other GFLOP/s) pairs of one cell: the text
    `a / b (r×, lo–hi)`, where `a / b` are the two throughputs of the run
    whose ratio is the median one (the lower middle for an even count), `r`
    that ratio (other time ÷ boostr time) and `lo–hi` the range of the runs'
    ratios; and the ratios."""
    ratios = [a / b for a, b in samples if a and b]  # in run order
    if not ratios:
        return "n/a", []
    runs = sorted((a / b, a, b) for a, b in samples if a and b)
    r, a, b = runs[(len(runs) - 1) // 2]
    spread = f", {runs[0][0]:.2f}–{runs[-1][0]:.2f}" if len(runs) > 1 else ""
    return f"{fmt_gf(a)} / {fmt_gf(b)} ({r:.2f}×{spread})", ratios


def fmt_gf(x):
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def grid(title, labels, seqs, rows):
    print(f"\n{title}\n")
    print("| " + " | ".join(labels + [f"S = {s}" for s in seqs]) + " |")
    print("| " + " | ".join(["---"] * len(labels) + ["---:"] * len(seqs)) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="--json files of complete runs of bench/cpu_vs_torch.py")
    ap.add_argument("--hq", type=int, default=8,
                    help="query heads of runs whose records do not say (default 8, cpu_vs_torch's)")
    args = ap.parse_args()
    runs = load(args.runs)
    n = len(runs)
    print(f"{n} runs; cells: boostr / other GFLOP/s of the run with the median ratio, that ratio "
          f"(other time ÷ boostr time) and the lowest–highest of the runs' ratios")

    targets = []  # (name, threshold, {cell: [ratio per run]})

    # GEMM throughput and the FMA peak, per run.
    for kernel in ("gemm-crate-f32", "torch-mm-f32", "torch-mm-bf16"):
        per_run = [gf(2 * 4096 ** 3, r["seconds"]) for run in runs for r in run
                   if r["section"] == "gemm" and r["kernel"] == kernel]
        if per_run:
            print(f"GEMM 4096³ {kernel}: {fmt_gf(med(per_run))} GFLOP/s "
                  f"(runs: {', '.join(fmt_gf(x) for x in per_run)})")
    peaks = [gf(r["flops"], r["seconds"]) for run in runs for r in run if r["section"] == "peak"]
    if peaks:
        print(f"FMA peak of one core: {fmt_gf(med(peaks))} GFLOP/s (runs: {', '.join(fmt_gf(x) for x in peaks)})")

    # Plain attention against SDPA, f32 and bf16.
    for section, dtype in (("plain", "f32"), ("bf16", "bf16")):
        data = cells(runs, section,
                     lambda r: (r["variant"], r["pass_"], r["hkv"], r["d"], r["s"]),
                     lambda r, e: (gf(r["flops"], r["boostr"]), gf(r["flops"], r["torch"]), e["gemm"]))
        if not data:
            continue
        seqs = sorted({k[4] for k in data})
        rows, by_target = [], {}
        for key in sorted({k[:4] for k in data}, key=lambda k: (k[0] != "full", k[1] != "fwd", -k[2], k[3])):
            variant, pass_, hkv, d = key
            row = [variant, "fwd" if pass_ == "fwd" else "fwd+bwd", str(hkv), str(d)]
            for s in seqs:
                samples = data.get(key + (s,), [])
                text, ratios = ratio_cell([x[:2] for x in samples])
                row.append(text)
                if section == "plain":
                    need = {("full", "fwd"): 1.0, ("causal", "fwd"): 1.3,
                            ("full", "fwdbwd"): 1.2, ("causal", "fwdbwd"): 1.3}[(variant, pass_)]
                    name = f"f32 {variant} {'fwd' if pass_ == 'fwd' else 'fwd+bwd'} ≥ {need}× SDPA"
                    by_target.setdefault(name, (need, {}))[1][key + (s,)] = ratios
                    if (variant, pass_) == ("full", "fwd"):
                        share = [x[0] / x[2] for x in samples if x[0] and x[2]]
                        by_target.setdefault("f32 full fwd ≥ 90% of the gemm crate's GEMM", (0.9, {}))[1][
                            key + (s,)] = share
                else:
                    by_target.setdefault("bf16 ≥ 1.0× SDPA bf16", (1.0, {}))[1][key + (s,)] = ratios
            rows.append(row)
        grid(f"{dtype}: boostr / SDPA", ["variant", "pass", "Hkv", "D"], seqs, rows)
        targets += [(name, need, c) for name, (need, c) in by_target.items()]

    # Custom variants against FlexAttention, and per attended pair against causal.
    data = cells(runs, "custom", lambda r: (r["variant"], r["hkv"], r["d"], r["s"]),
                 lambda r, e: (gf(r["flops"], r["boostr"]), gf(r["flops"], r["flex"]), r.get("hq", args.hq),
                               r["causal_fwd"]))
    if data:
        seqs = sorted({k[3] for k in data})
        rows, flex_t, pair_t = [], {}, {}
        order = ["alibi", "softcap", "window", "prefix"]
        for key in sorted({k[:3] for k in data}, key=lambda k: (order.index(k[0]) if k[0] in order else 9, -k[1], k[2])):
            variant, hkv, d = key
            row = [variant, str(hkv), str(d)]
            for s in seqs:
                samples = data.get(key + (s,), [])
                text, ratios = ratio_cell([x[:2] for x in samples])
                # Per attended pair against plain causal timed in the same
                # run: the two throughputs, each over its own attended pairs.
                shares = [x[0] / gf(flops("causal", "fwd", x[2], s, d), x[3]) for x in samples if x[0] and x[3]]
                share = med(shares)
                row.append(f"{text}, {100 * share:.0f}%" if share else text)
                flex_t[key + (s,)] = ratios
                pair_t[key + (s,)] = shares
            rows.append(row)
        grid("f32 custom variants, forward: boostr / flex (ratio), per-pair share of plain causal",
             ["variant", "Hkv", "D"], seqs, rows)
        targets.append(("custom ≥ 3× flex", 3.0, flex_t))
        for v in order:
            targets.append((f"{v} per pair ≥ 90% of causal", 0.9,
                            {k: x for k, x in pair_t.items() if k[0] == v}))

    print("\n| target | cells meeting it by median | in each run |")
    print("| --- | ---: | --- |")
    for name, need, c in targets:
        by_median = sum(1 for xs in c.values() if xs and statistics.median(xs) >= need)
        per_run = [sum(1 for xs in c.values() if len(xs) > i and xs[i] >= need) for i in range(n)]
        print(f"| {name} | {by_median} of {len(c)} | {', '.join(map(str, per_run))} |")


if __name__ == "__main__":
    main()
