"""The searched split: the exact chain DP inside the step against enumeration of every contiguous split."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import gates, train
from jmsnas.topology import presets
from jmsnas.cost import latency, tables
from jmsnas.space import build_space


def _space():
    topo = presets.chain_preset((2, 2, 1, 1))
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12, 16, 24),
                       device_strides=(1, 2, 1, 2))


def _all_contiguous(n, m):
    for counts in itertools.product(range(n + 1), repeat=m):
        if sum(counts) == n:
            yield np.repeat(np.arange(m), counts)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bandwidth_scale", [1.0, 1e4])
def test_best_split_equals_enumeration(seed, bandwidth_scale):
    sp = _space()
    table = tables.analytic_table(sp)
    table = table._replace(bandwidth_mbps=table.bandwidth_mbps * bandwidth_scale)
    rng = np.random.default_rng(seed)
    probs = gates.probabilities(jnp.asarray(rng.normal(size=sp.mask().shape) * 2), sp.mask())
    lat, assignment = latency.searched_latency(sp, table, probs)
    splits = jnp.asarray(np.stack(list(_all_contiguous(sp.num_layers, 4))))
    totals = jax.jit(jax.vmap(lambda a: latency.chain_latency(sp, table, probs, a).total))(splits)
    assert float(lat.total) == pytest.approx(float(totals.min()), rel=1e-6)
    assert np.all(np.diff(np.asarray(assignment)) >= 0), "contiguous along the chain"
    fixed = float(latency.chain_latency(sp, table, probs).total)
    assert float(lat.total) <= fixed + 1e-6


def test_fast_links_move_layers_off_the_ue():
    sp = _space()
    table = tables.analytic_table(sp)
    fast = table._replace(bandwidth_mbps=table.bandwidth_mbps * 1e6)
    probs = gates.probabilities(jnp.zeros(sp.mask().shape), sp.mask())
    _, slow_split = latency.searched_latency(sp, table, probs)
    _, fast_split = latency.searched_latency(sp, fast, probs)
    assert np.all(np.asarray(slow_split) == 0)  # 25 Mbit/s: keep everything on the UE
    assert np.all(np.asarray(fast_split) == 3)  # free links: the V100 cloud runs everything


def test_searched_step_latency_gradient_is_that_of_the_chosen_split():
    sp = _space()
    table = tables.analytic_table(sp)
    alpha = jnp.asarray(np.random.default_rng(0).normal(size=sp.mask().shape), jnp.float32)
    g = jax.grad(lambda a: train.step_latency(sp, table, a, "searched"))(alpha)
    assignment = latency.best_chain_assignment(sp, table, gates.probabilities(alpha, sp.mask()))
    g_fixed = jax.grad(lambda a: latency.chain_latency(sp, table, gates.probabilities(a, sp.mask()),
                                                       assignment).total)(alpha)
    np.testing.assert_allclose(g, g_fixed, rtol=1e-6, atol=1e-9)
    assert np.all(np.isfinite(g)) and np.any(g != 0)


def test_searched_split_rejects_a_mesh():
    sp = build_space(presets.mesh_preset((1,) * 6), image_size=8, in_channels=1, num_classes=10,
                     device_channels=(8,) * 6, device_strides=(1,) * 6)
    with pytest.raises(ValueError, match="chain"):
        latency.best_chain_assignment(sp, tables.analytic_table(sp), jnp.ones(sp.mask().shape) / 13)
    with pytest.raises(ValueError, match="split"):
        train.step_latency(sp, tables.analytic_table(sp), jnp.zeros(sp.mask().shape), "sometimes")
