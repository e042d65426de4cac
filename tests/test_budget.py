"""The budget repair against brute-force enumeration of every architecture of tiny spaces."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import budget, gates
from jmsnas.cost import latency, tables
from jmsnas.topology.presets import device
from jmsnas.space import build_space
from jmsnas.topology import LinkProfile, chain, make_topology


def _chain_space():
    devs = [device("raspberry_pi4", "ue"), device("jetson_agx_xavier", "mbs"), device("server_v100", "cloud")]
    topo = chain("c3", devs, [25.0, 200.0], [2, 1, 1])
    return build_space(topo, image_size=16, in_channels=1, num_classes=10, device_channels=(8, 12, 16),
                       device_strides=(2, 2, 2), stem_channels=8)


def _mesh_space():
    names = ["ue", "root", "b1", "b2", "agg"]
    kinds = ["raspberry_pi4", "xps15_rtx3050", "jetson_agx_xavier", "raspberry_pi4", "server_v100"]
    devs = [device(k, n) for k, n in zip(kinds, names)]
    links = [LinkProfile("ue", "root", 25.0), LinkProfile("root", "b1", 50.0), LinkProfile("root", "b2", 40.0),
             LinkProfile("b1", "agg", 200.0), LinkProfile("b2", "agg", 100.0)]
    topo = make_topology("m5", devs, links, [1, 1, 1, 1, 1])
    return build_space(topo, image_size=32, in_channels=1, num_classes=10, device_channels=(8, 12, 16, 16, 24),
                       device_strides=(2, 2, 2, 2, 2), stem_channels=8)


def _enumerate(sp, table, alpha):
    mask = sp.mask()
    combos = np.array(list(itertools.product(*[np.flatnonzero(mask[n]) for n in range(sp.num_layers)])), np.int32)
    t = np.asarray(jax.jit(jax.vmap(lambda o: latency.arch_latency(sp, table, o).total))(jnp.asarray(combos)))
    with np.errstate(divide="ignore"):  # masked candidates have p = 0
        logp = np.log(np.asarray(gates.probabilities(alpha, mask), np.float64))
    cost = -logp[np.arange(sp.num_layers)[None], combos].sum(1)
    return combos, t, cost


@pytest.mark.parametrize("make", [_chain_space, _mesh_space], ids=["chain", "mesh"])
@pytest.mark.parametrize("seed", [0, 1])
def test_repair_is_the_cheapest_feasible_architecture(make, seed):
    sp = make()
    table = tables.analytic_table(sp)
    alpha = jnp.asarray(np.random.default_rng(seed).normal(size=sp.mask().shape) * 2, jnp.float32)
    combos, t, cost = _enumerate(sp, table, alpha)
    slowest = combos[np.argmax(t)]
    assert t.max() > t.min() * 1.01, "the space must offer a latency range"
    for q in (0.05, 0.3, 0.7):
        t_const = float(np.quantile(t, q))
        r = budget.repair(sp, table, alpha, slowest, t_const)
        assert r.repaired and r.feasible
        assert r.latency_ms <= t_const + 1e-6
        assert r.latency_ms == pytest.approx(float(latency.arch_latency(sp, table, r.ops).total), rel=1e-6)
        ok = t <= t_const + 1e-6
        got = cost[np.flatnonzero((combos == r.ops).all(1))[0]]
        assert got == pytest.approx(cost[ok].min(), rel=1e-5, abs=1e-5)
        assert r.min_latency_ms == pytest.approx(t.min(), rel=1e-5)


@pytest.mark.parametrize("make", [_chain_space, _mesh_space], ids=["chain", "mesh"])
def test_infeasible_budget_reports_the_fastest(make):
    sp = make()
    table = tables.analytic_table(sp)
    alpha = jnp.zeros(sp.mask().shape)
    combos, t, _ = _enumerate(sp, table, alpha)
    r = budget.repair(sp, table, alpha, combos[np.argmax(t)], float(t.min()) * 0.9)
    assert not r.feasible
    assert r.min_latency_ms == pytest.approx(t.min(), rel=1e-5)
    assert r.latency_ms == pytest.approx(t.min(), rel=1e-5)


def test_architecture_within_budget_is_kept():
    sp = _chain_space()
    table = tables.analytic_table(sp)
    alpha = jnp.zeros(sp.mask().shape)
    combos, t, _ = _enumerate(sp, table, alpha)
    fast = combos[np.argmin(t)]
    r = budget.repair(sp, table, alpha, fast, float(t.max()))
    assert not r.repaired and r.feasible
    np.testing.assert_array_equal(r.ops, fast)
