"""Cutting N blocks with load times c[0..N-1] (ms) into k contiguous children whose heaviest child is as light as
possible (paper 002's hypothesis: a pool of children loads in the time of its heaviest one).

Children are given by boundaries ``cuts = [0, c_1, ..., c_{k-1}, N]``; child i is blocks cuts[i]..cuts[i+1]-1.
The per-child overhead of the load model adds the same constant to every child, so it does not move the optimum.

* ``exact``: the min-max contiguous partition by dynamic programming, O(k N^2).
* ``equal``: the baseline with equal numbers of blocks per child.
* ``qlearning``: paper 002's agent (section 4.2.1) as the registered ``"qlearning"`` ask/tell strategy over
  ``strategies.qlearning.balanced_split_env``. The paper's state (C_split, I_split, n_p, n_r) with C_split = k
  fixed is that env's state (j children made, p blocks processed; n_r = N - p); the action is the next split
  index; each child earns eq. (4)'s reward (0 within ``tol`` of T/k, else -1) and the Q table follows eq. (5)'s
  update. Eq. (4) alone cannot rank two splits that both miss the tolerance (often every split does: one ResNet-50
  block is heavier than T/8), so the caller's fitness -max_child / (T/k) is added to each episode's last step.
  The best episode seen is the answer.
* ``choose_k``: ``--children auto``: the k in 1..k_max whose split has the smallest predicted makespan with the
  given number of threads (``loadmodel.makespan_ms``, per-child overhead included). The paper's reward cannot
  choose k: k = 1 always meets eq. (4) (its only child takes T = T/1).
"""
from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.modular.blocks import ModularError
from jmsnas.strategies import base as S
from jmsnas.strategies import qlearning as Q

STRATEGIES = ("exact", "qlearning", "equal")


def check_costs(costs, k) -> tuple:
    """(float64[N] costs, int k) validated: finite, non-negative, 1 <= k <= N."""
    c = np.asarray(costs, np.float64)
    if c.ndim != 1 or c.size < 1 or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ModularError(f"block load times must be a non-empty 1-D array of finite ms >= 0, got shape {c.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ModularError(f"number of children must be an integer >= 1, got {k!r}")
    if k > c.size:
        raise ModularError(f"{k} children need at least {k} blocks; the network has {c.size}")
    return c, int(k)


def child_costs(costs, cuts) -> np.ndarray:
    """float64[k]: each child's load time (ms, the sum of its blocks' ``costs``), without the per-child overhead."""
    cum = np.concatenate([[0.0], np.cumsum(costs)])
    c = np.asarray(cuts)
    return cum[c[1:]] - cum[c[:-1]]


def max_child(costs, cuts) -> float:
    """Load time (ms) of the heaviest child, without the per-child overhead."""
    return float(np.max(child_costs(costs, cuts)))


def exact(costs, k) -> list:
    """Boundaries of a min-max contiguous partition into k children (DP; the first optimum in cut order)."""
    c, k = check_costs(costs, k)
    n = c.size
    cum = np.concatenate([[0.0], np.cumsum(c)])
    best = np.full((k + 1, n + 1), np.inf)
    arg = np.zeros((k + 1, n + 1), int)
    best[0, 0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            p = np.arange(j - 1, i)
            v = np.maximum(best[j - 1, p], cum[i] - cum[p])
            t = int(np.argmin(v))
            best[j, i], arg[j, i] = v[t], p[t]
    cuts, i = [n], n
    for j in range(k, 0, -1):
        i = arg[j, i]
        cuts.append(int(i))
    return cuts[::-1]


def equal(num_blocks: int, k) -> list:
    """Boundaries giving every child the same number of blocks (+-1)."""
    _, k = check_costs(np.zeros(num_blocks), k)
    return [int(round(i * num_blocks / k)) for i in range(k + 1)]


class AgentResult(NamedTuple):
    cuts: list
    max_ms: float
    episodes: int  # episodes played in total
    episodes_to_10pct: int | None  # episodes until the best split was within 10% of ``reference_ms`` (if given)
    seconds: float  # wall time (compilation included)


def qlearning(key, costs, k, *, tol: float = 0.05, steps: int = 200, population: int = 16, epsilon: float = 0.5,
              epsilon_final: float = 0.02, learning_rate: float = 0.5, reference_ms: float | None = None
              ) -> AgentResult:
    """Paper 002's Q-learning split into k children (module doc). ``tol``: eq. (4)'s tolerance as a fraction of
    T/k; ``steps`` ask/tell rounds of ``population`` episodes; epsilon decays linearly over the rounds."""
    c, k = check_costs(costs, k)
    t0 = time.perf_counter()
    target = float(c.sum()) / k
    if k == 1 or target == 0.0:
        cuts = exact(c, k)
        return AgentResult(cuts, max_child(c, cuts), 0, 0, time.perf_counter() - t0)
    env = Q.balanced_split_env(c, k, tol * target)
    strat = S.make("qlearning", env=env, horizon=k, population=population, epsilon=epsilon,
                   epsilon_final=epsilon_final, decay_steps=steps, learning_rate=learning_rate, discount=1.0)
    cum = jnp.asarray(np.concatenate([[0.0], np.cumsum(c)]), jnp.float32)

    def fitness(archs):
        ends = archs.ops  # int32[P, k]: the end of each child (an episode always makes exactly k children)
        starts = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=1)
        return -jnp.max(cum[ends] - cum[starts], axis=1) / target

    state, metrics = jax.jit(lambda key: S.run(strat, fitness, key, steps))(key)
    ends = [int(e) for e in np.asarray(state.best_ops)]
    cuts = [0] + ends
    check_cuts_ok = all(b > a for a, b in zip(cuts, cuts[1:])) and cuts[-1] == c.size
    if not check_cuts_ok:
        raise ModularError(f"the Q-learning agent returned invalid boundaries {cuts}")
    best = -np.asarray(metrics["best_fitness"]) * target
    hit = None
    if reference_ms is not None:
        ok = np.flatnonzero(best <= 1.1 * reference_ms + 1e-9)
        hit = int((ok[0] + 1) * population) if ok.size else None
    return AgentResult(cuts, max_child(c, cuts), steps * population, hit, time.perf_counter() - t0)


def split(strategy: str, costs, k, key=None, **agent_kw) -> list:
    """Boundaries from ``strategy`` in STRATEGIES."""
    if strategy == "exact":
        return exact(costs, k)
    if strategy == "equal":
        check_costs(costs, k)
        return equal(len(costs), k)
    if strategy == "qlearning":
        return qlearning(jax.random.key(0) if key is None else key, costs, k, **agent_kw).cuts
    raise ModularError(f"unknown split strategy {strategy!r}; expected one of {list(STRATEGIES)}")


def choose_k(strategy: str, costs, overhead_ms: float, threads: int, k_max: int = 8, key=None) -> tuple:
    """(k, cuts, {k: predicted makespan ms}) minimising the predicted load time over k = 1..min(k_max, N)."""
    from jmsnas.modular.loadmodel import makespan_ms
    c = np.asarray(costs, np.float64)
    table, best = {}, None
    for k in range(1, min(k_max, c.size) + 1):
        cuts = split(strategy, c, k, key)
        ms = makespan_ms(overhead_ms + child_costs(c, cuts), threads)
        table[k] = ms
        if best is None or ms < best[2] - 1e-12:
            best = (k, cuts, ms)
    return best[0], best[1], table
