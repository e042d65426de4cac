"""The oracle band ``benchmarks/bench_adapt.py`` prints beside the adapted interval (``ceiling_band``), by hand: on
networks whose latency is the table's times (1 + e) for chosen e, the band is the 90% quantile of |e| over the
design networks at each level, and what it holds of the others is counted directly."""
import os
import sys

import numpy as np

import paths
from jmsnas.cost import layertable as LT
from jmsnas.fbnet import help as H

sys.path.insert(0, os.path.join(paths.REPO, "benchmarks"))
import bench_adapt  # noqa: E402

DATA = os.path.join(paths.DATA, "help_fbnet")


def test_the_oracle_band_is_the_quantile_of_the_design_errors_and_counts_the_test_by_hand():
    table = H.tables(DATA)["pixel3"]
    data = H.load(DATA)
    m = H.measured(data, "pixel3", data["index"][:110])
    p = LT.predict_ms(table, m.archs)
    rng = np.random.default_rng(0)
    e = np.concatenate([rng.uniform(-0.2, 0.2, 100), [0.01, -0.02, 0.05, 0.3, -0.5, 0.0, 0.15, -0.07, 0.2, 0.09]])
    got = m._replace(ms=p * (1 + e))
    design, held = got._replace(archs=got.archs[:100], ms=got.ms[:100]), got._replace(archs=got.archs[100:],
                                                                                      ms=got.ms[100:])
    b = bench_adapt.ceiling_band(table, design, held, levels=(0.5, 0.9))
    for band, q in zip(b["bands"], (0.5, 0.9)):
        w = np.quantile(np.abs(e[:100]), q)
        assert band["level"] == q and abs(band["halfwidth_pct"] - 100 * w) < 1e-9
        assert abs(band["design_pct"] - 100 * np.mean(np.abs(e[:100]) <= w + 1e-12)) < 1e-9
        assert abs(band["test_pct"] - 100 * np.mean(np.abs(e[100:]) <= w + 1e-12)) < 1e-9
    assert b["bands"][0]["halfwidth_pct"] < b["bands"][1]["halfwidth_pct"]
    assert len(b["quantile90_by_500_pct"]) == 1     # 110 networks: one block of 500
    assert abs(b["quantile90_by_500_pct"][0] - 100 * np.quantile(np.abs(e), 0.9)) < 1e-9
