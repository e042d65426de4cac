"""Cost table and completion latency: eq. (1) (chain) and eq. (2) (mesh), expected and discrete (issue 2, item 5).

Oracles: brute-force enumeration of every architecture of tiny spaces (float64), hand-computed meshes with round
numbers, and central finite differences for dE[T]/dalpha.
"""
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas.topology import presets
from jmsnas.cost import latency as L
from jmsnas.cost.tables import CostTable, activation_bytes, analytic_table, from_compute, roofline_ms
from jmsnas.space import NUM_OPS, build_space
from jmsnas.topology import DeviceProfile, LinkProfile, chain, make_topology

R = NUM_OPS


def f64(table: CostTable) -> CostTable:
    """The same table in float64 (its float32 values are exactly representable)."""
    return CostTable(*(jnp.asarray(np.asarray(a, np.float64)) for a in table))


def np64(table: CostTable):
    return CostTable(*(np.asarray(a, np.float64) for a in table))


def np_softmax(alpha, mask):
    a = np.where(mask, alpha, -np.inf)
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def random_table(space, seed):
    rng = np.random.default_rng(seed)
    m, n = space.topology.num_devices, space.num_layers
    return from_compute(space, rng.uniform(0.1, 5.0, (m, n, R)), rng.uniform(0.1, 2.0, m), rng.uniform(0.1, 2.0, m))


def comm(nbytes, bw_mbps, lat_ms=0.0):
    return nbytes * 8.0 / (bw_mbps * 1e3) + lat_ms


# ------------------------------------------------------------------------------------------------ chain, eq. (1)

def chain_space():
    """3 devices, D = (2, 1, 1): 4 layers with 13, 13, 6, 6 valid candidates (6084 architectures)."""
    devs = [DeviceProfile(n, 10.0, 1e9) for n in ("ue", "edge", "cloud")]
    topo = chain("c3", devs, [25.0, 50.0], [2, 1, 1], latencies_ms=[0.5, 0.25])
    return build_space(topo, image_size=8, in_channels=3, num_classes=5, device_channels=[4, 4, 8],
                       device_strides=[1, 2, 1], stem_channels=4, head_channels=8)


def chain_T(t: CostTable, ops, assign):
    """Eq. (1) written out for the 3-device chain: compute of every layer on its device, the stem on the UE, the
    head on the cloud, and on each link the output of the last layer run before it (the stem's when none)."""
    ops, assign = np.asarray(ops), np.asarray(assign)
    total = t.stem_ms[0] + t.head_ms[2]
    total += sum(t.compute_ms[assign[n], n, ops[..., n]] for n in range(4))
    for j, (bw, lat) in enumerate(zip(t.bandwidth_mbps, t.link_latency_ms)):
        before = np.flatnonzero(assign <= j)
        nbytes = t.out_bytes[before[-1]] if before.size else t.stem_bytes
        total += comm(nbytes, bw, lat)
    return total


def all_archs(space):
    valid = [np.flatnonzero(r) for r in space.mask()]
    return np.array(list(itertools.product(*valid)), np.int32)


@pytest.mark.slow
def test_chain_expected_latency_equals_enumeration():
    sp = chain_space()
    archs = all_archs(sp)
    assert len(archs) == 13 * 13 * 6 * 6
    table = random_table(sp, 0)
    t = np64(table)
    rng = np.random.default_rng(1)
    alpha = rng.normal(0, 1.5, (sp.num_layers, R))
    p = np_softmax(alpha, sp.mask())
    T = chain_T(t, archs, [0, 0, 1, 2])  # [6084]
    prob = np.prod(p[np.arange(4), archs], axis=1)
    np.testing.assert_allclose(prob.sum(), 1.0, rtol=1e-12)
    exact = float(np.sum(prob * T))
    with jax.enable_x64(True):
        lat = L.expected_latency(sp, f64(table), jnp.asarray(alpha))
        got = float(lat.total)
        # the discrete latency of every architecture, vmapped, equals eq. (1) written out
        disc = jax.vmap(lambda o: L.arch_latency(sp, f64(table), o).total)(jnp.asarray(archs))
    assert got == pytest.approx(exact, rel=1e-6)
    np.testing.assert_allclose(np.asarray(disc), T, rtol=1e-9)


def test_chain_breakdown_by_hand():
    sp = chain_space()
    table = random_table(sp, 2)
    t = np64(table)
    ops = [12, 3, 0, 5]
    with jax.enable_x64(True):
        lat = L.arch_latency(sp, f64(table), ops)
    u = t.compute_ms
    per_dev = [t.stem_ms[0] + u[0, 0, 12] + u[0, 1, 3], u[1, 2, 0], u[2, 3, 5] + t.head_ms[2]]
    # ue sends layer 1's output (8*8*4 floats = 1024 B) over 25 Mbit/s + 0.5 ms; edge sends layer 2's (4*4*4*4 B)
    assert t.out_bytes[1] == 1024 and t.out_bytes[2] == 256
    per_link = [1024 * 8 / 25e3 + 0.5, 256 * 8 / 50e3 + 0.25]
    np.testing.assert_allclose(np.asarray(lat.per_device), per_dev, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(lat.per_link), per_link, rtol=1e-12)
    assert float(lat.total) == pytest.approx(sum(per_dev) + sum(per_link), rel=1e-12)
    bd = L.breakdown_dict(sp, lat)
    assert set(bd) == {"total", "per_device", "per_link"}
    assert list(bd["per_device"]) == ["ue", "edge", "cloud"] and list(bd["per_link"]) == ["ue->edge", "edge->cloud"]
    assert bd["per_link"]["ue->edge"] == pytest.approx(per_link[0])
    assert all(isinstance(v, float) for v in bd["per_device"].values())


@pytest.mark.parametrize("assign", [[0, 0, 1, 2], [0, 0, 0, 2], [1, 1, 2, 2], [0, 0, 0, 0], [0, 2, 2, 2]])
def test_chain_assignment_moves_compute_and_transfers(assign):
    sp = chain_space()
    table = random_table(sp, 3)
    archs = all_archs(sp)[::97]
    with jax.enable_x64(True):
        got = jax.vmap(lambda o: L.arch_latency(sp, f64(table), o, jnp.asarray(assign)).total)(jnp.asarray(archs))
    np.testing.assert_allclose(np.asarray(got), chain_T(np64(table), archs, assign), rtol=1e-9)


def test_chain_assignment_special_cases_by_hand():
    sp = chain_space()
    table = random_table(sp, 4)
    t = np64(table)
    ops = [0, 0, 0, 0]
    u = t.compute_ms
    with jax.enable_x64(True):
        # nothing on the UE but the stem: the first link carries the stem output (8*8*4 floats)
        lat = L.arch_latency(sp, f64(table), ops, [1, 1, 2, 2])
        np.testing.assert_allclose(np.asarray(lat.per_link), [comm(1024, 25, 0.5), comm(1024, 50, 0.25)])
        np.testing.assert_allclose(np.asarray(lat.per_device),
                                   [t.stem_ms[0], u[1, 0, 0] + u[1, 1, 0], u[2, 2, 0] + u[2, 3, 0] + t.head_ms[2]])
        # the edge runs nothing: layer 2's output is relayed across both links
        lat = L.arch_latency(sp, f64(table), ops, [0, 0, 0, 2])
        np.testing.assert_allclose(np.asarray(lat.per_link), [comm(256, 25, 0.5), comm(256, 50, 0.25)])
        assert float(lat.per_device[1]) == 0.0


def test_chain_rejects_bad_assignment():
    sp = chain_space()
    table = analytic_table(sp)
    ops = [0, 0, 0, 0]
    with pytest.raises(ValueError, match=re.escape("[0, 2, 1, 2]")):
        L.arch_latency(sp, table, ops, [0, 2, 1, 2])  # data would flow back from the cloud to the edge
    with pytest.raises(ValueError, match=re.escape("[0, 1, 2]")):
        L.arch_latency(sp, table, ops, [0, 1, 2])
    with pytest.raises(ValueError, match=re.escape("[0, 1, 3, 3]")):
        L.arch_latency(sp, table, ops, [0, 1, 3, 3])
    mesh = build_space(presets.topology("mesh", [1] * 6), image_size=4, in_channels=3, num_classes=2,
                       device_channels=[4] * 6, device_strides=[1] * 6, stem_channels=4, head_channels=4)
    with pytest.raises(ValueError, match="every branch layer stays on its branch device"):
        L.arch_latency(mesh, analytic_table(mesh), [0] * 6, [0] * 6)
    with pytest.raises(ValueError, match=r"layers 0\.\.1 \(before the fork\) must run on devices \[0, 1\]"):
        L.arch_latency(mesh, analytic_table(mesh), [0] * 6, [1, 0, 2, 3, 4, 5])


def test_chain_gradient_matches_central_differences():
    sp = chain_space()
    table = random_table(sp, 5)
    mask = sp.mask()
    alpha = np.random.default_rng(6).normal(0, 1.0, (sp.num_layers, R))
    with jax.enable_x64(True):
        f = jax.jit(lambda a: L.expected_latency(sp, f64(table), a).total)
        grad = np.asarray(jax.grad(f)(jnp.asarray(alpha)))
        fd = central_differences(f, alpha)
    assert np.all(grad[~mask] == 0)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    assert np.abs(grad).max() > 1e-2


def central_differences(f, alpha, eps=1e-6):
    fd = np.zeros_like(alpha)
    for idx in np.ndindex(alpha.shape):
        e = np.zeros_like(alpha)
        e[idx] = eps
        fd[idx] = (float(f(jnp.asarray(alpha + e))) - float(f(jnp.asarray(alpha - e)))) / (2 * eps)
    return fd


# ------------------------------------------------------------------------------------------------ mesh, eq. (2)

def hand_mesh():
    """ue -> root -> {b1, b2} -> agg, one layer each, every slot 5x5x10 (250 floats = 1000 B = 8000 bit out),
    links 8, 4, 16 (+0.25 ms fixed), 8, 2 Mbit/s = 8000, 4000, 16000, 8000, 2000 bit/ms, so the transfers take
    ue->root 1 ms, root->b1 2 ms, root->b2 0.5 + 0.25 ms, b1->agg 1 ms, b2->agg 4 ms (exact in float32).
    U[m, n, i] = c[m] * (i + 1) with c = (1, 2, 3, 5, 7); stem 0.5 ms on the UE, head 0.25 ms on agg
    (9 ms on every other device, which must not be used)."""
    names = ["ue", "root", "b1", "b2", "agg"]
    devs = [DeviceProfile(n, 10.0, 1e9) for n in names]
    links = [LinkProfile("ue", "root", 8.0), LinkProfile("root", "b1", 4.0),
             LinkProfile("root", "b2", 16.0, 0.25), LinkProfile("b1", "agg", 8.0), LinkProfile("b2", "agg", 2.0)]
    topo = make_topology("hand", devs, links, [1] * 5)
    sp = build_space(topo, image_size=5, in_channels=3, num_classes=5, device_channels=[10] * 5,
                     device_strides=[1] * 5, stem_channels=10, head_channels=8)
    c = np.array([1.0, 2.0, 3.0, 5.0, 7.0])
    u = np.broadcast_to(c[:, None, None] * (np.arange(R) + 1.0), (5, 5, R))
    table = from_compute(sp, u, [0.5, 9, 9, 9, 9], [9, 9, 9, 9, 0.25])
    return sp, table, c


def test_mesh_discrete_eq2_by_hand():
    sp, table, _ = hand_mesh()
    assert sp.topology.kind == "mesh" and np.all(np.asarray(table.out_bytes) == 1000)
    lat = L.arch_latency(sp, table, [0, 1, 2, 0, 12])
    # layers: ue op0 = 1, root op1 = 2*2 = 4, b1 op2 = 3*3 = 9, b2 op0 = 5, agg op12 = 7*13 = 91
    # chain part C = {ue, agg}: (0.5 stem + 1 + 1 ms link) + (91 + 0.25 head)             = 93.75
    # branch b1: 4 + 2 + 9 + 1 = 16;  branch b2: 4 + 0.75 + 5 + 4 = 13.75;  max           = 16
    assert float(lat.total) == 109.75
    np.testing.assert_array_equal(np.asarray(lat.per_device), [1.5, 4, 9, 5, 91.25])
    np.testing.assert_array_equal(np.asarray(lat.per_link), [1, 2, 0.75, 1, 4])
    # b2 runs op12 = 5*13 = 65: branch b2 = 4 + 0.75 + 65 + 4 = 73.75 is now the slowest
    assert float(L.arch_latency(sp, table, [0, 1, 2, 12, 12]).total) == 93.75 + 73.75
    bd = L.breakdown_dict(sp, lat)
    assert bd["per_link"]["root->b2"] == 0.75 and bd["total"] == 109.75
    assert list(bd["per_device"]) == ["ue", "root", "b1", "b2", "agg"]


def mesh_eq2(per_layer, stem, head):
    """Eq. (2) on the hand mesh from per-layer latencies [..., 5] (ms)."""
    t = per_layer
    chain_part = stem + t[..., 0] + 1.0 + t[..., 4] + head
    b1 = t[..., 1] + 2.0 + t[..., 2] + 1.0
    b2 = t[..., 1] + 0.75 + t[..., 3] + 4.0
    return chain_part + np.maximum(b1, b2)


def grid(vec, n, num):
    shape = [1] * num
    shape[n] = -1
    return np.reshape(vec, shape)


def test_mesh_expected_latency_is_eq2_of_expected_layers_and_lower_bound():
    sp, table, c = hand_mesh()
    rng = np.random.default_rng(7)
    alpha = rng.normal(0, 1.0, (5, R))
    p = np_softmax(alpha, sp.mask())
    with jax.enable_x64(True):
        got = float(L.expected_latency(sp, f64(table), jnp.asarray(alpha)).total)
    # eq. (2) with E[tau_n^m] = sum_i p_i U_n^m(v_i) = c[m] * sum_i p_i (i + 1)
    e_tau = c * (p @ (np.arange(R) + 1.0))
    assert got == pytest.approx(mesh_eq2(e_tau, 0.5, 0.25), rel=1e-9)
    # the true E[T] over all 13^5 architectures
    per_op = [grid(c[n] * (np.arange(R) + 1.0), n, 5) for n in range(5)]
    T = mesh_eq2(np.stack(np.broadcast_arrays(*per_op), -1), 0.5, 0.25)
    prob = np.prod(np.broadcast_arrays(*[grid(p[n], n, 5) for n in range(5)]), axis=0)
    true = float(np.sum(prob * T))
    assert got <= true
    assert true - got > 1e-3 * true  # the branches overlap, so max of expectations < expectation of max


def test_mesh_bound_is_tight_when_one_branch_always_dominates():
    sp, table, _ = hand_mesh()
    u = np.asarray(table.compute_ms, np.float64).copy()
    u[2] *= 100.0  # b1's cheapest op (300 + 3 ms links) exceeds b2's slowest (65 + 4.75 ms links)
    table = from_compute(sp, u, table.stem_ms, table.head_ms)
    alpha = np.random.default_rng(8).normal(0, 1.0, (5, R))
    p = np_softmax(alpha, sp.mask())
    with jax.enable_x64(True):
        got = float(L.expected_latency(sp, f64(table), jnp.asarray(alpha)).total)
    t = np.asarray(table.compute_ms, np.float64)[np.arange(5), np.arange(5)]  # [5, R]: layer n on device n
    per_op = [grid(t[n], n, 5) for n in range(5)]
    T = mesh_eq2(np.stack(np.broadcast_arrays(*per_op), -1), 0.5, 0.25)
    prob = np.prod(np.broadcast_arrays(*[grid(p[n], n, 5) for n in range(5)]), axis=0)
    assert got == pytest.approx(float(np.sum(prob * T)), rel=1e-9)


def fig2b_space():
    """Fig. 2(b): ue -> sbs -> mbs1..3 -> cloud with Table I links, one layer per device; branch slots change
    shape (6 candidates), the others keep it (13): 13^3 * 6^3 = 474552 architectures."""
    return build_space(presets.topology("mesh", [1] * 6), image_size=8, in_channels=3, num_classes=5,
                       device_channels=[4, 4, 8, 8, 8, 8], device_strides=[1, 1, 2, 2, 2, 1], stem_channels=4,
                       head_channels=8)


def test_fig2b_mesh_enumeration_random_table():
    sp = fig2b_space()
    table = random_table(sp, 9)
    t = np64(table)
    topo = sp.topology
    alpha = np.random.default_rng(10).normal(0, 1.0, (6, R))
    mask = sp.mask()
    p = np_softmax(alpha, mask)
    valid = [np.flatnonzero(r) for r in mask]
    # per-layer latency on its own device, over the layer's valid ops, laid out on the product grid
    lay = [grid(t.compute_ms[n, n, valid[n]], n, 6) for n in range(6)]
    prob = np.prod(np.broadcast_arrays(*[grid(p[n, valid[n]], n, 6) for n in range(6)]), axis=0)
    ms = lambda a, b, n: comm(t.out_bytes[n], t.bandwidth_mbps[topo.link_index(a, b)],
                              t.link_latency_ms[topo.link_index(a, b)])
    chain_part = t.stem_ms[0] + lay[0] + ms(0, 1, 0) + lay[5] + t.head_ms[5]
    branches = [lay[1] + ms(1, b, 1) + lay[b] + ms(b, 5, b) for b in (2, 3, 4)]
    T = chain_part + np.maximum(np.maximum(branches[0], branches[1]), branches[2])
    true = float(np.sum(prob * T))
    e = lambda n: float(np.sum(p[n] * t.compute_ms[n, n]))
    eq2_expected = (t.stem_ms[0] + e(0) + ms(0, 1, 0) + e(5) + t.head_ms[5]
                    + max(e(1) + ms(1, b, 1) + e(b) + ms(b, 5, b) for b in (2, 3, 4)))
    with jax.enable_x64(True):
        got = float(L.expected_latency(sp, f64(table), jnp.asarray(alpha)).total)
        # a few discrete architectures against eq. (2) on the grid
        idx = np.random.default_rng(11).integers(0, [len(v) for v in valid], (5, 6))
        for row in idx:
            ops = [int(valid[n][k]) for n, k in enumerate(row)]
            assert float(L.arch_latency(sp, f64(table), ops).total) == pytest.approx(float(T[tuple(row)]), rel=1e-9)
    assert got == pytest.approx(eq2_expected, rel=1e-9)
    assert got < true


def test_mesh_gradient_matches_central_differences():
    sp = fig2b_space()
    table = random_table(sp, 12)
    alpha = np.random.default_rng(13).normal(0, 1.0, (6, R))
    with jax.enable_x64(True):
        f = jax.jit(lambda a: L.expected_latency(sp, f64(table), a).total)
        grad = np.asarray(jax.grad(f)(jnp.asarray(alpha)))
        fd = central_differences(f, alpha)
    assert np.all(grad[~sp.mask()] == 0)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    # only the slowest branch's device gets a gradient from the max; the other two branches get none
    branch_grads = [np.abs(grad[n]).max() for n in (2, 3, 4)]
    assert sorted(branch_grads)[1] == 0 and max(branch_grads) > 0


def test_expected_latency_is_float32_jittable_by_default():
    sp = fig2b_space()
    table = analytic_table(sp)
    alpha = jnp.zeros((6, R))
    lat = jax.jit(lambda a: L.expected_latency(sp, table, a))(alpha)
    assert lat.total.dtype == jnp.float32 and np.isfinite(float(lat.total))
    assert lat.per_device.shape == (6,) and lat.per_link.shape == (7,)


# ------------------------------------------------------------------------------------------------ the table

def test_roofline_by_hand():
    d = DeviceProfile("d", 10.0, 1e9, mem_bandwidth_gbs=25.0, efficiency=0.5, layer_overhead_ms=0.1)
    # compute-bound: 1e6 FLOP / (10 GFLOP/s * 0.5) = 0.2 ms; memory 1e6 B / 25 GB/s = 0.04 ms
    assert float(roofline_ms(1e6, 1e6, d)) == pytest.approx(0.3)
    # memory-bound: 1e8 B / 25 GB/s = 4 ms
    assert float(roofline_ms(1e6, 1e8, d)) == pytest.approx(4.1)


def test_activation_bytes_follow_bits():
    sp = chain_space()
    out8, stem8, raw = activation_bytes(sp, 8)
    out32, stem32, _ = activation_bytes(sp, 32)
    np.testing.assert_array_equal(out8, [s.out_elems for s in sp.layers])
    np.testing.assert_array_equal(out32, 4 * out8)
    assert stem8 == 8 * 8 * 4 and stem32 == 4 * stem8 and raw == 8 * 8 * 3
    assert activation_bytes(sp, 4)[0][0] == out8[0] / 2
    with pytest.raises(ValueError, match=re.escape("activation bits must be one of 4, 8, 16, 32, got 12")):
        activation_bytes(sp, 12)


def test_from_compute_keeps_values_zeroes_masked_and_copies_links():
    sp = chain_space()
    rng = np.random.default_rng(14)
    u = rng.uniform(0.1, 1.0, (3, 4, R))
    t = from_compute(sp, u, [1, 2, 3], [4, 5, 6])
    mask = sp.mask()
    np.testing.assert_allclose(np.asarray(t.compute_ms)[:, mask], u[:, mask].astype(np.float32))
    assert np.all(np.asarray(t.compute_ms)[:, ~mask] == 0)
    np.testing.assert_array_equal(np.asarray(t.bandwidth_mbps), [25.0, 50.0])
    np.testing.assert_array_equal(np.asarray(t.link_latency_ms), [0.5, 0.25])
    assert isinstance(t, tuple) and all(isinstance(a, jax.Array) for a in t)


@pytest.mark.parametrize("which, value", [("compute_ms", -1.0), ("compute_ms", np.nan), ("compute_ms", np.inf),
                                          ("stem_ms", -0.5), ("head_ms", np.nan)])
def test_from_compute_rejects_bad_values(which, value):
    sp = chain_space()
    args = {"compute_ms": np.ones((3, 4, R)), "stem_ms": np.ones(3), "head_ms": np.ones(3)}
    idx = (1, 2, 3) if which == "compute_ms" else (2,)
    args[which][idx] = value
    with pytest.raises(ValueError, match=re.escape(f"{which} has a negative or non-finite latency at index")) as e:
        from_compute(sp, **args)
    assert str(e.value).endswith(f"at index {idx}: {float(value)!r}")


def test_from_compute_rejects_wrong_shape():
    sp = chain_space()
    with pytest.raises(ValueError, match=re.escape("compute_ms has shape (3, 4, 12), expected (devices, layers, "
                                                   "ops) = (3, 4, 13)")):
        from_compute(sp, np.ones((3, 4, 12)), np.ones(3), np.ones(3))


@pytest.mark.parametrize("which", ["stem_ms", "head_ms"])
def test_from_compute_rejects_wrong_stem_or_head_length(which):
    """One stem/head latency per device; a shorter vector would be read out of bounds (clamped) by jnp indexing."""
    sp = chain_space()
    args = {"compute_ms": np.ones((3, 4, R)), "stem_ms": np.ones(3), "head_ms": np.ones(3)}
    args[which] = np.ones(2)
    with pytest.raises(ValueError, match=re.escape(f"{which} has shape (2,), expected (devices,) = (3,)")):
        from_compute(sp, **args)
