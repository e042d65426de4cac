"""Builds the library of per-layer FBNet tables that ships with jmsnas (jmsnas/fbnet/library/, HELP's data, MIT).

For every device of HELP's fbnet_latency.json: ``jmsnas.cost.layerfit.fit`` on its networks 0-3999 (the first 3600
fitted, 3600-3999 held out: the table's ``validation``); networks 4000-4999, the benchmark's test set, are in no
fit. Then the device's learning curve (and its interval calibration: the 90% quantile of the held-out relative
errors over the leave-one-out RMS relative error, ``interval_factor``): ``adapt_prior.adapt_library`` from the other devices' tables with K random
networks of 0-3599 (K = 5, 10, 20, 50; ``--draws`` draws each; base: the Pixel 3 table, the Raspberry Pi 4's for
the Pixel 3), scored on 3600-3999; the medians go in ``adaptation["learning_curve"]``.

    python benchmarks/build_fbnet_library.py [--data ../shared/reference/help_fbnet] [--out jmsnas/fbnet/library]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jmsnas.cost import accuracy, adapt_prior as AP, layerfit  # noqa: E402
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


def curve(data, tables, base_tables, dev, ks=KS, draws=5, seed=0) -> dict:
    """The learning curve of ``dev`` adapted from the other tables (module docstring)."""
    rng = np.random.default_rng(seed)
    lib = [t for d, t in tables.items() if d != dev]
    base = base_tables["pixel3" if dev != "pixel3" else "raspi4"]
    held = H.measured(data, dev, range(3600, 4000))
    rows = {"networks": list(ks), "mape_pct": [], "within_10pct": [], "rms_rel": [], "coverage_90_pct": [],
            "interval_factor": []}
    for k in ks:
        got = []
        for _ in range(draws):
            sample = H.measured(data, dev, rng.choice(3600, k, replace=False))
            t = AP.adapt_library(base, sample, lib, stages=stages())
            p = LT.predict_ms(t, held.archs)
            lo, hi = AP.interval_ms(t, held.archs) if t.adaptation["interval"] else (p, p)
            r = accuracy.report(p, held.ms)
            err = np.abs(p - held.ms) / held.ms
            got.append((r["mape_pct"], r["within_10pct"], float(np.sqrt(np.mean(err ** 2))),
                        float(100 * np.mean((held.ms >= lo) & (held.ms <= hi))),
                        float(np.quantile(err, 0.9) / max(t.adaptation["interval"]["loo_rms_rel"], 1e-9))))
        med = np.median(np.array(got), axis=0)
        for key, v in zip(("mape_pct", "within_10pct", "rms_rel", "coverage_90_pct", "interval_factor"), med):
            rows[key].append(float(v))
    rows["how"] = (f"median over {draws} draws of K networks from 0-3599, adapted from the other library tables "
                   f"(jmsnas.cost.adapt_prior), scored on networks 3600-3999")
    return rows


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
        c = curve(data, tables, base_tables, dev, draws=args.draws)
        t = t._replace(adaptation={**t.adaptation, "learning_curve": c})
        LT.save(t, os.path.join(args.out, f"{dev}.json"))
        v = t.validation
        print(f"{dev:14s} held-out 3600-3999: MAPE {v['mape_pct']:.2f}%  within ±10% {v['within_10pct']:.1f}%  "
              f"Spearman {v['spearman']:.3f} | curve K={c['networks']}: MAPE {np.round(c['mape_pct'], 2).tolist()} "
              f"within {np.round(c['within_10pct'], 1).tolist()}")
    print(f"wrote {len(tables)} tables to {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
