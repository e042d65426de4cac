"""TensorBoard logs of a run, under ``WORKDIR/tensorboard`` (``tensorboard --logdir WORKDIR/tensorboard``).

Every flow (``jmsnas search``, ``evolve`` with the SplitNets configs too, ``separable``) opens one writer with
:func:`run` around its work and calls :func:`log` with plain ``{tag: number}`` dicts at the points where it
already has the numbers (an epoch's history row, a generation of the evolution, a round of the controller, the
final result); the ``*_scalars`` functions below turn the flows' own records into those dicts. Figures the run
writes as PNG go in as images (:func:`images`).

The events are written by ``tensorboardX`` (no TensorFlow needed) and read by TensorBoard itself or by
``tensorboard.backend.event_processing.event_accumulator``. Only JAX process 0 writes; ``cfg.tensorboard =
False`` (``--config.tensorboard=False``) turns the logs off. Outside :func:`run` (or with the logs off)
:func:`log` and :func:`images` do nothing, so library code may call them unconditionally. The writer is held in
a ``contextvars.ContextVar`` for the duration of :func:`run`: importing this module changes nothing.

Tags (units in their names): ``train/loss``, ``train/accuracy``, ``val/accuracy`` (fractions), ``latency/
expected_ms`` (E[T], eq. (1)/(2)), ``latency/expected/device/<name>_ms`` and ``latency/expected/link/<a>_to_<b>_ms``
(its breakdown), ``latency/derived_ms`` (T of the argmax architecture), ``arch/entropy/layer_NN`` (nats of
softmax(alpha) over the layer's valid ops), ``arch/top_op/layer_NN`` (index into ``space.OP_NAMES``),
``arch/top_prob/layer_NN``, ``search/gumbel_temperature``; ``evolution/*`` per generation; ``controller/*``,
``random/*`` per round or controller step (separable); ``result/*`` and ``memory/*`` once at the end.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Iterator, Mapping

import numpy as np

DIRNAME = "tensorboard"  # under the workdir

_current: contextvars.ContextVar = contextvars.ContextVar("jmsnas_tensorboard_writer", default=None)


class TensorBoardConfigError(ValueError):
    """``cfg.tensorboard`` is not true or false; the message names the value."""


def enabled(cfg) -> bool:
    """Whether a run of ``cfg`` writes TensorBoard logs: ``cfg.tensorboard`` (default True); raises
    TensorBoardConfigError (a ValueError) for a value that is not a bool."""
    on = cfg.get("tensorboard", True) if hasattr(cfg, "get") else True
    if not isinstance(on, bool):
        raise TensorBoardConfigError(f"tensorboard must be true or false, got {on!r}")
    return on


class _Writer:
    """The run's events writer, made on first use: a run refused before it logs anything (a ``--resume`` whose
    checkpoint does not match) writes nothing."""

    def __init__(self, logdir: str):
        self.logdir, self.writer = logdir, None

    def get(self):
        if self.writer is None:
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(logdir=self.logdir, flush_secs=30)
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@contextlib.contextmanager
def run(workdir: str, on: bool = True) -> Iterator[object]:
    """Opens the run's writer on ``workdir/tensorboard`` for the block (process 0, when ``on``); yields it (None
    when no logs are written). The events file is created by the first :func:`log` or :func:`images`, so a run
    that fails before it has anything to log leaves no trace. Events already there (an earlier attempt of a
    resumed run) are kept: TensorBoard drops the steps a restart repeats."""
    import jax
    if not on or jax.process_index() != 0:
        yield None
        return
    writer = _Writer(os.path.join(workdir, DIRNAME))
    token = _current.set(writer)
    try:
        yield writer
    finally:
        _current.reset(token)
        writer.close()


def active() -> bool:
    """True inside :func:`run` on the process that writes."""
    return _current.get() is not None


def log(step: int, scalars: Mapping[str, float]) -> None:
    """Writes ``scalars`` at ``step``; None and non-finite values are skipped (TensorBoard cannot show them)."""
    if _current.get() is None:
        return
    writer = _current.get().get()
    for tag, value in scalars.items():
        if value is None:
            continue
        v = float(value)
        if math.isfinite(v):
            writer.add_scalar(tag, v, int(step))


def images(step: int, paths: Mapping[str, str]) -> None:
    """Adds each PNG file ``paths[tag]`` as an image at ``step`` (files that do not exist are skipped)."""
    if _current.get() is None or not any(p and os.path.isfile(p) for p in paths.values()):
        return
    writer = _current.get().get()
    from PIL import Image
    for tag, path in paths.items():
        if path and os.path.isfile(path):
            with Image.open(path) as im:
                writer.add_image(tag, np.asarray(im.convert("RGB")), int(step), dataformats="HWC")
    writer.flush()


def _name(text: str) -> str:
    """A device or link name as a tag component: ``a->b`` becomes ``a_to_b``, spaces and slashes become ``_``."""
    return str(text).replace("->", "_to_").replace("/", "_").replace(" ", "_")


# --------------------------------------------------------------------------------- records -> {tag: value}

HISTORY_TAGS = {  # a history.json row's key -> its tag
    "train_loss": "train/loss", "train_acc": "train/accuracy", "val_acc": "val/accuracy",
    "val_acc_smallest": "val/accuracy_smallest", "loss_std_within_epoch": "train/loss_std",
    "expected_latency_ms": "latency/expected_ms", "derived_latency_ms": "latency/derived_ms",
    "derived_latency_ms_smallest": "latency/derived_smallest_ms",
}


def history_scalars(row: Mapping) -> dict:
    """The numbers of one history.json row (any flow's) under :data:`HISTORY_TAGS`; None values are left out."""
    return {tag: row[k] for k, tag in HISTORY_TAGS.items() if row.get(k) is not None}


def breakdown_scalars(prefix: str, breakdown: Mapping) -> dict:
    """``{prefix}_ms``, ``{prefix}/device/<name>_ms`` and ``{prefix}/link/<a>_to_<b>_ms`` of a latency breakdown
    dict (``cost.latency.breakdown_dict``: total, per_device, per_link in ms)."""
    out = {f"{prefix}_ms": breakdown["total"]}
    out.update({f"{prefix}/device/{_name(n)}_ms": v for n, v in breakdown.get("per_device", {}).items()})
    out.update({f"{prefix}/link/{_name(n)}_ms": v for n, v in breakdown.get("per_link", {}).items()})
    return out


def arch_scalars(probs) -> dict:
    """Per layer n of the architecture distribution ``probs`` float[N, R] (rows sum to 1, invalid ops 0):
    ``arch/entropy/layer_NN`` = -sum_i p log p in nats (log(k) for k equally likely ops, 0 once one op has all
    the mass), ``arch/top_op/layer_NN`` = argmax_i p and ``arch/top_prob/layer_NN`` = its probability; and
    ``arch/entropy_mean`` over the layers."""
    p = np.asarray(probs, np.float64)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    ent = -plogp.sum(axis=-1)
    top = p.argmax(axis=-1)
    out = {"arch/entropy_mean": float(ent.mean())}
    for n in range(p.shape[0]):
        out[f"arch/entropy/layer_{n:02d}"] = float(ent[n])
        out[f"arch/top_op/layer_{n:02d}"] = int(top[n])
        out[f"arch/top_prob/layer_{n:02d}"] = float(p[n, top[n]])
    return out


def composed_scalars(choices, probs, link_names) -> dict:
    """The composed search's other groups of gates (``jmsnas.compose.choices``; ``probs`` a ChoiceProbs, its ops
    logged by :func:`arch_scalars`): per link ``compose/link/<a>_to_<b>/sent_fraction`` = E[channels sent / c]
    (1 for no module, 1/r for a reduction r), ``compose/link/.../bits`` = E[transmitted bits] and
    ``.../p_no_module``; per layer ``compose/weight_bits/layer_NN`` = E[weight bits] (read where its device
    quantizes)."""
    q = np.asarray(probs.module, np.float64)
    frac = np.array([1.0] + [1.0 / r for r in choices.modules])
    abits = np.asarray(probs.act_bits, np.float64) @ np.asarray(choices.act_bits, np.float64)
    wbits = np.asarray(probs.weight_bits, np.float64) @ np.asarray(choices.weight_bits, np.float64)
    out = {}
    for l, name in enumerate(link_names):
        tag = f"compose/link/{_name(name)}"
        out[f"{tag}/sent_fraction"] = float(q[l] @ frac)
        out[f"{tag}/bits"] = float(abits[l])
        out[f"{tag}/p_no_module"] = float(q[l, 0])
    out.update({f"compose/weight_bits/layer_{n:02d}": float(b) for n, b in enumerate(wbits)})
    return out


def generation_scalars(accuracy, latency_ms, feasible, fitness, sensor_peak_bytes=None) -> dict:
    """One generation of an evolution (arrays over its P candidates): the best and mean fitness of the feasible
    candidates (``fitness`` is -inf where infeasible), the feasible fraction, best/mean accuracy, min/max
    latency in ms, and, where given, the largest sensor peak memory in bytes."""
    acc, lat = np.asarray(accuracy, np.float64), np.asarray(latency_ms, np.float64)
    ok, fit = np.asarray(feasible, bool), np.asarray(fitness, np.float64)
    out = {"evolution/feasible_fraction": float(ok.mean()), "evolution/accuracy_mean": float(acc.mean()),
           "evolution/latency_min_ms": float(lat.min()), "evolution/latency_max_ms": float(lat.max())}
    if ok.any():
        out.update({"evolution/fitness_best": float(fit[ok].max()), "evolution/fitness_mean": float(fit[ok].mean()),
                    "evolution/accuracy_best_feasible": float(acc[ok].max())})
    if sensor_peak_bytes is not None:
        out["evolution/sensor_peak_max_bytes"] = float(np.max(sensor_peak_bytes))
    return out


def result_scalars(result: Mapping) -> dict:
    """The final numbers of a search/evolve/SplitNets result.json: ``result/accuracy/{val,test}``, the latency
    breakdown under ``result/latency``, ``result/params`` and ``memory/sensor_peak_bytes`` (SplitNets) or
    ``memory/<device>/bytes`` and ``limit_bytes`` (search/evolve)."""
    out = {f"result/accuracy/{k}": v for k, v in result["accuracy"].items()}
    out.update(breakdown_scalars("result/latency", result["latency_ms"]))
    out["result/params"] = result.get("params")
    mem = result.get("memory")
    if mem and "sensor_peak_bytes" in mem:  # SplitNets
        out["memory/sensor_peak_bytes"] = mem["sensor_peak_bytes"]
        out["memory/sensor_limit_bytes"] = mem["limit_bytes"]
    elif mem:  # search/evolve: every device's memory against its limit (jmsnas.limits.report)
        for d, m in mem.items():
            out[f"memory/{_name(d)}/bytes"] = m["bytes"]
            if m.get("limit_bytes") is not None:
                out[f"memory/{_name(d)}/limit_bytes"] = m["limit_bytes"]
    return out


def device_memory_scalars(device_params: Mapping[str, int], bytes_per_param: int = 4) -> dict:
    """``memory/<device>/weight_bytes``: each device part's parameters (and BN statistics) at ``bytes_per_param``
    bytes each (float32: 4), what the device holds before its first activation."""
    return {f"memory/{_name(d)}/weight_bytes": int(n) * bytes_per_param for d, n in device_params.items()}


def separable_round_scalars(entry: Mapping, ctrl_steps: int) -> tuple:
    """(per-round scalars, [(step, scalars) per controller step]) of a separable run's history entry: for each arm
    its train loss, best accuracy, mean accuracy and bytes ratio of its final samples, and its mean reward of
    every controller step (global step ``round * ctrl_steps + t``), with the control group's reward."""
    r, per_round, per_step = int(entry["round"]), {}, {}
    for arm in ("controller", "random"):
        a = entry[arm]
        per_round.update({f"{arm}/train_loss": a["train_loss"], f"{arm}/best_accuracy": a["best_acc"],
                          f"{arm}/sample_accuracy_mean": float(np.mean(a["sample_acc"])),
                          f"{arm}/sample_bytes_ratio_mean": float(np.mean(a["sample_bytes_ratio"])),
                          f"{arm}/reward_round_mean": float(np.mean(a["rewards"]))})
        series = {f"{arm}/reward": a["rewards"]}
        if arm == "controller" and "random_on_controller_weights" in a:
            series["control_group/reward"] = a["random_on_controller_weights"]
        for tag, values in series.items():
            for t, v in enumerate(values):
                per_step.setdefault(r * ctrl_steps + t, {})[tag] = v
    return per_round, sorted(per_step.items())


def separable_result_scalars(result: Mapping) -> dict:
    """The final numbers of a separable run's result.json: per arm (controller, random, and the user's ``given``
    decisions) its test accuracy, latency (overlapped and synchronous) and bytes, compute ms per device and
    transfer ms per link; the non-separated reference's test accuracy."""
    out = {}
    for arm in ("controller", "random", "given"):
        if arm not in result:
            continue
        a, c = result[arm], result[arm]["cost"]
        out.update({f"result/{arm}/test_accuracy": a["test_acc"], f"result/{arm}/latency_ms": c["latency_ms"],
                    f"result/{arm}/synchronous_ms": c["synchronous_ms"],
                    f"result/{arm}/bytes_per_image": c["bytes_per_image"], f"result/{arm}/bytes_ratio": c["bytes_ratio"]})
        out.update({f"result/{arm}/device/{_name(d)}_ms": v for d, v in c["compute_ms"].items()})
        out.update({f"result/{arm}/link/{_name(n)}_ms": v for n, v in c["link_ms"].items()})
    if "reference" in result:
        out["result/reference/test_accuracy"] = result["reference"]["test_acc"]
    return out


def figures(paths) -> dict:
    """``{"figures/<name>": path}`` for the PNG files among ``paths`` (what a flow's plotting returned)."""
    return {f"figures/{os.path.splitext(os.path.basename(p))[0]}": p for p in paths if str(p).endswith(".png")}


# --------------------------------------------------------------------------------- reading the logs back

def read(workdir: str) -> tuple:
    """(scalars, image tags) of the logs under ``workdir/tensorboard``: ``{tag: [(step, value), ...]}`` in step
    order, and the sorted image tags. Reads with TensorBoard's own event reader (``pip install tensorboard``)."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise ImportError("reading TensorBoard logs needs the tensorboard package: pip install tensorboard") from None
    acc = event_accumulator.EventAccumulator(os.path.join(workdir, DIRNAME),
                                             size_guidance={event_accumulator.SCALARS: 0,
                                                            event_accumulator.IMAGES: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags.get(event_accumulator.SCALARS, [])}
    return scalars, sorted(tags.get(event_accumulator.IMAGES, []))

