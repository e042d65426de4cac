"""Batched population evaluation: equals the loop of single evaluations, compiles once, latency per arch."""
from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import evaluate as E
from jmsnas import supernet as SN
from jmsnas.cost.latency import arch_latency
from jmsnas.cost.tables import analytic_table
from jmsnas.dwconv import depthwise_conv
from jmsnas.gates import onehot_gates
from jmsnas.objectives import cross_entropy
from jmsnas.space import IDENTITY, NUM_OPS, OPS, build_space, op_index
from jmsnas.topology import DeviceProfile, LinkProfile, make_topology

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 141 -> 87 s of test time, AVX2 EPYC, 2 cores

TOL = dict(rtol=1e-4, atol=1e-5)


def _space(kind: str = "chain"):
    """Tiny spaces: every kind of slot (shape change, shape kept with identity/shortcuts, stride 2), odd sizes."""
    if kind == "chain":
        devs = [DeviceProfile(n, 10.0 * (i + 1), 1e9) for i, n in enumerate("abc")]
        links = [LinkProfile("a", "b", 20.0), LinkProfile("b", "c", 50.0)]
        topo = make_topology("chain", devs, links, (1, 1, 1))
        return build_space(topo, image_size=5, in_channels=1, num_classes=5, device_channels=(12, 12, 16),
                           device_strides=(1, 1, 2), stem_channels=8, head_channels=16)
    devs = [DeviceProfile(n, 10.0 * (i + 1), 1e9) for i, n in enumerate(("root", "m1", "m2", "agg"))]
    links = [LinkProfile("root", "m1", 30.0), LinkProfile("root", "m2", 40.0),
             LinkProfile("m1", "agg", 50.0), LinkProfile("m2", "agg", 60.0)]
    topo = make_topology("mesh", devs, links, (1, 1, 1, 1))
    return build_space(topo, image_size=5, in_channels=1, num_classes=4, device_channels=(8, 8, 8, 12),
                       device_strides=(1, 1, 1, 2), stem_channels=8, head_channels=12)


def _trained_like(space, seed: int, shared=True):
    """Supernet params/state made to look trained: BN scales x U(0.5, 1.5), running variances x U(0.5, 2), every
    other leaf (weights, biases, running means) + N(0, 0.1), including the zero padding of the stacks, which the
    candidates' masks must keep out of the results."""
    params, state = SN.init(jax.random.PRNGKey(seed), space, shared_weights=shared)
    rng = np.random.default_rng(seed)

    def jitter(tree):
        def one(path, a):
            a, name = np.asarray(a), jax.tree_util.keystr(path)
            if name.endswith("['scale']"):
                return jnp.asarray(a * rng.uniform(0.5, 1.5, a.shape), jnp.float32)
            if name.endswith("['var']"):
                return jnp.asarray(a * rng.uniform(0.5, 2.0, a.shape), jnp.float32)
            return jnp.asarray(a + 0.1 * rng.standard_normal(a.shape), jnp.float32)
        return jax.tree_util.tree_map_with_path(one, tree)

    return jitter(params), jitter(state)


def _population(space, seed: int) -> np.ndarray:
    """int32[7, N]: four random architectures, one sharing all but the last op with the first, two duplicates
    (so with chunks of 4 a whole chunk repeats earlier prefixes) and one with identity wherever it is valid."""
    rng = np.random.default_rng(seed)
    mask = space.mask()
    ops = np.array([[rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)] for _ in range(3)])
    near = ops[0].copy()
    near[-1] = [i for i in np.flatnonzero(mask[-1]) if i != ops[0, -1]][0]
    identity = [IDENTITY if mask[n, IDENTITY] else op_index("mbconv_k7_e6") for n in range(space.num_layers)]
    return np.vstack([ops, ops[2], near, ops[1], identity]).astype(np.int32)


@pytest.fixture(scope="module")
def chain():
    space = _space("chain")
    params, state = _trained_like(space, 0)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((12, 5, 5, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 5, 12), jnp.int32)
    bn = jnp.asarray(rng.standard_normal((3, 12, 5, 5, 1)) * 1.5 + 0.3, jnp.float32)
    return space, analytic_table(space), params, state, x, y, bn


def _assert_same(a, b):
    for k in ("loss", "accuracy", "latency_ms"):
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), **TOL, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("recalibrate,chunk", [(False, None), (True, 4)])
def test_batched_equals_loop(chain, recalibrate, chunk):
    """Default chunk (1 on CPU) without, and chunks of 4 (P = 7 padded to 8) with BN recalibration."""
    space, table, params, state, x, y, bn = chain
    ops = _population(space, 0)
    bn_batches = bn if recalibrate else None
    got = E.evaluate_population(space, table, params, state, ops, x, y, bn_batches=bn_batches, chunk=chunk)
    want = E.evaluate_loop(space, table, params, state, ops, x, y, bn_batches=bn_batches)
    _assert_same(got, want)
    assert set(got) == {"loss", "accuracy", "latency_ms"} and got["loss"].shape == (7,)
    loss = np.asarray(got["loss"])
    assert loss[3] == loss[2] and loss[5] == loss[1]  # duplicates: computed once, same result
    assert len(np.unique(np.round(loss, 4))) == 5  # the five distinct architectures really differ


@pytest.mark.slow  # two more compilations of each evaluator (about 25 s of CPU)
def test_separate_weights_and_any_chunk(chain):
    """Per-candidate weights (no shared superkernel); a chunk larger than P."""
    space, table, _, _, x, y, _ = chain
    params, state = _trained_like(space, 3, shared=False)
    ops = _population(space, 1)
    _assert_same(E.evaluate_population(space, table, params, state, ops, x, y, chunk=16),
                 E.evaluate_loop(space, table, params, state, ops, x, y))


@pytest.mark.slow  # a second space: compiles both evaluators with recalibration again (about 35 s of CPU)
def test_mesh_equals_loop():
    space = _space("mesh")
    params, state = _trained_like(space, 4)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 5, 5, 1)), jnp.float32)
    y = jnp.arange(8) % 4
    bn = jnp.asarray(rng.standard_normal((2, 8, 5, 5, 1)), jnp.float32)
    table = analytic_table(space)
    ops = _population(space, 2)
    _assert_same(E.evaluate_population(space, table, params, state, ops, x, y, bn_batches=bn, chunk=4),
                 E.evaluate_loop(space, table, params, state, ops, x, y, bn_batches=bn))


@pytest.mark.slow
def test_recalibration_on_one_batch_is_train_mode_batch_norm(chain):
    """With K copies of batch b, the recalibrated statistics are b's batch statistics, so evaluating b in eval mode
    must give what train-mode batch norm gives on b (an oracle independent of how statistics are collected)."""
    space, table, params, state, x, y, _ = chain
    ops = _population(space, 3)
    got = E.evaluate_population(space, table, params, state, ops, x, y, bn_batches=jnp.stack([x, x, x]), chunk=4)
    train_logits = jax.jit(lambda o: SN.apply(space, params, state, onehot_gates(o, NUM_OPS), x, train=True)[0])
    for a in range(ops.shape[0]):
        logits = train_logits(ops[a])
        np.testing.assert_allclose(got["loss"][a], cross_entropy(logits, y), rtol=1e-4)
        acc = np.mean(np.argmax(np.asarray(logits), -1) == np.asarray(y))
        np.testing.assert_allclose(got["accuracy"][a], acc)


@pytest.mark.slow
def test_compiles_once_for_populations_of_one_size(chain, monkeypatch):
    """Two populations of one size: traced once (here without prefix sharing, chunks of 2, checked against the
    loop); a third of another size is traced again, which the counter reports."""
    space, table, params, state, x, y, _ = chain
    chex.clear_trace_counter()
    counted = jax.jit(chex.assert_max_traces(E._evaluate_population, n=1), static_argnames=E._STATIC_ARGS)
    monkeypatch.setattr(E, "_evaluate_population_jit", counted)
    run = lambda ops: E.evaluate_population(space, table, params, state, ops, x, y, chunk=2, share_prefixes=False)
    first, second = run(_population(space, 4)), run(_population(space, 5))
    assert not np.allclose(first["loss"], second["loss"])
    _assert_same(first, E.evaluate_loop(space, table, params, state, _population(space, 4), x, y))
    with pytest.raises(AssertionError, match="traced > 1"):  # the counter does count: another size retraces
        run(_population(space, 6)[:6])


def test_latency_is_arch_latency_per_architecture(chain):
    space, table, params, state, x, y, _ = chain
    ops = _population(space, 7)
    got = E.evaluate_population(space, table, params, state, ops, x, y)
    want = [float(arch_latency(space, table, o).total) for o in ops]
    np.testing.assert_allclose(got["latency_ms"], want, rtol=1e-6)
    assert len(set(np.round(want, 6))) > 1


@pytest.mark.parametrize("hw,k,stride", [(2, 7, 1), (5, 3, 2), (8, 5, 1), (8, 7, 2), (9, 3, 1)])
def test_depthwise_matches_xla_convolution(hw, k, stride):
    """Both forms of the channels-first depthwise conv (matrix per channel on small images, shifted sum on larger
    ones: (9, 3) is above the threshold) against XLA's grouped convolution."""
    rng = np.random.default_rng(hw * 100 + k * 10 + stride)
    h = jnp.asarray(rng.standard_normal((6, 3, hw, hw)), jnp.float32)  # [C, B, H, W]
    w = jnp.asarray(rng.standard_normal((k, k, 6)), jnp.float32)
    want = jax.jit(lambda h, w: depthwise_conv(jnp.transpose(h, (1, 2, 3, 0)), w, stride, impl="xla"))(h, w)
    got = jax.jit(lambda h, w: E._depthwise(h, w, stride))(h, w)
    np.testing.assert_allclose(np.transpose(got, (1, 2, 3, 0)), want, rtol=1e-5, atol=1e-5)
    assert E._small_image(hw, k) == (hw * hw <= 64)


def test_representatives_brute_force():
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 3, 40).astype(np.int32)
    col = rng.integers(0, 4, 40).astype(np.int32)
    got = np.asarray(E._representatives(jnp.asarray(prefix), jnp.asarray(col)))
    want = [min(b for b in range(40) if prefix[b] == prefix[a] and col[b] == col[a]) for a in range(40)]
    np.testing.assert_array_equal(got, want)


def test_chunk_branch_covers_every_member():
    """The branch a chunk runs pads to at least every member's kernel and expansion (all pairs of classes)."""
    space = _space("chain")
    for n in range(space.num_layers):
        cl = E._classes(space, n)
        lay = SN.layout(space, n)
        shapes = ([(0, 0)] if cl.has_identity else []) + [(k, e) for k in cl.kernels for e in cl.expands]
        for v1, v2 in itertools.product(range(len(lay.valid)), repeat=2):
            b = int(E._branch_of(cl, max(cl.k_index[v1], cl.k_index[v2]), max(cl.e_index[v1], cl.e_index[v2])))
            for v in (v1, v2):
                op = OPS[lay.valid[v]]
                assert shapes[b][0] >= op.kernel and shapes[b][1] >= op.expand


def test_bad_input_is_rejected_before_compute(chain):
    space, table, params, state, x, y, bn = chain
    ops = _population(space, 8)
    ev = lambda o=ops, xx=x, yy=y, **kw: E.evaluate_population(space, table, params, state, o, xx, yy, **kw)
    with pytest.raises(ValueError, match=r"archs_ops has shape \(7, 2\)"):
        ev(ops[:, :2])
    bad = ops.copy()
    bad[2, 0] = IDENTITY  # layer 0 changes shape: identity is masked there
    with pytest.raises(ValueError, match=r"archs_ops\[2, 0\] = 12"):
        ev(bad)
    with pytest.raises(ValueError, match="archs_ops must hold integer"):
        ev(ops.astype(np.float32))
    with pytest.raises(ValueError, match=r"x has shape \(12, 5, 5, 3\)"):
        ev(xx=jnp.zeros((12, 5, 5, 3)))
    with pytest.raises(ValueError, match=r"y has shape \(11,\)"):
        ev(yy=y[:11])
    with pytest.raises(ValueError, match="bn_batches has shape"):
        ev(bn_batches=bn[0])
    with pytest.raises(ValueError, match="chunk must be a positive integer, got 0"):
        ev(chunk=0)
    with pytest.raises(ValueError, match=r"archs_ops\[2, 0\]"):
        E.evaluate_loop(space, table, params, state, bad, x, y)
