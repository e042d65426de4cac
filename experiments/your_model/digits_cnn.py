"""A small flax CNN with batch norm and a residual block, trained on the digits: the example "your own model".

    python experiments/your_model/digits_cnn.py [OUT_DIR] [--steps 400]

trains it (Adam, batch 64, seed 0; about a minute on one CPU core) on the digits' train split (``jmsnas.data``,
normalised) and writes ``OUT_DIR/params.npz`` (its variables, "params/..." and "batch_stats/..." keys) and
``OUT_DIR/eval.npz`` (``images``, ``labels``: the digits' validation then test split, 499 images), default
OUT_DIR ``runs/your_model``. ``digits_cnn.py:trained`` is then the model reference of the trained network
(``$DIGITS_CNN_PARAMS`` overrides where its parameters are read from):

    jmsnas autosplit --model experiments/your_model/digits_cnn.py:trained --data runs/your_model/eval.npz \\
        --topology autosplit --memory-mb 0.05 --max-accuracy-drop 0.01
"""
from __future__ import annotations

import argparse
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmsnas.traced import ref

INPUT_SHAPE = (8, 8, 1)


class DigitsCNN(nn.Module):
    """conv 3x3/32 -> conv 3x3/64 stride 2 -> residual block of two 3x3/64 convs -> mean -> dense 10."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        bn = lambda name: nn.BatchNorm(use_running_average=not train, momentum=0.9, name=name)
        x = nn.relu(bn("bn1")(nn.Conv(32, (3, 3), use_bias=False, name="conv1")(x)))
        x = nn.relu(bn("bn2")(nn.Conv(64, (3, 3), (2, 2), use_bias=False, name="conv2")(x)))
        h = nn.relu(bn("bn3")(nn.Conv(64, (3, 3), use_bias=False, name="res_a")(x)))
        h = bn("bn4")(nn.Conv(64, (3, 3), use_bias=False, name="res_b")(h))
        x = nn.relu(x + h)
        return nn.Dense(10, name="fc")(jnp.mean(x, axis=(1, 2)))


def train(steps: int = 400, seed: int = 0, batch: int = 64):
    """(variables, dataset) after ``steps`` Adam steps on the digits' train split."""
    from jmsnas import data
    ds = data.load("digits", seed=seed)
    model = DigitsCNN()
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1,) + INPUT_SHAPE))  # eager flax is slow
    opt = optax.adam(3e-3)
    state = opt.init(variables["params"])

    @jax.jit
    def step(params, stats, state, x, y):
        def loss(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd["batch_stats"]
        (_, stats), g = jax.value_and_grad(loss, has_aux=True)(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), stats, state

    params, stats = variables["params"], variables["batch_stats"]
    rng = np.random.default_rng(seed)
    x, y = ds.train.images, ds.train.labels
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        params, stats, state = step(params, stats, state, x[idx], y[idx])
    return {"params": params, "batch_stats": stats}, ds


def trained() -> ref.UserModel:
    """The trained network (``$DIGITS_CNN_PARAMS``, default runs/your_model/params.npz)."""
    path = os.environ.get("DIGITS_CNN_PARAMS", os.path.join("runs", "your_model", "params.npz"))
    return ref.from_linen(DigitsCNN(), ref.load_params(path), INPUT_SHAPE, name="digits_cnn")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.path.join("runs", "your_model"))
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args(argv)
    variables, ds = train(args.steps)
    os.makedirs(args.out, exist_ok=True)
    ref.save_params(variables, os.path.join(args.out, "params.npz"))
    images = np.concatenate([ds.val.images, ds.test.images])
    labels = np.concatenate([ds.val.labels, ds.test.labels])
    np.savez(os.path.join(args.out, "eval.npz"), images=images, labels=labels)
    logits = jax.jit(DigitsCNN().apply)(variables, ds.test.images)
    print(f"test accuracy {float(np.mean(np.argmax(logits, -1) == ds.test.labels)):.4f}; wrote {args.out}")


if __name__ == "__main__":
    main()
