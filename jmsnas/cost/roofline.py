"""Analytic roofline latency of layers on devices described by their specifications.

    latency_ms = max(FLOPs / (peak * efficiency), bytes / bandwidth) * 1e3 + layer_overhead_ms

with FLOPs = 2 * MACs, peak in GFLOP/s (``DeviceProfile.peak_gflops``), bytes = activations read and written plus
weights read at the given bit width, bandwidth in GB/s (10^9 bytes/s, ``DeviceProfile.mem_bandwidth_gbs``).

Presets by name: the paper's four devices (``jmsnas.presets.DEVICES``), SplitNets' head-mounted system (paper 000,
Fig. 6 and section 3.2) and Auto-Split's Eyeriss and TPU (paper 001, Table 1). Papers count "OPs" differently;
each preset says how its figure was converted to GFLOP/s (2 FLOPs per multiply-add).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.presets import DEVICES
from jmsnas.topology import DeviceProfile, TopologyError

GB = 1024 ** 3
MB = 1024 ** 2
KB = 1024

# SplitNets (paper 000), section 3.2 and Fig. 6: on-sensor 16 nm NPU "Comp_sen = 125 GOP/s", "Mem_sen = 2 MB";
# aggregator 7 nm NPU "Comp_agg = 1.25 TOP/s" with "sufficient on-chip memory"; sensors share a 1.2 Gb/s bus.
# SplitNets counts one multiply-add as one OP: Table 4 lists MobileNet-v2 at 301 M OPs and 2.46 ms on the sensor
# (301 M / 125 G/s = 2.41 ms) and ResNet-152 at 11.5 G OPs and 92.1 ms (= 11.5 G / 125 G/s), so 125 GOP/s is
# 250 GFLOP/s here, and the simulator runs at about its peak (efficiency 1.0). Memory bandwidths are not given;
# our assumption (100 GB/s on-sensor SRAM, 1000 GB/s on the aggregator) keeps the roofline compute-bound as the
# paper's latencies are (within 3% of Table 4's, see tests/test_roofline.py).
SPLITNETS_BUS_MBPS = 1200.0  # Fig. 6: shared 1.2 Gb/s sensor-aggregator bus

# Auto-Split (paper 001), Table 1, platforms simulated with SCALE-SIM: Eyeriss (edge) 192 KB on-chip, 4 GB
# off-chip, 1 GB/s, "34 GOPs"; TPU (cloud) 28 MB on-chip, 16 GB off-chip, 13 GB/s, "96 TOPs"; uplink 3 Mbps.
# Eyeriss's 34 GOPs is its 168 PEs x 200 MHz = 33.6 G multiply-adds/s -> 67.2 GFLOP/s. The TPU figure follows the
# TPU's own convention of 2 operations per multiply-add (TPU v1: 65,536 MACs x 700 MHz x 2 = 92 TOPS), so
# 96 TOPs = 96,000 GFLOP/s. Auto-Split's MAC units are INT8 whatever the bit width: bits only change the bytes
# moved (section 5.1), exactly as in this roofline. Efficiency 1.0: the ideal roofline of the simulated array.
AUTOSPLIT_UPLINK_MBPS = 3.0

_EXTRA = {
    "splitnets_sensor": DeviceProfile(
        "splitnets_sensor", 250.0, 2 * MB, 100.0, 1.0, 0.0,
        "SplitNets (paper 000) on-sensor 16 nm NPU: 125 GOP/s (1 OP = 1 multiply-add), 2 MB memory "
        "(Fig. 6, sec. 3.2); 100 GB/s bandwidth is our assumption"),
    "splitnets_aggregator": DeviceProfile(
        "splitnets_aggregator", 2500.0, 1 * GB, 1000.0, 1.0, 0.0,
        "SplitNets (paper 000) aggregator 7 nm NPU: 1.25 TOP/s (1 OP = 1 multiply-add), 'sufficient on-chip "
        "memory' (1 GB and 1000 GB/s are our assumptions)"),
    "eyeriss": DeviceProfile(
        "eyeriss", 67.2, 4 * GB, 1.0, 1.0, 0.0,
        "Auto-Split (paper 001) Table 1: Eyeriss, 34 GOPs (168 PEs x 200 MHz multiply-adds), 1 GB/s, "
        "192 KB on-chip, 4 GB off-chip"),
    "tpu": DeviceProfile(
        "tpu", 96000.0, 16 * GB, 13.0, 1.0, 0.0,
        "Auto-Split (paper 001) Table 1: TPU, 96 TOPs (2 ops per multiply-add), 13 GB/s, 28 MB on-chip, "
        "16 GB off-chip"),
}
PRESETS: dict = {**DEVICES, **_EXTRA}
NAMES: tuple = tuple(PRESETS)


def preset(name: str) -> DeviceProfile:
    """A roofline device profile by name; raises ValueError listing the known names."""
    if name not in PRESETS:
        raise TopologyError(f"unknown roofline preset {name!r}; expected one of {list(NAMES)}")
    return PRESETS[name]


def splitnets_sensor_link_mbps(num_sensors: int = 4) -> float:
    """Bandwidth one sensor gets on SplitNets' shared bus, Mbit/s (Table 4: 4 sensors at 25% = 37.5 MB/s)."""
    if isinstance(num_sensors, bool) or not isinstance(num_sensors, int) or num_sensors < 1:
        raise ValueError(f"num_sensors must be a positive integer, got {num_sensors!r}")
    return SPLITNETS_BUS_MBPS / num_sensors


def _check_device(d: DeviceProfile) -> DeviceProfile:
    if isinstance(d, str):
        return preset(d)
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
