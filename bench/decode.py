#!/usr/bin/env python3
"""CPU decode: boostr against PyTorch SDPA, one run.

    pip install torch numpy            # once, in any environment
    python3 bench/decode.py            # the shapes of examples/decode.rs
    python3 bench/decode.py --reps 15

Sq = 1, Hq = 32, Hkv = 8, D = 128, causal, for (B, Sk) in (1, 4k),
(1, 16k), (1, 64k), (8, 4k), (8, 16k), in f32, bf16 and f16:

  - boostr: `cargo run --release -p boostr-runtime --example decode`, which
    also measures the machine's read bandwidth in the same run;
  - torch.nn.functional.scaled_dot_product_attention with `enable_gqa=True`
    (the query row is the last position, so causal is every key), on as
    many threads as boostr's rayon pool, in each dtype;
  - torch.compile(flex_attention) with `enable_gqa=True` and no mask (the
    same pairs), f32, where it runs.

Effective bandwidth is bytes of K and V read / time; medians of --reps after
a warm-up.
"""

import argparse
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(1, 4096), (1, 16384), (1, 65536), (8, 4096), (8, 16384)]
HQ, HKV, D = 32, 8, 128


def torch_decode(reps):
    import torch

    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        size = torch.tensor([], dtype=dtype).element_size()
        for b, sk in SHAPES:
            q = torch.randn(b, HQ, 1, D).to(dtype)
            k = torch.randn(b, HKV, sk, D).to(dtype)
            v = torch.randn(b, HKV, sk, D).to(dtype)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            sdpa(q, k, v, enable_gqa=True)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                sdpa(q, k, v, enable_gqa=True)
                times.append(time.perf_counter() - t)
            times.sort()
            t = times[len(times) // 2]
            gb = 2 * b * HKV * sk * D * size / t / 1e9
            rows.append(f"{str(dtype)[6:]} B = {b}, Sk = {sk}: {t * 1e3:.2f} ms, {gb:.1f} GB/s of K and V")
            del q, k, v
    return rows


def flex_decode(reps):
    """torch.compile(flex_attention) with a causal mask_mod (the last
    position sees every key), GQA; its CPU path is the forward."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    flex = torch.compile(flex_attention)
    rows = []
    for b, sk in SHAPES:
        q = torch.randn(b, HQ, 1, D)
        k = torch.randn(b, HKV, sk, D)
        v = torch.randn(b, HKV, sk, D)
        try:
            flex(q, k, v, enable_gqa=True)
        except Exception as e:  # noqa: BLE001 - report, do not hide
            rows.append(f"B = {b}, Sk = {sk}: does not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            flex(q, k, v, enable_gqa=True)
            times.append(time.perf_counter() - t)
        times.sort()
        t = times[len(times) // 2]
        gb = 2 * b * HKV * sk * D * 4 / t / 1e9
        rows.append(f"B = {b}, Sk = {sk}: {t * 1e3:.2f} ms, {gb:.1f} GB/s of K and V")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    cmd = ["cargo", "run", "--release", "-q", "-p", "boostr-runtime", "--example", "decode", "--", str(args.reps)]
    print("boostr:")
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for line in out.strip().splitlines():
        print("  " + line)
    import torch

    threads = int(os.environ.get("RAYON_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__} SDPA, enable_gqa, {threads} threads:")
    for line in torch_decode(args.reps):
        print("  " + line)
    print(f"torch {torch.__version__} torch.compile(flex_attention), enable_gqa, {threads} threads:")
    for line in flex_decode(args.reps):
        print("  " + line)


if __name__ == "__main__":
    main()
