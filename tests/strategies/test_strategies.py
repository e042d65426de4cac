"""Tests of the search strategies (evolution, REINFORCE with two policies, tabular Q-learning) and reward shapes."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas.space import Arch
from jmsnas.strategies import STRATEGIES, best, make, run, step_fn
from jmsnas.strategies import evolution as evo
from jmsnas.strategies import qlearning as ql
from jmsnas.strategies import reinforce as rf

# tiny programs: compile them without XLA's optimisation passes (compile time dominates)
pytestmark = pytest.mark.usefixtures("fast_compiles")


# The toy space: N=4 layers x R=4 ops, some masked; fitness = sum_n table[n, op_n]. Each row of the table is a
# permutation of 0..3, so the optimum is unique with a margin of 1 per layer.
MASK = np.array([[1, 0, 1, 1],
                 [1, 1, 1, 1],
                 [0, 1, 1, 0],
                 [1, 1, 0, 1]], bool)


def toy_table(seed):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(4) for _ in range(4)]).astype(np.float32)


def table_fitness(table):
    """fitness(archs) = sum_n table[n, archs.ops[..., n]] -> float32[P]."""
    table = jnp.asarray(table)
    return lambda archs: jnp.take_along_axis(table[None], archs.ops[..., None], axis=-1)[..., 0].sum(-1)


def brute_force_optimum(mask, table):
    """(ops, fitness) of the best valid architecture, by enumerating every one."""
    valid = [np.flatnonzero(row) for row in mask]
    best_ops = max(itertools.product(*valid), key=lambda ops: sum(table[n, o] for n, o in enumerate(ops)))
    return np.array(best_ops), float(sum(table[n, o] for n, o in enumerate(best_ops)))


def assert_valid(ops, mask):
    ops = np.asarray(ops)
    assert ops.min() >= 0 and ops.max() < mask.shape[1]
    assert np.all(mask[np.arange(mask.shape[0]), ops]), ops


# Small hyperparameters for every registered strategy (the equivalence test runs each four ways).
SMALL = {
    "evolution": dict(population=6),
    "reinforce": dict(population=4, learning_rate=0.1),
    "reinforce_lstm": dict(population=4, learning_rate=0.01, hidden=8),
    "qlearning": dict(population=4, history=None, learning_rate=0.5, epsilon=0.3),
}


def test_registry_covers_all_strategies():
    assert set(STRATEGIES) == set(SMALL)
    with pytest.raises(ValueError, match="'nope'"):
        make("nope", mask=MASK)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "reinforce_lstm" else n  # LSTM: slowest
                                  for n in sorted(SMALL)])
def test_loop_scan_and_jit_agree(name):
    """3 steps as a Python loop (eager and jitted step) and inside lax.scan (eager and jitted) give the same
    architectures (exactly), states and metrics (to 1e-4, 1% of one step at learning rate 0.01) for the same
    key, and every asked architecture is valid."""
    strategy = make(name, mask=MASK, **SMALL[name])
    fitness = table_fitness(toy_table(0))
    key, steps = jax.random.key(7), 3
    k_init, k_run = jax.random.split(key)
    step = step_fn(strategy, fitness)

    def loop(step, ask=None):
        state, ms, asked = strategy.init(k_init), [], []
        for k in jax.random.split(k_run, steps):
            if ask is not None:
                asked.append(ask(jax.random.split(k)[0], state)[0].ops)
            state, m = step(state, k)
            ms.append(m)
        return state, jax.tree.map(lambda *x: jnp.stack(x), *ms), asked

    eager_state, eager_m, _ = loop(step)
    ask = jax.jit(strategy.ask)
    jit_state, jit_m, asked = loop(jax.jit(step), ask)
    scan_state, scan_m = run(strategy, fitness, key, steps)
    jscan_state, jscan_m = jax.jit(run, static_argnums=(0, 1, 3))(strategy, fitness, key, steps)
    for ops in asked:
        assert_valid(ops.reshape(-1, 4), MASK)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    for other_state, other_m in ((jit_state, jit_m), (scan_state, scan_m), (jscan_state, jscan_m)):
        jax.tree.map(close, eager_state, other_state)
        jax.tree.map(close, eager_m, other_m)
        np.testing.assert_array_equal(eager_state.best_ops, other_state.best_ops)
        np.testing.assert_array_equal(ask(key, eager_state)[0].ops, ask(key, other_state)[0].ops)


# ------------------------------------------------------------------------------------- toy problems with an optimum

def _check_reaches(runs_state, tables, picked):
    """Every vmapped run (one per toy table) found the brute-force optimum; ``picked`` are its final choices."""
    for i, table in enumerate(tables):
        ops, f = brute_force_optimum(MASK, table)
        np.testing.assert_array_equal(np.asarray(picked[i]), ops)
        assert float(runs_state.best_fitness[i]) == f


TABLES = np.stack([toy_table(s) for s in range(4)])


def _vmapped_runs(strategy, steps):
    """Runs ``strategy`` once per toy table (each with its own key) in one compiled program."""

    def one(table, key):
        return run(strategy, table_fitness(table), key, steps)[0]

    return jax.jit(jax.vmap(one))(jnp.asarray(TABLES), jax.random.split(jax.random.key(0), len(TABLES)))


@pytest.mark.slow
def test_evolution_reaches_optimum():
    """Budget: population 16 x 8 generations = 128 evaluations (the space has 3*4*2*3 = 72 architectures)."""
    state = _vmapped_runs(make("evolution", mask=MASK, population=16), 8)
    _check_reaches(state, TABLES, state.population[:, 0])  # the population is sorted, best first


def test_evolution_reaches_optimum_of_larger_space():
    """N=12 x R=6 (about 1.5e9 architectures, random mask): population 64 x 30 generations find the additive
    optimum, which is the per-layer maximum."""
    rng = np.random.default_rng(1)
    mask = rng.random((12, 6)) < 0.7
    mask[np.arange(12), rng.integers(0, 6, 12)] = True
    table = rng.permutation(72).reshape(12, 6).astype(np.float32)
    state, _ = jax.jit(lambda k: run(make("evolution", mask=mask, population=64), table_fitness(table), k, 30))(
        jax.random.key(3))
    opt = np.argmax(np.where(mask, table, -np.inf), axis=1)
    np.testing.assert_array_equal(best(state)[0].ops, opt)
    assert float(best(state)[1]) == float(table[np.arange(12), opt].sum())


@pytest.mark.parametrize("policy,hp,steps", [
    ("independent", dict(population=8, learning_rate=0.05), 50),
    ("lstm", dict(population=8, learning_rate=0.01, hidden=16), 40),
])
def test_reinforce_policy_mode_is_optimum(policy, hp, steps):
    """Budget: 8 samples x 50 (independent) / 40 (LSTM) steps; the policy's greedy decoding is the optimum."""
    name = "reinforce" if policy == "independent" else "reinforce_lstm"
    state = _vmapped_runs(make(name, mask=MASK, **hp), steps)
    pol = rf.make_policy(MASK, policy, hp.get("hidden", 100))
    modes = jax.vmap(pol.mode)(state.params)
    _check_reaches(state, TABLES, modes)


@pytest.mark.slow
def test_qlearning_greedy_policy_is_optimum():
    """Budget: 8 episodes x 30 tells with the prefix-tree state (history=None), learning rate 1, optimistic
    initial Q (above the best return 12); the greedy rollout of the learned table is the optimum."""
    s = make("qlearning", mask=MASK, history=None, population=8, learning_rate=1.0, epsilon=0.2, q_init=20.0)
    state = _vmapped_runs(s, 30)
    env = ql.chain_env(MASK, None)
    greedy = jax.vmap(lambda q: ql.greedy_rollout(q, env, 4).actions)(state.q)
    _check_reaches(state, TABLES, greedy)


def _brute_force_split(load, k, tol):
    n, target, best_r = len(load), load.sum() / k, -np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0,) + cuts + (n,)
        best_r = max(best_r, sum(0.0 if abs(load[b[i]:b[i + 1]].sum() - target) <= tol else -1.0
                                 for i in range(k)))
    return best_r


@pytest.mark.parametrize("tol", [0.5, 1.5])
def test_qlearning_balanced_split_env(tol):
    """Paper 002's problem (8 blocks into 3 children): 300 online episodes, then the greedy rollout's return
    equals the brute-force best over all splits, and its cuts are increasing and end at N."""
    load = np.array([5, 1, 1, 2, 1, 5, 5, 3], float)
    env = ql.balanced_split_env(load, 3, tol)
    q0 = jnp.zeros(env.valid.shape, jnp.float32)
    q, _ = jax.jit(lambda key: ql.train(key, q0, env, 300, 0.3, 0.5, 1.0, 3))(jax.random.key(0))
    ep = ql.greedy_rollout(q, env, 3)
    assert float(ep.total_reward) == _brute_force_split(load, 3, tol)
    cuts = np.asarray(ep.actions)
    assert cuts[-1] == 8 and np.all(np.diff(cuts) > 0) and int(ep.length) == 3


# --------------------------------------------------------------------------------------------- operators and pieces

def test_mutation_and_crossover_respect_mask():
    rng = np.random.default_rng(0)
    mask = rng.random((10, 13)) < 0.4
    mask[np.arange(10), rng.integers(0, 13, 10)] = True
    m = jnp.asarray(mask)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    a = evo.sample_valid(k1, m, 500)
    b = evo.sample_valid(k2, m, 500)
    assert_valid(a.reshape(-1, 10), mask)
    full = evo.mutate(k3, a, m, 1.0)
    assert_valid(full, mask)
    # with probability 1 every valid op shows up at every layer; with probability 0 nothing changes
    for n in range(10):
        assert set(np.unique(full[:, n]).tolist()) == set(np.flatnonzero(mask[n]).tolist())
    np.testing.assert_array_equal(evo.mutate(k3, a, m, 0.0), a)
    child = evo.crossover(k4, a, b)
    assert_valid(child, mask)
    assert np.all((child == a) | (child == b))
    frac_a = float(jnp.mean((child == a) & (a != b)) / jnp.mean(a != b))
    assert 0.45 < frac_a < 0.55


@pytest.mark.slow
def test_evolution_discards_infeasible_children():
    """Children violating the hard constraint (op 0 at layer 0, told as -inf or feasible=False) never enter the
    population once enough feasible ones exist; the best feasible candidate is never lost."""
    table = toy_table(1)
    fit = table_fitness(table)
    s = make("evolution", mask=MASK, population=8)
    for how in ("inf", "flag"):
        state = s.init(jax.random.key(1))
        best_seen = -np.inf
        for k in jax.random.split(jax.random.key(2), 6):
            archs, state = s.ask(k, state)
            f = fit(archs)
            bad = archs.ops[:, 0] == 0
            if how == "inf":
                state, m = s.tell(k, archs, jnp.where(bad, -jnp.inf, f), state)
            else:
                state, m = s.tell(k, archs, f, state, feasible=~bad)
            best_seen = max(best_seen, float(jnp.max(jnp.where(bad, -jnp.inf, f))))
            np.testing.assert_allclose(float(m["feasible_fraction"]), float(jnp.mean(~bad)))
            fin = np.isfinite(np.asarray(state.fitness))
            assert np.all(np.asarray(state.population)[fin, 0] != 0)
            assert float(state.fitness[0]) == best_seen == float(state.best_fitness)
        assert fin.all()


@pytest.mark.slow
def test_lstm_policy_is_a_distribution_over_valid_archs():
    """exp(log pi) summed over every architecture of a 3 x 3 space is 1, and masked ones get probability 0."""
    mask = np.array([[1, 0, 1], [1, 1, 1], [0, 1, 1]], bool)
    pol = rf.make_policy(mask, "lstm", hidden=6)
    params = pol.init(jax.random.key(0))
    everything = jnp.asarray(list(itertools.product(range(3), repeat=3)), jnp.int32)
    lp, ent = pol.log_prob(params, everything)
    p = np.exp(np.asarray(lp, np.float64))
    ok = mask[np.arange(3), np.asarray(everything)].all(axis=1)
    np.testing.assert_allclose(p[ok].sum(), 1.0, rtol=1e-5)
    assert np.all(p[~ok] == 0)
    assert np.all(np.asarray(ent) > 0)
    samples = pol.sample(params, jax.random.key(1), 2000)
    assert_valid(samples, mask)
    # empirical frequencies of the 12 valid archs match exp(log pi) within sampling error
    codes = np.asarray(samples) @ np.array([9, 3, 1])
    freq = np.bincount(codes, minlength=27) / 2000.0
    np.testing.assert_allclose(freq, p, atol=0.04)


def test_independent_policy_log_prob_by_hand():
    mask = np.array([[1, 1, 0], [1, 1, 1]], bool)
    pol = rf.make_policy(mask, "independent")
    params = {"logits": jnp.array([[0.0, np.log(3.0), 5.0], [0.0, 0.0, 0.0]])}
    lp, ent = pol.log_prob(params, jnp.array([[1, 2], [0, 0]]))
    np.testing.assert_allclose(lp, [np.log(0.75 / 3), np.log(0.25 / 3)], rtol=1e-6)
    h = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75)) + np.log(3.0)
    np.testing.assert_allclose(ent, [h, h], rtol=1e-6)
    np.testing.assert_array_equal(pol.mode(params), [1, 0])


def test_reinforce_baseline_and_update_direction():
    """First tell: baseline = mean reward; then b <- d b + (1 - d) mean(r). The sampled arch with the higher
    reward gains probability."""
    s = make("reinforce", mask=MASK, population=2, learning_rate=0.1, baseline_decay=0.5)
    state = s.init(jax.random.key(0))
    archs = Arch(jnp.array([[0, 0, 1, 0], [2, 1, 2, 1]], jnp.int32))
    state, m = s.tell(None, archs, jnp.array([1.0, 3.0]), state)
    assert float(state.baseline) == 2.0
    pol = rf.make_policy(MASK)
    lp = pol.log_prob(state.params, archs.ops)[0]
    assert lp[1] > lp[0]
    state, _ = s.tell(None, archs, jnp.array([5.0, 7.0]), state)
    assert float(state.baseline) == 0.5 * 2.0 + 0.5 * 6.0
    # a non-finite reward is treated as the batch's worst finite reward
    state2, m2 = s.tell(None, archs, jnp.array([-jnp.inf, 4.0]), state)
    assert float(m2["mean_reward"]) == 4.0


@pytest.mark.slow
def test_q_update_and_epsilon_greedy_by_hand():
    env = ql.make_env(np.array([[1, 2], [2, 2], [2, 2]]), np.array([[1.0, 0.0], [0.0, 5.0], [0, 0]]),
                      np.array([[True, True], [True, False], [True, True]]), np.array([False, False, True]), 0)
    q = jnp.array([[0.0, 0.0], [2.0, 9.0], [7.0, 7.0]])
    # target = 1 + 0.9 * max over *valid* actions of state 1 (= 2, action 1 is invalid) -> 2.8
    q2 = ql.q_update(q, env, 0, 0, 1.0, 0.5, 0.9)
    np.testing.assert_allclose(q2[0, 0], 0.5 * 2.8)
    # into a terminal state the target is the reward alone
    np.testing.assert_allclose(ql.q_update(q, env, 1, 0, 4.0, 1.0, 0.9)[1, 0], 4.0)
    keys = jax.random.split(jax.random.key(0), 200)
    picks = jax.vmap(lambda k: ql.epsilon_greedy(k, q[1], env.valid[1], 0.0))(keys)
    assert np.all(np.asarray(picks) == 0)  # greedy among valid actions ignores the larger invalid Q
    tie = jax.vmap(lambda k: ql.epsilon_greedy(k, jnp.zeros(2), jnp.array([True, True]), 0.0))(keys)
    assert 0.3 < float(jnp.mean(tie)) < 0.7  # ties are broken at random


def test_reward_shapes_by_hand():
    np.testing.assert_allclose(rf.proxyless_reward(0.8, 20.0, 10.0, 0.5), 0.8 * 0.5 ** 0.5, rtol=1e-6)
    np.testing.assert_allclose(rf.mnasnet_reward(0.8, 20.0, 10.0), 0.8 * 2.0 ** -0.07, rtol=1e-6)
    np.testing.assert_allclose(rf.mnasnet_reward(0.8, 5.0, 10.0), 0.8 * 0.5 ** -0.07, rtol=1e-6)
    np.testing.assert_allclose(rf.mnasnet_hard_reward(0.8, 5.0, 10.0), 0.8, rtol=1e-6)
    np.testing.assert_allclose(rf.mnasnet_hard_reward(0.8, 10.0, 10.0), 0.8, rtol=1e-6)
    np.testing.assert_allclose(rf.mnasnet_hard_reward(0.8, 40.0, 10.0), 0.2, rtol=1e-6)
    np.testing.assert_allclose(rf.tunas_reward(0.8, 12.0, 10.0, -0.5), 0.7, rtol=1e-6)
    np.testing.assert_allclose(rf.tunas_reward(0.8, 8.0, 10.0, -0.5), 0.7, rtol=1e-6)
    out = jax.jit(rf.mnasnet_hard_reward)(jnp.array([0.5, 0.5]), jnp.array([5.0, 20.0]), 10.0)
    np.testing.assert_allclose(out, [0.5, 0.25], rtol=1e-6)
    with pytest.raises(ValueError, match="0.3"):
        rf.tunas_reward(0.8, 12.0, 10.0, 0.3)


@pytest.mark.parametrize("name,kwargs,needle", [
    ("evolution", dict(population=1), "population.*1"),
    ("evolution", dict(parent_ratio=0.0), "parent_ratio.*0.0"),
    ("evolution", dict(mutation_prob=1.5), "mutation_prob.*1.5"),
    ("reinforce", dict(learning_rate=-0.1), "learning_rate.*-0.1"),
    ("reinforce_lstm", dict(learning_rate=-1e-3), "learning_rate.*-0.001"),
    ("reinforce", dict(policy="gru"), "'gru'"),
    ("reinforce", dict(population=0), "population.*0"),
    ("qlearning", dict(epsilon=1.5), "epsilon.*1.5"),
    ("qlearning", dict(epsilon=-0.1), "epsilon.*-0.1"),
    ("qlearning", dict(learning_rate=-0.5), "learning_rate.*-0.5"),
    ("qlearning", dict(discount=2.0), "discount.*2.0"),
])
def test_bad_hyperparameters(name, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        make(name, mask=MASK, **kwargs)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_bad_mask(name):
    bad = MASK.copy()
    bad[2] = False
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        make(name, mask=bad)
    with pytest.raises(ValueError, match="shape"):
        make(name, mask=np.ones(4, bool))


def test_bad_environments():
    with pytest.raises(ValueError, match=r"states \[1\]"):
        ql.make_env([[1], [1]], [[0.0], [0.0]], [[True], [False]], [False, False], 0)
    with pytest.raises(ValueError, match="range"):
        ql.make_env([[5]], [[0.0]], [[True]], [False], 0)
    with pytest.raises(ValueError, match="k = 4"):
        ql.balanced_split_env([1.0, 2.0, 3.0], 4, 0.1)
    with pytest.raises(ValueError, match="exactly one"):
        make("qlearning")
    with pytest.raises(ValueError, match="states"):
        ql.chain_env(np.ones((30, 13), bool), None)
