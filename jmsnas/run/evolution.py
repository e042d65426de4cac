"""The evolution loop of every flow that evolves architectures (``jmsnas evolve``, SplitNets, the FBNet flow).

A strategy of ``jmsnas.strategies`` (ask/tell) is run for a number of generations on the run layer's generation
loop (``loop.generations``: a checkpoint after each, so a killed run resumes to the same result); the flow gives
only the fitness of a population. The best feasible candidate, the most accurate one whatever its limits and a
per-generation log are kept (and checkpointed) as JSON data; each generation is logged to TensorBoard.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import tensorboard as tb
from jmsnas.run import loop


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
