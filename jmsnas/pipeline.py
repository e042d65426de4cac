"""The main job: ``search(config, workdir)`` runs stage 1, repairs the budget, retrains, reports.

Everything a run needs to continue is checkpointed (orbax) every ``checkpoint_every`` steps and at epoch ends
(every ``checkpoint_min_interval_s`` seconds at most, and after each stage's last epoch: ``EpochSaves``): the
whole state plus the position in the data and the history. ``resume=True`` continues from the latest
checkpoint; because batches are a pure function of (seed, epoch, position) and the PRNG key is part of the state,
a resumed run ends with the same architecture as an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from jmsnas import (ahead as A, budget, data, dwconv, gates as G, programs, report, runcheck, safeio, supernet,
                    tensorboard as tb, timing, topology, train)
from jmsnas.checkpoint import CheckpointError, Checkpointer
from jmsnas.cost.latency import arch_latency, best_chain_assignment, breakdown_dict, expected_latency, searched_latency
from jmsnas.cost.tables import CostTable, analytic_table
from jmsnas.deploy.spec import space_to_dict
from jmsnas.objectives import PENALTIES
from jmsnas.runcheck import ConfigError
from jmsnas.space import OP_NAMES, SearchSpace, adapt_schedule, build_space
from jmsnas.topology import Topology


def validate_config(cfg) -> None:
    """Checks the values that would otherwise fail deep inside a run (before anything is loaded or written)."""
    runcheck.check_values(cfg)
    tb.enabled(cfg)  # a bool
    t = cfg.t_const_ms
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0:
        raise ConfigError(f"t_const_ms must be a positive number of ms, got {t!r}")
    if cfg.dataset not in data.DATASETS:
        raise ConfigError(f"unknown dataset {cfg.dataset!r}; expected one of {list(data.DATASETS)}")
    topo = resolve_topology(cfg)
    if topo.kind == "star":
        raise ConfigError(f"topology {cfg.topology!r} is a star of {len(topo.branches)} source devices (sensors); "
                          "search and evolve need one source device (a chain or a mesh); split it with jmsnas split")
    if topo.kind == "cluster":
        raise ConfigError(f"topology {cfg.topology!r} links every pair of its {topo.num_devices} devices (a cluster); "
                          "search and evolve need a chain or a mesh; a cluster runs separable networks "
                          "(jmsnas separable --config.cluster.topology=FILE)")
    ds = cfg.space
    try:  # the per-device schedule on this topology (shapes only; the data's sizes are not known yet)
        channels, strides = adapt_schedule(topo, tuple(ds.device_channels), tuple(ds.device_strides))
        build_space(topo, image_size=8, in_channels=1, num_classes=2, device_channels=channels,
                    device_strides=strides, stem_channels=ds.stem_channels, stem_stride=ds.stem_stride,
                    head_channels=ds.head_channels)
    except ValueError as e:
        raise ConfigError(f"space on topology {topo.name!r}: {e}") from None
    s = cfg.search
    for name in ("warmup_epochs", "epochs", "batch_size", "arch_every"):
        v = s[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmup_epochs" else 1):
            raise ConfigError(f"search.{name} must be a {'non-negative' if name == 'warmup_epochs' else 'positive'}"
                              f" integer, got {v!r}")
    if cfg.retrain.epochs < 0:
        raise ConfigError(f"retrain.epochs must be >= 0, got {cfg.retrain.epochs!r}")
    n_dev = jax.device_count()
    for name, bs in (("search.batch_size", s.batch_size), ("eval_batch_size", cfg.eval_batch_size)):
        if bs % n_dev:
            raise ConfigError(f"{name}={bs} must be divisible by the number of devices ({n_dev})")
    if cfg.split not in train.SPLITS:
        raise ConfigError(f"unknown split {cfg.split!r}; expected one of {list(train.SPLITS)}")
    if cfg.split == "searched" and topo.kind != "chain":
        raise ConfigError(f"split 'searched' needs a chain topology, got {cfg.topology!r} ({topo.kind})")
    if s.gate_mode not in G.GATE_MODES:
        raise ConfigError(f"unknown search.gate_mode {s.gate_mode!r}; expected one of {list(G.GATE_MODES)}")
    if s.get("penalty", "two_sided") not in PENALTIES:
        raise ConfigError(f"unknown search.penalty {s.penalty!r}; expected one of {list(PENALTIES)}")
    if cfg.get("dw_impl", "auto") not in dwconv.IMPLS:
        raise ConfigError(f"unknown dw_impl {cfg.dw_impl!r}; expected one of {list(dwconv.IMPLS)}")
    if cfg.get("candidate_impl", "auto") not in supernet.CANDIDATE_IMPLS:
        raise ConfigError(f"unknown candidate_impl {cfg.candidate_impl!r}; expected one of "
                          f"{list(supernet.CANDIDATE_IMPLS)}")


def resolve_topology(cfg) -> Topology:
    """The topology ``cfg.topology`` names (``jmsnas.topology.resolve``): a preset with ``cfg.layers_per_device``,
    or a topology file (.yaml/.yml/.json, or a run's result.json) whose own layers_per_device wins."""
    return topology.resolve(cfg.topology, cfg.get("layers_per_device"))


def build(cfg):
    """(space, table) from the configuration. A topology file's devices also go into ``cfg.topology_resolved``
    (so the run's fingerprint covers the file's content); the space's per-device widths and strides are
    resampled to the topology's devices when the config gives another number (``space.adapt_schedule``)."""
    topo = resolve_topology(cfg)
    if cfg.topology not in topology.presets.TOPOLOGIES:
        with cfg.unlocked():
            cfg.topology_resolved = topology.to_dict(topo)
    ds = cfg.space
    channels, strides = adapt_schedule(topo, tuple(ds.device_channels), tuple(ds.device_strides))
    space = build_space(topo, image_size=cfg.image_size_resolved, in_channels=cfg.channels_resolved,
                        num_classes=cfg.num_classes_resolved, device_channels=channels,
                        device_strides=strides, stem_channels=ds.stem_channels,
                        stem_stride=ds.stem_stride, head_channels=ds.head_channels)
    return space, make_table(space, cfg)


def make_table(space: SearchSpace, cfg) -> CostTable:
    """The cost table: per-device sources from ``cost.tables`` (see jmsnas.cost.build), else the roofline."""
    tables_cfg = cfg.cost.get("tables")
    if tables_cfg:
        from jmsnas.cost.build import build_table  # measured / imported / fitted tables
        return build_table(space, dict(tables_cfg), activation_bits=cfg.cost.activation_bits)
    return analytic_table(space, cfg.cost.activation_bits)


def fingerprint(cfg) -> str:
    """A hash of everything that determines the run (so a resumed run cannot silently change it)."""
    d = cfg.to_dict()
    for key in runcheck.CHECKPOINT_KEYS:
        d.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _hparams(cfg) -> train.SearchHParams:
    s = cfg.search
    return train.SearchHParams(s.weight_lr, s.arch_lr, s.lambda1, s.lambda2, float(cfg.t_const_ms), s.penalty,
                               s.gate_mode, s.tau0, s.tau_min, s.tau_decay, cfg.split)


def check_run(cfg, space: SearchSpace, ds, batch_size: int, paths: int, extra_bytes: int = 0,
              extra_what: str = "") -> None:
    """What would fail after the workdir is prepared: batch sizes against the splits, one step's memory (plus
    ``extra_bytes``, e.g. an evolution's population)."""
    for name, split in (("train", ds.train), ("val", ds.val)):
        if batch_size > split.labels.shape[0]:
            raise ConfigError(f"search.batch_size={batch_size} is larger than the {name} split "
                              f"({split.labels.shape[0]} examples): an epoch would have no batch")
    runcheck.check_memory(space, batch_size, paths, f"image_size={space.image_size}", extra_bytes, extra_what)


def claim_workdir(workdir: str, resume: bool, stored: dict, command: str) -> None:
    """``runcheck.claim_workdir`` by process 0 once every process has checked the workdir (multi-process runs)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jmsnas: workdir checked")
    if jax.process_index() == 0:
        runcheck.claim_workdir(workdir, resume, stored, command)


def prepare_workdir(workdir: str, resume: bool, cfg, command: str, resumable: bool = True) -> None:
    """Checks ``workdir`` for ``jmsnas <command>`` (``runcheck.check_workdir``), then creates it and stores the
    configuration: for flows whose other checks are all done (separable networks, SplitNets)."""
    stored = runcheck.plain(cfg)
    runcheck.check_workdir(workdir, resume, stored, command, resumable)
    claim_workdir(workdir, resume, stored, command)


def _gate_paths(cfg) -> int:
    """Candidates one layer computes per step: 2 for two-path gates, all 13 for the others."""
    return 2 if cfg.search.gate_mode == "two_path" else len(OP_NAMES)


def load_data(cfg):
    ds = data.load(cfg.dataset, data_dir=cfg.get("data_dir"), val_fraction=cfg.val_fraction, seed=cfg.seed,
                   image_size=cfg.get("image_size"), max_train=cfg.get("max_train"), max_eval=cfg.get("max_eval"))
    with cfg.unlocked():
        cfg.image_size_resolved = ds.image_size
        cfg.channels_resolved = ds.channels
        cfg.num_classes_resolved = ds.num_classes
    return ds


@timing.measured
def search(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False, progress: bool = True) -> dict:
    """Runs both stages and writes result.json, plots, per-device parts and checkpoints into ``workdir``."""
    validate_config(cfg)
    stored = runcheck.plain(cfg)
    runcheck.check_workdir(workdir, resume, stored, "search")
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    with start_ahead() as ahead:
        ds = load_data(cfg)
        space, table = build(cfg)
        check_run(cfg, space, ds, cfg.search.batch_size, _gate_paths(cfg))
        claim_workdir(workdir, resume, stored, "search")
        mesh = train.data_mesh()
        fp = fingerprint(cfg)
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints", "search"))
        with tb.run(workdir, tb.enabled(cfg)):
            st, pos, history = _stage1(cfg, space, table, ds, mesh, ckpt, fp, resume, progress, ahead)
            check_alpha(st.alpha)
            derived = np.asarray(G.derive(st.alpha, space.mask()))
            assignment = _assignment(cfg, space, table, derived)
            fix = budget.repair(space, table, st.alpha, derived, float(cfg.t_const_ms), assignment)
            ops = tuple(int(i) for i in fix.ops)
            assignment = _assignment(cfg, space, table, fix.ops)  # re-split the repaired net: T can only fall
            ahead.wait_for(("retrain", ops))  # its steps, compiled since the search's last batch (_compile_retrain)
            rt, history = _stage2(cfg, space, ds, mesh, st, ops, workdir, fp, resume, progress, history)
            return _finish(cfg, space, table, ds, mesh, rt, ops, assignment, fix, derived, history, workdir)


def start_ahead() -> A.Ahead:
    """The run's ahead-of-time compiler (``jmsnas.ahead``), already building the native CPU kernels (a C++
    compiler in child processes) while the data loads. Nothing ahead in a multi-process run."""
    ahead = A.Ahead(None if jax.process_count() == 1 else 0)
    if jax.default_backend() == "cpu":
        from jmsnas import native
        ahead.submit(native.load)
    return ahead


def _first_batches(ds, batch_size: int, eval_batch_size: int, mesh):
    """Abstract (x, y) of a training batch and (x, y, valid) of an evaluation batch, placed as the run places
    them (``train.shard_batch``): the arguments the steps are compiled for ahead."""
    x, y = ds.train.images[:batch_size], ds.train.labels[:batch_size]
    return (A.abstract(train.shard_batch((x, y), mesh)),
            A.abstract(train.shard_batch(next(train.padded_eval_batches(ds.val, eval_batch_size)), mesh)))


def _compile_stage1(ahead: A.Ahead, cfg, space, ds, mesh, shapes, steps, latencies):
    """Stage 1's steps compiled ahead, all at once, for the state of ``shapes`` (``jax.eval_shape`` of its
    initialisation) placed as the run places it: (weight_step, arch_step, eval_step, latencies), each waiting at
    its first call for its compilation."""
    weight_step, arch_step, eval_step = steps
    (x, y), (xe, ye, valid) = _first_batches(ds, cfg.search.batch_size, cfg.eval_batch_size, mesh)
    state = A.abstract(shapes, train.replicated(mesh))
    ops = A.abstract(jax.eval_shape(lambda a: G.derive(a, space.mask()), state.alpha), train.replicated(mesh))
    # in the order they are first needed: the first batch, the end of epoch 0, the first architecture step
    weight_step = ahead.compile(weight_step, state, x, y)
    eval_step = ahead.compile(eval_step, state.params, state.bn, ops, xe, ye, valid)
    latencies.expected = ahead.compile(latencies.expected, state.alpha)
    if cfg.split == "fixed":
        latencies.derived = ahead.compile(latencies.derived, ops, None)
    arch_step = ahead.compile(arch_step, state, x, y)
    return weight_step, arch_step, eval_step, latencies


def _compile_retrain(ahead: A.Ahead, cfg, space, table, ds, mesh, st) -> None:
    """Compile the retraining's steps in threads for the architecture the search ends with (``st.alpha``
    derived and repaired to the budget, as ``search`` does next), while the search's last epoch is evaluated
    and checkpointed, under the key ``("retrain", ops)`` (``Ahead.speculate``): ``search`` waits for it when its
    ops are these (always, unless the two computations disagree)."""
    alpha = train.replicate(np.asarray(st.alpha), mesh)  # a copy: st may be donated meanwhile
    state = A.abstract(st)
    (x, y), (xe, ye, valid) = _first_batches(ds, cfg.search.batch_size, cfg.eval_batch_size, mesh)
    r = cfg.retrain

    def guess():
        derived = np.asarray(G.derive(alpha, space.mask()))
        fix = budget.repair(space, table, alpha, derived, float(cfg.t_const_ms),
                            _assignment(cfg, space, table, derived))
        return "retrain", tuple(int(i) for i in fix.ops)

    def build(key):
        ops = key[1]
        train_step, eval_step = retrain_steps(space, ops, r.lr, cfg.search.lambda1, cfg.dw_impl)
        shapes = jax.eval_shape(lambda s: train.init_retrain_state(space, s, ops, r.lr), state)
        rt = A.abstract(shapes, train.replicated(mesh))
        host_params = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), shapes.params)
        evaluate = lambda: (eval_step.lower(rt.params, rt.bn, xe, ye, valid).compile(),
                            train.adam_init(r.lr).lower(host_params).compile())
        beside = ahead.submit(evaluate) if ahead.workers > 1 else None  # this thread holds one worker
        train_step.lower(rt, x, y).compile()
        beside.result() if beside is not None else evaluate()

    ahead.speculate(guess, build)


def _assignment(cfg, space, table, ops):
    """The layer->device split: D^m (None) when fixed, the exact best chain split of ``ops`` when searched."""
    if cfg.split == "fixed":
        return None
    onehot = jax.nn.one_hot(jnp.asarray(ops), len(OP_NAMES))
    return np.asarray(best_chain_assignment(space, table, onehot))


def _save(ckpt: Checkpointer, step: int, state, meta: dict) -> None:
    if step not in ckpt.all_steps():
        ckpt.save(step, jax.device_get(state), meta)


class EpochSaves:
    """A stage's checkpoints: mid-epoch every ``cfg.checkpoint_every`` batches (``mid_epoch``), and at epoch ends
    (``save``) always after the last epoch, otherwise when at least ``cfg.checkpoint_min_interval_s`` seconds (0:
    always) have passed since the stage's last checkpoint of either kind. A run that is killed resumes from the
    latest checkpoint and repeats the epochs after it, to the same result; a save costs a device-to-host copy and an
    orbax write (0.2 s in the main job)."""

    def __init__(self, cfg, clock=time.monotonic):
        self.every, self.clock, self.last = cfg.checkpoint_every, clock, None
        self.interval = float(cfg.get("checkpoint_min_interval_s", 0.0))

    def saved(self) -> None:
        self.last = self.clock()

    def mid_epoch(self, ckpt: Checkpointer, batches_done: int, batches: int, what) -> None:
        """After ``batches_done`` of an epoch's ``batches``: the checkpoint every ``checkpoint_every`` batches (none
        at the epoch's end, which ``save`` decides). ``what() -> (step, state, meta)`` is called only when one is
        written, so the step counter is not read back from the device every batch."""
        if batches_done % self.every == 0 and batches_done < batches:
            _save(ckpt, *what())
            self.saved()

    def save(self, ckpt: Checkpointer, step: int, state, meta: dict, *, last_epoch: bool) -> bool:
        """Writes the epoch-end checkpoint if it is due; returns whether it did."""
        if not (last_epoch or self.last is None or self.clock() - self.last >= self.interval):
            return False
        _save(ckpt, step, state, meta)
        self.saved()
        return True


def search_steps(cfg, space: SearchSpace, table: CostTable):
    """(weight_step, arch_step, eval_step) of ``train.make_search_steps`` as the configuration asks, each with
    its traced program kept for later runs (``programs.persistent_jit``)."""
    made = (space, table, _hparams(cfg), cfg.dw_impl, cfg.get("candidate_impl", "auto"))
    steps = train.make_search_steps(*made)
    return tuple(programs.persistent_jit(step, name=f"search.{name}", identity=made, donate_argnums=donate)
                 for step, name, donate in zip(steps, ("weight_step", "arch_step", "eval_step"), (0, 0, ())))


@functools.lru_cache(maxsize=16)  # the same steps for the same network: _finish reuses the retraining's
def retrain_steps(space: SearchSpace, ops: tuple, lr: float, lambda1: float, dw_impl: str):
    """(train_step, eval_step) of ``train.make_retrain_steps``, each with its traced program kept for later runs."""
    made = (space, ops, lr, lambda1, dw_impl)
    train_step, eval_step = train.make_retrain_steps(*made)
    return (programs.persistent_jit(train_step, name="retrain.train_step", identity=made, donate_argnums=0),
            programs.persistent_jit(eval_step, name="retrain.eval_step", identity=made))


META_TYPES = {"epoch": "count", "batch": "count", "history": list}  # what a training checkpoint's meta holds


def check_alpha(alpha, what: str = "the search") -> None:
    """ConfigError when the architecture parameters hold NaN or inf (a diverged search or a damaged state):
    no architecture can be derived from them."""
    a = np.asarray(alpha)
    if not np.all(np.isfinite(a)):
        raise ConfigError(f"the architecture parameters alpha hold {int((~np.isfinite(a)).sum())} NaN/inf value(s) "
                          f"after {what}: training diverged; lower search.weight_lr / search.arch_lr or "
                          f"search.lambda2, or start again")


def restore_progress(ckpt: Checkpointer, state, fp: str, resume: bool):
    """(state, epoch, batch, history): from the latest checkpoint when resuming one (its fingerprint must be
    ``fp``), else ``state`` at the start."""
    if resume and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(jax.device_get(state), expect_meta={"fingerprint": fp}, meta_types=META_TYPES)
        return state, meta["epoch"], meta["batch"], meta["history"]
    return state, 0, 0, []


def _stage1(cfg, space, table, ds, mesh, ckpt, fp, resume, progress, ahead: A.Ahead | None = None):
    hp = _hparams(cfg)
    s = cfg.search
    weight_step, arch_step, eval_step = search_steps(cfg, space, table)
    latencies = _EpochLatencies(cfg, space, table)
    init = lambda: train.init_search_state(jax.random.PRNGKey(cfg.seed), space, hp, cfg.shared_weights)
    if ahead is not None:  # compiled in threads while the supernet initialises
        weight_step, arch_step, eval_step, latencies = _compile_stage1(
            ahead, cfg, space, ds, mesh, jax.eval_shape(init), (weight_step, arch_step, eval_step), latencies)
    st, epoch, start, history = restore_progress(ckpt, init(), fp, resume)
    st = train.replicate(st, mesh)
    nb = data.num_batches(ds.train, s.batch_size)
    n_val = data.num_batches(ds.val, s.batch_size)
    total = s.warmup_epochs + s.epochs
    bar = timing.label(tqdm(total=total * nb, initial=epoch * nb + start, disable=not progress, desc="search",
                            unit="step"))
    metrics, saves = {}, EpochSaves(cfg)
    while epoch < total:
        warm = epoch < s.warmup_epochs
        for i, (x, y) in enumerate(data.epoch_batches(ds.train, s.batch_size, seed=cfg.seed, epoch=epoch,
                                                      start=start), start=start):
            st, m = weight_step(st, *train.shard_batch((x, y), mesh))
            metrics.update(m)
            if not warm and i % s.arch_every == 0:
                j = (i // s.arch_every) % n_val
                xv, yv = next(data.epoch_batches(ds.val, s.batch_size, seed=cfg.seed + 1, epoch=epoch, start=j))
                st, m = arch_step(st, *train.shard_batch((xv, yv), mesh))
                metrics.update(m)
            bar.update(1)
            saves.mid_epoch(ckpt, i + 1, nb, lambda: (int(st.step), st, {"epoch": epoch, "batch": i + 1,
                                                                          "history": history, "fingerprint": fp}))
            if progress and i % 5 == 0:  # the postfix costs a device sync and E[T]: only for a visible bar
                bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", acc=f"{float(metrics['acc']):.3f}",
                                ET=f"{float(latencies.expected(st.alpha)):.3f}ms")
        if ahead is not None and epoch == total - 1 and cfg.retrain.epochs > 0:  # alpha is final
            _compile_retrain(ahead, cfg, space, table, ds, mesh, st)
        history.append(_epoch_entry(cfg, space, table, ds, mesh, st, eval_step, epoch, warm, metrics, latencies))
        if tb.active():
            tb.log(epoch, _search_scalars(cfg, space, latencies, st, history[-1]))
        epoch, start = epoch + 1, 0
        saves.save(ckpt, int(st.step), st, {"epoch": epoch, "batch": 0, "history": history, "fingerprint": fp},
                   last_epoch=epoch == total)
    bar.close()
    return st, (epoch, start), history


class _EpochLatencies:
    """E[T] of alpha (the objective's) and T of a derived architecture, each one executable for the whole stage
    (evaluated eagerly they dispatched a few hundred small operations per call); ``breakdown``: E[T] per device
    and link with the architecture probabilities (for the TensorBoard logs)."""

    def __init__(self, cfg, space, table):
        self.expected = jax.jit(lambda alpha: train.step_latency(space, table, alpha, cfg.split))
        self.derived = jax.jit(lambda ops, assignment: arch_latency(space, table, ops, assignment).total)

        def breakdown(alpha):
            probs = G.probabilities(alpha, jnp.asarray(space.mask()))
            if cfg.split == "searched":  # E[T] under the best split of E[tau], as the objective takes it
                return searched_latency(space, table, probs)[0], probs
            return expected_latency(space, table, alpha), probs

        self.breakdown = jax.jit(breakdown)


def _search_scalars(cfg, space, latencies, st, row) -> dict:
    """An epoch of stage 1 for TensorBoard: the history row, E[T] per device and link, per-layer entropy and top
    op of the architecture distribution, and the Gumbel temperature of the gate modes that sample with one."""
    lat, probs = latencies.breakdown(st.alpha)
    out = {**tb.history_scalars(row), **tb.breakdown_scalars("latency/expected", breakdown_dict(space, lat)),
           **tb.arch_scalars(jax.device_get(probs))}
    s = cfg.search
    if s.gate_mode in ("gumbel_soft", "gumbel_hard"):  # the modes that sample with tau (gates.arch_gates)
        out["search/gumbel_temperature"] = float(G.temperature_schedule(s.tau0, s.tau_min, s.tau_decay)(int(st.step)))
    return out


def _epoch_entry(cfg, space, table, ds, mesh, st, eval_step, epoch, warm, metrics, latencies) -> dict:
    ops = G.derive(st.alpha, space.mask())
    acc, _ = train.evaluate(lambda x, y, v: eval_step(st.params, st.bn, ops, x, y, v), ds.val,
                            cfg.eval_batch_size, mesh)
    return {"epoch": epoch, "stage": "warmup" if warm else "search", "train_loss": float(metrics["loss"]),
            "train_acc": float(metrics["acc"]), "val_acc": acc,
            "expected_latency_ms": float(latencies.expected(st.alpha)),
            "derived_latency_ms": float(latencies.derived(ops, _assignment(cfg, space, table, np.asarray(ops))))}


def _stage2(cfg, space, ds, mesh, st, ops, workdir, fp, resume, progress, history):
    r = cfg.retrain
    rt = train.init_retrain_state(space, jax.device_get(st), ops, r.lr)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints", "retrain"))
    epoch, start = 0, 0
    if resume and ckpt.latest_step() is not None:
        rt, meta = ckpt.restore(jax.device_get(rt), expect_meta={"fingerprint": fp, "ops": list(ops)},
                                meta_types=META_TYPES)
        epoch, start, history = meta["epoch"], meta["batch"], meta["history"]
    rt = train.replicate(rt, mesh)
    train_step, eval_step = retrain_steps(space, ops, r.lr, cfg.search.lambda1, cfg.dw_impl)
    bs = cfg.search.batch_size
    nb = data.num_batches(ds.train, bs)
    bar = timing.label(tqdm(total=r.epochs * nb, initial=epoch * nb + start, disable=not progress, desc="retrain",
                            unit="step"))
    metrics, saves = {}, EpochSaves(cfg)
    while epoch < r.epochs:
        for i, (x, y) in enumerate(data.epoch_batches(ds.train, bs, seed=cfg.seed + 2, epoch=epoch, start=start),
                                   start=start):
            rt, metrics = train_step(rt, *train.shard_batch((x, y), mesh))
            bar.update(1)
            if i % 5 == 0:
                bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", acc=f"{float(metrics['acc']):.3f}")
            saves.mid_epoch(ckpt, i + 1, nb, lambda: (int(rt.step), rt, {"epoch": epoch, "batch": i + 1,
                                                                          "history": history, "fingerprint": fp,
                                                                          "ops": list(ops)}))
        acc, _ = train.evaluate(lambda x, y, v: eval_step(rt.params, rt.bn, x, y, v), ds.val, cfg.eval_batch_size, mesh)
        history.append({"epoch": len(history), "stage": "retrain", "train_loss": float(metrics["loss"]),
                        "train_acc": float(metrics["acc"]), "val_acc": acc, "expected_latency_ms": None,
                        "derived_latency_ms": None})
        tb.log(history[-1]["epoch"], tb.history_scalars(history[-1]))
        epoch, start = epoch + 1, 0
        saves.save(ckpt, int(rt.step), rt, {"epoch": epoch, "batch": 0, "history": history, "fingerprint": fp,
                                            "ops": list(ops)}, last_epoch=epoch == r.epochs)
    bar.close()
    return rt, history


def _finish(cfg, space, table, ds, mesh, rt, ops, assignment, fix, derived, history, workdir, *,
            note: str | None = None, extra: dict | None = None) -> dict:
    """Evaluates the retrained net and writes result.json, history.json, the report and parts/. ``note``
    replaces the budget note and ``extra`` adds keys to result.json (for flows other than the search)."""
    _, eval_step = retrain_steps(space, ops, cfg.retrain.lr, cfg.search.lambda1, cfg.dw_impl)
    ev = lambda split: train.evaluate(lambda x, y, v: eval_step(rt.params, rt.bn, x, y, v), split,
                                      cfg.eval_batch_size, mesh)[0]
    val_acc, test_acc = ev(ds.val), ev(ds.test)
    lat = breakdown_dict(space, arch_latency(space, table, jnp.asarray(ops), assignment))
    devices = space.layer_devices() if assignment is None else assignment
    for h in history:
        if h["derived_latency_ms"] is None:
            h["derived_latency_ms"] = lat["total"]
    names = space.topology.device_names
    params = jax.device_get(rt.params)
    result = {
        "topology": space.topology.name, "topology_spec": topology.to_dict(space.topology),
        "space": space_dict(space), "t_const_ms": float(cfg.t_const_ms),
        "architecture": [{"layer": s.index, "device": names[int(d)], "op": OP_NAMES[i]}
                         for s, i, d in zip(space.layers, ops, devices)],
        "split": cfg.split,
        "latency_ms": lat, "accuracy": {"val": val_acc, "test": test_acc},
        "params": supernet.count_params(params),
        "budget": {"met": bool(budget.within(lat["total"], cfg.t_const_ms)), "repaired": bool(fix.repaired),
                   "min_reachable_ms": fix.min_latency_ms,
                   "note": _budget_note(fix, derived, cfg.t_const_ms) if note is None else note},
        "dataset": ds.name, "seed": cfg.seed,
        **(extra or {}),
    }
    if timing.active() is not None:  # compile and run time so far (wall, CPU): the only entry that varies by run
        result["time"] = timing.summary()
    with output_errors(workdir):
        if jax.process_index() != 0:  # process 0 writes the outputs of a multi-process run
            return result
        with safeio.atomic_write(os.path.join(workdir, "result.json")) as f:
            json.dump(result, f, indent=2)
        with safeio.atomic_write(os.path.join(workdir, "history.json")) as f:
            json.dump(history, f, indent=2)
        figures = report.write_report(result, history, workdir)
        write_parts(space, params, jax.device_get(rt.bn), ops, os.path.join(workdir, "parts"), assignment)
    if tb.active():
        step = len(history)
        parts = [supernet.device_parts(space, tree, ops, assignment) for tree in (params, jax.device_get(rt.bn))]
        held = {d: sum(supernet.count_params(p[d]["params"]) for p in parts) for d in parts[0]}
        tb.log(step, {**tb.result_scalars(result), **tb.device_memory_scalars(held)})
        tb.images(step, tb.figures(figures))
    return result


@contextlib.contextmanager
def output_errors(workdir: str):
    """An OSError while writing the outputs becomes one ConfigError line; the checkpoints stay, so the same
    command with --resume writes them once the workdir is writable again."""
    try:
        yield
    except OSError as e:
        where = e.filename or workdir
        raise ConfigError(f"cannot write the run's outputs to {where!r}: {e.strerror or e}; the checkpoints are "
                          f"kept: fix that and rerun the same command with --resume (or `jmsnas retrain --workdir "
                          f"{workdir}`)") from None


def space_dict(space: SearchSpace) -> dict:
    """The arguments of ``build_space`` (besides the topology) that rebuild ``space``: what result.json records."""
    firsts = [space.layers[space.layers_of(d)[0]] for d in range(space.topology.num_devices)]
    return {"image_size": space.image_size, "in_channels": space.in_channels, "num_classes": space.num_classes,
            "device_channels": [s.out_ch for s in firsts], "device_strides": [s.stride for s in firsts],
            "stem_channels": space.stem_channels, "stem_stride": space.stem_stride,
            "head_channels": space.head_channels}


def _budget_note(fix, derived, t_const) -> str:
    if not fix.feasible:
        return (f"no architecture of this space meets T_const={t_const:.4g} ms; the fastest reachable is "
                f"{fix.min_latency_ms:.4g} ms and is used")
    if fix.repaired:
        return (f"the derived architecture exceeded T_const; repaired to the most probable architecture within it "
                f"(log-probability loss {fix.logprob_loss:.3f})")
    return "the derived (argmax) architecture meets T_const"


def write_parts(space: SearchSpace, params, bn, ops, directory: str, assignment=None) -> dict:
    """Per-device parts ready to deploy: ``<device>.npz`` (weights + BN statistics) and ``manifest.json``, written
    as one folder (``safeio.atomic_dir``: a failure leaves the previous folder or none, never a partial one)."""
    parts = supernet.device_parts(space, params, ops, assignment)
    bn_parts = supernet.device_parts(space, bn, ops, assignment)
    manifest = {"op_names": list(OP_NAMES), "devices": {}, "space": space_to_dict(space)}
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    with safeio.atomic_dir(directory) as tmp:
        for dev, part in parts.items():
            flat = {}
            for prefix, tree in (("params", part["params"]), ("bn", bn_parts[dev]["params"])):
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                    flat[prefix + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = \
                        np.asarray(leaf)
            with open(safeio.child_path(tmp, dev, ".npz", "device name"), "wb") as f:
                np.savez(f, **flat)
            layers = part["layers"]
            manifest["devices"][dev] = {"layers": layers, "ops": part["ops"], "file": f"{dev}.npz",
                                        "input_shape": _io_shape(space, layers, first=True),
                                        "output_shape": _io_shape(space, layers, first=False)}
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
    return manifest


def _io_shape(space, layers, first: bool):
    if not layers:
        return None  # the device only relays the tensor it receives
    s = space.layers[layers[0] if first else layers[-1]]
    return [s.in_hw, s.in_hw, s.in_ch] if first else [s.out_hw, s.out_hw, s.out_ch]
