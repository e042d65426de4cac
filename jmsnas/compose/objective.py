"""The composed search's cost terms for one architecture step: E[T] and the devices' limits hinge, from every
group of logits (ops, weight bits, modules, transmitted bits), as ``train.step_latency`` and
``train.step_limits_penalty`` give them from the ops' logits alone.

Under ``split="searched"`` the split is the best one of the current expectations (``compose.cost.best_assignment``),
held fixed for the gradient as in ``train.step_latency``. With every mechanism off both terms equal today's.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jmsnas.compose import cost as K
from jmsnas.compose.choices import ChoiceProbs, Choices, probs_from_logits
from jmsnas.compose.terms import Terms
from jmsnas.limits import DeviceLimits
from jmsnas.objectives import limits_penalty

SPLITS = ("fixed", "searched")


class StepCosts(NamedTuple):
    """latency_ms: E[T] (ms); limits_penalty: sum over devices of the memory and energy hinges (dimensionless,
    ``objectives.limits_penalty``; 0 without ``limits``); assignment: the split used, int32[N]."""

    latency_ms: jnp.ndarray
    limits_penalty: jnp.ndarray
    assignment: jnp.ndarray


def step_costs(space, table, terms: Terms, choices: Choices, logits: ChoiceProbs, split: str = "fixed",
               limits: DeviceLimits | None = None) -> StepCosts:
    """E[T] and the limits hinge of ``logits`` under the fixed split (D^m) or the searched one; differentiable in
    every group of logits."""
    if split not in SPLITS:
        raise ValueError(f"unknown split mode {split!r}; expected one of {list(SPLITS)}")
    probs = probs_from_logits(space, choices, logits)
    a = jnp.asarray(space.layer_devices(), jnp.int32) if split == "fixed" else K.best_assignment(space, table,
                                                                                                 terms, probs)
    t = K.latency(space, table, terms, probs, None if split == "fixed" else a).total
    penalty = jnp.zeros((), jnp.float32)
    if limits is not None:
        mem = K.memory(space, limits.mem, table, terms, probs, a).total
        en = K.energy(space, table, terms, probs, a).per_device
        penalty = limits_penalty(mem, limits.memory_bytes) + limits_penalty(en, limits.energy_mj)
    return StepCosts(t, penalty, a)
