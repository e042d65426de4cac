"""On-device personalisation (paper 002, section 4.2.3): train only the last child's parameters on new data.

The parameters of all children form one pytree ``{"frozen": [child 0 .. k-2], "last": child k-1}``; the optimiser
is ``optax.multi_transform`` with Adam on "last" and ``set_to_zero`` on "frozen" (which also labels the last child's
batch-norm statistics), and the frozen children sit behind ``stop_gradient`` so their gradients are never computed.
Only trainable leaves are updated (frozen arrays are passed through untouched, which keeps them bitwise equal,
-0.0 included), and only the last child is written back: a new directory ``child_XX.ft<n>``, then the manifest is
replaced atomically to point at it (with its new sha256), then the old directory is removed. A crash at any point
leaves a loadable directory.

Batch norm runs in inference mode (the stored statistics are kept): fine-tuning a few layers on a small new data
set with frozen statistics is the usual transfer-learning recipe.
"""
from __future__ import annotations

import os
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmsnas.modular import store
from jmsnas.modular.blocks import ModularError


class FinetuneResult(NamedTuple):
    losses: list  # per step, cross-entropy on the batch
    accuracy_before: float  # on (x, y), fraction
    accuracy_after: float
    directory: str  # the last child's new directory


def _logits_fn(manifest: dict):
    def logits(frozen, last, x):
        for c, tree in zip(manifest["children"], [jax.lax.stop_gradient(t) for t in frozen] + [last]):
            x = store.run_child(manifest, c, tree, x)
        return x

    return logits


def train_last(manifest: dict, children: list, x, y, *, steps: int = 20, lr: float = 1e-3, batch: int = 64,
               seed: int = 0) -> tuple:
    """(new last child tree, losses, accuracy before, accuracy after) after ``steps`` Adam steps on the last child
    only; ``x`` float32[B, ...], ``y`` int[B] class labels."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ModularError(f"fine-tuning steps must be an integer >= 1, got {steps!r}")
    x, y = np.asarray(x, np.float32), np.asarray(y)
    if x.shape[0] != y.shape[0] or x.shape[0] < 1:
        raise ModularError(f"fine-tuning data: {x.shape[0]} inputs and {y.shape[0]} labels; need the same number >= 1")
    logits = _logits_fn(manifest)
    params = {"frozen": [dict(t) for t in children[:-1]], "last": dict(children[-1])}
    params["last"].pop("range", None)
    # batch-norm statistics ("state" subtrees of jmsnas blocks) are not trained: Adam could make a variance negative
    is_stat = lambda path: any(getattr(k, "key", None) == "state" for k in path)
    labels = {"frozen": jax.tree_util.tree_map(lambda _: "frozen", params["frozen"]),
              "last": jax.tree_util.tree_map_with_path(lambda p, _: "frozen" if is_stat(p) else "last",
                                                       params["last"])}
    tx = optax.multi_transform({"last": optax.adam(lr), "frozen": optax.set_to_zero()}, labels)
    opt = tx.init(params)

    def loss_fn(last, frozen, xb, yb):
        out = logits(frozen, last, xb)
        return optax.softmax_cross_entropy_with_integer_labels(out, yb).mean()

    @jax.jit
    def step(params, opt, xb, yb):
        loss, g_last = jax.value_and_grad(loss_fn)(params["last"], params["frozen"], xb, yb)
        grads = {"frozen": jax.tree_util.tree_map(jnp.zeros_like, params["frozen"]), "last": g_last}
        updates, opt = tx.update(grads, opt, params)
        # only trainable leaves are touched: frozen arrays stay the very same values (bitwise, -0.0 included)
        last = jax.tree_util.tree_map(lambda lab, p, u: p if lab == "frozen" else p + u.astype(p.dtype),
                                      labels["last"], params["last"], updates["last"])
        return {"frozen": params["frozen"], "last": last}, opt, loss

    acc = lambda p: float(np.mean(np.argmax(np.asarray(logits(p["frozen"], p["last"], x)), -1) == y))
    before = acc(params)
    rng = np.random.default_rng(seed)
    losses = []
    frozen_in = params["frozen"]
    for _ in range(steps):
        idx = rng.choice(x.shape[0], size=min(batch, x.shape[0]), replace=False)
        params, opt, loss = step(params, opt, x[idx], y[idx])
        losses.append(float(loss))
    params["frozen"] = frozen_in  # the caller's arrays, not device copies
    last = {k: jax.tree_util.tree_map(np.asarray, v) for k, v in params["last"].items()}
    last["range"] = np.asarray(children[-1]["range"])
    return last, losses, before, acc(params)


def save_last(directory: str, manifest: dict, last_tree: dict) -> str:
    """Write the new last child beside the old one, point the manifest at it, remove the old one."""
    c = manifest["children"][-1]
    base = c["dir"].split(".ft")[0]
    n = int(c["dir"].split(".ft")[1]) + 1 if ".ft" in c["dir"] else 1
    new_dir = f"{base}.ft{n}"
    old = os.path.join(directory, c["dir"])
    a, b = c["blocks"]
    try:  # the manifest names the new child only once it is whole; a failed write leaves the old state
        store.write_child(os.path.join(directory, new_dir), last_tree,
                          {"network": manifest["fingerprint"], "child": c["index"], "blocks": [a, b]})
        m = dict(manifest)
        m["children"] = manifest["children"][:-1] + [dict(c, dir=new_dir, sha256=store.tree_sha256(last_tree))]
        m["finetuned"] = int(manifest.get("finetuned", 0)) + 1
        store.write_manifest(directory, m)
    except BaseException:
        shutil.rmtree(os.path.join(directory, new_dir), ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return new_dir


def finetune(directory: str, x, y, *, steps: int = 20, lr: float = 1e-3, batch: int = 64, seed: int = 0,
             parallel: int | None = None) -> FinetuneResult:
    """Load the children of ``directory``, train the last one on (x, y), save it back alone."""
    res = store.load(directory, parallel=parallel)
    last, losses, before, after = train_last(res.manifest, res.children, x, y, steps=steps, lr=lr, batch=batch,
                                             seed=seed)
    new_dir = save_last(directory, res.manifest, last)
    return FinetuneResult(losses, before, after, new_dir)
