"""The evolution loop of every flow that evolves architectures (``jmsnas evolve``, SplitNets, the FBNet flow), and
the weight-sharing search both ``jmsnas evolve`` and SplitNets run (``search``: the supernet, ``run.supernet``, then
the evolution) over a ``Problem``, what the flow's space differs in.

A strategy of ``jmsnas.strategies`` (ask/tell) is run for a number of generations on the run layer's generation
loop (``loop.generations``: a checkpoint after each, so a killed run resumes to the same result); the flow gives
only the fitness of a population. The best feasible candidate, the most accurate one whatever its limits and a
per-generation log are kept (and checkpointed) as JSON data; each generation is logged to TensorBoard.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import data, strategies, tensorboard as tb
from jmsnas.checkpoint import Checkpointer
from jmsnas.run import loop
from jmsnas.run.supernet import train_supernet
from jmsnas.runcheck import ConfigError
from jmsnas.strategies.base import sample_valid


def record(ops, f: dict, i: int) -> dict:
    """Candidate ``i`` of a generation as JSON data: its ``ops`` and every per-candidate value of ``f`` (fitness
    None when -inf)."""
    out = {"ops": np.asarray(ops[i]).tolist()}
    for k, v in f.items():
        if k != "feasible":
            x = float(v[i])
            out[k] = x if np.isfinite(x) else None
    return out


def evolution(strategy, es, key, fitness, *, ckpt, fp, resume, total, progress):
    """Runs ``total`` generations of ``strategy`` (module docstring).

    ``es``: the strategy's initial state (its population is generation 0's); generation g asks and tells with
    the keys of ``fold_in(key, g + 1)``. ``fitness(ops int32[P, N]) -> dict`` of float arrays [P]: ``fitness``
    (-inf for a candidate that breaks a hard limit), ``feasible`` (bool), ``accuracy``, ``latency_ms`` and any
    other per-candidate value (its maximum goes into the log). Returns (per-generation log, the best feasible
    candidate (None if none was), the most accurate candidate whatever its limits), candidates as ``record``.
    """
    ask, tell = jax.jit(strategy.ask), jax.jit(strategy.tell)

    def generation(es, gen, c):
        k_ask, k_tell = jax.random.split(jax.random.fold_in(key, gen + 1))
        archs, es = ask(k_ask, es)
        f = fitness(np.asarray(archs.ops))
        es, _ = tell(k_tell, archs, jnp.asarray(f["fitness"], jnp.float32), es)
        i, j = int(np.argmax(f["fitness"])), int(np.argmax(f["accuracy"]))
        best, top = c["best"], c["most_accurate"]
        if f["feasible"][i] and (best is None or f["fitness"][i] > best["fitness"]):  # strict: first kept
            best = record(archs.ops, f, i)
        if top is None or f["accuracy"][j] > top["accuracy"]:
            top = record(archs.ops, f, j)
        ok = f["feasible"]
        row = {"generation": gen, "feasible_fraction": float(ok.mean()),
               "best_accuracy": float(f["accuracy"][ok].max()) if ok.any() else None,
               "mean_accuracy": float(f["accuracy"].mean()),
               "best_so_far_accuracy": None if best is None else best["accuracy"],
               "min_latency_ms": float(f["latency_ms"].min()),
               **{f"max_{k}": float(v.max()) for k, v in f.items() if k not in ("fitness", "feasible", "accuracy")}}
        extra = [f["sensor_peak_bytes"]] if "sensor_peak_bytes" in f else []  # SplitNets' memory
        tb.log(gen, tb.generation_scalars(f["accuracy"], f["latency_ms"], f["feasible"], f["fitness"], *extra))
        return es, {"log": c["log"] + [row], "best": best, "most_accurate": top}

    _, c = loop.generations(es, ckpt=ckpt, fp=fp, resume=resume, total=total, generation=generation,
                            carry={"log": [], "best": None, "most_accurate": None}, desc="evolution",
                            progress=progress,
                            postfix=lambda c: {"best": f"{c['log'][-1]['best_so_far_accuracy'] or 0:.3f}",
                                               "feasible": f"{c['log'][-1]['feasible_fraction']:.2f}"})
    return c["log"], c["best"], c["most_accurate"]


class Problem(NamedTuple):
    """What a weight-sharing search differs in (``jmsnas evolve``'s space, SplitNets'); ``search`` runs the rest:
    the supernet's epoch loop (``run.supernet``), the evolution from a population inside the limits, their
    checkpoints and resume, the population shared out among the processes."""

    mask: np.ndarray  # bool[N, R]: the valid choices of each of the N genes
    init: Callable  # key -> (params, bn): the supernet
    step: Callable  # the jitted sandwich step (``run.supernet.sandwich``)
    end_epoch: Callable  # (state, epoch, metrics) -> the supernet epoch's history row
    within: Callable  # ops int32[P, N] -> bool[P]: inside every hard limit (costs only, no network is run)
    fitness: Callable  # (state, ops int32[P, N]) -> the dict of ``evolution``
    tries: int = 64  # uniform draws per member of the initial population (``feasible_population``)
    fold: bool = True  # the initial population's key: fold_in(key, 0) (SplitNets: the key, as it always was)


class FitnessData(NamedTuple):
    """Fixed inputs of the fitness: x float32[n, ...], y int32[n], bn float32[K, B, ...] or None."""

    x: np.ndarray
    y: np.ndarray
    bn: np.ndarray | None


def fitness_data(cfg, ds) -> FitnessData:
    """The first ``evolve.fitness_examples`` validation examples and the first ``evolve.bn_batches`` training batches
    (of ``bn_batch_size``, shuffled with seed + 3): the same every generation, so fitness is deterministic."""
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


def make_strategy(mask, e) -> strategies.Strategy:
    """The evolution strategy over ``mask`` bool[N, R] with the settings of ``cfg.evolve`` (``e``)."""
    return strategies.make("evolution", mask=mask, population=e.population, parent_ratio=e.parent_ratio,
                           mutation_prob=e.mutation_prob, mutation_ratio=e.mutation_ratio)


def feasible_population(key, mask, within, size: int, tries: int = 64) -> np.ndarray:
    """int32[size, N]: an initial population inside the limits where it can (rejection sampling, as OFA's
    evolution finder starts). ``size * tries`` uniform valid architectures of ``mask`` bool[N, R] are drawn and
    ``within(ops) -> bool[P]`` judges them (costs only: no network is run); those inside come first, in draw order,
    and others fill what is left."""
    cand = np.asarray(sample_valid(key, jnp.asarray(mask), size * tries))
    return cand[np.argsort(~np.asarray(within(cand)), kind="stable")[:size]]


def evolve_population(cfg, problem: Problem, st, ckpt, fp: str, resume: bool, progress: bool):
    """Stage 2: ``evolution`` with ``problem.fitness`` of the supernet ``st``, from an initial population inside
    the limits (``feasible_population``); returns (log, best, most accurate)."""
    e, key = cfg.evolve, jax.random.PRNGKey(cfg.seed + 4)
    strategy = make_strategy(problem.mask, e)
    k_init, k_pop = jax.random.split(jax.random.fold_in(key, 0) if problem.fold else key)
    es = strategy.init(k_init)  # generation 0 asks for es.population: start it inside the limits
    es = es._replace(population=jnp.asarray(feasible_population(k_pop, problem.mask, problem.within, e.population,
                                                                problem.tries)))
    return evolution(strategy, es, key, lambda ops: problem.fitness(st, ops), ckpt=ckpt, fp=fp, resume=resume,
                     total=e.generations, progress=progress)


def search(cfg, problem: Problem, ds, mesh, workdir: str, fp: str, resume: bool, progress: bool):
    """Stage 1 (``run.supernet.train_supernet``) and stage 2 (``evolve_population``), checkpointed under
    ``workdir/checkpoints``; returns (state, history, per-generation log, best feasible candidate, most accurate
    candidate)."""
    ckpt = lambda stage: Checkpointer(os.path.join(workdir, "checkpoints", stage))
    st, history = train_supernet(cfg, problem, ds, mesh, ckpt("supernet"), fp, resume, progress)
    return (st, history, *evolve_population(cfg, problem, st, ckpt("evolution"), fp, resume, progress))
