"""Stage 1 of every weight-sharing search (``jmsnas evolve``, SplitNets): the supernet trained with the sandwich
rule (OFA/BigNAS) on the run layer's epoch loop. What the flow's space differs in (how sub-networks are drawn and
run, the epoch's history row) comes in a ``run.evolution.Problem``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmsnas import tensorboard as tb, train
from jmsnas.objectives import cross_entropy, l2_norm_sq
from jmsnas.run import loop
from jmsnas.strategies.base import sample_valid


def init_sandwich_state(key, init, lr: float) -> train.SupernetState:
    """The sandwich step's first state: the supernet of ``init(key) -> (params, bn)``, Adam's zero moments."""
    k_init, k_run = jax.random.split(key)
    params, bn = init(k_init)
    return train.SupernetState(params, bn, train.init_optimizer(optax.adam(lr), params), k_run,
                               train.zeros((), np.int32))


def sandwich_archs(key, mask, largest, smallest, num_random: int) -> jnp.ndarray:
    """int32[2 + num_random, N]: the largest, the smallest, then ``num_random`` uniform valid sub-networks of
    ``mask`` bool[N, R]."""
    rand = sample_valid(key, jnp.asarray(mask), num_random)
    return jnp.concatenate([jnp.asarray(largest)[None], jnp.asarray(smallest)[None], rand]).astype(jnp.int32)


def sandwich(lr: float, lambda1: float, sample, apply, keys: int = 1):
    """The pure step ``(state, x, y) -> (state, metrics)`` of a supernet trained with the sandwich rule; jit it.
    ``sample(*keys) -> archs`` draws the step's K sub-networks (a pytree with a leading axis K: the largest, the
    smallest, then random ones) with ``keys`` keys split off the state's; ``apply(params, bn, arch, x) -> (logits,
    bn)`` runs one. They run in turn inside one ``lax.scan`` (one compiled body whatever they are); each updates the
    running statistics of the BN it used, the next starts from those. The update is one Adam step on
    sum_k grad CE_k + lambda1 grad ||w||^2. Metrics: ``loss``/``acc`` (mean CE / accuracy over the sub-networks),
    ``*_largest``, ``*_smallest``."""
    tx = optax.adam(lr)

    def loss_fn(p, bn, arch, x, y):
        logits, bn = apply(p, bn, arch, x)
        return cross_entropy(logits, y), (bn, jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32)))

    def step(st: train.SupernetState, x, y):
        key, *ks = jax.random.split(st.key, 1 + keys)

        def body(carry, arch):
            grads, bn = carry
            (ce, (bn, acc)), g = jax.value_and_grad(loss_fn, has_aux=True)(st.params, bn, arch, x, y)
            return (jax.tree_util.tree_map(jnp.add, grads, g), bn), (ce, acc)

        zeros = jax.tree_util.tree_map(jnp.zeros_like, st.params)
        (grads, bn), (ce, acc) = jax.lax.scan(body, (zeros, st.bn), sample(*ks))
        grads = jax.tree_util.tree_map(jnp.add, grads, jax.grad(lambda p: lambda1 * l2_norm_sq(p))(st.params))
        updates, opt = tx.update(grads, st.opt, st.params)
        st = train.SupernetState(optax.apply_updates(st.params, updates), bn, opt, key, st.step + 1)
        return st, {"loss": jnp.mean(ce), "acc": jnp.mean(acc), "loss_largest": ce[0], "acc_largest": acc[0],
                    "loss_smallest": ce[1], "acc_smallest": acc[1]}

    return step


def train_supernet(cfg, problem, ds, mesh, ckpt, fp: str, resume: bool, progress: bool):
    """Stage 1: ``problem.step`` (a ``run.evolution.Problem``) over ``cfg.evolve.epochs`` epochs of ``ds.train`` on
    the run layer's epoch loop (checkpoints in ``ckpt`` every ``checkpoint_every`` steps and at epoch ends, None:
    none), from ``init_sandwich_state``; returns (state, history)."""
    def end_epoch(st, epoch, m):
        row = problem.end_epoch(st, epoch, m)
        tb.log(epoch, tb.history_scalars(row))
        return row

    return loop.epochs(
        init_sandwich_state(jax.random.PRNGKey(cfg.seed), problem.init, cfg.search.weight_lr), cfg=cfg, ckpt=ckpt,
        fp=fp, resume=resume, total=cfg.evolve.epochs, split=ds.train, batch_size=cfg.search.batch_size,
        seed=cfg.seed, step=lambda st, epoch, i, batch: problem.step(st, *train.shard_batch(batch, mesh)),
        place=lambda st: train.replicate(st, mesh), desc="supernet", progress=progress, end_epoch=end_epoch,
        postfix=lambda st, m: {"loss": f"{float(m['loss']):.3f}", "big": f"{float(m['acc_largest']):.3f}",
                               "small": f"{float(m['acc_smallest']):.3f}"})
