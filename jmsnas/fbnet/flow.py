"""``jmsnas search`` / ``jmsnas evolve`` with a config holding ``fbnet``: a latency-constrained search in the FBNet
space over a chain of devices (one device included), each with a per-layer latency table.

1. Supernet (``fitness = "supernet"``): the weight-sharing FBNet supernet (``jmsnas.fbnet.net``, every candidate
   of every layer) is trained with single-path uniform sampling (SPOS, Guo et al. 2020): every step one random
   architecture (drawn from the step's key), its cross-entropy, one Adam update of the weights it used.
2. Evolution (``jmsnas.fbnet.search``) under T <= T_const with the tables of ``fbnet.tables``; fitness is the
   sub-network's accuracy on ``fitness_examples`` validation images with the supernet's weights (batch-norm
   statistics of that batch, as single-path supernets are usually evaluated). ``fitness = "flops"`` ranks by the
   network's FLOPs instead (no training: the larger network that fits the budget), for quick runs and tests.

In both commands the FBNet space runs this flow, on the run layer like every flow (``jmsnas.run``): the workdir is
checked and claimed (``config.json``, one writer), the supernet trains on the epoch loop (``checkpoints/supernet``)
and the evolution runs on the generation loop (``checkpoints/evolution``), so ``--resume`` continues a killed run
to the same result; result.json and evolution.json are written atomically by process 0. ``fbnet.width`` scales the
channels of the trained network (the tables stay those of the published space: they give the published network's
latency). result.json holds the common top level (flow, topology, dataset, seed, time; docs/run_directory.md), the
architecture per device, latency per device and link from the tables, T_const, met, fitness, the per-generation
history and the tables' sources.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jmsnas import data, runcheck, safeio, tensorboard as tb, timing, train
from jmsnas.checkpoint import Checkpointer
from jmsnas.fbnet import help as H, net, search as S, space as SP
from jmsnas.run import directory, loop
from jmsnas.run import workdir as W
from jmsnas.runcheck import ConfigError

DEFAULTS = dict(width=0.25, tables=None, fitness="supernet", supernet_epochs=2, batch_size=64, lr=3e-3,
                population=32, generations=8, fitness_examples=256, seed=0)
FITNESS = ("supernet", "flops")
MIN_WIDTH = 1 / 16
BOUNDS = {**{f"fbnet.{k}": dict(low=low, integer=True) for k, low in dict(
    supernet_epochs=0, batch_size=1, population=2, generations=1, fitness_examples=1, seed=0).items()},
          # a width below 1/16 makes every layer 2 channels wide (fbnet.space.scaled's floor): a search at chance
          "fbnet.width": dict(low=MIN_WIDTH, high=4), "fbnet.lr": dict(low=0, low_open=True),
          "t_const_ms": dict(low=0, low_open=True)}  # runcheck.number's keyword arguments


def settings(cfg) -> ml_collections.ConfigDict:
    """A copy of ``cfg`` with ``cfg.fbnet`` holding every setting of DEFAULTS and the run layer's checkpoint
    cadence (``loop.DEFAULTS``), checked; ConfigError names a bad value."""
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    with cfg.unlocked():
        cfg.fbnet = ml_collections.ConfigDict(runcheck.with_defaults(cfg.fbnet, DEFAULTS, "fbnet"), type_safe=False)
        for key, value in loop.DEFAULTS.items():
            cfg[key] = cfg.get(key, value)
    s = cfg.fbnet
    if s.fitness not in FITNESS:
        raise ConfigError(f"fbnet.fitness must be one of {list(FITNESS)}, got {s.fitness!r}")
    if not isinstance(s.tables, ml_collections.ConfigDict) or not s.tables:
        raise ConfigError("fbnet.tables must map every device to a table file or HELP's file:DEVICE, got "
                          f"{safeio.short(s.tables)}")
    runcheck.check_bounds(cfg, BOUNDS)
    if s.fitness == "supernet" and s.supernet_epochs < 1:
        raise ConfigError("fbnet.supernet_epochs=0 leaves the supernet untrained, and fitness 'supernet' ranks "
                          "networks by its accuracy (chance level); train it (fbnet.supernet_epochs >= 1) or use "
                          "fbnet.fitness=flops")
    tb.enabled(cfg)  # a bool
    return cfg


def topology_of(cfg):
    """The config's topology: a file path, or a device preset name for a single device."""
    from jmsnas import topology as T
    name = cfg.topology
    if isinstance(name, str) and name in T.presets.DEVICES:
        return T.make_topology(name, [T.presets.device(name)], [], [22])
    if isinstance(name, str) and T.is_file_name(name):
        return T.load(name)
    raise ConfigError(f"topology {safeio.short(name)} is neither a topology file nor a device preset "
                      f"({sorted(T.presets.DEVICES)})")


def train_supernet(cfg, space, ds, *, ckpt, fp: str, resume: bool, progress: bool):
    """The single-path supernet on the run layer's epoch loop; returns its (params, batch-norm state)."""
    s = cfg.fbnet
    key = jax.random.PRNGKey(s.seed)
    params, bn = net.numpy_init(jax.eval_shape(lambda: net.supernet_init(key, space)), s.seed)
    tx = optax.adam(s.lr)

    def loss(p, bn, arch, x, y):
        logits, new = net.supernet_apply(space, p, bn, arch, x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

    @jax.jit
    def step(st: train.SupernetState, x, y):
        arch = jax.random.randint(jax.random.fold_in(st.key, st.step), (space.num_layers,), 0, len(space.op_names))
        (l, bn), g = jax.value_and_grad(loss, has_aux=True)(st.params, st.bn, arch, x, y)
        upd, opt = tx.update(g, st.opt, st.params)
        return train.SupernetState(optax.apply_updates(st.params, upd), bn, opt, st.key, st.step + 1), {"loss": l}

    st, _ = loop.epochs(
        train.SupernetState(params, bn, tx.init(params), key, jnp.zeros((), jnp.int32)), cfg=cfg, ckpt=ckpt, fp=fp,
        resume=resume, total=s.supernet_epochs, split=ds.train, batch_size=s.batch_size, seed=s.seed,
        step=lambda st, epoch, i, batch: step(st, *batch), desc="supernet", progress=progress,
        end_epoch=lambda st, epoch, m: {"epoch": epoch, "stage": "supernet", "train_loss": float(m["loss"])})
    return st.params, st.bn


@timing.measured
def run(cfg, workdir: str, *, resume: bool = False, progress: bool = True, command: str = "search") -> dict:
    """The flow (module docstring); every check before the workdir is claimed. Returns the result dict."""
    cfg = settings(cfg)
    s, topo = cfg.fbnet, topology_of(cfg)
    tables = {d: H.table_from_spec(str(spec))[0] for d, spec in s.tables.items()}
    published = SP.fbnet_c100()
    plan = S.plan(published, topo, tables)
    S.check_budget(plan, float(cfg.t_const_ms))
    stored = W.plain(cfg)
    W.check_workdir(workdir, resume, stored, command)
    dataset = cfg.get("dataset", "digits") if s.fitness == "supernet" else None
    ds = data.load(dataset, data_dir=cfg.get("data_dir"), seed=s.seed) if dataset else None
    W.claim(workdir, resume, stored, command)
    fp = W.fingerprint(cfg)
    ckpt = lambda stage: Checkpointer(os.path.join(workdir, "checkpoints", stage))
    with tb.run(workdir, tb.enabled(cfg)):
        if ds is not None:
            space = SP.scaled(published, width=s.width, image_size=ds.image_size, in_channels=ds.channels,
                              num_classes=ds.num_classes)
            params, bn = train_supernet(cfg, space, ds, ckpt=ckpt("supernet"), fp=fp, resume=resume,
                                        progress=progress)
            xv, yv = ds.val.images[: s.fitness_examples], ds.val.labels[: s.fitness_examples]
            acc = jax.jit(lambda a: jnp.mean(jnp.argmax(net.supernet_apply(space, params, bn, a, xv, True)[0], -1)
                                             == yv))
            fitness = lambda archs: np.array([float(acc(jnp.asarray(a, jnp.int32))) for a in archs])
        else:
            flops = np.array([[SP.block_flops(b, l) for b in published.blocks] for l in published.layers])
            fitness = lambda archs: flops[np.arange(published.num_layers)[None], archs].sum(axis=1) / 1e6
        res = S.search(jax.random.PRNGKey(s.seed), plan, float(cfg.t_const_ms), fitness, population=s.population,
                       generations=s.generations, ckpt=ckpt("evolution"), fp=fp, resume=resume, progress=progress)
        br = S.breakdown(plan, res.arch)
        names = topo.device_names
        result = {"flow": "fbnet", "topology": topo.name, "dataset": dataset, "seed": s.seed, "space": published.name,
                  "architecture": [{"layer": n, "device": names[int(plan.device_of[n])],
                                    "op": published.op_names[int(i)]} for n, i in enumerate(res.arch)],
                  "latency_ms": br["total"], "per_device_ms": br["per_device"],
                  "per_link_ms": dict(zip(topo.link_names, br["per_link"])), "t_const_ms": float(cfg.t_const_ms),
                  "met": br["total"] <= float(cfg.t_const_ms), "fitness": {"kind": s.fitness, "value": res.fitness},
                  "history": res.history, "tables": {d: t.source for d, t in tables.items()},
                  "settings": s.to_dict(), "time": timing.summary()}
        directory.write_json(workdir, directory.RESULT, result)
        breakdown = {"total": br["total"], "per_device": br["per_device"], "per_link": result["per_link_ms"]}
        tb.log(len(res.history), {"result/fitness": res.fitness, **tb.breakdown_scalars("result/latency", breakdown)})
    return result


def summary(result: dict) -> str:
    """The lines ``jmsnas search|evolve`` prints for an FBNet run."""
    lines = ["FBNet space, architecture per layer: " + " ".join(a["op"] for a in result["architecture"])]
    lines += [f"  {d:12s} {ms:9.3f} ms  compute" for d, ms in result["per_device_ms"].items()]
    lines += [f"  {link:12s} {ms:9.3f} ms  communication" for link, ms in result["per_link_ms"].items()]
    lines.append(f"  total        {result['latency_ms']:9.3f} ms  ({'within' if result['met'] else 'over'} T_const = "
                 f"{result['t_const_ms']:.3f} ms); fitness ({result['fitness']['kind']}) "
                 f"{result['fitness']['value']:.4g}")
    return "\n".join(lines)
