"""REINFORCE over architectures, with two policies and the latency-aware reward shapes of the literature.

Policies (``make_policy``):

* ``"independent"``: one categorical distribution per layer, logits float32[N, R] (masked ops get probability 0).
* ``"lstm"``: an LSTM controller that emits the N decisions in sequence, as in ENAS and the separable-network
  paper (004, section 3): step 0 reads a learned start embedding and a zero state; every later step reads the
  embedding of the previous decision; a per-layer linear head gives the R logits of that layer. The hidden size
  defaults to 100, the controller size of paper 004.

Update (``tell``): rewards are the caller's fitness float32[P]; a non-finite reward (a hard-constraint violation)
is replaced by the smallest finite reward of the batch (all equal when none is finite, so no update). The
exponential moving-average baseline b is updated first, ``b <- d b + (1 - d) mean(r)`` (``b = mean(r)`` on the
first tell), then the policy takes one optax step on ``-mean((r - b) log pi(a)) - c_H mean(H(pi))``.

Reward shapes (pure, jit-able; acc in [0, 1], latencies in ms, all of the same unit):

* ProxylessNAS: ``acc * (T_ref / T) ** w``  (the paper writes ``ACC * (LAT / T) ** w'`` with ``w' = -w``).
* MnasNet: ``acc * (T / T_target) ** w`` with ``w = alpha`` if ``T <= T_target`` else ``beta``; soft constraint
  ``alpha = beta = -0.07``, hard constraint ``alpha = 0, beta = -1``.
* TuNAS (absolute reward): ``acc + beta * |T / T_ref - 1|`` with ``beta < 0``.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jmsnas.space import Arch
from jmsnas.strategies.base import (Strategy, check_float, check_int, check_mask, finite_or_worst,
                                    masked_logits, register, update_best)

POLICIES = ("independent", "lstm")


# ------------------------------------------------------------------------------------------------ reward shapes

def _check_finite(name, value):
    if isinstance(value, (int, float)) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def proxyless_reward(acc, latency_ms, ref_ms, w: float):
    """ProxylessNAS's REINFORCE reward ``acc * (ref_ms / latency_ms) ** w`` (w > 0 rewards lower latency)."""
    _check_finite("w", w)
    return acc * (ref_ms / latency_ms) ** w


def mnasnet_reward(acc, latency_ms, target_ms, alpha: float = -0.07, beta: float = -0.07):
    """MnasNet's reward ``acc * (T / T_target) ** w``, w = alpha where T <= T_target else beta. The defaults are
    the soft constraint; ``alpha=0, beta=-1`` is the hard one (see ``mnasnet_hard_reward``)."""
    _check_finite("alpha", alpha)
    _check_finite("beta", beta)
    ratio = latency_ms / target_ms
    return acc * ratio ** jnp.where(latency_ms <= target_ms, alpha, beta)


def mnasnet_hard_reward(acc, latency_ms, target_ms):
    """MnasNet's hard-constraint reward: ``acc`` at or under the target, ``acc * T_target / T`` above it."""
    return mnasnet_reward(acc, latency_ms, target_ms, alpha=0.0, beta=-1.0)


def tunas_reward(acc, latency_ms, ref_ms, beta: float):
    """TuNAS's absolute reward ``acc + beta * |latency_ms / ref_ms - 1|`` with beta < 0."""
    _check_finite("beta", beta)
    if isinstance(beta, (int, float)) and beta >= 0:
        raise ValueError(f"beta must be negative (it penalises distance from the reference latency), got {beta!r}")
    return acc + beta * jnp.abs(latency_ms / ref_ms - 1.0)


# ------------------------------------------------------------------------------------------------------- policies

class Policy(NamedTuple):
    """``init(key) -> params``; ``sample(params, key, num) -> ops int32[num, N]``;
    ``log_prob(params, ops int32[P, N]) -> (log pi float32[P], entropy float32[P])``; ``mode(params) -> int32[N]``."""

    init: Callable[..., Any]
    sample: Callable[..., Any]
    log_prob: Callable[..., Any]
    mode: Callable[..., Any]


class Controller(nn.Module):
    """One step of the LSTM controller: (carry, previous decision int32[...], layer n) -> (carry, logits [..., R]).

    The previous decision is an op index, or ``num_ops`` for the start token."""

    num_layers: int
    num_ops: int
    hidden: int = 100

    def setup(self):
        self.embed = nn.Embed(self.num_ops + 1, self.hidden)
        self.cell = nn.OptimizedLSTMCell(self.hidden)
        uniform = lambda k, s, d=jnp.float32: jax.random.uniform(k, s, d, -0.1, 0.1)
        self.head_w = self.param("head_w", uniform, (self.num_layers, self.hidden, self.num_ops))
        self.head_b = self.param("head_b", nn.initializers.zeros, (self.num_layers, self.num_ops))

    def __call__(self, carry, token, n):
        carry, h = self.cell(carry, self.embed(token))
        return carry, h @ self.head_w[n] + self.head_b[n]


def _independent(mask) -> Policy:
    def init(key):
        del key
        return {"logits": jnp.zeros(mask.shape, jnp.float32)}

    def sample(params, key, num):
        logits = masked_logits(params["logits"], mask)
        return jax.random.categorical(key, logits, shape=(num, mask.shape[0])).astype(jnp.int32)

    def log_prob(params, ops):
        logp = jax.nn.log_softmax(masked_logits(params["logits"], mask), axis=-1)  # [N, R]
        lp = jnp.take_along_axis(logp[None], ops[..., None], axis=-1)[..., 0].sum(-1)
        ent = -jnp.sum(jnp.exp(logp) * logp)
        return lp, jnp.broadcast_to(ent, lp.shape)

    def mode(params):
        return jnp.argmax(masked_logits(params["logits"], mask), axis=-1).astype(jnp.int32)

    return Policy(init, sample, log_prob, mode)


def _lstm(mask, hidden: int) -> Policy:
    n_layers, n_ops = mask.shape
    net = Controller(n_layers, n_ops, hidden)
    layers = jnp.arange(n_layers)

    def zero_carry(num):
        z = jnp.zeros((num, hidden), jnp.float32)
        return z, z

    def init(key):
        return net.init(key, zero_carry(1), jnp.full((1,), n_ops, jnp.int32), 0)

    def logits_at(params, c, tok, n):
        c, logits = net.apply(params, c, tok, n)
        return c, masked_logits(logits, mask[n])

    def sample_body(carry, xs):
        params, c, tok = carry
        n, key = xs
        c, logits = logits_at(params, c, tok, n)
        a = jax.random.categorical(key, logits).astype(jnp.int32)
        return (params, c, a), a

    def greedy_body(carry, n):
        params, c, tok = carry
        c, logits = logits_at(params, c, tok, n)
        a = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (params, c, a), a

    def log_prob_body(carry, xs):
        params, c = carry
        n, tok, a = xs
        c, logits = logits_at(params, c, tok, n)
        logp = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp, a[:, None], axis=-1)[:, 0]
        return (params, c), (lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1))

    def start(params, num):
        return params, zero_carry(num), jnp.full((num,), n_ops, jnp.int32)

    def sample(params, key, num):
        _, acts = jax.lax.scan(sample_body, start(params, num), (layers, jax.random.split(key, n_layers)))
        return acts.T

    def mode(params):
        return jax.lax.scan(greedy_body, start(params, 1), layers)[1][:, 0]

    def log_prob(params, ops):
        num = ops.shape[0]
        prev = jnp.concatenate([jnp.full((num, 1), n_ops, jnp.int32), ops[:, :-1]], axis=1)
        _, (lp, ent) = jax.lax.scan(log_prob_body, (params, zero_carry(num)), (layers, prev.T, ops.T))
        return lp.sum(0), ent.sum(0)

    # jitted inside so that eager (Python-driven) ask/tell calls compile these scans once, not on every call
    return Policy(init, jax.jit(sample, static_argnums=2), jax.jit(log_prob), jax.jit(mode))


def make_policy(mask, kind: str = "independent", hidden: int = 100) -> Policy:
    """The sampling policy over a bool[N, R] op ``mask``: ``"independent"`` or ``"lstm"`` (hidden units)."""
    mask = jnp.asarray(check_mask(mask))
    if kind not in POLICIES:
        raise ValueError(f"unknown policy {kind!r}; expected one of {list(POLICIES)}")
    if kind == "lstm":
        return _lstm(mask, check_int("hidden", hidden, 1))
    return _independent(mask)


# -------------------------------------------------------------------------------------------------- the strategy

class ReinforceState(NamedTuple):
    params: Any  # policy parameters (pytree)
    opt_state: Any  # optax state of the policy optimizer
    baseline: jnp.ndarray  # float32[], EMA of the mean reward
    step: jnp.ndarray  # int32[], number of tells so far
    best_ops: jnp.ndarray  # int32[N]
    best_fitness: jnp.ndarray  # float32[]


@register("reinforce")
def reinforce(mask, *, policy: str = "independent", population: int = 16, learning_rate: float | None = None,
              baseline_decay: float = 0.95, entropy_coef: float = 0.0, hidden: int = 100) -> Strategy:
    """REINFORCE with an EMA baseline and Adam (eps 1e-6). ``population`` architectures are sampled per ask.

    ``learning_rate`` defaults to 0.05 for the independent logits and 3.5e-4 (ENAS's controller rate) for the LSTM.
    """
    pol = make_policy(mask, policy, hidden)
    n_layers = check_mask(mask).shape[0]
    p = check_int("population", population, 1)
    if learning_rate is None:
        learning_rate = 0.05 if policy == "independent" else 3.5e-4
    lr = check_float("learning_rate", learning_rate, 0.0, float("inf"), lo_open=True, hi_open=True)
    decay = check_float("baseline_decay", baseline_decay, 0.0, 1.0, hi_open=True)
    ent_c = check_float("entropy_coef", entropy_coef, 0.0, float("inf"), hi_open=True)
    # eps = 1e-6 rather than Adam's 1e-8: when the advantages sum to zero, weights that every sample shares get
    # gradients that are zero up to rounding (~1e-9), which eps = 1e-8 would turn into ~10% of a full step.
    opt = optax.adam(lr, eps=1e-6)

    def init(key):
        params = pol.init(key)
        return ReinforceState(params, opt.init(params), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                              jnp.zeros((n_layers,), jnp.int32), jnp.asarray(-jnp.inf, jnp.float32))

    def ask(key, state):
        return Arch(pol.sample(state.params, key, p)), state

    def tell(key, archs, fitness, state):
        """``fitness`` float32[P] is the reward (apply a reward shape first); ``key`` is unused."""
        del key
        r = finite_or_worst(fitness)
        b = jnp.where(state.step == 0, jnp.mean(r), decay * state.baseline + (1.0 - decay) * jnp.mean(r))
        adv = r - b

        def loss_fn(params):
            lp, ent = pol.log_prob(params, archs.ops)
            return -jnp.mean(adv * lp) - ent_c * jnp.mean(ent), jnp.mean(ent)

        (loss, ent), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        best_ops, best_f = update_best(state.best_ops, state.best_fitness, archs.ops, fitness)
        metrics = {"mean_reward": jnp.mean(r), "baseline": b, "loss": loss, "entropy": ent, "best_fitness": best_f}
        return ReinforceState(params, opt_state, b, state.step + 1, best_ops, best_f), metrics

    return Strategy(init, ask, tell)


register("reinforce_lstm")(functools.partial(reinforce, policy="lstm"))
