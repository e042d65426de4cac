"""Auto-Split pieces against oracles: packing round trips, quantizer distortion, eq. (6), the Lagrangian bit
assignment and (9) against brute force, edge memory against an independent working-set simulation."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas.cost.memory import peak_memory_bytes
from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.quant import packing, quantizers as Q, solver
from jmsnas.split import zoo
from jmsnas.topology import resolve as topology

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 45 -> 39 s of test time, AVX2 EPYC, 2 cores


# ----------------------------------------------------------------------------------------------- packing

def _reference_pack(codes, bits):
    stream = [(int(c) >> k) & 1 for c in codes for k in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(stream[8 * i + k] << k for k in range(8)) for i in range(len(stream) // 8)]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [13, pytest.param(61, marks=pytest.mark.slow)])  # 13: odd lengths in the quick loop
def test_pack_unpack_round_trip_every_width_and_odd_lengths(bits, n):
    rng = np.random.default_rng(bits * 100 + n)
    codes = rng.integers(0, 2 ** bits, size=(3, n), dtype=np.uint8)
    packed = packing.pack(codes, bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, math.ceil(n * bits / 8))
    assert packed.shape[-1] == packing.packed_bytes(n, bits)
    assert np.array_equal(np.asarray(packed[1]), _reference_pack(codes[1], bits))
    assert np.array_equal(np.asarray(packing.unpack(packed, bits, n)), codes)


@pytest.mark.slow
def test_pack_is_vmappable_and_jittable():
    codes = np.random.default_rng(0).integers(0, 8, size=(4, 11), dtype=np.uint8)
    f = jax.jit(jax.vmap(lambda c: packing.unpack(packing.pack(c, 3), 3, 11)))
    assert np.array_equal(np.asarray(f(codes)), codes)
    assert np.array_equal(np.asarray(jax.vmap(lambda c: packing.pack(c, 3))(codes)),
                          np.asarray(packing.pack(codes, 3)))


@pytest.mark.parametrize("bits, codes, needle", [(0, [1], "bits must be an integer in 1..8"),
                                                 (9, [1], "bits must be an integer in 1..8"),
                                                 (2, [4], "codes must lie in [0, 3]"),
                                                 (3, [-1], "codes must lie in [0, 7]")])
def test_pack_rejects_bad_widths_and_codes(bits, codes, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        packing.pack(np.array(codes, np.int32), bits)


# ----------------------------------------------------------------------------------------------- quantizers

@pytest.mark.slow
def test_distortion_falls_as_bits_rise():
    rng = np.random.default_rng(0)
    bits = (2, 3, 4, 5, 6, 7, 8, 16)
    ws = [rng.normal(size=(3, 3, 16)), rng.normal(size=(24, 48)) * 0.1]
    dw = Q.weight_distortion(ws, bits)
    a = np.maximum(rng.normal(size=(2000,)), 0)
    da = Q.act_distortion([a, rng.normal(size=777)], [[a.min(), a.max()], [-4, 4]], bits)
    for d in np.concatenate([dw, da]):
        assert np.all(np.diff(d) < 0), d
    # the padded batched MSE equals the direct MSE of each tensor
    for w, row in zip(ws, dw):
        q = np.asarray(Q.fake_quant_weight(jnp.asarray(w, jnp.float32), 4), np.float64)
        assert row[2] == pytest.approx(np.mean((np.asarray(w, np.float64) - q) ** 2), rel=1e-5)


def test_weight_quantizer_is_symmetric_per_output_channel():
    w = jnp.asarray(np.random.default_rng(1).normal(size=(5, 7)), jnp.float32) * jnp.arange(1, 8)
    codes, scale = Q.weight_codes(w, 4)
    assert int(jnp.max(jnp.abs(codes))) == 7 and scale.shape == (7,)
    q = Q.fake_quant_weight(w, 4)
    assert np.allclose(np.max(np.abs(q), 0), np.max(np.abs(w), 0), rtol=1e-6)  # each channel's max is exact
    assert len(np.unique(np.asarray(q[:, 0]))) <= 15
    assert np.array_equal(Q.fake_quant_weight(w, 0), w)


@pytest.mark.slow
def test_activation_fake_quant_is_what_the_receiver_reconstructs():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 6, 6, 3)) * 3, jnp.float32)
    for b in (1, 3, 8):
        codes = Q.act_codes(x, -2.0, 5.0, b)
        packed = packing.pack(codes.reshape(4, -1), b)
        back = Q.act_dequant(packing.unpack(packed, b, 108).reshape(x.shape), -2.0, 5.0, b)
        assert np.array_equal(np.asarray(back), np.asarray(Q.fake_quant_act(x, -2.0, 5.0, b)))


@pytest.mark.parametrize("bits, needle", [((), "empty"), ((1, 4), r"unsupported bit width\(s\) \[1\]"),
                                          ((4, 32, 12), r"\[12, 32\]"), (("x",), "must be integers")])
def test_bad_bit_sets(bits, needle):
    with pytest.raises(ValueError, match=needle):
        Q.check_bit_set(bits)


# ----------------------------------------------------------------------------------------------- tiny problems

def _tiny_problem(rng, n=5, skip=True, memory=None, bits=(2, 4, 8)):
    """A random DAG of n layers (chain plus one skip), random shapes and decreasing distortion tables."""
    layers = []
    for i in range(n):
        ins = (i - 1,) if i else ()
        if skip and i >= 3 and rng.random() < 0.6:
            ins = (i - 1, i - 3)
        layers.append(LayerSpec(f"l{i}", "conv", int(rng.integers(100, 5000)), int(rng.integers(0, 400)),
                                (int(rng.integers(1, 9)), 4, 4), ins))
    layers[-1] = layers[-1]._replace(out_shape=(10,))
    net = NetSpec("tiny", (8, 8, 1), tuple(layers))
    k = len(bits)
    dw = np.sort(rng.random((n, k)), axis=1)[:, ::-1] * rng.random((n, 1))
    da = np.sort(rng.random((n, k)), axis=1)[:, ::-1]
    mem = memory if memory is not None else float(rng.integers(300, 1500))
    return net, solver.make_problem(net, topology("splitnets"), mem, bits, dw, da,
                                    w_elems=[l.params for l in layers], input_bits=8)


def _crossing_brute(p, n):
    if n == p.n:
        return []
    return sorted({u for u, v in p.edges if u < n <= v})


def test_potential_splits_equal_a_brute_force_filter_of_eq6():
    rng = np.random.default_rng(3)
    for _ in range(30):
        _, p = _tiny_problem(rng, n=int(rng.integers(2, 8)))
        bmin = p.bits[0]
        t0 = math.ceil(p.input_elems * p.input_bits / 8)
        want = []
        for n in range(p.n + 1):
            tn = sum(t0 if u < 0 else math.ceil(p.a_elems[u] * bmin / 8) for u in _crossing_brute(p, n))
            mem = bmin * (sum(p.w_elems[:n]) + (max(p.a_elems[:n]) if n else 0)) / 8
            if tn <= t0 and mem <= p.memory_bytes:
                want.append(n)
        assert solver.potential_splits(p) == want
    # a real network too
    net = zoo.get("resnet18")
    k = 3
    p = solver.make_problem(net, topology("splitnets"), 4e6, (2, 4, 8), np.ones((len(net.layers), k)),
                            np.ones((len(net.layers), k)))
    t0 = net.input_elems
    brute = [n for n in range(p.n + 1)
             if sum(t0 if u < 0 else math.ceil(p.a_elems[u] * 2 / 8) for u in _crossing_brute(p, n)) <= t0
             and 2 * (p.w_elems[:n].sum() + (p.a_elems[:n].max() if n else 0)) / 8 <= 4e6]
    assert solver.potential_splits(p) == brute and len(brute) > 3


def _brute_knapsack(dist, cost, budget):
    best = None
    for c in itertools.product(range(dist.shape[1]), repeat=dist.shape[0]):
        tc = sum(cost[i, k] for i, k in enumerate(c))
        td = sum(dist[i, k] for i, k in enumerate(c))
        if tc <= budget + 1e-9 and (best is None or td < best - 1e-12):
            best = td
    return best


def test_lagrangian_assignment_equals_brute_force_on_tiny_instances():
    rng = np.random.default_rng(4)
    checked_vertices = 0
    for _ in range(40):
        n, k = int(rng.integers(1, 5)), int(rng.integers(2, 5))
        bits = np.sort(rng.choice(np.arange(1, 17), size=k, replace=False))
        s = rng.integers(1, 50, size=n)
        cost = s[:, None] * bits[None] / 8.0
        dist = np.sort(rng.random((n, k)), axis=1)[:, ::-1] * rng.random((n, 1))
        # every Lagrangian vertex (a solution of min D + lam * M) used as the budget: exactly brute force's optimum
        for lam in np.concatenate([[0.0], np.geomspace(1e-4, 1e2, 40)]):
            c = np.argmin(dist + lam * cost, axis=1)
            budget = cost[np.arange(n), c].sum()
            got = solver.lagrangian_assign(dist, cost, budget)
            assert dist[np.arange(n), got].sum() == pytest.approx(_brute_knapsack(dist, cost, budget), abs=1e-12)
            checked_vertices += 1
        # any budget: feasible, never better than brute force, and optimal for the memory it uses
        for budget in rng.uniform(cost.min(1).sum(), cost.max(1).sum(), size=5):
            got = solver.lagrangian_assign(dist, cost, budget)
            used = cost[np.arange(n), got].sum()
            d = dist[np.arange(n), got].sum()
            assert used <= budget + 1e-9
            assert d >= _brute_knapsack(dist, cost, budget) - 1e-12
            assert d == pytest.approx(_brute_knapsack(dist, cost, used), abs=1e-12)
        assert solver.lagrangian_assign(dist, cost, cost.min(1).sum() * 0.99) is None
    assert checked_vertices > 1000


def test_activation_assignment_equals_brute_force():
    rng = np.random.default_rng(5)
    for _ in range(30):
        _, p = _tiny_problem(rng, n=int(rng.integers(1, 5)))
        n = p.n
        for budget in rng.uniform(0, p.a_elems.max() * 2, size=4):
            best = None
            for c in itertools.product(p.bits, repeat=n):
                if max(p.a_elems[i] * b / 8 for i, b in enumerate(c)) <= budget:
                    d = sum(p.da[i, p.bits.index(b)] for i, b in enumerate(c))
                    best = d if best is None or d < best else best
            got = solver.assign_activations(p, n, budget)
            if best is None:
                assert got is None
            else:
                assert sum(p.da[i, p.bits.index(b)] for i, b in enumerate(got)) == pytest.approx(best)


def _simulated_working_set(p, n, abits):
    """Step through layers [0, n): live tensors = produced (or the input) and still needed (or to be sent)."""
    if n == 0:
        return 0
    cons = {}
    for u, v in p.edges:
        cons.setdefault(u, []).append(v)
    size = lambda t: packing.transmitted_bytes(p.input_elems if t < 0 else p.a_elems[t],
                                               p.input_bits if t < 0 else abits[t])
    peak = 0
    for step in range(n):
        live = 0
        for t in [-1] + list(range(step + 1)):
            vs = cons.get(t, [])
            needed_later = any(v >= step for v in vs if v < n) or any(v >= n for v in vs) or (t >= 0 and not vs)
            if t < 0 and not any(v < n for v in vs):
                continue
            if (t == step) or needed_later:
                live += size(t)
        peak = max(peak, live)
    return peak


def test_edge_memory_matches_a_simulation_and_cost_memory():
    rng = np.random.default_rng(6)
    for _ in range(25):
        net, p = _tiny_problem(rng, n=int(rng.integers(2, 8)))
        for n in range(p.n + 1):
            ab = tuple(int(b) for b in rng.choice(p.bits, size=n))
            assert solver.working_set_bytes(p, n, ab) == _simulated_working_set(p, n, ab)
        # uniform bits (the input at the same width): the project's own peak-memory accounting agrees
        p8 = p._replace(input_bits=8)
        for n in range(1, p.n + 1):
            assert solver.edge_memory_bytes(p8, n, (8,) * n, (8,) * n) == peak_memory_bytes(net, list(range(n)), 8, 8)


@pytest.mark.slow
def test_no_returned_solution_exceeds_the_memory_limit():
    rng = np.random.default_rng(7)
    found = 0
    for _ in range(20):
        _, p = _tiny_problem(rng, n=int(rng.integers(2, 7)))
        for s in solver.candidates(p) + [solver.neurosurgeon(p), solver.u8_split(p)]:
            mem = sum(math.ceil(p.w_elems[i] * s.wbits[i] / 8) for i in range(s.split))
            assert mem + _simulated_working_set(p, s.split, s.abits) <= p.memory_bytes
            found += s.split > 0
    net = zoo.get("mobilenet_v2")
    k = 5
    dw = np.tile(np.geomspace(1, 1e-6, k), (len(net.layers), 1))
    for mb in (0.5, 2.0, 6.0):
        p = solver.make_problem(net, topology("splitnets"), mb * 2**20, (2, 4, 6, 8, 16), dw, dw)
        cands = solver.candidates(p)
        assert all(s.edge_memory_bytes <= p.memory_bytes for s in cands)
        assert all(solver.evaluate(p, "x", s.split, s.wbits, s.abits).edge_memory_bytes == s.edge_memory_bytes
                   for s in cands[:50])
        found += sum(s.split > 0 for s in cands)
    assert found > 100


def test_selection_meets_the_threshold_and_remark_5():
    rng = np.random.default_rng(8)
    for _ in range(10):
        _, p = _tiny_problem(rng, n=5, memory=1e6)
        cands = solver.candidates(p)
        for a in (0.0, 0.5, 2.0):
            chosen, d, _ = solver.select(cands, lambda s: s.distortion, a)
            assert d <= a
            ok = [s for s in cands if s.distortion <= a]
            assert chosen.latency_ms == min(s.latency_ms for s in ok)
            assert chosen.latency_ms <= solver.cloud_only(p).latency_ms
    with pytest.raises(ValueError, match="A must be a number >= 0"):
        solver.select(cands, lambda s: 0.0, -0.1)
