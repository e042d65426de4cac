"""experiments/fig6.py: the baseline-latency machinery on a tiny chain space (no training).

Oracles: eq. (1) of ``cost.latency`` for every contiguous split (the whole-network arrays handed to the split
solvers must price a split exactly as the search does), brute-force enumeration of every forward-only
assignment (for both chain DPs), the cloud-computing sum written out by hand, and hand-mapped MobileNet blocks.
"""
from __future__ import annotations

import importlib.util
import itertools
import os

import numpy as np
import pytest

from jmsnas.topology import presets
from jmsnas.cost.latency import arch_latency
from jmsnas.cost.tables import analytic_table
from jmsnas.space import NUM_OPS, OP_NAMES, build_space
from jmsnas.split import solvers
from jmsnas.topology import transfer_ms

from paths import REPO as ROOT


@pytest.fixture(scope="module")
def fig6():
    spec = importlib.util.spec_from_file_location("fig6", os.path.join(ROOT, "experiments", "fig6.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _space(layers_per_device=(1, 1, 1, 1), channels=(6, 8, 12, 16)):
    topo = presets.chain_preset(layers_per_device)
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=channels,
                       device_strides=(1, 2, 1, 2), stem_channels=8, head_channels=16)


@pytest.fixture(scope="module")
def tiny():
    space = _space()
    return space, analytic_table(space, 32)


def _random_archs(space, count, seed=0):
    rng = np.random.default_rng(seed)
    mask = space.mask()
    return [np.array([rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)], np.int32)
            for _ in range(count)]


def _forward_assignments(n, m):
    """Every non-decreasing int[n] over m chain devices (the forward-only splits of a sequence)."""
    return [np.array(a, int) for a in itertools.combinations_with_replacement(range(m), n)]


def test_whole_network_arrays_price_every_split_as_eq1(fig6, tiny):
    """Stem pinned to the UE and head to the cloud: the solvers' path latency equals eq. (1) for all 35 splits."""
    space, table = tiny
    n, m = space.num_layers, space.topology.num_devices
    for ops in _random_archs(space, 3):
        compute, out, inb = fig6.whole_network_costs(space, table, ops)
        assert compute.shape == (n + 2, m) and out.shape == (n + 2,) and inb == 64.0
        for a in _forward_assignments(n, m):
            whole = np.concatenate([[0], a, [m - 1]])
            got = solvers.path_latency(whole, compute, out, inb, space.topology)
            want = arch_latency(space, table, ops, a.astype(np.int32))
            np.testing.assert_allclose(got.total_ms, float(want.total), rtol=1e-5)
            np.testing.assert_allclose(list(got.per_device_ms.values()), np.asarray(want.per_device), rtol=1e-5,
                                       atol=1e-9)
            np.testing.assert_allclose(list(got.per_link_ms.values()), np.asarray(want.per_link), rtol=1e-5)


def test_cloud_computing_is_raw_upload_plus_cloud_compute(fig6, tiny):
    space, table = tiny
    ops = _random_archs(space, 1, seed=3)[0]
    got = fig6.cloud_computing(space, table, ops)
    cloud = space.topology.device_names.index("cloud")
    compute = np.asarray(table.compute_ms, np.float64)
    by_hand = (float(table.stem_ms[cloud]) + float(table.head_ms[cloud])
               + sum(compute[cloud, i, op] for i, op in enumerate(ops)))
    raw = 8 * 8 * 1  # an 8x8 grey image at 8 bits per pixel
    links = {f"{l.src}->{l.dst}": transfer_ms(raw, l.bandwidth_mbps, l.latency_ms) for l in space.topology.links}
    assert got["per_link"] == pytest.approx(links, rel=1e-9)
    assert got["per_device"]["cloud"] == pytest.approx(by_hand, rel=1e-6)
    assert [got["per_device"][d] for d in ("ue", "sbs", "mbs")] == [0.0, 0.0, 0.0]
    assert got["total"] == pytest.approx(by_hand + sum(links.values()), rel=1e-6)


@pytest.mark.slow
def test_best_jmsnas_split_is_the_minimum_over_all_splits(fig6, tiny):
    space, table = tiny
    m = space.topology.num_devices
    for ops in _random_archs(space, 4, seed=1):
        lat, a = fig6.best_jmsnas_split(space, table, ops)
        brute = min(float(arch_latency(space, table, ops, x.astype(np.int32)).total)
                    for x in _forward_assignments(space.num_layers, m))
        assert lat["total"] == pytest.approx(brute, rel=1e-5)
        assert lat["total"] == pytest.approx(float(arch_latency(space, table, ops, a).total), rel=1e-6)
        assert lat["total"] <= fig6.jmsnas_split(space, table, ops)["total"] + 1e-6  # D^m is one of the splits


def test_free_split_is_the_minimum_over_whole_network_splits(fig6, tiny):
    """Stem and head may move too: the DP equals enumeration of all 84 forward assignments of the 6 rows and is
    never worse than the constrained split or cloud computing (both are among them)."""
    space, table = tiny
    n, m = space.num_layers, space.topology.num_devices
    for ops in _random_archs(space, 3, seed=2):
        compute, out, inb = fig6.whole_network_costs(space, table, ops)
        lat, a = fig6.free_split(space, table, ops)
        brute = min(solvers.path_latency(x, compute, out, inb, space.topology).total_ms
                    for x in _forward_assignments(n + 2, m))
        assert lat["total"] == pytest.approx(brute, rel=1e-9)
        assert a.shape == (n + 2,)
        assert lat["total"] <= fig6.best_jmsnas_split(space, table, ops)[0]["total"] + 1e-6
        assert lat["total"] <= fig6.cloud_computing(space, table, ops)["total"] + 1e-9


def test_free_split_leaves_the_cloud_when_the_uplink_is_fast_and_the_input_large(fig6):
    """Not always cloud computing: with a 32x32x1 image and a fast uplink the DP keeps work on the edge side,
    and its choice is the brute-force one."""
    topo = presets.chain_preset((1, 1, 1, 1))
    space = build_space(topo, image_size=32, in_channels=1, num_classes=10, device_channels=(8, 8, 4, 4),
                        device_strides=(2, 2, 2, 2), stem_channels=4, stem_stride=2, head_channels=16)
    table = analytic_table(space, 8)._replace(bandwidth_mbps=np.array([1.0, 1.0, 1.0], np.float32))
    ops = np.array([OP_NAMES.index("mbconv_k3_e3")] * 4, np.int32)
    lat, a = fig6.free_split(space, table, ops)
    compute, out, inb = fig6.whole_network_costs(space, table, ops)
    brute = min(_forward_assignments(6, 4),
                key=lambda x: solvers.path_latency(x, compute, out, inb, topo).total_ms)
    assert lat["total"] == pytest.approx(solvers.path_latency(brute, compute, out, inb, topo).total_ms, rel=1e-9)
    assert a[0] != topo.device_names.index("cloud")  # the stem (4x smaller output than the image) stays out
    assert lat["total"] < fig6.cloud_computing(space, table, ops)["total"]


def test_mobilenet_v2_mapping_by_hand(fig6):
    """Default chain shapes (8 slots, first of each device changes shape): blocks 0,2,5,7,9,11,14,16 of 17."""
    space = _space((2, 2, 2, 2), (24, 32, 48, 64))
    names = [OP_NAMES[i] for i in fig6.mobilenet_ops(space, fig6.MOBILENET_V2_BLOCKS)]
    assert names == ["mbconv_k3_e3"] + ["mbconv_k3_e6_res", "mbconv_k3_e6"] * 3 + ["mbconv_k3_e6_res"]


def test_mobilenet_v3_mapping_by_hand(fig6):
    """Blocks 0,2,...,14 of 15: (3,1) (3,3) (5,3) (3,6) (3,2.3) (3,6) (5,6) (5,6); 1 and 2.3 go to e3."""
    space = _space((2, 2, 2, 2), (24, 32, 48, 64))
    names = [OP_NAMES[i] for i in fig6.mobilenet_ops(space, fig6.MOBILENET_V3_LARGE_BLOCKS)]
    assert names == ["mbconv_k3_e3", "mbconv_k3_e3_res", "mbconv_k5_e3", "mbconv_k3_e6_res", "mbconv_k3_e3",
                     "mbconv_k3_e6_res", "mbconv_k5_e6", "mbconv_k5_e6_res"]


def test_mapping_rounds_kernels_and_expansions_to_the_nearest_candidate(fig6, tiny):
    space, _ = tiny
    ops = fig6.mobilenet_ops(space, [(4, 4.5), (6, 5.0), (9, 100.0), (1, 0.5)])  # ties go to the smaller
    names = [OP_NAMES[i] for i in ops]
    assert names[0].startswith("mbconv_k3_e3") and names[1].startswith("mbconv_k5_e6")
    assert names[2].startswith("mbconv_k7_e6") and names[3].startswith("mbconv_k3_e3")
    assert [n.endswith("_res") for n in names] == [s.keeps_shape for s in space.layers]


@pytest.mark.parametrize("blocks", [[], [(3,)], [(0, 6)], [(3, -1.0)]])
def test_mapping_rejects_bad_blocks(fig6, tiny, blocks):
    with pytest.raises(ValueError, match="blocks must be"):
        fig6.mobilenet_ops(tiny[0], blocks)


def test_split_text(fig6, tiny):
    space, _ = tiny
    assert fig6.split_text(space, [0, 0, 0, 3]) == "ue: L0–L2 · cloud: L3"
    assert fig6.split_text(space, [3] * 6, whole=True) == "cloud: stem–head"


def test_rows_table_and_points(fig6, tiny):
    space, table = tiny
    ops = _random_archs(space, 1, seed=5)[0]
    rows = fig6.network_rows(space, table, "net", ops, {"val": 0.5, "test": 0.25}, 1.0,
                             ["fixed", "chain_dp", "chain_dp_free", "cloud"])
    assert [r["deployment"] for r in rows] == ["fixed", "chain_dp", "chain_dp_free", "cloud"]
    assert rows[3]["latency_ms"] == fig6.cloud_computing(space, table, ops)
    md = fig6.table_markdown(rows, space.topology.device_names, space.topology.link_names).splitlines()
    assert len(md) == 2 + len(rows) and all(line.count("|") == md[0].count("|") for line in md)
    pts = fig6.plot_points(rows)
    assert [p["group"] for p in pts] == [fig6.GROUPS[r["deployment"]] for r in rows]
    assert all(p["accuracy"] == 0.25 and p["latency_ms"] == r["latency_ms"]["total"] for p, r in zip(pts, rows))
    with pytest.raises(ValueError, match="unknown deployment"):
        fig6.network_rows(space, table, "net", ops, {"val": 0.5, "test": 0.25}, 1.0, ["edge"])


def test_reference_rows_at_224(fig6):
    """The zoo MobileNets on the chain: the exact DP is never slower than edge-only or cloud computing, and
    cloud computing pays the raw 224x224x3 image on every link."""
    rows = fig6.reference_rows()
    assert len(rows) == 9
    topo = presets.chain_preset()
    raw = sum(transfer_ms(224 * 224 * 3, l.bandwidth_mbps, l.latency_ms) for l in topo.links)
    for name in ("mobilenet_v1", "mobilenet_v2", "mobilenet_v3_large"):
        by = {r["method"]: r["latency_ms"] for r in rows if r["network"] == name}
        assert by["chain_dp"]["total"] <= min(by["edge_only"]["total"], by["cloud_only"]["total"]) + 1e-9
        assert sum(by["cloud_only"]["per_link"].values()) == pytest.approx(raw, rel=1e-9)


def _result(space, table, ops, assignment, acc):
    names = space.topology.device_names
    from jmsnas.cost.latency import breakdown_dict
    lat = breakdown_dict(space, arch_latency(space, table, ops, assignment))
    return {"architecture": [{"layer": i, "device": names[d], "op": OP_NAMES[o]}
                             for i, (o, d) in enumerate(zip(ops, assignment))],
            "latency_ms": lat, "accuracy": {"val": acc, "test": acc}, "params": 1}


@pytest.mark.parametrize("identical", [True, False])
def test_all_rows(fig6, tiny, identical):
    """An identical fixed-split rerun is folded into the mid row; the searched run is priced at the split it
    found; each baseline gets the DP, whole-network DP and cloud rows."""
    space, table = tiny
    ml = type("Cfg", (), {"t_const_ms": 1.0})
    archs = _random_archs(space, 3, seed=7)
    dm = space.layer_devices()
    levels = {l: (ml, _result(space, table, a, dm, 0.9), "x") for l, a in zip(fig6.LEVELS, archs)}
    rerun = levels["mid"][1] if identical else _result(space, table, archs[0], dm, 0.8)
    found = np.array([0, 0, 0, 3], np.int32)
    pair = {"fixed": (ml, rerun, "y"), "searched": (ml, _result(space, table, archs[2], found, 0.7), "z")}
    scratch = {"mobilenet_v2": (archs[1], {"accuracy": {"val": 0.5, "test": 0.5}}),
               "mid_fixed_scratch": (archs[1], {"accuracy": {"val": 0.6, "test": 0.6}})}
    rows = fig6.all_rows(space, table, levels, pair, scratch)
    nets = [r["network"] for r in rows]
    assert len(rows) == 3 * 2 + (1 if identical else 3) + 2 + 3 + 1  # levels, mid DP or rerun, searched, V2, control
    assert ("JMSNAS mid (= fixed-split rerun)" in nets) == identical
    assert ("JMSNAS mid, fixed-split rerun" in nets) == (not identical)
    searched = next(r for r in rows if r["deployment"] == "searched")
    assert searched["latency_ms"]["total"] == pytest.approx(float(arch_latency(space, table, archs[2], found).total))
    assert searched["how"].endswith("ue: L0–L2 · cloud: L3")


def _eq1_numpy(space, table, archs, a):
    """Eq. (1) for many architectures int[A, N] under one split a int[N], written out with numpy (oracle)."""
    c = np.asarray(table.compute_ms, np.float64)
    t = c[a[None, :], np.arange(space.num_layers)[None, :], archs].sum(axis=1)
    t += float(table.stem_ms[0]) + float(table.head_ms[-1])
    for j, link in enumerate(space.topology.links):
        done = int(np.sum(a <= j))
        nbytes = float(table.out_bytes[done - 1]) if done else float(table.stem_bytes)
        t += transfer_ms(nbytes, link.bandwidth_mbps, link.latency_ms)
    return t


def test_searched_split_range_is_min_and_max_over_all_architectures(fig6, tiny):
    """1296 architectures x 35 splits enumerated: T_min = min over both, T_max = max over archs of min over splits."""
    space, table = tiny
    mask = space.mask()
    archs = np.array(list(itertools.product(*[np.flatnonzero(mask[n]) for n in range(space.num_layers)])))
    splits = _forward_assignments(space.num_layers, space.topology.num_devices)
    t = np.stack([_eq1_numpy(space, table, archs, a) for a in splits], axis=1)  # [A, S]
    probe = archs[123]
    np.testing.assert_allclose(t[123, 7], float(arch_latency(space, table, probe, splits[7].astype(np.int32)).total),
                               rtol=1e-5)
    t_min, t_max = fig6.searched_split_range(space, table)
    assert t_min == pytest.approx(t.min(), rel=1e-5)
    assert t_max == pytest.approx(t.min(axis=1).max(), rel=1e-5)


def test_label_clusters(fig6):
    pts = [{"label": "a", "latency_ms": 1.0, "accuracy": 0.9}, {"label": "b", "latency_ms": 1.05, "accuracy": 0.9},
           {"label": "c", "latency_ms": 1.5, "accuracy": 0.9}, {"label": "a", "latency_ms": 1.0, "accuracy": 0.9},
           {"label": "d", "latency_ms": 1.0, "accuracy": 0.95}]
    assert fig6.label_clusters(pts) == [((1.0, 0.9), "a, b"), ((1.5, 0.9), "c"), ((1.0, 0.95), "d")]
