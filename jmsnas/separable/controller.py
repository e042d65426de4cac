"""The communication controller (paper 004, section 3.2) and the random sampler of section 4.5.

The controller is ``jmsnas.strategies.reinforce`` with the LSTM policy over the decision space's token sequence:
per transmission step one categorical over the G! permutations and, when K > 1, one over the K sparsity levels
(``DecisionSpace.mask``); hidden size 100 as in the paper. The random sampler has the same ask/tell interface and
draws every token uniformly among its valid choices; its ``tell`` only keeps the best decision seen.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.separable.decisions import DecisionSpace
from jmsnas.space import Arch
from jmsnas.strategies.base import Strategy, check_int, finite_or_worst, sample_valid, update_best
from jmsnas.strategies.reinforce import reinforce


def make_controller(space: DecisionSpace, *, population: int = 8, learning_rate: float = 3.5e-3,
                    hidden: int = 100, entropy_coef: float = 1e-3, baseline_decay: float = 0.9) -> Strategy:
    """REINFORCE with an LSTM controller over ``space``'s decisions; ``ask`` gives Arch(ops int32[P, tokens])."""
    return reinforce(space.mask(), policy="lstm", population=population, learning_rate=learning_rate,
                     hidden=hidden, entropy_coef=entropy_coef, baseline_decay=baseline_decay)


class RandomState(NamedTuple):
    step: jnp.ndarray  # int32[]
    best_ops: jnp.ndarray  # int32[tokens]
    best_fitness: jnp.ndarray  # float32[]


def make_random(space: DecisionSpace, *, population: int = 8) -> Strategy:
    """Uniform sampling of decisions with the Strategy interface (the baseline of section 4.5)."""
    mask = jnp.asarray(space.mask())
    p = check_int("population", population, 1)

    def init(key):
        del key
        return RandomState(jnp.zeros((), jnp.int32), jnp.zeros((mask.shape[0],), jnp.int32),
                           jnp.asarray(-jnp.inf, jnp.float32))

    def ask(key, state):
        return Arch(sample_valid(key, mask, p)), state

    def tell(key, archs, fitness, state):
        del key
        best_ops, best_f = update_best(state.best_ops, state.best_fitness, archs.ops, fitness)
        return RandomState(state.step + 1, best_ops, best_f), {"mean_reward": jnp.mean(finite_or_worst(fitness)),
                                                              "best_fitness": best_f}

    return Strategy(init, ask, tell)



def ask_many(strategy: Strategy, key, state, rounds: int) -> jnp.ndarray:
    """int32[rounds * P, tokens]: ``rounds`` asks of an arm's current distribution (state unchanged)."""
    return np.concatenate([np.asarray(strategy.ask(k, state)[0].ops) for k in jax.random.split(key, rounds)])
