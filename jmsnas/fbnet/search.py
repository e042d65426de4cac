"""Latency-constrained search in the FBNet space over a chain of devices, with per-layer latency tables.

The 22 layers are split over the chain's devices in order, ``topology.layers_per_device`` each (they must sum to
22). A network's latency (eq. (1) of the JMSNAS paper with these tables) is

    T(a) = sum_m [const_m + sum_{l on m} table_m[l, a_l]] + sum_links (bytes * 8 / bandwidth + link latency),

where const_m (the table's fixed term: stem, head, call overhead; they cannot be separated in the published
tables) is counted on the first device only, and the bytes crossing a link are those of the float32 output of the
last layer before it (fixed by the macro-architecture: every candidate of a layer has the same output shape). On
one device T(a) is exactly the table's value. Because T is additive over layers, the fastest network is the
per-layer argmin of the tables; a T_const below it is an error.

``search`` runs ``strategies.make("evolution")`` (ask/tell, on the run layer's evolution loop) with a caller's
fitness (higher is better, e.g. the accuracy of the sub-network under a trained weight-sharing supernet) and the
hard constraint T <= T_const; the initial population holds the fastest network, so a feasible one exists from the
first generation on.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import strategies
from jmsnas.cost import layertable as LT
from jmsnas.fbnet.space import FBNetSpace
from jmsnas.run.evolution import evolution
from jmsnas.topology import Topology, TopologyError


class Plan(NamedTuple):
    """entry_ms float64[N, R] (each layer's entries from its device's table); const_ms; comm_ms float64[L]
    (per link, in topology link order); device_of int[N]; names of the devices."""

    entry_ms: np.ndarray
    const_ms: float
    comm_ms: np.ndarray
    device_of: np.ndarray
    names: tuple


def plan(space: FBNetSpace, topology: Topology, tables: dict) -> Plan:
    """The latency model of ``space`` on ``topology`` with ``tables`` {device name: LayerTable}."""
    if topology.kind != "chain":
        raise TopologyError(f"the FBNet search runs on a chain of devices (one device included), got a "
                            f"{topology.kind} topology {topology.name!r}")
    names = topology.device_names
    missing = [n for n in names if n not in tables]
    if missing:
        raise LT.TableError(f"no latency table for device(s) {missing}; tables are given for {sorted(tables)}")
    order = list(topology.pre)
    counts = [topology.layers_per_device[m] for m in order]
    if sum(counts) != space.num_layers:
        raise TopologyError(f"layers_per_device {list(topology.layers_per_device)} sums to {sum(counts)}, the FBNet "
                            f"space has {space.num_layers} layers")
    for n in names:
        t = tables[n]
        if t.space != space.name or t.num_layers != space.num_layers or tuple(t.op_names) != space.op_names:
            raise LT.TableError(f"table for {n!r} ({t.source}) is of space {t.space!r} with {t.num_layers} layers, "
                                f"expected {space.name!r} with {space.num_layers} layers and ops {list(space.op_names)}")
    device_of = np.repeat(order, counts)
    entry = np.stack([tables[names[m]].entry_ms[n] for n, m in enumerate(device_of)])
    comm = np.zeros(len(topology.links))
    ends = np.cumsum(counts)
    for j, (a, b) in enumerate(zip(order, order[1:])):
        lay = space.layers[ends[j] - 1]
        link = topology.links[topology.link_index(a, b)]
        nbytes = 4.0 * lay.out_hw * lay.out_hw * lay.out_ch
        comm[topology.link_index(a, b)] = nbytes * 8.0 / (link.bandwidth_mbps * 1e3) + link.latency_ms
    return Plan(entry, tables[names[order[0]]].const_ms, comm, device_of, names)


def latency_ms(p: Plan, archs) -> np.ndarray:
    """float64[K]: T of each architecture (int[K, N] or int[N])."""
    a = np.atleast_2d(np.asarray(archs, np.int64))
    return p.const_ms + p.entry_ms[np.arange(a.shape[1])[None], a].sum(axis=1) + p.comm_ms.sum()


def breakdown(p: Plan, arch) -> dict:
    """{"total", "per_device": {name: ms}, "per_link": [ms in link order]} of one architecture."""
    a = np.asarray(arch, np.int64)
    layer = p.entry_ms[np.arange(len(a)), a]
    per = {n: float(layer[p.device_of == m].sum()) for m, n in enumerate(p.names)}
    first = p.names[int(p.device_of[0])]
    per[first] += p.const_ms
    return {"total": float(latency_ms(p, a)[0]), "per_device": per, "per_link": p.comm_ms.tolist()}


def fastest(p: Plan) -> np.ndarray:
    """int64[N]: the architecture of least latency (per-layer argmin; T is additive over layers)."""
    return np.nanargmin(p.entry_ms, axis=1)


def check_budget(p: Plan, t_const_ms: float) -> None:
    """ValueError (one line) when no network of the space meets ``t_const_ms``."""
    t_min = float(latency_ms(p, fastest(p))[0])
    if not t_const_ms >= t_min:
        raise ValueError(f"T_const = {t_const_ms!r} ms is below the fastest network's latency {t_min:.4f} ms on "
                         f"these tables; expected T_const >= {t_min:.4f}")


class Result(NamedTuple):
    arch: np.ndarray  # int64[N]
    latency_ms: float
    fitness: float
    history: list  # per generation: best fitness so far, feasible fraction


def search(key, p: Plan, t_const_ms: float, fitness_fn: Callable[[np.ndarray], np.ndarray], *,
           population: int = 64, generations: int = 10, ckpt=None, fp: str = "", resume: bool = False,
           progress: bool = False) -> Result:
    """The fittest architecture found with T <= ``t_const_ms`` (evolution on the run layer's loop,
    ``jmsnas.run.evolution``: checkpoints in ``ckpt``, None: none; module docstring).

    ``fitness_fn(archs int64[P, N]) -> float[P]`` (higher is better)."""
    check_budget(p, t_const_ms)
    strat = strategies.make("evolution", mask=np.isfinite(p.entry_ms), population=population)
    k_init, key = jax.random.split(key)
    state = strat.init(k_init)
    state = state._replace(population=state.population.at[0].set(jnp.asarray(fastest(p), jnp.int32)))

    def fitness(archs):
        a = np.asarray(archs, np.int64)
        t, score = latency_ms(p, a), np.asarray(fitness_fn(a), np.float64)
        return {"fitness": np.where(t <= t_const_ms, score, -np.inf), "feasible": t <= t_const_ms,
                "accuracy": score, "latency_ms": t}

    log, best, _ = evolution(strat, state, key, fitness, ckpt=ckpt, fp=fp, resume=resume, total=generations,
                             progress=progress)  # the fastest network is in generation 0: best is feasible
    arch = np.asarray(best["ops"], np.int64)
    history = [{"best_fitness": r["best_so_far_accuracy"], "feasible_fraction": r["feasible_fraction"]} for r in log]
    return Result(arch, float(latency_ms(p, arch)[0]), float(best["fitness"]), history)
