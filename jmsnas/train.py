"""The two stages of JMSNAS as pure jitted steps (paper 003, section V-B).

Stage 1 (search): warm-up epochs train the weights only; then every weight step (one candidate sampled per layer
from p = softmax(alpha), weights updated on the training split) is followed, every ``arch_every`` steps, by an
architecture step (gates reset: two paths sampled, alpha updated on the validation split through eq. (5), with the
latency term of eq. (4)). Adam for both. After every epoch the derived (argmax) network is evaluated on validation.
Stage 2 (retrain): the derived architecture is fixed and its compact network retrained from the stage-1 weights.

Every step is ``(state, x, y) -> (state, metrics)``, jitted once with the state donated. Steps run under a
``jax.sharding.Mesh`` over all devices: the batch is sharded along ``data``, everything else replicated, so the
same code is single-device, multi-device and (after ``jax.distributed.initialize()``) multi-host.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmsnas import gates as G
from jmsnas import ops as O
from jmsnas import supernet
from jmsnas.cost.latency import expected_latency, searched_latency
from jmsnas.cost.tables import CostTable
from jmsnas.objectives import cross_entropy, l2_norm_sq, latency_penalty
from jmsnas.space import NUM_OPS, SearchSpace


class SearchState(NamedTuple):
    """Everything stage 1 needs to continue: weights, BN statistics, alpha[N, R], both Adam states, PRNG key, step."""

    params: dict
    bn: dict
    alpha: jnp.ndarray
    weight_opt: tuple
    arch_opt: tuple
    key: jnp.ndarray  # uint32[2] raw PRNG key
    step: jnp.ndarray  # int32 scalar: weight steps taken


class SupernetState(NamedTuple):
    """A weight-sharing supernet's training (``jmsnas evolve``'s sandwich rule, SplitNets, FBNet's single path):
    weights, BN running statistics, Adam state, PRNG key (uint32[2]), steps taken."""

    params: dict
    bn: dict
    opt: tuple
    key: jnp.ndarray
    step: jnp.ndarray


class RetrainState(NamedTuple):
    """Stage 2: the compact network's weights, BN statistics, Adam state and step."""

    params: dict
    bn: dict
    opt: tuple
    step: jnp.ndarray


class SearchHParams(NamedTuple):
    weight_lr: float = 2e-3
    arch_lr: float = 2e-3
    lambda1: float = 1e-5
    lambda2: float = 1.0
    t_const_ms: float = 1.0
    penalty: str = "two_sided"
    gate_mode: str = "two_path"
    tau0: float = 5.0
    tau_min: float = 0.1
    tau_decay: float = 0.97
    split: str = "fixed"  # "fixed": D^m from the topology; "searched": best chain split of E[tau] in every step
    lambda_limits: float = 0.0  # weight of the per-device memory/energy hinge (jmsnas.limits); 0: no term
    activation_bits: int = 32  # the activations' width in the memory term


def data_mesh(devices=None) -> Mesh:
    """A 1-D mesh named ``data`` over all (global) devices."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devices, ("data",))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of everything but the batch: a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, P())


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, replicated(mesh))


def shard_batch(batch, mesh: Mesh):
    """Places a global batch (numpy) sharded along its first axis; each host passes the same global batch."""
    sharding = NamedSharding(mesh, P("data"))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    n, i = jax.process_count(), jax.process_index()
    return jax.tree_util.tree_map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.array_split(a, n)[i], a.shape), batch)


def init_optimizer(tx: optax.GradientTransformation, params):
    """``tx.init(params)`` as one executable: called eagerly, optax's zeros compile one executable per parameter
    shape (dozens for a supernet), each traced and looked up again on every run."""
    return jax.jit(tx.init)(params)


@functools.lru_cache(maxsize=16)
def adam_init(lr: float):
    """``jax.jit(optax.adam(lr).init)``, one function per learning rate, so that its executable (compiled ahead,
    ``jmsnas.ahead``, or at a first call) serves every later call with the same shapes."""
    return jax.jit(optax.adam(lr).init)


def zeros(shape, dtype=np.float32):
    """A zero array placed on the default device without compiling anything."""
    return jax.device_put(np.zeros(shape, dtype))


def init_search_state(key, space: SearchSpace, hp: SearchHParams, shared_weights: bool = True) -> SearchState:
    """The search's initial state (supernet weights and batch norms, alpha = 0, both optimizers' states, the run's
    key) from ``key``, computed by one executable (``_init_program``)."""
    return _init_program(space, hp.weight_lr, hp.arch_lr, shared_weights)(key)


@functools.lru_cache(maxsize=16)
def _init_program(space: SearchSpace, weight_lr: float, arch_lr: float, shared_weights: bool):
    """``_search_state`` as one jitted program whose weight draws are taken together (``ops.one_draw``): the same
    bits as initialising eagerly, which compiled 35 executables (a random draw per weight shape, key splits,
    optax's zeros)."""
    hp = SearchHParams(weight_lr=weight_lr, arch_lr=arch_lr)
    return jax.jit(O.one_draw(lambda key: _search_state(key, space, hp, shared_weights)))


def _search_state(key, space: SearchSpace, hp: SearchHParams, shared_weights: bool) -> SearchState:
    k_init, k_run = jax.random.split(key)
    params, bn = supernet.init(k_init, space, shared_weights=shared_weights)
    alpha = zeros((space.num_layers, NUM_OPS))
    return SearchState(params, bn, alpha, init_optimizer(optax.adam(hp.weight_lr), params),
                       init_optimizer(optax.adam(hp.arch_lr), alpha), k_run, zeros((), np.int32))


def _accuracy(logits, y):
    return jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))


def make_search_steps(space: SearchSpace, table: CostTable, hp: SearchHParams, dw_impl: str = "auto",
                      candidate_impl: str = "auto"):
    """(weight_step, arch_step, eval_step), each jitted once; the two training steps donate the state.

    ``candidate_impl``: how the supernet computes sampled candidates ("auto", "own", "padded";
    ``supernet.candidate_impl``)."""
    mask = jnp.asarray(space.mask())
    w_tx, a_tx = optax.adam(hp.weight_lr), optax.adam(hp.arch_lr)
    tau_at = G.temperature_schedule(hp.tau0, hp.tau_min, hp.tau_decay)

    def weight_step(st: SearchState, x, y):
        key, k = jax.random.split(st.key)
        gates = G.single_path_gates(k, st.alpha, mask)

        def loss_fn(params):
            logits, bn = supernet.apply(space, params, st.bn, gates, x, train=True, dw_impl=dw_impl,
                                        impl=candidate_impl)
            ce = cross_entropy(logits, y)
            return ce + hp.lambda1 * l2_norm_sq(params), (ce, bn, logits)

        (loss, (ce, bn, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(st.params)
        updates, w_opt = w_tx.update(grads, st.weight_opt, st.params)
        st = st._replace(params=optax.apply_updates(st.params, updates), bn=bn, weight_opt=w_opt, key=key,
                         step=st.step + 1)
        return st, {"loss": loss, "ce": ce, "acc": _accuracy(logits, y)}

    def arch_step(st: SearchState, x, y):
        key, k = jax.random.split(st.key)
        tau = tau_at(st.step)

        def loss_fn(alpha):
            gates = G.arch_gates(hp.gate_mode, k, alpha, mask, tau)
            logits, _ = supernet.apply(space, st.params, st.bn, gates, x, train=True, dw_impl=dw_impl,
                                       impl=candidate_impl)
            ce = cross_entropy(logits, y)
            t = step_latency(space, table, alpha, hp.split)
            loss = ce + hp.lambda2 * latency_penalty(t, hp.t_const_ms, hp.penalty)
            if hp.lambda_limits:
                loss = loss + hp.lambda_limits * step_limits_penalty(space, table, alpha, hp)
            return loss, (ce, t)

        (loss, (ce, t)), grad = jax.value_and_grad(loss_fn, has_aux=True)(st.alpha)
        updates, a_opt = a_tx.update(grad, st.arch_opt, st.alpha)
        st = st._replace(alpha=optax.apply_updates(st.alpha, updates), arch_opt=a_opt, key=key)
        return st, {"arch_loss": loss, "arch_ce": ce, "expected_latency_ms": t}

    def eval_step(params, bn, ops, x, y, valid):
        logits, _ = supernet.apply(space, params, bn, G.onehot_gates(ops, NUM_OPS), x, train=False,
                                   dw_impl=dw_impl, impl=candidate_impl)
        return _eval_sums(logits, y, valid)

    return (jax.jit(weight_step, donate_argnums=0), jax.jit(arch_step, donate_argnums=0), jax.jit(eval_step))


SPLITS = ("fixed", "searched")


def step_latency(space: SearchSpace, table: CostTable, alpha, split: str = "fixed"):
    """E[T] for the objective: under the fixed split, or under the best split of the current E[tau] (a DP whose
    argmin is held fixed for the gradient, so the gradient is that of eq. (1) at the chosen split: exact almost
    everywhere, whereas a smoothed minimum would mix in splits that cannot be deployed)."""
    if split == "fixed":
        return expected_latency(space, table, alpha).total
    if split == "searched":
        return searched_latency(space, table, G.probabilities(alpha, jnp.asarray(space.mask())))[0].total
    raise ValueError(f"unknown split mode {split!r}; expected one of {SPLITS}")


def step_limits_penalty(space: SearchSpace, table: CostTable, alpha, hp: SearchHParams):
    """The devices' memory/energy hinge (``limits.expected_penalty``) under the step's split (D^m, or the best
    chain split of the current E[tau], held fixed for the gradient as in ``step_latency``)."""
    from jmsnas import limits
    assignment = None
    if hp.split == "searched":
        assignment = searched_latency(space, table, G.probabilities(alpha, jnp.asarray(space.mask())))[1]
    return limits.expected_penalty(space, table, limits.device_limits(space, hp.activation_bits), alpha, assignment)


def _eval_sums(logits, y, valid):
    correct = jnp.sum((jnp.argmax(logits, -1) == y) * valid)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return correct, jnp.sum(losses * valid)


def init_retrain_state(space: SearchSpace, st: SearchState, ops, lr) -> RetrainState:
    params, bn = supernet.extract(space, st.params, st.bn, ops)
    return RetrainState(params, bn, adam_init(lr)(params), zeros((), np.int32))


def compact_steps(apply, lr, lambda1: float):
    """(train_step, eval_step), jitted, of a compact network ``apply(params, bn, x, train) -> (logits, bn)``:
    Adam on cross-entropy + lambda1 L2 over a ``RetrainState``, and the evaluation sums (correct, loss)."""
    tx = optax.adam(lr)

    def train_step(st: RetrainState, x, y):
        def loss_fn(params):
            logits, bn = apply(params, st.bn, x, True)
            ce = cross_entropy(logits, y)
            return ce + lambda1 * l2_norm_sq(params), (ce, bn, logits)

        (loss, (ce, bn, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(st.params)
        updates, opt = tx.update(grads, st.opt, st.params)
        st = RetrainState(optax.apply_updates(st.params, updates), bn, opt, st.step + 1)
        return st, {"loss": loss, "ce": ce, "acc": _accuracy(logits, y)}

    def eval_step(params, bn, x, y, valid):
        logits, _ = apply(params, bn, x, False)
        return _eval_sums(logits, y, valid)

    return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)


@functools.lru_cache(maxsize=16)  # the same jitted steps for the same network: _finish reuses the retraining trace
def make_retrain_steps(space: SearchSpace, ops: tuple, lr, lambda1: float, dw_impl: str = "auto"):
    """(train_step, eval_step) of the compact network ``ops`` (static): ``compact_steps`` of
    ``supernet.compact_apply``."""
    return compact_steps(lambda params, bn, x, train: supernet.compact_apply(space, ops, params, bn, x, train=train,
                                                                             dw_impl=dw_impl), lr, lambda1)


def padded_eval_batches(split, batch_size: int):
    """Fixed-size evaluation batches (x, y, valid) covering every example once; the last one zero-padded."""
    n = len(split.labels)
    for start in range(0, n, batch_size):
        x, y = split.images[start:start + batch_size], split.labels[start:start + batch_size]
        k = len(y)
        valid = np.zeros(batch_size, np.float32)
        valid[:k] = 1.0
        if k < batch_size:
            x = np.concatenate([x, np.zeros((batch_size - k,) + x.shape[1:], x.dtype)])
            y = np.concatenate([y, np.zeros(batch_size - k, y.dtype)])
        yield x, y, valid


def evaluate(eval_fn, split, batch_size: int, mesh: Mesh) -> tuple:
    """(accuracy, mean loss) of ``eval_fn(x, y, valid) -> (correct, loss_sum)`` over a whole split."""
    correct = loss = 0.0
    for x, y, valid in padded_eval_batches(split, batch_size):
        c, l = eval_fn(*shard_batch((x, y, valid), mesh))
        correct, loss = correct + float(c), loss + float(l)
    n = len(split.labels)
    return correct / n, loss / n


def final_accuracy(eval_step, rt, ds, batch_size: int, mesh: Mesh) -> tuple:
    """(validation, test) accuracy of a retrained state ``rt`` (params, bn) under ``eval_step(params, bn, x, y,
    valid)``: what a search's result.json reports."""
    ev = lambda split: evaluate(lambda x, y, v: eval_step(rt.params, rt.bn, x, y, v), split, batch_size, mesh)[0]
    return ev(ds.val), ev(ds.test)


def fill_derived_latency(history: list, total_ms: float) -> None:
    """Gives the rows without a derived latency (stage 2's) the final network's T, in place."""
    for h in history:
        if h["derived_latency_ms"] is None:
            h["derived_latency_ms"] = total_ms
