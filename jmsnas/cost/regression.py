"""A latency estimator U(.) fitted from any table of layer features -> measured ms (JMSNAS section V-A).

The model is linear in a few *terms*, each a product of named layer features (``"1"`` is the constant
per-layer cost)::

    ms ~ c0 + c1 * macs + c2 * dw_macs + c3 * act_bytes + c4 * params        (DEFAULT_TERMS)

so every coefficient has a unit (ms per MAC, ms per byte) and a layer's estimate is the sum of a fixed cost,
compute (depthwise MACs cost extra), activation traffic and weight traffic. Splitting memory traffic into
activations and weights matters on ProxylessNAS's mobile table: with one ``mem_bytes`` term the held-out median
error is about 16%, with the split about 6% (10 random 25% hold-outs; OFA Note10 tables: about 4%).

Coefficients are fitted by non-negative least squares (scipy, a dependency of jax and scikit-learn) on the
*relative* error (each row divided by its measured ms), the error measure latency predictors are judged by; a
held-out part of the table is kept aside and the report gives the error on it. The model is a NamedTuple of plain numbers and
strings: ``model_to_json``/``model_from_json`` store it without pickle.

Features come from a lookup-table key (``features_from_key``) or from a jmsnas layer slot and candidate op
(``features_from_slot``, built on ``jmsnas.space.op_flops``/``op_memory_bytes``), with the same definitions, so a
table measured for either kind of layer fits the same model.
"""
from __future__ import annotations

import json
import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np
from scipy.optimize import nnls

from jmsnas.cost.lut import LayerKey, NetLatency, parse_key
from jmsnas.space import LayerSlot, OpSpec, op_flops, op_memory_bytes, op_params


class LayerFeatures(NamedTuple):
    """What a layer does, per image (batch 1).

    Attributes:
      macs: multiply-accumulates of all its convolutions / FC layers.
      dw_macs: the depthwise-convolution part of ``macs``.
      mem_bytes: fp32 bytes moved: activations read and written (intermediate maps written and read back, as in
        ``jmsnas.space.op_memory_bytes``) plus weights.
      act_bytes: the activation part of ``mem_bytes``.
      params: parameters.
      kernel, stride: of the (depthwise) convolution; 1 for pooling/FC.
      expand: middle channels / input channels (1 without an expansion convolution).
      in_hw, out_hw, in_ch, out_ch: spatial size and channels in and out.
      se, hs, skip: squeeze-and-excitation, h-swish activation, identity shortcut (0/1).
    """

    macs: float
    dw_macs: float
    mem_bytes: float
    act_bytes: float
    params: float
    kernel: float = 1
    stride: float = 1
    expand: float = 1
    in_hw: float = 1
    out_hw: float = 1
    in_ch: float = 1
    out_ch: float = 1
    se: float = 0
    hs: float = 0
    skip: float = 0


FEATURES = LayerFeatures._fields
DEFAULT_TERMS = ("1", "macs", "dw_macs", "act_bytes", "params")


class LatencyModel(NamedTuple):
    """ms = sum_k coef[k] * prod(features in terms[k]); ``coef`` in ms per unit of its term."""

    terms: tuple
    coef: tuple


class FitReport(NamedTuple):
    """Relative errors |pred - ms| / ms of a fit: on the held-out rows (the honest figure) and on the training rows."""

    n_train: int
    n_holdout: int
    holdout_median_rel_error: float
    holdout_within_10pct: float
    holdout_max_rel_error: float
    train_median_rel_error: float
    holdout_index: tuple


# ----------------------------------------------------------------------------------------------- features


def _mbconv(hin, hout, cin, cout, mid, k, se_ch, skip, hs, stride) -> LayerFeatures:
    has_expand = mid != cin
    expand = hin * hin * cin * mid if has_expand else 0
    dw = hout * hout * mid * k * k
    project = hout * hout * mid * cout
    se_macs = 2 * mid * se_ch
    params = (cin * mid + 2 * mid if has_expand else 0) + mid * k * k + 2 * mid + mid * cout + 2 * cout
    params += 2 * mid * se_ch + se_ch + mid if se_ch else 0
    acts = hin * hin * cin + (2 * hin * hin * mid if has_expand else 0) + 2 * hout * hout * mid + hout * hout * cout
    return LayerFeatures(expand + dw + project + se_macs, dw, 4.0 * (acts + params), 4.0 * acts, params, k,
                         stride, mid / cin, hin, hout, cin, cout, float(se_ch > 0), hs, skip)


def features_from_key(key: LayerKey, flavor: str) -> LayerFeatures:
    """Features of a lookup-table layer; ``flavor`` "proxyless" (expand = ratio) or "ofa" (expand = channels)."""
    if flavor not in ("proxyless", "ofa"):
        raise ValueError(f"flavor must be 'proxyless' or 'ofa', got {flavor!r}")
    hin, cin = key.input[0], key.input[-1]
    hout, cout = (key.output[0], key.output[-1]) if len(key.output) == 3 else (1, key.output[0])
    if key.kind == "expanded_conv":
        mid = key.expand * cin if flavor == "proxyless" else key.expand
        se_ch = max(1, mid // 4) if key.se else 0
        return _mbconv(hin, hout, cin, cout, mid, key.kernel, se_ch, key.idskip, key.hs or 0, key.stride)
    if key.kind == "AvgPool2D":
        acts = 4.0 * (hin * hin * cin + cout)
        return LayerFeatures(0, 0, acts, acts, 0, in_hw=hin, in_ch=cin, out_ch=cout)
    k = 3 if key.kind == "Conv" else 1
    stride = max(1, round(hin / hout)) if key.kind == "Conv" else 1
    macs = hout * hout * cout * cin * k * k if key.kind != "Logits" else cin * cout
    params = cin * cout * k * k + 2 * cout if key.kind != "Logits" else cin * cout + cout
    acts = hin * hin * cin + hout * hout * cout
    return LayerFeatures(macs, 0, 4.0 * (acts + params), 4.0 * acts, params, k, stride, 1, hin, hout, cin, cout)


def features_from_slot(op: OpSpec, slot: LayerSlot) -> LayerFeatures:
    """Features of candidate ``op`` at jmsnas layer ``slot`` (identity: all-zero work, the model's constant only)."""
    if op.is_identity:
        return LayerFeatures(0, 0, 0, 0, 0, 0, slot.stride, 0, slot.in_hw, slot.out_hw, slot.in_ch, slot.out_ch)
    mid = slot.in_ch * op.expand
    params = op_params(op, slot)
    mem = op_memory_bytes(op, slot)
    return LayerFeatures(op_flops(op, slot) / 2.0, slot.out_hw ** 2 * mid * op.kernel ** 2, mem, mem - 4.0 * params,
                         params, op.kernel, slot.stride, op.expand, slot.in_hw, slot.out_hw, slot.in_ch, slot.out_ch,
                         0, 0, int(op.residual))


def feature_matrix(features: Sequence[LayerFeatures]) -> dict:
    """Column view {feature name: float64[N]} of a list of LayerFeatures."""
    if len(features) == 0:
        raise ValueError("no layers given")
    arr = np.asarray([tuple(f) for f in features], dtype=np.float64).reshape(len(features), len(FEATURES))
    return {name: arr[:, i] for i, name in enumerate(FEATURES)}


def design(features, terms: Sequence[str]) -> np.ndarray:
    """float64[N, K]: each term (a product of feature names joined by '*', or "1") evaluated on every layer."""
    cols = features if isinstance(features, Mapping) else feature_matrix(features)
    n = len(next(iter(cols.values())))
    out = np.empty((n, len(terms)))
    for j, term in enumerate(terms):
        out[:, j] = 1.0
        if term == "1":
            continue
        for name in term.split("*"):
            if name not in cols:
                raise ValueError(f"term {term!r} uses unknown feature {name!r}; features are {list(FEATURES)}")
            out[:, j] *= cols[name]
    return out


# ------------------------------------------------------------------------------------------ fit / predict


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of the relative residual (x c - y) / y, with column scaling for conditioning."""
    a = x / y[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, np.ones_like(y))
    return coef / scale


def _rel_errors(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.abs(pred - y) / y


def fit(features: Sequence[LayerFeatures], ms: Sequence[float], holdout_fraction: float = 0.2, seed: int = 0,
        terms: Sequence[str] = DEFAULT_TERMS) -> tuple:
    """Fits U(.) on a random (1 - holdout_fraction) of the rows and reports the error on the rest.

    Args:
      features: N LayerFeatures.
      ms: float[N] measured latencies in ms (> 0).
      holdout_fraction: share of rows kept out of the fit, in [0, 1); 0 fits on every row (no held-out figure).
      seed: seed of the numpy generator that picks the held-out rows.
      terms: model terms (see ``design``).
    Returns:
      (LatencyModel fitted on the training rows, FitReport).
    """
    y = np.asarray(ms, dtype=np.float64).reshape(-1)
    if len(features) != len(y):
        raise ValueError(f"{len(features)} feature rows but {len(y)} latencies")
    bad = [i for i, v in enumerate(y) if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"latencies must be finite and > 0 ms; rows {bad[:10]} are {y[bad[:10]].tolist()}")
    if not (0.0 <= holdout_fraction < 1.0):
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction!r}")
    terms = tuple(terms)
    x = design(features, terms)
    n_hold = int(round(holdout_fraction * len(y)))
    if len(y) - n_hold < len(terms):
        raise ValueError(f"{len(y) - n_hold} training rows cannot fit {len(terms)} terms {list(terms)}")
    perm = np.random.default_rng(seed).permutation(len(y))
    hold, train = np.sort(perm[:n_hold]), np.sort(perm[n_hold:])
    coef = _solve(x[train], y[train])
    model = LatencyModel(terms, tuple(float(c) for c in coef))
    train_err = _rel_errors(x[train] @ coef, y[train])
    hold_err = _rel_errors(x[hold] @ coef, y[hold]) if n_hold else np.full(1, np.nan)
    report = FitReport(len(train), n_hold, float(np.median(hold_err)), float(np.mean(hold_err <= 0.1)),
                       float(np.max(hold_err)), float(np.median(train_err)), tuple(int(i) for i in hold))
    return model, report


def predict(model: LatencyModel, features) -> np.ndarray:
    """float64[N] estimated ms of N layers (a list of LayerFeatures or a feature_matrix dict)."""
    return design(features, model.terms) @ np.asarray(model.coef, dtype=np.float64)


def model_to_json(model: LatencyModel) -> str:
    return json.dumps({"terms": list(model.terms), "coef": list(model.coef), "unit": "ms"})


def model_from_json(text: str) -> LatencyModel:
    """Reads ``model_to_json`` output; raises ValueError for a malformed model."""
    try:
        d = json.loads(text)
        terms, coef = tuple(d["terms"]), tuple(float(c) for c in d["coef"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a latency model JSON ({e})") from None
    if len(terms) != len(coef) or not all(isinstance(t, str) for t in terms):
        raise ValueError(f"latency model has {len(terms)} terms {list(terms)} but {len(coef)} coefficients")
    design({f: np.zeros(1) for f in FEATURES}, terms)  # validates the feature names
    return LatencyModel(terms, coef)


def fit_lut(lut, holdout_fraction: float = 0.2, seed: int = 0, terms: Sequence[str] = DEFAULT_TERMS) -> tuple:
    """``fit`` on every entry of a ``jmsnas.cost.lut.LatencyLUT``; the report's holdout_index indexes lut.entries."""
    keys = list(lut.entries)
    feats = [features_from_key(lut.keys[k], lut.flavor) for k in keys]
    return fit(feats, [lut.entries[k] for k in keys], holdout_fraction, seed, terms)


def network_latency_with_model(lut, layers: Sequence, model: LatencyModel) -> tuple:
    """Like ``lut.network_latency`` but layers whose key the table lacks are estimated by ``model``.

    Returns (NetLatency, names of the estimated layers) so the caller can always tell measured from estimated.
    """
    per_layer, estimated = {}, []
    for name, key in layers:
        if key in lut.entries:
            per_layer[name] = lut.entries[key]
        else:
            per_layer[name] = float(predict(model, [features_from_key(parse_key(key), lut.flavor)])[0])
            estimated.append(name)
    return NetLatency(float(sum(per_layer.values())), per_layer, dict(layers)), tuple(estimated)
