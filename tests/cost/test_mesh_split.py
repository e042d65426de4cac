"""The searched split on a mesh (eq. (2)): exact against enumeration, with and without memory limits."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jmsnas import budget, limits as L
from jmsnas.cost.latency import arch_latency, best_mesh_assignment, mesh_latency, mesh_segments
from jmsnas.cost.tables import analytic_table, from_compute
from jmsnas.gates import probabilities
from jmsnas.space import build_space
from jmsnas.topology import DeviceProfile, LinkProfile, make_topology


def _mesh(n_pre, n_branch, n_post, lpd, bws, mems):
    names = [f"p{i}" for i in range(n_pre)] + ["root"] + [f"b{i}" for i in range(n_branch)] + \
            [f"q{i}" for i in range(n_post)]
    devs = [DeviceProfile(n, 10.0, mem, active_power_w=1.0) for n, mem in zip(names, mems)]
    chain_a = [f"p{i}" for i in range(n_pre)] + ["root"]
    post = [f"q{i}" for i in range(n_post)]
    pairs = list(zip(chain_a, chain_a[1:])) + [("root", f"b{i}") for i in range(n_branch)] + \
        [(f"b{i}", post[0]) for i in range(n_branch)] + list(zip(post, post[1:]))
    links = [LinkProfile(a, b, bw, 0.1, False, 1.0, 1.0) for (a, b), bw in zip(pairs, bws)]
    topo = make_topology("m", devs, links, lpd[:len(names)])
    m = len(names)
    ch = tuple(8 if d.startswith(("p", "root")) else 12 for d in names)
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=ch,
                       device_strides=(1,) * m, stem_channels=8, head_channels=8)


def _all_splits(space):
    """Every assignment of the MeshSegments family."""
    seg = mesh_segments(space)
    dev = space.layer_devices()

    def contiguous(devices, n):
        for cuts in itertools.combinations_with_replacement(range(n + 1), len(devices) - 1):
            yield np.repeat(devices, np.diff((0,) + cuts + (n,)))

    for a in contiguous(seg.prefix_devices, seg.prefix):
        for b in contiguous(seg.post, space.num_layers - seg.suffix_start):
            yield np.concatenate([a, dev[seg.prefix:seg.suffix_start], b]).astype(np.int32)


@pytest.mark.slow
@settings(max_examples=5, deadline=None)
@given(st.integers(0, 1), st.integers(2, 3), st.integers(1, 2), st.lists(st.integers(1, 2), min_size=8, max_size=8),
       st.lists(st.floats(1.0, 200.0), min_size=12, max_size=12), st.integers(0, 2 ** 31 - 1))
def test_mesh_searched_split_equals_enumeration(n_pre, n_branch, n_post, lpd, bws, seed):
    rng = np.random.default_rng(seed)
    n_dev = n_pre + 1 + n_branch + n_post
    space = _mesh(n_pre, n_branch, n_post, lpd, bws, [1e12] * n_dev)
    t0 = analytic_table(space)
    table = from_compute(space, rng.uniform(0.0, 2.0, t0.compute_ms.shape), rng.uniform(0, 0.5, n_dev),
                         rng.uniform(0, 0.5, n_dev))
    mask = space.mask()
    ops = np.array([rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)], np.int32)
    splits = list(_all_splits(space))
    lat = jax.jit(jax.vmap(lambda a: arch_latency(space, table, ops, a).total))
    t = np.asarray(lat(jnp.asarray(np.stack(splits))), np.float64)
    onehot = jax.nn.one_hot(ops, 13)
    best = np.asarray(best_mesh_assignment(space, table, onehot))
    np.testing.assert_allclose(float(arch_latency(space, table, ops, best).total), t.min(), rtol=1e-5, atol=1e-5)
    lim = L.device_limits(space)
    free = L.best_split(space, table, lim, ops)
    np.testing.assert_allclose(float(arch_latency(space, table, ops, free).total), t.min(), rtol=1e-5, atol=1e-5)
    # memory limits: a random device limit between what the splits need; exact among the splits that fit
    usage = [L.usage(space, table, lim, ops, a)[0].total for a in splits]
    m = int(rng.integers(n_dev))
    mems = lim.memory_bytes.copy()
    mems[m] = float(rng.uniform(min(u[m] for u in usage), max(u[m] for u in usage) + 1))
    lim = lim._replace(memory_bytes=mems)
    fits = np.array([L.within_limits(space, table, lim, ops, a) for a in splits])
    got = L.best_split(space, table, lim, ops)
    if not fits.any():
        assert got is None
    else:
        assert L.within_limits(space, table, lim, ops, got)
        np.testing.assert_allclose(float(arch_latency(space, table, ops, got).total), t[fits].min(), rtol=1e-5,
                                   atol=1e-5)


def test_assigned_path_equals_the_fixed_one_at_d_m():
    space = _mesh(1, 3, 2, [2] * 8, [25, 50, 50, 50, 200, 200, 200, 100], [1e12] * 7)
    table = analytic_table(space)
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), space.mask().shape))
    a, b = mesh_latency(space, table, probs), mesh_latency(space, table, probs, space.layer_devices())
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_repair_under_a_mesh_split_equals_enumeration():
    space = _mesh(0, 2, 2, [1, 1, 1, 1, 1], [20, 20, 20, 20, 20, 100], [1e12] * 5)
    table = analytic_table(space)
    mask = space.mask()
    a = space.layer_devices().copy()
    a[-2:] = space.topology.post[-1]  # the aggregator relays; the last device runs both suffix layers
    alpha = jax.random.normal(jax.random.PRNGKey(1), mask.shape)
    archs = np.array(list(itertools.product(*[np.flatnonzero(mask[n]) for n in range(space.num_layers)])), np.int32)
    t = np.asarray(jax.jit(jax.vmap(lambda o: arch_latency(space, table, o, a).total))(jnp.asarray(archs)))
    cost = -np.log(np.asarray(probabilities(alpha, jnp.asarray(mask)), np.float64))[
        np.arange(space.num_layers), archs].sum(1)
    t_const = float(np.quantile(t, 0.3))
    fix = budget.repair(space, table, alpha, archs[np.argmin(cost)], t_const, a)
    ok = budget.within(t, t_const)
    got = -np.log(np.asarray(probabilities(alpha, jnp.asarray(mask)), np.float64))[
        np.arange(space.num_layers), fix.ops].sum()
    np.testing.assert_allclose(got, cost[ok].min(), rtol=1e-9)


@pytest.mark.slow
def test_searched_step_latency_on_a_mesh_is_the_best_split_of_e_tau():
    from jmsnas import train
    space = _mesh(1, 2, 2, [1] * 6, [25, 50, 50, 200, 200, 100], [1e12] * 6)
    table = analytic_table(space)
    alpha = jax.random.normal(jax.random.PRNGKey(2), space.mask().shape)
    probs = probabilities(alpha, jnp.asarray(space.mask()))
    t = min(float(mesh_latency(space, table, probs, a).total) for a in _all_splits(space))
    got = jax.jit(lambda a: train.step_latency(space, table, a, "searched"))(alpha)
    np.testing.assert_allclose(float(got), t, rtol=1e-6)
    g = jax.grad(lambda a: train.step_latency(space, table, a, "searched"))(alpha)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0
