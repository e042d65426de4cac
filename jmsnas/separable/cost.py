"""Latency and transmitted bytes of a separable network on a cluster of G devices (paper 004, section 3.3, Fig. 3).

Units: FLOPs per image (2 per multiply-add), bytes per image, ms. Node i of the cluster topology runs group i.

Bytes. The stem output is broadcast from the input node to the G - 1 others once, in float32 (as the forward
computes it). At transmission step s every node j with ``perm[j] != j`` sends ``s_out^2 * N_send`` values of the
output of the window's first block to ``perm[j]``, 2 bytes each with float16 transfer, else 4.
The non-separated reference (paper's Table 5: "ResNeXt w/ ring all-reduce" = 100 %) is the same network split
over the G nodes by channels, which needs every block's output on every node: a ring all-reduce per block moves
``2 (G - 1)`` times the block output (float32) in total, plus the same stem broadcast.

Latency (one image; bulk-synchronous per transmission window of alpha blocks):

* start: stem on the input node, then the broadcast (links in parallel: the slowest one counts);
* window s: every node computes the window's first block (the slowest node counts), then sends; with overlap the
  transfers run while the nodes compute the other alpha - 1 blocks: ``max(max_i rest_i, max_j T_j)``; the
  synchronous schedule (Fig. 3, left) does one after the other: ``max_i rest_i + max_j T_j``. With alpha = 1
  ``rest = 0`` and both are equal; with alpha > 1 the overlapped latency is never above the synchronous one;
* end: the classifier on the output node.

Compute time of a layer on a device: ``flops / (peak_gflops * efficiency * 1e6)`` ms plus ``layer_overhead_ms``.
"""
from __future__ import annotations

import numpy as np

from jmsnas.separable import decisions as dec
from jmsnas.separable.network import BlockShape, NetSpec
from jmsnas.topology import Topology, TopologyError, transfer_ms


def block_flops(b: BlockShape) -> int:
    """FLOPs per image of one group's bottleneck (1x1 in, 3x3 grouped, 1x1 out, projection shortcut)."""
    mid = b.paths * b.width
    f = 2 * b.size_in ** 2 * b.cin * mid + 2 * b.size_out ** 2 * 9 * b.width * mid + 2 * b.size_out ** 2 * mid * b.cout
    if b.stride != 1 or b.cin != b.cout:
        f += 2 * b.size_out ** 2 * b.cin * b.cout
    return int(f)


def block_layers(b: BlockShape) -> int:
    return 4 if (b.stride != 1 or b.cin != b.cout) else 3


def stem_flops(spec: NetSpec) -> int:
    return int(2 * spec.image_size ** 2 * 9 * spec.in_channels * spec.stem_channels)


def head_flops(spec: NetSpec) -> int:
    return int(2 * spec.blocks[-1].cout * spec.num_classes)


def layer_ms(flops, device, layers: int = 1) -> float:
    """ms of ``flops`` on a DeviceProfile: flops / (GFLOP/s * efficiency * 1e6) + layers * layer_overhead_ms."""
    return float(flops) / (device.peak_gflops * device.efficiency * 1e6) + layers * device.layer_overhead_ms


def check_cluster(spec: NetSpec, topo: Topology, input_device: int = 0) -> None:
    """G must equal the cluster's device count, and the input node must be one of them."""
    if topo.kind != "cluster":
        raise TopologyError(f"a separable network needs a 'cluster' topology (links between all nodes), got a "
                            f"{topo.kind!r} topology {topo.name!r}")
    if topo.num_devices != spec.num_groups:
        raise TopologyError(f"G={spec.num_groups} does not match topology {topo.name!r} with {topo.num_devices} "
                            f"devices {list(topo.device_names)}; expected G == number of devices")
    if isinstance(input_device, bool) or not isinstance(input_device, int) \
            or not 0 <= input_device < topo.num_devices:
        raise TopologyError(f"input_device must be a device index in 0..{topo.num_devices - 1}, got {input_device!r}")


def bytes_per_value(spec: NetSpec) -> int:
    return 2 if spec.float16 else 4


def step_bytes(spec: NetSpec, step: int, perm, level: int) -> np.ndarray:
    """int64[G]: bytes per image node j sends at ``step`` (0 where ``perm[j] == j``)."""
    b = spec.blocks[spec.window(step)[0]]
    n = spec.nsend[step][level]
    per_node = b.size_out ** 2 * n * bytes_per_value(spec)
    perm = np.asarray(perm)
    return np.where(perm != np.arange(spec.num_groups), per_node, 0).astype(np.int64)


def stem_bytes(spec: NetSpec) -> int:
    """Bytes per image of one copy of the stem output (float32)."""
    return int(spec.image_size ** 2 * spec.stem_channels * 4)


def reference_bytes(spec: NetSpec) -> int:
    """Bytes per image the non-separated network moves split over G nodes: stem broadcast + one ring all-reduce
    (2 (G - 1) x the float32 output) per block."""
    g = spec.num_groups
    return int((g - 1) * stem_bytes(spec) + sum(2 * (g - 1) * b.size_out ** 2 * b.cout * 4 for b in spec.blocks))


def bytes_per_image(spec: NetSpec, perm_ids, levels) -> int:
    """Total bytes per image of a decision sequence (perm_ids, levels int[S]), stem broadcast included."""
    table = dec.permutation_table(spec.num_groups)
    total = (spec.num_groups - 1) * stem_bytes(spec)
    for s in range(spec.num_steps):
        total += int(step_bytes(spec, s, table[int(perm_ids[s])], int(levels[s])).sum())
    return int(total)


def evaluate(spec: NetSpec, topo: Topology, perm_ids, levels, input_device: int = 0) -> dict:
    """The predicted cost of one decision sequence: latency (overlapped and synchronous), bytes, per device and link.

    Returns a JSON-ready dict: ``latency_ms``, ``synchronous_ms``, ``bytes_per_image``, ``reference_bytes``,
    ``bytes_ratio``, ``compute_ms`` {device: ms}, ``link_bytes``/``link_ms`` {"a->b": ...} (only links used),
    ``steps`` [{perm, level, n_send, bytes, compute_first_ms, compute_rest_ms, transfer_ms}].
    """
    check_cluster(spec, topo, input_device)
    g, devs = spec.num_groups, topo.devices
    table = dec.permutation_table(g)
    cb = np.array([[layer_ms(block_flops(b), d, block_layers(b)) for b in spec.blocks] for d in devs])  # [G, B]
    compute = cb.sum(1)
    compute[input_device] += layer_ms(stem_flops(spec), devs[input_device])
    head = layer_ms(head_flops(spec), devs[spec.output_group])
    compute[spec.output_group] += head
    link_bytes, link_ms = {}, {}

    def send(a, b, nbytes):
        l = topo.links[topo.link_index(a, b)]
        ms = transfer_ms(nbytes, l.bandwidth_mbps, l.latency_ms)
        key = f"{l.src}->{l.dst}"
        link_bytes[key] = link_bytes.get(key, 0) + int(nbytes)
        link_ms[key] = link_ms.get(key, 0.0) + ms
        return ms

    sb = stem_bytes(spec)
    start = layer_ms(stem_flops(spec), devs[input_device]) + max(
        send(input_device, j, sb) for j in range(g) if j != input_device)
    overlap = sync = start
    steps = []
    for s in range(spec.num_steps):
        w = spec.window(s)
        perm, lv = table[int(perm_ids[s])], int(levels[s])
        nb = step_bytes(spec, s, perm, lv)
        t = max([send(j, int(perm[j]), nb[j]) for j in range(g) if perm[j] != j], default=0.0)
        first = float(cb[:, w[0]].max())
        rest = float(cb[:, w[1:]].sum(1).max()) if len(w) > 1 else 0.0
        overlap += first + max(rest, t)
        sync += first + rest + t
        steps.append({"perm": perm.tolist(), "perm_id": int(perm_ids[s]), "level": lv,
                      "n_send": spec.nsend[s][lv], "bytes": int(nb.sum()), "compute_first_ms": first,
                      "compute_rest_ms": rest, "transfer_ms": t})
    total = bytes_per_image(spec, perm_ids, levels)
    ref = reference_bytes(spec)
    return {"latency_ms": overlap + head, "synchronous_ms": sync + head, "bytes_per_image": total,
            "reference_bytes": ref, "bytes_ratio": total / ref,
            "compute_ms": {d.name: float(c) for d, c in zip(devs, compute)},
            "link_bytes": link_bytes, "link_ms": link_ms, "steps": steps}
