"""SplitNets as a system (jmsnas.splitnets): split module, init, views, HMD costs, search limits, CLI."""
from __future__ import annotations

import itertools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyrun
from jmsnas import cli, tensorboard, train
from jmsnas.run import evolution as RE
from jmsnas.cost.memory import peak_memory_bytes
from jmsnas.pipeline import ConfigError
from jmsnas.splitnets import hardware as H
from jmsnas.splitnets import module as SM
from jmsnas.splitnets import net as N
from jmsnas.splitnets import search as S
from jmsnas.splitnets import views as VW
from jmsnas.splitnets.space import SplitArch, SplitSpace

from paths import REPO as ROOT

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 81 -> 70 s of test time, AVX2 EPYC, 2 cores

SINGLE = os.path.join(ROOT, "experiments", "configs", "splitnets_single.py")
MULTI = os.path.join(ROOT, "experiments", "configs", "splitnets_multiview.py")
HMD_FILE = os.path.join(ROOT, "experiments", "topologies", "splitnets_hmd.yaml")


def tiny_space(views=1, **kw):
    base = dict(image_size=4, in_channels=1, num_classes=3, views=views, stem_channels=4, phase_channels=(8, 16),
                phase_strides=(1, 2), max_depth=2, kernels=(3,), expands=(3,), reductions=(2, 4), head_channels=8)
    return SplitSpace(**{**base, **kw})


# ----------------------------------------------------------------------------------------------- module / init

def test_init_variance_formula_by_hand():
    # Table 3 with k = 3, c_in = 32, c_out = 4
    assert SM.init_variance(3, 32, 4, "fan_in") == pytest.approx(2 / (9 * 32))
    assert SM.init_variance(3, 32, 4, "fan_out") == pytest.approx(2 / (9 * 4))
    assert SM.init_variance(3, 32, 4, "geometric") == pytest.approx(2 / (9 * math.sqrt(128)))
    # the geometric variance lies between the two Kaiming ones, and equals them when c_in == c_out
    assert SM.init_variance(1, 16, 16, "geometric") == pytest.approx(SM.init_variance(1, 16, 16, "fan_in"))
    with pytest.raises(ValueError, match="unknown split-module init 'xavier'"):
        SM.init_variance(1, 4, 2, "xavier")


@pytest.mark.parametrize("views", [1, 4])
def test_init_samples_have_the_formula_variance(views):
    c, d, k = 64, 16, 3
    p = SM.init(jax.random.PRNGKey(0), c, d, views, kernel=k, mode="geometric")
    np.testing.assert_allclose(np.var(np.asarray(p["reduce"])), 2 / (k * k * math.sqrt(c * d)), rtol=0.05)
    agg = p["recover"] if views == 1 else p["fuse"]
    assert agg.shape == (k, k, views * d, c)
    np.testing.assert_allclose(np.var(np.asarray(agg)), 2 / (k * k * math.sqrt(views * d * c)), rtol=0.05)


def test_reduction_must_send_fewer_channels():
    with pytest.raises(ValueError) as e:
        SM.init(jax.random.PRNGKey(0), 8, 8)
    assert "d = 8 must be smaller than c = 8" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="reduction 1: d = 8 must be smaller than c = 8"):
        tiny_space(reductions=(1, 2))
    with pytest.raises(ValueError, match="views must be an integer >= 1, got 0"):
        tiny_space(views=0)


@pytest.mark.slow
def test_module_shapes_mask_and_fuse_is_a_concatenation():
    c, dm, V, B, s = 8, 4, 3, 2, 5
    p = SM.init(jax.random.PRNGKey(1), c, dm, V)
    x = jax.random.normal(jax.random.PRNGKey(2), (B * V, s, s, c))
    z = SM.reduce(p, x, 2)
    assert z.shape == (B * V, s, s, dm)
    assert np.all(np.asarray(z[..., 2:]) == 0) and np.any(np.asarray(z[..., :2]) != 0)
    y = SM.fuse(p, z, V)
    assert y.shape == (B, s, s, c)
    zz = np.asarray(z).reshape(B, V, s, s, dm)
    cat = np.concatenate([zz[:, v, ..., :2] for v in range(V)], axis=-1)  # V * d channels, view-major
    w = np.asarray(p["fuse"])[0, 0]
    rows = np.concatenate([np.arange(2) + v * dm for v in range(V)])
    np.testing.assert_allclose(np.asarray(y), cat @ w[rows], rtol=1e-4, atol=1e-5)
    p1 = SM.init(jax.random.PRNGKey(1), c, dm, 1)
    assert SM.apply(p1, x[:B], 3).shape == (B, s, s, c)


# ----------------------------------------------------------------------------------------------- space / supernet

def test_genes_decode_encode_and_clamp():
    sp = tiny_space()
    g = sp.extreme(True)
    a = sp.decode(g)
    assert a == SplitArch(((0, 0), (0, 0)), (2, 2), (1, 2), 8) and list(sp.encode(a)) == list(g)
    g2 = g.copy()
    g2[4:6] = 0  # depth 1 in both phases: the split offset 2 is clamped to 1
    assert sp.decode(g2).split == (1, 1)
    with pytest.raises(ValueError, match="not a valid architecture"):
        sp.decode(np.full(sp.num_genes, 7))


def _module_grads(sp, genes, extras):
    params, state = N.init(jax.random.PRNGKey(0), sp)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, sp.views, 4, 4, 1))
    g = _grad_fn(sp)(params, state, jnp.asarray(genes), x, extras)
    return [{k: float(jnp.abs(v).sum()) for k, v in m.items()} for m in g["modules"]]


def _grad_fn(sp, cache={}):
    if sp not in cache:
        loss = lambda p, st, g, x, ex: jnp.sum(N.apply(sp, p, st, g, x, train=True, extras=ex)[0] ** 2)
        cache[sp] = jax.jit(jax.grad(loss))
    return cache[sp]


@pytest.mark.slow
def test_split_module_gating_single_view():
    """Exactly one module at search (only the split phase's phi and phi' get gradients, both of them); with
    training-time extras the other phase's module is active too, again phi with phi'."""
    sp = tiny_space()
    g = sp.extreme(True).copy()
    g[-3] = 0  # split in phase 0
    one = _module_grads(sp, g, jnp.zeros(2))  # no extra modules: the searched network
    assert one[0]["reduce"] > 0 and one[0]["recover"] > 0
    assert one[1]["reduce"] == 0 and one[1]["recover"] == 0
    both = _module_grads(sp, g, jnp.ones(2))
    assert all(m["reduce"] > 0 and m["recover"] > 0 for m in both)


@pytest.mark.slow
def test_multiview_forward_shapes_and_view_order_matters():
    sp = tiny_space(views=2)
    assert not sp.shared
    params, state = N.init(jax.random.PRNGKey(0), sp)
    assert "aggregator" in params and "fuse" in params["modules"][0]
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 4, 4, 1))
    f = jax.jit(lambda x: N.apply(sp, params, state, jnp.asarray(sp.extreme(False)), x, train=False)[0])
    y = f(x)
    assert y.shape == (3, 3) and np.all(np.isfinite(np.asarray(y)))
    assert not np.allclose(np.asarray(y), np.asarray(f(x[:, ::-1])))  # concatenation keeps the views apart


# ----------------------------------------------------------------------------------------------- hardware

def test_bus_sharing_latency_by_hand():
    # 1000 bytes per sensor, 1.2 Gbit/s shared by 4: each at 300 Mbit/s -> 1000 * 8 / 300e6 s = 26.67 us
    assert H.comm_ms(1000, 1200.0, 4) == pytest.approx(1000 * 8 / 300e6 * 1e3)
    assert H.comm_ms(1000, 1200.0, 4) == pytest.approx(4 * H.comm_ms(1000, 1200.0, 1))
    for V in (1, 4):
        sp = tiny_space(views=V)
        a = SplitArch(((0, 0), (0, 0)), (2, 1), (1, 1), 4)  # phase 1 is 2 x 2: d * 4 values of 8 bits
        c = H.cost(sp, a, H.hmd(V))
        assert c.bytes_per_sensor == 4 * 4 and c.bus_bytes == 16 * V
        assert c.comm_ms == pytest.approx(16 * 8 / (1200e6 / V) * 1e3)
        assert c.total_ms == pytest.approx(c.sensor_ms + c.comm_ms + c.aggregator_ms)
        # the sensor's peak memory is the DAG peak of exactly the on-sensor layers at 8 bits
        assert c.sensor_peak_bytes == peak_memory_bytes(c.sensor_net, list(range(len(c.sensor_net.layers))), 8, 8)
        assert c.sensor_net.layers[-1].out_shape == (2, 2, 4)  # Conv-Reduce is the last sensor layer
    with pytest.raises(ValueError, match="4 views but the hardware has 1 sensors"):
        H.cost(tiny_space(views=4), a, H.hmd(1))


def test_hardware_from_the_hmd_topology_file():
    from jmsnas.configs import apply_overrides, load_config

    cfg = S.with_defaults(apply_overrides(load_config(MULTI), ["--config.splitnets.topology=" + HMD_FILE]))
    hw = S.hardware(cfg)
    assert (hw.num_sensors, hw.bus_mbps, hw.sensor_memory_bytes) == (4, 1200.0, 2 * 1024 ** 2)
    assert hw.sensor.peak_gflops == 250 and hw.aggregator.peak_gflops == 2500


def test_split_module_cuts_bus_bytes_against_no_module():
    sp = tiny_space(views=4)
    for p, m in sp.positions:
        for d in sp.d_choices(p):
            a = SplitArch(((0, 0), (0, 0)), (2, 2), (p, m), d)
            with_m, without = H.cost(sp, a, H.hmd(4)), H.cost(sp, a, H.hmd(4), "none")
            s, c = sp.phase_hw(p), sp.phase_channels[p]
            assert (with_m.bus_bytes, without.bus_bytes) == (4 * d * s * s, 4 * c * s * s)
            assert with_m.comm_ms < without.comm_ms


def test_reachable_minimum_is_the_brute_force_minimum():
    sp = tiny_space(kernels=(3, 5), reductions=(2, 4))
    hw = H.hmd(1, sensor_memory_bytes=3000.0)
    mask = sp.mask()
    lat, mem, lat_ok = [], [], []
    for g in itertools.product(*[np.flatnonzero(row) for row in mask]):
        c = H.cost(sp, sp.decode(np.array(g)), hw)
        lat.append(c.total_ms)
        mem.append(c.sensor_peak_bytes)
        if c.sensor_peak_bytes <= hw.sensor_memory_bytes:
            lat_ok.append(c.total_ms)
    r = S.reachable(sp, hw)
    assert r.min_latency_ms == pytest.approx(min(lat)) and r.min_memory_bytes == min(mem)
    assert r.min_latency_within_memory_ms == pytest.approx(min(lat_ok))
    c = H.cost(sp, sp.decode(r.fastest_within_memory), hw)  # the evolution's fallback
    assert c.total_ms == pytest.approx(r.min_latency_within_memory_ms) and c.sensor_peak_bytes <= 3000.0
    with pytest.raises(ConfigError, match=f"below the smallest sensor peak memory of this space, {min(mem):.0f} "):
        S.check_limits(sp, hw._replace(sensor_memory_bytes=min(mem) - 1.0), 1.0)
    with pytest.raises(ConfigError, match="below the smallest end-to-end latency reachable"):
        S.check_limits(sp, hw, min(lat_ok) * 0.99)


# ----------------------------------------------------------------------------------------------- views

def test_views_are_partial_and_cover_the_image():
    assert VW.view_origins(8, 6, 4) == ((2, 2), (2, 0), (0, 0), (0, 2))
    img = np.arange(64, dtype=np.float32).reshape(1, 8, 8, 1)
    v = VW.make_views(img, VW.view_origins(8, 6, 4), 6)
    assert v.shape == (1, 4, 6, 6, 1)
    seen = [set(v[0, i].ravel().tolist()) for i in range(4)]
    assert all(len(s) < 64 for s in seen) and set().union(*seen) == set(range(64))
    with pytest.raises(ValueError, match="views must be an integer >= 1"):
        VW.view_origins(8, 6, 0)
    with pytest.raises(ValueError, match=r"view_size must be an integer in \[1, 8\]"):
        VW.view_origins(8, 9, 2)


@pytest.mark.slow
def test_views_over_tfds(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=12):
        ds = VW.load("cifar10", views=4, view_size=24, data_dir=str(tmp_path), max_train=10)
    assert ds.train.images.shape == (10, 4, 24, 24, 3) and ds.test.images.shape == (12, 4, 24, 24, 3)
    assert ds.views == 4 and ds.num_classes == 10 and ds.image_size == 24
    assert ds.origins == VW.view_origins(32, 24, 4)


# ----------------------------------------------------------------------------------------------- CLI

def _run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("override,expected", [
    ("--config.splitnets.views=0", "splitnets.views must be an integer >= 1"),
    ("--config.splitnets.reductions=[1,2]", "d = 8 must be smaller than c = 8"),
    ("--config.splitnets.sensor_memory_bytes=1000", "below the smallest sensor peak memory of this space, "),
    ("--config.t_const_ms=0.0000001", "below the smallest end-to-end latency reachable"),
    ("--config.splitnets.topology=" + HMD_FILE, "splitnets.views=1 does not match topology"),
])
def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys, override, expected):
    work = tmp_path / "w"
    code, _, err = _run(["evolve", "--config", SINGLE + ":tiny", "--workdir", str(work), "--no-progress",
                         override], capsys)
    assert code == 2 and expected in err and err.count("\n") == 1
    assert not work.exists()


@pytest.mark.slow
def test_evolve_cli_single_view_meets_both_limits(tmp_path, capsys):
    work = tmp_path / "run"
    # limits that cut the space: about half of the random networks break the memory or the latency limit
    code, out, err = _run(["evolve", "--config", SINGLE + ":tiny", "--workdir", str(work), "--no-progress",
                           "--config.splitnets.sensor_memory_bytes=9000", "--config.t_const_ms=0.0015"], capsys)
    assert code == 0, err
    res = json.loads((work / "result.json").read_text())
    tinyrun.assert_common_top_level(res, "splitnets")
    sn = res["splitnets"]
    assert res["latency_ms"]["total"] <= 0.0015 and sn["sensor_peak_memory_bytes"] <= 9000
    assert res["budget"]["met"] and res["memory"]["met"]
    assert sn["d"] < sn["c"] and sn["bus_bytes"] < sn["bus_bytes_without_module"]
    assert sn["blocks_on_sensor"] >= 1 and set(res["latency_ms"]["per_device"]) == {"sensor", "aggregator"}
    evo = json.loads((work / "evolution.json").read_text())
    if evo["best"]:
        assert evo["best"]["latency_ms"] <= 0.0015 and evo["best"]["sensor_peak_bytes"] <= 9000
    for f in ("history.png", "latency_breakdown.png", "architecture.png", "parts/sensor.npz",
              "parts/aggregator.npz", "parts/manifest.json"):
        assert (work / f).exists(), f
    scalars, images = tensorboard.read(str(work))  # TensorBoard: epochs, generations, the result, its figures
    names = {"train/loss", "val/accuracy", "val/accuracy_smallest", "evolution/fitness_best",
             "evolution/sensor_peak_max_bytes", "result/latency/device/sensor_ms",
             "result/latency/link/sensor_to_aggregator_ms", "memory/sensor_peak_bytes", "result/accuracy/test"}
    assert names <= set(scalars), sorted(names - set(scalars))
    assert scalars["memory/sensor_peak_bytes"][0][1] == pytest.approx(sn["sensor_peak_memory_bytes"])
    assert images == ["figures/architecture", "figures/history", "figures/latency_breakdown"]
    man = json.loads((work / "parts" / "manifest.json").read_text())
    sensor = np.load(work / "parts" / "sensor.npz")
    assert sensor["params/reduce"].shape[-1] == sn["d"] and man["split"]["d"] == sn["d"]


@pytest.mark.slow
@pytest.mark.parametrize("seed,quantile", [(0, 50), (2, 0.5)])
def test_evolution_never_returns_a_network_over_either_limit(monkeypatch, seed, quantile):
    """Evolution with a stand-in accuracy (a fixed hash of the genes, larger networks favoured) under limits at a
    quantile of the space's latencies and memories; the tightest leaves only a few networks (fallback path)."""
    from jmsnas.configs import apply_overrides, load_config
    from jmsnas.strategies.base import sample_valid

    sp = tiny_space(kernels=(3, 5), expands=(3, 6))
    pop = np.asarray(sample_valid(jax.random.PRNGKey(9), jnp.asarray(sp.mask()), 400))
    lat, mem = S.CostCache(sp, H.hmd(1)).arrays(pop)
    limit = max(float(np.percentile(mem, quantile)), S.reachable(sp, H.hmd(1)).min_memory_bytes)
    hw = H.hmd(1, sensor_memory_bytes=limit)
    t_const = max(float(np.percentile(lat, quantile)), S.reachable(sp, hw).min_latency_within_memory_ms * 1.001)
    S.check_limits(sp, hw, t_const)  # what the flow checks before it trains
    cfg = S.with_defaults(apply_overrides(load_config(SINGLE + ":tiny"), [f"--config.seed={seed}",
                                                                          f"--config.t_const_ms={t_const}"]))
    cfg.evolve.population, cfg.evolve.generations = 16, 3
    fake = lambda space, params, genes, calib, x, y: np.array(
        [(hash(tuple(int(v) for v in g)) % 97) / 97 + 0.01 * float(np.sum(g)) for g in np.asarray(genes)])
    monkeypatch.setattr(S, "population_accuracy", fake)
    costs = S.CostCache(sp, hw)
    problem = S.problem(cfg, sp, costs, RE.FitnessData(None, np.zeros(8), None))
    _, best, _ = RE.evolve_population(cfg, problem, train.SupernetState(*[None] * 5), None, "", False, False)
    genes, _ = S.winner(sp, hw, best)
    c = costs(genes)
    assert c.total_ms <= t_const + 1e-12 and c.sensor_peak_bytes <= limit
    if best is not None:
        assert best["latency_ms"] <= t_const + 1e-12 and best["sensor_peak_bytes"] <= limit
