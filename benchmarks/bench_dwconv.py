"""Forward + backward of one depthwise convolution: XLA's grouped convolution, the shifted-sum custom VJP and the
native CPU kernels (jmsnas/native, XLA FFI).

Usage:
  python benchmarks/bench_dwconv.py [--reps 5] [--batch 64] [--size 32] [--channels 96] [--kernels 3 5 7]

Times one jitted program that returns (y, dL/dx, dL/dw) for a fixed random cotangent (the output is returned so
that the forward pass cannot be dropped), median wall-clock seconds of --reps runs after two warm-up runs. If
torch is importable, the same forward + backward in PyTorch (torch.set_num_threads(--threads)) is timed in both
NCHW and channels_last layouts (its results are checked against the native kernels), and the ratio is taken
against the faster of the two. Times are in ms. A second table times the
1x1 (pointwise) convolution as lax.conv against jmsnas.dwconv.pointwise_conv (a matmul).
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmsnas.dwconv import depthwise_conv, pointwise_conv


def median_seconds(fn, reps: int, warmup: int = 2) -> float:
    """Median wall-clock seconds of fn() over reps runs after warmup runs; fn must block until done."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jax_step(f, *args, g=None):
    """A jitted (y, grads) program for f(*args) with a fixed cotangent g (random if None); returns a no-argument
    runner that blocks until done and returns (y, grads)."""
    if g is None:
        y_shape = jax.eval_shape(f, *args).shape
        g = jnp.asarray(np.random.default_rng(1).standard_normal(y_shape), jnp.float32)

    @jax.jit
    def step(args, g):
        y, pull = jax.vjp(f, *args)
        return y, pull(g)

    return lambda: jax.block_until_ready(step(args, g))


def torch_depthwise_step(x_np, w_np, g_np, channels_last: bool, threads: int):
    """Forward + backward of torch's grouped conv on the same data (NHWC arrays given, converted to NCHW)."""
    import torch

    torch.set_num_threads(threads)
    k, c = w_np.shape[0], w_np.shape[2]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.from_numpy(np.ascontiguousarray(x_np.transpose(0, 3, 1, 2))).to(memory_format=fmt).requires_grad_()
    g = torch.from_numpy(np.ascontiguousarray(g_np.transpose(0, 3, 1, 2))).to(memory_format=fmt)
    conv = torch.nn.Conv2d(c, c, k, padding=k // 2, groups=c, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(np.ascontiguousarray(w_np.transpose(2, 0, 1))[:, None]))
    conv = conv.to(memory_format=fmt)

    def step():
        x.grad = None
        conv.weight.grad = None
        y = conv(x)
        y.backward(g)
        return y

    def result():
        """(y, dx, dw) of the last run, in the NHWC / [k, k, C] layouts of the JAX side."""
        y = step().detach().numpy().transpose(0, 2, 3, 1)
        return y, x.grad.numpy().transpose(0, 2, 3, 1), conv.weight.grad.numpy()[:, 0].transpose(1, 2, 0)

    step.result = result
    return step


def check_same(ref, got, what: str) -> None:
    """Raise if two (y, dx, dw) triples differ by more than float32 round-off (the benchmark times the same op)."""
    y, (dx, dw) = got
    for name, a, b in zip(("y", "dx", "dw"), ref, (y, dx, dw)):
        a, b = np.asarray(a), np.asarray(b)
        err = float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30))
        if err > 1e-4:
            raise RuntimeError(f"{what}: {name} differs by {err:.2e} relative")


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def depthwise_table(args, use_torch: bool) -> str:
    b, s, c = args.batch, args.size, args.channels
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((b, s, s, c)).astype(np.float32)
    g_np = np.random.default_rng(1).standard_normal((b, s, s, c)).astype(np.float32)
    x, g = jnp.asarray(x_np), jnp.asarray(g_np)
    head = ("| k | XLA grouped conv (ms) | shifted (ms) | native kernels (ms) | grouped / native | shifted / native "
            "| native GFLOP/s |")
    sep = "|---|---|---|---|---|---|---|"
    if use_torch:
        head += " torch NCHW (ms) | torch channels_last (ms) | best torch / native |"
        sep += "---|---|---|"
    rows = [head, sep]
    for k in args.kernels:
        w_np = rng.standard_normal((k, k, c)).astype(np.float32) / k
        w = jnp.asarray(w_np)
        t_xla = median_seconds(jax_step(lambda a, v: depthwise_conv(a, v, 1, "xla"), x, w, g=g), args.reps)
        t_sh = median_seconds(jax_step(lambda a, v: depthwise_conv(a, v, 1, "shifted"), x, w, g=g), args.reps)
        fast = jax_step(lambda a, v: depthwise_conv(a, v, 1, "native"), x, w, g=g)
        t_nat = median_seconds(fast, args.reps)
        flops = 3 * 2 * k * k * b * s * s * c  # forward, input gradient, weight gradient
        row = (f"| {k} | {1e3 * t_xla:.1f} | {1e3 * t_sh:.1f} | {1e3 * t_nat:.1f} | {t_xla / t_nat:.1f}x "
               f"| {t_sh / t_nat:.1f}x | {flops / t_nat / 1e9:.1f} |")
        if use_torch:
            times = []
            for channels_last in (False, True):
                step = torch_depthwise_step(x_np, w_np, g_np, channels_last, args.threads)
                times.append(median_seconds(step, args.reps))
                check_same(step.result(), fast(), f"torch vs native, k={k}")
            row += f" {1e3 * times[0]:.1f} | {1e3 * times[1]:.1f} | {min(times) / t_nat:.2f}x |"
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return "\n".join(rows)


def pointwise_table(args) -> str:
    b, s = args.batch, args.size
    rows = ["| Cin -> Cout | lax.conv 1x1 (ms) | pointwise_conv (ms) | conv / matmul |", "|---|---|---|---|"]
    for cin, cout in ((args.channels, 6 * args.channels), (6 * args.channels, args.channels)):
        rng = np.random.default_rng(cin)
        x = jnp.asarray(rng.standard_normal((b, s, s, cin)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((cin, cout)) / np.sqrt(cin), jnp.float32)

        def conv(a, v):
            return lax.conv_general_dilated(a, v[None, None], (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

        t_conv = median_seconds(jax_step(conv, x, w), args.reps)
        t_mm = median_seconds(jax_step(pointwise_conv, x, w), args.reps)
        row = f"| {cin} -> {cout} | {1e3 * t_conv:.1f} | {1e3 * t_mm:.1f} | {t_conv / t_mm:.1f}x |"
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--channels", type=int, default=96)
    p.add_argument("--kernels", type=int, nargs="+", default=[3, 5, 7])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-pointwise", action="store_true")
    args = p.parse_args()
    if args.reps < 5:
        raise ValueError(f"--reps must be at least 5 (median of >= 5 runs), got {args.reps}")
    use_torch = not args.no_torch and torch_available()
    print(f"jax {jax.__version__} backend={jax.default_backend()} cpus={os.cpu_count()} "
          f"machine={platform.processor() or platform.machine()} load={os.getloadavg()[0]:.1f}")
    print(f"depthwise conv forward + backward, {args.batch}x{args.size}x{args.size}x{args.channels}, "
          f"stride 1, median of {args.reps} after 2 warm-up runs")
    table = depthwise_table(args, use_torch)
    print("\n" + table + "\n")
    if not args.no_pointwise:
        print(pointwise_table(args) + "\n")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
