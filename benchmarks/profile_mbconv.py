"""Where a training step's time goes: one MBConv layer and its parts, JAX (jmsnas.ops) against PyTorch, per part.

    python benchmarks/profile_mbconv.py [--batch 64] [--size 32] [--in-ch 16] [--expand 6] [--out-ch 32]
                                        [--kernels 3,5,7] [--reps 7] [--threads 2]

For each kernel size: the forward (training-mode batch norm) and forward + backward (gradients of sum(y^2) with
respect to the input and every parameter) of the whole MBConv (1x1 expand, BN, ReLU6, k x k depthwise, BN, ReLU6,
1x1 project, BN), and of its parts on the expanded activation float[B, size, size, in_ch * expand]: the depthwise
convolution, one training-mode batch norm, and the expanding 1x1 convolution. PyTorch runs the same modules in
channels_last with the same number of threads. Prints milliseconds (median of --reps after one warm-up call) and
the ratio PyTorch / JAX (> 1: JAX faster). The supernet benchmark (bench_vs_pytorch.py) gives the end-to-end
figures; this one says which part to work on next.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dwconv import median_seconds  # noqa: E402

from jmsnas import ops as O  # noqa: E402
from jmsnas.dwconv import depthwise_conv  # noqa: E402
from jmsnas.space import OpSpec  # noqa: E402


def jax_parts(args, k: int) -> dict:
    """Name -> a no-argument function that runs one JAX program and blocks."""
    B, H, C, M = args.batch, args.size, args.in_ch, args.in_ch * args.expand
    op = OpSpec("profiled", k, args.expand, False)
    p, st = O.mbconv_init(jax.random.PRNGKey(0), op, C, args.out_ch)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, H, H, C)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((B, H, H, M)), jnp.float32)
    bn_state = {"mean": jnp.zeros(M), "var": jnp.ones(M)}
    sq = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    mbconv = lambda p, x: O.mbconv_apply(p, st, x, op, 1, True)[0]
    dw = lambda w, h: depthwise_conv(h, w, 1)
    bn = lambda bp, h: O.batch_norm(bp, bn_state, h, True)[0]
    parts = {"mbconv": (mbconv, p, x), "depthwise": (dw, p["dw"], h), "batch norm": (bn, p["bn1"], h),
             "1x1 expand": (O.pointwise, x, p["expand"])}
    out = {}
    for name, (f, *a) in parts.items():
        fwd, grad = jax.jit(f), jax.jit(jax.grad(sq(f), argnums=(0, 1)))
        out[(name, "forward")] = lambda fwd=fwd, a=a: jax.block_until_ready(fwd(*a))
        out[(name, "fwd+bwd")] = lambda grad=grad, a=a: jax.block_until_ready(grad(*a))
    return out


def torch_parts(args, k: int) -> dict:
    B, H, C, M = args.batch, args.size, args.in_ch, args.in_ch * args.expand
    cl = torch.channels_last
    nn = torch.nn
    mbconv = nn.Sequential(nn.Conv2d(C, M, 1, bias=False), nn.BatchNorm2d(M), nn.ReLU6(),
                           nn.Conv2d(M, M, k, padding=k // 2, groups=M, bias=False), nn.BatchNorm2d(M), nn.ReLU6(),
                           nn.Conv2d(M, args.out_ch, 1, bias=False), nn.BatchNorm2d(args.out_ch)).to(memory_format=cl)
    dw = nn.Conv2d(M, M, k, padding=k // 2, groups=M, bias=False).to(memory_format=cl)
    bn = nn.BatchNorm2d(M)
    expand = nn.Conv2d(C, M, 1, bias=False).to(memory_format=cl)
    x = torch.randn(B, C, H, H).to(memory_format=cl).requires_grad_()
    h = torch.randn(B, M, H, H).to(memory_format=cl).requires_grad_()
    parts = {"mbconv": (mbconv, x), "depthwise": (dw, h), "batch norm": (bn, h), "1x1 expand": (expand, x)}
    out = {}
    for name, (m, a) in parts.items():
        m.train()

        def fwd(m=m, a=a):
            with torch.no_grad():
                m(a)

        def both(m=m, a=a):
            m.zero_grad()
            a.grad = None
            (m(a) ** 2).sum().backward()

        out[(name, "forward")], out[(name, "fwd+bwd")] = fwd, both
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--in-ch", type=int, default=16)
    ap.add_argument("--expand", type=int, default=6)
    ap.add_argument("--out-ch", type=int, default=32)
    ap.add_argument("--kernels", default="3,5,7")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.reps < 5:
        raise SystemExit(f"--reps must be at least 5 (median of >= 5 repetitions), got {args.reps}")
    torch.set_num_threads(args.threads)
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} ({args.threads} threads), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; batch {args.batch}, {args.size}x{args.size}, "
          f"{args.in_ch} -> {args.in_ch * args.expand} -> {args.out_ch} channels\n")
    print("| k | part | pass | JAX ms | PyTorch ms | PyTorch / JAX |")
    print("|---|---|---|---:|---:|---:|")
    for k in (int(v) for v in args.kernels.split(",")):
        jp, tp = jax_parts(args, k), torch_parts(args, k)
        for key in jp:
            tj = 1e3 * median_seconds(jp[key], args.reps, warmup=1)
            tt = 1e3 * median_seconds(tp[key], args.reps, warmup=1)
            print(f"| {k} | {key[0]} | {key[1]} | {tj:.1f} | {tt:.1f} | {tt / tj:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
