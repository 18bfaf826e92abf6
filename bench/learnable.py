#!/usr/bin/env python3
"""Learnable relative position bias on the CPU: boostr against PyTorch, one run.

    pip install torch numpy            # once, in any environment
    python3 bench/learnable.py         # S = 4096, B = 1, Hq = 8, D = 128, causal T5 buckets
    python3 bench/learnable.py --seq 1024

Forward + backward of causal attention with T5's decoder bucket bias (a
learnable [Hq, 32] table):

  - boostr: `cargo run --release -p boostr-runtime --example learnable`, which
    times `stock::CausalT5Bias` with the table learnable and read-only (and
    the gpt-oss sinks against no sink), and prints its peak memory;
  - PyTorch SDPA with a float `attn_mask` gathered from the table (so it
    requires grad): it materialises the S x S bias and its gradient;
  - torch.compile(flex_attention) with the bucket lookup as its score_mod and a
    causal block mask: the forward (its CPU path has no backward).

Each PyTorch method runs in its own process, whose peak resident memory is
reported with its time (median of --reps after a warm-up).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T5_THRESHOLDS = [19, 21, 24, 27, 31, 35, 40, 46, 52, 59, 67, 77, 87, 99, 113]


def torch_run(method, s, hq, d, reps):
    import resource
    import torch

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, hq, s, d) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    table = (0.5 * torch.randn(hq, 32)).requires_grad_(True)
    pos = torch.arange(s)
    n = pos[:, None] - pos[None, :]
    large = 16 + sum((n >= t).long() for t in T5_THRESHOLDS)
    bucket = torch.where(n < 16, n.clamp(0, 15), large)
    causal = n >= 0

    if method == "sdpa":
        def step():
            bias = table[:, bucket].masked_fill(~causal, float("-inf")).unsqueeze(0)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            out.backward(dout)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, kvi):
            return kvi <= qi

        def score_mod(score, b, h, qi, kvi):
            rel = qi - kvi
            big = 16 + sum((rel >= t).to(torch.int64) for t in T5_THRESHOLDS)
            bk = torch.where(rel < 16, rel.clamp(0, 15), big)
            return score + table[h, bk]

        block = create_block_mask(mask_mod, 1, 1, s, s, device="cpu")
        flex = torch.compile(flex_attention)
        q, k, v, table = (t.detach() for t in (q, k, v, table))

        def step():
            with torch.no_grad():
                flex(q, k, v, score_mod=score_mod, block_mask=block)

    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(json.dumps({"ms": 1e3 * times[len(times) // 2], "peak_mib": peak, "threads": torch.get_num_threads()}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--torch-only", choices=["sdpa", "flex"])
    a = p.parse_args()
    hq, d = 8, 128
    if a.torch_only:
        torch_run(a.torch_only, a.seq, hq, d, a.reps)
        return
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "boostr-runtime", "--example", "learnable"],
                   cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ours = subprocess.run([os.path.join(target, "release", "examples", "learnable"), str(a.seq), str(a.reps)],
                          capture_output=True, text=True, check=True).stdout
    print("boostr:\n  " + ours.strip().replace("\n", "\n  "))
    for method, what in [("sdpa", "SDPA, float attn_mask requiring grad, forward + backward"),
                         ("flex", "torch.compile(flex_attention), forward only")]:
        r = subprocess.run([sys.executable, __file__, "--seq", str(a.seq), "--reps", str(a.reps),
                            "--torch-only", method], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"torch {what}: failed: {r.stderr.strip().splitlines()[-1] if r.stderr else r.returncode}")
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"torch {what}: {res['ms']:.1f} ms, peak resident memory {res['peak_mib']} MiB "
              f"({res['threads']} threads)")


if __name__ == "__main__":
    main()
