#!/usr/bin/env python3
"""Compare two builds of boostr's CPU kernels, paired run by run.

Each side is a build of the timing server of `bench/cpu_vs_torch.py`
(`cargo build --release -p boostr-runtime --example cpu_vs_torch`, copied
aside before the change under test). For every command the two servers take
turns (A B, then B A, ...); each turn is an untimed run followed by enough
back-to-back timed runs to last about 50 ms, and the ratio A/B of one pair of
adjacent turns is one sample. Ratios of adjacent turns cancel most of the
drift of a shared machine, which moves both sides alike; their median and
quartiles are printed. A/B > 1 means B is faster.

    cp target/release/examples/cpu_vs_torch /tmp/before
    # ... change, rebuild ...
    python3 bench/ab_cpu.py /tmp/before target/release/examples/cpu_vs_torch \\
        "attn causal fwd 8 8 1024 64" "attn window fwdbwd 8 2 2048 128"

Commands are the server's (see `boostr-runtime/examples/cpu_vs_torch.rs`).
With `--threads 1 2` and the same binary as A and B, it measures how the
kernels scale from one thread to two.
Needs nothing beyond the Python standard library.
"""

import argparse
import os
import statistics
import subprocess


class Server:
    def __init__(self, path, threads=None, pin=True):
        env = dict(os.environ)
        if threads is not None:
            env["RAYON_NUM_THREADS"] = str(threads)
        # `--pin`: rayon's workers bound one per CPU (`cpu::pin_threads`).
        self.proc = subprocess.Popen([path] + (["--pin"] if pin else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)
        ready = self.proc.stdout.readline()
        if not ready.startswith("ready"):
            raise SystemExit(f"{path}: unexpected greeting {ready!r}")
        self.threads = int(ready.split()[1])

    def run(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        if len(answer) < 2 or answer[0] != "ok" or answer[1] == "none":
            raise SystemExit(f"{command!r}: {' '.join(answer) or 'server exited'}")
        return float(answer[1])

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="timing server binary A (the baseline)")
    ap.add_argument("b", help="timing server binary B")
    ap.add_argument("commands", nargs="+", help="server commands, e.g. 'attn full fwd 8 8 1024 64'")
    ap.add_argument("--no-pin", action="store_true", help="leave the servers' threads unbound")
    ap.add_argument("--pairs", type=int, default=16, help="paired turns per command (default 16)")
    ap.add_argument("--threads", type=int, nargs=2, metavar=("A", "B"),
                    help="rayon threads of each server (default: the environment's); with the same "
                         "binary twice, e.g. --threads 1 2, A/B is the speed-up from the threads")
    args = ap.parse_args()

    ta, tb = args.threads or (None, None)
    a, b = Server(args.a, ta, not args.no_pin), Server(args.b, tb, not args.no_pin)
    try:
        for command in args.commands:
            once = max(a.run(command), b.run(command), 1e-4)
            runs = max(1, int(0.05 / once))
            ratios, times = [], {"a": [], "b": []}
            for i in range(args.pairs):
                turn = {}
                order = (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))
                for name, server in order:
                    server.run(command)
                    turn[name] = sum(server.run(command) for _ in range(runs)) / runs
                    times[name].append(turn[name])
                ratios.append(turn["a"] / turn["b"])
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            print(f"{command:40s} A {statistics.median(times['a']) * 1e3:8.2f} ms  "
                  f"B {statistics.median(times['b']) * 1e3:8.2f} ms  "
                  f"A/B {statistics.median(ratios):.3f} [{q1:.3f}, {q3:.3f}]", flush=True)
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    main()
