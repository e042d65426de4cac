"""The search objective, eq. (4) of paper 003, and its one-sided variant.

L = CE + lambda1 * ||theta||^2 + lambda2 * (E[T] - T_const)^2. The two-sided penalty pulls E[T] to the budget
(the paper argues the optimum of (3) sits at T = T_const); the one-sided one, lambda2 * max(0, E[T] - T_const)^2,
only penalises exceeding it.

Device limits add one hinge term per device and resource (``limits_penalty``):
L += lambda3 * sum_m [max(0, E[M_m] / Mem_m - 1)^2 + max(0, E[E_m] / Energy_m - 1)^2], relative to each limit so
bytes and mJ weigh alike; it is zero while every device is within its limits (docs/design.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

PENALTIES = ("two_sided", "one_sided")


def l2_norm_sq(params) -> jnp.ndarray:
    """||theta||_2^2 over every leaf of a parameter pytree."""
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(params))


def latency_penalty(t_ms, t_const_ms, kind: str = "two_sided"):
    """(T - T_const)^2, or max(0, T - T_const)^2 for ``one_sided`` (ms^2)."""
    if kind == "two_sided":
        return jnp.square(t_ms - t_const_ms)
    if kind == "one_sided":
        return jnp.square(jnp.maximum(t_ms - t_const_ms, 0.0))
    raise ValueError(f"unknown latency penalty {kind!r}; expected one of {PENALTIES}")


def limits_penalty(values, limits):
    """sum_m max(0, v_m / limit_m - 1)^2 over the devices with a finite limit (dimensionless); ``limits`` numpy."""
    limits = np.asarray(limits, np.float64)
    finite = np.isfinite(limits)
    if not finite.any():
        return jnp.zeros((), jnp.float32)
    idx = np.flatnonzero(finite)
    ratio = values[idx] / jnp.asarray(limits[idx], jnp.float32)
    return jnp.sum(jnp.square(jnp.maximum(ratio - 1.0, 0.0)))


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy with integer labels."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def jmsnas_loss(logits, labels, params, t_ms, t_const_ms, lambda1: float, lambda2: float,
                penalty: str = "two_sided"):
    """Eq. (4); returns (loss, parts dict)."""
    ce = cross_entropy(logits, labels)
    reg = l2_norm_sq(params)
    lat = latency_penalty(t_ms, t_const_ms, penalty)
    return ce + lambda1 * reg + lambda2 * lat, {"ce": ce, "l2": reg, "latency_penalty": lat}
