"""A design choice of ``jmsnas adapt --library`` judged without the target's data (HELP's FBNet data).

For each target T of the data, every other device P acts as the target in turn, adapted by
``adapt_prior.adapt_library`` from the shipped tables of the devices other than T and P, from P's 10 reference
networks and from ``--draws`` random sets of 10 of P's networks 0-3999, and scored on P's other networks of 0-3999.
Nothing of T (not its table, not its networks) is in T's row; networks 4000-4999 are in no row. The row of T is
the evidence for or against a change when T is adapted.

Compared: the design against ``--alternative``:
- ``absolute``: the combination of the library's tables fitted by least absolute relative errors (a linear
  program) instead of least squares on relative errors (NNLS, ``adapt_prior._combine``); tried, not kept;
- ``layers``: the structural table (``adapt_prior.structural_tables``) as one unit per layer that runs something
  (a block or a shape-changing skip alike) instead of the kernels each layer launches; the first version, replaced.
(docs/device_tables.md, *Choosing without the target*). Printed: per T, the mean held-out MAPE, share within
+-10% and Spearman of both, and the paired differences (alternative - design) with their standard errors, over
the (P, sample) rows; then over every row, with the standard error clustered by (T, P); then per pseudo-target P.

    python benchmarks/validate_adapt_design.py [--alternative absolute|layers] [--data ../shared/reference/help_fbnet]
                                               [--draws 8] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from scipy import stats
from scipy.optimize import linprog

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jmsnas.cost import adapt_prior as AP  # noqa: E402
from jmsnas.cost import layertable as LT  # noqa: E402
from jmsnas.cost import library as LB  # noqa: E402
from jmsnas.fbnet import help as H  # noqa: E402
from build_fbnet_library import stages  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "reference",
                            "help_fbnet")


def absolute(lib_pred, y):
    """The alternative: w >= 0 minimising sum_k |lib_pred[k] . w - y_k| / y_k, as the linear program min sum t,
    -t <= A w - 1 <= t, w >= 0, A = lib_pred / y (HiGHS)."""
    a = lib_pred / y[:, None]
    k, j = a.shape
    eye = np.eye(k)
    res = linprog(np.concatenate([np.zeros(j), np.ones(k)]), A_ub=np.block([[a, -eye], [-a, -eye]]),
                  b_ub=np.concatenate([np.ones(k), -np.ones(k)]), bounds=[(0, None)] * (j + k), method="highs")
    assert res.status == 0, res.message
    return res.x[:j]


def layers(base, structure: str) -> tuple:
    """The alternative structural table: 1 for every (layer, op) that runs something (an op with a kernel size, or a
    skip where the layer changes the shape), whatever its kernels."""
    if structure == "none":
        return ()
    cells = (AP.block_ops(base.op_names)[None, :] | AP._reshaping(base)[:, None]).astype(np.float64)
    return (LT.make(0.0, np.where(base.valid, cells, np.nan), base.op_names, space=base.space,
                    device="layers (ms per layer run)", source="validate_adapt_design.layers"),)


ALTERNATIVES = {"absolute": ("_combine", absolute), "layers": ("structural_tables", layers)}


def rows(data, helps, shipped, draws: int, seed: int) -> dict:
    """{(T, P, sample): (MAPE %, within +-10% %, Spearman)} (module docstring)."""
    rng = np.random.default_rng(seed)
    sets = [("reference", np.asarray(data["reference"]))] + [(f"draw{i}", rng.choice(4000, 10, replace=False))
                                                             for i in range(draws)]
    every = {d: H.measured(data, d, range(4000)) for d in shipped}
    out = {}
    for t in sorted(shipped):
        for p in sorted(shipped):
            if p == t:
                continue
            base = helps["raspi4" if "pixel3" in (t, p) else "pixel3"]
            lib = [tab for d, tab in shipped.items() if d not in (t, p)]
            for name, idx in sets:
                table = AP.adapt_library(base, H.measured(data, p, idx), lib, stages=stages())
                keep = np.ones(4000, bool)
                keep[idx] = False
                pred, y = LT.predict_ms(table, every[p].archs[keep]), every[p].ms[keep]
                e = np.abs(pred - y) / y
                out[(t, p, name)] = (float(100 * e.mean()), float(100 * np.mean(e <= 0.1)),
                                     float(stats.spearmanr(pred, y)[0]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA, help="directory of HELP's FBNet files")
    ap.add_argument("--draws", type=int, default=8, help="random sets of 10 networks per pseudo-target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alternative", choices=sorted(ALTERNATIVES), default="layers",
                    help="the design choice to compare the design with (module docstring)")
    args = ap.parse_args(argv)
    t0 = time.time()
    data, helps = H.load(args.data), H.tables(args.data)
    shipped = {t.device: t for t in LB.load(LB.shipped_paths("fbnet_c100"))}
    design = rows(data, helps, shipped, args.draws, args.seed)
    name, fn = ALTERNATIVES[args.alternative]
    kept = getattr(AP, name)
    setattr(AP, name, fn)
    try:
        other = rows(data, helps, shipped, args.draws, args.seed)
    finally:
        setattr(AP, name, kept)
    print(f"library-only validation, {1 + args.draws} samples of 10 per pseudo-target (HELP's reference networks + "
          f"{args.draws} random, seed {args.seed}); MAPE % / within ±10% % / Spearman on its other networks of 0-3999")
    print(f"{'target T':14s} {'design':>24s} {args.alternative:>24s}   {args.alternative} - design (± s.e.)")
    for t in sorted(shipped):
        keys = [k for k in other if k[0] == t]
        a = np.array([other[k] for k in keys])
        s = np.array([design[k] for k in keys])
        d = a - s
        se = d.std(axis=0, ddof=1) / np.sqrt(len(d))
        print(f"{t:14s} {s[:, 0].mean():7.3f} / {s[:, 1].mean():5.1f} / {s[:, 2].mean():.4f} "
              f"{a[:, 0].mean():7.3f} / {a[:, 1].mean():5.1f} / {a[:, 2].mean():.4f}   MAPE {d[:, 0].mean():+.3f} ± "
              f"{se[0]:.3f}, ±10% {d[:, 1].mean():+.2f} ± {se[1]:.2f}, Spearman {d[:, 2].mean():+.4f} ± {se[2]:.4f}")
    pairs = sorted({k[:2] for k in other})
    d = np.array([np.mean([np.subtract(other[k], design[k]) for k in other if k[:2] == pq], axis=0)
                  for pq in pairs])
    se = d.std(axis=0, ddof=1) / np.sqrt(len(d))
    print(f"every row ({len(other)}; s.e. clustered by (T, P)): MAPE {d[:, 0].mean():+.3f} ± {se[0]:.3f}, "
          f"±10% {d[:, 1].mean():+.2f} ± {se[1]:.2f}, Spearman {d[:, 2].mean():+.4f} ± {se[2]:.4f}")
    print(f"per pseudo-target P (every T), design -> {args.alternative}:")
    for p in sorted(shipped):
        s = np.array([v for k, v in design.items() if k[1] == p])
        a = np.array([v for k, v in other.items() if k[1] == p])
        print(f"  {p:14s} MAPE {s[:, 0].mean():.3f} -> {a[:, 0].mean():.3f}, ±10% {s[:, 1].mean():.1f} -> "
              f"{a[:, 1].mean():.1f}, Spearman {s[:, 2].mean():.4f} -> {a[:, 2].mean():.4f}")
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
