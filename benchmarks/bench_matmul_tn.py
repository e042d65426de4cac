"""The 1x1 convolutions' weight gradient x^T g: XLA's dot against the native kernel (jmsnas_matmul_tn) and PyTorch.

Usage:
  python benchmarks/bench_matmul_tn.py [--reps 21] [--threads 2]

For each (rows, K, N) shape of the benchmark supernet's 1x1 convolutions and stem (batch 64 at 32x32, 16x16 and 8x8),
plus one small shape below ``dwconv.NATIVE_MATMUL_MIN_ROWS``, times one jitted x.T @ g under XLA and one call of the
native kernel (checked against float64), and torch.mm(x.t(), g) with --threads threads: median milliseconds of --reps
calls after warm-up, and the XLA / native ratio. Run it with JMSNAS_KEEP_FREED_MEMORY=1 so that no side pays page
faults for fresh output buffers (jmsnas.hostmem). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dwconv import median_seconds  # noqa: E402

from jmsnas import native  # noqa: E402

SHAPES = ((65536, 32, 96), (65536, 192, 32), (65536, 32, 192), (16384, 48, 288), (16384, 288, 48),
          (4096, 96, 576), (4096, 576, 96), (65536, 27, 16), (1000, 13, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--threads", type=int, default=2, help="torch threads (XLA:CPU uses every core)")
    args = p.parse_args()
    if args.reps < 5:
        raise ValueError(f"--reps must be at least 5 (median of >= 5 repetitions), got {args.reps}")
    native.require()
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        torch = None
    print("| x^T g | XLA ms | native ms | XLA / native | native GFLOP/s | PyTorch ms | max rel. error (native) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m, k, n in SHAPES:
        rng = np.random.default_rng(m + k + n)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        g = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
        xla = jax.jit(lambda x, g: x.T @ g)
        kern = jax.jit(lambda x, g, k=k, n=n: native.call("jmsnas_matmul_tn", (k, n), x, g))
        ref = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
        err = float(np.abs(np.asarray(kern(x, g)) - ref).max() / np.abs(ref).max())
        t_xla = median_seconds(lambda: jax.block_until_ready(xla(x, g)), args.reps) * 1e3
        t_nat = median_seconds(lambda: jax.block_until_ready(kern(x, g)), args.reps) * 1e3
        t_torch = "-"
        if torch is not None:
            xt, gt = torch.from_numpy(np.array(x)), torch.from_numpy(np.array(g))
            t_torch = f"{median_seconds(lambda: torch.mm(xt.t(), gt), args.reps) * 1e3:.2f}"
        print(f"| {m}x{k}^T @ {m}x{n} | {t_xla:.2f} | {t_nat:.2f} | {t_xla / t_nat:.2f}x | "
              f"{2 * m * k * n / t_nat / 1e6:.0f} | {t_torch} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
