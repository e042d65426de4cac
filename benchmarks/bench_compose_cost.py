"""The composed cost model (jmsnas.compose) at the main job's size: building its terms, E[T] + E[memory] +
E[energy] with the searched split and their gradient against today's E[T] + E[memory] (jitted, per call), and the
exact repair (without limits, and with a binding memory limit on the UE).

    python benchmarks/bench_compose_cost.py

The main job's space (chain preset, Table I links, 2 layers per device, the digits' 8x8 images) with modules
(2, 4, 8), weight bits (4, 6, 8, 32) and transmitted bits (4, 6, 8, 32), random logits (seed 0)."""
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import budget, configs, limits as L, pipeline
from jmsnas.compose import choices as C, cost as K, repair as R, terms as TT
from jmsnas.cost import latency as CL, memory as CM
from jmsnas.gates import probabilities


def main():
    print("load average", os.getloadavg())
    cfg = configs.default_config()
    space, table = pipeline.build(cfg, types.SimpleNamespace(image_size=8, channels=1, num_classes=10))
    mem = CM.space_memory(space)
    ch = C.make_choices(space.topology, [2, 4, 8], [4, 6, 8, 32], [4, 6, 8, 32])
    t0 = time.perf_counter()
    terms = TT.build_terms(space, table, ch)
    print(f"build_terms: {time.perf_counter() - t0:.2f} s")
    rng = np.random.default_rng(0)
    logits = C.ChoiceProbs(*(jnp.asarray(rng.normal(size=s), jnp.float32) for s in C.logits_shapes(space, ch)))
    mask = jnp.asarray(space.mask())

    def composed(lg):
        p = C.probs_from_logits(space, ch, lg)
        a = K.best_assignment(space, table, terms, p)
        return (K.latency(space, table, terms, p, a).total + K.energy(space, table, terms, p, a).total
                + jnp.sum(K.memory(space, mem, table, terms, p, a).total) * 1e-9)

    def today(alpha):
        p = probabilities(alpha, mask)
        a = CL.best_assignment(space, table, p)
        return CL.latency(space, table, p, a).total + jnp.sum(CM.device_memory(space, mem, table, p, a).total) * 1e-9

    for name, f, x in (("composed", jax.jit(jax.grad(composed)), logits), ("today", jax.jit(jax.grad(today)),
                                                                          logits.ops)):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(200):
            jax.block_until_ready(f(x))
        print(f"{name} cost + gradient: compile and first call {first:.2f} s, then "
              f"{(time.perf_counter() - t0) / 200 * 1e3:.3f} ms per call")
    derived = np.asarray(jnp.argmax(probabilities(logits.ops, mask), -1))
    print(f"JMSNAS alone (D^m): least T {budget.repair(space, table, logits.ops, derived, 2.8).min_latency_ms:.4f} ms")
    a = jnp.asarray(space.layer_devices())
    fix = None
    for t_const in (2.4, 0.5):
        t0 = time.perf_counter()
        fix = R.repair(space, table, terms, ch, logits, t_const)
        print(f"composed repair, T_const {t_const} ms: {time.perf_counter() - t0:.2f} s; feasible {fix.feasible}, "
              f"T {fix.latency_ms:.4f} ms, least T {fix.min_latency_ms:.4f} ms, log-prob lost {fix.logprob_loss:.3f}, "
              f"modules {fix.config.module.tolist()}, transmitted bits {fix.config.act_bits.tolist()}")
    ue = float(np.asarray(K.memory(space, mem, table, terms, C.onehot(space, ch, fix.config), a).total)[0])
    lim = np.full(space.topology.num_devices, np.inf)
    lim[0] = 0.8 * ue
    t0 = time.perf_counter()
    fix2 = R.repair(space, table, terms, ch, logits, 0.5, limits=L.DeviceLimits(lim, np.full_like(lim, np.inf), mem))
    ue2 = float(np.asarray(K.memory(space, mem, table, terms, C.onehot(space, ch, fix2.config), a).total)[0])
    print(f"... with the UE's memory at 0.8 x {ue:.0f} = {lim[0]:.0f} bytes: {time.perf_counter() - t0:.2f} s; "
          f"feasible {fix2.feasible}, T {fix2.latency_ms:.4f} ms, UE {ue2:.0f} bytes, log-prob lost "
          f"{fix2.logprob_loss:.3f}")


if __name__ == "__main__":
    main()
