"""Predicted vs measured from a pipeline run's records (``pipeline.run_pipeline``): eq. (1)/(2) with the run's
settings beside the medians of every measured term, the hand-offs the model has no term for, each link's rate and
the pipelined throughput."""
from __future__ import annotations

import statistics

import numpy as np

from jmsnas.deploy.predict import link_name, predict, total_ms


def _median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _link_mbps(manifest: dict, records: dict) -> dict:
    """Every link's median rate while it transmits, bytes * 8 / (end - start of transmission), Mbit/s (all phases)."""
    out = {}
    for l in manifest["links"]:
        rates = [l["bytes"] * 8 / (r[1] - r[0]) / 1e6 for recs in records.values()
                 for rec in recs[l["dst"]].values() for r in [rec["in"][l["src"]]] if r[1] > r[0]]
        out[link_name(l["src"], l["dst"])] = _median(rates)
    return out


def analyze(manifest: dict, raw: dict) -> dict:
    """Predicted vs measured: eq. (1)/(2) with the settings' terms beside the medians of the measured terms.

    measured: "total" (median end-to-end ms, first device's compute start to last device's compute end, latency
    phase), "per_device" (compute ms), "per_link" (release at the receiver - start of transmission, ms),
    "link_mbps" (bytes*8 / transmission time), "link_queue_ms" (compute end -> start of transmission),
    "eq_of_measured" (eq. (1)/(2) of the measured terms per image, median) and "overhead_ms" (total - that: the
    hand-offs the model has no term for); "throughput_per_s" (stream phase: images / span).
    """
    s = raw["settings"]
    pred = predict(manifest, raw["predicted_compute_ms"], s["bandwidth_scale"])
    order, b = manifest["order"], s["batch"]
    out = {"settings": s, "predicted": pred, "calib_ms": raw["calib_ms"], "stretch": raw["stretch"]}
    lat = raw["records"].get("latency")
    if lat:
        n = len(lat[order[0]])
        per_dev = {d: [(lat[d][i]["c1"] - lat[d][i]["c0"]) * 1e3 for i in range(n)] for d in order}
        per_link, queue_ms = {}, {}
        for l in manifest["links"]:
            a, c, name = l["src"], l["dst"], link_name(l["src"], l["dst"])
            t = [lat[c][i]["in"][a] for i in range(n)]
            per_link[name] = [(r[3] - r[0]) * 1e3 for r in t]
            queue_ms[name] = _median([(r[0] - lat[a][i]["c1"]) * 1e3 for i, r in enumerate(t)])
        totals = [(lat[order[-1]][i]["c1"] - lat[order[0]][i]["c0"]) * 1e3 for i in range(n)]
        eq = [total_ms(manifest, {d: per_dev[d][i] for d in order}, {k: v[i] for k, v in per_link.items()})
              for i in range(n)]
        out["measured"] = {"total": _median(totals), "total_p10": float(np.percentile(totals, 10)),
                           "total_p90": float(np.percentile(totals, 90)),
                           "per_device": {d: _median(v) for d, v in per_dev.items()},
                           "per_link": {k: _median(v) for k, v in per_link.items()},
                           "link_queue_ms": queue_ms, "eq_of_measured": _median(eq),
                           "overhead_ms": _median([t - e for t, e in zip(totals, eq)])}
        out["error_pct"] = 100.0 * (out["measured"]["total"] / pred["total"] - 1.0)
    out.setdefault("measured", {})["link_mbps"] = _link_mbps(manifest, raw["records"])
    st = raw["records"].get("stream")
    if st:
        n = len(st[order[0]])
        start = min(st[order[0]][i]["c0"] for i in range(n))
        end = max(st[order[-1]][i]["c1"] for i in range(n))
        busy = {d: sum(st[d][i]["c1"] - st[d][i]["c0"] for i in range(n)) / (end - start) for d in order}
        e2e = [(st[order[-1]][i]["c1"] - st[order[0]][i]["c0"]) * 1e3 for i in range(n)]
        out.setdefault("measured", {}).update({"throughput_per_s": n * b / (end - start), "utilisation": busy,
                                               "stream_latency_ms": _median(e2e)})
    return out
