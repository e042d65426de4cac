"""Evolutionary search over architectures, as in the search stage of SplitNets (paper 000, section 3.2).

SplitNets mutates and crosses over pairs of the current generation's networks, evaluates the children, keeps only
children that satisfy every hard constraint (e.g. peak memory on a device, T <= T_const) and ranks the rest by the
soft objective (e.g. latency at equal accuracy); it samples 512 candidates for 20 generations. The paper does not
state the parent ratio or the mutation probability; the defaults here are those of the evolutionary finder of
Once-for-All, a method in the same line of work: the top 25% of the population are parents, each layer of a mutated
child is resampled with probability 0.1, and half of the children come from mutation, half from uniform crossover.

One generation:

* ``ask``: on the first call, the random initial population itself (P candidates); afterwards P children, the
  first ``round(mutation_ratio * P)`` mutations of a random parent, the rest uniform crossovers of two random
  parents. Parents are drawn uniformly from the feasible members among the top ``parent_ratio * P``.
* ``tell``: a child whose fitness is not finite (the caller passes ``-inf``) or whose ``feasible`` flag is False
  is discarded. The next population is the best P of (previous population + feasible children) by fitness, so
  the soft objective ranks and the best candidate is never lost (elitist (mu + lambda) selection). Fitness is
  whatever scalar the caller builds from the soft objectives (e.g. ``-latency_ms`` or accuracy). Duplicate
  architectures are not removed (a fixed-size, jit-able population), so a converged population repeats its best.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.space import Arch
from jmsnas.strategies.base import (Strategy, check_float, check_int, check_mask, register, sample_valid,
                                    update_best)


class EvolutionState(NamedTuple):
    population: jnp.ndarray  # int32[P, N]
    fitness: jnp.ndarray  # float32[P], -inf where not evaluated or infeasible
    generation: jnp.ndarray  # int32[], number of tells so far
    best_ops: jnp.ndarray  # int32[N]
    best_fitness: jnp.ndarray  # float32[]


def mutate(key: jax.Array, ops: jnp.ndarray, mask: jnp.ndarray, prob: float) -> jnp.ndarray:
    """ops int32[..., N] with each layer independently resampled, with probability ``prob``, uniformly among its
    valid ops (the draw may repeat the current op). Valid in, valid out."""
    k_flip, k_new = jax.random.split(key)
    fresh = sample_valid(k_new, mask, int(np.prod(ops.shape[:-1], dtype=np.int64))).reshape(ops.shape)
    return jnp.where(jax.random.bernoulli(k_flip, prob, ops.shape), fresh, ops)


def crossover(key: jax.Array, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Uniform crossover of ops int32[..., N]: each layer from ``a`` or ``b`` with probability 1/2. Because masks
    are per layer, two valid parents always give a valid child."""
    return jnp.where(jax.random.bernoulli(key, 0.5, a.shape), a, b)


def _valid_fitness(fitness, feasible):
    ok = jnp.isfinite(fitness)
    if feasible is not None:
        ok = ok & jnp.asarray(feasible, bool)
    return jnp.where(ok, fitness.astype(jnp.float32), -jnp.inf)


@register("evolution")
def evolution(mask, *, population: int = 512, parent_ratio: float = 0.25, mutation_prob: float = 0.1,
              mutation_ratio: float = 0.5) -> Strategy:
    """Evolution over a bool[N, R] op ``mask``; SplitNets' 512 candidates per generation by default (run it for
    20 generations to match the paper). See the module docstring for the generation scheme."""
    mask = jnp.asarray(check_mask(mask))
    p = check_int("population", population, 2)
    parent_ratio = check_float("parent_ratio", parent_ratio, 0.0, 1.0, lo_open=True)
    mutation_prob = check_float("mutation_prob", mutation_prob, 0.0, 1.0)
    mutation_ratio = check_float("mutation_ratio", mutation_ratio, 0.0, 1.0)
    n_parents = max(1, int(round(parent_ratio * p)))
    n_mut = int(round(mutation_ratio * p))

    def init(key):
        pop = sample_valid(key, mask, p)
        return EvolutionState(pop, jnp.full((p,), -jnp.inf, jnp.float32), jnp.zeros((), jnp.int32),
                              pop[0], jnp.asarray(-jnp.inf, jnp.float32))

    def children(key, state):
        order = jnp.argsort(-state.fitness, stable=True)[:n_parents]  # best first
        n_ok = jnp.sum(jnp.isfinite(state.fitness[order]))
        n_pick = jnp.where(n_ok > 0, n_ok, n_parents)
        k_a, k_b, k_mut, k_cx = jax.random.split(key, 4)
        pa = order[jax.random.randint(k_a, (p,), 0, n_pick)]
        pb = order[jax.random.randint(k_b, (p,), 0, n_pick)]
        mutants = mutate(k_mut, state.population[pa[:n_mut]], mask, mutation_prob)
        crossed = crossover(k_cx, state.population[pa[n_mut:]], state.population[pb[n_mut:]])
        return jnp.concatenate([mutants, crossed], axis=0)

    def ask(key, state):
        ops = jnp.where(state.generation == 0, state.population, children(key, state))
        return Arch(ops), state

    def tell(key, archs, fitness, state, feasible=None):
        """``fitness`` float32[P] (higher is better, -inf = violates a hard constraint); ``feasible`` optional
        bool[P], False discards the child as well. ``key`` is unused (selection is deterministic)."""
        del key
        f = _valid_fitness(fitness, feasible)
        first = state.generation == 0
        old_f = jnp.where(first, -jnp.inf, state.fitness)  # generation 0: the population is the told batch
        all_ops = jnp.concatenate([state.population, archs.ops], axis=0)
        all_f = jnp.concatenate([old_f, f])
        top_f, idx = jax.lax.top_k(all_f, p)
        best_ops, best_f = update_best(state.best_ops, state.best_fitness, archs.ops, f)
        ok = jnp.isfinite(f)
        metrics = {
            "best_fitness": best_f,
            "population_mean_fitness": jnp.nanmean(jnp.where(jnp.isfinite(top_f), top_f, jnp.nan)),
            "feasible_fraction": jnp.mean(ok.astype(jnp.float32)),
            "children_best_fitness": jnp.max(f),
            "generation": state.generation + 1,
        }
        new = EvolutionState(all_ops[idx], top_f, state.generation + 1, best_ops, best_f)
        return new, metrics

    return Strategy(init, ask, tell)
