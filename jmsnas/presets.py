"""Named device profiles and topologies: the paper's four device classes and Table I links.

Device figures are vendor peak numbers (FP32, GFLOP/s = 1e9 floating-point operations per second, 2 per
multiply-add) and memory sizes; ``efficiency`` is the fraction of that peak small batch-1 layers reach
(our assumption, stated here so users can change it), ``layer_overhead_ms`` a fixed per-layer cost
(kernel launch / framework dispatch).
"""
from __future__ import annotations

from jmsnas.topology import DeviceProfile, LinkProfile, Topology, TopologyError, make_topology

GB = 1024 ** 3

# Section V-A of paper 003 lists the four machines; the numbers are from the vendors' data sheets.
DEVICES: dict = {
    # 4x Cortex-A72 @ 1.5 GHz, one 128-bit NEON FMA per cycle = 8 FP32 FLOP/cycle/core -> 48 GFLOP/s;
    # 4 GB LPDDR4-3200 on a 32-bit bus -> 12.8 GB/s.
    "raspberry_pi4": DeviceProfile("raspberry_pi4", 48.0, 4 * GB, 12.8, 0.15, 0.02,
                                   "Raspberry Pi 4 Model B: 4x Cortex-A72 1.5 GHz, 4 GB LPDDR4-3200"),
    # RTX 3050 Laptop GPU: 2048 CUDA cores x ~1.34 GHz boost x 2 = 5.5 TFLOP/s; 4 GB GDDR6, 192 GB/s.
    "xps15_rtx3050": DeviceProfile("xps15_rtx3050", 5500.0, 4 * GB, 192.0, 0.05, 0.01,
                                   "Dell XPS15: i7-11800H, 16 GB DDR4, RTX 3050 Laptop GPU (4 GB GDDR6)"),
    # Jetson AGX Xavier: 512-core Volta GPU (64 Tensor Cores) at 1.377 GHz -> 1.41 TFLOP/s FP32;
    # 32 GB LPDDR4x, 136.5 GB/s.
    "jetson_agx_xavier": DeviceProfile("jetson_agx_xavier", 1410.0, 32 * GB, 136.5, 0.1, 0.02,
                                       "NVIDIA Jetson AGX Xavier: 512-core Volta GPU, 8-core Carmel ARM, 32 GB"),
    # Tesla V100 SXM2: 15.7 TFLOP/s FP32, 16 GB HBM2 at 900 GB/s (host: 2x Xeon Platinum 8280).
    "server_v100": DeviceProfile("server_v100", 15700.0, 16 * GB, 900.0, 0.05, 0.005,
                                 "server with 2x Xeon Platinum 8280 and a Tesla V100 (16 GB HBM2)"),
}

# Table I of paper 003: (transmitter, receiver, wireless, Mbit/s).
TABLE_I_LINKS = (("ue", "sbs", True, 25.0), ("sbs", "mbs", True, 50.0), ("mbs", "cloud", False, 200.0))

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
    links = [LinkProfile(a, b, bw, 0.0, w) for a, b, w, bw in TABLE_I_LINKS]
    return make_topology("chain", devs, links, layers_per_device)


def mesh_preset(layers_per_device=(2, 2, 2, 2, 2, 2)) -> Topology:
    """Fig. 2(b): UE -> SBS (root) -> three MBS in parallel -> cloud (aggregator); C = {UE, cloud}, T = {SBS, MBS x3}.

    Links use Table I: UE-SBS 25 Mbit/s wireless, SBS-MBS 50 Mbit/s wireless, MBS-cloud 200 Mbit/s wired.
    """
    mbs = [f"mbs{i}" for i in (1, 2, 3)]
    devs = [device(ROLES["ue"], "ue"), device(ROLES["sbs"], "sbs")]
    devs += [device(ROLES["mbs"], n) for n in mbs] + [device(ROLES["cloud"], "cloud")]
    links = [LinkProfile("ue", "sbs", 25.0, 0.0, True)]
    links += [LinkProfile("sbs", n, 50.0, 0.0, True) for n in mbs]
    links += [LinkProfile(n, "cloud", 200.0, 0.0, False) for n in mbs]
    return make_topology("mesh", devs, links, layers_per_device)


TOPOLOGIES = {"chain": chain_preset, "mesh": mesh_preset}


def topology(name: str, layers_per_device=None) -> Topology:
    """A topology preset by name; ``layers_per_device`` overrides D^m."""
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology preset {name!r}; expected one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[name]() if layers_per_device is None else TOPOLOGIES[name](tuple(layers_per_device))
