"""Analytic roofline latency of layers on devices described by their specifications.

    latency_ms = max(FLOPs / (peak * efficiency), bytes / bandwidth) * 1e3 + layer_overhead_ms

with FLOPs = 2 * MACs, peak in GFLOP/s (``DeviceProfile.peak_gflops``), bytes = activations read and written plus
weights read at the given bit width, bandwidth in GB/s (10^9 bytes/s, ``DeviceProfile.mem_bandwidth_gbs``).

A device is a ``DeviceProfile`` or the name of a device preset (``jmsnas.topology.presets.DEVICES``: the paper's
four devices, SplitNets' head-mounted system and Auto-Split's Eyeriss and TPU).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.topology import DeviceProfile, TopologyError, presets


def _check_device(d: DeviceProfile) -> DeviceProfile:
    if isinstance(d, str):
        return presets.device(d)
    if not isinstance(d, DeviceProfile):
        raise TopologyError(f"expected a DeviceProfile or a preset name, got {type(d).__name__}")
    for what, v in (("peak_gflops", d.peak_gflops), ("mem_bandwidth_gbs", d.mem_bandwidth_gbs),
                    ("efficiency", d.efficiency), ("layer_overhead_ms", d.layer_overhead_ms)):
        zero_ok = what == "layer_overhead_ms"
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                or (v == 0 and not zero_ok)):
            raise TopologyError(f"device {d.name!r} {what} must be a finite number {'>=' if zero_ok else '>'} 0, "
                                f"got {v!r}")
    if d.efficiency > 1:
        raise TopologyError(f"device {d.name!r} efficiency must be in (0, 1], got {d.efficiency!r}")
    return d


def _check_bits(what: str, bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 64:
        raise ValueError(f"{what} must be an integer number of bits in [1, 64], got {bits!r}")


def layer_input_elems(net: NetSpec) -> list:
    """Elements each layer reads from its producers (the network input for a layer without inputs)."""
    return [sum(net.layers[p].out_elems for p in l.inputs) if l.inputs else net.input_elems for l in net.layers]


def layer_latency_ms(layer: LayerSpec, device: DeviceProfile | str, bits: int = 32, *, in_elems: int = 0,
                     weight_bits: int | None = None) -> float:
    """Roofline latency of one layer in ms.

    Args:
      layer: the layer (its macs, params and out_shape are used).
      device: a DeviceProfile or a preset name.
      bits: bit width of activations (and of weights unless ``weight_bits`` is given).
      in_elems: elements the layer reads from its producers; 0 counts only the output and weights
        (``net_latency_table`` passes the real count, see ``layer_input_elems``).
    """
    d = _check_device(device)
    wbits = bits if weight_bits is None else weight_bits
    _check_bits("bits", bits)
    _check_bits("weight_bits", wbits)
    compute_s = 2.0 * layer.macs / (d.peak_gflops * 1e9 * d.efficiency)
    num_bytes = (in_elems + layer.out_elems) * bits / 8.0 + layer.params * wbits / 8.0
    memory_s = num_bytes / (d.mem_bandwidth_gbs * 1e9)
    return 1e3 * max(compute_s, memory_s) + d.layer_overhead_ms


def net_latency_table(net: NetSpec, devices: Sequence[DeviceProfile | str], bits: int = 32,
                      weight_bits: int | None = None) -> np.ndarray:
    """float64[N, M]: roofline latency in ms of each of the N layers of ``net`` on each of the M devices."""
    devs = [_check_device(d) for d in devices]
    if not devs:
        raise ValueError("net_latency_table needs at least one device")
    ins = layer_input_elems(net)
    return np.array([[layer_latency_ms(l, d, bits, in_elems=n, weight_bits=weight_bits) for d in devs]
                     for l, n in zip(net.layers, ins)], dtype=np.float64).reshape(len(net.layers), len(devs))
