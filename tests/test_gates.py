"""Gates over candidate ops: softmax, one-hot, Gumbel top-k sampling, two-path binary gates with the Lemma 1 /
eq. (5) gradient, Gumbel-softmax (soft and hard) and the temperature schedule (issue 2, item 4)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import gates as G
from jmsnas.space import NUM_OPS, OPS

R = NUM_OPS
PLAIN = np.array([not (o.is_identity or o.residual) for o in OPS])


def make_mask():
    """Row 0: all 13 valid; row 1: the 6 plain MBConvs (shape-changing slot); row 2: an irregular subset."""
    m = np.ones((3, R), bool)
    m[1] = PLAIN
    m[2] = False
    m[2, [0, 3, 4, 9, 12]] = True
    return m


MASK = make_mask()
# masked entries get large logits on purpose: they must never be chosen nor receive probability
ALPHA = np.where(MASK, np.random.default_rng(0).normal(0, 1.0, (3, R)), 8.0).astype(np.float32)
N_SAMPLES = 20000


def np_probs(alpha, mask):
    a = np.where(mask, alpha.astype(np.float64), -np.inf)
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


P = np_probs(ALPHA, MASK)


def eq5(alpha, paths, dl_dg):
    """Lemma 1 / eq. (5) written out: dL/dalpha_i = sum_j dL/dg_j p_j (delta_ij - p_i) over the sampled pair,
    with p renormalised over the pair; zero for the candidates that were not sampled."""
    alpha, dl_dg = np.asarray(alpha, np.float64), np.asarray(dl_dg, np.float64)
    out = np.zeros_like(alpha)
    for n, pair in enumerate(np.asarray(paths)):
        e = np.exp(alpha[n, pair] - alpha[n, pair].max())
        p = e / e.sum()
        for a, i in enumerate(pair):
            out[n, i] = sum(dl_dg[n, j] * p[b] * ((a == b) - p[a]) for b, j in enumerate(pair))
    return out


def test_probabilities_and_softmax_gates():
    p = np.asarray(G.probabilities(jnp.asarray(ALPHA), jnp.asarray(MASK)))
    np.testing.assert_allclose(p, P, rtol=1e-5, atol=1e-7)
    assert np.all(p[~MASK] == 0)
    g = G.softmax_gates(jnp.asarray(ALPHA), jnp.asarray(MASK))
    assert g.paths is None
    np.testing.assert_allclose(np.asarray(g.weights), P, rtol=1e-5, atol=1e-7)


def test_onehot_gates():
    g = G.onehot_gates([2, 0, 12], R)
    assert g.weights.shape == (3, R) and g.paths.shape == (3, 1) and g.paths.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(g.weights), np.eye(R)[[2, 0, 12]])
    np.testing.assert_array_equal(np.asarray(g.paths)[:, 0], [2, 0, 12])


def test_derive_ignores_masked_logits():
    ops = np.asarray(G.derive(jnp.asarray(ALPHA), jnp.asarray(MASK)))
    np.testing.assert_array_equal(ops, np.argmax(np.where(MASK, ALPHA, -np.inf), -1))
    assert all(MASK[n, i] for n, i in enumerate(ops))


def _many_paths(k):
    keys = jax.random.split(jax.random.PRNGKey(42), N_SAMPLES)
    fn = jax.vmap(lambda key: G.sample_paths(key, jnp.asarray(ALPHA), jnp.asarray(MASK), k))
    return np.asarray(fn(keys))  # [S, N, k]


@pytest.mark.parametrize("k", [2, 3])
def test_sample_paths_distinct_and_valid(k):
    paths = _many_paths(k)
    assert paths.shape == (N_SAMPLES, 3, k) and paths.dtype == np.int32
    s = np.sort(paths, -1)
    assert np.all(s[..., 1:] != s[..., :-1]), "sampled paths of a layer must be distinct"
    rows = np.broadcast_to(np.arange(3)[None, :, None], paths.shape)
    assert MASK[rows, paths].all(), "a masked candidate was sampled"


def test_sample_paths_frequencies_match_sampling_without_replacement():
    paths = _many_paths(2)
    for n in range(3):
        first = np.bincount(paths[:, n, 0], minlength=R) / N_SAMPLES
        # std of a frequency is <= 0.0036 at this sample size; 0.015 is over 4 sigma
        np.testing.assert_allclose(first, P[n], atol=0.015)
        # ordered pair (i, j): p_i * p_j / (1 - p_i)
        pair = np.zeros((R, R))
        np.add.at(pair, (paths[:, n, 0], paths[:, n, 1]), 1.0 / N_SAMPLES)
        with np.errstate(invalid="ignore", divide="ignore"):
            expect = np.nan_to_num(P[n][:, None] * P[n][None, :] / (1 - P[n][:, None]))
        np.fill_diagonal(expect, 0.0)
        np.testing.assert_allclose(pair, expect, atol=0.01)


def test_binary_gate_weights_forward_is_onehot_of_active_path():
    paths = jnp.array([[3, 7], [0, 2], [9, 4]], jnp.int32)
    active = jnp.array([1, 0, 1], jnp.int32)
    w = np.asarray(G.binary_gate_weights(jnp.asarray(ALPHA), paths, active))
    np.testing.assert_array_equal(w, np.eye(R)[[7, 0, 4]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binary_gate_vjp_is_eq5_on_the_sampled_pair(seed):
    rng = np.random.default_rng(seed)
    alpha = jnp.asarray(rng.normal(0, 2, (3, R)), jnp.float32)
    paths = jnp.asarray(np.stack([rng.choice(np.flatnonzero(MASK[n]), 2, replace=False) for n in range(3)]),
                        jnp.int32)
    active = jnp.asarray(rng.integers(0, 2, 3), jnp.int32)
    dl_dg = rng.normal(0, 1, (3, R)).astype(np.float32)  # nonzero also off the pair: must be ignored
    _, vjp = jax.vjp(lambda a: G.binary_gate_weights(a, paths, active), alpha)
    (got,) = vjp(jnp.asarray(dl_dg))
    want = eq5(alpha, paths, dl_dg)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    off = np.ones((3, R), bool)
    off[np.arange(3)[:, None], np.asarray(paths)] = False
    assert np.all(np.asarray(got)[off] == 0)
    # eq. (5) on a pair sums to zero (softmax is shift invariant)
    np.testing.assert_allclose(np.asarray(got).sum(-1), 0.0, atol=1e-6)


def test_two_path_gates_gradient_and_structure():
    alpha, mask = jnp.asarray(ALPHA), jnp.asarray(MASK)
    c = jnp.asarray(np.random.default_rng(3).normal(0, 1, (3, R)), jnp.float32)
    for seed in range(4):
        key = jax.random.PRNGKey(seed)
        g = G.two_path_gates(key, alpha, mask)
        paths, w = np.asarray(g.paths), np.asarray(g.weights)
        assert paths.shape == (3, 2) and np.all(paths[:, 0] != paths[:, 1])
        assert MASK[np.arange(3)[:, None], paths].all()
        # one active candidate, one of the pair
        assert np.all(w.sum(-1) == 1) and np.all(np.isin(w.argmax(-1)[:, None], paths).any(-1))
        assert np.all(w[np.arange(3), w.argmax(-1)] == 1)
        grad = jax.grad(lambda a: jnp.sum(G.two_path_gates(key, a, mask).weights * c))(alpha)
        np.testing.assert_allclose(np.asarray(grad), eq5(alpha, paths, c), rtol=1e-5, atol=1e-6)


def test_two_path_active_choice_frequency():
    """P(active = i) = sum_j [P(i, j) + P(j, i)] * p_i / (p_i + p_j) (pair sampled, then active within it)."""
    keys = jax.random.split(jax.random.PRNGKey(7), N_SAMPLES)
    w = jax.vmap(lambda k: G.two_path_gates(k, jnp.asarray(ALPHA), jnp.asarray(MASK)).weights)(keys)
    freq = np.asarray(w).mean(0)
    for n in range(3):
        p = P[n]
        want = np.zeros(R)
        for i in np.flatnonzero(MASK[n]):
            for j in np.flatnonzero(MASK[n]):
                if i != j:
                    pij = p[i] * p[j] / (1 - p[i]) + p[j] * p[i] / (1 - p[j])
                    want[i] += pij * p[i] / (p[i] + p[j])
        np.testing.assert_allclose(want.sum(), 1.0, rtol=1e-9)
        np.testing.assert_allclose(freq[n], want, atol=0.015)


def test_single_path_gates():
    g = G.single_path_gates(jax.random.PRNGKey(0), jnp.asarray(ALPHA), jnp.asarray(MASK))
    paths = np.asarray(g.paths)
    assert paths.shape == (3, 1) and MASK[np.arange(3), paths[:, 0]].all()
    np.testing.assert_array_equal(np.asarray(g.weights), np.eye(R)[paths[:, 0]])


@pytest.mark.parametrize("tau", [0.01, 1.0])
@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_gumbel_soft_and_hard_finite_with_finite_gradients(tau, scale):
    alpha, mask = jnp.asarray(ALPHA) * scale, jnp.asarray(MASK)
    c = jnp.asarray(np.random.default_rng(4).normal(0, 1, (3, R)), jnp.float32)
    for seed in range(3):
        key = jax.random.PRNGKey(seed)
        soft = np.asarray(G.gumbel_softmax_gates(key, alpha, mask, tau).weights)
        hard_g = G.gumbel_softmax_gates(key, alpha, mask, tau, hard=True)
        hard = np.asarray(hard_g.weights)
        assert hard_g.paths is None
        assert np.isfinite(soft).all() and np.isfinite(hard).all()
        np.testing.assert_allclose(soft.sum(-1), 1.0, rtol=1e-5)
        assert np.all(soft[~MASK] == 0) and np.all(hard[~MASK] == 0)
        # straight-through hard gates are the one-hot of the soft argmax in the forward pass
        np.testing.assert_allclose(hard, np.eye(R)[soft.argmax(-1)], atol=1e-6)
        assert MASK[np.arange(3), hard.argmax(-1)].all()
        loss = lambda a, h: jnp.sum(G.gumbel_softmax_gates(key, a, mask, tau, hard=h).weights * c)
        g_soft, g_hard = jax.grad(loss)(alpha, False), jax.grad(loss)(alpha, True)
        assert np.isfinite(np.asarray(g_soft)).all() and np.isfinite(np.asarray(g_hard)).all()
        # straight-through: the backward pass is the soft one
        np.testing.assert_allclose(np.asarray(g_hard), np.asarray(g_soft), rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(g_soft)[~MASK] == 0)


def test_gumbel_hard_argmax_frequency_matches_p():
    """Gumbel-max: argmax(alpha + Gumbel) is distributed as softmax(alpha), at any temperature."""
    keys = jax.random.split(jax.random.PRNGKey(11), N_SAMPLES)
    w = jax.vmap(lambda k: G.gumbel_softmax_gates(k, jnp.asarray(ALPHA), jnp.asarray(MASK), 0.5, True).weights)(keys)
    np.testing.assert_allclose(np.asarray(w).mean(0), P, atol=0.015)


@pytest.mark.slow
def test_gumbel_soft_gradient_matches_finite_differences():
    key, mask = jax.random.PRNGKey(5), jnp.asarray(MASK)
    c = jnp.asarray(np.random.default_rng(6).normal(0, 1, (3, R)), jnp.float32)
    with jax.enable_x64(True):
        alpha = jnp.asarray(ALPHA, jnp.float64)
        f = lambda a: jnp.sum(G.gumbel_softmax_gates(key, a, mask, 0.7).weights * c.astype(jnp.float64))
        grad = np.asarray(jax.grad(f)(alpha))
        eps = 1e-6
        for n, i in [(0, 0), (0, 12), (1, int(np.flatnonzero(PLAIN)[2])), (2, 9)]:
            e = np.zeros((3, R))
            e[n, i] = eps
            fd = (f(alpha + e) - f(alpha - e)) / (2 * eps)
            np.testing.assert_allclose(grad[n, i], float(fd), rtol=1e-5, atol=1e-9)


def test_temperature_schedule_values_and_floor():
    sched = G.temperature_schedule(tau0=5.0, tau_min=0.5, decay=0.5, steps_per_decay=2)
    assert float(sched(0)) == pytest.approx(5.0)
    assert float(sched(2)) == pytest.approx(2.5)
    assert float(sched(3)) == pytest.approx(5.0 * 0.5 ** 1.5, rel=1e-5)
    assert float(sched(100)) == pytest.approx(0.5)
    vals = [float(sched(s)) for s in range(12)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    # decay = 1 is allowed and means a constant tau0 (max(tau_min, tau0 * 1^s))
    flat = G.temperature_schedule(tau0=1.0, tau_min=0.1, decay=1.0)
    assert [float(flat(s)) for s in (0, 1, 1000)] == pytest.approx([1.0, 1.0, 1.0])


@pytest.mark.parametrize("kw, bad", [(dict(tau0=0.0), "0.0"), (dict(tau_min=-1.0), "-1.0"),
                                     (dict(decay=1.5), "1.5"), (dict(decay=0.0), "0.0"),
                                     (dict(steps_per_decay=0), "steps_per_decay"),
                                     (dict(steps_per_decay=-3), "-3")])
def test_temperature_schedule_rejects_bad_values(kw, bad):
    with pytest.raises(ValueError, match=re.escape(bad)):
        G.temperature_schedule(**kw)


def test_arch_gates_modes_and_bad_mode():
    key, alpha, mask = jax.random.PRNGKey(0), jnp.asarray(ALPHA), jnp.asarray(MASK)
    assert set(G.GATE_MODES) == {"two_path", "gumbel_soft", "gumbel_hard", "softmax"}
    tp = G.arch_gates("two_path", key, alpha, mask)
    assert tp.paths.shape == (3, 2)
    sm = G.arch_gates("softmax", key, alpha, mask)
    np.testing.assert_allclose(np.asarray(sm.weights), P, rtol=1e-5, atol=1e-7)
    gs = G.arch_gates("gumbel_soft", key, alpha, mask, tau=0.3)
    np.testing.assert_allclose(np.asarray(gs.weights),
                               np.asarray(G.gumbel_softmax_gates(key, alpha, mask, 0.3).weights))
    gh = G.arch_gates("gumbel_hard", key, alpha, mask, tau=0.3)
    assert gh.paths is None and set(np.unique(np.round(np.asarray(gh.weights), 5))) <= {0.0, 1.0}
    with pytest.raises(ValueError, match=re.escape("unknown gate mode 'darts'")):
        G.arch_gates("darts", key, alpha, mask)
