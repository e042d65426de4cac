"""Benchmark: exact chain DP (``jmsnas.split.solvers.chain_dp``) against exhaustive enumeration.

Rows: the DP alone on N = 200 layers and M = 6 devices, and the DP against a vectorised exhaustive search over
all C(N+M-1, M-1) contiguous splits on the largest size the enumeration finishes in a few seconds, with the
time ratio (median of ``--reps`` repetitions each) and whether both find the same latency. The enumeration
scores splits in NumPy batches with prefix sums (O(M) per split), so the ratio is not inflated by Python loops.

Run: python benchmarks/bench_chain_dp.py [--reps 5] [--enum-layers 48]
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import numpy as np

from jmsnas.split.solvers import chain_dp, cut_bytes, check_edges
from jmsnas.topology import DeviceProfile, chain, transfer_ms


def instance(n: int, m: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    devs = [DeviceProfile(f"d{i}", 10.0 * 4 ** i, 1e12) for i in range(m)]
    topo = chain(f"bench{m}", devs, list(rng.uniform(5, 200, m - 1)), [1] * m,
                 latencies_ms=list(rng.uniform(0, 2, m - 1)))
    speed = 0.8 ** np.arange(m)
    c = rng.uniform(0.1, 3.0, (n, m)) * speed
    return c, rng.uniform(1e3, 2e5, n), 1.5e5, topo


def enumerate_best(c, b, inb, topo, chunk: int = 200_000) -> float:
    """Minimum latency over every contiguous split (same conventions as chain_dp), batch-scored in NumPy."""
    n, m = c.shape
    pre = np.vstack([np.zeros(m), np.cumsum(c, axis=0)])  # [n+1, m]
    cut = cut_bytes(b, inb, check_edges(None, n))
    bw = np.array([l.bandwidth_mbps for l in topo.links])
    lat = np.array([l.latency_ms for l in topo.links])
    best = math.inf
    combos = itertools.combinations_with_replacement(range(n + 1), m - 1)
    while True:
        inner = np.array(list(itertools.islice(combos, chunk)), dtype=np.int64).reshape(-1, m - 1)
        if not len(inner):
            return best
        s = np.hstack([np.zeros((len(inner), 1), np.int64), inner, np.full((len(inner), 1), n)])
        cols = np.arange(m)
        comp = (pre[s[:, 1:], cols] - pre[s[:, :-1], cols]).sum(axis=1)
        comm = (np.where(inner < n, transfer_ms(cut[inner], bw, lat), 0.0)).sum(axis=1)
        best = min(best, float((comp + comm).min()))


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--enum-layers", type=int, default=48, help="N for the DP-vs-enumeration row (M = 6)")
    args = ap.parse_args(argv)
    print("| case | N | M | splits | DP ms (median) | enumeration ms (median) | enumeration / DP | same optimum |")
    print("|---|---|---|---|---|---|---|---|")
    c, b, inb, topo = instance(200, 6)
    dp_ms = median_ms(lambda: chain_dp(c, b, inb, topo), args.reps)
    print(f"| DP alone | 200 | 6 | {math.comb(205, 5):.3g} | {dp_ms:.1f} | - | - | - |")
    c, b, inb, topo = instance(args.enum_layers, 6, seed=1)
    dp_ms = median_ms(lambda: chain_dp(c, b, inb, topo), args.reps)
    en_ms = median_ms(lambda: enumerate_best(c, b, inb, topo), args.reps)
    same = math.isclose(chain_dp(c, b, inb, topo).total_ms, enumerate_best(c, b, inb, topo), rel_tol=1e-9)
    print(f"| DP vs enumeration | {args.enum_layers} | 6 | {math.comb(args.enum_layers + 5, 5):.3g} | {dp_ms:.1f} "
          f"| {en_ms:.1f} | {en_ms / dp_ms:.0f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
