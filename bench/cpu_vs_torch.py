#!/usr/bin/env python3
"""boostr's CPU kernels against PyTorch's CPU attention, on the same machine in one run.

    pip install torch numpy            # once, in any environment; nothing is installed here
    python3 bench/cpu_vs_torch.py                  # the whole sweep (about 20 minutes on 2 cores)
    python3 bench/cpu_vs_torch.py --quick          # S = 1024 only
    python3 bench/cpu_vs_torch.py --seq 4096 --dim 128 --hkv 8 --section plain
    python3 bench/cpu_vs_torch.py --section mem    # peak RSS of forward+backward at S = 16384

It builds and starts `cargo run --release -p boostr-runtime --example cpu_vs_torch`
(a timing server) and times PyTorch in this process, alternating short bursts
of the two implementations on same-shaped inputs, so that machine drift hits
both; each time is the median of --reps runs, taken in bursts that each begin
with a pause and an untimed run, the runs of a burst back to back on both sides
(see `interleaved`).

Sections:
  gemm    f32 GEMM throughput, n = 4096: the `gemm` crate (on every thread) and
          torch.mm; bf16 torch.mm for reference. Then attention-sized tile
          products on one thread: boostr's AVX-512 tile kernel and the gemm crate,
          and the core's FMA peak (register-only FMAs), their ceiling.
  plain   full and causal attention, forward and forward+backward: boostr against
          torch.nn.functional.scaled_dot_product_attention; each cell also as a share
          of the FMA peak of all threads (`peak ... all` of the server, 24 register
          FMAs per round), measured right before and after the cell.
  custom  ALiBi (causal), softcap 30 (causal), causal sliding window 256, prefix-LM
          (prefix S/4), forward: boostr against torch.compile(flex_attention) on the
          CPU (which has no CPU backward); boostr's forward+backward too, and each
          variant's throughput per attended pair relative to boostr's plain causal.
  bf16    full and causal forward and forward+backward with bf16 inputs.
  layout  causal forward and forward+backward, f32 and bf16, on inputs made as
          [B, S, H, D] and permuted to [B, H, S, D] (`bshd`), against the
          same call on contiguous [B, H, S, D] inputs, for boostr (which reads
          them in place) and for SDPA.
  mem     peak resident set of one forward+backward (S = 16384, D = 128, Hq = 8),
          in a fresh process, against the bytes of q, k, v, out and their gradients.

FLOPs count useful work: 4 * B * Hq * D * (attended (query, key) pairs) for a
forward; the backward counts 2.5 times that. Threads: both sides use --threads
(default: every core; rayon and torch.set_num_threads), each thread bound to its
own CPU (the server's --pin, OpenMP's OMP_PROC_BIND=true OMP_PLACES=cores) unless
--no-pin: unbound workers woken together can share one CPU for tens of
milliseconds, which made the S = 1024 cells vary up to 2x on a 2-core VM.
"""

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ["gemm", "plain", "custom", "bf16", "layout", "mem"]
CUSTOM = ["alibi", "softcap", "window", "prefix"]
WINDOW = 256
PAUSE = 0.1
PEAK_ITERS = 2_000_000
SHORT = 0.05
CAP = 30.0


class Dims(collections.namedtuple("Dims", "d dv")):
    """A head dim `D`, or `D/Dv` for values of their own head dim (MLA's
    prefill: 192/128); prints as the server reads it."""

    @classmethod
    def parse(cls, text):
        d, _, dv = text.partition("/")
        return cls(int(d), int(dv or d))

    def __str__(self):
        return str(self.d) if self.d == self.dv else f"{self.d}/{self.dv}"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]
    p.add_argument("--seq", type=ints, default=[1024, 2048, 4096])
    p.add_argument("--dim", type=lambda s: [Dims.parse(x) for x in s.split(",")],
                   default=[Dims(64, 64), Dims(128, 128)],
                   help="head dims, comma-separated; D/Dv for values of their own head dim (e.g. 192/128)")
    p.add_argument("--hkv", type=ints, default=[8, 2])
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--quick", action="store_true", help="S = 1024 only")
    p.add_argument("--section", default=",".join(s for s in SECTIONS if s not in ("mem", "layout")),
                   help="comma-separated subset of " + ",".join(SECTIONS) + " (default: all but layout and mem)")
    p.add_argument("--no-pin", action="store_true",
                   help="leave both sides' threads unbound (by default each binds one thread per CPU)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--json", help="also write every measurement to this file")
    p.add_argument("--server", help="path of a prebuilt cpu_vs_torch example binary")
    a = p.parse_args()
    if a.quick:
        a.seq = a.seq[:1]
    a.section = a.section.split(",")
    bad = [s for s in a.section if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {SECTIONS}")
    return a


def import_torch(pin=True):
    # OpenMP reads its binding when torch loads: one thread per core, each
    # bound, as the Rust server's `--pin` binds rayon's workers.
    if pin:
        os.environ.setdefault("OMP_PROC_BIND", "true")
        os.environ.setdefault("OMP_PLACES", "cores")
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("PyTorch is not installed in this Python: `pip install torch numpy` (see the README)")
    import torch
    return torch


def server_binary(args):
    if args.server:
        return args.server
    print("building the Rust timing server (cargo build --release) ...", file=sys.stderr, flush=True)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "boostr-runtime", "--example", "cpu_vs_torch"],
                   cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "release", "examples", "cpu_vs_torch")


class Server:
    """The Rust timing server: one command per line, one answer per line."""

    def __init__(self, path, threads, pin):
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        argv = [path] + (["--pin"] if pin else [])
        # Started after torch, whose OpenMP binding narrowed this process's
        # affinity mask: the server gets every CPU back.
        cpus = range(os.cpu_count())
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        self.banner = self.proc.stdout.readline().strip()

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        if not reply.startswith("ok "):
            raise RuntimeError(f"{command!r}: {reply or 'server exited'}")
        return reply[3:]

    def time(self, command):
        return float(self.ask(command))

    def burst(self, command):
        """`interleaved`'s side for a server command: n + 1 runs back to back
        in the server (no round trip between them), the last n returned."""
        return lambda n: [float(t) for t in self.ask(f"repeat {n + 1} {command}").split()][1:]

    def fma_peak(self, threads):
        """GFLOP/s of the FMA peak loop on every thread at once (`peak ... all`),
        or None without AVX-512F."""
        return self.peak(f"peak {PEAK_ITERS} all", threads * PEAK_ITERS * 768)

    def dot_peak(self, threads):
        """GFLOP/s of the `vdpbf16ps` peak loop on every thread at once
        (`dotpeak`), or None without AVX512-BF16."""
        return self.peak(f"dotpeak {PEAK_ITERS}", threads * PEAK_ITERS * 24 * 64)

    def peak(self, command, flops):
        """The best of three runs of a peak loop after a pause (so that no
        thread of the other side is still spinning on the cores)."""
        pause()
        replies = [self.ask(command) for _ in range(3)]
        if "none" in replies:
            return None
        return flops / min(float(r) for r in replies) / 1e9

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def pairs(variant, s):
    """Attended (query, key) pairs of one head, Sq = Sk = s."""
    causal = s * (s + 1) // 2
    if variant == "full":
        return s * s
    if variant in ("causal", "alibi", "softcap"):
        return causal
    if variant == "window":
        w = min(WINDOW, s)
        return w * (w + 1) // 2 + (s - w) * w
    if variant == "prefix":
        pre = s // 4
        return pre * pre + (s * (s + 1) - pre * (pre + 1)) // 2
    raise ValueError(variant)


def flops(variant, pass_, hq, s, d):
    """Two products of the forward (`Q Kᵀ` over D, `P V` over Dv), five of
    the backward (S, dK, dQ over D; dP, dV over Dv), 2 flops per term."""
    d = d if isinstance(d, Dims) else Dims(d, d)
    n = pairs(variant, s) * hq
    fwd = 2 * n * (d.d + d.dv)
    return fwd + (2 * n * (3 * d.d + 2 * d.dv) if pass_ == "fwdbwd" else 0)


def interleaved(reps, *sides):
    """Median seconds of each side over `reps` timed runs each (three times
    as many when the first side takes under SHORT seconds), in alternating
    bursts. A side is a callable `burst(n)` that runs n + 1 times back to
    back and returns the seconds of the last n (the first is a warm-up);
    None sides are skipped and give None. Each burst starts after a pause of
    PAUSE seconds and times up to three runs. The pause and the untimed run
    keep one side's threads out of the other's measurement: right after one
    side's run, the other side's first run is slowed by the first side's
    threads still spinning (OpenMP, rayon) — by up to 1.7x, measured on 2
    cores. Within a burst the runs follow each other directly on both sides,
    so that neither pays for waking its threads more often than the other."""
    times = [[] for _ in sides]
    # Short runs are the noisiest and the cheapest: three times the runs.
    if sides[0](1)[0] < SHORT:
        reps *= 3
    while len(times[0]) < reps:
        n = min(3, reps - len(times[0]))
        for side, ts in zip(sides, times):
            if side:
                pause()
                ts += side(n)
    return [statistics.median(ts) if ts else None for ts in times]


def burst(fn):
    """`interleaved`'s side for an in-process callable: n + 1 runs, the last n timed."""
    return lambda n: [timed(fn) for _ in range(n + 1)][1:]


PAUSED = [0.0]


def pause():
    """Sleep PAUSE seconds, and count them (they are left out of the CPU-time check)."""
    time.sleep(PAUSE)
    PAUSED[0] += PAUSE


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Torch:
    def __init__(self, torch, threads, flex):
        self.torch = torch
        torch.set_num_threads(threads)
        self.F = torch.nn.functional
        self.flex = None
        self.flex_error = None
        if flex:
            try:
                import torch._dynamo
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                self.create_block_mask = create_block_mask
                # Every cell brings new score and mask functions, so every
                # cell compiles anew. Past dynamo's recompile limit (8 by
                # default) flex_attention would silently run eagerly, an
                # unfused implementation that materialises the scores; so
                # raise the limit, and make that fallback an error (see
                # `flex_fn`) rather than a slow number. `dynamic=False`:
                # one kernel specialised to each shape, as for boostr.
                config = torch._dynamo.config
                for name in ("recompile_limit", "cache_size_limit"):
                    if hasattr(config, name):
                        setattr(config, name, 4096)
                if hasattr(config, "accumulated_recompile_limit"):
                    config.accumulated_recompile_limit = 1 << 16
                warnings.filterwarnings("error", message=".*flex_attention called without torch.compile")
                self.flex = torch.compile(flex_attention, dynamic=False)
            except Exception as e:  # older torch: report and go on without it
                self.flex_error = f"{type(e).__name__}: {e}"

    def inputs(self, hq, hkv, s, d, dtype):
        t = self.torch
        dt = {"f32": t.float32, "bf16": t.bfloat16}[dtype]
        g = t.Generator().manual_seed(hq * 1_000_003 + hkv * 10_007 + s * 101 + d.d * 7 + d.dv)
        mk = lambda h, d: t.randn(1, h, s, d, generator=g).to(dt)
        return mk(hq, d.d), mk(hkv, d.d), mk(hkv, d.dv), mk(hq, d.dv)

    def permuted(self, x):
        """Each of `x` made as a contiguous [B, S, H, D] copy, viewed as [B, H, S, D]."""
        return tuple(y.transpose(1, 2).contiguous().transpose(1, 2) for y in x)

    def sdpa(self, variant, pass_, x):
        t, F = self.torch, self.F
        q, k, v, dout = x
        gqa = q.shape[1] != k.shape[1]
        causal = variant == "causal"
        if pass_ == "fwd":
            def run():
                with t.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        else:
            qg, kg, vg = (y.detach().requires_grad_() for y in (q, k, v))

            def run():
                for y in (qg, kg, vg):
                    y.grad = None
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=gqa)
                out.backward(dout)
        return run

    def flex_fn(self, variant, x):
        t = self.torch
        q, k, v, _ = x
        hq, s = q.shape[1], q.shape[2]
        gqa = q.shape[1] != k.shape[1]
        causal = lambda b, h, qi, kv: qi >= kv
        masks = {
            "full": None,
            "causal": causal,
            "alibi": causal,
            "softcap": causal,
            "window": lambda b, h, qi, kv: (qi >= kv) & (qi - kv < WINDOW),
            "prefix": lambda b, h, qi, kv: (kv < s // 4) | (qi >= kv),
        }
        slopes = t.exp2(-8.0 * t.arange(1, hq + 1, dtype=t.float32) / hq)
        scores = {
            "alibi": lambda sc, b, h, qi, kv: sc - slopes[h] * (qi - kv),
            "softcap": lambda sc, b, h, qi, kv: CAP * t.tanh(sc / CAP),
        }
        mask = masks[variant]
        block = self.create_block_mask(mask, None, None, s, s, device="cpu") if mask else None
        score = scores.get(variant)

        def run():
            with t.no_grad():
                self.flex(q, k, v, score_mod=score, block_mask=block, enable_gqa=gqa)
        # Compile now, where a failure (or the eager fallback's warning,
        # an error here) leaves the cell without flex instead of ending the run.
        run()
        return run


def gflops(f, sec):
    return f / sec / 1e9 if sec else float("nan")


def table(title, header, rows):
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(header))) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    sys.stdout.flush()


def fmt_ms(sec):
    return "—" if sec is None else f"{sec * 1e3:.1f}"


def fmt_gf(x):
    return "—" if x is None or math.isnan(x) else f"{x:.1f}"


def fmt_ratio(x):
    return "—" if x is None or math.isnan(x) else f"{x:.2f}×"


def main():
    args = parse_args()
    torch = import_torch(not args.no_pin)
    results = []
    binary = server_binary(args)

    if "mem" in args.section:
        mem(binary, args)
    run_sections = [s for s in args.section if s != "mem"]
    if not run_sections:
        return
    server = Server(binary, args.threads, not args.no_pin)
    th = Torch(torch, args.threads, not args.no_flex)
    print(f"boostr CPU vs PyTorch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} threads (boostr: {server.banner}); B=1, Hq={args.hq}; "
          f"median of {args.reps} runs ({3 * args.reps} under {SHORT * 1e3:.0f} ms), alternating in bursts "
          f"that each start after a {PAUSE * 1e3:.0f} ms pause with an untimed run; "
          f"ratio = torch time / boostr time")
    cpu0 = os.times()

    if "gemm" in args.section:
        n = 4096
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        ab16, bb16 = a.bfloat16(), b.bfloat16()
        f = 2 * n ** 3
        crate, tmm, tbf = interleaved(args.reps, server.burst(f"gemm {n} f32"),
                                      burst(lambda: torch.mm(a, b)),
                                      burst(lambda: torch.mm(ab16, bb16)))
        rows = [["gemm crate, f32", fmt_ms(crate), fmt_gf(gflops(f, crate))],
                ["torch.mm, f32", fmt_ms(tmm), fmt_gf(gflops(f, tmm))],
                ["torch.mm, bf16", fmt_ms(tbf), fmt_gf(gflops(f, tbf))]]
        table(f"GEMM {n}×{n}×{n}", ["kernel", "ms", "GFLOP/s"], rows)
        results += [dict(section="gemm", kernel=k, seconds=t) for k, t in
                    [("gemm-crate-f32", crate), ("torch-mm-f32", tmm), ("torch-mm-bf16", tbf)]]
        gemm_gf = gflops(f, crate)

        # Attention-sized tile products on one thread: boostr's AVX-512 tile
        # kernel against the gemm crate (the best of --reps calls of 20 000).
        rows = []
        for m, n_, k, layout in ((64, 64, 64, "n"), (64, 64, 64, "t"), (64, 128, 64, "n"), (64, 64, 128, "n")):
            ours, theirs = [], []
            for _ in range(args.reps):
                a_, b_ = server.ask(f"tile {m} {n_} {k} {layout} 20000").split()
                ours.append(float("nan") if a_ == "none" else float(a_))
                theirs.append(float(b_))
            tf = 2 * m * n_ * k * 20000
            rows.append([f"{m}×{n_}×{k}" + (", A transposed" if layout == "t" else ""),
                         fmt_gf(gflops(tf, min(ours))), fmt_gf(gflops(tf, min(theirs)))])
            results.append(dict(section="tile", shape=[m, n_, k, layout], ours=min(ours), gemm=min(theirs)))
        # The ceiling of both: one core's FMA throughput, from a loop of 24
        # independent register FMAs with no loads (best of --reps).
        peak = [server.ask("peak 20000000") for _ in range(args.reps)]
        if "none" not in peak:
            t = min(float(p) for p in peak)
            rows.append(["FMA peak (registers only)", fmt_gf(gflops(20000000 * 24 * 32, t)), ""])
            results.append(dict(section="peak", seconds=t, flops=20000000 * 24 * 32))
        table("Tile products C += A·B on one thread, best of --reps × 20 000 calls",
              ["m×n×k", "boostr tile kernel GFLOP/s", "gemm crate GFLOP/s"], rows)
    else:
        gemm_gf = None

    amx_gf = None
    if "bf16" in args.section:
        # The bf16 tile peak on every thread: four independent AMX tdpbf16ps
        # on registers per round (best of --reps, one thread, times threads).
        peak = [server.ask("amxpeak 2000000") for _ in range(args.reps)]
        if "none" not in peak:
            t = min(float(p) for p in peak)
            amx_gf = gflops(2000000 * 4 * 16384, t) * args.threads
            print(f"AMX bf16 tile peak: {fmt_gf(amx_gf)} GFLOP/s on {args.threads} threads "
                  f"({fmt_gf(amx_gf / args.threads)} per core, registers only)", file=sys.stderr)
            results.append(dict(section="amxpeak", seconds=t, flops=2000000 * 4 * 16384))
    for dtype, section in (("f32", "plain"), ("bf16", "bf16")):
        if section not in args.section:
            continue
        rows = []
        for variant in ("full", "causal"):
            for pass_ in ("fwd", "fwdbwd"):
                for hkv in args.hkv:
                    for d in args.dim:
                        for s in args.seq:
                            x = th.inputs(args.hq, hkv, s, d, dtype)
                            cmd = f"attn {variant} {pass_} {args.hq} {hkv} {s} {d} {dtype}"
                            # The bf16 kernels' ceiling is the dot-product peak
                            # where they run on vdpbf16ps (no AMX).
                            on_dot = section == "bf16" and not amx_gf
                            peak_of = server.dot_peak if on_dot else server.fma_peak
                            peak0 = peak_of(args.threads)
                            try:
                                tb, tt = interleaved(args.reps, server.burst(cmd), burst(th.sdpa(variant, pass_, x)))
                            except RuntimeError as e:
                                print(f"boostr: {e}", file=sys.stderr)
                                [tt] = interleaved(args.reps, burst(th.sdpa(variant, pass_, x)))
                                tb = None
                            peak = (peak0 + peak_of(args.threads)) / 2 if peak0 else None
                            f = flops(variant, pass_, args.hq, s, d)
                            gb, gt = (gflops(f, tb) if tb else None), gflops(f, tt)
                            row = [variant, "fwd" if pass_ == "fwd" else "fwd+bwd", str(hkv), str(s), str(d),
                                   fmt_ms(tb), fmt_gf(gb), fmt_ms(tt), fmt_gf(gt),
                                   fmt_ratio(tt / tb if tb else None)]
                            if peak:
                                row.append(f"{100 * gb / peak:.0f}%" if gb else "")
                            if gemm_gf and section == "plain":
                                row.append(f"{100 * gb / gemm_gf:.0f}%" if (gb and variant == "full" and pass_ == "fwd") else "")
                            if amx_gf and section == "bf16":
                                row.append(f"{100 * gb / amx_gf:.0f}%" if gb else "")
                            rows.append(row)
                            print("  " + " ".join(row), file=sys.stderr, flush=True)
                            results.append(dict(section=section, variant=variant, pass_=pass_, hq=args.hq, hkv=hkv,
                                                s=s, d=d, dtype=dtype, boostr=tb, torch=tt, flops=f,
                                                peak_gflops=peak, peak_kind="vdpbf16ps" if on_dot else "fma"))
        header = ["variant", "pass", "Hkv", "S", "D", "boostr ms", "boostr GF/s", "SDPA ms", "SDPA GF/s", "ratio"]
        if rows and len(rows[0]) > len(header):
            header.append("of dot peak" if section == "bf16" and not amx_gf else "of FMA peak")
        if gemm_gf and section == "plain":
            header.append("of gemm")
        if amx_gf and section == "bf16":
            header.append("of AMX peak")
        table(f"{dtype}: boostr vs scaled_dot_product_attention", header, rows)

    if "plain" in args.section and "bf16" in args.section:
        # boostr's bf16 against its own f32, cell by cell, same run.
        f32 = {(r["variant"], r["pass_"], r["hkv"], r["s"], r["d"]): r["boostr"]
               for r in results if r.get("section") == "plain"}
        rows = []
        for r in results:
            if r.get("section") != "bf16":
                continue
            key = (r["variant"], r["pass_"], r["hkv"], r["s"], r["d"])
            base = f32.get(key)
            if base and r["boostr"] and r["torch"]:
                rows.append([r["variant"], "fwd" if r["pass_"] == "fwd" else "fwd+bwd", str(r["hkv"]),
                             str(r["s"]), str(r["d"]), fmt_ratio(base / r["boostr"]),
                             fmt_ratio(r["torch"] / r["boostr"])])
        table("bf16: boostr's bf16 against its own f32 and against SDPA bf16",
              ["variant", "pass", "Hkv", "S", "D", "bf16 speedup over f32", "over SDPA bf16"], rows)

    if "layout" in args.section:
        # Permuted [B, S, H, D] inputs against contiguous ones, each side
        # against itself, interleaved with the contiguous run.
        rows = []
        for dtype in ("f32", "bf16"):
            for pass_ in ("fwd", "fwdbwd"):
                for hkv in args.hkv:
                    for d in args.dim:
                        for s in args.seq:
                            x = th.inputs(args.hq, hkv, s, d, dtype)
                            xp = th.permuted(x)
                            cmd = f"attn causal {pass_} {args.hq} {hkv} {s} {d} {dtype}"
                            tb, tbp, tt, ttp = interleaved(
                                args.reps, server.burst(cmd), server.burst(cmd + " bshd"),
                                burst(th.sdpa("causal", pass_, x)), burst(th.sdpa("causal", pass_, xp)))
                            row = [dtype, "fwd" if pass_ == "fwd" else "fwd+bwd", str(hkv), str(s), str(d),
                                   fmt_ms(tb), fmt_ms(tbp), f"{tbp / tb:.3f}", fmt_ms(tt), fmt_ms(ttp),
                                   f"{ttp / tt:.3f}"]
                            rows.append(row)
                            print("  " + " ".join(row), file=sys.stderr, flush=True)
                            results.append(dict(section="layout", pass_=pass_, hq=args.hq, hkv=hkv, s=s, d=d,
                                                dtype=dtype, boostr=tb, boostr_bshd=tbp, torch=tt, torch_bshd=ttp))
        table("causal: permuted [B, S, H, D] inputs against contiguous [B, H, S, D] (time ratio; 1 = no cost)",
              ["dtype", "pass", "Hkv", "S", "D", "boostr ms", "bshd ms", "ratio", "SDPA ms", "bshd ms", "ratio"],
              rows)

    if "custom" in args.section:
        if th.flex_error:
            print(f"FlexAttention unavailable: {th.flex_error}", file=sys.stderr)
        rows = []
        for hkv in args.hkv:
            for d in args.dim:
                for s in args.seq:
                    x = th.inputs(args.hq, hkv, s, d, "f32")
                    causal = f"attn causal fwd {args.hq} {hkv} {s} {d} f32"
                    for variant in CUSTOM:
                        cmd = f"attn {variant} fwd {args.hq} {hkv} {s} {d} f32"
                        flex = None
                        if th.flex:
                            try:
                                flex = th.flex_fn(variant, x)
                            except Exception as e:
                                print(f"flex {variant}: {type(e).__name__}: {e}", file=sys.stderr)
                        # The variant, plain causal on the same shape (for the
                        # per-pair comparison) and flex, interleaved.
                        tb, causal_fwd, tf = interleaved(
                            args.reps, server.burst(cmd), server.burst(causal), flex and burst(flex))
                        [tbb] = interleaved(
                            args.reps, server.burst(f"attn {variant} fwdbwd {args.hq} {hkv} {s} {d} f32"))
                        f = flops(variant, "fwd", args.hq, s, d)
                        gb = gflops(f, tb)
                        causal_gf = gflops(flops("causal", "fwd", args.hq, s, d), causal_fwd)
                        row = [variant, str(hkv), str(s), str(d), fmt_ms(tb), fmt_gf(gb),
                               f"{100 * gb / causal_gf:.0f}%", fmt_ms(tf), fmt_gf(gflops(f, tf) if tf else None),
                               fmt_ratio(tf / tb if tf else None), fmt_ms(tbb), fmt_gf(gflops(3.5 * f, tbb))]
                        rows.append(row)
                        print("  " + " ".join(row), file=sys.stderr, flush=True)
                        results.append(dict(section="custom", variant=variant, hq=args.hq, hkv=hkv, s=s, d=d,
                                            boostr=tb, flex=tf,
                                            boostr_fwdbwd=tbb, causal_fwd=causal_fwd, flops=f))
        table("f32 custom variants: boostr vs torch.compile(flex_attention) (forward; flex has no CPU backward)",
              ["variant", "Hkv", "S", "D", "boostr ms", "boostr GF/s", "per pair vs causal", "flex ms", "flex GF/s",
               "ratio", "boostr fwd+bwd ms", "fwd+bwd GF/s"], rows)

    server.close()
    cpu1 = os.times()
    used = (cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system
            + cpu1.user + cpu1.system - cpu0.user - cpu0.system)
    wall = cpu1.elapsed - cpu0.elapsed
    busy = wall - PAUSED[0]
    print(f"\nwall {wall:.0f} s ({PAUSED[0]:.0f} s of it in pauses); CPU time of both processes "
          f"{100 * used / (busy * args.threads):.0f}% of {args.threads} threads × the time outside pauses "
          f"(well below 100% means something else shared the cores)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


def mem(binary, args):
    s, d, hq = 16384, 128, args.hq
    rows = []
    for hkv in args.hkv:
        server = Server(binary, args.threads, not args.no_pin)
        reply = json.loads(server.ask(f"mem causal {hq} {hkv} {s} {d}"))
        server.close()
        extra = reply["peak_rss"] - reply["rss_before_inputs"]
        rows.append([str(hkv), f"{reply['tensors'] / 2**20:.0f}", f"{reply['peak_rss'] / 2**20:.0f}",
                     f"{extra / 2**20:.0f}", f"{reply['peak_rss'] / reply['tensors']:.2f}×",
                     f"{reply['seconds']:.1f}"])
    table(f"peak RSS of one causal forward+backward, S={s}, D={d}, Hq={hq}, f32 (fresh process each)",
          ["Hkv", "q,k,v,out + grads MiB", "peak RSS MiB", "growth from start MiB", "peak / tensors", "seconds"],
          rows)


if __name__ == "__main__":
    main()
