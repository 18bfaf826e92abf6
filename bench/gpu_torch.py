#!/usr/bin/env python3
"""PyTorch baselines for boostr's CUDA benchmark (examples/gpu_bench.rs).

Same shapes, variants and FLOP count as gpu_bench: B=4, Hq=Hkv=16,
S in {1024, 4096}, D in {64, 128}, bf16, forward and forward+backward,
median over CUDA-event-timed reps after warm-up.

Implementations (one JSON line per measurement, same schema as gpu_bench,
plus a "note" field):
  sdpa  torch.nn.functional.scaled_dot_product_attention (PyTorch picks the
        kernel):
          causal          is_causal=True (FlashAttention-2 kernel)
          sliding_window  explicit boolean attn_mask [S, S] (memory-efficient
                          or math kernel: no FlashAttention with a mask)
          alibi, softcap  not run (SDPA has no score modification without
                          a dense float bias; not a like-for-like baseline)
  flex  torch.compile(flex_attention): create_block_mask for the causal and
        sliding-window masks; score_mod for alibi (with the causal block
        mask) and softcap (same).

Variants (as boostr's stock ones): causal; sliding_window: visible iff
0 <= q - kv < 256; alibi: s - 2^(-8(h+1)/16) (q - kv), causal; softcap:
30 tanh(s/30), causal.

FLOPs over visible pairs: forward 4 B H D pairs, backward 2.5x forward.

Installs nothing; without flex_attention (torch < 2.5) the flex rows are
skipped with a message. SDPA runs first, then flex from the largest shape
down; --budget-s bounds the total time: once spent, the remaining
configurations are skipped and listed (each torch.compile of flex for a new
variant/shape costs tens of seconds).
"""

import argparse
import json
import math
import statistics
import sys
import time

VARIANTS = ["causal", "sliding_window", "alibi", "softcap"]
WINDOW = 256
CAP = 30.0
ALIBI_HEADS = 16
# Variants SDPA runs (causal: is_causal=True; sliding window: a boolean mask).
SDPA_VARIANTS = ["causal", "sliding_window"]


def visible_pairs(variant, s):
    if variant == "sliding_window":
        w = WINDOW
        # sum over q of min(q + 1, w)
        if s <= w:
            return s * (s + 1) // 2
        return w * (w + 1) // 2 + (s - w) * w
    return s * (s + 1) // 2


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seqs", default="1024,4096")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--impls", default="sdpa,flex")
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args()

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"gpu_torch: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    seqs = [int(x) for x in args.seqs.split(",") if x]
    dims = [int(x) for x in args.dims.split(",") if x]
    impls = [x for x in args.impls.split(",") if x]

    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        sys.exit(f"gpu_torch: PyTorch is not importable: {e}")
    if not torch.cuda.is_available():
        sys.exit("gpu_torch: no CUDA device visible to PyTorch")
    dev = torch.device("cuda")
    log(f"gpu_torch: torch {torch.__version__}, {torch.cuda.get_device_name(dev)}")

    flex = None
    if "flex" in impls:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(
                torch._dynamo.config.cache_size_limit, 64
            )
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # ImportError, or an older torch without compile support
            log(f"gpu_torch: flex_attention unavailable in torch {torch.__version__} ({e}); skipping flex")

    # Score and mask functions (module-level so torch.compile caches by code).
    def causal_mask(b, h, q, kv):
        return kv <= q

    def sliding_mask(b, h, q, kv):
        return (q - kv >= 0) & (q - kv < WINDOW)

    def alibi_mod(score, b, h, q, kv):
        slope = torch.exp2(-8.0 * (h + 1).to(torch.float32) / ALIBI_HEADS)
        return score - slope * (q - kv).to(torch.float32)

    def softcap_mod(score, b, h, q, kv):
        return CAP * torch.tanh(score / CAP)

    flex_spec = {
        "causal": (causal_mask, None),
        "sliding_window": (sliding_mask, None),
        "alibi": (causal_mask, alibi_mod),
        "softcap": (causal_mask, softcap_mod),
    }

    def time_ms(fn):
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(args.reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        return statistics.median(samples)

    t_start = time.monotonic()
    B, H = args.batch, args.heads
    rows = []
    skipped = []
    # SDPA first (cheap), then flex with the largest shapes first: each flex
    # (variant, shape) costs a torch.compile, and the budget may run out.
    sdpa_variants = [v for v in variants if v in SDPA_VARIANTS]
    jobs = [("sdpa", v, s, d) for s in seqs for d in dims for v in sdpa_variants if "sdpa" in impls]
    jobs += sorted(
        (("flex", v, s, d) for s in seqs for d in dims for v in variants if "flex" in impls),
        key=lambda j: (-j[2], -j[3], variants.index(j[1])),
    )
    for impl in impls:
        if impl not in ("sdpa", "flex"):
            sys.exit(f"gpu_torch: unknown impl {impl!r} (sdpa, flex)")
    current = None
    for impl, variant, s, d in jobs:
        if time.monotonic() - t_start > args.budget_s:
            skipped.append(f"{impl} {variant} S={s} D={d}")
            continue
        if current != (s, d):
            current = None
            q = k = v = dout = qg = kg = vg = None
            torch.cuda.empty_cache()
            gen = torch.Generator(device=dev).manual_seed(s * 131 + d)

            def rand():
                return (torch.rand(B, H, s, d, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)

            q, k, v, dout = rand(), rand(), rand(), rand()
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            current = (s, d)

        note = ""
        if impl == "sdpa":
            if variant == "causal":
                kw = {"is_causal": True}
                note = "is_causal=True"
            elif variant == "sliding_window":
                qi = torch.arange(s, device=dev)[:, None]
                ki = torch.arange(s, device=dev)[None, :]
                kw = {"attn_mask": (qi - ki >= 0) & (qi - ki < WINDOW)}
                note = "boolean attn_mask"
            else:
                continue

            def fwd(kw=kw):
                return F.scaled_dot_product_attention(q, k, v, **kw)

            def fwdbwd(kw=kw):
                out = F.scaled_dot_product_attention(qg, kg, vg, **kw)
                out.backward(dout)
                qg.grad = kg.grad = vg.grad = None

        elif impl == "flex":
            if flex is None:
                continue
            mask_fn, score_mod = flex_spec[variant]
            note = "block_mask" + (" + score_mod" if score_mod else "")
            t0 = time.monotonic()
            block_mask = create_block_mask(mask_fn, None, None, s, s, device=dev)

            def fwd(bm=block_mask, sm=score_mod):
                return flex(q, k, v, score_mod=sm, block_mask=bm)

            def fwdbwd(bm=block_mask, sm=score_mod):
                out = flex(qg, kg, vg, score_mod=sm, block_mask=bm)
                out.backward(dout)
                qg.grad = kg.grad = vg.grad = None

            try:
                fwd()
                fwdbwd()
                torch.cuda.synchronize()
            except Exception as e:
                log(f"gpu_torch: flex {variant} S={s} D={d} failed to compile/run: {e}")
                continue
            log(f"gpu_torch: flex {variant} S={s} D={d} compiled in {time.monotonic() - t0:.1f} s")
        else:
            sys.exit(f"gpu_torch: unknown impl {impl!r} (sdpa, flex)")

        try:
            fwd_ms = time_ms(fwd)
            fwdbwd_ms = time_ms(fwdbwd)
        except Exception as e:
            log(f"gpu_torch: {impl} {variant} S={s} D={d} failed: {e}")
            continue
        fwd_flops = 4.0 * B * H * d * visible_pairs(variant, s)
        row = {
            "impl": impl,
            "variant": variant,
            "S": s,
            "D": d,
            "dtype": "bf16",
            "fwd_ms": round(fwd_ms, 4),
            "fwdbwd_ms": round(fwdbwd_ms, 4),
            "fwd_tflops": round(fwd_flops / (fwd_ms * 1e-3) / 1e12, 3),
            "fwdbwd_tflops": round(3.5 * fwd_flops / (fwdbwd_ms * 1e-3) / 1e12, 3),
            "note": note,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        log(f"gpu_torch: {impl} {variant} S={s} D={d}: fwd {fwd_ms:.3f} ms, fwd+bwd {fwdbwd_ms:.3f} ms")
    if skipped:
        log(f"gpu_torch: time budget of {args.budget_s:.0f} s spent; skipped: {'; '.join(skipped)}")
    if not rows:
        sys.exit("gpu_torch: no measurement completed")
    if not math.isfinite(sum(r["fwd_ms"] for r in rows)):
        sys.exit("gpu_torch: non-finite timings")


if __name__ == "__main__":
    main()
