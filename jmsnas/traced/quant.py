"""Auto-Split on your own model: distortion tables and measured accuracy on the traced graph (paper 001).

Per layer k of the traced graph (``trace.Traced``): its kernels (the anchor's parameter leaves of 2+ dimensions)
are fake-quantized per output channel at w_k bits, its outputs at a_k bits over the range [min, max] calibrated on
the first ``CALIBRATION`` validation images (``quantizers``); biases and batch norm stay float (they are counted at
the layer's weight bits in the edge memory, as the run path counts folded biases). D^w_k(b) is the MSE of the
layer's kernels (their element-weighted mean when there are several; 0 without one), D^a_k(b) the MSE of its
calibrated outputs. A candidate's accuracy drop is measured on the validation half of the data
(``evaldata.split``; ``select_on="test"`` checks it on the test half) with the edge layers quantized and the
cloud's in float.
"""
from __future__ import annotations

import numpy as np

import jax.numpy as jnp

from jmsnas.quant import solver
from jmsnas.quant.quantizers import act_distortion, weight_distortion
from jmsnas.traced import evaldata, run
from jmsnas.traced.trace import trace

BATCH = 256  # every evaluation batch is padded to this size: one compilation
CALIBRATION = 256


def _padded(x):
    x = np.asarray(x, np.float32)
    if len(x) == BATCH:
        return jnp.asarray(x)
    return jnp.asarray(np.concatenate([x, np.zeros((BATCH - len(x),) + x.shape[1:], np.float32)]))


def calibrate(t, leaves, images):
    """(ranges float32[N, 2], outputs: list over layers of float32[n, elements]) on the first CALIBRATION images."""
    import jax
    x = np.asarray(images[:CALIBRATION], np.float32)
    outs = jax.jit(run.layer_outputs(t))(leaves, _padded(x))
    outs = [np.asarray(o)[: len(x)] for o in outs]
    return np.array([[o.min(), o.max()] for o in outs], np.float32), outs


def distortion_tables(t, leaves, ranges, outputs, bits):
    """(D^w float[N, K], D^a float[N, K]) as the module docstring says."""
    n = len(t.net.layers)
    dw = np.zeros((n, len(bits)))
    ks = [(k, l) for k in range(n) for l in t.kernels[k]]
    if ks:
        tab = weight_distortion([np.asarray(leaves[l], np.float32) for _, l in ks], bits)
        sizes = np.array([np.asarray(leaves[l]).size for _, l in ks], float)
        for k in range(n):
            rows = [i for i, (kk, _) in enumerate(ks) if kk == k]
            if rows:
                dw[k] = (tab[rows] * sizes[rows, None]).sum(0) / sizes[rows].sum()
    return dw, act_distortion([o.reshape(-1) for o in outputs], ranges, bits)


def accuracy(fq, leaves, split, wbits, abits, ranges) -> float:
    """Top-1 accuracy in [0, 1] on a ``data.Split`` with the given bits (``run.quant_forward``'s function)."""
    args = (jnp.asarray(wbits, jnp.int32), jnp.asarray(abits, jnp.int32), jnp.asarray(ranges, jnp.float32))
    correct = 0
    for s in range(0, len(split.images), BATCH):
        x = split.images[s:s + BATCH]
        y = np.asarray(fq(leaves, _padded(x), *args))[: len(x)]
        correct += int(np.sum(np.argmax(y.reshape(len(x), -1), -1) == split.labels[s:s + BATCH]))
    return correct / max(1, len(split.images))


def prepare(model, topo, memory_bytes: float, bits, select_on: str, data, data_dir=None, check_fits=None):
    """(problem, drop function, context) for Auto-Split on a model reference with evaluation data."""
    if data is None:
        raise evaldata.EvalDataError("--data is required with a model reference: FILE.npz (images, labels) or "
                                     "tfds:NAME, the data its accuracy is measured on")
    t = trace(model)
    images, labels = evaldata.load(data, t.model.input_shape, data_dir)
    evaldata.check_classes(labels, t.output_shape, data)
    net = t.net
    if check_fits is not None:
        check_fits(net, [l.params for l in net.layers], memory_bytes, bits)
    val, test = evaldata.split(images, labels)
    leaves = run.leaves_dict(t)
    ranges, outs = calibrate(t, leaves, val.images)
    dw, da = distortion_tables(t, leaves, ranges, outs, bits)
    prob = solver.make_problem(net, topo, memory_bytes, bits, dw, da, w_elems=[l.params for l in net.layers],
                               input_bits=8)
    fq = run.quant_forward(t)
    n = len(net.layers)
    acc = lambda split, s: accuracy(fq, leaves, split, *s.bit_arrays(n), ranges)
    fb = run.float_bits(t)
    ref = {"val": accuracy(fq, leaves, val, *fb), "test": accuracy(fq, leaves, test, *fb)}
    chosen = val if select_on == "val" else test
    cache = {}

    def drop(s):
        if s.key() not in cache:
            cache[s.key()] = ref[select_on] - acc(chosen, s) if s.split else 0.0
        return cache[s.key()]

    ctx = {"kind": "traced", "name": net.name, "traced": t, "ranges": ranges, "acc": acc,
           "eval": {"val": val, "test": test}, "float_accuracy": ref,
           "data": {"source": data, "val_examples": len(val.images), "test_examples": len(test.images)}}
    return prob, drop, ctx
