"""SplitNets' search (paper 000, section 3.2) as ``jmsnas evolve`` runs it for a config with a ``splitnets`` block.

What differs from ``jmsnas evolve``'s space is a problem description (``problem``: the split-aware supernet, its
sandwich step, its epoch row and a fitness under two HARD limits, end-to-end latency and sensor peak memory) that
``run.evolution.search`` trains and evolves (``strategies.make("evolution")``, 512 x 20 by default). Before anything
is trained the limits are checked against the smallest values the space can reach (``reachable``): a limit no
network meets is an error naming that value. The winner is retrained (weights inherited) and written as
result.json (with the split position, d, the bytes on the bus and the sensor peak memory), history.json,
evolution.json, the report plots and parts/ (sensor, aggregator).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jmsnas import data, evolve as EV, tensorboard as tb, timing, train
from jmsnas.checkpoint import Checkpointer
from jmsnas.objectives import cross_entropy, l2_norm_sq
from jmsnas.run import directory, loop, processes
from jmsnas.run import evolution as RE, supernet as RS
from jmsnas.run import workdir as W
from jmsnas import runcheck
from jmsnas.runcheck import ConfigError
from jmsnas.splitnets import hardware as H
from jmsnas.splitnets import net as N
from jmsnas.splitnets import views as VW
from jmsnas.splitnets.module import INITS
from jmsnas.splitnets.space import SplitArch, SplitSpace

DEFAULTS = dict(views=1, view_size=12, stem_channels=8, phase_channels=(16, 24, 32), phase_strides=(2, 2, 2),
                max_depth=3, kernels=(3, 5), expands=(3, 6), reductions=(2, 4, 8), split_kernel=1,
                head_channels=64, init="geometric", extra_modules=0.5, topology=None, bus_mbps=1200.0,
                sensor_memory_bytes=2e6)
BOUNDS = {"splitnets.views": dict(low=1, integer=True), "splitnets.extra_modules": dict(low=0, high=1),
          "t_const_ms": dict(low=0, low_open=True), "search.batch_size": dict(low=1, integer=True),
          "retrain.epochs": dict(low=0, integer=True), "checkpoint_every": dict(low=1, integer=True),
          "checkpoint_min_interval_s": dict(low=0),
          "evolve.bn_batches": dict(low=1, integer=True)}  # runcheck.number's keyword arguments


# ----------------------------------------------------------------------------------------------- configuration

def with_defaults(cfg) -> ml_collections.ConfigDict:
    """A copy of ``cfg`` whose ``splitnets`` block holds every setting of ``DEFAULTS`` (and ``evolve`` filled)."""
    cfg = EV.with_defaults(ml_collections.ConfigDict(cfg.to_dict()))
    with cfg.unlocked():
        cfg.splitnets = ml_collections.ConfigDict(runcheck.with_defaults(cfg.splitnets, DEFAULTS, "splitnets"),
                                                  type_safe=False)
        for key, value in loop.DEFAULTS.items():  # the run layer's checkpoint cadence
            cfg[key] = cfg.get(key, value)
    return cfg


def hardware(cfg) -> H.HMD:
    """The HMD of the config: a topology file with one shared bus (``splitnets.topology``), else SplitNets' HMD
    numbers with one sensor per view. The topology's sensors must match the view count."""
    s = cfg.splitnets
    if s.topology:
        from jmsnas import topology as T
        hw = H.from_topology(T.load(s.topology))
        if hw.num_sensors != s.views:
            raise ConfigError(f"splitnets.views={s.views} does not match topology {s.topology!r}, whose bus has "
                              f"{hw.num_sensors} sensors (one view per sensor)")
        return hw
    return H.hmd(s.views, bus_mbps=s.bus_mbps, sensor_memory_bytes=s.sensor_memory_bytes)


def build_space(cfg, image_size: int, channels: int, classes: int) -> SplitSpace:
    s = cfg.splitnets
    return SplitSpace(image_size=s.view_size, in_channels=channels, num_classes=classes, views=s.views,
                      stem_channels=s.stem_channels, phase_channels=tuple(s.phase_channels),
                      phase_strides=tuple(s.phase_strides), max_depth=s.max_depth, kernels=tuple(s.kernels),
                      expands=tuple(s.expands), reductions=tuple(s.reductions), split_kernel=s.split_kernel,
                      head_channels=s.head_channels)


def validate(cfg) -> None:
    """Checks every setting before anything is read or written; ConfigError names the bad value."""
    tb.enabled(cfg)  # a bool
    s, v = cfg.splitnets, cfg.splitnets.views
    if s.init not in INITS:
        raise ConfigError(f"unknown splitnets.init {s.init!r}; expected one of {list(INITS)}")
    data.check_name(cfg.dataset)
    runcheck.check_bounds(cfg, {**EV.BOUNDS, **BOUNDS})
    try:
        hardware(cfg)
        build_space(cfg, s.view_size, 1, 2)
        image = cfg.get("image_size") or (8 if cfg.dataset == "digits" else None)  # tfds: checked once loaded
        if image is not None:
            VW.view_origins(image, s.view_size, v)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"splitnets: {err}") from None


# ----------------------------------------------------------------------------------------------- costs

class Reachable(NamedTuple):
    """The smallest latency (ms) and sensor peak memory (bytes) of any network of the space, the smallest latency
    among networks within the memory limit (None when none is) and that network's genes (the fallback of an
    evolution that found no network within both limits)."""

    min_latency_ms: float
    min_memory_bytes: float
    min_latency_within_memory_ms: float | None
    fastest_within_memory: np.ndarray | None


def reachable(space: SplitSpace, hw: H.HMD) -> Reachable:
    """Exact minima by enumeration of the structure (depths, split position, d) with the smallest op everywhere:
    a smaller kernel or expansion never adds MACs, parameters or activations, so it never raises either cost."""
    o = space.decode(space.extreme(False)).ops[0][0]
    ops = tuple((o,) * space.max_depth for _ in range(space.num_phases))
    best_t, best_m, best_tm, fastest = np.inf, np.inf, np.inf, None
    for depth in itertools.product(range(1, space.max_depth + 1), repeat=space.num_phases):
        for p in range(space.num_phases):
            for m in range(1, depth[p] + 1):
                for d in space.d_choices(p):
                    a = SplitArch(ops, depth, (p, m), d)
                    c = H.cost(space, a, hw)
                    best_t, best_m = min(best_t, c.total_ms), min(best_m, c.sensor_peak_bytes)
                    if c.sensor_peak_bytes <= hw.sensor_memory_bytes and c.total_ms < best_tm:
                        best_tm, fastest = c.total_ms, space.encode(a)
    return Reachable(best_t, best_m, None if fastest is None else best_tm, fastest)


def check_limits(space: SplitSpace, hw: H.HMD, t_const_ms: float) -> Reachable:
    """Raises ConfigError when no network of the space meets the memory limit, the latency limit, or both."""
    r = reachable(space, hw)
    if r.min_memory_bytes > hw.sensor_memory_bytes:
        raise ConfigError(f"sensor memory limit {hw.sensor_memory_bytes:.0f} bytes is below the smallest sensor "
                          f"peak memory of this space, {r.min_memory_bytes:.0f} bytes")
    if r.min_latency_within_memory_ms > t_const_ms:
        raise ConfigError(f"t_const_ms={t_const_ms:.6g} ms is below the smallest end-to-end latency reachable "
                          f"within the sensor memory limit, {r.min_latency_within_memory_ms:.6g} ms")
    return r


class CostCache:
    """Costs of architectures by their decoded form (many genes decode to the same network)."""

    def __init__(self, space: SplitSpace, hw: H.HMD):
        self.space, self.hw, self.memo = space, hw, {}

    def __call__(self, genes) -> H.Cost:
        a = self.space.decode(genes)
        if a not in self.memo:
            self.memo[a] = H.cost(self.space, a, self.hw)
        return self.memo[a]

    def arrays(self, pop) -> tuple:
        cs = [self(g) for g in np.asarray(pop)]
        return (np.array([c.total_ms for c in cs]), np.array([c.sensor_peak_bytes for c in cs]))


# ----------------------------------------------------------------------------------------------- the problem

def problem(cfg, space: SplitSpace, costs: CostCache, fd: RE.FitnessData) -> RE.Problem:
    """What ``run.evolution.search`` runs for SplitNets: the split-aware supernet (``net``), its sandwich step
    (largest + smallest + ``evolve.num_random`` random networks; single view: each random one also carries, with
    probability ``splitnets.extra_modules``, extra reduce/recover pairs in the other phases, Appendix D), its epoch
    row, and the two HARD limits (end-to-end latency <= T_const, sensor peak memory <= the sensor's memory) of the
    fitness: supernet accuracy on ``fd`` (BN recalibrated per network), ties broken by lower latency."""
    e, s, t_const, mem = cfg.evolve, cfg.search, float(cfg.t_const_ms), costs.hw.sensor_memory_bytes
    mask, P = space.mask(), space.num_phases
    big, small = jnp.asarray(space.extreme(True)), jnp.asarray(space.extreme(False))
    extra = float(cfg.splitnets.extra_modules) if space.views == 1 else 0.0

    def sample(k1, k2):
        genes = RS.sandwich_archs(k1, mask, big, small, e.num_random)
        extras = jax.random.bernoulli(k2, extra, (genes.shape[0], P)).astype(jnp.float32)
        return genes, extras.at[:2].set(0.0)

    def end_epoch(st, epoch, m):
        accs = np.asarray(population_accuracy(space, jax.device_get(st.params), np.stack([big, small]), fd.bn,
                                              fd.x, fd.y))
        return {"epoch": epoch, "stage": "search", "train_loss": float(m["loss"]), "train_acc": float(m["acc"]),
                "val_acc": float(accs[0]), "val_acc_smallest": float(accs[1]), "expected_latency_ms": None,
                "derived_latency_ms": None}

    def within(pop):
        lat, peak = costs.arrays(pop)
        return (lat <= t_const + 1e-12) & (peak <= mem)

    def fitness(st, pop):
        (lat, peak), ok = costs.arrays(pop), within(pop)
        acc = processes.spread(lambda p, _, rows: population_accuracy(space, p, rows, fd.bn, fd.x, fd.y),
                               jax.device_get(st.params), None, pop)
        return {"accuracy": acc, "latency_ms": lat, "sensor_peak_bytes": peak, "feasible": ok,
                "fitness": np.where(ok, acc - lat / t_const / (2 * len(fd.y)), -np.inf)}

    step = RS.sandwich(s.weight_lr, s.lambda1, sample, lambda p, bn, arch, x: N.apply(
        space, p, bn, arch[0], x, train=True, extras=arch[1]), keys=2)
    return RE.Problem(mask, lambda k: N.init(k, space, cfg.splitnets.init), jax.jit(step, donate_argnums=0),
                      end_epoch, within, fitness, tries=32, fold=False)


def winner(space: SplitSpace, hw: H.HMD, best) -> tuple:
    """(genes int32[G], note): the evolution's best network, or (none met both limits) the fastest smallest-op
    network within them (``reachable``)."""
    if best:
        return (np.asarray(best["ops"], np.int32),
                "the evolution's best network meets both hard limits (latency and sensor memory)")
    return (np.asarray(reachable(space, hw).fastest_within_memory, np.int32),
            "no evolved candidate met both limits; the fastest smallest-op network within them is used")


def population_accuracy(space: SplitSpace, params, pop, calib, x, y, chunk: int = 8):
    """float32[P] accuracy of each architecture genes int32[P, G] on (x, y), BN recalibrated on calib
    float32[K, B, V, H, W, C] per architecture. The population is evaluated in chunks of ``chunk`` (the last one
    padded), one jitted call per chunk (``lax.map`` over its architectures), so any P compiles once."""
    pop = np.asarray(pop, np.int32)
    n = pop.shape[0]
    padded = np.concatenate([pop, np.repeat(pop[:1], -n % chunk, axis=0)]) if n % chunk else pop
    calib = jnp.asarray(calib)
    out = [np.asarray(_pop_acc(space, params, jnp.asarray(padded[i:i + chunk]), calib, x, y))
           for i in range(0, len(padded), chunk)]
    return np.concatenate(out)[:n]


def _acc_one(space, params, genes, calib, x, y):
    fwd = lambda p, st, xx, train: N.apply(space, p, st, genes, xx, train=train)
    state = N.recalibrate(fwd, params, _bn_shapes(space), calib)
    logits, _ = fwd(params, state, x, False)
    return jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))


def _bn_shapes(space):
    """The supernet's BN state as shapes (``net.recalibrate`` needs only those)."""
    return jax.eval_shape(lambda: N.init(jax.random.PRNGKey(0), space)[1])


_pop_acc = jax.jit(lambda space, params, pop, calib, x, y: jax.lax.map(
    lambda g: _acc_one(space, params, g, calib, x, y), pop), static_argnums=0)


# ----------------------------------------------------------------------------------------------- retrain

def train_fixed(cfg, space, ds, params, genes, epochs: int, calib, *, pos=None, module="split", lr=None,
                progress=True, desc="retrain", ckpt=None, fp: str = "", resume: bool = False):
    """Trains one network (genes fixed; ``pos``/``module`` as in ``net.apply_fixed``, None: the genes' split, which
    computes what ``net.apply`` computes for these genes: only this network is compiled) from ``params``, its BN
    recalibrated on calib float32[K, B, V, H, W, C], for ``epochs`` on the run layer's epoch loop (checkpoints in
    ``ckpt``, None: none); returns (params, bn state with running statistics, history rows, evaluate)."""
    s, genes = cfg.search, jnp.asarray(genes, jnp.int32)
    tx = optax.adam(cfg.retrain.lr if lr is None else lr)
    pos = space.decode(genes).split if pos is None else pos
    fwd = lambda p, st, x, train: N.apply_fixed(space, p, st, genes, x, train=train, pos=pos, module=module)

    @jax.jit
    def step(fs: train.RetrainState, x, y):
        def loss(p):
            logits, st2 = fwd(p, fs.bn, x, True)
            return cross_entropy(logits, y) + s.lambda1 * l2_norm_sq(p), st2
        (l, st2), g = jax.value_and_grad(loss, has_aux=True)(fs.params)
        up, opt = tx.update(g, fs.opt, fs.params)
        return train.RetrainState(optax.apply_updates(fs.params, up), st2, opt, fs.step + 1), {"loss": l}

    st = N.recalibrate(fwd, params, _bn_shapes(space), jnp.asarray(calib))
    evaluate = jax.jit(lambda p, st, x: jnp.argmax(fwd(p, st, x, False)[0], -1))
    fs, hist = loop.epochs(
        train.RetrainState(params, st, tx.init(params), jnp.zeros((), jnp.int32)), cfg=cfg, ckpt=ckpt, fp=fp,
        resume=resume, total=epochs, split=ds.train, batch_size=s.batch_size, seed=cfg.seed + 2,
        step=lambda fs, epoch, i, batch: step(fs, *batch), desc=desc, progress=progress,
        end_epoch=lambda fs, epoch, m: {"epoch": epoch, "stage": "retrain", "train_loss": float(m["loss"]),
                                        "train_acc": None, "val_acc": accuracy(evaluate, fs.params, fs.bn, ds.val),
                                        "expected_latency_ms": None, "derived_latency_ms": None},
        extra_meta={"genes": [int(g) for g in genes]})
    return fs.params, fs.bn, hist, evaluate


def accuracy(evaluate, params, st, split: data.Split, batch: int = 256) -> float:
    right = sum(int(np.sum(np.asarray(evaluate(params, st, x)) == y)) for x, y in data.eval_batches(split, batch))
    return right / len(split.labels)


# ----------------------------------------------------------------------------------------------- outputs

def compact_parts(space: SplitSpace, params, bn, genes) -> dict:
    """Per-device parameters of one network: ``sensor`` (stem, on-sensor blocks cut to their kernel and
    expansion, Conv-Reduce cut to d outputs) and ``aggregator`` (recover/fuse cut to the d channels of each view,
    on-aggregator blocks, head), each {"layers": [...], "params": ..., "bn": ...}."""
    a = space.decode(genes)
    p_s, m_s = a.split
    out = {dev: {"layers": [], "params": {"blocks": {}}, "bn": {"blocks": {}}} for dev in ("sensor", "aggregator")}
    out["sensor"]["params"]["stem"], out["sensor"]["bn"]["stem"] = params["stem"], bn["stem"]
    for p in range(space.num_phases):
        for j in range(a.depth[p]):
            dev = "sensor" if (p, j) < (p_s, m_s) else "aggregator"
            side = "sensor" if space.shared or dev == "sensor" else "aggregator"
            i = p * space.max_depth + j
            k, e = space.op_choices[a.ops[p][j]]
            c_in = space.slot(p, j)[0]
            mid, lo = c_in * e, (space.kmax - k) // 2
            w, st = params[side][i], bn[side][i]
            q = {"expand": w["expand"][:, :mid], "dw": w["dw"][lo:lo + k, lo:lo + k, :mid],
                 "project": w["project"][:mid], "bn3": w["bn3"]}
            q.update({n: {kk: v[:mid] for kk, v in w[n].items()} for n in ("bn1", "bn2")})
            sq = {"bn1": {kk: v[:mid] for kk, v in st["bn1"].items()},
                  "bn2": {kk: v[:mid] for kk, v in st["bn2"].items()}, "bn3": st["bn3"]}
            out[dev]["layers"].append({"phase": p, "slot": j, "op": space.op_name(p, j, a.ops[p][j])})
            out[dev]["params"]["blocks"][f"{p}.{j}"], out[dev]["bn"]["blocks"][f"{p}.{j}"] = q, sq
    mod, dm = params["modules"][p_s], space.d_max(p_s)
    out["sensor"]["params"]["reduce"] = mod["reduce"][..., :a.d]
    if space.views == 1:
        out["aggregator"]["params"]["recover"] = mod["recover"][:, :, :a.d]
    else:
        rows = np.concatenate([np.arange(a.d) + v * dm for v in range(space.views)])
        out["aggregator"]["params"]["fuse"] = mod["fuse"][:, :, rows]
    out["aggregator"]["params"]["head"], out["aggregator"]["bn"]["head"] = params["head"], bn["head"]
    return out


def write_parts(space, params, bn, genes, workdir: str, bus_mbps: float | None = None) -> dict:
    """``parts/sensor.npz`` and ``parts/aggregator.npz`` (weights and BN statistics) and ``parts/manifest.json``
    (``run.directory.write_parts``: atomic, process 0), which records the split, the split-aware space and the bus's
    Mbit/s (what ``jmsnas export`` needs to deploy the parts, ``jmsnas.deploy.splitnets``)."""
    a = space.decode(genes)
    parts = compact_parts(space, jax.device_get(params), jax.device_get(bn), genes)
    s_hw, c = space.phase_hw(a.split[0]), space.phase_channels[a.split[0]]
    shapes = {"sensor": ([space.image_size, space.image_size, space.in_channels], [s_hw, s_hw, a.d]),
              "aggregator": ([space.views, s_hw, s_hw, a.d], [space.num_classes])}
    return directory.write_parts(
        workdir, {dev: {**part, "input_shape": shapes[dev][0], "output_shape": shapes[dev][1]}
                  for dev, part in parts.items()},
        {"views": space.views, "split": {"phase": a.split[0], "m": a.split[1], "d": a.d, "c": c},
         "splitnets_space": dataclasses.asdict(space), "bus_mbps": None if bus_mbps is None else float(bus_mbps)})


def result_dict(cfg, space, hw, genes, cost: H.Cost, val_acc, test_acc, n_params, ds_name, note) -> dict:
    """result.json: the common top level and a ``splitnets`` block (where the split is and what it costs)."""
    a = space.decode(genes)
    p, m = a.split
    before = sum(a.depth[:p]) + m
    arch = []
    for q in range(space.num_phases):
        for j in range(a.depth[q]):
            arch.append({"layer": len(arch), "device": "sensor" if (q, j) < a.split else "aggregator",
                         "op": space.op_name(q, j, a.ops[q][j])})
    met_t = cost.total_ms <= cfg.t_const_ms + 1e-12
    met_m = cost.sensor_peak_bytes <= hw.sensor_memory_bytes
    return {"topology": cfg.splitnets.topology or f"hmd_{space.views}_sensors", "t_const_ms": float(cfg.t_const_ms),
            "architecture": arch, "split": "searched",
            "latency_ms": {"total": cost.total_ms, "per_device": {"sensor": cost.sensor_ms,
                                                                  "aggregator": cost.aggregator_ms},
                           "per_link": {"sensor->aggregator": cost.comm_ms}},
            "accuracy": {"val": val_acc, "test": test_acc}, "params": n_params,
            "budget": {"met": bool(met_t and met_m), "repaired": False, "min_reachable_ms": None, "note": note},
            "memory": {"sensor_peak_bytes": cost.sensor_peak_bytes, "limit_bytes": hw.sensor_memory_bytes,
                       "met": bool(met_m)},
            "splitnets": {
                "views": space.views, "split_phase": p, "blocks_on_sensor": before,
                "blocks_on_aggregator": sum(a.depth) - before, "depth": list(a.depth), "d": a.d,
                "c": space.phase_channels[p], "feature_shape": [space.phase_hw(p), space.phase_hw(p), a.d],
                "bytes_per_sensor": cost.bytes_per_sensor, "bus_bytes": cost.bus_bytes,
                "bus_bytes_without_module": float(space.phase_hw(p) ** 2 * space.phase_channels[p] * space.views),
                "sensor_peak_memory_bytes": cost.sensor_peak_bytes, "genes": [int(g) for g in genes]},
            "dataset": ds_name, "seed": cfg.seed, "flow": "splitnets"}


# ----------------------------------------------------------------------------------------------- the flow

def prepare(cfg):
    """(cfg with defaults, hardware, space, data) after every check; raises ConfigError before any write."""
    cfg = with_defaults(cfg)
    validate(cfg)
    hw = hardware(cfg)
    ds = VW.load(cfg.dataset, views=cfg.splitnets.views, view_size=cfg.splitnets.view_size,
                 data_dir=cfg.get("data_dir"), val_fraction=cfg.val_fraction, seed=cfg.seed,
                 image_size=cfg.get("image_size"), max_train=cfg.get("max_train"))
    space = build_space(cfg, ds.image_size, ds.channels, ds.num_classes)
    check_limits(space, hw, float(cfg.t_const_ms))
    return cfg, hw, space, ds


@timing.measured
def evolve(cfg, workdir: str, *, resume: bool = False, progress: bool = True) -> dict:
    """Stages 1 and 2 (``run.evolution.search`` over ``problem``) and the winner's retraining, each on the run layer
    (checkpoints under ``checkpoints/``, so ``resume`` continues a killed run to the same result); writes
    result.json, history.json, evolution.json, plots and parts/ (atomically, process 0)."""
    cfg, hw, space, ds = prepare(cfg)
    fd = RE.fitness_data(cfg, ds)
    W.check_and_claim(workdir, resume, cfg, "evolve")
    fp, costs = W.fingerprint(cfg), CostCache(space, hw)
    with tb.run(workdir, tb.enabled(cfg)):
        st, history, log, best, _ = RE.search(cfg, problem(cfg, space, costs, fd), ds, train.data_mesh(), workdir,
                                              fp, resume, progress)
        genes, note = winner(space, hw, best)
        params, bn, hist2, evaluate = train_fixed(
            cfg, space, ds, jax.device_get(st.params), genes, cfg.retrain.epochs, fd.bn, progress=progress,
            ckpt=Checkpointer(os.path.join(workdir, "checkpoints", "retrain")), fp=fp, resume=resume)
        for i, row in enumerate(hist2):
            tb.log(len(history) + i, tb.history_scalars(row))
        history += hist2
        cost = costs(genes)
        n_params = sum(int(np.size(v)) for part in compact_parts(space, params, bn, genes).values()
                       for v in jax.tree_util.tree_leaves(part["params"]))
        result = result_dict(cfg, space, hw, genes, cost, accuracy(evaluate, params, bn, ds.val),
                             accuracy(evaluate, params, bn, ds.test), n_params, ds.name, note)
        result["evolution"] = {"population": cfg.evolve.population, "generations": cfg.evolve.generations,
                               "supernet_val_acc": None if best is None else best["accuracy"]}
        if timing.active() is not None:  # compile and run time (wall, CPU): the only entry that varies by run
            result["time"] = timing.summary()
        for h in history:
            h["derived_latency_ms"] = cost.total_ms
        directory.write_json(workdir, directory.EVOLUTION, {"generations": log, "best": best,
                                                            "winner": [int(g) for g in genes]})
        figures = directory.write_outputs(workdir, result, history,
                                          lambda: write_parts(space, params, bn, genes, workdir, hw.bus_mbps))
        tb.log(len(history), tb.result_scalars(result))
        tb.images(len(history), tb.figures(figures))
        return result
