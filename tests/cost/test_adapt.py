"""Per-layer tables, adaptation from measured networks, accuracy reports (jmsnas.cost.layertable/adapt/accuracy),
on HELP's FBNet data (tests/data/help_fbnet, a subset of ../shared/reference/help_fbnet)."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats

from jmsnas.cost import accuracy, adapt
from jmsnas.cost import layertable as LT
from jmsnas.cost import networks as NW
from jmsnas.fbnet import help as H
import paths

DATA = os.path.join(paths.DATA, "help_fbnet")
SETTINGS = settings(max_examples=25, derandomize=True, deadline=None, database=None)


@pytest.fixture(scope="module")
def tables():
    return H.tables(DATA)


@pytest.fixture(scope="module")
def data():
    return H.load(DATA)


def test_relative_tables_reproduce_the_published_sums(tables, data):
    """Oracle: HELP's pixel3/raspi4 values are sums of the per-layer table; the non-negative form keeps them."""
    raw = json.load(open(os.path.join(DATA, H.LUT_FILE)))["devices"]
    for dev in ("pixel3", "raspi4"):
        t = tables[dev]
        assert t.const_ms >= 0 and (t.entry_ms >= 0).all()
        base, delta = raw[dev]["base_all_k3_e1_ms"], np.array(raw[dev]["delta_ms[layer][op]"])
        by_hand = np.array([base + sum(delta[l][o] for l, o in enumerate(a)) for a in data["archs"]])
        np.testing.assert_allclose(LT.predict_ms(t, data["archs"]), by_hand, rtol=0, atol=1e-9)
        np.testing.assert_allclose(LT.predict_ms(t, data["archs"]), data["ms"][dev], rtol=0, atol=1e-9)


def test_table_file_round_trip(tables, tmp_path):
    t = tables["raspi4"]._replace(validation={"n": 3})
    LT.save(t, tmp_path / "t.json")
    u = LT.load(tmp_path / "t.json")
    assert u.const_ms == t.const_ms and u.op_names == t.op_names and u.validation == {"n": 3}
    np.testing.assert_array_equal(u.entry_ms, t.entry_ms)


def test_adapt_recovers_a_per_type_scaling_exactly(tables, data):
    """Oracle: a target that is the base with one scale per (kernel, expansion) type and another for the fixed
    term is reproduced (leave-one-out error ~0, the chosen model predicts unseen networks exactly)."""
    base = tables["pixel3"]
    groups = adapt.op_groups(base.op_names, "kernel_expand")
    theta = np.array([0.7, 2.0, 1.5, 3.0, 2.5, 1.2, 4.0, 0.5])  # fixed term, then the 7 types
    assert groups.max() + 1 == len(theta) - 1
    target = LT.make(theta[0] * base.const_ms, base.entry_ms * theta[1 + groups][None], base.op_names,
                     space=base.space, device="synthetic", source="synthetic")
    sample = data["archs"][:30]
    m = NW.make(sample, LT.predict_ms(target, sample), base.op_names, space=base.space, device="synthetic")
    got = adapt.adapt(base, m, lambdas=(1e-8,))
    assert got.adaptation["grouping"] in ("kernel_expand", "op")
    assert got.adaptation["loo_mape_pct"] < 1e-3
    np.testing.assert_allclose(LT.predict_ms(got, data["archs"]), LT.predict_ms(target, data["archs"]), rtol=1e-5)


def test_single_factor_is_the_relative_least_squares_optimum():
    p, y = np.array([1.0, 2.0, 4.0]), np.array([1.5, 3.5, 7.0])
    s = adapt.single_factor(p, y)
    loss = lambda s: np.sum(((s * p - y) / y) ** 2)
    assert loss(s) <= min(loss(s - 1e-4), loss(s + 1e-4))


def test_accuracy_report_by_hand():
    r = accuracy.report([1.0, 2.125, 3.75, 10.0], [1.0, 2.0, 4.0, 8.0])  # errors 0, +1/16, -1/16, +1/4
    assert r["n"] == 4 and r["within_10pct"] == 75.0
    assert r["mape_pct"] == pytest.approx(100 * (0 + 0.0625 + 0.0625 + 0.25) / 4)
    assert r["max_error_pct"] == pytest.approx(25.0) and r["median_error_pct"] == pytest.approx(6.25)
    assert r["bias_pct"] == pytest.approx(100 * 0.25 / 4)
    assert r["spearman"] == pytest.approx(1.0) and r["kendall"] == pytest.approx(1.0)


@st.composite
def _measured(draw):
    """A base table of random non-negative entries and 1-12 random networks with random positive latencies."""
    n, r = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    ms = st.floats(0.0, 50.0, allow_nan=False)
    entry = np.array(draw(st.lists(ms, min_size=n * r, max_size=n * r))).reshape(n, r)
    base = LT.make(draw(ms), entry, [f"k{3 + 2 * (i % 2)}_e{1 + i}" for i in range(r - 1)] + ["skip"],
                   space="s", device="base", source="hypothesis")
    k = draw(st.integers(1, 12))
    archs = np.array(draw(st.lists(st.integers(0, r - 1), min_size=n * k, max_size=n * k))).reshape(k, n)
    y = draw(st.lists(st.floats(0.01, 500.0, allow_nan=False), min_size=k, max_size=k))
    return base, NW.make(archs, y, base.op_names, space="s", device="target")


@SETTINGS
@given(_measured())
def test_adapted_table_never_predicts_a_negative_latency(case):
    base, m = case
    t = adapt.adapt(base, m)
    assert t.const_ms >= 0 and (t.entry_ms >= 0).all()
    every = np.array(np.meshgrid(*[range(len(base.op_names))] * base.num_layers)).reshape(base.num_layers, -1).T
    assert (LT.predict_ms(t, every) >= 0).all()


@SETTINGS
@given(_measured(), st.sampled_from(["zero", "space", "layers", "op"]))
def test_bad_adaptation_inputs_end_with_one_line(case, what):
    base, m = case
    if what == "zero":
        m = NW.make(np.zeros((0, 0)), [], base.op_names, space="s", device="target")
    elif what == "space":
        m = m._replace(space="mbconv")
    elif what == "layers":
        m = m._replace(archs=np.zeros((len(m.ms), base.num_layers + 1), np.int64))
    else:
        m = m._replace(op_names=("no_such_op",) * len(m.op_names))
    with pytest.raises(LT.TableError) as e:
        adapt.adapt(base, m)
    assert "\n" not in str(e.value)


def test_fbnet_networks_of_another_space_are_refused(tables, data):
    m = H.measured(data, "samsung_a50", data["reference"])._replace(space="mbconv13")
    with pytest.raises(LT.TableError, match="space 'mbconv13'"):
        adapt.adapt(tables["pixel3"], m)


def test_measured_file_round_trip_and_errors(tmp_path, data):
    m = H.measured(data, "silver_4114", data["reference"])
    NW.save(m, tmp_path / "m.json")
    back = NW.load(tmp_path / "m.json")
    np.testing.assert_array_equal(back.archs, m.archs)
    np.testing.assert_array_equal(back.ms, m.ms)
    d = NW.to_dict(m)
    d["networks"][3]["ms"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(LT.TableError, match=r"networks\[3\]\.ms must be a latency of 1e-06-1e\+07 ms .*, got -1.0"):
        NW.load(tmp_path / "bad.json")


def test_adaptation_on_help_data_beats_one_factor_on_held_out_networks(tables, data):
    """The benchmark's claim on the test copy (10 reference networks, held-out 4000-4099), a Xeon Silver 4210R."""
    held = H.measured(data, "silver_4210r", range(4000, 4100))
    sample = H.measured(data, "silver_4210r", data["reference"])
    one = adapt.rescale(tables["pixel3"], sample)
    ours = adapt.adapt(tables["pixel3"], sample)
    err = lambda t: accuracy.report(LT.predict_ms(t, held.archs), held.ms)["mape_pct"]
    assert err(ours) < err(one)
    rho = stats.spearmanr(LT.predict_ms(ours, held.archs), held.ms).statistic
    assert rho > 0
