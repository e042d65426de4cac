"""Predicted vs measured from a pipeline run's records (``pipeline.run_pipeline``): eq. (1)/(2) with the run's
settings beside the medians of every measured term, the hand-offs the model has no term for, each link's rate and
the pipelined throughput.

Every worker time is already on the coordinator's clock (mapped with the estimated offsets, whose uncertainty is
reported beside: a term between two devices carries both devices' uncertainties); the end-to-end time is taken at
the coordinator alone (image sent -> output received), so it does not depend on any offset. With
``pacing="network"`` the kernel's shaper counts bytes on the wire, so the prediction of a link uses them
(``links.wire_bytes`` with the connection's MSS and header bytes) and every link's rate is reported both as payload and as
wire Mbit/s."""
from __future__ import annotations

import statistics

import numpy as np

from jmsnas.deploy import links as L
from jmsnas.deploy.predict import cameras, link_name, predict, total_ms


def median(xs) -> float:
    return float(statistics.median(xs)) if len(xs) else float("nan")


def totals(ms) -> dict:
    """"total" (the median) and "total_p10"/"total_p90" of every image's end-to-end time ``ms``."""
    return {"total": median(ms), **{f"total_p{q}": float(np.percentile(ms, q)) for q in (10, 90)}}


def _frame_mbps(nbytes: int, r: list) -> float:
    """A frame's payload Mbit/s: as its receiver saw it (``links.payload_rate``), or, for a frame too short for the
    receiver to tell, bytes * 8 / the sender's own transmission time (the pacer's rate, one clock)."""
    if not nbytes:  # an empty frame (an idle mesh branch's trigger) has no rate
        return float("nan")
    if len(r) > 4 and r[4] is not None and np.isfinite(r[4]):
        return float(r[4])
    return nbytes * 8 / (r[1] - r[0]) / 1e6 if r[1] > r[0] else float("nan")


def _link_mbps(manifest: dict, records: dict) -> dict:
    """Every link's median payload Mbit/s (``_frame_mbps``), latency phase (the receiver is idle while it
    receives) or else every phase."""
    out = {}
    phases = [records["latency"]] if "latency" in records else list(records.values())
    for l in manifest["links"]:
        rates = [_frame_mbps(l["bytes"], rec["in"][l["src"]]) for recs in phases for rec in recs[l["dst"]].values()]
        out[link_name(l["src"], l["dst"])] = median([x for x in rates if np.isfinite(x)])
    return out


def link_bytes(manifest: dict, records: dict) -> dict:
    """{"a->b": the distinct payload sizes (bytes) of every frame the receiver took from the sender, sorted}, over
    every phase: one value when every transfer carried the same bytes (records from before the receivers counted
    bytes: an empty list)."""
    out = {}
    for l in manifest["links"]:
        seen = {int(f[5]) for recs in records.values() for rec in recs[l["dst"]].values()
                for f in rec.get("frames", {}).get(l["src"], [rec["in"][l["src"]]]) if len(f) > 5}
        out[link_name(l["src"], l["dst"])] = sorted(seen)
    return out


def wire_manifest(manifest: dict, framing: dict) -> dict:
    """The manifest with every link's bytes replaced by its bytes on the wire (``links.wire_bytes`` with the
    connection's [MSS, header bytes] from ``framing``; a link without framing keeps its payload bytes)."""
    links = []
    for l in manifest["links"]:
        f = framing.get(link_name(l["src"], l["dst"]))
        links.append(dict(l, bytes=L.wire_bytes(l["bytes"], *f)) if f else dict(l))
    return {**manifest, "links": links}


def analyze(manifest: dict, raw: dict, handoff: dict | None = None, waits: dict | None = None) -> dict:
    """Predicted vs measured: eq. (1)/(2) with the settings' terms beside the medians of the measured terms.
    ``handoff`` {"a->b": (fixed ms, ms per byte)} (``predict.table_prediction``): every link's predicted term also
    carries its hand-off, as the cost model charges it (None: eps alone); ``waits``: the table's wait curve for
    parts on one host (``predict.predict``).

    measured: "total" (median end-to-end ms at the coordinator: image sent -> output received, latency phase),
    "first_to_last_ms" (first device's compute start to last device's compute end), "per_device" (compute ms),
    "per_link" (release at the receiver - the sender's compute end, ms: the transmission, its latency and the
    hand-off, as eps + the hand-off predict it), "link_mbps" (bytes*8 / transmission time), "link_bytes"
    (``link_bytes``: the payload sizes received), "link_queue_ms" (compute end -> start of transmission, part of
    "per_link"), "eq_of_measured" (eq. (1)/(2) of the measured terms per image, median), "overhead_ms" (total -
    that: the coordinator's own hand-offs and what no term covers) and "ends" ({"camera": image sent -> first
    compute start, "result": last compute end -> output received}, medians); "throughput_per_s" (stream phase:
    images / span).
    """
    s = raw["settings"]
    network = s.get("pacing") == "network"
    pm = wire_manifest(manifest, raw.get("framing", {})) if network else manifest
    pred = predict(pm, raw["predicted_compute_ms"], s["bandwidth_scale"], handoff, int(s.get("batch", 1)), waits)
    order, b = manifest["order"], s["batch"]
    out = {"settings": s, "predicted": pred, "calib_ms": raw["calib_ms"], "stretch": raw["stretch"],
           "clock": raw.get("clock", {}), "where": raw.get("where", {})}
    lat = raw["records"].get("latency")
    if lat:
        n = len(lat[order[0]])
        per_dev = {d: [(lat[d][i]["c1"] - lat[d][i]["c0"]) * 1e3 for i in range(n)] for d in order}
        per_link, queue_ms = {}, {}
        for l in manifest["links"]:
            a, c, name = l["src"], l["dst"], link_name(l["src"], l["dst"])
            t = [lat[c][i]["in"][a] for i in range(n)]
            queue = [(r[0] - lat[a][i]["c1"]) * 1e3 for i, r in enumerate(t)]
            # from the sender's compute end (its output handed to its link thread) to the release at the receiver,
            # as eps + the hand-off predict it; a frame sent before the sender's last stage ended (a staged part)
            # from its start of transmission
            per_link[name] = [(r[3] - r[0]) * 1e3 + max(q, 0.0) for r, q in zip(t, queue)]
            queue_ms[name] = median(queue)
        starts = sorted({d for d, _ in cameras(manifest)}, key=order.index)  # the parts that take the image
        span = [(lat[order[-1]][i]["c1"] - min(lat[d][i]["c0"] for d in starts)) * 1e3 for i in range(n)]
        co = raw.get("coordinator", {}).get("latency")
        ends = [(co[i][1] - co[i][0]) * 1e3 for i in range(n)] if co else span
        eq = [total_ms(manifest, {d: per_dev[d][i] for d in order}, {k: v[i] for k, v in per_link.items()})
              for i in range(n)]
        unc = {d: c.get("uncertainty_ms", 0.0) for d, c in raw.get("clock", {}).items()}
        out_ends = {"camera": median([(lat[starts[0]][i]["c0"] - co[i][0]) * 1e3 for i in range(n)]),
                    "result": median([(co[i][1] - lat[order[-1]][i]["c1"]) * 1e3 for i in range(n)])} if co else {}
        out["measured"] = {**totals(ends), "first_to_last_ms": median(span),
                           "first_to_last_uncertainty_ms": unc.get(order[0], 0.0) + unc.get(order[-1], 0.0),
                           "per_device": {d: median(v) for d, v in per_dev.items()},
                           "per_link": {k: median(v) for k, v in per_link.items()},
                           "per_link_uncertainty_ms": {link_name(l["src"], l["dst"]): unc.get(l["src"], 0.0)
                                                       + unc.get(l["dst"], 0.0) for l in manifest["links"]},
                           "link_queue_ms": queue_ms, "eq_of_measured": median(eq),
                           "overhead_ms": median([t - e for t, e in zip(ends, eq)])}
        if out_ends:
            out["measured"]["ends"] = out_ends
        out["error_pct"] = 100.0 * (out["measured"]["total"] / pred["total"] - 1.0)
    rates = _link_mbps(manifest, raw["records"])
    out.setdefault("measured", {})["link_mbps"] = rates
    out["measured"]["link_bytes"] = link_bytes(manifest, raw["records"])
    if network:
        payload = {link_name(l["src"], l["dst"]): l["bytes"] for l in manifest["links"]}
        wire = {link_name(l["src"], l["dst"]): l["bytes"] for l in pm["links"]}
        out["measured"]["link_wire_mbps"] = {k: v * wire[k] / payload[k] for k, v in rates.items()}
    st = raw["records"].get("stream")
    if st:
        n = len(st[order[0]])
        start = min(st[order[0]][i]["c0"] for i in range(n))
        end = max(st[order[-1]][i]["c1"] for i in range(n))
        busy = {d: sum(st[d][i]["c1"] - st[d][i]["c0"] for i in range(n)) / (end - start) for d in order}
        e2e = [(st[order[-1]][i]["c1"] - st[order[0]][i]["c0"]) * 1e3 for i in range(n)]
        out.setdefault("measured", {}).update({"throughput_per_s": n * b / (end - start), "utilisation": busy,
                                               "stream_latency_ms": median(e2e)})
    return out
