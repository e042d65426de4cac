"""The search-strategy interface: a NamedTuple of pure functions over an explicit state pytree.

A strategy is built by a factory that closes over its hyperparameters (the op validity mask among them), in the
style of optax's ``GradientTransformation`` and evosax's ask/tell::

    state = strategy.init(key)                                  # a NamedTuple of arrays
    archs, state = strategy.ask(key, state)                     # Arch with ops int32[P, N]
    state, metrics = strategy.tell(key, archs, fitness, state)  # fitness float32[P], higher is better

Every state is a NamedTuple of arrays, so it goes through ``jax.jit`` and ``lax.scan`` and can be checkpointed.
Every state also carries ``best_ops: int32[N]`` and ``best_fitness: float32[]``, the best candidate told so far
(``best`` reads them). Fitness that is not finite (``-inf``, ``nan``) marks a candidate that violates a hard
constraint; each strategy documents how it treats such candidates.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.space import Arch

# Logit given to masked choices: finite (so 0 * logit stays 0 in entropies) but far below any real logit.
MASKED_LOGIT = -1e30


class Strategy(NamedTuple):
    """``init(key) -> state``, ``ask(key, state) -> (Arch, state)``, ``tell(key, archs, fitness, state) -> (state,
    metrics)``; all pure and jit-able."""

    init: Callable[..., Any]
    ask: Callable[..., Any]
    tell: Callable[..., Any]


STRATEGIES: dict = {}


def register(name: str):
    """Decorator adding a factory ``factory(mask, **hparams) -> Strategy`` to ``STRATEGIES`` under ``name``."""

    def deco(factory):
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} is already registered")
        STRATEGIES[name] = factory
        return factory

    return deco


def make(name: str, **hparams) -> Strategy:
    """Builds the registered strategy ``name`` with ``hparams`` (e.g. ``make("evolution", mask=space.mask())``)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](**hparams)


def best(state) -> tuple:
    """(Arch with ops int32[N], fitness float32[]) of the best candidate told so far (-inf before any tell)."""
    return Arch(state.best_ops), state.best_fitness


# ---------------------------------------------------------------------------------------------------- validation

def check_mask(mask) -> np.ndarray:
    """Validates an op mask bool[N, R] (N >= 1 layers, R >= 1 ops, every layer with a valid op); returns it."""
    m = np.asarray(mask)
    if m.ndim != 2 or m.shape[0] < 1 or m.shape[1] < 1:
        raise ValueError(f"mask must be a bool array of shape [N layers, R ops] with N, R >= 1, got shape {m.shape}")
    if m.dtype != np.bool_:
        raise ValueError(f"mask must have dtype bool, got {m.dtype}")
    empty = np.flatnonzero(~m.any(axis=1))
    if empty.size:
        raise ValueError(f"mask rows {empty.tolist()} are all False: every layer needs at least one valid op")
    return m


def check_int(name: str, value, lo: int) -> int:
    """``value`` as an int >= lo, or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def check_float(name: str, value, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` as a float in the interval [lo, hi] (ends open where asked), or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    bad = (not np.isfinite(v) and not (v == hi == np.inf)) or v < lo or v > hi or (lo_open and v == lo) \
        or (hi_open and v == hi)
    if bad:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{name} must lie in {lb}{lo}, {hi}{rb}, got {value!r}")
    return v


# ---------------------------------------------------------------------------------------------------- helpers

def masked_logits(logits: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """logits [..., N, R] with masked entries set to MASKED_LOGIT (their softmax probability is exactly 0)."""
    return jnp.where(mask, logits, MASKED_LOGIT)


def sample_valid(key: jax.Array, mask: jnp.ndarray, num: int) -> jnp.ndarray:
    """int32[num, N]: ops drawn uniformly among the valid ones of each layer."""
    logits = masked_logits(jnp.zeros(mask.shape, jnp.float32), mask)
    return jax.random.categorical(key, logits, shape=(num, mask.shape[0])).astype(jnp.int32)


def finite_or_worst(fitness: jnp.ndarray) -> jnp.ndarray:
    """float32[P]: non-finite entries replaced by the smallest finite one (all 0 if none is finite), so a
    violator ranks with the worst of its batch in a learning update."""
    ok = jnp.isfinite(fitness)
    worst = jnp.min(jnp.where(ok, fitness, jnp.inf))
    return jnp.where(ok, fitness, jnp.where(jnp.isfinite(worst), worst, 0.0)).astype(jnp.float32)


def update_best(state_best_ops, state_best_fitness, ops: jnp.ndarray, fitness: jnp.ndarray) -> tuple:
    """Best-so-far after seeing candidates ops int32[P, N] with fitness float32[P] (non-finite never wins)."""
    f = jnp.where(jnp.isfinite(fitness), fitness, -jnp.inf)
    i = jnp.argmax(f)
    better = f[i] > state_best_fitness
    return jnp.where(better, ops[i], state_best_ops), jnp.where(better, f[i], state_best_fitness)


def step_fn(strategy: Strategy, fitness_fn: Callable[[Arch], jnp.ndarray]) -> Callable:
    """One ask -> evaluate -> tell round as ``step(state, key) -> (state, metrics)`` (the ``lax.scan`` body).

    ``fitness_fn(archs)`` maps an Arch with ops int32[P, N] to float32[P] and must be jit-able.
    """

    def step(state, key):
        k_ask, k_tell = jax.random.split(key)
        archs, state = strategy.ask(k_ask, state)
        return strategy.tell(k_tell, archs, fitness_fn(archs), state)

    return step


def run(strategy: Strategy, fitness_fn: Callable, key: jax.Array, num_steps: int, state=None) -> tuple:
    """Runs ``num_steps`` rounds inside ``lax.scan``; returns (final state, metrics stacked over steps).

    Wrap in ``jax.jit`` (with ``num_steps`` static) to compile the whole search into one program.
    """
    k_init, k_run = jax.random.split(key)
    if state is None:
        state = strategy.init(k_init)
    return jax.lax.scan(step_fn(strategy, fitness_fn), state, jax.random.split(k_run, num_steps))
