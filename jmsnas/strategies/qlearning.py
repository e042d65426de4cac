"""Tabular Q-learning with epsilon-greedy exploration over a caller-supplied deterministic environment.

Paper 002 splits a pretrained model of N blocks into k children whose loading times are balanced: the agent picks
split positions, and the reward of a child is 0 when its loading time is within a tolerance of T / k (T the whole
model's loading time) and -1 otherwise (its eq. 4); the Q table is updated with eq. 5. ``balanced_split_env``
builds that problem as a ``TabularEnv``. The update here is the standard Q-learning target
``r + gamma * max_{a' valid} Q(s', a')`` (0 after a terminal state).

Two ways to use it:

* ``run_episode`` / ``train`` / ``greedy_rollout``: online Q-learning in a ``TabularEnv`` (transition table
  int32[S, A], reward float32[S, A], valid bool[S, A], terminal bool[S], start state), pure and built from lax loops.
* The registered ``"qlearning"`` strategy (ask/tell): an episode's action sequence is the "architecture". With a
  bool[N, R] op mask the environment is ``chain_env(mask)`` (state n = "choose the op of layer n", as in
  MetaQNN), so an episode is an Arch. ``ask`` samples P epsilon-greedy episodes without learning; ``tell`` adds the
  caller's fitness to the reward of each episode's last step and replays the episodes one after another, each
  from its last step back to its first (so a terminal reward reaches the first decision in one replay). A
  non-finite fitness (a hard-constraint violation) becomes the smallest finite fitness of the batch. With a
  general env, actions after the terminal state are -1.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.space import Arch
from jmsnas.strategies.base import (Strategy, check_float, check_int, check_mask, finite_or_worst, register,
                                    update_best)


class TabularEnv(NamedTuple):
    transition: jnp.ndarray  # int32[S, A], next state
    reward: jnp.ndarray  # float32[S, A], reward of taking action a in state s
    valid: jnp.ndarray  # bool[S, A], actions allowed in each state
    terminal: jnp.ndarray  # bool[S], episodes end on entering these
    start: jnp.ndarray  # int32[], initial state


def make_env(transition, reward, valid, terminal, start) -> TabularEnv:
    """Validated ``TabularEnv``: consistent shapes, next states in range, a valid action in every non-terminal
    state, a non-terminal start."""
    tr, rw, va, te = (np.asarray(x) for x in (transition, reward, valid, terminal))
    if tr.ndim != 2 or tr.shape[0] < 1 or tr.shape[1] < 1:
        raise ValueError(f"transition must have shape [S states, A actions], got {tr.shape}")
    s, a = tr.shape
    if rw.shape != (s, a) or va.shape != (s, a) or te.shape != (s,):
        raise ValueError(f"reward {rw.shape}, valid {va.shape}, terminal {te.shape} must be [{s}, {a}], "
                         f"[{s}, {a}], [{s}]")
    if va.dtype != np.bool_ or te.dtype != np.bool_:
        raise ValueError(f"valid and terminal must be bool, got {va.dtype} and {te.dtype}")
    if not np.issubdtype(tr.dtype, np.integer) or tr.min() < 0 or tr.max() >= s:
        raise ValueError(f"transition must hold state indices in [0, {s}), got range [{tr.min()}, {tr.max()}]")
    stuck = np.flatnonzero(~te & ~va.any(axis=1))
    if stuck.size:
        raise ValueError(f"non-terminal states {stuck.tolist()} have no valid action")
    if not np.all(np.isfinite(rw)):
        raise ValueError("reward must be finite")
    start = check_int("start", start, 0)
    if start >= s or te[start]:
        raise ValueError(f"start must be a non-terminal state in [0, {s}), got {start}")
    return TabularEnv(jnp.asarray(tr, jnp.int32), jnp.asarray(rw, jnp.float32), jnp.asarray(va),
                      jnp.asarray(te), jnp.asarray(start, jnp.int32))


MAX_STATES = 1_000_000


def chain_env(mask, history: int | None = 1) -> TabularEnv:
    """The architecture MDP of a bool[N, R] op mask: the action at layer n is its op (valid = mask[n]); the state
    is (layer n, the ops of the last ``history`` layers). ``history=1`` is MetaQNN's (layer, previous layer)
    state, N + (N - 1) R states; ``history=None`` remembers every earlier op (the prefix tree, sum_n R^n states,
    capped at MAX_STATES), the only choice under which a fitness told at the end is Markov, so Q-learning then
    converges to the optimum; with a shorter history the value of early decisions is averaged over the
    forgotten ones. States are numbered layer by layer (state 0 = layer 0, the last state is terminal); all
    rewards are 0, the fitness comes at the end."""
    m = check_mask(mask)
    n, r = m.shape
    h = n - 1 if history is None else check_int("history", history, 0)
    width = [r ** min(layer, h) for layer in range(n)]  # codes per layer (Python ints: no overflow)
    num_s = sum(width) + 1
    if num_s > MAX_STATES:
        raise ValueError(f"history={history} gives {num_s} states for N={n}, R={r}; at most {MAX_STATES}")
    offset = np.concatenate([[0], np.cumsum(width)])
    end = num_s - 1
    tr = np.full((num_s, r), end, np.int32)
    valid = np.ones((num_s, r), bool)
    for layer in range(n):
        for code in range(width[layer]):
            s = offset[layer] + code
            valid[s] = m[layer]
            if layer + 1 < n:
                tr[s] = offset[layer + 1] + (code * r + np.arange(r)) % width[layer + 1]
    terminal = np.arange(num_s) == end
    return make_env(tr, np.zeros((num_s, r), np.float32), valid, terminal, 0)


def balanced_split_env(load_ms, k: int, tol_ms: float) -> TabularEnv:
    """Paper 002's split problem: cut N blocks with loading times ``load_ms`` float[N] (ms) into k contiguous
    children. State (j, p) = j children made, next child starts at block p (index j * (N + 1) + p); action q =
    the next child is blocks p..q-1 (the last child must end at N, every child keeps at least one block). Reward
    0 if the child's loading time is within ``tol_ms`` of sum(load_ms) / k, else -1."""
    load = np.asarray(load_ms, np.float64)
    if load.ndim != 1 or load.size < 1 or not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError(f"load_ms must be a non-empty 1-D array of finite non-negative ms, got {load_ms!r}")
    n = load.size
    k = check_int("k", k, 1)
    if k > n:
        raise ValueError(f"k = {k} children need at least k blocks, got {n}")
    tol = check_float("tol_ms", tol_ms, 0.0, float("inf"), hi_open=True)
    cum = np.concatenate([[0.0], np.cumsum(load)])
    target = cum[-1] / k
    s_of = lambda j, p: j * (n + 1) + p
    num_s, num_a = (k + 1) * (n + 1), n + 1
    tr = np.zeros((num_s, num_a), np.int32)
    rw = np.full((num_s, num_a), -1.0, np.float32)
    va = np.zeros((num_s, num_a), bool)
    for j in range(k + 1):
        for p in range(n + 1):
            for q in range(n + 1):
                tr[s_of(j, p), q] = s_of(min(j + 1, k), q)
                if j < k and p < q <= n - (k - 1 - j) and (j < k - 1 or q == n):
                    va[s_of(j, p), q] = True
                    rw[s_of(j, p), q] = 0.0 if abs(cum[q] - cum[p] - target) <= tol else -1.0
    terminal = ~va.any(axis=1)
    return make_env(tr, rw, va, terminal, 0)


# ---------------------------------------------------------------------------------------------- tabular core

def epsilon_greedy(key: jax.Array, q_row: jnp.ndarray, valid_row: jnp.ndarray, epsilon) -> jnp.ndarray:
    """int32[]: with probability epsilon a uniform valid action, else a uniform pick among the valid argmaxes."""
    k_explore, k_pick = jax.random.split(key)
    qv = jnp.where(valid_row, q_row, -jnp.inf)
    greedy = valid_row & (qv == jnp.max(qv))
    choice = jnp.where(jax.random.bernoulli(k_explore, epsilon), valid_row, greedy)
    return jax.random.categorical(k_pick, jnp.where(choice, 0.0, -jnp.inf)).astype(jnp.int32)


def next_value(q, env: TabularEnv, s_next):
    """max_{a' valid} Q(s', a'), or 0 if s' is terminal: the bootstrap term of the Q-learning target."""
    best_next = jnp.max(jnp.where(env.valid[s_next], q[s_next], -jnp.inf))
    return jnp.where(env.terminal[s_next], 0.0, best_next)


def q_update(q, env: TabularEnv, s, a, r, lr, gamma) -> jnp.ndarray:
    """One Q-learning update of Q float32[S, A] for the transition (s, a, r, env.transition[s, a])."""
    s_next = env.transition[s, a]
    target = r + gamma * next_value(q, env, s_next)
    return q.at[s, a].add(lr * (target - q[s, a]))


class Episode(NamedTuple):
    actions: jnp.ndarray  # int32[H], -1 after the episode ended
    states: jnp.ndarray  # int32[H], the state each action was taken in (last state repeated after the end)
    total_reward: jnp.ndarray  # float32[]
    length: jnp.ndarray  # int32[]


def run_episode(key, q, env: TabularEnv, epsilon, lr, gamma, horizon: int, learn: bool = True) -> tuple:
    """One epsilon-greedy episode of at most ``horizon`` steps from env.start; returns (Q, Episode). With
    ``learn`` the table is updated online after every step (standard Q-learning)."""

    def body(carry, k):
        q, s, alive = carry
        a = epsilon_greedy(k, q[s], env.valid[s], epsilon)
        r = env.reward[s, a]
        if learn:
            q = jnp.where(alive, q_update(q, env, s, a, r, lr, gamma), q)
        s_next = env.transition[s, a]
        out = (jnp.where(alive, a, -1), s, jnp.where(alive, r, 0.0), alive)
        return (q, jnp.where(alive, s_next, s), alive & ~env.terminal[s_next]), out

    (q, _, _), (acts, states, rews, alive) = jax.lax.scan(body, (q, env.start, jnp.asarray(True)),
                                                          jax.random.split(key, horizon))
    return q, Episode(acts, states, jnp.sum(rews), jnp.sum(alive).astype(jnp.int32))


def train(key, q, env: TabularEnv, num_episodes: int, epsilon, lr, gamma, horizon: int) -> tuple:
    """``num_episodes`` online episodes in ``lax.scan``; returns (Q, total reward float32[num_episodes])."""

    def body(q, k):
        q, ep = run_episode(k, q, env, epsilon, lr, gamma, horizon)
        return q, ep.total_reward

    return jax.lax.scan(body, q, jax.random.split(key, num_episodes))


def greedy_rollout(q, env: TabularEnv, horizon: int) -> Episode:
    """The episode of the greedy policy (ties to the lowest action index), no learning."""

    def body(carry, _):
        s, alive = carry
        a = jnp.argmax(jnp.where(env.valid[s], q[s], -jnp.inf)).astype(jnp.int32)
        s_next = env.transition[s, a]
        out = (jnp.where(alive, a, -1), s, jnp.where(alive, env.reward[s, a], 0.0), alive)
        return (jnp.where(alive, s_next, s), alive & ~env.terminal[s_next]), out

    _, (acts, states, rews, alive) = jax.lax.scan(body, (env.start, jnp.asarray(True)), None, length=horizon)
    return Episode(acts, states, jnp.sum(rews), jnp.sum(alive).astype(jnp.int32))


# -------------------------------------------------------------------------------------------------- the strategy

class QState(NamedTuple):
    q: jnp.ndarray  # float32[S, A]
    step: jnp.ndarray  # int32[], number of tells so far
    best_ops: jnp.ndarray  # int32[H]
    best_fitness: jnp.ndarray  # float32[]


def _replay(q, env, states, acts, rewards, lr, gamma):
    """Updates Q along one recorded episode, last step first; steps with action -1 are skipped."""

    def body(q, xs):
        s, a, r = xs
        return jnp.where(a >= 0, q_update(q, env, s, jnp.maximum(a, 0), r, lr, gamma), q), None

    return jax.lax.scan(body, q, (states, acts, rewards), reverse=True)[0]


def _resolve_env(mask, env, history, horizon) -> tuple:
    """(env, horizon) from exactly one of a bool[N, R] op mask (chain env, horizon N) or a caller's env."""
    if (mask is None) == (env is None):
        raise ValueError("pass exactly one of mask (architecture search) or env (a TabularEnv)")
    if env is None:
        env = chain_env(mask, history)
        horizon = check_mask(mask).shape[0] if horizon is None else horizon
    elif not isinstance(env, TabularEnv):
        raise ValueError(f"env must be a TabularEnv (see make_env), got {type(env).__name__}")
    if horizon is None:
        raise ValueError("horizon is required with a caller-supplied env")
    return env, check_int("horizon", horizon, 1)


@register("qlearning")
def qlearning(mask=None, *, env: TabularEnv | None = None, history: int | None = 1, population: int = 8,
              epsilon: float = 0.2, epsilon_final: float | None = None, decay_steps: int = 1,
              learning_rate: float = 0.5, discount: float = 1.0, horizon: int | None = None,
              q_init: float = 0.0) -> Strategy:
    """Q-learning in ask/tell form over a bool[N, R] op ``mask`` (``chain_env(mask, history)``) or a caller's
    ``env`` (exactly one).

    Epsilon decays linearly from ``epsilon`` to ``epsilon_final`` (default: no decay) over ``decay_steps`` tells;
    ``horizon`` (default N for a mask) bounds the episode length. ``q_init`` fills the initial table; a value
    above every achievable return (optimistic initialisation) makes the greedy choice try untried actions first.
    """
    env, h = _resolve_env(mask, env, history, horizon)
    p = check_int("population", population, 1)
    eps0 = check_float("epsilon", epsilon, 0.0, 1.0)
    eps1 = eps0 if epsilon_final is None else check_float("epsilon_final", epsilon_final, 0.0, 1.0)
    decay = check_int("decay_steps", decay_steps, 1)
    lr = check_float("learning_rate", learning_rate, 0.0, 1.0, lo_open=True)
    gamma = check_float("discount", discount, 0.0, 1.0)
    q0 = check_float("q_init", q_init, -float("inf"), float("inf"), lo_open=True, hi_open=True)
    num_s, num_a = env.valid.shape
    epsilon_at = lambda step: eps0 + (eps1 - eps0) * jnp.minimum(step / decay, 1.0)

    def init(key):
        del key
        return QState(jnp.full((num_s, num_a), q0, jnp.float32), jnp.zeros((), jnp.int32),
                      jnp.zeros((h,), jnp.int32), jnp.asarray(-jnp.inf, jnp.float32))

    # jitted inside so that eager (Python-driven) ask/tell calls compile these loops once, not on every call
    @jax.jit
    def episodes(keys, q, eps):
        episode = lambda k: run_episode(k, q, env, eps, lr, gamma, h, learn=False)[1].actions
        return jax.vmap(episode)(keys)

    @jax.jit
    def learn(q, ops, fit):
        def one(q, xs):
            acts, f = xs
            states, rewards = _trajectory(env, acts)
            last = jnp.arange(h) == jnp.sum(acts >= 0) - 1
            return _replay(q, env, states, acts, rewards + jnp.where(last, f, 0.0), lr, gamma), None

        return jax.lax.scan(one, q, (ops, fit))[0]

    def ask(key, state):
        return Arch(episodes(jax.random.split(key, p), state.q, epsilon_at(state.step))), state

    def tell(key, archs, fitness, state):
        """``fitness`` float32[P] is added to the reward of each episode's last step; ``key`` is unused."""
        del key
        f = finite_or_worst(fitness)
        q = learn(state.q, archs.ops, f)
        best_ops, best_f = update_best(state.best_ops, state.best_fitness, archs.ops, fitness)
        metrics = {"mean_fitness": jnp.mean(f), "best_fitness": best_f, "epsilon": epsilon_at(state.step)}
        return QState(q, state.step + 1, best_ops, best_f), metrics

    return Strategy(init, ask, tell)


def _trajectory(env: TabularEnv, acts):
    """(states int32[H], env rewards float32[H]) visited by the action sequence ``acts`` int32[H] (-1 = ended)."""

    def body(s, a):
        a0 = jnp.maximum(a, 0)
        return jnp.where(a >= 0, env.transition[s, a0], s), (s, jnp.where(a >= 0, env.reward[s, a0], 0.0))

    return jax.lax.scan(body, env.start, acts)[1]
