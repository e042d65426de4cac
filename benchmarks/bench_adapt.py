"""Adapting a latency table to devices from 10 measured networks, on HELP's FBNet data (HW-NAS-Bench's space).

Base: the Pixel 3 per-layer table. For each device of the data (the end-to-end measured ones first, then the
Raspberry Pi 4 table's sums): adaptation samples = HELP's 10 reference architectures, test = architectures
4000-4999 (HELP's convention). Reports MAPE, % within +-10% and Spearman's rho on the test set for
(a) the base table unadapted, (b) the base rescaled by one factor fitted on the 10 (relative least squares),
(c) ``jmsnas.cost.adapt.adapt`` (model chosen by leave-one-out on the 10; the test set plays no part in it).

    python benchmarks/bench_adapt.py [--data ../shared/reference/help_fbnet] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jmsnas.cost import accuracy, adapt  # noqa: E402
from jmsnas.cost import layertable as LT  # noqa: E402
from jmsnas.fbnet import help as H  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "reference",
                            "help_fbnet")
END_TO_END = ("silver_4114", "silver_4210r", "titan_rtx_32", "samsung_a50")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA, help="directory of HELP's FBNet files")
    ap.add_argument("--base", default="pixel3")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    base = H.tables(args.data)[args.base]
    data = H.load(args.data)
    test = np.arange(4000, 5000)
    devices = [d for d in END_TO_END if d in data["ms"]] + [d for d in data["ms"] if d not in END_TO_END
                                                             and d != args.base]
    rows, out = [], {}
    for dev in devices:
        samples = H.measured(data, dev, data["reference"])
        held = H.measured(data, dev, test)
        tables = {"(a) base": base, "(b) one factor": adapt.rescale(base, samples), "(c) adapt": adapt.adapt(base, samples)}
        out[dev] = {}
        for name, t in tables.items():
            r = accuracy.report(LT.predict_ms(t, held.archs), held.ms)
            out[dev][name] = r
            rows.append((dev, name, r))
        a = tables["(c) adapt"].adaptation
        out[dev]["chosen"] = {k: a[k] for k in ("grouping", "lambda", "loo_mape_pct", "theta_const", "theta",
                                                "single_factor")}
    print(f"base: {args.base} table; samples: HELP's 10 reference architectures; test: architectures 4000-4999")
    print(f"{'device':14s} {'table':16s} {'MAPE %':>8s} {'±10% %':>8s} {'Spearman':>9s}")
    for dev, name, r in rows:
        print(f"{dev:14s} {name:16s} {r['mape_pct']:8.2f} {r['within_10pct']:8.1f} {r['spearman']:9.3f}")
    for dev in devices:
        c = out[dev]["chosen"]
        lam = "inf" if c["lambda"] is None else f"{c['lambda']:g}"
        print(f"{dev}: chosen {c['grouping']} lambda={lam} (leave-one-out MAPE {c['loo_mape_pct']:.2f}% on the 10)")
    wins = [out[d]["(c) adapt"]["mape_pct"] < out[d]["(b) one factor"]["mape_pct"] for d in devices]
    print(f"(c) below (b) in MAPE on {sum(wins)} of {len(devices)} devices")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
