"""The cost table: what every latency computation reads (paper 003, section IV-B).

``CostTable`` is a plain pytree of arrays so that measured, imported, fitted and analytic tables are the same
type and can be passed to jitted functions:

* ``compute_ms[M, N, R]``: U_n^m(v_i), latency in ms of candidate i at layer slot n on device m (0 where masked);
* ``stem_ms[M]`` / ``head_ms[M]``: latency of the fixed stem / classifier head on each device;
* ``out_bytes[N]``: bytes of layer n's output per image at the activation bit width;
* ``stem_bytes``: bytes of the stem output; ``input_bytes``: bytes of the raw input image;
* ``bandwidth_mbps[L]`` / ``link_latency_ms[L]``: the topology's links, in its order (copied so that a sweep over
  bandwidths is a change of data, not of the static search space);
* ``call_ms[M]``: what device m's part pays for being a program of its own between a receive and a send, beyond
  its ops', stem's and head's entries (ms, once per image, on every device: a device that runs no layer still
  relays); ``handoff_ms[L]`` + ``handoff_ms_per_byte[L]`` x bytes: a link's hand-off (framing, the send and
  receive system calls, the receiver's wake-up; ms) on top of eps. Measured by ``jmsnas profile``
  (``jmsnas.deploy.partcost``), 0 in every table that has none: the paper's analytic tables, lookup tables and
  regressions keep their meaning, eq. (1)/(2) exactly as the paper writes them.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jmsnas.space import OPS, SearchSpace, op_flops, op_memory_bytes
from jmsnas.topology import DeviceProfile


class CostTable(NamedTuple):
    compute_ms: jnp.ndarray
    stem_ms: jnp.ndarray
    head_ms: jnp.ndarray
    out_bytes: jnp.ndarray
    stem_bytes: jnp.ndarray
    input_bytes: jnp.ndarray
    bandwidth_mbps: jnp.ndarray
    link_latency_ms: jnp.ndarray
    call_ms: jnp.ndarray = 0.0  # [M] (0: none); see the module docstring
    handoff_ms: jnp.ndarray = 0.0  # [L]
    handoff_ms_per_byte: jnp.ndarray = 0.0  # [L]


def roofline_ms(flops, mem_bytes, device: DeviceProfile):
    """Roofline latency in ms: max(FLOPs / (peak * efficiency), bytes / memory bandwidth) + per-layer overhead."""
    compute = flops / (device.peak_gflops * 1e9 * device.efficiency) * 1e3
    memory = mem_bytes / (device.mem_bandwidth_gbs * 1e9) * 1e3
    return np.maximum(compute, memory) + device.layer_overhead_ms


def stem_flops(space: SearchSpace) -> float:
    hw = space.stem_out_hw
    return 2.0 * hw * hw * 9 * space.in_channels * space.stem_channels


def head_flops(space: SearchSpace) -> float:
    hw, ch = space.head_in
    return 2.0 * hw * hw * ch * space.head_channels + 2.0 * space.head_channels * space.num_classes


def activation_bytes(space: SearchSpace, bits: int = 32) -> tuple:
    """(out_bytes[N], stem_bytes, input_bytes) per image at ``bits`` bits per activation."""
    if bits not in (4, 8, 16, 32):
        raise ValueError(f"activation bits must be one of 4, 8, 16, 32, got {bits!r}")
    per = bits / 8.0
    out = np.array([s.out_elems * per for s in space.layers], np.float32)
    stem = space.stem_out_hw ** 2 * space.stem_channels * per
    raw = space.image_size ** 2 * space.in_channels * 1.0  # the camera image: 8-bit pixels
    return out, stem, raw


def links_arrays(space: SearchSpace):
    links = space.topology.links
    return (np.array([l.bandwidth_mbps for l in links], np.float32),
            np.array([l.latency_ms for l in links], np.float32))


def from_compute(space: SearchSpace, compute_ms, stem_ms, head_ms, activation_bits: int = 32, call_ms=None,
                 handoff_ms=None, handoff_ms_per_byte=None) -> CostTable:
    """Assembles a CostTable from per-op latencies [M, N, R] and the space's shapes; validates the numbers.

    ``call_ms`` [M] (ms), ``handoff_ms`` [L] (ms) and ``handoff_ms_per_byte`` [L] (ms per byte): the deployed
    terms (module docstring); None: 0."""
    compute_ms = np.asarray(compute_ms, np.float32)
    expect = (space.topology.num_devices, space.num_layers, len(OPS))
    if compute_ms.shape != expect:
        raise ValueError(f"compute_ms has shape {compute_ms.shape}, expected (devices, layers, ops) = {expect}")
    n_links = len(space.topology.links)
    zeros = lambda n: np.zeros((n,), np.float32)
    call_ms = zeros(expect[0]) if call_ms is None else call_ms
    handoff_ms = zeros(n_links) if handoff_ms is None else handoff_ms
    handoff_ms_per_byte = zeros(n_links) if handoff_ms_per_byte is None else handoff_ms_per_byte
    for name, arr in (("compute_ms", compute_ms), ("stem_ms", stem_ms), ("head_ms", head_ms), ("call_ms", call_ms),
                      ("handoff_ms", handoff_ms), ("handoff_ms_per_byte", handoff_ms_per_byte)):
        arr = np.asarray(arr, np.float64)
        want = {"compute_ms": None, "handoff_ms": (n_links,), "handoff_ms_per_byte": (n_links,)}.get(name, expect[:1])
        if want is not None and arr.shape != want:
            what = "(links,)" if name.startswith("handoff") else "(devices,)"
            raise ValueError(f"{name} has shape {arr.shape}, expected {what} = {want}")
        bad = np.argwhere(~np.isfinite(arr) | (arr < 0))
        if bad.size:
            at = tuple(int(i) for i in bad[0])  # plain ints/floats: numpy 2 would print np.int64(2)
            raise ValueError(f"{name} has a negative or non-finite latency at index {at}: {float(arr[at])!r}")
    compute_ms = np.where(space.mask()[None], compute_ms, 0.0).astype(np.float32)
    out, stem, raw = activation_bytes(space, activation_bits)
    bw, lat = links_arrays(space)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    return CostTable(f32(compute_ms), f32(stem_ms), f32(head_ms), f32(out), f32(stem), f32(raw), f32(bw), f32(lat),
                     f32(call_ms), f32(handoff_ms), f32(handoff_ms_per_byte))


def analytic_table(space: SearchSpace, activation_bits: int = 32) -> CostTable:
    """U from the roofline of each device profile: FLOPs and memory traffic of every candidate at its slot."""
    devices = space.topology.devices
    flops = np.array([[op_flops(o, s) for o in OPS] for s in space.layers])
    mem = np.array([[op_memory_bytes(o, s) for o in OPS] for s in space.layers])
    compute = np.stack([roofline_ms(flops, mem, d) for d in devices])
    compute[:, :, [o.is_identity for o in OPS]] = 0.0  # identity: nothing executes
    stem = np.array([roofline_ms(stem_flops(space), 0.0, d) for d in devices])
    head = np.array([roofline_ms(head_flops(space), 0.0, d) for d in devices])
    return from_compute(space, compute, stem, head, activation_bits)
