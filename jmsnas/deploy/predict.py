"""Eq. (1)/(2) of paper 003 over the deployed parts: per-device compute terms and per-link terms, in ms.

The same function evaluates the prediction (compute terms from the cost table or from a calibration, link terms
from bytes, bandwidth and latency) and the measurement (every term measured in the pipeline), so the two can be
compared term by term. Chain, eq. (1): T = sum_m tau^m + sum_links eps. Bus (SplitNets: V sensors on shared
bus links into one aggregator): T = max_v (tau^v + eps_v) + tau^agg. Mesh, eq. (2): the chain part C (the
devices before the root and from the aggregator on, with their links) plus the slowest root -> branch ->
aggregator path, max_b (tau^r + eps_{r,b} + tau^b + eps_{b,agg}); as in ``jmsnas.cost.latency.mesh_latency``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jmsnas.topology import transfer_ms


def cameras(manifest: dict) -> list:
    """(device, view or None) of every part that takes the image (the camera feeds each over its own unthrottled
    link; a ``view`` v gets images[:, v])."""
    return [(d, i.get("view")) for d in manifest["order"] for i in manifest["parts"][d]["inputs"]
            if i["from"] == "image"]


def link_name(src: str, dst: str) -> str:
    return f"{src}->{dst}"


link_ms = transfer_ms  # eps = bytes * 8 / bandwidth + latency (ms; bandwidth in Mbit/s): the topology's own formula


def total_ms(manifest: dict, device_ms: dict, link_terms: dict) -> float:
    """Eq. (1) (chain) or (2) (mesh) from per-device and per-link ("a->b") terms in ms."""
    order = manifest["order"]
    if manifest["kind"] == "bus":  # V senders at once on their shares of the bus, then the receiver (SplitNets)
        agg = order[-1]
        return max(device_ms[d] + link_terms[link_name(d, agg)] for d in order[:-1]) + device_ms[agg]
    if manifest["kind"] == "chain":
        return sum(device_ms[d] for d in order) + sum(link_terms[link_name(a, b)] for a, b in zip(order, order[1:]))
    root, branches = manifest["root"], manifest["branches"]
    i_root, i_agg = order.index(root), order.index(root) + len(branches) + 1
    pre, post = order[:i_root], order[i_agg:]
    agg = post[0]
    chain = sum(device_ms[d] for d in pre + post)
    chain += sum(link_terms[link_name(a, b)] for a, b in zip(pre + [root], (pre + [root])[1:]))
    chain += sum(link_terms[link_name(a, b)] for a, b in zip(post, post[1:]))
    paths = [device_ms[root] + link_terms[link_name(root, b)] + device_ms[b] + link_terms[link_name(b, agg)]
             for b in branches]
    return chain + max(paths)


def predicted_links(manifest: dict, bandwidth_scale: float = 1.0, handoff: dict | None = None) -> dict:
    """{"a->b": eps ms} for every link at ``bandwidth_scale`` x its bandwidth (bytes of float32 activations), plus
    its hand-off fixed_ms + ms_per_byte x bytes where ``handoff`` {"a->b": (fixed ms, ms per byte)} has one
    (``table_prediction``): ``cost.latency.eps_ms``, the formula eq. (1)/(2) charge in the search."""
    from jmsnas.cost.latency import eps_ms
    handoff = handoff or {}
    return {link_name(l["src"], l["dst"]): eps_ms(l["bytes"], l["bandwidth_mbps"] * bandwidth_scale, l["latency_ms"],
                                                  *handoff.get(link_name(l["src"], l["dst"]), (0.0, 0.0)))
            for l in manifest["links"]}


ENDS = ("camera", "result")  # the coordinator's own hand-offs: the image into the first part, the output back


def _array_bytes(entry: dict, batch: int) -> int:
    """Bytes of ``batch`` items of a manifest array entry {"shape": [batch, ...], "dtype"}."""
    return int(batch * np.prod(entry["shape"][1:], dtype=np.int64) * np.dtype(entry.get("dtype", "float32")).itemsize)


def end_bytes(manifest: dict, batch: int = 1) -> dict:
    """{"camera": the largest image input of a part that takes one, "result": the last part's output} in bytes."""
    order = manifest["order"]
    cams = [i for d in order for i in manifest["parts"][d]["inputs"] if i["from"] == "image"]
    return {"camera": max((_array_bytes(i, batch) for i in cams), default=0),
            "result": _array_bytes(manifest["parts"][order[-1]]["output"], batch)}


def predict(manifest: dict, compute_ms: dict, bandwidth_scale: float = 1.0, handoff: dict | None = None,
            batch: int = 1, waits: dict | None = None) -> dict:
    """{"total", "per_device", "per_link", "throughput_per_s", "bottleneck"}: eq. (1)/(2) and the pipelined rate
    1000 / (the slowest stage: a device's compute or a link's transmission, bytes*8/bandwidth), images/s.
    ``handoff``: per-link hand-off terms (``predicted_links``), None: none. Where it also has "camera" and "result"
    (fixed ms, ms per byte), the coordinator's own hand-offs (the image into the first part, the output back, over
    unpaced connections) are predicted too ("ends") and added to "total", which is then what the coordinator
    measures end to end (eq. (1)/(2) start at the first part's compute and end at the last's).

    ``waits`` (a table's ``deployed.waits``, ``table_prediction`` with ``one_host``), on a chain: every part and
    every frame on one host comes after the wait ``wait_gaps`` gives it, and costs what the table measured after
    that wait: a part its time x ``part_ratio`` at it, a hand-off ``handoff_fixed_ms`` at it instead of its fixed
    ms (interpolated in the wait, the values at ``idle_ms`` beyond it). None, or a mesh or a bus: every wait as
    long as the table's. Why a chain only: the curve is measured with one part at a time on the host, as a chain
    runs them; a mesh runs its branches at once, more processes than cores, and its parts ran at the table's
    times after the long wait (measured on the 2-core host at Table I's bandwidth, one table, three runs each: the
    chain -21% to -28% end to end without the curve, -1% to -10% with it; the mesh -4% to +7% without it, +19% to
    +32% with it; ``benchmarks/README.md``)."""
    if waits is not None and manifest["kind"] == "chain":
        gaps = wait_gaps(manifest, compute_ms, bandwidth_scale)
        at = lambda key, gap: float(np.interp(gap, waits["wait_ms"], waits[key]))
        compute_ms = {d: float(t) * at("part_ratio", gaps[d]) for d, t in compute_ms.items()}
        if handoff:
            handoff = {k: (at("handoff_fixed_ms", gaps[k]), per_byte) for k, (_, per_byte) in handoff.items()}
    links = predicted_links(manifest, bandwidth_scale, handoff)
    stages = {d: compute_ms[d] for d in manifest["order"]}
    for l in manifest["links"]:
        stages[link_name(l["src"], l["dst"])] = link_ms(l["bytes"], l["bandwidth_mbps"] * bandwidth_scale)
    bottleneck = max(stages, key=stages.get)
    out = {"total": total_ms(manifest, compute_ms, links), "per_device": dict(compute_ms), "per_link": links,
           "throughput_per_s": 1e3 / stages[bottleneck] if stages[bottleneck] > 0 else float("inf"),
           "bottleneck": bottleneck}
    if handoff and all(k in handoff for k in ENDS):
        nbytes = end_bytes(manifest, batch)
        out["ends"] = {k: float(handoff[k][0] + handoff[k][1] * nbytes[k]) for k in ENDS}
        out["total"] += sum(out["ends"].values())
    return out


def wait_gaps(manifest: dict, compute_ms: dict, bandwidth_scale: float = 1.0) -> dict:
    """{device or "a->b" or end: ms the host has been idle before it} for parts on one host, one image at a time:
    while a part computes the host is busy; only a link's transmission (eps without its hand-off: the pacer sleeps)
    leaves it idle. So a frame waits its own link's eps, a part its incoming link's (a mesh's aggregator: that of
    the branch whose frame arrives last, root -> branch -> aggregator), and the coordinator's ends and the first
    part, which follow the last part's compute (the result, then the next image), the last part's incoming link's:
    the host's last idle period before them."""
    eps = {link_name(l["src"], l["dst"]): link_ms(l["bytes"], l["bandwidth_mbps"] * bandwidth_scale, l["latency_ms"])
           for l in manifest["links"]}
    into = {}
    for name in eps:
        into.setdefault(name.split("->")[1], []).append(name)

    def arrives(name):  # after the start of the part before the sender: the sender's wait, compute, then the link
        src = name.split("->")[0]
        return max((eps[n] for n in into.get(src, [])), default=0.0) + compute_ms[src] + eps[name]

    gaps = dict(eps)
    for d in manifest["order"]:
        if d in into:
            gaps[d] = eps[max(into[d], key=arrives)]
    last = gaps.get(manifest["order"][-1], 0.0)  # a single part: nothing but compute, no idle period
    for k in list(ENDS) + [d for d in manifest["order"] if d not in into]:
        gaps[k] = last
    return gaps


def _run_table(run: str, table_path: str) -> tuple:
    """(space, CostTable, MeasuredTable, ops int32[N], device index int32[N]) of the run with the table at
    ``table_path`` as every device's row; DeployError (one line) for a table that does not fit."""
    from jmsnas.cost.build import TableSpecError, build_table
    from jmsnas.cost.measured import ProfileError, load_table
    from jmsnas.deploy.export import load_run
    from jmsnas.deploy.runtime import DeployError
    from jmsnas.space import op_index
    space, pm, _ = load_run(run)
    names = space.topology.device_names
    ops, where = [0] * space.num_layers, [0] * space.num_layers
    for dev, entry in pm["devices"].items():
        for n, op in zip(entry["layers"], entry["ops"]):
            ops[int(n)], where[int(n)] = op_index(op), names.index(dev)
    try:
        table = build_table(space, {d: {"kind": "measured", "path": table_path} for d in names})
        measured = load_table(table_path, space)
    except (TableSpecError, ProfileError, ValueError, OSError) as e:
        raise DeployError(f"--predict-table {table_path}: {' '.join(str(e).split())}") from None
    impl = measured.settings.get("dw_impl")
    if impl == "auto":  # dwconv.resolve_impl: the native kernels on CPU, XLA's convolution elsewhere
        impl = "native or shifted" if measured.device.get("backend") == "cpu" else "xla"
    if impl not in (None, "xla"):
        raise DeployError(f"--predict-table {table_path} timed the {impl} depthwise convolution; exported parts run "
                          "XLA's own (no custom calls), several times slower on CPU: profile with jmsnas profile "
                          "--dw-impl xla")
    return space, table, measured, np.asarray(ops, np.int32), np.asarray(where, np.int32)


def shared_cores(work_ms: dict, busy: float, cores: int) -> dict:
    """{part: when it ends (ms)} of parts that start together on one host of ``cores`` cores, part k taking
    ``work_ms[k]`` alone while keeping ``busy`` cores busy (CPU time / wall time): processor sharing. At every moment
    the running parts share the cores equally, none getting more than ``busy``; a part alone ends at its own time.
    ValueError for busy or cores <= 0 or a negative time."""
    if not busy > 0 or not cores > 0:
        raise ValueError(f"busy and cores must be > 0, got {busy!r}, {cores!r}")
    if any(not (t >= 0) for t in work_ms.values()):
        raise ValueError(f"every part's time must be >= 0 ms, got {work_ms!r}")
    cap = min(float(busy), float(cores))
    left = {k: float(t) * cap for k, t in work_ms.items()}  # CPU-ms each part needs
    now, end = 0.0, {k: 0.0 for k, v in left.items() if v <= 0}
    left = {k: v for k, v in left.items() if v > 0}
    while left:
        rate = min(cap, cores / len(left))  # equal shares, each at most the cores one part can use
        step = min(left.values()) / rate
        now += step
        for k in list(left):
            left[k] -= rate * step
            if left[k] <= 1e-12 * max(1.0, rate * now):
                end[k] = now
                del left[k]
    return end


class TablePrediction(NamedTuple):
    """What a latency table predicts of a run's deployment: ``compute_ms`` {device: ms per image} and ``handoff``
    {"a->b": (fixed ms, ms per byte)}, with "camera" and "result" (the coordinator's hand-offs, ``predict``) ({} for
    a table without hand-off terms: eps alone, as before); ``waits``: the table's wait curve for parts on one host
    (``predict``'s ``waits``), None where it has none or the parts are on hosts of their own."""

    compute_ms: dict
    handoff: dict
    waits: dict | None = None


def table_prediction(run: str, table_path: str, one_host: bool = False) -> TablePrediction:
    """The run's architecture priced by a latency table measured on this machine (``jmsnas profile``, one table for
    every device: all parts run on this host), through the cost model's own eq. (1)/(2) terms, the table built once
    (``cost.latency.arch_latency`` with the run's split; the links' hand-offs as ``CostTable.handoff_ms`` /
    ``handoff_ms_per_byte``, which eq. (1)/(2) charge in the search).

    A table with ``deployed`` terms (``jmsnas.deploy.partcost``) models the parts: the cost model already charges
    every device its part's call cost (``CostTable.call_ms``) and its ops, stem and head at the part scale, and that
    is the prediction. A table without them models a network run as ONE call: its per-call terms (``call`` +
    ``network.offset_ms``) ride on the stem, so the cost model charges them once, to the first device; deployed,
    every device's part is a call of its own program and pays them (measured: ``benchmarks/README.md``, "Deployed
    pipeline, honest prediction"), so every other device is charged them too (``per_call_ms``). The table must
    time the depthwise convolution the parts run (``jmsnas profile --dw-impl xla``); one that timed another is
    refused. The honest prediction: nothing in the pipeline is slowed or calibrated to it.

    ``one_host``: every part runs on this one host (``jmsnas pipeline`` without ``--hosts``): where the table
    measured how many cores a part keeps busy (``deployed.cores_busy``), parts that run at once share the host's
    cores (``shared_cores``: a mesh's branches, which run at once after the root; every other part runs alone, one
    image at a time), and where it measured the wait curve (``deployed.waits``) it is returned for ``predict``:
    on one host a part or a frame waits only as long as the host is idle before it (``wait_gaps``). The search's
    devices are machines of their own, each idle between its images; neither is in eq. (1)/(2)."""
    from jmsnas.cost.latency import arch_latency, breakdown_dict
    space, table, measured, ops, where = _run_table(run, table_path)
    per_device = breakdown_dict(space, arch_latency(space, table, ops, where))["per_device"]
    if measured.deployed is None:
        call = per_call_ms(measured)
        first = space.topology.device_names[space.topology.path_order()[0]]  # its stem term already holds the call
        return TablePrediction({d: ms + (call if d != first else 0.0) for d, ms in per_device.items()}, {})
    topo, dep = space.topology, measured.deployed
    if one_host and dep.get("cores_busy") is not None and topo.kind == "mesh":  # the branches run at once
        names = topo.device_names
        per_device.update(shared_cores({names[b]: per_device[names[b]] for b in topo.branches}, dep["cores_busy"],
                                       dep["host_cores"]))
    a, b = np.asarray(table.handoff_ms, float), np.asarray(table.handoff_ms_per_byte, float)
    h = measured.deployed["handoff"]  # the camera and the result: frames over this host's loopback, as any link's
    ends = {k: (float(h["fixed_ms"]), float(h["ms_per_byte"])) for k in ENDS}
    waits = dep.get("waits") if one_host else None
    return TablePrediction(per_device, {**{link_name(l.src, l.dst): (float(a[i]), float(b[i]))
                                           for i, l in enumerate(space.topology.links)}, **ends},
                           None if waits is None else {k: list(v) for k, v in waits.items()})


def per_call_ms(table) -> float:
    """The per-call cost of a ``jmsnas profile`` table (a ``MeasuredTable``): its near-empty call plus the
    network offset (what a network costs beyond its stem, head and ops), ms. Paid once per call of a program."""
    return float(table.call.median_ms + table.network["offset_ms"])
