"""``jmsnas split`` and jmsnas.split.compare: zoo networks through every split method."""
import json

import numpy as np
import pytest

from jmsnas import cli, topology
from jmsnas.cost.memory import peak_memory_bytes
from jmsnas.split import compare, solvers, zoo
import paths


def run_json(capsys, *argv):
    assert cli.main(["split", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_split_json_on_splitnets(capsys):
    out = run_json(capsys, "--model", "mnasnet1_0", "--topology", "splitnets", "--act-bits", "8",
                   "--weight-bits", "8")
    n = len(zoo.mnasnet1_0().layers)
    assert set(out["methods"]) == set(compare.METHODS)
    for m, r in out["methods"].items():
        lat = r["latency_ms"]
        assert lat["total"] == pytest.approx(sum(lat["per_device"].values()) + sum(lat["per_link"].values()))
        assert len(r["assignment"]) == n and set(r["peak_memory_bytes"]) == {"sensor", "aggregator"}
    cloud = out["methods"]["cloud_only"]
    # the raw 224x224x3 8-bit image over 25% of the 1.2 Gbit/s bus: 150528 * 8 / 300e3 ms
    assert cloud["bytes_per_link"] == {"sensor->aggregator": 150528}
    assert cloud["latency_ms"]["per_link"]["sensor->aggregator"] == pytest.approx(150528 * 8 / 300e3)
    assert out["methods"]["edge_only"]["memory_ok"]["sensor"] is False  # > 2 MB on the sensor
    ns = out["methods"]["neurosurgeon"]["latency_ms"]["total"]
    assert ns <= min(out["methods"][m]["latency_ms"]["total"] for m in ("edge_only", "cloud_only"))
    assert out["methods"]["chain_dp"]["latency_ms"]["total"] <= out["methods"]["neurosurgeon_mem"]["latency_ms"]["total"] + 1e-9


def test_split_text_and_bandwidth_override(capsys):
    assert cli.main(["split", "--model", "mobilenet_v2", "--topology", "splitnets", "--act-bits", "8",
                     "--weight-bits", "8", "--methods", "edge_only", "neurosurgeon"]) == 0
    text = capsys.readouterr().out
    assert "neurosurgeon" in text and "OVER the 2.10 MB limit" in text and "300 Mbit/s" in text
    out = run_json(capsys, "--model", "mobilenet_v2", "--topology", "splitnets", "--bandwidth", "0.01")
    assert out["links_mbps"] == {"sensor->aggregator": 0.01}
    assert set(out["methods"]["neurosurgeon"]["assignment"]) == {"sensor"}  # a 10 kbit/s link: keep it local


def test_split_json_network_file_on_chain(capsys, tmp_path):
    net = {"name": "tiny", "input_shape": [8, 8, 3], "layers": [
        {"name": "a", "kind": "conv", "macs": 10_000, "params": 100, "out_shape": [8, 8, 4], "inputs": []},
        {"name": "b", "kind": "conv", "macs": 20_000, "params": 200, "out_shape": [8, 8, 4], "inputs": [0]},
        {"name": "c", "kind": "add", "macs": 0, "params": 0, "out_shape": [8, 8, 4], "inputs": [0, 1]},
        {"name": "fc", "kind": "fc", "macs": 2_560, "params": 2_570, "out_shape": [10], "inputs": [2]}]}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(net))
    out = run_json(capsys, "--model", str(path), "--topology", "chain")
    assert out["model"] == "tiny" and len(out["methods"]["dag_min_cut"]["assignment"]) == 4
    assert set(out["methods"]["edge_only"]["latency_ms"]["per_device"]) == {"ue", "sbs", "mbs", "cloud"}


@pytest.mark.parametrize("argv,message", [
    (["--model", "nope", "--topology", "chain"], "neither a zoo network"),
    (["--model", "resnet18", "--topology", "star"], "unknown topology 'star'"),
    (["--model", "resnet18", "--topology", "chain", "--bandwidth", "1", "2"], "needs 1 or 3 values"),
    (["--model", "resnet18", "--topology", "chain", "--bandwidth", "-5"], "bandwidth_mbps must be > 0"),
])
def test_split_bad_arguments(capsys, argv, message):
    assert cli.main(["split", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jmsnas split: error:") and message in err


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_zoo_peak_memory_grows_with_the_range(name):
    """The promise behind chain_dp(monotone_peak=True) for cost.memory.peak_memory_bytes."""
    net = zoo.get(name)
    n = len(net.layers)
    pk = {(j, k): peak_memory_bytes(net, list(range(j, k)), 8, 8) for j in range(n) for k in range(j + 1, n + 1)}
    assert all(pk[(j, k)] <= pk[(j, k + 1)] for j, k in pk if k < n)
    assert all(pk[(j, k)] <= pk[(j - 1, k)] for j, k in pk if j > 0)


def test_monotone_peak_dp_equals_full_dp_on_zoo_net():
    setup = compare.make_setup(zoo.mobilenet_v2(), topology.resolve("chain"), act_bits=8, weight_bits=8)
    limits = [1.2e6, 2.5e6, 4e6, np.inf]
    args = (setup.compute_ms, setup.out_bytes, setup.input_bytes, setup.topo)
    full = solvers.chain_dp(*args, edges=setup.edges, peak=setup.peak, memory_limits=limits)
    fast = solvers.chain_dp(*args, edges=setup.edges, peak=setup.peak, memory_limits=limits, monotone_peak=True)
    assert full.feasible and fast.total_ms == pytest.approx(full.total_ms)
    assert full.assignment.tolist() == fast.assignment.tolist()


def test_splitnets_table4_experiment_matches_papers_choices():
    import importlib.util
    import pathlib
    path = pathlib.Path(paths.REPO) / "experiments" / "splitnets_table4.py"
    spec = importlib.util.spec_from_file_location("splitnets_table4", path)
    exp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exp)
    results, setups = exp.run()
    facts = exp._facts(results, setups)
    assert all(facts["same"].values())  # Neurosurgeon under the paper's memory rule picks Table 4's splits
    for b in exp.BACKBONES:
        assert not results[("All-on-sensor", b)].memory_ok["sensor"]
        assert results[("All-on-aggregator", b)].per_link_ms["sensor->aggregator"] == pytest.approx(4.01, abs=0.005)
        # compute within 2% of the paper's All-on-sensor latency (roofline at the stated peaks)
        assert results[("All-on-sensor", b)].total_ms == pytest.approx(exp.PAPER[("All-on-sensor", b)][3], rel=0.02)
    assert "## Why our numbers differ" in exp.notes(results, setups)
