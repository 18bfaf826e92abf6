#!/usr/bin/env python3
"""Packed causal documents on the CPU: boostr against torch.compile(flex_attention), one run.

    pip install torch numpy          # once, in any environment
    python3 bench/documents.py       # S = 8192, B = 1, Hq = Hkv = 8, D = 128, 8 documents
    python3 bench/documents.py --seq 4096 --dim 64 --docs 16

Times, interleaved in bursts as bench/cpu_vs_torch.py does (its timing server
and helpers), the forward of causal attention within packed documents:

  - boostr, closed form: `q / L == kv / L && kv <= q` (equal documents only);
  - boostr, ids from a tensor (`stock::CausalDocuments`): equal documents, and
    documents of random lengths (cut points uniform, --seed);
  - flex: torch.compile(flex_attention) with a block mask that
    `create_block_mask` builds from the same ids, timed with the mask
    creation counted (a new set of ids per call, as in training on packed
    batches) and without it (a mask built once and reused).

Per attended pair, the tensor variant against the closed form, and what
checking the ids and summarising them costs boostr before its kernels run.
FLOPs count useful work: 4 * Hq * D * (attended pairs).
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_vs_torch as base  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--no-pin", action="store_true", help="leave both sides' threads unbound")
    p.add_argument("--server", help="path of a prebuilt cpu_vs_torch example binary")
    a = p.parse_args()
    if a.seq % a.docs:
        p.error("--docs must divide --seq")
    return a


def random_lengths(s, n, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, s), n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [s])]


def pairs(lens):
    return sum(l * (l + 1) // 2 for l in lens)


def main():
    args = parse_args()
    torch = base.import_torch(not args.no_pin)
    binary = base.server_binary(args)
    server = base.Server(binary, args.threads, not args.no_pin)
    th = base.Torch(torch, args.threads, not args.no_flex)
    hq, s, d = args.hq, args.seq, args.dim
    x = th.inputs(hq, hq, s, d, "f32")
    equal = [s // args.docs] * args.docs
    rand_lens = random_lengths(s, args.docs, args.seed)
    print(f"causal packed documents, forward: boostr CPU vs PyTorch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads (boostr: {server.banner}); "
          f"B=1, Hq=Hkv={hq}, S={s}, D={d}, f32; median of {args.reps} runs, interleaved in bursts")
    print(f"random lengths (seed {args.seed}): {rand_lens}")

    def flex_sides(lens):
        """flex with the block mask made per call, and made once."""
        if not th.flex:
            return None, None, None
        ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        mask = lambda b, h, qi, kv: (ids[qi] == ids[kv]) & (qi >= kv)
        q, k, v, _ = x

        def block():
            return th.create_block_mask(mask, 1, None, s, s, device="cpu")

        once = block()

        def with_mask():
            with torch.no_grad():
                th.flex(q, k, v, block_mask=block())

        def reused():
            with torch.no_grad():
                th.flex(q, k, v, block_mask=once)

        reused()  # compile
        with_mask()
        return base.burst(with_mask), base.burst(reused), base.burst(block)

    rows = []
    f = lambda lens: 4 * hq * d * pairs(lens)
    for label, lens in (("equal", equal), ("random lengths", rand_lens)):
        server.ask("docs " + ",".join(map(str, lens)))
        closed = server.burst(f"attn docs_closed fwd {hq} {hq} {s} {d} f32") if lens is equal else None
        tensor = server.burst(f"attn docs fwd {hq} {hq} {s} {d} f32")
        host = server.burst(f"host {hq} {hq} {s} {d}")
        t_closed, t_tensor, t_host, t_flex_mask, t_flex, t_mask = _times(
            args.reps, tensor, closed, host, flex_sides(lens))
        rows.append((label, lens, t_closed, t_tensor, t_host, t_flex_mask, t_flex, t_mask))

    ref = None
    print()
    print("| documents | attended pairs | boostr closed form ms (GF/s) | boostr tensor ms (GF/s) | "
          "tensor per pair vs closed form | ids checked and summarised | flex, mask made per call ms (GF/s) | "
          "flex, mask reused ms (GF/s) | create_block_mask ms | boostr vs flex (per call / reused) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, lens, tc, tt, th_, tfm, tf, tm in rows:
        fl = f(lens)
        gf = lambda t: fl / t / 1e9
        if tc:
            ref = f(equal) / tc / 1e9
        cell = lambda t: "—" if t is None else f"{t * 1e3:.1f} ({gf(t):.0f})"
        ratio = lambda t: "—" if t is None else f"{t / tt:.2f}×"
        print(f"| {args.docs} {label} | {pairs(lens)} | {cell(tc)} | {cell(tt)} | "
              f"{gf(tt) / ref:.2f} | {th_ * 1e3:.2f} ms ({100 * th_ / tt:.2f}% of the forward) | "
              f"{cell(tfm)} | {cell(tf)} | {'—' if tm is None else f'{tm * 1e3:.1f}'} | "
              f"{ratio(tfm)} / {ratio(tf)} |")
    server.close()


def _times(reps, tensor, closed, host, sides):
    """Median seconds of every side, interleaved (the tensor variant first)."""
    flex_mask, flex, mask = sides
    t_tensor, t_closed, t_host, t_flex_mask, t_flex, t_mask = base.interleaved(
        reps, tensor, closed, host, flex_mask, flex, mask)
    return t_closed, t_tensor, t_host, t_flex_mask, t_flex, t_mask


if __name__ == "__main__":
    main()
