"""Devices, links, chain/mesh topologies, presets and their validation (issue 2, item 2)."""
import math
import re

import pytest

from jmsnas.topology import presets
from jmsnas.topology import (DeviceProfile, LinkProfile, TopologyError, chain, make_topology,
                             transfer_ms)


def dev(name, gflops=10.0):
    return DeviceProfile(name, gflops, 1e9)


def devs(*names):
    return [dev(n) for n in names]


def link(a, b, bw=10.0, lat=0.0):
    return LinkProfile(a, b, bw, lat)


def mesh_links(branches=("b1", "b2")):
    """ue -> root -> branches -> agg -> cloud."""
    ls = [link("ue", "root")]
    ls += [link("root", b) for b in branches] + [link(b, "agg") for b in branches]
    return ls + [link("agg", "cloud")]


def raises(match):
    return pytest.raises(TopologyError, match=re.escape(match))


# ---------------------------------------------------------------- structure

def test_transfer_ms_by_hand():
    # 1000 bytes = 8000 bit over 8 Mbit/s = 1 ms, plus 0.5 ms fixed latency
    assert transfer_ms(1000, 8.0) == pytest.approx(1.0)
    assert transfer_ms(1000, 8.0, 0.5) == pytest.approx(1.5)
    assert transfer_ms(0, 25.0) == 0.0


def test_chain_structure_follows_links_not_listing_order():
    ds = devs("ue", "edge", "cloud")
    t = make_topology("c", ds, [link("edge", "cloud"), link("ue", "edge")], [1, 2, 3])
    assert t.kind == "chain"
    assert t.pre == (0, 1, 2) and t.root == -1 and t.branches == () and t.post == ()
    assert t.path_order() == (0, 1, 2)
    assert t.link_names == ("edge->cloud", "ue->edge")
    assert t.link_index(0, 1) == 1 and t.link_index(1, 2) == 0
    with raises("no link cloud->ue"):
        t.link_index(2, 0)


def test_chain_helper_builds_links_with_bandwidths_latencies_and_kinds():
    t = chain("c", devs("a", "b", "c"), [25.0, 200.0], [1, 1, 1], latencies_ms=[0.5, 1.0],
              wireless=[True, False])
    assert [(l.src, l.dst, l.bandwidth_mbps, l.latency_ms, l.wireless) for l in t.links] == [
        ("a", "b", 25.0, 0.5, True), ("b", "c", 200.0, 1.0, False)]
    assert t.num_devices == 3 and t.device_names == ("a", "b", "c")


def test_single_device_topology_is_a_chain():
    t = make_topology("solo", devs("ue"), [], [3])
    assert t.kind == "chain" and t.pre == (0,) and t.links == ()


def test_mesh_structure_with_three_branches_and_post_chain():
    names = ["ue", "root", "b1", "b2", "b3", "agg", "cloud"]
    t = make_topology("m", devs(*names), mesh_links(("b3", "b1", "b2")), [1] * 7)
    assert t.kind == "mesh"
    assert t.pre == (0,) and t.root == 1 and t.branches == (2, 3, 4) and t.post == (5, 6)
    assert t.path_order() == (0, 1, 2, 3, 4, 5, 6)


def test_mesh_without_devices_before_the_root():
    t = make_topology("m", devs("root", "b1", "b2", "agg"),
                      [link("root", "b1"), link("root", "b2"), link("b1", "agg"), link("b2", "agg")],
                      [1, 1, 1, 1])
    assert t.kind == "mesh" and t.pre == () and t.root == 0 and t.post == (3,)


# ---------------------------------------------------------------- presets

def test_chain_preset_is_table_one():
    t = presets.topology("chain")
    assert t.kind == "chain" and t.device_names == ("ue", "sbs", "mbs", "cloud")
    got = [(l.src, l.dst, l.bandwidth_mbps, l.wireless) for l in t.links]
    assert got == [("ue", "sbs", 25.0, True), ("sbs", "mbs", 50.0, True), ("mbs", "cloud", 200.0, False)]
    assert t.layers_per_device == (2, 2, 2, 2)
    assert presets.topology("chain", [1, 2, 3, 4]).layers_per_device == (1, 2, 3, 4)


def test_mesh_preset_is_fig_2b():
    t = presets.topology("mesh")
    # C = {1, 6} (UE, cloud), T = {2, 3, 4, 5} with root r = 2 (the SBS)
    assert t.kind == "mesh" and t.num_devices == 6
    assert [t.device_names[i] for i in t.pre] == ["ue"]
    assert t.device_names[t.root] == "sbs"
    assert [t.device_names[i] for i in t.branches] == ["mbs1", "mbs2", "mbs3"]
    assert [t.device_names[i] for i in t.post] == ["cloud"]
    bw = {(l.src, l.dst): (l.bandwidth_mbps, l.wireless) for l in t.links}
    assert bw[("ue", "sbs")] == (25.0, True)
    assert all(bw[("sbs", f"mbs{i}")] == (50.0, True) for i in (1, 2, 3))
    assert all(bw[(f"mbs{i}", "cloud")] == (200.0, False) for i in (1, 2, 3))


def test_device_presets_four_classes_with_sources():
    assert set(presets.ROLES.values()) == {"raspberry_pi4", "xps15_rtx3050", "jetson_agx_xavier", "server_v100"}
    # the roofline's devices are presets too: SplitNets' NPUs (paper 000) and Auto-Split's pair (paper 001)
    assert set(presets.DEVICES) == set(presets.ROLES.values()) | {"splitnets_sensor", "splitnets_aggregator",
                                                                  "eyeriss", "tpu"}
    for name, d in presets.DEVICES.items():
        assert d.name == name and d.note and d.peak_gflops > 0 and d.memory_bytes > 0
        assert 0 < d.efficiency <= 1
    # the cloud server is the fastest class and the Pi the slowest
    peak = {n: presets.DEVICES[n].peak_gflops for n in presets.ROLES.values()}
    assert min(peak, key=peak.get) == "raspberry_pi4" and max(peak, key=peak.get) == "server_v100"
    assert presets.device("server_v100", "cloud").name == "cloud"


# ---------------------------------------------------------------- bad input

def test_cycle_is_rejected_naming_it():
    with raises("has a cycle: a -> b -> c -> a"):
        make_topology("cyc", devs("a", "b", "c"), [link("a", "b"), link("b", "c"), link("c", "a")], [1, 1, 1])


def test_cycle_inside_larger_graph_is_rejected():
    with pytest.raises(TopologyError, match=r"cycle: .*b.*c"):
        make_topology("cyc", devs("ue", "b", "c", "cloud"),
                      [link("ue", "b"), link("b", "c"), link("c", "b"), link("c", "cloud")], [1] * 4)


def test_isolated_device_is_rejected_naming_it():
    with raises("['lonely'] are not connected"):
        make_topology("t", devs("ue", "cloud", "lonely"), [link("ue", "cloud")], [1, 1, 1])


def test_two_components_are_rejected_naming_them():
    with raises("not connected: components"):
        make_topology("t", devs("a", "b", "c", "d"), [link("a", "b"), link("c", "d")], [1] * 4)


@pytest.mark.parametrize("bw", [0.0, -5.0, float("nan"), float("inf"), 0])
def test_bad_bandwidth_is_rejected_naming_link_and_value(bw):
    with raises(f"link a->b bandwidth_mbps must be"):
        make_topology("t", devs("a", "b"), [link("a", "b", bw)], [1, 1])
    with pytest.raises(TopologyError, match=re.escape(repr(bw))):
        chain("t", devs("a", "b"), [bw], [1, 1])


def test_non_numeric_bandwidth_and_negative_latency_are_rejected():
    with raises("bandwidth_mbps must be a number, got 'fast'"):
        make_topology("t", devs("a", "b"), [link("a", "b", "fast")], [1, 1])
    with raises("bandwidth_mbps must be a number, got True"):
        make_topology("t", devs("a", "b"), [link("a", "b", True)], [1, 1])
    with raises("link a->b latency_ms must be >= 0, got -1.0"):
        make_topology("t", devs("a", "b"), [link("a", "b", 10.0, -1.0)], [1, 1])


def test_bad_device_figures_are_rejected():
    with raises("device 'x' peak_gflops must be > 0, got 0.0"):
        make_topology("t", [DeviceProfile("x", 0.0, 1e9)], [], [1])
    with raises("device 'x' memory_bytes must be finite, got nan"):
        make_topology("t", [DeviceProfile("x", 1.0, math.nan)], [], [1])
    with raises("device 'x' efficiency must be in (0, 1], got 1.5"):
        make_topology("t", [DeviceProfile("x", 1.0, 1e9, efficiency=1.5)], [], [1])
    with raises("device name must be a non-empty string, got ''"):
        make_topology("t", [DeviceProfile("", 1.0, 1e9)], [], [1])


def test_unknown_preset_names_are_rejected():
    with raises("unknown topology preset 'ring'"):
        presets.topology("ring")
    with raises("unknown device preset 'pdp11'"):
        presets.device("pdp11")


def test_layer_counts_must_match_devices():
    with raises("layers_per_device has 2 entries [1, 1] but there are 3 devices ['a', 'b', 'c']"):
        chain("t", devs("a", "b", "c"), [1.0, 1.0], [1, 1])
    with raises("layers_per_device for device 'b' must be an integer >= 1, got 0"):
        chain("t", devs("a", "b"), [1.0], [1, 0])
    with raises("layers_per_device for device 'a' must be an integer >= 1, got 1.5"):
        chain("t", devs("a", "b"), [1.0], [1.5, 1])
    with raises("layers_per_device has 2 entries [2, 2] but there are 4 devices"):
        presets.topology("chain", [2, 2])
    with raises("a chain of 3 devices needs 2 bandwidths, got [1.0]"):
        chain("t", devs("a", "b", "c"), [1.0], [1, 1, 1])


def test_duplicate_names_and_links_are_rejected():
    with raises("duplicate device names: ['a']"):
        make_topology("t", devs("a", "b", "a"), [link("a", "b")], [1, 1, 1])
    with raises("duplicate links among"):
        make_topology("t", devs("a", "b"), [link("a", "b"), link("a", "b", 5.0)], [1, 1])


def test_links_to_unknown_devices_and_self_loops_are_rejected():
    with raises("link a->z names unknown device 'z'"):
        make_topology("t", devs("a", "b"), [link("a", "b"), link("a", "z")], [1, 1])
    with raises("link a->a is a self-loop"):
        make_topology("t", devs("a", "b"), [link("a", "b"), link("a", "a")], [1, 1])


def test_malformed_meshes_are_rejected():
    # two sources that do not send to one common aggregator (two sources into one device make a star)
    with raises("has several sources ['a', 'b']: each must send to one common aggregator"):
        make_topology("t", devs("a", "b", "c", "d"), [link("a", "c"), link("b", "d"), link("d", "c")], [1] * 4)
    # two sinks
    with raises("exactly one sink device (the cloud), got ['b', 'c']"):
        make_topology("t", devs("a", "b", "c"), [link("a", "b"), link("a", "c")], [1] * 3)
    # a branch that skips the aggregator and goes straight to the cloud
    ls = [link("root", "b1"), link("root", "b2"), link("b1", "agg"), link("b2", "cloud"), link("agg", "cloud")]
    with pytest.raises(TopologyError, match="every branch device of root 'root'"):
        make_topology("t", devs("root", "b1", "b2", "agg", "cloud"), ls, [1] * 5)
    # two forks
    ls = [link("r1", "a"), link("r1", "b"), link("a", "r2"), link("b", "r2"), link("r2", "c"), link("r2", "d"),
          link("c", "e"), link("d", "e")]
    with raises("only one tree root may fork, got ['r1', 'r2']"):
        make_topology("t", devs("r1", "a", "b", "r2", "c", "d", "e"), ls, [1] * 7)


# ---------------------------------------------------------------- star (sensors) and shared buses

def test_star_of_sensors_with_a_shared_bus():
    from jmsnas.topology import BusGroup
    ls = [link("s2", "agg", 300.0), link("s1", "agg", 300.0), link("agg", "cloud")]
    bus = BusGroup("bus", 1200.0, (("s1", "agg"), ("s2", "agg")))
    t = make_topology("hmd", devs("s1", "s2", "agg", "cloud"), ls, [1] * 4, buses=[bus])
    assert t.kind == "star" and t.pre == () and t.root == -1
    assert t.branches == (0, 1) and t.post == (2, 3) and t.path_order() == (0, 1, 2, 3)
    assert t.buses == (bus,) and bus.share_mbps() == 600.0
    assert t.bus_of(0) == bus and t.bus_of(1) == bus and t.bus_of(2) is None
    # every sensor sends to the one aggregator, and the devices after it form a chain
    with raises("each must send to one common aggregator"):
        make_topology("t", devs("s1", "s2", "a", "b"), [link("s1", "a"), link("s1", "b"), link("s2", "a"),
                                                        link("a", "b")], [1] * 4)
    with raises("devices after aggregator 'agg' must form a chain"):
        make_topology("t", devs("s1", "s2", "agg", "c1", "c2"),
                      [link("s1", "agg"), link("s2", "agg"), link("agg", "c1"), link("agg", "c2"), link("c1", "c2")],
                      [1] * 5)


def test_buses_are_validated():
    from jmsnas.topology import BusGroup
    ds, ls = devs("a", "b", "c"), [link("a", "b"), link("b", "c")]
    with raises("bus 'x' names link a->c which is not a link of the topology"):
        make_topology("t", ds, ls, [1] * 3, buses=[BusGroup("x", 10.0, (("a", "c"),))])
    with raises("bus 'x' bandwidth_mbps must be > 0, got -1.0"):
        make_topology("t", ds, ls, [1] * 3, buses=[BusGroup("x", -1.0, (("a", "b"),))])
    with raises("link a->b is on two buses: 'x' and 'y'"):
        make_topology("t", ds, ls, [1] * 3, buses=[BusGroup("x", 10.0, (("a", "b"),)),
                                                   BusGroup("y", 10.0, (("a", "b"),))])
    with raises("bus 'x' has no links"):
        make_topology("t", ds, ls, [1] * 3, buses=[BusGroup("x", 10.0, ())])


# ---------------------------------------------------------------- one resolver

def test_resolve_presets_files_and_bandwidths(tmp_path):
    from jmsnas import topology
    assert topology.resolve("chain") == presets.chain_preset()
    assert topology.resolve("mesh", [1] * 6) == presets.mesh_preset((1,) * 6)
    # SplitNets' and Auto-Split's systems, from the roofline's device presets
    sn = topology.resolve("splitnets")
    assert sn.devices[0][1:] == presets.device("splitnets_sensor")[1:] and sn.links[0].bandwidth_mbps == 300.0
    au = topology.resolve("autosplit", bandwidths_mbps=[5.0])
    assert au.device_names == ("edge", "cloud") and au.links[0].bandwidth_mbps == 5.0
    assert au.devices[0][1:] == presets.device("eyeriss")[1:]
    # a file: what dump wrote reads back equal; its own layers_per_device wins
    p = tmp_path / "t.yaml"
    topology.dump(presets.chain_preset((1, 2, 3, 4)), p)
    assert topology.resolve(str(p), [2, 2, 2, 2]) == presets.chain_preset((1, 2, 3, 4))
    # one value for every link or one per link
    bws = [l.bandwidth_mbps for l in topology.resolve("chain", bandwidths_mbps=[7, 8, 9]).links]
    assert bws == [7.0, 8.0, 9.0]
    with raises("needs 1 or 3 values"):
        topology.resolve("chain", bandwidths_mbps=[1, 2])
    with raises("unknown topology 'ring'; expected a preset ['autosplit', 'chain', 'mesh', 'splitnets']"):
        topology.resolve("ring")


def test_topology_package_has_no_import_cycle():
    # types imports nothing of jmsnas but the leaf safeio (names that become file names, short reprs), presets only
    # types, file only types, presets and safeio (its capped parsers); safeio imports nothing of jmsnas
    import ast
    import pathlib
    import jmsnas.topology as pkg
    root = pathlib.Path(pkg.__file__).parent
    imports = {}
    for name in ("types", "presets", "file"):
        tree = ast.parse((root / f"{name}.py").read_text())
        imports[name] = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                         and n.module.startswith("jmsnas")}
    assert imports == {"types": {"jmsnas.safeio"}, "presets": {"jmsnas.topology.types"},
                       "file": {"jmsnas.topology.types", "jmsnas.topology.presets", "jmsnas.safeio"}}
    leaf = ast.parse((root.parent / "safeio.py").read_text())
    assert not [n for n in ast.walk(leaf) if isinstance(n, (ast.Import, ast.ImportFrom))
                and any(a.name.startswith("jmsnas") for a in n.names) or isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("jmsnas")]
