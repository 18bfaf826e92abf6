#!/usr/bin/env python3
"""boostr's CPU attention as a share of the machine's FMA peak, measured beside it.

On a shared machine the cores' speed drifts by tens of percent within
minutes, so a throughput and a peak taken at different times do not divide
well. This script alternates the timing server's FMA peak loop (on every
thread at once: `peak <iters> all`) with single attention runs, and divides
each run's GFLOP/s by the mean of the two peaks measured right before and
after it. The median share tells how much of the cores' multiply-add
capacity the kernels turn into useful work.

    cargo build --release -p boostr-runtime --example cpu_vs_torch
    python3 bench/peak_share.py target/release/examples/cpu_vs_torch \\
        "full fwd 8 8 2048 128" "causal fwdbwd 8 2 1024 64"

Commands are `attn` commands of the server without the word `attn`
(`<variant> <fwd|fwdbwd> <hq> <hkv> <seq> <dim>`); FLOPs count useful work as
in `bench/cpu_vs_torch.py`. Needs nothing beyond the Python standard library.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_cpu import Server  # noqa: E402  (the same timing-server client)
from cpu_vs_torch import flops  # noqa: E402  (the same FLOP count as the comparison)

FMA_FLOPS_PER_ITER = 24 * 16 * 2  # 24 FMAs of 16 lanes, 2 flops each


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("server", help="timing server binary (the cpu_vs_torch example)")
    ap.add_argument("commands", nargs="+", help="e.g. 'full fwd 8 8 2048 128'")
    ap.add_argument("--runs", type=int, default=15, help="attention runs per command (default 15)")
    ap.add_argument("--threads", type=int, help="rayon threads (default: the environment's)")
    ap.add_argument("--peak-iters", type=int, default=2_000_000,
                    help="rounds of the peak loop per measurement (default 2000000)")
    args = ap.parse_args()
    if args.runs < 2:
        ap.error(f"--runs {args.runs}: at least 2 (quartiles need two)")

    server = Server(args.server, args.threads)
    peak_cmd = f"peak {args.peak_iters} all"
    peak_flops = args.peak_iters * FMA_FLOPS_PER_ITER * server.threads
    print(f"{server.threads} threads; share = attention GFLOP/s / FMA peak GFLOP/s of "
          f"all threads, the peak measured before and after each run")
    try:
        for command in args.commands:
            words = command.split()
            if len(words) != 6:
                raise SystemExit(f"{command!r}: <variant> <fwd|fwdbwd> <hq> <hkv> <seq> <dim>")
            variant, pass_ = words[0], words[1]
            if not all(w.isdigit() for w in words[2:]):
                raise SystemExit(f"{command!r}: <hq> <hkv> <seq> <dim> are whole numbers")
            hq, _hkv, s, d = map(int, words[2:])  # the FLOP count does not depend on hkv
            if pass_ not in ("fwd", "fwdbwd"):
                raise SystemExit(f"{command!r}: pass {pass_!r} is not fwd or fwdbwd")
            try:
                work = flops(variant, pass_, hq, s, d)
            except ValueError:
                raise SystemExit(f"{command!r}: unknown variant {variant!r}") from None
            attn = f"attn {command}"
            server.run(attn)  # inputs made, caches warm
            before = peak_flops / server.run(peak_cmd)
            rates, peaks, shares = [], [], []
            for _ in range(args.runs):
                rate = work / server.run(attn)
                after = peak_flops / server.run(peak_cmd)
                peak = (before + after) / 2
                rates.append(rate / 1e9)
                peaks.append(peak / 1e9)
                shares.append(rate / peak)
                before = after
            q1, _, q3 = statistics.quantiles(shares, n=4)
            print(f"{command:28s} {statistics.median(rates):6.0f} GFLOP/s  "
                  f"peak {statistics.median(peaks):4.0f} [{min(peaks):.0f}, {max(peaks):.0f}]  "
                  f"share {statistics.median(shares):.2f} [{q1:.2f}, {q3:.2f}]", flush=True)
    finally:
        server.close()


if __name__ == "__main__":
    main()
