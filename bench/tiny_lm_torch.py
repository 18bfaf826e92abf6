"""The PyTorch twin of `examples/tiny_lm`: the same architecture, the same
initial weights and the same batches (read from the file that
`tiny_lm --export FILE` writes), trained with torch's AdamW; its per-step
losses against ours, and the step times of PyTorch eager and
`torch.compile`.

    cargo run --release -p boostr-runtime --features tiny-lm --example tiny_lm -- \\
        --steps 100 --check 50 --export /tmp/tiny_lm.safetensors
    python3 bench/tiny_lm_torch.py /tmp/tiny_lm.safetensors [--compile]

Exits non-zero when a loss of the first 50 steps differs from ours by more
than 1e-4 (relative).
"""

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from safetensors import safe_open

TOLERANCE = 1e-4


class Model(torch.nn.Module):
    def __init__(self, meta, weights):
        super().__init__()
        self.m = meta
        self.w = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(v.clone()) for k, v in weights.items()}
        )
        hd = meta["dim"] // meta["heads"]
        inv = 1.0 / (meta["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.arange(meta["max_seq"], dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def p(self, name):
        return self.w[name.replace(".", "_")]

    def norm(self, x, name):
        eps = self.m["norm_eps"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.p(name)

    def rope(self, x):
        s, half = x.shape[2], x.shape[3] // 2
        cos, sin = self.cos[:s], self.sin[:s]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, tokens, targets):
        m = self.m
        b, s = tokens.shape
        h, kvh = m["heads"], m["kv_heads"]
        hd = m["dim"] // h
        x = F.embedding(tokens, self.p("embed"))
        for l in range(m["layers"]):
            n = self.norm(x, f"{l}.attn_norm")
            split = lambda t, heads: t.view(b, s, heads, hd).transpose(1, 2)
            q = self.rope(split(F.linear(n, self.p(f"{l}.q")), h))
            k = self.rope(split(F.linear(n, self.p(f"{l}.k")), kvh))
            v = split(F.linear(n, self.p(f"{l}.v")), kvh)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(b, s, h * hd), self.p(f"{l}.o"))
            n = self.norm(x, f"{l}.mlp_norm")
            f = F.silu(F.linear(n, self.p(f"{l}.gate"))) * F.linear(n, self.p(f"{l}.up"))
            x = x + F.linear(f, self.p(f"{l}.down"))
        logits = F.linear(self.norm(x, "norm"), self.p("head"))
        return F.cross_entropy(logits.view(-1, m["vocab"]), targets)


def load(path):
    with safe_open(path, framework="pt") as f:
        raw = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = {k: (float(v) if "." in v or "e" in v else int(v)) for k, v in raw.items()}
    weights = {k[len("weights."):]: v for k, v in tensors.items() if k.startswith("weights.")}
    return meta, weights, tensors["batches.inputs"], tensors["batches.targets"], tensors["losses"]


class BoostrAdamW:
    """boostr 0.10's AdamW, step for step: decoupled decay `p·(1 − lr·wd)`,
    then `lr·√(1 − β2^t)/(1 − β1^t) · m / (√v + eps)`. torch.optim.AdamW adds
    eps after the bias correction (`√v/√(1 − β2^t) + eps`), which moves the
    first steps' updates of near-zero gradients by ~1e-5 of the loss."""

    def __init__(self, params, meta):
        self.params = list(params)
        self.m = meta
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.t = 0

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2, lr = self.m["beta1"], self.m["beta2"], self.m["lr"]
        step_size = lr * math.sqrt(1 - b2**self.t) / (1 - b1**self.t)
        decay = lr * self.m["weight_decay"]
        for p, (m, v) in zip(self.params, self.state):
            g = p.grad
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            p.mul_(1 - decay).sub_(step_size * m / (v.sqrt() + self.m["eps"]))


def train(meta, weights, inputs, targets, compile_, torch_adamw):
    model = Model(meta, weights)
    if torch_adamw:
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=meta["lr"],
            betas=(meta["beta1"], meta["beta2"]),
            eps=meta["eps"],
            weight_decay=meta["weight_decay"],
        )
    else:
        opt = BoostrAdamW(model.parameters(), meta)
    step_fn = torch.compile(model) if compile_ else model
    losses, times = [], []
    for i in range(inputs.shape[0]):
        started = time.perf_counter()
        loss = step_fn(inputs[i], targets[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    return losses, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--torch-adamw", action="store_true", help="torch.optim.AdamW instead of boostr's formula"
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    meta, weights, inputs, targets, ours = load(a.file)
    ours = ours.tolist()
    losses, times = train(meta, weights, inputs, targets, False, a.torch_adamw)
    print("step  ours        PyTorch     relative difference")
    worst50, worst = 0.0, 0.0
    for i, (x, y) in enumerate(zip(ours, losses)):
        rel = abs(x - y) / abs(y)
        worst = max(worst, rel)
        if i < 50:
            worst50 = max(worst50, rel)
        if i < 5 or i % 10 == 9 or i + 1 == len(ours):
            print(f"{i:4}  {x:.8f}  {y:.8f}  {rel:.2e}")
    steady = sorted(times[5:])[len(times[5:]) // 2]
    print(
        f"over {len(ours)} steps: max relative difference {worst:.2e} ({worst50:.2e} over the "
        f"first 50); PyTorch {torch.__version__} eager: {steady * 1e3:.1f} ms per step (median, "
        f"{a.threads} threads)"
    )
    if a.compile:
        _, ctimes = train(meta, weights, inputs, targets, True, a.torch_adamw)
        csteady = sorted(ctimes[5:])[len(ctimes[5:]) // 2]
        print(f"torch.compile: {csteady * 1e3:.1f} ms per step (median after the first 5)")
    if worst50 > TOLERANCE:
        print(f"the losses differ by {worst50:.2e} > {TOLERANCE:e} over the first 50 steps")
        sys.exit(1)


if __name__ == "__main__":
    main()
