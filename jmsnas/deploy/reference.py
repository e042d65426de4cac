"""The whole compact network of a run, in one process: what the pipeline's outputs are checked against.

``whole_network(run)`` reads the compact network (``run.directory.read_compact``: the space and architecture
from result.json, the parameters and batch-norm statistics from every device's ``RUN/parts/*.npz``) and returns
``f(images) -> logits`` through ``supernet.compact_apply`` in inference mode (the training code's own forward pass,
not the exported programs). ``test_images(run, n)`` are the first n images of the run's dataset's test split,
normalised as ``data.load`` does for the run's dataset and seed.
"""
from __future__ import annotations

import jax
import numpy as np

from jmsnas import data, supernet
from jmsnas.run import directory
from jmsnas.deploy.export import load_run
from jmsnas.deploy.runtime import DeployError


def whole_network(run: str):
    """f(images float32[B, H, W, C]) -> logits float32[B, classes] of the run's compact network."""
    try:
        space, ops, params, state = directory.read_compact(run)
    except directory.RunDirError as e:
        raise DeployError(str(e)) from None
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
