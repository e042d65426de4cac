"""``jmsnas evolve``: the two-stage weight-sharing flow (SplitNets, paper 000, section 3.2; OFA/BigNAS training).

Stage 1 trains the supernet alone with the sandwich rule: every step computes the gradient of the largest
sub-network (the widest valid candidate of each layer: kernel 7, expansion 6, with shortcut where allowed), of
the smallest (identity where allowed, else kernel 3 / expansion 3) and of ``num_random`` uniformly sampled ones,
adds them up (plus the L2 term once) and makes one Adam update. Weights are shared (``supernet.init``), so every
sampled path trains weights the others use; the largest and smallest bound the range the search will query.

Stage 2 is evolution (``strategies.make("evolution")``) with the supernet as a fixed accuracy predictor; its
initial population is drawn inside the budget where possible (``feasible_population``). Fitness
of a population is its accuracy on a fixed validation subset from ``evaluate.evaluate_population`` (BN statistics
recalibrated per sub-network on a few training batches); the hard constraint T <= T_const discards a candidate
(fitness -inf) and the soft ranking is by that accuracy, ties broken by lower latency (a term below half an
example, so it never outweighs one correctly classified image). The winner is then retrained as in ``jmsnas
search`` (its weights inherited from the supernet) and the run writes the same outputs: result.json (plus
``"flow": "evolve"`` and an ``evolution`` summary), history.json, the report plots, parts/, and evolution.json
(per-generation statistics). Both stages checkpoint (``checkpoints/supernet``, ``checkpoints/evolution``) and a
run resumes from where it stopped, to the same result.

Settings live in ``cfg.evolve`` (``DEFAULTS`` fills what is missing); the supernet's batch size, learning rate and
L2 weight are ``cfg.search.batch_size``, ``weight_lr`` and ``lambda1``, the retrain is ``cfg.retrain``.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jmsnas import budget, data, limits, pipeline, programs, runcheck, strategies, supernet, timing, train
from jmsnas import space as S
from jmsnas import tensorboard as tb
from jmsnas.checkpoint import Checkpointer
from jmsnas.run import directory, loop, processes
from jmsnas.run.evolution import evolution
from jmsnas.run import workdir as W
from jmsnas.cost.latency import arch_latency, latency, searched_latency
from jmsnas.evaluate import evaluate_loop, evaluate_population
from jmsnas.gates import onehot_gates
from jmsnas.objectives import cross_entropy, l2_norm_sq
from jmsnas.pipeline import ConfigError
from jmsnas.space import IDENTITY, NUM_OPS, OPS, SearchSpace
from jmsnas.strategies.base import sample_valid

DEFAULTS = dict(
    epochs=10,  # supernet training epochs (stage 1)
    num_random=2,  # random sub-networks per step, besides the largest and the smallest
    population=512,  # SplitNets: 512 candidates ...
    generations=20,  # ... for 20 generations
    parent_ratio=0.25, mutation_prob=0.1, mutation_ratio=0.5,  # see strategies.evolution
    fitness_examples=512,  # validation examples the fitness is measured on (at most the whole split)
    bn_batches=4, bn_batch_size=64,  # BN recalibration: K training batches of this size (0 batches: running stats)
    chunk=8,  # evaluate_population's chunk of architectures (memory ~ chunk x fitness_examples activations)
    evaluator="batched",  # "batched": evaluate_population; "loop": one jitted evaluation per architecture
)
EVALUATORS = ("batched", "loop")
BOUNDS = {f"evolve.{name}": dict(low=low, integer=True) for name, low in  # runcheck.number's keyword arguments
          dict(epochs=1, num_random=0, population=2, generations=1, fitness_examples=1, bn_batches=0,
               bn_batch_size=1, chunk=1).items()}


# ----------------------------------------------------------------------------------------------- configuration

def with_defaults(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``cfg`` (modified in place and returned) with ``cfg.evolve`` holding every setting of ``DEFAULTS``.

    Raises ConfigError for keys of an existing ``cfg.evolve`` that are not settings."""
    with cfg.unlocked():
        cfg.evolve = ml_collections.ConfigDict(runcheck.with_defaults(cfg.get("evolve"), DEFAULTS, "evolve"))
        cfg.tensorboard = cfg.get("tensorboard", True)  # WORKDIR/tensorboard (jmsnas.tensorboard); False: none
    return cfg


def validate(cfg) -> None:
    """Checks ``cfg`` (pipeline.validate_config plus ``cfg.evolve``); ConfigError names the bad value."""
    pipeline.validate_config(cfg)
    runcheck.check_bounds(cfg, BOUNDS)
    e = cfg.evolve
    if e.evaluator not in EVALUATORS:
        raise ConfigError(f"evolve.evaluator must be one of {list(EVALUATORS)}, got {e.evaluator!r}")
    try:  # the strategy's own checks of its hyperparameters, on a one-layer mask
        make_strategy(np.ones((1, 1), bool), e)
    except ValueError as err:
        raise ConfigError(f"evolve.{err}") from None


# ----------------------------------------------------------------------------------------------- stage 1

def sandwich_ops(space: SearchSpace) -> tuple:
    """(largest, smallest) int32[N]: per layer the widest valid candidate (largest kernel, then expansion, then
    with shortcut) and the narrowest (identity where valid, else the smallest kernel, then expansion)."""
    mask = space.mask()
    size = lambda i: (OPS[i].kernel, OPS[i].expand, OPS[i].residual)
    largest = [max(np.flatnonzero(m), key=size) for m in mask]
    smallest = [IDENTITY if m[IDENTITY] else min(np.flatnonzero(m), key=size) for m in mask]
    return np.asarray(largest, np.int32), np.asarray(smallest, np.int32)


def sandwich_archs(key, mask, largest, smallest, num_random: int) -> jnp.ndarray:
    """int32[2 + num_random, N]: the largest, the smallest, then ``num_random`` uniform valid sub-networks."""
    rand = sample_valid(key, jnp.asarray(mask), num_random)
    return jnp.concatenate([jnp.asarray(largest)[None], jnp.asarray(smallest)[None], rand]).astype(jnp.int32)


def init_sandwich_state(key, init, lr: float) -> train.SupernetState:
    """The sandwich step's first state: the supernet of ``init(key) -> (params, bn)``, Adam's zero moments."""
    k_init, k_run = jax.random.split(key)
    params, bn = init(k_init)
    return train.SupernetState(params, bn, train.init_optimizer(optax.adam(lr), params), k_run,
                               train.zeros((), np.int32))


def sandwich(lr: float, lambda1: float, sample, apply, keys: int = 1):
    """The pure step ``(state, x, y) -> (state, metrics)`` of every supernet trained with the sandwich rule
    (``jmsnas evolve``, SplitNets); jit it. ``sample(*keys) -> archs`` draws the step's K sub-networks (a pytree
    with a leading axis K: the largest, the smallest, then random ones) with ``keys`` keys split off the state's;
    ``apply(params, bn, arch, x) -> (logits, bn)`` runs one. They run in turn inside one ``lax.scan`` (one compiled
    body whatever they are); each updates the running statistics of the BN it used, the next starts from those.
    The update is one Adam step on sum_k grad CE_k + lambda1 grad ||w||^2. Metrics: ``loss``/``acc`` (mean CE /
    accuracy over the sub-networks), ``*_largest``, ``*_smallest``."""
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


def sandwich_step(space: SearchSpace, lr: float, lambda1: float, num_random: int, dw_impl: str = "auto"):
    """``sandwich`` over ``space``: x float32[B, H, W, C], y int32[B]; the sub-networks are ``sandwich_archs``."""
    largest, smallest = sandwich_ops(space)
    mask = space.mask()
    return sandwich(lr, lambda1, lambda k: sandwich_archs(k, mask, largest, smallest, num_random),
                    lambda p, bn, ops, x: supernet.apply(space, p, bn, onehot_gates(ops, NUM_OPS), x, train=True,
                                                         dw_impl=dw_impl))


def make_sandwich_step(space: SearchSpace, lr: float, lambda1: float, num_random: int, dw_impl: str = "auto"):
    """``sandwich_step`` jitted once, with the state donated."""
    return jax.jit(sandwich_step(space, lr, lambda1, num_random, dw_impl), donate_argnums=0)


class Problem(NamedTuple):
    """What a weight-sharing search differs in (``jmsnas evolve``'s space, SplitNets'); ``search`` runs the rest:
    the supernet's epoch loop, the evolution from a population inside the limits, their checkpoints and resume."""

    mask: np.ndarray  # bool[N, R]: the valid choices of each of the N genes
    init: Callable  # key -> (params, bn): the supernet
    step: Callable  # the jitted sandwich step (``sandwich``)
    end_epoch: Callable  # (state, epoch, metrics) -> the supernet epoch's history row
    within: Callable  # ops int32[P, N] -> bool[P]: inside every hard limit (costs only, no network is run)
    fitness: Callable  # (state, ops int32[P, N]) -> the dict of ``run.evolution.evolution``
    tries: int = 64  # uniform draws per member of the initial population (``feasible_population``)
    fold: bool = True  # the initial population's key: fold_in(key, 0) (SplitNets: the key, as it always was)


def search(cfg, problem: Problem, ds, mesh, workdir: str, fp: str, resume: bool, progress: bool):
    """Stage 1 (``train_supernet``) and stage 2 (``evolve_population``), checkpointed under ``workdir/checkpoints``;
    returns (state, history, per-generation log, best feasible candidate, most accurate candidate)."""
    ckpt = lambda stage: Checkpointer(os.path.join(workdir, "checkpoints", stage))
    st, history = train_supernet(cfg, problem, ds, mesh, ckpt("supernet"), fp, resume, progress)
    return (st, history, *evolve_population(cfg, problem, st, ckpt("evolution"), fp, resume, progress))


def train_supernet(cfg, problem: Problem, ds, mesh, ckpt, fp: str, resume: bool, progress: bool):
    """Stage 1 on the run layer's epoch loop (checkpoints in ``ckpt`` every ``checkpoint_every`` steps and at epoch
    ends, None: none); returns (state, history)."""
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


def evolve_population(cfg, problem: Problem, st, ckpt, fp: str, resume: bool, progress: bool):
    """Stage 2: ``run.evolution.evolution`` with ``problem.fitness`` of the supernet ``st``, from an initial
    population inside the limits (``feasible_population``); returns (log, best, most accurate)."""
    e, key = cfg.evolve, jax.random.PRNGKey(cfg.seed + 4)
    strategy = make_strategy(problem.mask, e)
    k_init, k_pop = jax.random.split(jax.random.fold_in(key, 0) if problem.fold else key)
    es = strategy.init(k_init)  # generation 0 asks for es.population: start it inside the limits
    es = es._replace(population=jnp.asarray(feasible_population(k_pop, problem.mask, problem.within, e.population,
                                                                problem.tries)))
    return evolution(strategy, es, key, lambda ops: problem.fitness(st, ops), ckpt=ckpt, fp=fp, resume=resume,
                     total=e.generations, progress=progress)


def _epoch_entry(cfg, space, table, ds, mesh, st, eval_step, epoch, m) -> dict:
    """History row: train metrics of the last step, validation accuracy (running BN statistics) and latency of
    the largest sub-network (``val_acc``, ``derived_latency_ms``) and of the smallest (``*_smallest``)."""
    row = {"epoch": epoch, "stage": "search", "train_loss": float(m["loss"]), "train_acc": float(m["acc"]),
           "expected_latency_ms": None}
    for name, ops in zip(("", "_smallest"), sandwich_ops(space)):
        acc, _ = train.evaluate(lambda x, y, v: eval_step(st.params, st.bn, jnp.asarray(ops), x, y, v), ds.val,
                                cfg.eval_batch_size, mesh)
        lat = float(arch_latency(space, table, ops, pipeline.assignment(cfg, space, table, ops)).total)
        row.update({f"val_acc{name}": acc, f"derived_latency_ms{name}": lat})
    return row


# ----------------------------------------------------------------------------------------------- stage 2

def population_latency(space: SearchSpace, table, ops, split: str = "fixed") -> jnp.ndarray:
    """float32[P] total latency T (ms) of ops int32[P, N]: under the topology's split, or (``"searched"``) under
    each architecture's own best chain split, the same T that ``jmsnas search`` reports for it."""
    def one(o):
        onehot = jax.nn.one_hot(o, NUM_OPS)
        if split == "searched":
            return searched_latency(space, table, onehot)[0].total
        return latency(space, table, onehot).total

    return jax.vmap(one)(jnp.asarray(ops, jnp.int32))


_population_latency = jax.jit(population_latency, static_argnames=("space", "split"))


class FitnessData(NamedTuple):
    """Fixed inputs of the fitness: x float32[n, H, W, C], y int32[n], bn float32[K, B, H, W, C] or None."""

    x: np.ndarray
    y: np.ndarray
    bn: np.ndarray | None


def fitness_data(cfg, ds) -> FitnessData:
    """The first ``fitness_examples`` validation examples and the first ``bn_batches`` training batches (of
    ``bn_batch_size``, shuffled with seed + 3): the same every generation, so fitness is deterministic."""
    e = cfg.evolve
    n = min(e.fitness_examples, len(ds.val.labels))
    bn = None
    if e.bn_batches:
        if data.num_batches(ds.train, e.bn_batch_size) < e.bn_batches:
            raise ConfigError(f"evolve.bn_batches={e.bn_batches} batches of evolve.bn_batch_size="
                              f"{e.bn_batch_size} need {e.bn_batches * e.bn_batch_size} training examples, "
                              f"the split has {len(ds.train.labels)}")
        batches = data.epoch_batches(ds.train, e.bn_batch_size, seed=cfg.seed + 3, epoch=0)
        bn = np.stack([next(batches)[0] for _ in range(e.bn_batches)])
    return FitnessData(ds.val.images[:n], ds.val.labels[:n], bn)


def fitness(space, table, params, bn, ops, fd: FitnessData, t_const_ms: float, split: str, chunk: int,
            evaluator: str = "batched", lim: limits.DeviceLimits | None = None) -> dict:
    """Per architecture of ops int32[P, N]: ``accuracy`` (supernet, BN recalibrated), ``latency_ms``,
    ``feasible`` (T <= T_const and every device within its memory and energy limits) and ``fitness`` = accuracy -
    (T / T_const) / (2 n) where feasible, else -inf (n = number of fitness examples, so the latency term only
    breaks ties). numpy float64/bool arrays [P].
    ``evaluator``: "batched" (``evaluate_population`` in chunks of ``chunk``) or "loop" (``evaluate_loop``: one
    architecture at a time, the same accuracies up to float rounding, less memory). With several JAX processes
    the rows are shared out among them (``run.processes.spread``)."""
    if evaluator not in EVALUATORS:
        raise ValueError(f"evaluator must be one of {list(EVALUATORS)}, got {evaluator!r}")

    def accuracy(params, bn, rows):
        if evaluator == "loop":
            return evaluate_loop(space, table, params, bn, rows, fd.x, fd.y, bn_batches=fd.bn)["accuracy"]
        return evaluate_population(space, table, params, bn, rows, fd.x, fd.y, bn_batches=fd.bn,
                                   chunk=chunk)["accuracy"]

    acc = processes.spread(accuracy, params, bn, np.asarray(ops))
    lat = np.asarray(_population_latency(space, table, ops, split=split), np.float64)
    feasible = budget.within(lat, t_const_ms) & _within_limits(space, table, lim, ops, split)
    fit = np.where(feasible, acc - lat / t_const_ms / (2 * len(fd.y)), -np.inf)
    return {"accuracy": acc, "latency_ms": lat, "feasible": feasible, "fitness": fit}


def _within_limits(space, table, lim, ops, split) -> np.ndarray:
    """bool[P]: every device within its memory and energy limits (all True when ``lim`` is None or cannot bind)."""
    if lim is None or not limits.binding(space, table, lim, any_split=split == "searched"):
        return np.ones(np.shape(ops)[0], bool)
    return limits.population_within(space, table, lim, ops, split)


def make_strategy(mask, e) -> strategies.Strategy:
    """The evolution strategy over ``mask`` bool[N, R] with the settings of ``cfg.evolve`` (``e``)."""
    return strategies.make("evolution", mask=mask, population=e.population, parent_ratio=e.parent_ratio,
                           mutation_prob=e.mutation_prob, mutation_ratio=e.mutation_ratio)


def population_bytes(space: SearchSpace, size: int, tries: int = 64) -> int:
    """Bytes ``feasible_population`` holds at once: ``size * tries`` architectures of int32[N] with a float32
    per candidate of every layer for their latencies, and a float64 latency each."""
    return int(size) * tries * (space.num_layers * 4 * (1 + len(OPS)) + 8)


def feasible_population(key, mask, within, size: int, tries: int = 64) -> np.ndarray:
    """int32[size, N]: an initial population inside the limits where it can (rejection sampling, as OFA's
    evolution finder starts). ``size * tries`` uniform valid architectures of ``mask`` bool[N, R] are drawn and
    ``within(ops) -> bool[P]`` judges them (costs only: no network is run); those inside come first, in draw order,
    and others fill what is left."""
    cand = np.asarray(sample_valid(key, jnp.asarray(mask), size * tries))
    return cand[np.argsort(~np.asarray(within(cand)), kind="stable")[:size]]


def within_budget(space: SearchSpace, table, t_const_ms: float, split: str, lim: limits.DeviceLimits | None = None):
    """``ops int32[P, N] -> bool[P]``: T <= T_const and every device within its memory and energy limits."""
    return lambda ops: budget.within(np.asarray(_population_latency(space, table, ops, split=split), np.float64),
                                     t_const_ms) & _within_limits(space, table, lim, ops, split)


def _winner(cfg, space, table, best, top, lim=None):
    """(ops, Repair, note): the best feasible candidate; if none was feasible, the most accurate candidate
    repaired to the nearest architecture (fewest changed layers) within T_const, or the fastest one."""
    t_const = float(cfg.t_const_ms)
    start = np.asarray((best or top)["ops"], np.int32)
    alpha = 10.0 * np.eye(NUM_OPS, dtype=np.float32)[start]  # -log p ~ 10 per changed layer: nearest first
    fix = budget.repair(space, table, alpha, start, t_const, pipeline.assignment(cfg, space, table, start, lim),
                        lim)
    if not fix.repaired:
        note = ("the evolution's best architecture (validation accuracy in the supernet, BN recalibrated) "
                "meets T_const")
    elif fix.feasible:
        note = ("no evolved candidate met T_const; the most accurate one was repaired to the nearest "
                "architecture within it")
    else:
        note = (f"no architecture of this space meets T_const={t_const:.4g} ms; the fastest reachable is "
                f"{fix.min_latency_ms:.4g} ms and is used")
    return tuple(int(i) for i in fix.ops), fix, note


# ----------------------------------------------------------------------------------------------- the flow

@timing.measured
def evolve(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False, progress: bool = True) -> dict:
    """Runs stage 1 (sandwich supernet), stage 2 (evolution), retrains the winner and writes result.json,
    history.json, evolution.json, the plots, parts/ and checkpoints/ into ``workdir``; returns the result dict."""
    cfg = with_defaults(ml_collections.ConfigDict(cfg.to_dict()))
    validate(cfg)
    stored = W.plain(cfg)
    W.check_workdir(workdir, resume, stored, "evolve")
    ds = pipeline.load_data(cfg)
    fd = fitness_data(cfg, ds)
    space, table = pipeline.build(cfg, ds)
    pipeline.check_run(cfg, space, ds, cfg.search.batch_size, 2 + cfg.evolve.num_random,
                       population_bytes(space, cfg.evolve.population), f", evolve.population={cfg.evolve.population}")
    lim = pipeline.check_limits(cfg, space, table)
    W.claim(workdir, resume, stored, "evolve")
    e, t_const = cfg.evolve, float(cfg.t_const_ms)
    mesh = train.data_mesh()
    fp = W.fingerprint(cfg, S.to_dict(space))
    made = (space, cfg.search.weight_lr, cfg.search.lambda1, e.num_random, cfg.dw_impl)
    _, _, eval_step = pipeline.search_steps(cfg, space, table)
    problem = Problem(
        space.mask(), lambda k: supernet.init(k, space, shared_weights=cfg.shared_weights),
        programs.persistent_jit(make_sandwich_step(*made), name="evolve.sandwich_step", identity=made,
                                donate_argnums=0),
        lambda st, epoch, m: _epoch_entry(cfg, space, table, ds, mesh, st, eval_step, epoch, m),
        within_budget(space, table, t_const, cfg.split, lim),
        lambda st, ops: fitness(space, table, st.params, st.bn, ops, fd, t_const, cfg.split, e.chunk, e.evaluator,
                                lim))
    with tb.run(workdir, tb.enabled(cfg)):
        st, history, log, best, top = search(cfg, problem, ds, mesh, workdir, fp, resume, progress)
        ops, fix, note = _winner(cfg, space, table, best, top, lim)
        split = pipeline.assignment(cfg, space, table, ops, lim)
        rt, history = pipeline.retrain(cfg, space, ds, mesh, st, ops, workdir, fp, resume, progress, history)
        summary = {"population": e.population, "generations": e.generations,
                   "evaluated": e.population * e.generations, "fitness_examples": len(fd.y),
                   "bn_recalibration_examples": 0 if fd.bn is None else int(fd.bn.shape[0] * fd.bn.shape[1]),
                   "supernet_val_acc": best["accuracy"] if best and list(ops) == best["ops"] else None}
        directory.write_json(workdir, directory.EVOLUTION, {"generations": log, "best": best, "most_accurate": top,
                                                            "winner": list(ops), "summary": summary})
        return pipeline.finish(cfg, space, table, ds, mesh, rt, ops, split, fix, None, history, workdir, note=note,
                               extra={"flow": "evolve", "evolution": summary})

