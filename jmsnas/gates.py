"""Gates over the candidate operations of every layer (paper 003, section IV-A, Lemma 1).

A ``Gates`` value tells the supernet which paths to compute and how to weight them: layer n outputs
sum_k weights[n, paths[n, k]] * v_{paths[n, k]}(x). ``paths=None`` means every valid candidate is computed
(DARTS-style mixture, Gumbel-softmax). All functions take alpha[N, R] (architecture logits) and mask bool[N, R].

* binary two-path gates: two distinct candidates are sampled from p = softmax(alpha) (without replacement),
  one of them is active (g = one-hot), only those two are computed, and the gradient to alpha is eq. (5) of
  Lemma 1 applied to the sampled pair with p renormalised over the pair (as ProxylessNAS does, so candidates
  that were not sampled receive no gradient from this step);
* single-path gates for weight steps (one sampled candidate, g = 1);
* Gumbel-softmax, soft or straight-through hard, with a temperature schedule;
* the full softmax mixture as a reference.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


class Gates(NamedTuple):
    """weights: float32[N, R] gate values g; paths: int32[N, K] candidates to compute, or None for all valid ones."""

    weights: jnp.ndarray
    paths: Optional[jnp.ndarray] = None


def masked_logits(alpha, mask):
    return jnp.where(mask, alpha, -jnp.inf)


def probabilities(alpha, mask):
    """p = softmax(alpha) over the valid candidates of each layer, float32[N, R] (0 where masked)."""
    return jax.nn.softmax(masked_logits(alpha, mask), axis=-1)


def softmax_gates(alpha, mask) -> Gates:
    """The full mixture: every valid path weighted by p."""
    return Gates(probabilities(alpha, mask), None)


def onehot_gates(ops, num_ops: int) -> Gates:
    """One discrete architecture ops int32[N]: only the chosen candidate computed, with weight 1."""
    ops = jnp.asarray(ops, jnp.int32)
    return Gates(jax.nn.one_hot(ops, num_ops, dtype=jnp.float32), ops[:, None])


def sample_paths(key, alpha, mask, k: int):
    """k distinct candidates per layer sampled without replacement from softmax(alpha): int32[N, k].

    Uses the Gumbel-top-k trick: the indices of the k largest alpha + Gumbel noise are a sample without
    replacement with probabilities proportional to p.
    """
    g = jax.random.gumbel(key, alpha.shape)
    scores = masked_logits(alpha + g, mask)
    return jax.lax.top_k(scores, k)[1].astype(jnp.int32)


def single_path_gates(key, alpha, mask) -> Gates:
    """One candidate per layer sampled from p, with gate 1 (the weight step of the alternating update)."""
    paths = sample_paths(key, alpha, mask, 1)
    return Gates(jax.nn.one_hot(paths[:, 0], alpha.shape[-1], dtype=jnp.float32), paths)


@jax.custom_vjp
def binary_gate_weights(alpha, paths, active):
    """g = one-hot(paths[n, active[n]]) as float32[N, R]; the VJP is Lemma 1 restricted to the sampled pair."""
    chosen = jnp.take_along_axis(paths, active[:, None], axis=1)[:, 0]
    return jax.nn.one_hot(chosen, alpha.shape[-1], dtype=alpha.dtype)


def _bgw_fwd(alpha, paths, active):
    return binary_gate_weights(alpha, paths, active), (alpha, paths, active)


def _bgw_bwd(res, g_bar):
    alpha, paths, active = res
    pair_alpha = jnp.take_along_axis(alpha, paths, axis=1)  # [N, 2]
    p = jax.nn.softmax(pair_alpha, axis=-1)  # renormalised over the pair
    dl_dg = jnp.take_along_axis(g_bar, paths, axis=1)  # dL/dg_j for the two computed paths
    # eq. (5): dL/dalpha_i = sum_j dL/dg_j p_j (delta_ij - p_i), for i, j in the pair
    d_pair = p * dl_dg - p * jnp.sum(dl_dg * p, axis=-1, keepdims=True)
    grad = jnp.zeros_like(alpha)
    grad = jax.vmap(lambda row, idx, val: row.at[idx].add(val))(grad, paths, d_pair)
    zero_int = lambda x: jnp.zeros(x.shape, jax.dtypes.float0)
    return grad, zero_int(paths), zero_int(active)


binary_gate_weights.defvjp(_bgw_fwd, _bgw_bwd)


def two_path_gates(key, alpha, mask) -> Gates:
    """Binary gates of the architecture step: two sampled paths, one active (chosen with the pair-renormalised p)."""
    k_pair, k_act = jax.random.split(key)
    paths = sample_paths(k_pair, alpha, mask, 2)
    pair_logits = jnp.take_along_axis(alpha, paths, axis=1)
    active = jax.random.categorical(k_act, pair_logits, axis=-1).astype(jnp.int32)
    return Gates(binary_gate_weights(alpha, paths, active), paths)


def gumbel_softmax_gates(key, alpha, mask, tau, hard: bool = False) -> Gates:
    """Gumbel-softmax gates at temperature tau over all valid paths; ``hard`` = straight-through one-hot."""
    g = jax.random.gumbel(key, alpha.shape)
    soft = jax.nn.softmax(masked_logits((alpha + g) / tau, mask), axis=-1)
    if not hard:
        return Gates(soft, None)
    onehot = jax.nn.one_hot(jnp.argmax(soft, axis=-1), alpha.shape[-1], dtype=soft.dtype)
    return Gates(onehot + soft - jax.lax.stop_gradient(soft), None)


def temperature_schedule(tau0: float = 5.0, tau_min: float = 0.1, decay: float = 0.97, steps_per_decay: int = 1):
    """Exponentially decaying Gumbel temperature tau(step) = max(tau_min, tau0 * decay^(step/steps_per_decay))."""
    if not (tau0 > 0 and tau_min > 0 and 0 < decay <= 1):
        raise ValueError(f"need tau0 > 0, tau_min > 0, 0 < decay <= 1; got {tau0}, {tau_min}, {decay}")
    if isinstance(steps_per_decay, bool) or not isinstance(steps_per_decay, numbers.Integral) or steps_per_decay < 1:
        raise ValueError(f"steps_per_decay must be an integer >= 1, got {steps_per_decay!r}")
    if decay == 1:  # optax treats end_value as an upper bound when decay_rate >= 1
        return optax.constant_schedule(max(tau0, tau_min))
    return optax.exponential_decay(tau0, steps_per_decay, decay, end_value=tau_min)


GATE_MODES = ("two_path", "gumbel_soft", "gumbel_hard", "softmax")


def arch_gates(mode: str, key, alpha, mask, tau=1.0) -> Gates:
    """Gates for an architecture step in the named mode (see GATE_MODES)."""
    if mode == "two_path":
        return two_path_gates(key, alpha, mask)
    if mode == "gumbel_soft":
        return gumbel_softmax_gates(key, alpha, mask, tau, hard=False)
    if mode == "gumbel_hard":
        return gumbel_softmax_gates(key, alpha, mask, tau, hard=True)
    if mode == "softmax":
        return softmax_gates(alpha, mask)
    raise ValueError(f"unknown gate mode {mode!r}; expected one of {GATE_MODES}")


def derive(alpha, mask):
    """The derived (argmax) architecture ops int32[N] over valid candidates."""
    return jnp.argmax(masked_logits(alpha, mask), axis=-1).astype(jnp.int32)
