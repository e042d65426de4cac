"""Per-layer tables fitted from whole networks (jmsnas.cost.layerfit), the shipped library of HELP's devices
(jmsnas.cost.library, jmsnas/fbnet/library) and adaptation with the library as prior (jmsnas.cost.adapt_prior)."""
import itertools
import json
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jmsnas.cost import adapt_prior as AP, layerfit
from jmsnas.cost import layertable as LT
from jmsnas.cost import library as LB
from jmsnas.cost import networks as NW
from jmsnas.fbnet import help as H
import paths

DATA = os.path.join(paths.DATA, "help_fbnet")
SETTINGS = settings(max_examples=15, derandomize=True, deadline=None, database=None)
STAGES = np.repeat(np.arange(7), [1, 4, 4, 4, 4, 4, 1])


@pytest.fixture(scope="module")
def shipped():
    return {t.device: t for t in LB.load(LB.shipped_paths("fbnet_c100"))}


@pytest.fixture(scope="module")
def data():
    return H.load(DATA)


@pytest.fixture(scope="module")
def pixel3():
    return H.tables(DATA)["pixel3"]


def _table(rng, n, r, name, scale=1.0):
    return LT.make(float(rng.uniform(0, 3)) * scale, rng.uniform(0, 2, (n, r)) * scale,
                   [f"k{3 + 2 * (i % 2)}_e{1 + i}" for i in range(r - 1)] + ["skip"], space="s", device=name,
                   source=name)


def test_fit_recovers_an_additive_table_from_whole_networks():
    """Oracle: networks timed by a known additive table give back a table that predicts unseen networks exactly
    (its cells may differ by a per-layer constant moved into the fixed term; no prediction depends on it)."""
    rng = np.random.default_rng(0)
    truth = _table(rng, 5, 4, "truth")
    archs = rng.integers(0, 4, (120, 5))
    m = NW.make(archs, LT.predict_ms(truth, archs), truth.op_names, space="s", device="truth")
    t = layerfit.fit(m, holdout=0.25)
    assert t.validation["n"] == 30 and t.validation["mape_pct"] < 1e-6 and t.adaptation["fit"]["networks_fitted"] == 90
    every = np.array(list(itertools.product(range(4), repeat=5)))
    np.testing.assert_allclose(LT.predict_ms(t, every), LT.predict_ms(truth, every), rtol=1e-7)


def test_bounded_least_squares_is_the_brute_force_optimum():
    """Oracle: on 2 layers x 2 ops with noisy latencies the bounded solution's objective equals the best over every
    active set (free variables solved by least squares, the others 0, kept when feasible)."""
    rng = np.random.default_rng(1)
    archs = rng.integers(0, 2, (9, 2))
    y = rng.uniform(0.5, 3.0, 9)
    x = layerfit.design(archs, 2) / y[:, None]
    obj = lambda th: float(np.sum((x @ th - 1.0) ** 2))
    best = np.inf
    for free in itertools.product([0, 1], repeat=x.shape[1]):
        idx = np.flatnonzero(free)
        th = np.zeros(x.shape[1])
        if idx.size:
            th[idx] = np.linalg.lstsq(x[:, idx], np.ones(9), rcond=None)[0]
        if (th >= -1e-12).all():
            best = min(best, obj(th))
    assert obj(layerfit.solve(archs, y, 2)) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_fit_refuses_too_few_networks_and_unused_cells():
    rng = np.random.default_rng(2)
    truth = _table(rng, 3, 3, "t")
    archs = np.zeros((10, 3), np.int64)
    m = NW.make(archs, LT.predict_ms(truth, archs), truth.op_names, space="s", device="t")
    with pytest.raises(LT.TableError, match=r"op 'k5_e2' at layer 0 is in none of the 8 networks fitted"):
        layerfit.fit(m, holdout=0.2)
    with pytest.raises(LT.TableError, match=r"holdout 0.1 of 10 networks leaves 1 to validate on \(need >= 2\)"):
        layerfit.fit(m)
    with pytest.raises(LT.TableError, match="no measured networks"):
        layerfit.fit(NW.make(np.zeros((0, 0)), [], truth.op_names, space="s", device="t"))
    with pytest.raises(LT.TableError, match="holdout must be a share"):
        layerfit.fit(m, holdout=1.0)


def test_shipped_library_is_small_validated_and_licensed(shipped):
    d = os.path.dirname(LB.shipped_paths("fbnet_c100")[0])
    assert set(shipped) == {"silver_4114", "silver_4210r", "titan_rtx_32", "samsung_a50", "pixel3", "raspi4"}
    assert sum(os.path.getsize(p) for p in LB.shipped_paths("fbnet_c100")) < 150_000
    assert "MIT" in open(os.path.join(d, "README.md")).read()
    for t in shipped.values():
        assert t.validation["n"] == 400 and t.validation["within_10pct"] >= 94.0
        assert t.adaptation["learning_curve"]["networks"] == [5, 10, 20, 50]
        assert set(t.adaptation["learning_curve_without"]) == set(shipped) - {t.device}


def test_the_library_tables_reproduce_the_published_tables(shipped, data, pixel3):
    """pixel3's whole-network values are sums of its published table: the fitted table predicts them (the test copy's
    networks 4000-4099 were in no fit) to 1e-6."""
    archs = data["archs"][data["index"] >= 4000]
    np.testing.assert_allclose(LT.predict_ms(shipped["pixel3"], archs), LT.predict_ms(pixel3, archs), rtol=1e-6)


def test_a_combination_of_library_tables_is_recovered(pixel3):
    """Oracle: a target that is 0.5 x one library table + 1.2 x another is found (not a fallback) and predicts
    every network exactly."""
    rng = np.random.default_rng(3)
    n, r = pixel3.num_layers, len(pixel3.op_names)
    a_, b_ = (LT.make(pixel3.const_ms * f, pixel3.entry_ms * rng.uniform(0.2, 2.0, (n, r)), pixel3.op_names,
                      space=pixel3.space, device=d, source=d) for f, d in ((1.0, "a"), (2.0, "b")))
    truth = LT.make(0.5 * a_.const_ms + 1.2 * b_.const_ms, 0.5 * a_.entry_ms + 1.2 * b_.entry_ms, pixel3.op_names,
                    space=pixel3.space, device="target", source="t")
    archs = rng.integers(0, r, (10, n))
    m = NW.make(archs, LT.predict_ms(truth, archs), pixel3.op_names, space=pixel3.space, device="target")
    got = AP.adapt_library(pixel3, m, [b_, a_], stages=STAGES)
    assert not got.adaptation["fallback"]
    assert got.adaptation["weights"] == pytest.approx({"a": 0.5, "b": 1.2, "kernels (ms per kernel launched)": 0.0},
                                                      rel=1e-6, abs=1e-9)
    other = rng.integers(0, r, (200, n))
    np.testing.assert_allclose(LT.predict_ms(got, other), LT.predict_ms(truth, other), rtol=1e-6)


def _unrelated_library_and_a_rescaled_target(pixel3) -> tuple:
    """Two random tables, and 10 networks of a target that is exactly pixel3 x 1.7."""
    rng = np.random.default_rng(4)
    n, r = pixel3.num_layers, len(pixel3.op_names)
    lib = [LT.make(1.0, rng.uniform(0, 3, (n, r)), pixel3.op_names, space=pixel3.space, device=f"rand{i}",
                   source="r") for i in range(2)]
    archs = rng.integers(0, r, (10, n))
    return lib, NW.make(archs, 1.7 * LT.predict_ms(pixel3, archs), pixel3.op_names, space=pixel3.space,
                        device="target")


def test_falls_back_to_the_one_factor_rescale_when_the_library_does_not_help(pixel3):
    """Oracle: a target that is exactly the base x 1.7 has leave-one-out error 0 under the one-factor rescale; an
    unrelated library cannot beat it, so the result is that rescale, and says so."""
    lib, m = _unrelated_library_and_a_rescaled_target(pixel3)
    got = AP.adapt_library(pixel3, m, lib, stages=STAGES)
    assert got.adaptation["fallback"] and got.adaptation["chosen"] == ["single_factor"]
    assert "one-factor rescale" in got.adaptation["why"]
    np.testing.assert_allclose(got.entry_ms, 1.7 * pixel3.entry_ms, rtol=1e-9)


def test_help_device_from_the_shipped_library_and_its_interval(shipped, data, pixel3):
    """titan_rtx_32 from its 10 reference networks and the other five devices: below the one-factor rescale on the
    held-out networks 4000-4099 of the test copy, with an interval that holds most of them."""
    from jmsnas.cost import accuracy, adapt
    sample = H.measured(data, "titan_rtx_32", data["reference"])
    held = H.measured(data, "titan_rtx_32", range(4000, 4100))
    lib = [t for d, t in shipped.items() if d != "titan_rtx_32"]
    got = AP.adapt_library(pixel3, sample, lib, stages=STAGES)
    err = lambda t: accuracy.report(LT.predict_ms(t, held.archs), held.ms)["mape_pct"]
    assert err(got) < err(adapt.rescale(pixel3, sample))
    lo, hi = AP.interval_ms(got, held.archs)
    assert (lo <= LT.predict_ms(got, held.archs)).all() and 0.7 <= np.mean((held.ms >= lo) & (held.ms <= hi)) <= 1.0
    e = got.adaptation["expected"]
    assert e["at"]["networks"] == 10 and e["plus_10"]["networks"] == 20 and e["devices"] == 5
    with pytest.raises(LT.TableError, match="carries no prediction interval"):
        AP.interval_ms(pixel3, held.archs)


@st.composite
def _case(draw):
    """A base, a library of 1-4 random tables and 1-12 random networks with random positive latencies."""
    seed = draw(st.integers(0, 2 ** 31))
    rng = np.random.default_rng(seed)
    n, r = draw(st.integers(1, 5)), draw(st.integers(2, 4))
    base = _table(rng, n, r, "base")
    lib = [_table(rng, n, r, f"dev{i}", scale=float(rng.uniform(0.1, 10))) for i in range(draw(st.integers(1, 4)))]
    k = draw(st.integers(1, 12))
    archs = rng.integers(0, r, (k, n))
    y = draw(st.lists(st.floats(0.01, 500.0, allow_nan=False), min_size=k, max_size=k))
    return base, lib, NW.make(archs, y, base.op_names, space="s", device="target"), seed


@SETTINGS
@given(_case())
def test_adapted_table_is_never_negative_and_the_library_order_changes_nothing(case):
    base, lib, m, seed = case
    t = AP.adapt_library(base, m, lib)
    assert t.const_ms >= 0 and (t.entry_ms >= 0).all()
    every = np.array(list(itertools.product(range(len(base.op_names)), repeat=base.num_layers)))
    assert (LT.predict_ms(t, every) >= 0).all()
    shuffled = [lib[i] for i in np.random.default_rng(seed).permutation(len(lib))]
    u = AP.adapt_library(base, m, shuffled)
    np.testing.assert_array_equal(u.entry_ms, t.entry_ms)
    assert u.const_ms == t.const_ms and u.adaptation == t.adaptation


@SETTINGS
@given(_case(), st.sampled_from(["space", "ops", "layers", "target_name", "target_data", "twice", "empty"]))
def test_a_bad_library_is_refused_in_one_line(case, what):
    base, lib, m, _ = case
    if what == "space":
        lib = lib + [lib[0]._replace(space="mbconv13", device="other")]
    elif what == "ops":
        lib = lib + [lib[0]._replace(op_names=tuple(reversed(lib[0].op_names)), device="other")]
    elif what == "layers":
        e = np.vstack([lib[0].entry_ms, lib[0].entry_ms[:1]])
        lib = lib + [lib[0]._replace(entry_ms=e, device="other")]
    elif what == "target_name":
        lib = lib + [lib[0]._replace(device="target")]
    elif what == "target_data":  # the target's own table under another name: it reproduces every measurement
        truth = lib[0]._replace(device="alias")
        m = m._replace(ms=LT.predict_ms(truth, m.archs))
        if (m.ms <= 0).any():
            return
        lib = lib[1:] + [truth]
    elif what == "twice":
        lib = lib + [lib[0]]
    else:
        lib = []
    with pytest.raises(LT.TableError) as e:
        AP.adapt_library(base, m, lib)
    assert "\n" not in str(e.value)
    assert {"space": "space", "ops": "space", "layers": "space", "target_name": "target device",
            "target_data": "target itself", "twice": "two tables", "empty": "empty"}[what] in str(e.value)


def test_expected_error_interpolates_the_library_curves(shipped):
    lib = list(shipped.values())
    e = LB.expected_error(lib, 10)
    at10 = np.median([t.adaptation["learning_curve"]["mape_pct"][1] for t in lib])
    assert e["at"]["mape_pct"] == pytest.approx(at10)
    at20 = np.median([t.adaptation["learning_curve"]["mape_pct"][2] for t in lib])
    assert e["plus_10"]["mape_pct"] == pytest.approx(at20)
    assert LB.expected_error([t._replace(adaptation=None) for t in lib], 10) is None


def test_library_file_round_trip_keeps_the_curve(shipped, tmp_path):
    t = shipped["raspi4"]
    LT.save(t, tmp_path / "r.json")
    back = LB.load([str(tmp_path)])
    assert back[0].adaptation == json.loads(json.dumps(t.adaptation))


def test_the_adaptation_without_a_library_carries_a_t_interval(data, pixel3):
    """``adapt.adapt`` too: its half-width is t_{0.95, K-1} times the RMS of its leave-one-out errors."""
    from scipy import stats
    from jmsnas.cost import adapt
    sample = H.measured(data, "silver_4210r", data["reference"])
    t = adapt.adapt(pixel3, sample)
    iv = t.adaptation["interval"]
    assert iv["factor"] == pytest.approx(stats.t.ppf(0.95, 9))
    assert iv["rel_halfwidth"] == pytest.approx(iv["factor"] * iv["loo_rms_rel"])
    lo, hi = AP.interval_ms(t, sample.archs)
    np.testing.assert_allclose(hi / LT.predict_ms(t, sample.archs), 1 + iv["rel_halfwidth"])
    assert adapt.adapt(pixel3, H.measured(data, "silver_4210r", data["reference"][:2])).adaptation["interval"] is None


def test_the_targets_prior_holds_nothing_of_the_target(shipped, data, pixel3):
    """Leave-one-device-out: the calibration and learning curves the target's prior reads are built with the target's
    table out of every library device's library. Perturbing the target's table leaves the curves built without it,
    its interval and its expected error unchanged; the curves built with it (what leaked before) do change."""
    target, cal_devs = "titan_rtx_32", ("samsung_a50", "silver_4210r")
    clean = {d: t._replace(adaptation=None) for d, t in shipped.items()}
    rng = np.random.default_rng(3)
    t = clean[target]
    noisy = dict(clean, **{target: t._replace(entry_ms=t.entry_ms * rng.uniform(0.3, 3.0, t.entry_ms.shape))})

    def curves(tables):
        out = {}
        for j in cal_devs:
            kw = dict(ks=(5, 10), draws=2, seed=0, stages=STAGES,
                      reference=H.measured(data, j, data["reference"]))
            pool, held = H.measured(data, j, range(4000, 4060)), H.measured(data, j, range(4060, 4100))
            out[j] = {"learning_curve": AP.learning_curve(pixel3, [x for d, x in tables.items() if d != j], pool,
                                                          held, **kw),
                      "learning_curve_without": {target: AP.learning_curve(
                          pixel3, [x for d, x in tables.items() if d not in (j, target)], pool, held, **kw)}}
        return out

    a, b = curves(clean), curves(noisy)
    for j in cal_devs:
        assert a[j]["learning_curve_without"] == b[j]["learning_curve_without"]
        assert a[j]["learning_curve"] != b[j]["learning_curve"]   # the check can fail: the target's data moves these
    sample = H.measured(data, target, data["reference"])

    def prior(c):
        lib = [clean[j]._replace(adaptation=c[j]) for j in cal_devs]
        return (LB.interval_factor(lib, 10, target, sample.archs), LB.interval_factor(lib, 10, None, sample.archs),
                AP.adapt_library(pixel3, sample, lib, stages=STAGES).adaptation)

    (za, leak_a, ad_a), (zb, leak_b, ad_b) = prior(a), prior(b)
    assert za == zb and "reference networks" in za[1] and leak_a != leak_b
    assert ad_a["interval"] == ad_b["interval"] and ad_a["expected"] == ad_b["expected"]


def test_the_interval_factor_is_the_pooled_split_conformal_quantile():
    """Oracle: two library devices' score distributions stored as quantiles; the factor is the 90% quantile of the
    pooled scores (to the stored resolution), between the two devices' own 90% quantiles."""
    rng = np.random.default_rng(0)
    s1, s2 = rng.exponential(1.0, 20000), rng.exponential(2.0, 20000)
    lv = list(AP.SCORE_LEVELS)
    lib = [LT.make(0.0, np.ones((1, 2)), ("k3_e1", "skip"), space="s", device=f"d{i}", source="x",
                   adaptation={"learning_curve": {"networks": [5, 50], "mape_pct": [1, 1], "within_10pct": [1, 1],
                                                  "rms_rel": [1, 1], "score_levels": lv,
                                                  "score_percentiles": [np.quantile(s, lv).tolist()] * 2}})
           for i, s in enumerate((s1, s2))]
    z, how = LB.interval_factor(lib, 10)
    assert z == pytest.approx(np.quantile(np.concatenate([s1, s2]), 0.9), rel=0.03)
    assert np.quantile(s1, 0.9) < z < np.quantile(s2, 0.9) and "10 random networks" in how
    assert LB.interval_factor([t._replace(adaptation=None) for t in lib], 10) == (None, None)


def test_a_launch_bound_device_is_learned_from_a_library_that_has_none(shipped, data, pixel3):
    """Oracle: a device that costs 0.15 ms per kernel launched (3 per block, 4 per grouped block, 1 for the 1 x 1
    convolution of a skip where the layer changes the shape, FBNet's layers 1, 5, 9, 13, 17, 21, 0 for an identity)
    plus the Pixel 3's table x 0.01. The kernels table is built from the space alone; from 10 networks the adapted
    table predicts unseen ones to 1e-6, which no combination of the CPU and phone tables can."""
    kernels = AP.structural_tables(pixel3, "kernels")[0]
    skip = pixel3.op_names.index("skip")
    grouped = [i for i, n in enumerate(pixel3.op_names) if n.endswith("_g2")]
    assert grouped == [pixel3.op_names.index("k3_e1_g2"), pixel3.op_names.index("k5_e1_g2")]
    assert np.flatnonzero(kernels.entry_ms[:, skip]).tolist() == [1, 5, 9, 13, 17, 21]
    assert (kernels.entry_ms[[1, 5, 9, 13, 17, 21], skip] == 1).all() and kernels.const_ms == 0
    assert (kernels.entry_ms[:, grouped] == 4).all()
    assert (np.delete(kernels.entry_ms, grouped + [skip], axis=1) == 3).all()
    assert AP.structural_tables(pixel3, "none") == ()
    with pytest.raises(ValueError, match="'launch'"):
        AP.structural_tables(pixel3, "launch")
    rng = np.random.default_rng(0)
    archs = rng.integers(0, 9, (60, 22))
    truth = lambda a: 0.15 * LT.predict_ms(kernels, a) + 0.01 * LT.predict_ms(pixel3, a)
    sample = NW.make(archs[:10], truth(archs[:10]), pixel3.op_names, space=pixel3.space, device="gpu")
    lib = [shipped[d] for d in ("pixel3", "silver_4114", "samsung_a50")]
    got = AP.adapt_library(pixel3, sample, lib, stages=STAGES)
    np.testing.assert_allclose(LT.predict_ms(got, archs[10:]), truth(archs[10:]), rtol=1e-6)
    assert got.adaptation["weights"]["kernels (ms per kernel launched)"] == pytest.approx(0.15)
    old = AP.adapt_library(pixel3, sample, lib, stages=STAGES, structures=("none",))
    assert np.max(np.abs(LT.predict_ms(old, archs[10:]) / truth(archs[10:]) - 1)) > 0.01


def test_the_interval_is_per_network_from_the_jackknife_and_the_pooled_noise(shipped, data, pixel3):
    """The library model's interval: the fold tables it stores reproduce the leave-one-out errors its model choice
    scored (computed by another path, ``_loo``), the floor is the mean of the library tables' held-out RMS errors,
    the noise pools the residual over the 10 networks with the floor worth 2 (hand-computed), and the half-width
    z u(a) varies with the network, u(a) >= the noise, u(a)^2 - noise^2 the jackknife variance."""
    sample = H.measured(data, "titan_rtx_32", data["reference"])
    lib = [t for d, t in shipped.items() if d != "titan_rtx_32"]
    got = AP.adapt_library(pixel3, sample, lib, stages=STAGES)
    a, iv = got.adaptation, got.adaptation["interval"]
    assert not a["fallback"] and a["dropped"] == []
    jk = iv["jackknife"]
    assert len(jk["const_ms"]) == len(jk["entry_ms"]) == 10
    archs = NW.for_table(sample, pixel3)
    fold = [LT.make(c, np.array([[np.nan if v is None else v for v in r] for r in e]), pixel3.op_names,
                    space=pixel3.space, device="fold", source="fold") for c, e in zip(jk["const_ms"], jk["entry_ms"])]
    loo = [abs(LT.predict_ms(f, archs[k:k + 1])[0] - sample.ms[k]) / sample.ms[k] for k, f in enumerate(fold)]
    assert 100 * np.mean(loo) == pytest.approx(a["loo_mape_pct"], rel=1e-6)
    assert iv["floor_rel"] == pytest.approx(np.mean([t.validation["rms_error_pct"] for t in lib]) / 100)
    held = H.measured(data, "titan_rtx_32", range(4000, 4100))
    u = AP.relative_scale(got, held.archs)
    r, f = iv["residual_rel"], iv["floor_rel"]
    assert iv["noise_rel"] == pytest.approx(math.sqrt((10 * r * r + 2 * f * f) / 12), rel=1e-12)
    assert min(r, f) <= iv["noise_rel"] <= max(r, f)
    assert (u >= iv["noise_rel"] - 1e-12).all() and u.std() > 0
    k = np.array([[c + sum(e[l][o] or 0.0 for l, o in enumerate(a)) for a in held.archs]
                  for c, e in zip(jk["const_ms"], jk["entry_ms"])])                     # [folds, networks]
    jack2 = 9 / 10 * ((k - k.mean(axis=0)) ** 2).sum(axis=0) / LT.predict_ms(got, held.archs) ** 2
    np.testing.assert_allclose(u ** 2, jack2 + iv["noise_rel"] ** 2, rtol=1e-9)
    old = got._replace(adaptation={**a, "interval": {k_: v for k_, v in iv.items() if k_ != "noise_rel"}})
    np.testing.assert_allclose(AP.relative_scale(old, held.archs) ** 2, jack2 + r * r + f * f, rtol=1e-9)
    lo, hi = AP.interval_ms(got, held.archs)
    p = LT.predict_ms(got, held.archs)
    np.testing.assert_allclose(hi / p - 1, iv["factor"] * u, rtol=1e-9)
    np.testing.assert_allclose(1 - lo / p, iv["factor"] * u, rtol=1e-9)


def test_a_dropped_outlier_widens_the_interval_it_did_not_bend():
    """A measured network far off every other is left out of the fit but counted, at 15%, in the residual: the
    residual is the RMS of the kept networks' errors and the 15% cap."""
    rng = np.random.default_rng(11)
    n, r = 6, 3
    ops = ("k3_e1", "k5_e3", "skip")
    lib = [LT.make(0.5, rng.uniform(0.5, 2, (n, r)), ops, space="toy", device=f"dev{i}", source="r")
           for i in range(3)]
    base = LT.make(0.5, rng.uniform(0.5, 2, (n, r)), ops, space="toy", device="base", source="r")
    archs = rng.integers(0, r, (12, n))
    truth = 0.7 * LT.predict_ms(lib[0], archs) + 0.4 * LT.predict_ms(lib[2], archs)
    y = truth * (1 + rng.normal(0, 0.005, len(truth)))
    y[3] *= 1.9
    m = NW.make(archs, y, ops, space="toy", device="target")
    got = AP.adapt_library(base, m, lib)
    a = got.adaptation
    assert a["dropped"] == [3] and not a["fallback"]
    p = LT.predict_ms(got, archs)
    e = np.minimum(np.abs(y - p) / p, AP.OUTLIER_REL)
    assert e[3] == AP.OUTLIER_REL
    assert a["interval"]["residual_rel"] == pytest.approx(np.sqrt(np.mean(e ** 2)))


def test_fallback_off_keeps_the_library_model(pixel3):
    """``fallback=False`` (how the library's curves calibrate the interval): where the rescale would be used, the
    library's model is kept all the same, with its per-network interval, and says so."""
    lib, m = _unrelated_library_and_a_rescaled_target(pixel3)
    assert AP.adapt_library(pixel3, m, lib, stages=STAGES).adaptation["fallback"]
    kept = AP.adapt_library(pixel3, m, lib, stages=STAGES, fallback=False)
    assert not kept.adaptation["fallback"] and "fallback=False" in kept.adaptation["why"]
    assert "jackknife" in kept.adaptation["interval"] and "±" in AP.describe_interval(kept.adaptation["interval"])
