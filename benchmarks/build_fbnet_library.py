"""Builds the library of per-layer FBNet tables that ships with jmsnas (jmsnas/fbnet/library/, HELP's data, MIT).

For every device of HELP's fbnet_latency.json: ``jmsnas.cost.layerfit.fit`` on its networks 0-3999 (the first 3600
fitted, 3600-3999 held out: the table's ``validation``); networks 4000-4999, the benchmark's test set, are in no
fit. Then the device's learning curve and interval calibration (``adapt_prior.learning_curve``): the device
adapted by ``adapt_prior.adapt_library`` from the other devices' tables with K random networks of 0-3599 (K = 5,
10, 20, 50; ``--draws`` draws each) scored on 3600-3999, and from HELP's 10 reference networks scored on the rest
of 0-3999 (base: the Pixel 3 table, the Raspberry Pi 4's for the Pixel 3): the medians of the errors and the
percentiles of the calibration scores |y - p| / p / u(a) go in ``adaptation["learning_curve"]``. The same with
each other device x left out of the library too go in ``adaptation["learning_curve_without"][x]``: when x is the
target (the benchmark leaves each device out in turn), its prior reads only curves built without x's table.

    python benchmarks/build_fbnet_library.py [--data ../shared/reference/help_fbnet] [--out jmsnas/fbnet/library]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jmsnas.cost import adapt_prior as AP, layerfit  # noqa: E402
from jmsnas.cost import layertable as LT  # noqa: E402
from jmsnas.fbnet import help as H  # noqa: E402
from jmsnas.fbnet.space import fbnet_c100  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "..", "..", "shared", "reference", "help_fbnet")
DEFAULT_OUT = os.path.join(HERE, "..", "jmsnas", "fbnet", "library")
KS = (5, 10, 20, 50)


def stages(space=None) -> np.ndarray:
    """int[22]: the stage of each searchable layer of the FBNet space."""
    space = space or fbnet_c100()
    return np.repeat(np.arange(len(space.stage_layers)), space.stage_layers)


def fit_all(data) -> dict:
    """{device: table fitted on its networks 0-3599, validated on 3600-3999}."""
    out = {}
    for dev in data["ms"]:
        m = H.measured(data, dev, range(4000))
        out[dev] = layerfit.fit(m, holdout=0.1, source=f"HELP fbnet_latency.json (MIT), {dev}: per-layer table "
                                                       f"fitted on networks 0-3599 by jmsnas.cost.layerfit")
    return out


def curve(data, tables, base_tables, dev, exclude=None, ks=KS, draws=5, seed=0) -> dict:
    """The learning curve and interval calibration of ``dev`` adapted from the other tables, ``exclude`` left out
    too (module docstring); ``adapt_prior.learning_curve`` with K random networks of 0-3599 scored on 3600-3999, and
    HELP's 10 reference networks scored on the other networks of 0-3999."""
    lib = [t for d, t in tables.items() if d not in (dev, exclude)]
    base = base_tables["pixel3" if dev != "pixel3" else "raspi4"]
    return AP.learning_curve(base, lib, H.measured(data, dev, range(3600)), H.measured(data, dev, range(3600, 4000)),
                             ks=ks, draws=draws, seed=seed, stages=stages(),
                             reference=H.measured(data, dev, data["reference"]))


def curves(data, tables, base_tables, dev, ks=KS, draws=5, seed=0) -> dict:
    """{"learning_curve": from every other table, "learning_curve_without": {x: with x left out too}}: when x is
    the target of an adaptation (a benchmark leaving x out), its prior reads the curves built without x, so nothing
    of x's data is in it (``library.interval_factor``/``expected_error``)."""
    c = curve(data, tables, base_tables, dev, None, ks, draws, seed)
    without = {x: curve(data, tables, base_tables, dev, x, ks, draws, seed) for x in tables if x != dev}
    return {"learning_curve": c, "learning_curve_without": without}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--draws", type=int, default=5)
    args = ap.parse_args(argv)
    t0 = time.time()
    data = H.load(args.data)
    tables = fit_all(data)
    base_tables = H.tables(args.data)
    os.makedirs(args.out, exist_ok=True)
    for dev, t in tables.items():
        cs = curves(data, tables, base_tables, dev, draws=args.draws)
        c = cs["learning_curve"]
        t = t._replace(adaptation={**t.adaptation, **cs})
        LT.save(t, os.path.join(args.out, f"{dev}.json"))
        v = t.validation
        print(f"{dev:14s} held-out 3600-3999: MAPE {v['mape_pct']:.2f}%  within ±10% {v['within_10pct']:.1f}%  "
              f"Spearman {v['spearman']:.3f} | curve K={c['networks']}: MAPE {np.round(c['mape_pct'], 2).tolist()} "
              f"within {np.round(c['within_10pct'], 1).tolist()}")
    print(f"wrote {len(tables)} tables to {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
