"""Benchmark: batched population evaluation (``jmsnas.evaluate.evaluate_population``) against the loop.

P sub-networks of the default space (``presets.chain_preset()``, 8 layers, 8x8x1 inputs, device channels
24/32/48/64, strides 1/2/1/2) sampled uniformly from the valid candidates, evaluated on one batch of B
digits-sized inputs. Rows:

* ``loop``: ``evaluate_loop``, a Python loop of one jitted single-architecture evaluation (``supernet.apply``
  with one-hot gates): the peer;
* ``vmap(single)`` (with ``--vmap``): ``jax.vmap`` of that same single-architecture evaluation, jitted (plain
  vmap; vmapping its per-layer ``lax.switch`` turns it into a select that runs every candidate);
* ``batched chunk=c``: ``evaluate_population`` with chunks of c architectures (and ``no prefix sharing``: with
  ``share_prefixes=False``, every architecture computed in full after the shared stem and layer 0);
* with ``--bn-batches K > 0`` the loop and the batched evaluator (first chunk size listed) also run with BN
  recalibration on K batches.

Each row is the median of ``--reps`` timed repetitions after one warm-up call (which compiles); the rows are
timed interleaved (one repetition of every row, then the next) so that load from other processes spreads over
all of them. Results are checked equal to the loop before timing. Prints a markdown table with the speed-up.

It also prints what bounds the speed-up: the useful FLOPs of the population (``jmsnas.space.op_flops`` of every
architecture's candidates + stem + head, 2 per multiply-add, forward only), the loop's rate in GFLOP/s against
this machine's fp32 2048x2048 matmul rate (JAX, same run), and the fraction of that work prefix sharing removes.
A batched evaluator that ran every convolution at the matmul rate could be at most
``matmul rate / loop rate / (1 - shared fraction)`` times faster than the loop.

Run: python benchmarks/bench_batched_eval.py [--population 64] [--batch 256] [--reps 5]
     [--chunks 1,2,4,8] [--bn-batches 2] [--vmap]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import evaluate as E
from jmsnas import supernet
from jmsnas.topology import presets
from jmsnas.cost.tables import analytic_table, head_flops, stem_flops
from jmsnas.space import OPS, build_space, op_flops


def default_space():
    return build_space(presets.chain_preset(), image_size=8, in_channels=1, num_classes=10,
                       device_channels=(24, 32, 48, 64), device_strides=(1, 2, 1, 2))


def random_population(space, size: int, seed: int = 0) -> np.ndarray:
    """int32[size, N]: every layer's candidate drawn uniformly from its valid ones."""
    rng = np.random.default_rng(seed)
    mask = space.mask()
    return np.array([[rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)]
                     for _ in range(size)], np.int32)


def population_flops(space, ops) -> tuple:
    """(FLOPs per image summed over the architectures, the same with each distinct prefix counted once)."""
    every = shared = 0.0
    seen = set()
    for arch in np.asarray(ops):
        every += stem_flops(space) + head_flops(space)
        for n, i in enumerate(arch):
            f = op_flops(OPS[int(i)], space.layers[n])
            every += f
            if tuple(arch[:n + 1]) not in seen:
                seen.add(tuple(arch[:n + 1]))
                shared += f
        shared += head_flops(space)
    return every, shared + stem_flops(space)


def matmul_gflops(reps: int = 5, n: int = 2048) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda v: v @ v)
    block(f(a))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        block(f(a))
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def block(tree):
    return jax.block_until_ready(tree)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--population", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--bn-batches", type=int, default=2, help="K recalibration batches (0: skip those rows)")
    ap.add_argument("--vmap", action="store_true",
                    help="add the plain vmap row (vmapping lax.switch computes every candidate: memory heavy)")
    args = ap.parse_args(argv)

    space = default_space()
    table = analytic_table(space)
    params, state = supernet.init(jax.random.PRNGKey(0), space)
    kx, ky, kb = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.uniform(kx, (args.batch, 8, 8, 1), jnp.float32, 0.0, 16.0)
    y = jax.random.randint(ky, (args.batch,), 0, 10)
    bn = jax.random.uniform(kb, (args.bn_batches, args.batch, 8, 8, 1), jnp.float32, 0.0, 16.0)
    ops = random_population(space, args.population)
    common = (space, table, params, state)

    rows = {"loop": lambda: E.evaluate_loop(*common, ops, x, y)}
    if args.vmap:
        single = jax.jit(jax.vmap(lambda o: E._evaluate_one(space, table, params, state, o, x, y, None)))
        rows["vmap(single)"] = lambda: single(jnp.asarray(ops))
    chunks = [int(v) for v in args.chunks.split(",")]
    rows[f"batched chunk={chunks[0]}, no prefix sharing"] = lambda: E.evaluate_population(
        *common, ops, x, y, chunk=chunks[0], share_prefixes=False)
    for c in chunks:
        rows[f"batched chunk={c}"] = lambda c=c: E.evaluate_population(*common, ops, x, y, chunk=c)
    if args.bn_batches:
        rows[f"loop, BN recal K={args.bn_batches}"] = lambda: E.evaluate_loop(*common, ops, x, y, bn_batches=bn)
        c = chunks[0]
        rows[f"batched chunk={c}, BN recal K={args.bn_batches}"] = lambda: E.evaluate_population(
            *common, ops, x, y, bn_batches=bn, chunk=c)

    reference = {}
    for name, fn in rows.items():  # warm-up (compiles) and equality check against the matching loop
        out = block(fn())
        key = "recal" if "BN recal" in name else "plain"
        if key not in reference:
            reference[key] = out
        for k in ("loss", "accuracy", "latency_ms"):
            np.testing.assert_allclose(np.asarray(out[k]), np.asarray(reference[key][k]), rtol=2e-4, atol=2e-4,
                                       err_msg=f"{name}: {k} differs from the loop")
    times = {name: [] for name in rows}
    for _ in range(args.reps):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            block(fn())
            times[name].append(time.perf_counter() - t0)

    med = {name: statistics.median(t) for name, t in times.items()}
    every, shared = population_flops(space, ops)
    peak = matmul_gflops()
    loop_rate = every * args.batch / med["loop"] / 1e9
    saved = 1.0 - shared / every
    print(f"work: {every * args.batch / 1e9:.1f} GFLOP forward for the population ({saved:.1%} of it in shared "
          f"prefixes); loop {loop_rate:.1f} GFLOP/s, fp32 matmul {peak:.1f} GFLOP/s here: a batched evaluator at "
          f"the matmul rate would be at most {peak / loop_rate / (1.0 - saved):.2f}x the loop\n")
    print(f"P = {args.population} architectures, batch {args.batch} x 8x8x1, median of {args.reps} reps "
          f"(interleaved), {jax.devices()[0].platform}\n")
    print("| method | median s | per architecture ms | speed-up vs its loop |")
    print("|---|---:|---:|---:|")
    for name, t in med.items():
        peer = med[f"loop, BN recal K={args.bn_batches}"] if "BN recal" in name else med["loop"]
        print(f"| {name} | {t:.3f} | {1e3 * t / args.population:.1f} | {peer / t:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
