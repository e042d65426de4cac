"""Property-based tests (hypothesis): random valid chain and mesh topologies and spaces against enumeration, and
random invalid inputs, which must always raise the project's own error type with a one-line message.

Deterministic (``derandomize=True``: the examples are a function of the test) with a fixed, small example budget,
so the suite's run time does not depend on luck; no deadline (the machine may be loaded).
"""
import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from jmsnas import budget, gates, safeio
from jmsnas.cost import latency, lut, tables
from jmsnas.topology.presets import DEVICES, device
from jmsnas.space import build_space
from jmsnas.split import solvers
from jmsnas.topology import DeviceProfile, LinkProfile, TopologyError, chain, make_topology

SETTINGS = settings(max_examples=10, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
JAX_SETTINGS = settings(SETTINGS, max_examples=5)  # each example traces the latency for a new space
KINDS = sorted(DEVICES)
bandwidth = st.floats(1.0, 1000.0, allow_nan=False)


@st.composite
def chain_spaces(draw, max_layers=3):
    m = draw(st.integers(1, 3))
    per = [1] * m
    while sum(per) < draw(st.integers(m, max(m, max_layers))):
        per[draw(st.integers(0, m - 1))] += 1
    devs = [device(draw(st.sampled_from(KINDS)), f"d{i}") for i in range(m)]
    topo = chain("c", devs, [draw(bandwidth) for _ in range(m - 1)], per,
                 latencies_ms=[draw(st.sampled_from([0.0, 0.5])) for _ in range(m - 1)])
    chans = tuple(draw(st.sampled_from([4, 8])) for _ in range(m))
    strides = tuple(draw(st.sampled_from([1, 2])) for _ in range(m))
    return build_space(topo, image_size=8, in_channels=1, num_classes=3, device_channels=chans,
                       device_strides=strides, stem_channels=4, head_channels=8)


@st.composite
def mesh_spaces(draw):
    nb = draw(st.integers(2, 3))
    names = ["root"] + [f"b{i}" for i in range(nb)] + ["agg"]
    devs = [device(draw(st.sampled_from(KINDS)), n) for n in names]
    links = [LinkProfile("root", f"b{i}", draw(bandwidth)) for i in range(nb)]
    links += [LinkProfile(f"b{i}", "agg", draw(bandwidth)) for i in range(nb)]
    topo = make_topology("m", devs, links, [1] * len(names))
    return build_space(topo, image_size=8, in_channels=1, num_classes=3, device_channels=(8,) * len(names),
                       device_strides=(1,) * len(names), stem_channels=8, head_channels=8)


def _alpha(draw, sp):
    vals = draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=sp.mask().size, max_size=sp.mask().size))
    return jnp.asarray(np.asarray(vals, np.float32).reshape(sp.mask().shape))


def _all_archs(sp):
    return np.array(list(itertools.product(*[np.flatnonzero(r) for r in sp.mask()])), np.int32)


def _totals(sp, table, archs):
    return np.asarray(jax.vmap(lambda o: latency.arch_latency(sp, table, o).total)(jnp.asarray(archs)), np.float64)


# ------------------------------------------------------------------------------------------ eq. (1) and (2)

@pytest.mark.slow
@JAX_SETTINGS
@given(data=st.data(), sp=chain_spaces(max_layers=2))
def test_eq1_expected_latency_is_the_mean_over_all_architectures(data, sp):
    table = tables.analytic_table(sp)
    alpha = _alpha(data.draw, sp)
    archs = _all_archs(sp)
    p = np.asarray(gates.probabilities(alpha, jnp.asarray(sp.mask())), np.float64)
    weight = np.prod(p[np.arange(sp.num_layers)[None], archs], axis=1)
    assert weight.sum() == pytest.approx(1.0, rel=1e-5)
    expected = float(latency.expected_latency(sp, table, alpha).total)
    assert expected == pytest.approx(float(weight @ _totals(sp, table, archs)), rel=1e-4)


@pytest.mark.slow
@JAX_SETTINGS
@given(data=st.data(), sp=st.one_of(chain_spaces(), mesh_spaces()))
def test_latency_of_any_architecture_lies_between_the_fastest_and_the_slowest(data, sp):
    table = tables.analytic_table(sp)
    mask = sp.mask()
    own = np.asarray(table.compute_ms)[sp.layer_devices(), np.arange(sp.num_layers)]
    fast = [int(np.flatnonzero(r)[np.argmin(o[r])]) for r, o in zip(mask, own)]
    slow = [int(np.flatnonzero(r)[np.argmax(o[r])]) for r, o in zip(mask, own)]
    ops = [data.draw(st.sampled_from(list(np.flatnonzero(r)))) for r in mask]
    t_fast, t, t_slow = _totals(sp, table, np.array([fast, ops, slow]))
    assert np.isfinite([t_fast, t, t_slow]).all()
    assert t_fast <= t * (1 + 1e-6) and t <= t_slow * (1 + 1e-6)
    # eq. (2): at a one-hot alpha the expected latency is that architecture's latency
    onehot = 30.0 * jax.nn.one_hot(jnp.asarray(ops), mask.shape[1])
    assert float(latency.expected_latency(sp, table, onehot).total) == pytest.approx(t, rel=1e-4)


# ------------------------------------------------------------------------------------------ budget repair

@pytest.mark.slow
@JAX_SETTINGS
@given(data=st.data(), sp=chain_spaces(max_layers=2))
def test_repair_is_feasible_and_optimal(data, sp):
    table = tables.analytic_table(sp)
    alpha = _alpha(data.draw, sp)
    archs = _all_archs(sp)
    t = _totals(sp, table, archs)
    frac = data.draw(st.floats(-0.1, 1.1))
    t_const = float(t.min() + frac * (t.max() - t.min()))
    derived = np.asarray(gates.derive(alpha, sp.mask()))
    fix = budget.repair(sp, table, alpha, derived, t_const)
    got = float(latency.arch_latency(sp, table, fix.ops).total)
    assert np.isfinite(got) and fix.min_latency_ms == pytest.approx(t.min(), rel=1e-5)
    ok = budget.within(t, t_const)
    assert fix.feasible == bool(ok.any())
    if not fix.feasible:
        assert got == pytest.approx(t.min(), rel=1e-5)
        return
    assert budget.within(got, t_const)
    if fix.repaired:
        logp = np.log(np.maximum(np.asarray(gates.probabilities(alpha, sp.mask()), np.float64), 1e-30))
        cost = -logp[np.arange(sp.num_layers)[None], archs].sum(1)
        mine = -logp[np.arange(sp.num_layers), fix.ops].sum()
        assert mine <= cost[ok].min() + 1e-6


# ------------------------------------------------------------------------------------------ split solvers

@SETTINGS
@given(data=st.data(), m=st.integers(2, 4), n=st.integers(1, 6))
def test_chain_dp_is_the_best_contiguous_split(data, m, n):
    devs = [DeviceProfile(f"d{i}", 10.0, 1e9) for i in range(m)]
    topo = chain("r", devs, [data.draw(bandwidth) for _ in range(m - 1)], [1] * m)
    floats = lambda lo, hi, k: np.asarray(data.draw(st.lists(st.floats(lo, hi), min_size=k, max_size=k)))
    c = floats(0.0, 5.0, n * m).reshape(n, m)
    b, inb = floats(0.0, 1e5, n), float(data.draw(st.floats(0.0, 1e5)))
    r = solvers.chain_dp(c, b, inb, topo)
    path = np.array(solvers.chain_path(topo))
    brute = min(solvers.path_latency(path[list(pos)], c, b, inb, topo).total_ms
                for pos in itertools.combinations_with_replacement(range(m), n))
    assert r.total_ms == pytest.approx(brute, rel=1e-9, abs=1e-12)
    assert np.all(np.diff(r.assignment) >= 0)


# ------------------------------------------------------------------------------------------ invalid inputs

def _one_line(e):
    assert str(e) and "\n" not in safeio.clip(str(e), 10 ** 6)


bad_number = st.one_of(st.just(float("nan")), st.just(float("inf")), st.floats(-1e6, 0.0), st.just(True),
                       st.just("12"), st.none())


@SETTINGS
@given(field=st.sampled_from(["peak_gflops", "memory_bytes", "mem_bandwidth_gbs", "efficiency", "bandwidth"]),
       value=bad_number, m=st.integers(2, 4))
def test_invalid_topologies_raise_topology_error(field, value, m):
    devs = [DeviceProfile(f"d{i}", 10.0, 1e9) for i in range(m)]
    bws = [10.0] * (m - 1)
    if field == "bandwidth":
        bws[0] = value
    else:
        devs[0] = devs[0]._replace(**{field: value})
    if field == "peak_gflops" and value is not None and not isinstance(value, (str, bool)) and value == 0.0:
        pass  # 0 is invalid too
    with pytest.raises(TopologyError) as info:
        chain("bad", devs, bws, [1] * m)
    _one_line(info.value)


yaml_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10 ** 30, 10 ** 30),
                                     st.floats(allow_nan=True), st.text(max_size=20)),
                           lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                                                     max_size=4), max_leaves=12)


@SETTINGS
@given(table=st.one_of(yaml_values, st.dictionaries(st.sampled_from(
    ["Conv-input:8x8x1-output:8x8x4", "expanded_conv-input:8x8x4-output:8x8x4-expand:3-kernel:3-stride:1-idskip:1",
     "Logits-input:8x8x8-output:3", "bad-key", ""]), yaml_values, min_size=1, max_size=3)))
def test_invalid_latency_tables_raise_lut_error(tmp_path_factory, table):
    path = tmp_path_factory.mktemp("t") / "t.yaml"
    path.write_text(yaml.safe_dump(table))
    try:
        t = lut.load_lut(path)
    except lut.LUTError as e:
        _one_line(e)
        return
    assert all(math.isfinite(v) and v >= 0 for v in t.entries.values())  # what loads is a usable table


@SETTINGS
@given(text=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_random_bytes_as_a_table_raise_lut_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("t") / "t.yaml"
    path.write_bytes(text)
    try:
        lut.load_lut(path)
    except lut.LUTError as e:
        _one_line(e)


@SETTINGS
@given(arch=st.fixed_dictionaries({"ks": yaml_values, "e": st.lists(yaml_values, min_size=20, max_size=20),
                                   "d": st.lists(st.one_of(st.integers(-3, 6), yaml_values), min_size=5, max_size=5),
                                   "r": yaml_values}))
def test_invalid_architecture_files_raise_lut_error(arch):
    try:
        layers = lut.arch_layers(json.loads(json.dumps(arch)))
    except lut.LUTError as e:
        _one_line(e)
        return
    assert layers  # only a complete, valid arch gets through


@SETTINGS
@given(key=st.sampled_from(["t_const_ms", "search.epochs", "search.arch_lr", "seed", "topology", "shared_weights",
                            "space.device_channels", "eval_batch_size", "checkpoint_every", "retrain.lr"]),
       value=st.one_of(st.text(max_size=12), st.sampled_from(["-1", "0", ".nan", "1e999", "[1,", "true", "{a: 1}",
                                                             "!!binary x", "[[[[", "2e-3", "-2e-3"])))
def test_random_overrides_are_refused_or_valid(key, value):
    from jmsnas import pipeline
    from jmsnas import configs as cmd
    try:
        cfg = cmd.apply_overrides(cmd.load_config(None), [f"--config.{key}={value}"])
        pipeline.validate_config(cfg)
    except ValueError as e:
        _one_line(e)
