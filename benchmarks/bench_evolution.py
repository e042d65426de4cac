"""Evolution at SplitNets' scale (512 candidates x 20 generations) on a latency-only fitness.

Latency of an architecture = sum over layers of a table U[n, op] (ms) for N = 20 layers and R = 13 ops with a
random op mask; hard constraint T <= T_const (the 30th percentile of random architectures' latency, so most of
the initial population violates it); fitness = -T for feasible candidates, -inf otherwise. The optimum is the
per-layer minimum of U over valid ops.

Two ways to run the same search (same key, so the same result):

* ``lax.scan``: the whole search as one jitted program (``jax.jit(strategies.run)``);
* ``loop``: a Python loop of 20 calls of one jitted generation (ask -> fitness -> tell), the usual driver.

Times are after compilation: median (and min) of ``--reps`` runs. Usage::

    python benchmarks/bench_evolution.py [--reps 7] [--population 512] [--generations 20] [--seed 0]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import strategies


def latency_problem(seed: int, n: int = 20, r: int = 13):
    """(mask bool[N, R], table U float32[N, R] in ms, T_const in ms)."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n, r)) < 0.7
    mask[np.arange(n), rng.integers(0, r, n)] = True
    table = rng.uniform(0.05, 2.0, (n, r)).astype(np.float32)
    valid = [np.flatnonzero(m) for m in mask]
    samples = np.array([[rng.choice(v) for v in valid] for _ in range(2000)])
    t_const = float(np.percentile(table[np.arange(n), samples].sum(1), 30))
    return mask, table, t_const


def fitness_fn(table, t_const):
    u = jnp.asarray(table)

    def fitness(archs):
        lat = jnp.take_along_axis(u[None], archs.ops[..., None], axis=-1)[..., 0].sum(-1)  # ms, [P]
        return jnp.where(lat <= t_const, -lat, -jnp.inf)

    return fitness


def timed(fn, reps):
    """(first call incl. compilation s, [timed reps after it] s)."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return first, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--population", type=int, default=512)
    ap.add_argument("--generations", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.reps < 5:
        raise SystemExit(f"--reps must be at least 5, got {args.reps}")

    mask, table, t_const = latency_problem(args.seed)
    fitness = fitness_fn(table, t_const)
    strategy = strategies.make("evolution", mask=mask, population=args.population)
    key, gens = jax.random.key(args.seed), args.generations

    scan = jax.jit(lambda k: strategies.run(strategy, fitness, k, gens))
    step = jax.jit(strategies.step_fn(strategy, fitness))
    k_init, k_run = jax.random.split(key)  # the same split as strategies.run
    run_keys = jax.random.split(k_run, gens)

    def loop():
        state = strategy.init(k_init)
        for k in run_keys:
            state, _ = step(state, k)
        return state

    results = {}
    for name, fn in (("lax.scan (one jitted program)", lambda: scan(key)[0]), ("loop of jitted steps", loop)):
        first, times = timed(fn, args.reps)
        results[name] = (first, times, fn())
    states = [r[2] for r in results.values()]
    np.testing.assert_array_equal(states[0].best_ops, states[1].best_ops)  # same key, same search

    optimum = float(np.where(mask, table, np.inf).min(1).sum())
    evals = args.population * gens
    print(f"evolution: P={args.population} x {gens} generations = {evals} candidates, N=20 x R=13 "
          f"(mask keeps {mask.sum()} of {mask.size} ops), T_const={t_const:.3f} ms, "
          f"optimum {optimum:.3f} ms; {jax.devices()[0].platform}, jax {jax.__version__}\n")
    print("| driver | first call incl. compile (s) | median (s) | min (s) | candidates/s | best T (ms) |")
    print("|---|---|---|---|---|---|")
    for name, (first, times, state) in results.items():
        med = statistics.median(times)
        print(f"| {name} | {first:.2f} | {med:.4f} | {min(times):.4f} | {evals / med:,.0f} | "
              f"{-float(state.best_fitness):.3f} |")
    print(f"\nmedian and min over {args.reps} runs after the first; best T = latency of the best feasible "
          f"candidate found (optimum {optimum:.3f} ms).")


if __name__ == "__main__":
    main()
