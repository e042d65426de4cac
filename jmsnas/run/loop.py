"""The epoch loop every flow trains in, and the checkpoints that make a killed run resume to the same result.

``epochs(...)`` runs ``step`` over the batches of each epoch from a position (epoch, batch), writes a checkpoint
every ``checkpoint_every`` batches and at epoch ends (``EpochSaves``), appends one history row per epoch and shows
the progress bar. A checkpoint holds the whole state (PRNG key included) and its meta the position, the history
and the run's fingerprint; ``restore`` continues from the latest one. Batches are a pure function of (seed, epoch,
position), so a resumed run computes exactly what an uninterrupted one does. ``generations`` is the same for a
loop over generations (one checkpoint after each).
"""
from __future__ import annotations

import time
from typing import Callable

import jax
from tqdm import tqdm

from jmsnas import data, timing
from jmsnas.checkpoint import Checkpointer

META_TYPES = {"epoch": "count", "batch": "count", "history": list}  # what a training checkpoint's meta holds
DEFAULTS = dict(checkpoint_every=50, checkpoint_min_interval_s=30.0)  # the cadence jmsnas.configs.default_config has


def bar(total: int, initial: int, desc: str, unit: str, enabled: bool):
    """The progress bar of a loop (tqdm), labelled with compile/run time when a timer runs (``timing.label``)."""
    return timing.label(tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit=unit))


def save(ckpt: Checkpointer | None, step: int, state, meta: dict) -> None:
    """Writes checkpoint ``step`` unless it exists (a resumed run reaching a step it saved before) or there is no
    checkpointer (a loop run without checkpoints)."""
    if ckpt is not None and step not in ckpt.all_steps():
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
        if ckpt is not None and batches_done % self.every == 0 and batches_done < batches:
            save(ckpt, *what())
            self.saved()

    def save(self, ckpt: Checkpointer, step: int, state, meta: dict, *, last_epoch: bool) -> bool:
        """Writes the epoch-end checkpoint if it is due; returns whether it did."""
        if not (last_epoch or self.last is None or self.clock() - self.last >= self.interval):
            return False
        save(ckpt, step, state, meta)
        self.saved()
        return True


def restore(ckpt: Checkpointer | None, state, fp: str, resume: bool, meta_types: dict, extra_meta: dict | None = None):
    """(state, meta) of the latest checkpoint when resuming one (its fingerprint must be ``fp`` and its meta hold
    ``extra_meta``), else (``state``, None)."""
    if resume and ckpt is not None and ckpt.latest_step() is not None:
        return ckpt.restore(jax.device_get(state), expect_meta={"fingerprint": fp, **(extra_meta or {})},
                            meta_types=meta_types)
    return state, None


def epochs(state, *, cfg, ckpt: Checkpointer | None, fp: str, resume: bool, total: int, split: data.Split,
           batch_size: int, seed: int, step: Callable, end_epoch: Callable, desc: str, progress: bool,
           postfix: Callable | None = None, extra_meta: dict | None = None, history=None,
           place: Callable = lambda state: state):
    """Trains ``total`` epochs from the latest checkpoint (``resume``) or from the start; returns (state, history).

    An epoch is the shuffled full batches of ``split`` (``data.epoch_batches`` with ``seed``); ``step(state, epoch, i,
    batch) -> (state, metrics)``; ``end_epoch(state, epoch, metrics) -> dict`` is the epoch's history row (appended
    to ``history``, the previous stage's rows, when the stage starts afresh); ``postfix(state, metrics) -> dict`` is
    shown on the bar every 5 batches. The state must have a ``step`` counter. ``ckpt`` None: no checkpoints.
    ``extra_meta`` (JSON data) is stored with every checkpoint and must match on resume (e.g. the retrained
    architecture). ``place(state)`` puts the (restored) host state on the devices (e.g. ``train.replicate``).
    """
    extra = dict(extra_meta or {})
    state, meta = restore(ckpt, state, fp, resume, META_TYPES, extra)
    state = place(state)
    epoch, start, history = (0, 0, list(history or [])) if meta is None else (meta["epoch"], meta["batch"],
                                                                            meta["history"])
    nb = data.num_batches(split, batch_size)
    progress_bar = bar(total * nb, epoch * nb + start, desc, "step", progress)
    saves, metrics = EpochSaves(cfg), {}
    while epoch < total:
        batches = data.epoch_batches(split, batch_size, seed=seed, epoch=epoch, start=start)
        for i, batch in enumerate(batches, start=start):
            state, metrics = step(state, epoch, i, batch)
            progress_bar.update(1)
            saves.mid_epoch(ckpt, i + 1, nb, lambda: (int(state.step), state, {
                "epoch": epoch, "batch": i + 1, "history": history, "fingerprint": fp, **extra}))
            if progress and postfix is not None and i % 5 == 0:  # a device sync: only for a visible bar
                progress_bar.set_postfix(**postfix(state, metrics))
        history.append(end_epoch(state, epoch, metrics))
        epoch, start = epoch + 1, 0
        saves.save(ckpt, int(state.step), state, {"epoch": epoch, "batch": 0, "history": history, "fingerprint": fp,
                                                  **extra}, last_epoch=epoch == total)
    progress_bar.close()
    return state, history


def generations(state, *, ckpt: Checkpointer | None, fp: str, resume: bool, total: int, generation: Callable,
                carry: dict, desc: str, progress: bool, postfix: Callable | None = None, unit: str = "gen"):
    """Runs ``total`` generations from the latest checkpoint (``resume``) or from the start, one checkpoint after
    each; returns (state, carry).

    ``generation(state, g, carry) -> (state, carry)``; ``carry`` is JSON data (logs, the best so far) saved with the
    state and restored on resume. ``postfix(carry) -> dict`` is shown on the bar.
    """
    state, meta = restore(ckpt, state, fp, resume, {"generation": "count", "carry": dict})
    g, carry = (0, carry) if meta is None else (meta["generation"], meta["carry"])
    progress_bar = bar(total, g, desc, unit, progress)
    while g < total:
        state, carry = generation(state, g, carry)
        g += 1
        progress_bar.update(1)
        if postfix is not None:
            progress_bar.set_postfix(**postfix(carry))
        save(ckpt, g, state, {"generation": g, "carry": carry, "fingerprint": fp})
    progress_bar.close()
    return state, carry
