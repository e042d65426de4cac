"""The whole compact network of a run, in one process: what the pipeline's outputs are checked against.

``whole_network(run)`` reassembles the compact parameters and batch-norm statistics from ``RUN/parts/*.npz``
(every device's share) and returns ``f(images) -> logits`` through ``supernet.compact_apply`` in inference mode
(the training code's own forward pass, not the exported programs). ``test_images(run, n)`` are the first n images
of the run's dataset's test split, normalised as ``data.load`` does for the run's dataset and seed.
"""
from __future__ import annotations

import jax
import numpy as np

from jmsnas import data, supernet
from jmsnas.run import directory
from jmsnas.deploy.export import load_run
from jmsnas.deploy.runtime import DeployError
from jmsnas.space import op_index


def compact_params(run: str) -> tuple:
    """(space, ops, params, state) of the run's compact network, from its parts (``run.directory``)."""
    space, pm, _ = load_run(run)
    ops = [None] * space.num_layers
    for entry in pm["devices"].values():
        for n, op in zip(entry["layers"], entry["ops"]):
            ops[int(n)] = op_index(op)
    if any(o is None for o in ops):
        raise DeployError(f"{run}/parts/manifest.json leaves layers {[n for n, o in enumerate(ops) if o is None]} "
                          "on no device")
    try:
        params, state = directory.read_weights(run, pm, space.num_layers)
    except directory.RunDirError as e:
        raise DeployError(str(e)) from None
    return space, tuple(ops), params, state


def whole_network(run: str):
    """f(images float32[B, H, W, C]) -> logits float32[B, classes] of the run's compact network."""
    space, ops, params, state = compact_params(run)
    fn = jax.jit(lambda x: supernet.compact_apply(space, ops, params, state, x, train=False)[0])
    return lambda x: np.asarray(fn(np.asarray(x, np.float32)))


def test_images(run: str, n: int) -> tuple:
    """(images float32[n, H, W, C], labels int32[n]) from the run's dataset's test split."""
    _, _, result = load_run(run)
    ds = data.load(result.get("dataset", "digits"), seed=int(result.get("seed", 0)))
    if not 0 < n <= len(ds.test.images):
        raise DeployError(f"images must be between 1 and the {len(ds.test.images)} test images of "
                          f"{ds.name!r}, got {n}")
    return ds.test.images[:n], ds.test.labels[:n]
