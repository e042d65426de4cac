"""Named device profiles and topologies: the paper's four device classes and Table I links, SplitNets' head-mounted
system and Auto-Split's edge/cloud pair (the roofline's devices; papers 000 and 001).

Device figures are vendor peak numbers (FP32, GFLOP/s = 1e9 floating-point operations per second, 2 per
multiply-add) and memory sizes; ``efficiency`` is the fraction of that peak small batch-1 layers reach
(our assumption, stated here so users can change it), ``layer_overhead_ms`` a fixed per-layer cost
(kernel launch / framework dispatch). Papers count "OPs" differently; each preset says how its figure was
converted to GFLOP/s (2 FLOPs per multiply-add).

Every topology preset is a function of ``layers_per_device`` (D^m, one entry per device) alone; ``TOPOLOGIES`` maps
the names ``jmsnas.topology.resolve`` accepts to them.

Power (``active_power_w``, W while computing) and link radio/interface power (``tx_power_w``/``rx_power_w``) with
their sources are listed in docs/topology.md ("Energy"); figures marked there as our assumption are ours.
"""
from __future__ import annotations

from jmsnas.topology.types import DeviceProfile, LinkProfile, Topology, TopologyError, make_topology

GB = 1024 ** 3
MB = 1024 ** 2

# Section V-A of paper 003 lists the four machines; the numbers are from the vendors' data sheets.
DEVICES: dict = {
    # 4x Cortex-A72 @ 1.5 GHz, one 128-bit NEON FMA per cycle = 8 FP32 FLOP/cycle/core -> 48 GFLOP/s;
    # 4 GB LPDDR4-3200 on a 32-bit bus -> 12.8 GB/s.
    # Power: 6.4 W under full CPU load (Tom's Hardware, Raspberry Pi 4 review, 2019).
    "raspberry_pi4": DeviceProfile("raspberry_pi4", 48.0, 4 * GB, 12.8, 0.15, 0.02,
                                   "Raspberry Pi 4 Model B: 4x Cortex-A72 1.5 GHz, 4 GB LPDDR4-3200",
                                   active_power_w=6.4),
    # RTX 3050 Laptop GPU: 2048 CUDA cores x ~1.34 GHz boost x 2 = 5.5 TFLOP/s; 4 GB GDDR6, 192 GB/s.
    # Power: NVIDIA gives 35-80 W (TGP) for the RTX 3050 Laptop GPU; 40 W, near the bottom as in thin laptops, is
    # our assumption within that range.
    "xps15_rtx3050": DeviceProfile("xps15_rtx3050", 5500.0, 4 * GB, 192.0, 0.05, 0.01,
                                   "Dell XPS15: i7-11800H, 16 GB DDR4, RTX 3050 Laptop GPU (4 GB GDDR6)",
                                   active_power_w=40.0),
    # Jetson AGX Xavier: 512-core Volta GPU (64 Tensor Cores) at 1.377 GHz -> 1.41 TFLOP/s FP32;
    # 32 GB LPDDR4x, 136.5 GB/s.
    # Power: the 30 W mode of the module's 10/15/30 W power modes (NVIDIA Jetson AGX Xavier data sheet).
    "jetson_agx_xavier": DeviceProfile("jetson_agx_xavier", 1410.0, 32 * GB, 136.5, 0.1, 0.02,
                                       "NVIDIA Jetson AGX Xavier: 512-core Volta GPU, 8-core Carmel ARM, 32 GB",
                                       active_power_w=30.0),
    # Tesla V100 SXM2: 15.7 TFLOP/s FP32, 16 GB HBM2 at 900 GB/s (host: 2x Xeon Platinum 8280).
    # Power: 300 W maximum board power (NVIDIA Tesla V100 SXM2 data sheet); the host CPUs are not counted.
    "server_v100": DeviceProfile("server_v100", 15700.0, 16 * GB, 900.0, 0.05, 0.005,
                                 "server with 2x Xeon Platinum 8280 and a Tesla V100 (16 GB HBM2)",
                                 active_power_w=300.0),
}

# SplitNets (paper 000), section 3.2 and Fig. 6: on-sensor 16 nm NPU "Comp_sen = 125 GOP/s", "Mem_sen = 2 MB";
# aggregator 7 nm NPU "Comp_agg = 1.25 TOP/s" with "sufficient on-chip memory"; sensors share a 1.2 Gb/s bus.
# SplitNets counts one multiply-add as one OP: Table 4 lists MobileNet-v2 at 301 M OPs and 2.46 ms on the sensor
# (301 M / 125 G/s = 2.41 ms) and ResNet-152 at 11.5 G OPs and 92.1 ms (= 11.5 G / 125 G/s), so 125 GOP/s is
# 250 GFLOP/s here, and the simulator runs at about its peak (efficiency 1.0). Memory bandwidths are not given;
# our assumption (100 GB/s on-sensor SRAM, 1000 GB/s on the aggregator) keeps the roofline compute-bound as the
# paper's latencies are (within 3% of Table 4's, see tests/cost/test_roofline.py).
SPLITNETS_BUS_MBPS = 1200.0  # Fig. 6: shared 1.2 Gb/s sensor-aggregator bus

# Auto-Split (paper 001), Table 1, platforms simulated with SCALE-SIM: Eyeriss (edge) 192 KB on-chip, 4 GB
# off-chip, 1 GB/s, "34 GOPs"; TPU (cloud) 28 MB on-chip, 16 GB off-chip, 13 GB/s, "96 TOPs"; uplink 3 Mbps.
# Eyeriss's 34 GOPs is its 168 PEs x 200 MHz = 33.6 G multiply-adds/s -> 67.2 GFLOP/s. The TPU figure follows the
# TPU's own convention of 2 operations per multiply-add (TPU v1: 65,536 MACs x 700 MHz x 2 = 92 TOPS), so
# 96 TOPs = 96,000 GFLOP/s. Auto-Split's MAC units are INT8 whatever the bit width: bits only change the bytes
# moved (section 5.1), exactly as in this roofline. Efficiency 1.0: the ideal roofline of the simulated array.
AUTOSPLIT_UPLINK_MBPS = 3.0
# Power (docs/topology.md, "Energy"): SplitNets' NPUs 2 TOP/s per W (our assumption, the order of edge NPUs'
# published efficiency); Eyeriss 278 mW at 200 MHz (Chen et al., JSSC 2017, AlexNet's convolutions); TPU 40 W busy
# (Jouppi et al., ISCA 2017, the TPU die).

DEVICES.update({
    "splitnets_sensor": DeviceProfile(
        "splitnets_sensor", 250.0, 2 * MB, 100.0, 1.0, 0.0,
        "SplitNets (paper 000) on-sensor 16 nm NPU: 125 GOP/s (1 OP = 1 multiply-add), 2 MB memory "
        "(Fig. 6, sec. 3.2); 100 GB/s bandwidth is our assumption", active_power_w=0.0625),
    "splitnets_aggregator": DeviceProfile(
        "splitnets_aggregator", 2500.0, 1 * GB, 1000.0, 1.0, 0.0,
        "SplitNets (paper 000) aggregator 7 nm NPU: 1.25 TOP/s (1 OP = 1 multiply-add), 'sufficient on-chip "
        "memory' (1 GB and 1000 GB/s are our assumptions)", active_power_w=0.625),
    "eyeriss": DeviceProfile(
        "eyeriss", 67.2, 4 * GB, 1.0, 1.0, 0.0,
        "Auto-Split (paper 001) Table 1: Eyeriss, 34 GOPs (168 PEs x 200 MHz multiply-adds), 1 GB/s, "
        "192 KB on-chip, 4 GB off-chip", active_power_w=0.278),
    "tpu": DeviceProfile(
        "tpu", 96000.0, 16 * GB, 13.0, 1.0, 0.0,
        "Auto-Split (paper 001) Table 1: TPU, 96 TOPs (2 ops per multiply-add), 13 GB/s, 28 MB on-chip, "
        "16 GB off-chip", active_power_w=40.0),
})

# Table I of paper 003: (transmitter, receiver, wireless, Mbit/s).
TABLE_I_LINKS = (("ue", "sbs", True, 25.0), ("sbs", "mbs", True, 50.0), ("mbs", "cloud", False, 200.0))

# (tx_power_w, rx_power_w) of the Table I links by (transmitter, receiver) role, sources in docs/topology.md:
# UE uplink 3 W (Huang et al., MobiSys 2012, fit LTE uplink power as 1.29 W + 0.44 W per Mbit/s at a few
# Mbit/s; the cap at 25 Mbit/s is our assumption), a base station's receive chain is not charged (0 W, it
# listens regardless); SBS -> MBS backhaul 1 W transmit (3GPP TS 36.104: a local-area base station radiates at
# most 24 dBm = 0.25 W per antenna; the amplifier's draw of about 4x that is our assumption); wired links
# 0.5 W per end (our assumption: a 1 Gbit/s Ethernet port).
TABLE_I_POWER = {("ue", "sbs"): (3.0, 0.0), ("sbs", "mbs"): (1.0, 0.0), ("mbs", "cloud"): (0.5, 0.5)}

# Which device class plays which role in the paper's experiments.
ROLES = {"ue": "raspberry_pi4", "sbs": "xps15_rtx3050", "mbs": "jetson_agx_xavier", "cloud": "server_v100"}


def device(name: str, rename: str | None = None) -> DeviceProfile:
    """A device preset by name (optionally renamed, e.g. several MBS of one class)."""
    if name not in DEVICES:
        raise TopologyError(f"unknown device preset {name!r}; expected one of {sorted(DEVICES)}")
    d = DEVICES[name]
    return d._replace(name=rename) if rename else d


def chain_preset(layers_per_device=(2, 2, 2, 2)) -> Topology:
    """UE -> SBS -> MBS -> cloud with Table I links (Fig. 2(a))."""
    devs = [device(ROLES[r], r) for r in ("ue", "sbs", "mbs", "cloud")]
    links = [LinkProfile(a, b, bw, 0.0, w, *TABLE_I_POWER[a, b]) for a, b, w, bw in TABLE_I_LINKS]
    return make_topology("chain", devs, links, layers_per_device)


def mesh_preset(layers_per_device=(2, 2, 2, 2, 2, 2)) -> Topology:
    """Fig. 2(b): UE -> SBS (root) -> three MBS in parallel -> cloud (aggregator); C = {UE, cloud}, T = {SBS, MBS x3}.

    Links use Table I: UE-SBS 25 Mbit/s wireless, SBS-MBS 50 Mbit/s wireless, MBS-cloud 200 Mbit/s wired.
    """
    mbs = [f"mbs{i}" for i in (1, 2, 3)]
    devs = [device(ROLES["ue"], "ue"), device(ROLES["sbs"], "sbs")]
    devs += [device(ROLES["mbs"], n) for n in mbs] + [device(ROLES["cloud"], "cloud")]
    links = [LinkProfile("ue", "sbs", 25.0, 0.0, True, *TABLE_I_POWER["ue", "sbs"])]
    links += [LinkProfile("sbs", n, 50.0, 0.0, True, *TABLE_I_POWER["sbs", "mbs"]) for n in mbs]
    links += [LinkProfile(n, "cloud", 200.0, 0.0, False, *TABLE_I_POWER["mbs", "cloud"]) for n in mbs]
    return make_topology("mesh", devs, links, layers_per_device)


def splitnets_sensor_link_mbps(num_sensors: int = 4) -> float:
    """Bandwidth one sensor gets on SplitNets' shared bus, Mbit/s (Table 4: 4 sensors at 25% = 37.5 MB/s)."""
    if isinstance(num_sensors, bool) or not isinstance(num_sensors, int) or num_sensors < 1:
        raise ValueError(f"num_sensors must be a positive integer, got {num_sensors!r}")
    return SPLITNETS_BUS_MBPS / num_sensors


def splitnets_preset(layers_per_device=(1, 1), num_sensors: int = 4) -> Topology:
    """SplitNets' single-sensor system (paper 000, Fig. 6): sensor NPU -> aggregator NPU over its bus share
    (1/``num_sensors`` of the 1.2 Gbit/s bus)."""
    devs = [device("splitnets_sensor", "sensor"), device("splitnets_aggregator", "aggregator")]
    link = LinkProfile("sensor", "aggregator", splitnets_sensor_link_mbps(num_sensors), 0.0, False)
    return make_topology("splitnets", devs, [link], layers_per_device)


def autosplit_preset(layers_per_device=(1, 1), uplink_mbps: float = AUTOSPLIT_UPLINK_MBPS) -> Topology:
    """Auto-Split's simulated pair (paper 001, Table 1): Eyeriss edge -> TPU cloud over a 3 Mbit/s uplink."""
    devs = [device("eyeriss", "edge"), device("tpu", "cloud")]
    return make_topology("autosplit", devs, [LinkProfile("edge", "cloud", float(uplink_mbps), 0.0, True)],
                         layers_per_device)


TOPOLOGIES = {"chain": chain_preset, "mesh": mesh_preset, "splitnets": splitnets_preset,
              "autosplit": autosplit_preset}


def topology(name: str, layers_per_device=None) -> Topology:
    """A topology preset by name; ``layers_per_device`` overrides D^m."""
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology preset {name!r}; expected one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[name]() if layers_per_device is None else TOPOLOGIES[name](tuple(layers_per_device))
