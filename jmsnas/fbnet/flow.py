"""``jmsnas search`` / ``jmsnas evolve`` with a config holding ``fbnet``: a latency-constrained search in the FBNet
space over a chain of devices (one device included), each with a per-layer latency table.

1. Supernet (``fitness = "supernet"``): the weight-sharing FBNet supernet (``jmsnas.fbnet.net``, every candidate
   of every layer) is trained with single-path uniform sampling (SPOS, Guo et al. 2020): every step one random
   architecture, its cross-entropy, one Adam update of the weights it used.
2. Evolution (``jmsnas.fbnet.search``) under T <= T_const with the tables of ``fbnet.tables``; fitness is the
   sub-network's accuracy on ``fitness_examples`` validation images with the supernet's weights (batch-norm
   statistics of that batch, as single-path supernets are usually evaluated). ``fitness = "flops"`` ranks by the
   network's FLOPs instead (no training: the larger network that fits the budget), for quick runs and tests.

In both commands the FBNet space runs this flow. ``fbnet.width`` scales the channels of the trained network
(the tables stay those of the published space: they give the published network's latency). The run writes
``result.json`` (architecture per device, latency per device and link from the tables, T_const, met, fitness,
per-generation history, the tables' sources) into the workdir.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmsnas import safeio, tensorboard as tb
from jmsnas.run import workdir as W
from jmsnas.fbnet import help as H, net, search as S, space as SP

DEFAULTS = dict(width=0.25, tables=None, fitness="supernet", supernet_epochs=2, batch_size=64, lr=3e-3,
                population=32, generations=8, fitness_examples=256, seed=0)
FITNESS = ("supernet", "flops")


def settings(cfg) -> dict:
    """``cfg.fbnet`` with DEFAULTS filled in, checked; ValueError names a bad value."""
    given = cfg.fbnet.to_dict() if hasattr(cfg.fbnet, "to_dict") else dict(cfg.fbnet)
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown fbnet settings {unknown}; expected some of {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **given}
    if s["fitness"] not in FITNESS:
        raise ValueError(f"fbnet.fitness must be one of {list(FITNESS)}, got {s['fitness']!r}")
    if not isinstance(s["tables"], dict) or not s["tables"]:
        raise ValueError("fbnet.tables must map every device to a table file or HELP's file:DEVICE, got "
                         f"{safeio.short(s['tables'])}")
    for k in ("supernet_epochs", "batch_size", "population", "generations", "fitness_examples", "seed"):
        v, low = s[k], 0 if k in ("supernet_epochs", "seed") else (2 if k == "population" else 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"fbnet.{k} must be an integer >= {low}, got {v!r}")
    for k in ("width", "lr"):
        if isinstance(s[k], bool) or not isinstance(s[k], (int, float)) or not s[k] > 0:
            raise ValueError(f"fbnet.{k} must be a number > 0, got {s[k]!r}")
    t = cfg.t_const_ms
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise ValueError(f"t_const_ms must be a latency > 0 ms, got {t!r}")
    return s


def topology_of(cfg):
    """The config's topology: a file path, or a device preset name for a single device."""
    from jmsnas import topology as T
    name = cfg.topology
    if isinstance(name, str) and name in T.presets.DEVICES:
        return T.make_topology(name, [T.presets.device(name)], [], [22])
    if isinstance(name, str) and T.is_file_name(name):
        return T.load(name)
    raise ValueError(f"topology {safeio.short(name)} is neither a topology file nor a device preset "
                     f"({sorted(T.presets.DEVICES)})")


def _train_supernet(space, s, ds, progress: bool):
    key = jax.random.PRNGKey(s["seed"])
    params, state = net.numpy_init(jax.eval_shape(lambda: net.supernet_init(key, space)), s["seed"])
    opt = optax.adam(s["lr"])
    opt_state = opt.init(params)

    def loss(p, st, arch, x, y):
        logits, new = net.supernet_apply(space, p, st, arch, x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

    @jax.jit
    def step(p, st, o, arch, x, y):
        (l, new), g = jax.value_and_grad(loss, has_aux=True)(p, st, arch, x, y)
        upd, o = opt.update(g, o, p)
        return optax.apply_updates(p, upd), new, o, l

    from jmsnas import data
    rng = np.random.default_rng(s["seed"])
    for epoch in range(s["supernet_epochs"]):
        for x, y in data.epoch_batches(ds.train, s["batch_size"], seed=s["seed"], epoch=epoch):
            arch = jnp.asarray(rng.integers(0, len(space.op_names), space.num_layers), jnp.int32)
            params, state, opt_state, l = step(params, state, opt_state, arch, x, y)
        if progress:
            print(f"supernet epoch {epoch + 1}/{s['supernet_epochs']}: loss {float(l):.3f}", flush=True)
    return params, state


def run(cfg, workdir: str, *, resume: bool = False, progress: bool = True) -> int:
    """The flow (module docstring); prints a summary and returns 0."""
    s = settings(cfg)
    logs = tb.enabled(cfg)  # TensorBoard logs (a bool, checked before the workdir)
    if resume:
        raise ValueError("the FBNet flow does not resume; start it in an empty --workdir")
    topo = topology_of(cfg)
    tables = {d: H.table_from_spec(str(spec))[0] for d, spec in s["tables"].items()}
    published = SP.fbnet_c100()
    plan = S.plan(published, topo, tables)
    S.check_budget(plan, float(cfg.t_const_ms))
    W.check_workdir(workdir, False, {}, "search", resumable=False)  # writable, not busy, holds no run
    os.makedirs(workdir, exist_ok=True)
    W.lock_workdir(workdir, "search")  # one writer: a second command on this workdir is refused
    if s["fitness"] == "supernet":
        from jmsnas import data
        ds = data.load(cfg.get("dataset", "digits"), data_dir=cfg.get("data_dir"), seed=s["seed"])
        space = SP.scaled(published, width=s["width"], image_size=ds.image_size, in_channels=ds.channels,
                          num_classes=ds.num_classes)
        params, state = _train_supernet(space, s, ds, progress)
        xv, yv = ds.val.images[: s["fitness_examples"]], ds.val.labels[: s["fitness_examples"]]
        acc = jax.jit(lambda a: jnp.mean(jnp.argmax(net.supernet_apply(space, params, state, a, xv, True)[0], -1)
                                         == yv))
        fitness = lambda archs: np.array([float(acc(jnp.asarray(a, jnp.int32))) for a in archs])
    else:
        flops = np.array([[SP.block_flops(b, l) for b in published.blocks] for l in published.layers])
        fitness = lambda archs: flops[np.arange(published.num_layers)[None], archs].sum(axis=1) / 1e6
    res = S.search(jax.random.PRNGKey(s["seed"]), plan, float(cfg.t_const_ms), fitness, population=s["population"],
                   generations=s["generations"])
    br = S.breakdown(plan, res.arch)
    names = topo.device_names
    result = {"flow": "fbnet", "space": published.name, "topology": topo.name,
              "architecture": [{"layer": n, "device": names[int(plan.device_of[n])], "op": published.op_names[int(i)]}
                               for n, i in enumerate(res.arch)],
              "latency_ms": br["total"], "per_device_ms": br["per_device"],
              "per_link_ms": dict(zip(topo.link_names, br["per_link"])), "t_const_ms": float(cfg.t_const_ms),
              "met": br["total"] <= float(cfg.t_const_ms), "fitness": {"kind": s["fitness"], "value": res.fitness},
              "history": res.history, "tables": {d: t.source for d, t in tables.items()}, "settings": s}
    with safeio.atomic_write(os.path.join(workdir, "result.json")) as f:
        json.dump(result, f, indent=1)
    with tb.run(workdir, logs):  # WORKDIR/tensorboard: the fitness of every generation, the final breakdown
        for g, h in enumerate(res.history):
            tb.log(g, {"evolution/fitness_best": h["best_fitness"], "evolution/feasible_fraction": h["feasible_fraction"]})
        tb.log(len(res.history), {"result/fitness": res.fitness, **tb.breakdown_scalars(
            "result/latency", {"total": br["total"], "per_device": br["per_device"], "per_link": result["per_link_ms"]})})
    print("FBNet space, architecture per layer: " + " ".join(a["op"] for a in result["architecture"]))
    for d, ms in br["per_device"].items():
        print(f"  {d:12s} {ms:9.3f} ms  compute")
    for l, ms in result["per_link_ms"].items():
        print(f"  {l:12s} {ms:9.3f} ms  communication")
    print(f"  total        {br['total']:9.3f} ms  ({'within' if result['met'] else 'over'} T_const = "
          f"{float(cfg.t_const_ms):.3f} ms); fitness ({s['fitness']}) {res.fitness:.4g}")
    print(f"wrote {os.path.join(workdir, 'result.json')}")
    return 0
