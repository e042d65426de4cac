"""Device limits (memory, energy) in the repair and the boundary check: exact against enumeration."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import budget, limits as L
from jmsnas.cost.energy import energy
from jmsnas.cost.latency import arch_latency
from jmsnas.cost.tables import analytic_table, from_compute
from jmsnas.gates import probabilities
from jmsnas.space import build_space
from jmsnas.topology import DeviceProfile, LinkProfile, chain, make_topology


def _space(kind, ue_mem=1e9, ue_budget=None):
    ue = DeviceProfile("ue", 5.0, ue_mem, efficiency=0.5, active_power_w=5.0, energy_budget_mj=ue_budget)
    if kind == "chain":
        devs = [ue, DeviceProfile("edge", 50.0, 1e9, active_power_w=20.0), DeviceProfile("cloud", 500.0, 1e9)]
        topo = make_topology("c", devs, [LinkProfile("ue", "edge", 20.0, 0.0, True, 2.0, 3.0),
                                         LinkProfile("edge", "cloud", 100.0)], (2, 1, 1))
        ch, st = (8, 12, 16), (1, 2, 1)  # 6 x 13 x 6 x 6 = 2808 architectures
    else:
        names = ["r", "b1", "b2", "agg"]
        devs = [ue] + [DeviceProfile(n, 40.0, 1e9, active_power_w=10.0) for n in names]
        links = [LinkProfile(a, b, 20.0, 0.0, False, 1.0, 1.0)
                 for a, b in [("ue", "r"), ("r", "b1"), ("r", "b2"), ("b1", "agg"), ("b2", "agg")]]
        topo = make_topology("m", devs, links, (1, 1, 1, 1, 1))
        ch, st = (8, 12, 16, 16, 24), (1, 2, 1, 1, 1)  # every layer changes shape: 6^5 = 7776 architectures
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=ch, device_strides=st,
                       stem_channels=4, head_channels=8)


def _brute(space, table, lim, alpha, t_const):
    mask = space.mask()
    archs = np.array(list(itertools.product(*[np.flatnonzero(mask[n]) for n in range(space.num_layers)])), np.int32)
    logp = np.log(np.asarray(probabilities(alpha, jnp.asarray(mask)), np.float64))
    cost = -logp[np.arange(space.num_layers), archs].sum(1)
    oh = jax.nn.one_hot(jnp.asarray(archs), mask.shape[1])
    t = np.asarray(jax.vmap(lambda o: arch_latency(space, table, o).total)(jnp.asarray(archs)), np.float64)
    mem = np.asarray(jax.vmap(lambda o: L.M.arch_memory(space, lim.mem, table, o).total)(jnp.asarray(archs)))
    en = np.asarray(jax.vmap(lambda p: energy(space, table, p).per_device)(oh))
    ok = budget.within(t, t_const) & np.all(L._close(mem, lim.memory_bytes), 1) & np.all(L._close(en, lim.energy_mj), 1)
    return (cost[ok].min() if ok.any() else None), archs, cost, ok


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chain", "mesh"])
def test_repair_within_memory_and_energy_equals_enumeration(kind):
    space = _space(kind)
    table = analytic_table(space)
    lim0 = L.device_limits(space)
    mem_hi, en_hi = L.upper_bounds(space, table, lim0)
    rng = np.random.default_rng(1)
    for trial in range(3):
        mem = lim0.memory_bytes.copy()
        mem[0] = rng.uniform(0.55, 0.9) * mem_hi[0]
        en = lim0.energy_mj.copy()
        en[0] = rng.uniform(0.5, 0.95) * en_hi[0] if trial % 2 else np.inf
        lim = lim0._replace(memory_bytes=mem, energy_mj=en)
        alpha = jax.random.normal(jax.random.PRNGKey(trial), space.mask().shape)
        free = budget.repair(space, table, alpha, np.zeros(space.num_layers, np.int32) + 12, 1e9)
        t_const = float(free.min_latency_ms) * rng.uniform(1.05, 1.6)
        best, archs, cost, ok = _brute(space, table, lim, alpha, t_const)
        derived = archs[np.argmin(cost)]
        try:
            fix = budget.repair(space, table, alpha, derived, t_const, None, lim)
        except L.LimitsError:
            assert best is None and not any(
                L.within_limits(space, table, lim, a) for a in archs[:: max(1, len(archs) // 400)])
            continue
        if best is None:
            assert not fix.feasible
            continue
        assert fix.feasible
        assert L.within_limits(space, table, lim, fix.ops) and budget.within(fix.latency_ms, t_const)
        got = -np.log(np.asarray(probabilities(alpha, jnp.asarray(space.mask())), np.float64))[
            np.arange(space.num_layers), fix.ops].sum()
        np.testing.assert_allclose(got, best, rtol=1e-9, atol=1e-9)


def test_least_need_is_the_minimum_over_architectures():
    space = _space("chain")
    table = analytic_table(space)
    lim = L.device_limits(space)
    _, archs, _, _ = _brute(space, table, lim, jnp.zeros(space.mask().shape), 1e9)
    mems = np.asarray(jax.vmap(lambda o: L.M.arch_memory(space, lim.mem, table, o).total)(jnp.asarray(archs)))
    ens = np.asarray(jax.vmap(lambda o: energy(space, table, jax.nn.one_hot(o, 13)).per_device)(jnp.asarray(archs)))
    for m in range(space.topology.num_devices):
        need_m, need_e = L.least_need(space, table, lim, m)
        np.testing.assert_allclose(need_m, mems[:, m].min(), rtol=1e-6)
        np.testing.assert_allclose(need_e, ens[:, m].min(), rtol=1e-5)


def test_no_architecture_fits_names_the_device_and_its_least_memory():
    space = _space("chain", ue_mem=1000.0)
    table = analytic_table(space)
    lim = L.device_limits(space)
    need = L.least_need(space, table, lim, 0)[0]
    with pytest.raises(L.LimitsError, match=r"device 'ue' needs at least [\d,]+ bytes") as e:
        budget.check_feasible(space, table, lim, 100.0)
    assert f"{need:,.0f} bytes" in str(e.value) and "\n" not in str(e.value)


def test_limits_that_only_bind_with_t_const_name_what_the_device_would_need():
    space = _space("chain")
    # measured-like latencies in which the UE's fastest candidates are not its smallest ones
    rng = np.random.default_rng(0)
    t0 = analytic_table(space)
    table = from_compute(space, rng.uniform(0.1, 1.0, t0.compute_ms.shape), t0.stem_ms, t0.head_ms)
    lim0 = L.device_limits(space)
    fastest = budget.repair(space, table, jnp.zeros(space.mask().shape), np.zeros(4, np.int32) + 12, 0.0)
    ue_fast = L.usage(space, table, lim0, fastest.ops)[0].total[0]
    least = L.least_need(space, table, lim0, 0)[0]
    assert ue_fast > least * 1.01  # the fastest architecture is not the UE's smallest: the limit can bind with T
    lim = lim0._replace(memory_bytes=np.array([0.5 * (least + ue_fast), 1e9, 1e9]))
    t_const = float(fastest.latency_ms) * 1.0000001
    with pytest.raises(L.LimitsError, match="device 'ue' would need") as e:
        budget.check_feasible(space, table, lim, t_const)
    msg = str(e.value)
    assert "T_const >=" in msg and "\n" not in msg
    need = float(msg.split("would need ")[1].split(" bytes")[0].replace(",", ""))
    assert lim.memory_bytes[0] < need <= ue_fast * (1 + 1e-3)
    # that much memory admits an architecture within T_const
    fix = budget.repair(space, table, jnp.zeros(space.mask().shape), fastest.ops, t_const, None,
                        lim._replace(memory_bytes=np.array([need, 1e9, 1e9])))
    assert fix.feasible


def test_population_within_matches_one_by_one():
    space = _space("chain")
    table = analytic_table(space)
    lim0 = L.device_limits(space)
    rng = np.random.default_rng(0)
    mask = space.mask()
    ops = np.array([[rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)] for _ in range(24)],
                   np.int32)
    use = [L.usage(space, table, lim0, o) for o in ops]
    mem_ue = np.median([u[0].total[0] for u in use])
    en_edge = np.median([u[1].per_device[1] for u in use])
    lim = lim0._replace(memory_bytes=np.array([mem_ue, 1e9, 1e9]), energy_mj=np.array([np.inf, en_edge, np.inf]))
    got = L.population_within(space, table, lim, ops)
    want = np.array([L.within_limits(space, table, lim, o) for o in ops])
    assert (got == want).all() and want.any() and not want.all()


def test_chain_split_within_limits_equals_enumeration():
    space = _space("chain")
    t0 = analytic_table(space)
    rng = np.random.default_rng(3)
    table = from_compute(space, rng.uniform(0.05, 1.0, t0.compute_ms.shape), t0.stem_ms, t0.head_ms)
    mask = space.mask()
    ops = np.array([rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)], np.int32)
    order, n = list(space.topology.pre), space.num_layers
    splits = [np.repeat(order, np.diff((0,) + c + (n,))).astype(np.int32)
              for c in itertools.combinations_with_replacement(range(n + 1), len(order) - 1)]
    lim0 = L.device_limits(space)
    t = np.array([float(arch_latency(space, table, ops, a).total) for a in splits])
    np.testing.assert_allclose(float(arch_latency(space, table, ops, L.best_split(space, table, lim0, ops)).total),
                               t.min(), rtol=1e-6)
    use = np.array([L.usage(space, table, lim0, ops, a)[0].total for a in splits])
    for frac in (0.3, 0.6):
        mem = lim0.memory_bytes.copy()
        mem[0] = use[:, 0].min() + frac * (use[:, 0].max() - use[:, 0].min())
        lim = lim0._replace(memory_bytes=mem)
        fits = np.array([L.within_limits(space, table, lim, ops, a) for a in splits])
        got = L.best_split(space, table, lim, ops)
        assert L.within_limits(space, table, lim, ops, got)
        np.testing.assert_allclose(float(arch_latency(space, table, ops, got).total), t[fits].min(), rtol=1e-6)


def test_a_relay_device_over_its_limit_is_not_repaired_into():
    """A split that leaves a device no layer (it relays the stem's output) still charges it the stem, the input
    and both link buffers: the repair under that split refuses its limit in one line instead of returning an
    architecture over it (device_frontier checked the limits only per layer)."""
    devs = [DeviceProfile("ue", 5.0, 1e9), DeviceProfile("cloud", 100.0, 1e9)]
    topo = make_topology("c", devs, [LinkProfile("ue", "cloud", 10.0, 1.0, True)], (2, 1))
    space = build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12),
                        device_strides=(1, 1), stem_channels=8, head_channels=8)
    table = analytic_table(space)
    relay = np.array([1, 1, 1], np.int32)  # the UE runs the stem only
    ops = np.array([int(np.flatnonzero(space.mask()[n])[0]) for n in range(3)], np.int32)
    free = L.DeviceLimits(np.full(2, np.inf), np.full(2, np.inf), L.device_limits(space).mem)
    need = float(L.usage(space, table, free, ops, relay)[0].total[0])
    lim = free._replace(memory_bytes=np.array([need / 2, np.inf]))
    with pytest.raises(L.LimitsError, match="'ue' needs at least"):
        budget.repair(space, table, np.zeros(space.mask().shape, np.float32), ops, 100.0, relay, lim)
    ok = free._replace(memory_bytes=np.array([need, np.inf]))  # exactly enough: the relay fits
    fix = budget.repair(space, table, np.zeros(space.mask().shape, np.float32), ops, 100.0, relay, ok)
    assert L.within_limits(space, table, ok, fix.ops, relay)
