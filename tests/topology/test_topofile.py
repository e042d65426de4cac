"""Topology files (jmsnas.topofile, docs/topology.md): format, validation, presets as files, the CLI reaching them."""
import json
import os
import textwrap

import pytest
import yaml

from jmsnas import cli, space, topology
from jmsnas.topology import presets
from jmsnas.split import compare
from jmsnas.topology import BusGroup, DeviceProfile, TopologyError

from paths import REPO
TOPOS = os.path.join(REPO, "experiments", "topologies")
OWN = os.path.join(TOPOS, "phone_edge_cloud.yaml")


def shipped(name):
    return os.path.join(TOPOS, name)


# ---------------------------------------------------------------- the shipped files

def test_paper_files_are_the_presets():
    assert topology.load(shipped("paper_chain.yaml")) == presets.chain_preset()
    assert topology.load(shipped("paper_mesh.yaml")) == presets.mesh_preset()


def test_splitnets_hmd_is_a_star_on_a_shared_bus():
    t = topology.load(shipped("splitnets_hmd.yaml"))
    assert t.kind == "star" and t.device_names == ("sensor1", "sensor2", "sensor3", "sensor4", "aggregator")
    assert t.buses == (BusGroup("sensor_bus", 1200, tuple((f"sensor{i}", "aggregator") for i in range(1, 5))),)
    # each sensor's link gets a quarter of the 1.2 Gbit/s bus: SplitNets' Table 4 setting
    assert [l.bandwidth_mbps for l in t.links] == [300.0] * 4
    one = presets.splitnets_preset()
    sensor = one.devices[0]
    assert t.devices[0][1:6] == sensor[1:6]  # same figures as the roofline preset (name, note and power differ)
    assert t.bus_of(2) == t.buses[0]


def test_own_file_fields_presets_and_overrides():
    t = topology.load(OWN)
    assert t.kind == "chain" and t.device_names == ("phone", "edge", "cloud")
    assert [(l.src, l.dst, l.bandwidth_mbps, l.latency_ms, l.wireless) for l in t.links] == [
        ("phone", "edge", 10, 40, True), ("edge", "cloud", 1000, 5, False)]
    assert t.devices[0] == DeviceProfile("phone", 200, 6144 * 2 ** 20, 25, 0.2, 0.05, "mid-range phone (our figures)",
                                         active_power_w=5)
    assert [(l.tx_power_w, l.rx_power_w) for l in t.links] == [(3, 0), (0.5, 0.5)]
    assert t.devices[1] == presets.device("jetson_agx_xavier", "edge")
    assert t.layers_per_device == (2, 2, 2)


@pytest.mark.parametrize("name", sorted(os.listdir(TOPOS)))
@pytest.mark.parametrize("ext", ["yaml", "json"])
def test_dump_then_load_gives_the_same_topology(tmp_path, name, ext):
    t = topology.load(shipped(name))
    path = tmp_path / f"t.{ext}"
    topology.dump(t, path)
    assert topology.load(path) == t
    if ext == "json":
        assert json.loads(path.read_text())["devices"][0]["name"] == t.devices[0].name


def test_preset_overrides_memory_mb_and_layer_defaults(tmp_path):
    p = tmp_path / "two.yaml"
    p.write_text(textwrap.dedent("""
        devices:
          - {preset: raspberry_pi4, memory_mb: 512, efficiency: 0.5}
          - {name: srv, gflops: 100, memory_bytes: 1.0e9}
        links: [{src: raspberry_pi4, dst: srv, mbps: 5}]
    """))
    t = topology.load(p)
    assert t.name == "two" and t.devices[0].name == "raspberry_pi4"
    assert t.devices[0] == presets.DEVICES["raspberry_pi4"]._replace(memory_bytes=512 * 2 ** 20, efficiency=0.5)
    assert t.devices[1] == DeviceProfile("srv", 100, 1e9)  # the documented defaults
    assert t.layers_per_device == (2, 2)  # none in the file, none given
    assert topology.load(p, layers_per_device=(1, 3)).layers_per_device == (1, 3)
    assert topology.load(p, layers_per_device=(1, 1, 1, 1)).layers_per_device == (1, 1)  # mean of a template


def test_a_run_result_json_loads_as_its_topology(tmp_path):
    t = presets.mesh_preset()
    p = tmp_path / "result.json"
    p.write_text(json.dumps({"topology": t.name, "space": {"topology": topology.to_dict(t)}, "t_const_ms": 3.0}))
    assert topology.load(p) == t


# ---------------------------------------------------------------- bad files: one line, file + field + value

GOOD = {"devices": [{"name": "a", "preset": "raspberry_pi4"}, {"name": "b", "gflops": 10, "memory_mb": 64},
                    {"name": "c", "preset": "server_v100"}],
        "links": [{"src": "a", "dst": "b", "mbps": 10}, {"src": "b", "dst": "c", "mbps": 100}]}


def _edit(fn):
    d = json.loads(json.dumps(GOOD))
    fn(d)
    return yaml.safe_dump(d)


BAD = {
    "missing_field": (_edit(lambda d: d["devices"][1].pop("gflops")), "devices[1].gflops: missing"),
    "negative_bandwidth": (_edit(lambda d: d["links"][0].update(mbps=-5)), "links[0].mbps: must be > 0, got -5"),
    "zero_bandwidth": (_edit(lambda d: d["links"][1].update(mbps=0)), "links[1].mbps: must be > 0, got 0"),
    "unknown_preset": (_edit(lambda d: d["devices"][0].update(preset="pi9")),
                       "devices[0].preset: unknown device preset; expected one of"),
    "cycle": (_edit(lambda d: d["links"].append({"src": "c", "dst": "a", "mbps": 1})), "links: topology"),
    "branch_without_aggregator": (_edit(lambda d: d.update(
        devices=d["devices"] + [{"name": "d", "preset": "jetson_agx_xavier"}],
        links=[{"src": "a", "dst": "b", "mbps": 1}, {"src": "a", "dst": "d", "mbps": 1},
               {"src": "b", "dst": "c", "mbps": 1}])), "links: topology"),
    "python_tag": ("devices: !!python/object/apply:os.system ['echo pwned']\nlinks: []\n",
                   "(file): not valid YAML: could not determine a constructor for the tag"),
    "unknown_field": (_edit(lambda d: d["links"][0].update(mpbs=5)), "links[0].mpbs: unknown field"),
    "string_number": (_edit(lambda d: d["devices"][1].update(gflops="fast")),
                      "devices[1].gflops: must be a number, got 'fast'"),
    "efficiency_above_one": (_edit(lambda d: d["devices"][1].update(efficiency=2)),
                             "devices[1].efficiency: must be <= 1, got 2"),
    "wireless_not_bool": (_edit(lambda d: d["links"][0].update(wireless="radio")),
                          "links[0].wireless: must be true or false, got 'radio'"),
    "unknown_link_end": (_edit(lambda d: d["links"][0].update(dst="z")), "links[0].dst: unknown device"),
    "duplicate_device": (_edit(lambda d: d["devices"][2].update(name="a")),
                         "devices[2].name: duplicate device name, got 'a'"),
    "layers_wrong_length": (_edit(lambda d: d.update(layers_per_device=[1, 2])), "layers_per_device: must be a list"),
    "layers_zero": (_edit(lambda d: d.update(layers_per_device={"a": 1, "b": 0, "c": 1})),
                    "layers_per_device.b: must be an integer >= 1, got 0"),
    "bus_unknown_link": (_edit(lambda d: d.update(buses=[{"name": "x", "mbps": 9, "links": ["a->c"]}])),
                         "links: bus 'x' names link a->c which is not a link"),
    "no_links_no_mbps": (_edit(lambda d: d["links"][0].pop("mbps")), "links[0].mbps: missing"),
    "not_a_mapping": ("- just\n- a list\n", "(file): must be a mapping"),
    "deep_nesting": ("[" * 100_000, "(file): nested more than 32 levels deep"),
    "deep_dashes": ("- " * 100_000 + "x\n", "(file): nested more than 32 levels deep"),
    "broken_yaml": ("devices: [1, 1,\n", "(file): not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_fail_with_one_line_naming_file_field_value(tmp_path, case):
    text, needle = BAD[case]
    p = tmp_path / f"{case}.yaml"
    p.write_text(text)
    with pytest.raises(TopologyError) as e:
        topology.load(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: ") and needle in msg, msg


def test_bad_json_and_missing_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('{"devices": [}')
    with pytest.raises(TopologyError, match=r"t\.json: \(file\): not valid JSON"):
        topology.load(p)
    with pytest.raises(TopologyError, match="nope.yaml: topology file not found"):
        topology.load(tmp_path / "nope.yaml")


def _one_line_exit_2(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case", ["missing_field", "negative_bandwidth", "unknown_preset", "cycle",
                                  "branch_without_aggregator", "python_tag", "deep_nesting"])
def test_cli_bad_topology_file_exit_2(capsys, tmp_path, case):
    p = tmp_path / f"{case}.yaml"
    p.write_text(BAD[case][0])
    err = _one_line_exit_2(capsys, ["split", "--model", "mobilenet_v2", "--topology", str(p)])
    assert err.startswith("jmsnas split: error: ") and str(p) in err and BAD[case][1] in err
    work = tmp_path / "work"
    for command in ("search", "evolve"):
        err = _one_line_exit_2(capsys, [command, "--workdir", str(work), f"--config.topology={p}"])
        assert str(p) in err and BAD[case][1] in err
        assert not work.exists()  # refused before the workdir was made


def test_search_refuses_a_star_topology(capsys, tmp_path):
    err = _one_line_exit_2(capsys, ["search", "--workdir", str(tmp_path / "w"),
                                    f"--config.topology={shipped('splitnets_hmd.yaml')}"])
    assert "is a star of 4 source devices" in err and not (tmp_path / "w").exists()


# ---------------------------------------------------------------- the space on any topology

def _chain(n):
    return topology.chain("c", [DeviceProfile(f"d{i}", 10.0, 1e9) for i in range(n)], [1.0] * (n - 1), [1] * n)


def test_adapt_schedule_by_hand():
    tpl = ((24, 32, 48, 64), (1, 2, 1, 2))
    assert space.adapt_schedule(_chain(4), *tpl) == tpl  # one entry per device: unchanged
    # 3 stages at template positions 0, 1.5, 3: widths 24, (32+48)/2 = 40, 64; stride-2 steps at 1*2/3 -> 1, 3 -> 2
    assert space.adapt_schedule(_chain(3), *tpl) == ((24, 40, 64), (1, 2, 2))
    assert space.adapt_schedule(_chain(1), *tpl) == ((24,), (2,))
    # the mesh has 4 stages (ue, sbs, the three mbs, cloud): the template as it is, the branches share theirs
    assert space.adapt_schedule(presets.mesh_preset(), *tpl) == ((24, 32, 48, 48, 48, 64), (1, 2, 1, 1, 1, 2))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_adapted_schedule_keeps_the_downsampling_and_the_end_widths(n):
    ch, st = space.adapt_schedule(_chain(n), (24, 32, 48, 64), (1, 2, 1, 2))
    assert len(ch) == len(st) == n and ch[0] == 24 and ch[-1] == (64 if n > 1 else 24)
    assert list(ch) == sorted(ch) and st.count(2) == min(2, n)


# ---------------------------------------------------------------- reachable from the CLI

def test_split_on_own_file_json_carries_its_names(capsys):
    assert cli.main(["split", "--model", "mobilenet_v2", "--topology", OWN, "--json",
                     "--methods", "edge_only", "cloud_only", "chain_dp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["topology"] == "phone_edge_cloud" and set(out["links_mbps"]) == {"phone->edge", "edge->cloud"}
    assert topology.from_dict(out["topology_spec"]) == topology.load(OWN)
    cloud = out["methods"]["cloud_only"]["latency_ms"]
    assert set(cloud["per_device"]) == {"phone", "edge", "cloud"}
    # the raw 224x224x3 8-bit image over 10 Mbit/s plus the 40 ms link latency, by hand
    assert cloud["per_link"]["phone->edge"] == pytest.approx(150528 * 8 / 10e3 + 40)


def test_split_on_the_sensor_bus_uses_a_quarter_of_it(capsys):
    assert cli.main(["split", "--model", "mnasnet1_0", "--topology", shipped("splitnets_hmd.yaml"), "--json",
                     "--methods", "cloud_only"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["methods"]["cloud_only"]
    assert r["bytes_per_link"] == {"sensor1->aggregator": 150528, "sensor2->aggregator": 0,
                                   "sensor3->aggregator": 0, "sensor4->aggregator": 0}
    assert r["latency_ms"]["per_link"]["sensor1->aggregator"] == pytest.approx(150528 * 8 / 300e3)


# ---------------------------------------------------------------- a search on the user's own file, then its split

TINY = textwrap.dedent("""
    from jmsnas.configs import default_config, tiny
    def get_config():
        c = tiny(default_config())
        c.dw_impl = "xla"
        c.max_train = 64
        c.search.warmup_epochs = 0
        c.retrain.epochs = 0
        return c
""")


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """A tiny search on experiments/topologies/phone_edge_cloud.yaml through the CLI (the must-show command with
    the tiny config; the file's layers_per_device (2, 2, 2) wins over the config's (1, 1, 1, 1))."""
    root = tmp_path_factory.mktemp("own")
    cfg = root / "tiny.py"
    cfg.write_text(TINY)
    work = root / "run"
    assert cli.main(["search", "--config", str(cfg), f"--config.topology={OWN}", "--config.t_const_ms=60",
                     "--workdir", str(work), "--no-progress"]) == 0
    return work


@pytest.mark.slow
def test_search_on_own_file_records_its_devices_links_and_topology(own_run):
    result = json.loads((own_run / "result.json").read_text())
    t = topology.load(OWN)
    assert result["topology"] == "phone_edge_cloud" and topology.from_dict(result["space"]["topology"]) == t
    assert [a["device"] for a in result["architecture"]] == ["phone"] * 2 + ["edge"] * 2 + ["cloud"] * 2
    lat = result["latency_ms"]
    assert set(lat["per_device"]) == {"phone", "edge", "cloud"} and set(lat["per_link"]) == {"phone->edge",
                                                                                           "edge->cloud"}
    assert lat["per_link"]["phone->edge"] > 40 and lat["per_link"]["edge->cloud"] > 5  # the links' latencies
    # the default schedule (24, 32, 48, 64) / (1, 2, 1, 2) resampled to 3 devices, with tiny's widths of 8
    assert result["space"]["device_strides"] == [1, 2, 2] and result["space"]["device_channels"] == [8, 8, 8]
    assert sorted(os.listdir(own_run / "parts")) == ["cloud.npz", "edge.npz", "manifest.json", "phone.npz"]
    # the workdir alone reproduces the topology: its result.json is a topology file
    assert topology.load(own_run / "result.json") == t


@pytest.mark.slow
def test_split_model_result_json_splits_the_derived_network(own_run, capsys):
    from jmsnas.split import derived
    path = str(own_run / "result.json")
    assert cli.main(["split", "--model", path, "--json", "--methods", "edge_only", "chain_dp"]) == 0
    out = json.loads(capsys.readouterr().out)
    net, topo, space = derived.load_result(path)
    assert out["model"] == "phone_edge_cloud-derived" and out["topology"] == "phone_edge_cloud"
    assert len(out["methods"]["chain_dp"]["assignment"]) == len(net.layers)
    assert set(out["methods"]["edge_only"]["latency_ms"]["per_device"]) == {"phone", "edge", "cloud"}
    assert out["methods"]["chain_dp"]["latency_ms"]["total"] <= out["methods"]["edge_only"]["latency_ms"]["total"]
    # the workdir itself, as autosplit and modularize take a run: the same result
    assert cli.main(["split", "--model", str(own_run), "--json", "--methods", "edge_only", "chain_dp"]) == 0
    assert json.loads(capsys.readouterr().out) == out
    # over another topology (the paper's chain) and with --topology missing for a zoo network
    assert cli.main(["split", "--model", path, "--topology", "chain", "--json", "--methods", "edge_only"]) == 0
    assert set(json.loads(capsys.readouterr().out)["methods"]["edge_only"]["latency_ms"]["per_device"]) == {
        "ue", "sbs", "mbs", "cloud"}
    err = _one_line_exit_2(capsys, ["split", "--model", "mobilenet_v2"])
    assert "--topology is required" in err


def test_profile_space_file_may_name_a_topology_file(tmp_path):
    from jmsnas.commands.profile import space_from_arg
    p = tmp_path / "space.json"
    p.write_text(json.dumps({"topology": OWN, "image_size": 8, "in_channels": 1, "num_classes": 10,
                             "device_channels": [24, 32, 48, 64], "device_strides": [1, 2, 1, 2]}))
    s = space_from_arg(str(p))
    assert s.topology == topology.load(OWN)
    assert [(l.device, l.out_ch, l.stride) for l in s.layers] == [(0, 24, 1), (0, 24, 1), (1, 40, 2), (1, 40, 1),
                                                                  (2, 64, 2), (2, 64, 1)]


# ---------------------------------------------------------------- round trip of random topologies

from hypothesis import given, settings, strategies as st  # noqa: E402

_pos = st.floats(min_value=1e-6, max_value=1e7, allow_nan=False, allow_infinity=False)


@st.composite
def _chains(draw):
    n = draw(st.integers(1, 5))
    devs = [DeviceProfile(f"d{i}", draw(_pos), draw(_pos), draw(_pos), draw(st.floats(1e-3, 1.0)),
                          draw(st.floats(0.0, 10.0)), draw(st.text(max_size=8))) for i in range(n)]
    lats = [draw(st.floats(0.0, 100.0)) for _ in range(n - 1)]
    topo = topology.chain("r", devs, [draw(_pos) for _ in range(n - 1)], [draw(st.integers(1, 4)) for _ in range(n)],
                          latencies_ms=lats, wireless=[draw(st.booleans()) for _ in range(n - 1)])
    if n > 2 and draw(st.booleans()):
        pairs = tuple((l.src, l.dst) for l in topo.links[:2])
        topo = topology.make_topology("r", devs, topo.links, topo.layers_per_device,
                                      [BusGroup("bus", draw(_pos), pairs)])
    return topo


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(_chains(), st.sampled_from(["yaml", "json"]))
def test_random_topologies_round_trip(tmp_path_factory, topo, ext):
    path = tmp_path_factory.mktemp("rt") / f"t.{ext}"
    topology.dump(topo, path)
    assert topology.load(path) == topo


def test_line_break_characters_in_text_round_trip(tmp_path):
    """YAML reads U+0085 (and U+2028) as line breaks: dump escapes non-ASCII text so it reads back equal."""
    devs = [DeviceProfile("d0", 1.0, 1.0, note="\x85"), DeviceProfile("d1", 1.0, 1.0, note="a\u2028b é")]
    topo = topology.chain("r", devs, [1.0], [1, 1])
    for ext in ("yaml", "json"):
        topology.dump(topo, tmp_path / f"t.{ext}")
        assert topology.load(tmp_path / f"t.{ext}") == topo


def test_energy_fields_are_checked_in_one_line(tmp_path):
    for field, value, what in (("active_power_w", -1, "must be >= 0"), ("energy_budget_mj", 0, "must be > 0")):
        p = tmp_path / "bad.yaml"
        p.write_text(f"devices:\n  - {{name: a, gflops: 1, memory_mb: 1, {field}: {value}}}\n  - {{name: b, gflops: 1, "
                     "memory_mb: 1}\nlinks:\n  - {src: a, dst: b, mbps: 1}\n")
        with pytest.raises(topology.TopologyError, match=f"devices\\[0\\].{field}: {what}"):
            topology.load(p)
    p = tmp_path / "bad.yaml"
    p.write_text("devices:\n  - {name: a, gflops: 1, memory_mb: 1, energy_budget_mj: 5}\n  - {name: b, gflops: 1, "
                 "memory_mb: 1}\nlinks:\n  - {src: a, dst: b, mbps: 1, tx_power_w: x}\n")
    with pytest.raises(topology.TopologyError, match=r"links\[0\].tx_power_w: must be a number"):
        topology.load(p)
    p.write_text("devices:\n  - {name: a, gflops: 1, memory_mb: 1, energy_budget_mj: 5}\n  - {name: b, gflops: 1, "
                 "memory_mb: 1}\nlinks:\n  - {src: a, dst: b, mbps: 1}\n")
    with pytest.raises(topology.TopologyError, match="energy_budget_mj but no active_power_w"):
        topology.load(p)
