"""SplitNets' head-mounted system (paper 000, section 3.2 and Fig. 6) and the cost of a split network on it.

V smart sensors (16 nm NPU: 125 GOP/s, 2 MB of memory) each run the on-sensor part on their own view, in
parallel, and send their reduced features over ONE bus that all V share (1.2 Gbit/s): each sender gets 1/V of it,
so the V transfers, running side by side, take as long as the V payloads sent one after the other. The aggregator
(7 nm NPU, 1.25 TOP/s, "sufficient" memory) fuses and finishes:

    T = T_sen (one sensor's part) + T_comm + T_agg,   T_comm = bytes_per_sensor * 8 / (bus_mbps / V * 1e3) ms

Compute latency is the roofline of ``jmsnas.cost.roofline`` on the presets ``splitnets_sensor`` and
``splitnets_aggregator`` (1 OP = 1 multiply-add, as Table 4 counts), weights and activations in 8 bits (Table 4's
assumption), the raw view sent as 8-bit pixels. Sensor peak memory is ``cost.memory.peak_memory_bytes`` of the
on-sensor part: its 8-bit weights plus the largest set of activations alive at once on the DAG (shortcuts keep
their input alive). Parts are described as ``graph.NetSpec`` layers (expand / depthwise / project / add per MBConv).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from jmsnas.cost import roofline
from jmsnas.cost.memory import peak_memory_bytes
from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.splitnets.space import SplitArch, SplitSpace
from jmsnas.topology import DeviceProfile, TopologyError, presets, transfer_ms

MB = 1e6  # the paper's MB are decimal (Table 4)


class HMD(NamedTuple):
    """The hardware: sensor and aggregator devices, the shared bus (Mbit/s), the sensors on it, the sensor's
    memory limit (bytes) and the bit widths of weights, activations and raw pixels."""

    sensor: DeviceProfile
    aggregator: DeviceProfile
    bus_mbps: float
    num_sensors: int
    sensor_memory_bytes: float
    weight_bits: int = 8
    act_bits: int = 8
    input_bits: int = 8


def hmd(num_sensors: int = 1, *, bus_mbps: float = presets.SPLITNETS_BUS_MBPS,
        sensor_memory_bytes: float = 2 * MB) -> HMD:
    """SplitNets' HMD numbers (Fig. 6): 125 GOP/s sensors with 2 MB, a 1.25 TOP/s aggregator, a 1.2 Gbit/s bus."""
    if isinstance(num_sensors, bool) or not isinstance(num_sensors, int) or num_sensors < 1:
        raise ValueError(f"num_sensors must be an integer >= 1, got {num_sensors!r}")
    for what, v in (("bus_mbps", bus_mbps), ("sensor_memory_bytes", sensor_memory_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{what} must be a positive number, got {v!r}")
    return HMD(presets.device("splitnets_sensor"), presets.device("splitnets_aggregator"), float(bus_mbps),
               num_sensors, float(sensor_memory_bytes))


def from_topology(topo) -> HMD:
    """The HMD of a topology file's system (``jmsnas.topology.load``): its one shared bus (``buses``), whose
    links' sources are the sensors and whose common destination is the aggregator. The sensor memory limit is the
    sensors' ``memory_bytes``, the bus bandwidth the bus's ``bandwidth_mbps`` shared by its links."""
    buses = getattr(topo, "buses", ())
    if len(buses) != 1:
        raise TopologyError(f"topology {topo.name!r} must have exactly one shared bus (the sensors' bus), "
                            f"got {len(buses)}")
    bus = buses[0]
    names = topo.device_names
    receivers = sorted({dst for _, dst in bus.links})
    if len(receivers) != 1:
        raise TopologyError(f"bus {bus.name!r} of topology {topo.name!r} must lead to one aggregator, got "
                            f"{receivers}")
    senders = [topo.devices[names.index(src)] for src, _ in bus.links]
    recv = topo.devices[names.index(receivers[0])]
    return HMD(senders[0], recv, float(bus.bandwidth_mbps), len(senders), float(senders[0].memory_bytes))


def comm_ms(bytes_per_sensor: float, bus_mbps: float, senders: int) -> float:
    """Time in ms until all ``senders`` sensors have sent ``bytes_per_sensor`` each over a bus of ``bus_mbps``
    Mbit/s divided equally among them (each at bus_mbps / senders, all at once)."""
    return transfer_ms(bytes_per_sensor, bus_mbps / senders)


class _Builder:
    def __init__(self, name, input_shape):
        self.name, self.input_shape, self.layers = name, tuple(input_shape), []
        self.shape = tuple(input_shape)

    def add(self, kind, macs, params, out_shape, inputs=None):
        ins = (len(self.layers) - 1,) if inputs is None else inputs
        ins = tuple(i for i in ins if i >= 0)
        self.layers.append(LayerSpec(f"{kind}{len(self.layers)}", kind, int(macs), int(params), tuple(out_shape),
                                     ins))
        self.shape = tuple(out_shape)
        return len(self.layers) - 1

    def conv(self, k, cout, stride=1, groups=1, bn=True):
        h, _, cin = self.shape
        ho = -(-h // stride)
        per_out = cin // groups * k * k
        kind = "dwconv" if groups > 1 and groups == cin else "conv"
        return self.add(kind, ho * ho * cout * per_out, cout * per_out + (2 * cout if bn else 0), (ho, ho, cout))

    def mbconv(self, k, e, cout, stride, residual):
        src = len(self.layers) - 1
        cin = self.shape[-1]
        self.conv(1, cin * e)
        self.conv(k, cin * e, stride, groups=cin * e)
        last = self.conv(1, cout)
        if residual:
            self.add("add", 0, 0, self.shape, (src, last) if src >= 0 else (last,))

    def net(self):
        return NetSpec(self.name, self.input_shape, tuple(self.layers))


def _blocks(space: SplitSpace, arch: SplitArch, b: _Builder, sensor: bool):
    """Adds the active blocks before (sensor) or after (aggregator) the split."""
    p_s, m_s = arch.split
    for p in range(space.num_phases):
        for j in range(arch.depth[p]):
            before = (p, j) < (p_s, m_s)
            if before == sensor:
                k, e = space.op_choices[arch.ops[p][j]]
                _, cout, _, _, stride = space.slot(p, j)
                b.mbconv(k, e, cout, stride, space.residual(p, j))


class Cost(NamedTuple):
    """Cost of one split network: latencies in ms, bytes each sensor sends, sensor peak memory in bytes."""

    total_ms: float
    sensor_ms: float
    comm_ms: float
    aggregator_ms: float
    bytes_per_sensor: float
    bus_bytes: float  # all V sensors together
    sensor_peak_bytes: float
    sensor_net: NetSpec
    aggregator_net: NetSpec


def parts(space: SplitSpace, arch: SplitArch, module: str = "split") -> tuple:
    """(sensor NetSpec, aggregator NetSpec, values sent per sensor, whether they are raw pixels) of a network split at ``arch.split``.

    ``arch.split == (0, 0)`` puts everything but the raw view on the aggregator (the stem too) and sends the view;
    ``module="none"`` sends the c channels at the split without a Conv-Reduce (V > 1: averaged on the
    aggregator)."""
    V, hw = space.views, space.image_size
    sen = _Builder("sensor", (hw, hw, space.in_channels))
    if arch.split == (0, 0):
        sent = hw * hw * space.in_channels
        agg = _Builder("aggregator", (hw, hw, space.in_channels * V))
        agg.conv(3, space.stem_channels * V, groups=V)  # V stems on the V views (the same weights)
        if V > 1:
            agg.add("pool", 0, 0, (hw, hw, space.stem_channels))  # averaged (fusion without a module)
        raw = True
    else:
        sen.conv(3, space.stem_channels)
        _blocks(space, arch, sen, True)
        p, _ = arch.split
        s, c = space.phase_hw(p), space.phase_channels[p]
        k = space.split_kernel
        if module == "none":
            sent, agg = s * s * c, _Builder("aggregator", (s, s, c * V))
            if V > 1:
                agg.add("pool", 0, 0, (s, s, c), ())
        else:
            sen.add("conv", s * s * c * arch.d * k * k, c * arch.d * k * k, (s, s, arch.d))
            sent = s * s * arch.d
            agg = _Builder("aggregator", (s, s, V * arch.d))
            agg.add("conv", s * s * V * arch.d * c * k * k, V * arch.d * c * k * k, (s, s, c), ())
        raw = False
    _blocks(space, arch, agg, False)
    agg.conv(1, space.head_channels)
    agg.add("pool", 0, 0, (space.head_channels,))
    agg.add("fc", space.head_channels * space.num_classes, (space.head_channels + 1) * space.num_classes,
            (space.num_classes,))
    return sen.net(), agg.net(), sent, raw


def cost(space: SplitSpace, arch: SplitArch, hw: HMD, module: str = "split") -> Cost:
    """Latency (T_sen + T_comm + T_agg), bus bytes and sensor peak memory of ``arch`` on ``hw``."""
    if hw.num_sensors != space.views:
        raise ValueError(f"the space has {space.views} views but the hardware has {hw.num_sensors} sensors on "
                         "its bus; one view per sensor is expected")
    sen, agg, sent, raw = parts(space, arch, module)
    act = hw.act_bits
    per_sensor = math.ceil(sent * (hw.input_bits if raw else act) / 8)
    t_sen = _latency(sen, hw.sensor, hw) if sen.layers else 0.0
    t_agg = _latency(agg, hw.aggregator, hw)
    t_comm = comm_ms(per_sensor, hw.bus_mbps, hw.num_sensors)
    peak = float(peak_memory_bytes(sen, list(range(len(sen.layers))), hw.weight_bits, act)) if sen.layers else 0.0
    return Cost(t_sen + t_comm + t_agg, t_sen, t_comm, t_agg, float(per_sensor), float(per_sensor * space.views),
                peak, sen, agg)


def _latency(net: NetSpec, device: DeviceProfile, hw: HMD) -> float:
    return float(roofline.net_latency_table(net, [device], bits=hw.act_bits, weight_bits=hw.weight_bits).sum())
