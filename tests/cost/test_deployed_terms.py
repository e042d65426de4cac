"""The deployed terms of the cost model: a part's call cost per device, how an op's time changes in a part of its
own (the part scale, or every op's part entry), and a link's hand-off as a function of its bytes. Measured by ``jmsnas profile`` (``jmsnas.deploy.partcost``), stored in the table file,
loaded into ``CostTable``, charged by eq. (1)/(2) and by the search's exact split; a table without them behaves
exactly as the paper's eq. (1)/(2). Structure and sign only: no timing is asserted beyond being > 0.
"""
import itertools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jmsnas.cost import latency as L
from jmsnas.cost import profile as P
from jmsnas.cost.build import build_rows, build_table
from jmsnas.cost.tables import CostTable, analytic_table, from_compute
from jmsnas.deploy import partcost
from jmsnas.space import IDENTITY, NUM_OPS, OP_NAMES, build_space
from jmsnas.topology import DeviceProfile, chain, presets


def _chain_space():
    devs = [DeviceProfile(n, 10.0, 1e9) for n in ("ue", "edge", "cloud")]
    topo = chain("c3", devs, [25.0, 50.0], [2, 1, 1], latencies_ms=[0.5, 0.25])
    return build_space(topo, image_size=8, in_channels=3, num_classes=5, device_channels=[4, 4, 8],
                       device_strides=[1, 2, 1], stem_channels=4, head_channels=8)


def _mesh_space():
    return build_space(presets.mesh_preset((1,) * 6), image_size=8, in_channels=1, num_classes=3,
                       device_channels=(8,) * 6, device_strides=(1,) * 6, stem_channels=8, head_channels=16)


def _with_terms(space, table, call, a, b):
    m, n = space.topology.num_devices, len(space.topology.links)
    return table._replace(call_ms=jnp.full((m,), call, jnp.float32), handoff_ms=jnp.full((n,), a, jnp.float32),
                          handoff_ms_per_byte=jnp.full((n,), b, jnp.float32))


def _arch(space, seed):
    rng = np.random.default_rng(seed)
    return np.array([rng.choice(np.flatnonzero(r)) for r in space.mask()], np.int32)


@pytest.mark.parametrize("make", [_chain_space, _mesh_space])
def test_a_table_without_terms_is_the_papers_eq_exactly(make):
    """from_compute's zero terms and a CostTable built from the eight paper fields alone (no terms at all) give
    bit-identical latencies, breakdowns and exact splits: a table without the terms behaves as before them."""
    space = make()
    table = analytic_table(space)
    bare = CostTable(*table[:8])  # the paper's fields only: the terms default to 0.0
    assert np.all(np.asarray(table.call_ms) == 0) and np.all(np.asarray(table.handoff_ms) == 0)
    for seed in range(3):
        ops = _arch(space, seed)
        a, b = L.arch_latency(space, table, ops), L.arch_latency(space, bare, ops)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    probs = jax.nn.softmax(jnp.asarray(np.random.default_rng(0).normal(size=space.mask().shape)), -1)
    np.testing.assert_array_equal(np.asarray(L.best_assignment(space, table, probs)),
                                  np.asarray(L.best_assignment(space, bare, probs)))


@pytest.mark.parametrize("make", [_chain_space, _mesh_space])
def test_eq_1_2_charge_every_device_its_call_and_every_link_its_handoff(make):
    """With the terms, every device's term grows by its call cost, every link's by a + b * its bytes, and T (chain:
    their sum; mesh: through the slowest branch) by exactly that."""
    space = make()
    base = analytic_table(space)
    call, a, b = 0.375, 0.0625, 2.0 ** -19  # exact in float32
    table = _with_terms(space, base, call, a, b)
    ops = _arch(space, 1)
    with jax.enable_x64(True):
        f64 = lambda t: CostTable(*(jnp.asarray(np.asarray(x, np.float64)) for x in t))
        lat0, lat1 = L.arch_latency(space, f64(base), ops), L.arch_latency(space, f64(table), ops)
        nbytes = np.asarray(L.link_bytes(space, f64(base)), np.float64)
    np.testing.assert_allclose(np.asarray(lat1.per_device) - np.asarray(lat0.per_device), call, rtol=1e-9)
    used = np.asarray(lat0.per_link) > 0  # a chain's links all carry a tensor; so do a mesh's
    assert used.all()
    np.testing.assert_allclose(np.asarray(lat1.per_link) - np.asarray(lat0.per_link), a + b * nbytes, rtol=1e-9)
    topo = space.topology
    if topo.kind == "chain":
        want = float(lat0.total) + call * topo.num_devices + float(np.sum(a + b * nbytes))
    else:  # eq. (2) written out over the grown terms: the chain part plus the slowest branch path
        dev, link = np.asarray(lat1.per_device), np.asarray(lat1.per_link)
        li = topo.link_index
        seq = list(topo.pre) + [topo.root]
        want = sum(dev[m] for m in list(topo.pre) + list(topo.post)) + sum(link[li(x, y)] for x, y in zip(seq, seq[1:]))
        want += sum(link[li(x, y)] for x, y in zip(topo.post, topo.post[1:]))
        want += max(dev[topo.root] + link[li(topo.root, c)] + dev[c] + link[li(c, topo.post[0])] for c in topo.branches)
        assert want > float(lat0.total) + call * (len(topo.pre) + len(topo.post) + 2)
    assert float(lat1.total) == pytest.approx(want, rel=1e-9)


def test_the_searched_split_optimises_the_handoff():
    """The exact chain split (the DP the search runs, and the repair's split within the devices' limits) minimises
    eq. (1) with the hand-off: it equals the best of every contiguous split enumerated, and a costly hand-off per
    byte moves the cut to smaller tensors."""
    from jmsnas import limits
    space = _chain_space()
    rng = np.random.default_rng(3)
    base = from_compute(space, rng.uniform(0.1, 3.0, (3, space.num_layers, NUM_OPS)), [0.2] * 3, [0.2] * 3)
    ops = _arch(space, 2)
    probs = jax.nn.one_hot(ops, NUM_OPS)
    splits = [np.array(s, np.int32) for s in itertools.product(range(3), repeat=space.num_layers)
              if all(x <= y for x, y in zip(s, s[1:]))]
    for b in (0.0, 1e-3):
        table = _with_terms(space, base, 0.1, 0.05, b)
        totals = [float(L.arch_latency(space, table, ops, s).total) for s in splits]
        best = L.best_chain_assignment(space, table, probs)
        assert float(L.arch_latency(space, table, ops, best).total) == pytest.approx(min(totals), rel=1e-5)
        within = limits.best_split(space, table, limits.device_limits(space), ops)
        assert float(L.arch_latency(space, table, ops, within).total) == pytest.approx(min(totals), rel=1e-5)
        sent = float(np.sum(np.asarray(L.link_bytes(space, table, best))))
        if b == 0.0:
            sent_free = sent
    assert sent <= sent_free


# ------------------------------------------------------------------------------------------ the table file

def _fake_table(space, op_ms=0.0, deployed=None):
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {OP_NAMES[i]: P.Timing(op_ms, 0.0, 5) for i in np.flatnonzero(space.mask()[s.index])
                           if i != IDENTITY}} for s in space.layers)
    return P.MeasuredTable({"backend": "cpu"}, {"reps": 5, "batch": 1, "dw_impl": "xla"}, P.space_summary(space),
                           slots, P.Timing(0.05, 0.0, 5), 0.0, P.Timing(op_ms, 0.0, 5), P.Timing(op_ms, 0.0, 5),
                           {"method": "in-network", "networks": 3, "offset_ms": 0.25}, deployed)


DEPLOYED = {"part_call": P.Timing(0.4, 0.01, 5), "part_scale": 1.0,
            "handoff": {"fixed_ms": 0.08, "ms_per_byte": 1e-6, "bytes": [0, 4096], "median_ms": [0.08, 0.084]}}


def test_terms_are_stored_loaded_and_built_into_the_cost_table(tmp_path):
    """The file round-trips the terms; a measured device pays the part call (its stem without the one-call terms),
    a link the mean hand-off of its ends that have one; a table file without them keeps its one-call meaning."""
    space = _chain_space()
    P.write_table(_fake_table(space, 0.1, DEPLOYED), tmp_path / "dep.yaml")
    P.write_table(_fake_table(space, 0.1), tmp_path / "one.yaml")
    t = P.load_table(tmp_path / "dep.yaml", space)
    assert t.deployed == DEPLOYED
    assert P.load_table(tmp_path / "one.yaml", space).deployed is None
    assert "deployed" not in yaml.safe_load((tmp_path / "one.yaml").read_text())
    names = space.topology.device_names  # ue, edge, cloud; links ue->edge, edge->cloud
    spec = {names[0]: {"kind": "measured", "path": str(tmp_path / "dep.yaml")},
            names[1]: {"kind": "measured", "path": str(tmp_path / "one.yaml")},
            names[2]: {"kind": "scaled", "of": names[0], "factor": 2.0}}
    table = build_table(space, spec)
    np.testing.assert_allclose(np.asarray(table.call_ms), [0.4, 0.0, 0.8], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(table.stem_ms), [0.1, 0.05 + 0.25 + 0.1, 0.2], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(table.handoff_ms), [0.08, 0.08], rtol=1e-6)  # one end each has it
    np.testing.assert_allclose(np.asarray(table.handoff_ms_per_byte), [1e-6, 1e-6], rtol=1e-6)
    none = build_table(space, {n: {"kind": "measured", "path": str(tmp_path / "one.yaml")} for n in names})
    assert not np.any(np.asarray(none.call_ms)) and not np.any(np.asarray(none.handoff_ms))
    assert build_rows(space, {})[names[0]].handoff is None  # a roofline row has none


def test_the_part_scale_is_stored_loaded_and_priced_by_eq_1_2_the_split_and_compose(tmp_path):
    """A file's part_scale round-trips; built into the cost table it multiplies the device's ops, stem and head
    (its call cost and hand-off unchanged), so eq. (1), the exact split DP, limits.best_split and the composed
    search all price the same grown compute; a file without the key (made before it) loads as scale 1 and builds
    bit-identical numbers to one with scale 1."""
    from jmsnas import limits
    from jmsnas.compose import choices as C
    from jmsnas.compose import cost as K
    from jmsnas.compose import terms as TT
    space = _chain_space()
    rng = np.random.default_rng(7)
    t = _fake_table(space, 0.1, dict(DEPLOYED, part_scale=1.25))
    t = t._replace(slots=tuple(dict(sl, ops={k: P.Timing(float(rng.uniform(0.05, 0.5)), 0.0, 5) for k in sl["ops"]})
                               for sl in t.slots))
    P.write_table(t, tmp_path / "s.yaml")
    P.write_table(t._replace(deployed=DEPLOYED), tmp_path / "one.yaml")
    d = yaml.safe_load((tmp_path / "one.yaml").read_text())
    del d["deployed"]["part_scale"]  # a file written before the part scale existed
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(d))
    assert P.load_table(tmp_path / "s.yaml", space).deployed["part_scale"] == 1.25
    assert P.load_table(tmp_path / "old.yaml", space).deployed["part_scale"] == 1.0
    spec = lambda f: {n: {"kind": "measured", "path": str(tmp_path / f)} for n in space.topology.device_names}
    scaled, one, old = build_table(space, spec("s.yaml")), build_table(space, spec("one.yaml")), \
        build_table(space, spec("old.yaml"))
    for x, y in zip(one, old):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for f in ("compute_ms", "stem_ms", "head_ms"):
        np.testing.assert_allclose(np.asarray(getattr(scaled, f)), 1.25 * np.asarray(getattr(one, f)), rtol=1e-6)
    for f in ("call_ms", "handoff_ms", "handoff_ms_per_byte"):
        np.testing.assert_array_equal(np.asarray(getattr(scaled, f)), np.asarray(getattr(one, f)))
    ops = _arch(space, 4)
    lat1, lat0 = L.arch_latency(space, scaled, ops), L.arch_latency(space, one, ops)
    call = np.asarray(one.call_ms)
    np.testing.assert_allclose(np.asarray(lat1.per_device) - call, 1.25 * (np.asarray(lat0.per_device) - call),
                               rtol=1e-5)
    assert float(lat1.total) > float(lat0.total)
    np.testing.assert_array_equal(np.asarray(lat1.per_link), np.asarray(lat0.per_link))
    probs = jax.nn.one_hot(ops, NUM_OPS)
    splits = [np.array(a, np.int32) for a in itertools.product(range(3), repeat=space.num_layers)
              if all(x <= y for x, y in zip(a, a[1:]))]
    best = min(float(L.arch_latency(space, scaled, ops, a).total) for a in splits)
    dp = L.best_chain_assignment(space, scaled, probs)
    assert float(L.arch_latency(space, scaled, ops, dp).total) == pytest.approx(best, rel=1e-5)
    within = limits.best_split(space, scaled, limits.device_limits(space), ops)
    assert float(L.arch_latency(space, scaled, ops, within).total) == pytest.approx(best, rel=1e-5)
    ch = C.make_choices(space.topology)
    cfg = C.Config(ops, np.zeros(space.num_layers, np.int64), np.zeros(len(space.topology.links), np.int64),
                   np.zeros(len(space.topology.links), np.int64))
    composed = K.latency(space, scaled, TT.build_terms(space, scaled, ch), C.onehot(space, ch, cfg), dp)
    assert float(composed.total) == pytest.approx(float(L.arch_latency(space, scaled, ops, dp).total), rel=1e-6)


def test_fit_part_by_hand():
    """call + scale x entries recovered exactly; the relay (entries 0) anchors the call; parts whose times do not
    grow with their entries (or all of one size) give scale 1 and their mean excess, with a warning."""
    e = [0.0, 0.2, 0.5, 1.0]
    assert partcost.fit_part(e, [0.3 + 1.2 * x for x in e]) == pytest.approx((0.3, 1.2))
    with pytest.warns(RuntimeWarning, match="do not grow with their entries"):
        assert partcost.fit_part(e, [1.0, 0.8, 0.6, 0.4]) == pytest.approx((max(np.mean(
            np.subtract([1.0, 0.8, 0.6, 0.4], e)), 0.0), 1.0))
    with pytest.warns(RuntimeWarning, match="do not grow"):
        assert partcost.fit_part([0.5, 0.5], [0.7, 0.9]) == pytest.approx((0.3, 1.0))
    with pytest.raises(ValueError, match="two equal 1-D lists"):
        partcost.fit_part([0.1], [0.1, 0.2])


def test_a_validation_report_is_stored_in_the_table(tmp_path):
    """predict_vs_measured stores jmsnas validate's report (accuracy.report) in the table; it loads back as written
    and a malformed one is refused naming the entry."""
    from jmsnas.cost import accuracy
    space = _chain_space()
    rep = dict(accuracy.report([1.0, 2.1, 2.9], [1.0, 2.0, 3.0]), against="3 networks")
    P.write_table(_fake_table(space, 0.1)._replace(validation=rep), tmp_path / "t.yaml")
    assert P.load_table(tmp_path / "t.yaml", space).validation == rep
    d = yaml.safe_load((tmp_path / "t.yaml").read_text())
    d["validation"] = [1, 2]
    with pytest.raises(P.ProfileError, match="latency table entry validation: expected a mapping"):
        P.table_from_dict(d)


@pytest.mark.parametrize("path,value,needle", [
    (("handoff", "fixed_ms"), -0.1, "deployed.handoff.fixed_ms: -0.1 is not a finite number >= 0"),
    (("handoff", "bytes"), [0], "1 sizes in bytes, 2 in median_ms"),
    (("part_call", "median_ms"), float("nan"), "deployed.part_call.median_ms"),
    (("handoff",), "x", "latency table entry deployed.handoff: expected a mapping"),
    (("part_scale",), 0.0, "deployed.part_scale: 0.0 is not a finite number > 0"),
    (("part_scale",), float("inf"), "deployed.part_scale: inf is not a finite number >= 0"),
])
def test_bad_terms_are_refused_naming_the_entry(tmp_path, path, value, needle):
    space = _chain_space()
    P.write_table(_fake_table(space, 0.1, DEPLOYED), tmp_path / "t.yaml")
    d = yaml.safe_load((tmp_path / "t.yaml").read_text())
    node = d["deployed"]
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(P.ProfileError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        P.table_from_dict(d)


def test_from_compute_checks_the_terms():
    space = _chain_space()
    m, n = 3, space.num_layers
    z = np.zeros((m, n, NUM_OPS))
    with pytest.raises(ValueError, match=r"handoff_ms has shape \(3,\), expected \(links,\) = \(2,\)"):
        from_compute(space, z, [0] * m, [0] * m, handoff_ms=[0.1] * 3)
    with pytest.raises(ValueError, match="call_ms has a negative"):
        from_compute(space, z, [0] * m, [0] * m, call_ms=[0.1, -1.0, 0.0])


# ------------------------------------------------------------------------------------------ measuring them

def _tiny_space():
    return build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                       device_channels=(8, 8, 8, 8), device_strides=(1, 1, 1, 1), stem_channels=8,
                       head_channels=16)


def test_the_terms_are_measured_over_a_loopback_socket():
    """Parts (and a relay) called between a receive and a send, and frames over a real loopback connection: with
    entries growing with the parts the fit gives a call >= 0 and a scale > 0; with entries of 0 ms nothing tells a
    scale (1, with a warning) and the call cost is the parts' whole time (> 0); every hand-off takes time (> 0) and
    its fit is >= 0."""
    space = _tiny_space()
    sizes = (0, 8192, 65536)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a fallback under load is allowed: the test is the structure
        dep = partcost.measure_deployed(space, _fake_table(space, 0.01), reps=3, archs=2, sizes=sizes, idle_ms=0,
                                        design_repeats=None)
    assert dep["part_call"].median_ms >= 0 and dep["part_call"].reps == 3 and dep["part_scale"] > 0
    assert dep["load_ratio"] > 0  # the whole networks timed in the same rounds, against the table's prediction
    h = dep["handoff"]
    assert h["bytes"] == list(sizes) and len(h["median_ms"]) == 3 and min(h["median_ms"]) > 0
    assert h["fixed_ms"] >= 0 and h["ms_per_byte"] >= 0 and h["fixed_ms"] + h["ms_per_byte"] * 65536 > 0
    with pytest.warns(RuntimeWarning, match="do not grow with their entries"):
        flat = partcost.measure_deployed(space, _fake_table(space, 0.0), reps=3, archs=1, sizes=(0,), idle_ms=0,
                                         design_repeats=None)
    assert flat["part_scale"] == 1.0 and flat["part_call"].median_ms > 0
    assert "parts" not in dep and dep["idle_ms"] == 0.0


def test_the_part_entries_are_measured_after_an_idle_wait_and_priced():
    """With a balanced design the deployed terms hold part entries: one per valid (slot, op), >= 0, the relay's and
    every part's fit in them (call >= 0, part scale 1), timed after the idle wait asked; the cost table built from
    the file charges exactly those entries, the stem and head and the call (the table's own entries play no part)."""
    space = _tiny_space()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dep = partcost.measure_deployed(space, _fake_table(space, 0.01), reps=3, archs=1, sizes=(0, 4096), idle_ms=2,
                                        design_repeats=1)
    pe = dict(dep["parts"], ops=np.asarray(dep["parts"]["ops"]))
    mask = space.mask().copy()
    mask[:, IDENTITY] = False
    assert dep["idle_ms"] == 2.0 and dep["part_scale"] == 1.0 and dep["part_call"].median_ms >= 0
    assert pe["ops"].shape == (space.num_layers, NUM_OPS) and np.all(pe["ops"] >= 0)
    assert not np.any(pe["ops"][~mask])  # nothing for identity or an invalid op
    assert pe["parts"] == 4 * (1 + len(partcost.balanced_archs(space, 1, [0, 4]))) + 1  # + the relay
    assert pe["stem_ms"] >= 0 and pe["head_ms"] >= 0 and np.isfinite(pe["rms_error_pct"])
    assert dep["host_cores"] >= 1 and 0 < dep["cores_busy"] <= dep["host_cores"]
    assert dep["part_call"].median_ms + pe["stem_ms"] + pe["ops"].sum() > 0
    w = dep["waits"]  # the wait curve: the archs network's parts and every size after 0 ms (1 and 3 are not < 2)
    assert w["wait_ms"] == (0.0, 2.0) and w["part_ratio"][-1] == 1.0 and w["part_ratio"][0] > 0
    assert w["handoff_fixed_ms"][-1] == dep["handoff"]["fixed_ms"] and w["handoff_fixed_ms"][0] >= 0
    assert "waits" not in partcost.measure_deployed(space, _fake_table(space, 0.01), reps=3, archs=1, sizes=(0,),
                                                    idle_ms=0, design_repeats=None)
    with pytest.raises(ValueError, match="short_waits must start at 0"):
        partcost.measure_deployed(space, _fake_table(space, 0.01), reps=3, idle_ms=2, short_waits=(1.0,))


def test_balanced_archs_hold_every_valid_op_in_enough_networks():
    """Every network valid; every valid op of every slot in at least ``repeats`` networks; K = repeats x the most
    valid ops of a slot; the seed decides the pairing, not the coverage; with 3 repeats the parts' features reach the
    rank of many random networks (every part entry identified as far as any design identifies it)."""
    for space in (_chain_space(), _mesh_space()):
        valid = [np.flatnonzero(r) for r in space.mask()]
        for repeats in (1, 2, 3):
            archs = partcost.balanced_archs(space, repeats, [repeats, 9])
            assert len(archs) == repeats * max(len(v) for v in valid)
            for a in archs:
                space.validate_arch(a)
            counts = np.zeros((space.num_layers, NUM_OPS), int)
            for a in archs:
                counts[np.arange(space.num_layers), a] += 1
            for n, v in enumerate(valid):
                assert counts[n, v].min() >= repeats
            pick = np.random.default_rng(7)
            many = [tuple(int(pick.choice(v)) for v in valid) for _ in range(400)]
            if repeats == 3:  # enough parts for every pairing's rank (fewer may lack the equations for it)
                assert partcost._rank(space, archs) == partcost._rank(space, many)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        partcost.balanced_archs(_chain_space(), 0, 0)


def test_fit_part_entries_recovers_a_known_table_by_hand():
    """Times made from a known call, stem, head and entry per (slot, op) over a balanced design (plus a relay) give
    those numbers back; a design missing a valid op is refused naming it; bad times are refused."""
    space = _chain_space()
    rng = np.random.default_rng(3)
    mask = space.mask().copy()
    mask[:, IDENTITY] = False
    truth = np.where(mask, rng.uniform(0.05, 0.5, mask.shape), 0.0)
    call, stem, head = 0.3, 0.12, 0.07
    keys = partcost._split_keys(space, partcost.balanced_archs(space, 3, 1))
    ms = [call + stem * k[2] + head * k[3] + sum(truth[n, i] for n, i in zip(k[0], k[1])) for k in keys]
    fit = partcost.fit_part_entries(space, keys, ms)
    # per part the sum is identified, not how a part's constant splits between its layers: check the parts
    got = [fit["call_ms"] + fit["stem_ms"] * k[2] + fit["head_ms"] * k[3] +
           sum(fit["ops"][n, i] for n, i in zip(k[0], k[1])) for k in keys]
    np.testing.assert_allclose(got, ms, rtol=1e-6)
    assert fit["call_ms"] == pytest.approx(call, rel=1e-6)  # the relay anchors the call
    assert fit["rms_error_pct"] < 1e-4 and fit["parts"] == len(keys)
    diffs = fit["ops"] - truth  # within a slot every op moves by the same constant
    for n in range(space.num_layers):
        v = diffs[n, mask[n]]
        np.testing.assert_allclose(v, v[0], atol=1e-6)
    bad = [k for k in keys if not (k[0] and k[0][0] == 0 and k[1][0] == int(np.flatnonzero(mask[0])[0]))]
    with pytest.raises(ValueError, match=f"no part runs slot 0 op {OP_NAMES[int(np.flatnonzero(mask[0])[0])]}"):
        partcost.fit_part_entries(space, bad, [1.0] * len(bad))
    with pytest.raises(ValueError, match="one finite time >= 0 per part"):
        partcost.fit_part_entries(space, keys, [float("nan")] * len(keys))


def _design(space, seed):
    """(entry keys, the network of each: None for the relay) of a balanced design at the space's split."""
    archs = partcost.balanced_archs(space, 3, seed)
    keys = partcost._split_keys(space, archs)
    per = len(keys[:-1]) // len(archs)
    return keys, [k // per for k in range(len(keys) - 1)] + [None]


def _priced(space, w, keys):
    return np.array([partcost._part_features(space, k) @ w for k in keys])


def _weights(fit):
    return np.concatenate([[fit["call_ms"], fit["stem_ms"], fit["head_ms"]], np.asarray(fit["ops"]).ravel()])


def test_shrunk_part_entries_against_their_oracles():
    """Shrink 0 is the plain fit; a huge shrink gives the one-scale model (its call and scale by least squares over
    the parts, computed here apart); an interior solution solves the ridge's normal equations; cross-validation
    picks a strong pull for parts that follow the table's shape up to noise and at most a slight one for parts of
    another shape."""
    space = _chain_space()
    keys, groups = _design(space, 1)
    rng = np.random.default_rng(11)
    prior = np.zeros(3 + space.num_layers * len(OP_NAMES))
    cells = [3 + n * len(OP_NAMES) + i for n in range(space.num_layers) for i in np.flatnonzero(space.mask()[n])
             if i != IDENTITY]
    prior[1:3] = 0.2, 0.1
    prior[cells] = rng.uniform(0.1, 0.6, len(cells))
    x = np.stack([partcost._part_features(space, k) for k in keys])
    truth = 1.3 * prior + np.where(prior > 0, rng.uniform(-0.03, 0.03, prior.shape), 0.0)
    truth[0] = 0.25
    ms = x @ truth
    plain = partcost.fit_part_entries(space, keys, ms)
    zero = partcost.fit_part_entries(space, keys, ms, prior=prior, groups=groups, shrinks=(0.0,))
    np.testing.assert_allclose(_weights(zero), _weights(plain), atol=1e-9)
    assert zero["shrink"] == 0.0 and zero["cv_rms_error_pct"] == zero["cv_rms_error_pct_unshrunk"]
    # the one-scale model: ms ~ call + scale * (the prior's sum of each part), least squares (interior here)
    e = x[:, 1:] @ prior[1:]
    (c, sc), *_ = np.linalg.lstsq(np.stack([np.ones_like(e), e], 1), ms, rcond=None)
    assert c > 0 and sc > 0
    huge = partcost.fit_part_entries(space, keys, ms, prior=prior, groups=groups, shrinks=(1e9,))
    np.testing.assert_allclose(_weights(huge)[[0, 1, 2] + cells], np.concatenate([[c], sc * prior[1:]])[[0, 1, 2] + cells],
                               rtol=1e-4, atol=1e-6)
    # interior ridge: (X'X + lam I) w = X'y + lam w0 over the fitted columns
    lam = 0.5
    mid = partcost.fit_part_entries(space, keys, ms, prior=prior, groups=groups, shrinks=(lam,))
    cols = [0, 1, 2] + cells
    w0 = np.concatenate([[c], sc * prior[1:]])[cols]
    xc = x[:, cols]
    want = np.linalg.solve(xc.T @ xc + lam * np.eye(len(cols)), xc.T @ ms + lam * w0)
    assert want.min() > 0
    np.testing.assert_allclose(_weights(mid)[cols], want, rtol=1e-6, atol=1e-9)
    # the prior's shape plus noise per part: a pull helps on held-out networks; an exact other shape: none
    noisy = (x @ (1.3 * prior + np.eye(len(prior))[0] * 0.25)) * rng.uniform(0.8, 1.2, len(keys))
    pick = partcost.fit_part_entries(space, keys, noisy, prior=prior, groups=groups)
    assert pick["shrink"] > 0 and pick["cv_rms_error_pct"] < pick["cv_rms_error_pct_unshrunk"]
    other = np.where(prior > 0, rng.uniform(0.05, 1.0, prior.shape), 0.0)
    other[0] = 0.25
    exact = partcost.fit_part_entries(space, keys, x @ other, prior=prior, groups=groups)
    # (held out, even exact parts leave pairings the training networks never met unidentified: a slight pull
    # may still help there; a strong one toward the wrong shape does not)
    assert exact["shrink"] <= 0.1 < 1.0 <= pick["shrink"]
    assert exact["cv_rms_error_pct"] <= exact["cv_rms_error_pct_unshrunk"]
    with pytest.raises(ValueError, match="groups must name the network of every part: 3 for"):
        partcost.fit_part_entries(space, keys, ms, prior=prior, groups=[0, 1, 2])
    with pytest.raises(ValueError, match="prior must be .* finite entries >= 0"):
        partcost.fit_part_entries(space, keys, ms, prior=-prior, groups=groups)
    with pytest.raises(ValueError, match=r"shrinks must be numbers >= 0, got \(-1.0,\)"):
        partcost.fit_part_entries(space, keys, ms, prior=prior, groups=groups, shrinks=(-1.0,))


def test_prior_entries_are_the_tables_own():
    """prior_entries lays the table's stem, head and every (slot, op) median in fit_part_entries' columns, 0 for
    the call, identity and ops a slot lacks."""
    space = _chain_space()
    t = _fake_table(space, 0.3)
    w = partcost.prior_entries(t, space)
    assert w[0] == 0.0 and w[1] == pytest.approx(0.3) and w[2] == pytest.approx(0.3)
    ops = w[3:].reshape(space.num_layers, len(OP_NAMES))
    want = np.where(space.mask(), 0.3, 0.0)
    want[:, IDENTITY] = 0.0
    np.testing.assert_allclose(ops, want)


def test_part_entries_are_stored_loaded_and_built_into_the_cost_table(tmp_path):
    """A file with part entries round-trips them; its device row charges those entries (not the table's own), their
    stem and head, and part_call; a part scale other than 1 beside them, or an op the slot does not have, is
    refused naming the entry."""
    space = _chain_space()
    rng = np.random.default_rng(5)
    mask = space.mask().copy()
    mask[:, IDENTITY] = False
    ops = np.where(mask, rng.uniform(0.05, 0.5, mask.shape), 0.0)
    pe = {"stem_ms": 0.2, "head_ms": 0.05, "ops": ops, "parts": 40, "rms_error_pct": 3.5, "shrink": 1.0,
          "cv_rms_error_pct": 8.5, "cv_rms_error_pct_unshrunk": 10.9}
    dep = dict(DEPLOYED, idle_ms=30.0, parts=pe, host_cores=2, cores_busy=1.25)
    P.write_table(_fake_table(space, 0.1, dep), tmp_path / "p.yaml")
    got = P.load_table(tmp_path / "p.yaml", space).deployed
    np.testing.assert_allclose(got["parts"]["ops"], ops)
    assert (got["host_cores"], got["cores_busy"]) == (2, 1.25)
    assert got["idle_ms"] == 30.0 and {k: got["parts"][k] for k in ("stem_ms", "head_ms", "parts", "rms_error_pct",
                                                                     "shrink", "cv_rms_error_pct",
                                                                     "cv_rms_error_pct_unshrunk")} \
        == {"stem_ms": 0.2, "head_ms": 0.05, "parts": 40, "rms_error_pct": 3.5, "shrink": 1.0,
            "cv_rms_error_pct": 8.5, "cv_rms_error_pct_unshrunk": 10.9}
    table = build_table(space, {d: {"kind": "measured", "path": str(tmp_path / "p.yaml")}
                                for d in space.topology.device_names})
    np.testing.assert_allclose(np.asarray(table.compute_ms)[0], ops, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(table.stem_ms), 0.2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(table.head_ms), 0.05, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(table.call_ms), 0.4, rtol=1e-6)
    a = _arch(space, 2)
    lat = L.arch_latency(space, table, a)
    names = space.topology.device_names
    want = [0.4 + sum(ops[s.index, a[s.index]] for s in space.layers if s.device == m)
            + (0.2 if m == 0 else 0.0) + (0.05 if m == len(names) - 1 else 0.0) for m in range(len(names))]
    np.testing.assert_allclose(np.asarray(lat.per_device), want, rtol=1e-5)
    d = yaml.safe_load((tmp_path / "p.yaml").read_text())
    d["deployed"]["part_scale"] = 1.5
    with pytest.raises(P.ProfileError, match="deployed.part_scale: 1.5 with deployed.parts; expected 1"):
        P.table_from_dict(d)
    d = yaml.safe_load((tmp_path / "p.yaml").read_text())
    d["deployed"]["parts"]["slots"][0]["identity"] = 0.1
    with pytest.raises(P.ProfileError, match=r"deployed.parts.slots\[0\].identity: not an op the table has"):
        P.table_from_dict(d)
    d = yaml.safe_load((tmp_path / "p.yaml").read_text())
    d["deployed"]["cores_busy"] = 3.0
    with pytest.raises(P.ProfileError, match=r"deployed.cores_busy: 3.0; expected a number in \(0, host_cores = 2\]"):
        P.table_from_dict(d)
    waits = {"wait_ms": [0.0, 3.0, 30.0], "part_ratio": [0.8, 0.9, 1.0], "handoff_fixed_ms": [0.15, 0.2, 0.4]}
    d = yaml.safe_load((tmp_path / "p.yaml").read_text())
    d["deployed"]["waits"] = waits
    assert P.table_from_dict(d).deployed["waits"] == {k: tuple(v) for k, v in waits.items()}
    P.write_table(_fake_table(space, 0.1, dict(dep, waits=waits)), tmp_path / "w.yaml")
    assert P.load_table(tmp_path / "w.yaml", space).deployed["waits"] == {k: tuple(v) for k, v in waits.items()}
    del d["deployed"]["idle_ms"]
    with pytest.raises(P.ProfileError, match="deployed.waits: needs deployed.idle_ms"):
        P.table_from_dict(d)
    d["deployed"]["idle_ms"] = 30.0
    for key, bad, needle in (("wait_ms", [0.0, 3.0, 20.0], r"wait_ms: \[0.0, 3.0, 20.0\]; expected increasing waits "
                                                           r"from 0 to deployed.idle_ms = 30.0"),
                             ("part_ratio", [0.8, 0.9, 1.1], "part_ratio: .* expected ratios > 0 ending at 1"),
                             ("handoff_fixed_ms", [0.1, 0.2], "have \\[3, 3, 2\\] entries; expected one per wait")):
        d["deployed"]["waits"] = dict(waits, **{key: bad})
        with pytest.raises(P.ProfileError, match=needle):
            P.table_from_dict(d)
    d = yaml.safe_load((tmp_path / "p.yaml").read_text())
    d["deployed"]["parts"]["slots"] = d["deployed"]["parts"]["slots"][:1]
    with pytest.raises(P.ProfileError, match="deployed.parts.slots: expected a list of"):
        P.table_from_dict(d)


def test_fit_handoff_by_hand():
    x = [0, 1000, 2000, 4000]
    a, b = partcost.fit_handoff(x, [0.1 + 2e-5 * v for v in x])
    assert a == pytest.approx(0.1) and b == pytest.approx(2e-5)
    assert partcost.fit_handoff(x, [0.3, 0.2, 0.1, 0.0]) == pytest.approx((0.15, 0.0))  # falling: no slope
    a, b = partcost.fit_handoff(x, [0.0, 0.01, 0.03, 0.07])  # negative intercept: through the origin
    assert a == 0.0 and b > 0


def test_profile_cli_stores_the_terms_and_search_uses_them(tmp_path):
    """`jmsnas profile` writes the terms (unless --no-deployed) and the table built from it charges them."""
    import json

    from jmsnas import cli
    space = _tiny_space()
    sf = {"topology": "chain", "layers_per_device": [1, 1, 1, 1], "image_size": 4, "in_channels": 1,
          "num_classes": 3, "device_channels": [8, 8, 8, 8], "device_strides": [1, 1, 1, 1], "stem_channels": 8,
          "head_channels": 16}
    (tmp_path / "s.json").write_text(json.dumps(sf))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a clamp under load is allowed: the test is the structure
        assert cli.main(["profile", "--space", str(tmp_path / "s.json"), "--out", str(tmp_path / "t.yaml"),
                         "--reps", "3", "--warmup", "0", "--calibrate", "0", "--method", "standalone",
                         "--deployed-reps", "3", "--part-idle-ms", "1", "--part-design", "1"]) == 0
    t = P.load_table(tmp_path / "t.yaml", space)
    assert t.deployed is not None and t.deployed["part_call"].median_ms >= 0 and t.deployed["part_scale"] == 1.0
    assert t.deployed["idle_ms"] == 1.0 and np.shape(t.deployed["parts"]["ops"]) == (space.num_layers, NUM_OPS)
    assert P.load_table(tmp_path / "t.yaml", space) == t  # every field compares by value
    assert t.deployed["handoff"]["bytes"] == list(partcost.HANDOFF_BYTES)
    assert min(t.deployed["handoff"]["median_ms"]) > 0
    table = build_table(space, {d: {"kind": "measured", "path": str(tmp_path / "t.yaml")}
                                for d in space.topology.device_names})
    np.testing.assert_allclose(np.asarray(table.call_ms), t.deployed["part_call"].median_ms, rtol=1e-6)
    assert np.all(np.asarray(table.handoff_ms) + np.asarray(table.handoff_ms_per_byte) * 1e5 > 0)
    ops = np.zeros(space.num_layers, np.int32)
    lat = L.arch_latency(space, table, ops)
    eps = np.asarray(L.link_bytes(space, table)) * 8 / (np.asarray(table.bandwidth_mbps) * 1e3) \
        + np.asarray(table.link_latency_ms)
    assert np.all(np.asarray(lat.per_link) > eps)  # the hand-off is in eq. (1)'s link terms


def test_profile_cli_loopback_failure_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """The deployed terms need a loopback connection; when it fails: one line naming it, exit 2, no table."""
    import json

    from jmsnas import cli
    from jmsnas.cost import profile as prof

    def no_loopback(*a, **k):
        raise ConnectionRefusedError(111, "Connection refused")
    monkeypatch.setattr(partcost, "with_deployed", no_loopback)
    monkeypatch.setattr(prof, "measure_table", lambda space, **k: _fake_table(space, 0.1))
    sf = {"topology": "chain", "layers_per_device": [1, 1, 1, 1], "image_size": 4, "in_channels": 1,
          "num_classes": 3, "device_channels": [8, 8, 8, 8], "device_strides": [1, 1, 1, 1]}
    (tmp_path / "s.json").write_text(json.dumps(sf))
    assert cli.main(["profile", "--space", str(tmp_path / "s.json"), "--out", str(tmp_path / "t.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "loopback connection" in err and "--no-deployed" in err, err
    assert not (tmp_path / "t.yaml").exists()
    assert cli.main(["profile", "--space", str(tmp_path / "s.json"), "--out", str(tmp_path / "t.yaml"),
                     "--no-deployed", "--part-idle-ms", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--no-deployed skips them" in err, err
    assert not (tmp_path / "t.yaml").exists()


def test_profile_remote_measures_the_terms_through_an_authenticated_worker(tmp_path, capsys):
    """`jmsnas profile --remote` at a `jmsnas worker` on 127.0.0.1 that requires a shared secret: with the secret the
    parts run there right after their input arrives and frames make round trips, and the table written holds the
    terms (call >= 0, scale > 0, hand-offs > 0, the sizes timed), which the cost table then charges; without the
    secret, or with a table of kernels a sent part cannot hold, one line and nothing written."""
    import json
    import subprocess
    import sys

    from jmsnas import cli
    from jmsnas.deploy import links as LK
    from paths import REPO
    space = _tiny_space()
    sf = {"topology": "chain", "layers_per_device": [1, 1, 1, 1], "image_size": 4, "in_channels": 1,
          "num_classes": 3, "device_channels": [8, 8, 8, 8], "device_strides": [1, 1, 1, 1], "stem_channels": 8,
          "head_channels": 16}
    (tmp_path / "s.json").write_text(json.dumps(sf))
    rng = np.random.default_rng(2)
    t = _fake_table(space, 0.01)
    t = t._replace(slots=tuple(dict(sl, ops={k: P.Timing(float(rng.uniform(0.005, 0.05)), 0.0, 5) for k in sl["ops"]})
                               for sl in t.slots))
    P.write_table(t, tmp_path / "there.yaml")  # dw_impl xla (_fake_table's settings)
    P.write_table(t._replace(settings={"reps": 5, "batch": 1, "dw_impl": "auto"}), tmp_path / "auto.yaml")
    (tmp_path / "secret").write_bytes(b"correct-horse-battery-staple-0123456789\n")
    s = LK.listen(0)
    port = s.getsockname()[1]
    s.close()
    env = {k: v for k, v in os.environ.items() if k != "JMSNAS_SECRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "jmsnas.cli", "worker", "--listen", f"127.0.0.1:{port}",
                             "--secret-file", str(tmp_path / "secret")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    argv = ["profile", "--space", str(tmp_path / "s.json"), "--remote", f"127.0.0.1:{port}", "--reps", "3"]
    try:
        assert "listening on" in proc.stdout.readline()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a fallback under load is allowed: the test is the structure
            assert cli.main(argv + ["--table", str(tmp_path / "there.yaml"), "--out", str(tmp_path / "o.yaml"),
                                    "--secret-file", str(tmp_path / "secret")]) == 0
        out = capsys.readouterr().out
        assert "on the worker at 127.0.0.1" in out and "whole networks timed with the parts ran" in out
        capsys.readouterr()
        old_env = os.environ.pop("JMSNAS_SECRET", None)
        try:
            assert cli.main(argv + ["--table", str(tmp_path / "there.yaml"), "--out", str(tmp_path / "x.yaml")]) == 2
        finally:
            if old_env is not None:
                os.environ["JMSNAS_SECRET"] = old_env
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "requires a shared secret" in err, err
        assert cli.main(argv + ["--table", str(tmp_path / "auto.yaml"), "--out", str(tmp_path / "x.yaml"),
                                "--secret-file", str(tmp_path / "secret")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "'auto' depthwise convolution" in err, err
    finally:
        proc.terminate()
        proc.wait(20)
    assert not (tmp_path / "x.yaml").exists()
    got = P.load_table(tmp_path / "o.yaml", space)
    dep = got.deployed
    assert dep["part_call"].median_ms >= 0 and dep["part_call"].reps == 3 and dep["part_scale"] > 0
    h = dep["handoff"]
    assert h["bytes"] == list(partcost.HANDOFF_BYTES) and h["fixed_ms"] >= 0 and h["ms_per_byte"] >= 0
    assert h["fixed_ms"] + h["ms_per_byte"] * max(h["bytes"]) > 0
    assert got.slots == t.slots  # the table's own entries, unchanged
    table = build_table(space, {d: {"kind": "measured", "path": str(tmp_path / "o.yaml")}
                                for d in space.topology.device_names})
    np.testing.assert_allclose(np.asarray(table.call_ms), dep["part_call"].median_ms, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(table.handoff_ms), h["fixed_ms"], rtol=1e-6)
