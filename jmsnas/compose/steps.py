"""The composed search's two stages as pure jitted steps, as ``jmsnas.train`` has them for the ops alone.

Stage 1: a weight step samples one candidate of every group (op, weight bits, module, transmitted bits) from its
softmax and trains the weights (modules included) on the training split; an architecture step samples every group
in the ops' gate mode and updates all four groups of logits on the validation split with
loss = CE + lambda2 * penalty(E[T] - T_const) + lambda_limits * hinge, E[T] and the devices' memory/energy hinge
from ``compose.objective.step_costs`` (every group's gradient flows through both the cross-entropy and the costs).
The split is the topology's D^m, or, ``split="searched"``, the best split of the current expectations
(``compose.cost.best_assignment``), recomputed in every step as data: the forward does not recompile.
Stage 2 trains the derived network (``net.compact_apply``) with its modules and fake quantization.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmsnas import gates as G
from jmsnas import ops as O
from jmsnas import supernet
from jmsnas.compose import cost as K
from jmsnas.compose import net as N
from jmsnas.compose.choices import ChoiceProbs, Choices, Config, logits_shapes, onehot, probs_from_logits
from jmsnas.compose.objective import step_costs
from jmsnas.compose.terms import Terms
from jmsnas.objectives import cross_entropy, l2_norm_sq, latency_penalty
from jmsnas.space import NUM_OPS
from jmsnas.train import RetrainState, compact_steps


class ComposedState(NamedTuple):
    """Stage 1: weights (the supernet's and ``modules``), BN statistics, every group's logits (a ChoiceProbs of
    arrays; ops float[N, R] is alpha), both Adam states, the PRNG key (uint32[2]) and the weight steps taken."""

    params: dict
    bn: dict
    logits: ChoiceProbs
    weight_opt: tuple
    arch_opt: tuple
    key: jnp.ndarray
    step: jnp.ndarray


def init_state(key, space, choices: Choices, hp, split: str, shared_weights: bool = True) -> ComposedState:
    """The initial state, one compiled program (``_init_program``): the supernet drawn from ``key`` as
    ``train.init_search_state`` draws it, the modules from a key of their own, every logit 0."""
    return _init_program(space, choices, split, float(hp.weight_lr), float(hp.arch_lr), bool(shared_weights))(key)


@functools.lru_cache(maxsize=16)
def _init_program(space, choices: Choices, split: str, weight_lr: float, arch_lr: float, shared_weights: bool):
    def init(key):
        k_init, k_run = jax.random.split(key)
        params, bn = supernet.init(k_init, space, shared_weights=shared_weights)
        params = dict(params)
        k_mod, k_run = jax.random.split(k_run)
        params["modules"] = N.init_modules(k_mod, space, choices, split)
        logits = ChoiceProbs(*(jnp.zeros(s, jnp.float32) for s in logits_shapes(space, choices)))
        return ComposedState(params, bn, logits, optax.adam(weight_lr).init(params), optax.adam(arch_lr).init(logits),
                             k_run, jnp.zeros((), jnp.int32))

    return jax.jit(O.one_draw(init))


def current_split(space, table, terms: Terms, choices: Choices, logits: ChoiceProbs, split: str):
    """int32[N]: D^m, or the best split of the current expectations (no gradient)."""
    if split == "fixed":
        return jnp.asarray(space.layer_devices(), jnp.int32)
    probs = probs_from_logits(space, choices, jax.lax.stop_gradient(logits))
    return K.best_assignment(space, table, terms, probs)


def derive_config(space, choices: Choices, logits: ChoiceProbs):
    """The argmax of every group (traced) over its valid candidates: ops int32[N] over the valid ops, the others
    over ``Choices.row_masks``."""
    return Config(G.derive(logits.ops, jnp.asarray(space.mask())),
                  *(G.derive(a, m) for a, m in zip(logits[1:], choices.row_masks(logits[1:]))))


def make_steps(space, table, terms: Terms, choices: Choices, hp, limits=None, dw_impl: str = "auto",
               candidate_impl: str = "auto"):
    """(weight_step, arch_step, eval_step), each jitted once; the two training steps donate the state. ``hp``:
    ``train.SearchHParams`` (its ``split``, ``gate_mode``, ``lambda_limits`` apply); ``limits``: the devices'
    ``DeviceLimits`` for the hinge (None: no hinge)."""
    mask = jnp.asarray(space.mask())
    w_tx, a_tx = optax.adam(hp.weight_lr), optax.adam(hp.arch_lr)
    tau_at = G.temperature_schedule(hp.tau0, hp.tau_min, hp.tau_decay)
    fwd = functools.partial(N.apply, space, choices, hp.split, dw_impl=dw_impl, impl=candidate_impl)
    use_limits = limits if hp.lambda_limits else None

    def weight_step(st: ComposedState, x, y):
        key, k_ops, k_rest = jax.random.split(st.key, 3)
        gates = G.single_path_gates(k_ops, st.logits.ops, mask)
        cg = N.weight_gates(k_rest, st.logits[1:], choices)
        a = current_split(space, table, terms, choices, st.logits, hp.split)

        def loss_fn(params):
            logits, bn = fwd(params, st.bn, gates, cg, a, x, train=True)
            ce = cross_entropy(logits, y)
            return ce + hp.lambda1 * l2_norm_sq(params), (ce, bn, logits)

        (loss, (ce, bn, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(st.params)
        updates, w_opt = w_tx.update(grads, st.weight_opt, st.params)
        st = st._replace(params=optax.apply_updates(st.params, updates), bn=bn, weight_opt=w_opt, key=key,
                         step=st.step + 1)
        return st, {"loss": loss, "ce": ce, "acc": jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))}

    def arch_step(st: ComposedState, x, y):
        key, k_ops, k_rest = jax.random.split(st.key, 3)
        tau = tau_at(st.step)
        a = current_split(space, table, terms, choices, st.logits, hp.split)

        def loss_fn(lg: ChoiceProbs):
            gates = G.arch_gates(hp.gate_mode, k_ops, lg.ops, mask, tau)
            cg = N.arch_gates(hp.gate_mode, k_rest, lg[1:], choices, tau)
            logits, _ = fwd(st.params, st.bn, gates, cg, a, x, train=True)
            ce = cross_entropy(logits, y)
            costs = step_costs(space, table, terms, choices, lg, hp.split, use_limits)
            loss = ce + hp.lambda2 * latency_penalty(costs.latency_ms, hp.t_const_ms, hp.penalty)
            if use_limits is not None:
                loss = loss + hp.lambda_limits * costs.limits_penalty
            return loss, (ce, costs.latency_ms)

        (loss, (ce, t)), grad = jax.value_and_grad(loss_fn, has_aux=True)(st.logits)
        updates, a_opt = a_tx.update(grad, st.arch_opt, st.logits)
        st = st._replace(logits=optax.apply_updates(st.logits, updates), arch_opt=a_opt, key=key)
        return st, {"arch_loss": loss, "arch_ce": ce, "expected_latency_ms": t}

    def eval_step(params, bn, lg: ChoiceProbs, x, y, valid):
        config = derive_config(space, choices, lg)
        a = derived_split(space, table, terms, choices, config, hp.split)
        gates = G.onehot_gates(config.ops, NUM_OPS)
        logits, _ = fwd(params, bn, gates, N.onehot_gates(choices, config), a, x, train=False)
        correct = jnp.sum((jnp.argmax(logits, -1) == y) * valid)
        return correct, jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * valid)

    return jax.jit(weight_step, donate_argnums=0), jax.jit(arch_step, donate_argnums=0), jax.jit(eval_step)


def derived_split(space, table, terms, choices: Choices, config: Config, split: str):
    """int32[N]: D^m, or the best split of one configuration (traced)."""
    if split == "fixed":
        return jnp.asarray(space.layer_devices(), jnp.int32)
    return K.best_assignment(space, table, terms, onehot(space, choices, config))


def latencies(space, table, terms: Terms, choices: Choices, split: str):
    """A jitted ``logits -> (E[T] ms, T ms of the derived configuration under its split)``."""

    def both(lg):
        e = step_costs(space, table, terms, choices, lg, split).latency_ms
        config = derive_config(space, choices, lg)
        a = derived_split(space, table, terms, choices, config, split)
        return e, K.latency(space, table, terms, onehot(space, choices, config), a).total

    return jax.jit(both)


def init_retrain_state(space, st: ComposedState, net: N.Derived, lr: float) -> RetrainState:
    params, bn = N.extract(space, st.params, st.bn, net)
    return RetrainState(params, bn, optax.adam(lr).init(params), jnp.zeros((), jnp.int32))


@functools.lru_cache(maxsize=16)
def make_retrain_steps(space, net: N.Derived, lr: float, lambda1: float, dw_impl: str = "auto"):
    """(train_step, eval_step) of the derived network ``net`` (static): ``train.compact_steps`` of
    ``compose.net.compact_apply``."""
    return compact_steps(lambda params, bn, x, train: N.compact_apply(space, net, params, bn, x, train=train,
                                                                      dw_impl=dw_impl), lr, lambda1)
