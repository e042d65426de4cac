"""``jmsnas evolve``: the two-stage weight-sharing flow (SplitNets, paper 000, section 3.2; OFA/BigNAS training) on
the main job's search space: that space's ``run.evolution.Problem``, which ``run.evolution.search`` runs.

Stage 1 trains the supernet alone with the sandwich rule (``run.supernet.sandwich``): every step adds the gradients
of the largest sub-network (the widest valid candidate of each layer: kernel 7, expansion 6, with shortcut where
allowed), of the smallest (identity where allowed, else kernel 3 / expansion 3) and of ``num_random`` uniformly
sampled ones. Weights are shared (``supernet.init``), so every sampled path trains weights the others use; the
largest and smallest bound the range the search will query.

Stage 2 is evolution (``strategies.make("evolution")``) with the supernet as a fixed accuracy predictor, from an
initial population inside the budget where possible. Fitness of a population is its accuracy on a fixed validation
subset from ``evaluate.evaluate_population`` (BN statistics recalibrated per sub-network on a few training
batches); the hard constraint T <= T_const discards a candidate (fitness -inf) and the soft ranking is by that
accuracy, ties broken by lower latency (a term below half an example, so it never outweighs one correctly
classified image). The winner is then retrained as in ``jmsnas search`` (its weights inherited from the supernet)
and the run writes the same outputs: result.json (plus ``"flow": "evolve"`` and an ``evolution`` summary),
history.json, the report plots, parts/, and evolution.json (per-generation statistics). Both stages checkpoint
(``checkpoints/supernet``, ``checkpoints/evolution``) and a run resumes from where it stopped, to the same result.

Settings live in ``cfg.evolve`` (``DEFAULTS`` fills what is missing); the supernet's batch size, learning rate and
L2 weight are ``cfg.search.batch_size``, ``weight_lr`` and ``lambda1``, the retrain is ``cfg.retrain``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jmsnas import budget, limits, pipeline, programs, runcheck, supernet, timing, train
from jmsnas import space as S
from jmsnas import tensorboard as tb
from jmsnas.run import directory, processes
from jmsnas.run import evolution as RE, supernet as RS
from jmsnas.run import workdir as W
from jmsnas.cost.latency import arch_latency, latency, searched_latency
from jmsnas.evaluate import evaluate_loop, evaluate_population
from jmsnas.gates import onehot_gates
from jmsnas.pipeline import ConfigError
from jmsnas.space import IDENTITY, NUM_OPS, OPS, SearchSpace

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
    on = [k for k in ("modules", "weight_bits", "activation_bits") if tuple((cfg.get("compose") or {}).get(k) or ())
          not in ((), (32,) if k != "modules" else ())]
    if on:  # evolve searches the ops and the split only: a switch it would ignore is refused
        raise ConfigError(f"compose.{on[0]}={list(cfg.compose[on[0]])}: the composed search runs in jmsnas search; "
                          "jmsnas evolve searches the ops and the split (leave compose.* empty)")
    runcheck.check_bounds(cfg, BOUNDS)
    e = cfg.evolve
    if e.evaluator not in EVALUATORS:
        raise ConfigError(f"evolve.evaluator must be one of {list(EVALUATORS)}, got {e.evaluator!r}")
    try:  # the strategy's own checks of its hyperparameters, on a one-layer mask
        RE.make_strategy(np.ones((1, 1), bool), e)
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


def sandwich_step(space: SearchSpace, lr: float, lambda1: float, num_random: int, dw_impl: str = "auto"):
    """``run.supernet.sandwich`` over ``space``: x float32[B, H, W, C], y int32[B]; the sub-networks are
    ``run.supernet.sandwich_archs`` (largest and smallest: ``sandwich_ops``)."""
    largest, smallest = sandwich_ops(space)
    mask = space.mask()
    return RS.sandwich(lr, lambda1, lambda k: RS.sandwich_archs(k, mask, largest, smallest, num_random),
                       lambda p, bn, ops, x: supernet.apply(space, p, bn, onehot_gates(ops, NUM_OPS), x, train=True,
                                                            dw_impl=dw_impl))


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


def fitness(space, table, params, bn, ops, fd: RE.FitnessData, t_const_ms: float, split: str, chunk: int,
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


def population_bytes(space: SearchSpace, size: int, tries: int = 64) -> int:
    """Bytes ``run.evolution.feasible_population`` holds at once: ``size * tries`` architectures of int32[N] with a
    float32 per candidate of every layer for their latencies, and a float64 latency each."""
    return int(size) * tries * (space.num_layers * 4 * (1 + len(OPS)) + 8)


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
    fd = RE.fitness_data(cfg, ds)
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
    problem = RE.Problem(
        space.mask(), lambda k: supernet.init(k, space, shared_weights=cfg.shared_weights),
        programs.persistent_jit(jax.jit(sandwich_step(*made), donate_argnums=0), name="evolve.sandwich_step",
                                identity=made, donate_argnums=0),
        lambda st, epoch, m: _epoch_entry(cfg, space, table, ds, mesh, st, eval_step, epoch, m),
        within_budget(space, table, t_const, cfg.split, lim),
        lambda st, ops: fitness(space, table, st.params, st.bn, ops, fd, t_const, cfg.split, e.chunk, e.evaluator,
                                lim))
    with tb.run(workdir, tb.enabled(cfg)):
        st, history, log, best, top = RE.search(cfg, problem, ds, mesh, workdir, fp, resume, progress)
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

