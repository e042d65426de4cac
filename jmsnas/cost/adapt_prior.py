"""A new device's table from a few measured networks and a library of devices already measured (the prior).

Model (the argument for it: docs/device_tables.md). With library tables L_1..L_J (``library.check``) and K networks
(a_k, y_k) measured on the target:

1. Combination. m = sum_j w_j L_j, w >= 0, fitted by non-negative least squares on relative errors
   (min sum_k ((sum_j w_j L_j(a_k) - y_k) / y_k)^2). A combination of tables is a table: c_m = sum w_j c_j,
   m[l, o] = sum w_j L_j[l, o], never negative.
1b. Structure. The basis holds, beside the library's tables, tables built from the space alone (``STRUCTURES``,
   ``structural_tables``): ``kernels``, the number of kernels a layer launches: 3 for a block (1 x 1 expansion,
   depthwise, 1 x 1 projection), 4 for a grouped block (its channel shuffle is one more), 1 for a skip where the
   layer changes the shape (a 1 x 1 convolution), 0 for an identity. Its weight is a cost per kernel launched
   whatever its arithmetic: the launch cost that dominates a GPU on small inputs (titan_rtx_32, batch 32: ~0.45 ms
   per block, ~0.54 per grouped block, ~0.21 per shape-changing skip, whatever the block's arithmetic), which no
   CPU or phone of the library shows. NNLS gives it weight 0 where it does not help.
2. Per-type corrections shrunk toward the combination: T(a) = theta_0 c_m + sum_l theta_g(l, a_l) m[l, a_l],
   theta >= 0, fitted as ``adapt.fit_features`` does (relative least squares + lam sum (theta - s)^2, s the single
   factor that best rescales m); the cell groups g are the block types of ``adapt.op_groups`` (expand,
   kernel_expand, op) and, when the layers' stages are known, stage and stage x expansion.
3. Choice by leave-one-out over the measured networks, the whole procedure (the combination weights too) refitted
   on the other K - 1 each time: the candidates are the combination alone and every (grouping, lam). The table
   is the average of every candidate within one standard error of the lowest leave-one-out MAPE (the lowest of ~25
   scores on 10 networks is optimistic, and picking it alone chose a too flexible model on noisy devices; an
   average of tables is a table, and its leave-one-out errors are the average of theirs).
4. Fallback. The best candidate is used only when its leave-one-out errors are below those of the one-factor
   rescale of the base table by more than one standard error of the paired difference; otherwise the result is
   the one-factor rescale (the data cannot tell that the library helps), and ``adaptation["fallback"]`` says so.
5. Outliers. A network whose relative error under the combination fitted on all K is above 15% and 5 robust
   standard deviations (1.4826 MAD) from the median is left out (at most K // 5 of them; ``dropped``).
6. Interval (split-conformal, per network). The relative half-width at a network a is h(a) = z u(a), with u(a)^2
   the sum of the variances of two independent errors:
   - the fit's own uncertainty at a: the jackknife variance of the prediction over the K leave-one-out tables of
     step 3 (stored in the table: ``interval["jackknife"]``), relative to p(a). It is small where a looks like the
     measured networks and large where the model extrapolates (HELP's reference networks are chosen to be
     diverse, so their leave-one-out errors overstate the error on typical networks: a constant scale from them
     was twice too wide on four of HELP's six devices);
   - the device's noise: what no additive table removes on it, a variance estimated from the K measured networks
     with a prior from the library (``_noise``): (K r^2 + nu f^2) / (K + nu), the posterior mean of a variance
     under a conjugate prior worth ``NOISE_PRIOR_NETWORKS`` (nu = 2) networks at f^2, where
     - r is the device's residual: the RMS relative error of the table on every measured network, the dropped
       outliers counted at ``OUTLIER_REL`` (15%) — a device whose measurements hold an outlier is noisy, and a
       90% interval must say so even though the fit left it out;
     - f is the floor: the mean over the library's tables of their own held-out RMS error
       (``validation["rms_error_pct"]``): a typical device's. It keeps a device whose 10 networks the model fits
       almost exactly from getting an interval of nothing but the jackknife.
     The two estimate one variance, so they are pooled, not added: added, the floor widened the quietest
     device's interval (silver_4210r: 97.0% held on its networks 0-3999). nu was chosen on the targets' networks
     0-3999 (not the test set): the held shares there were 85.5-93.4% at nu = 0, 89.7-92.0% at 2, 89.0-94.0% at 5,
     88.1-95.6% at 10, 86.7-97.4% at 20.
   z: the 90% quantile of the pooled scores |y - p| / p / u(a) of the library's devices, each adapted by this
   procedure from the *other* library devices (the library's model, also on a draw where step 4 used the rescale:
   it is that model's interval being calibrated) and scored on its own held-out networks
   (``library.interval_factor``; the curves stored in the library tables, ``learning_curve``). When the target is
   itself a device the library's curves were built with (leave-one-device-out), only the curves built with the
   target left out are read (``learning_curve_without``): nothing of the target but its samples is in its prior.
   When the measured networks are exactly the ones a curve's ``reference`` block was calibrated on (HELP's 10
   reference networks), that block is used; else the random-draw scores at K networks. Without curves: Student's
   t_{0.95, K-1}. The fallback's interval is constant: Student's t times the RMS of the rescale's own leave-one-out
   errors. The 90% interval of a network predicted p ms is [p (1 - h(a)), p (1 + h(a))] (``interval_ms``).

Everything is a function of the sorted library and the measured networks: permuting the library changes nothing.
"""
from __future__ import annotations

import math
import re

import numpy as np
from scipy import stats
from scipy.optimize import nnls

from jmsnas.cost import adapt as AD
from jmsnas.cost import layertable as LT
from jmsnas.cost import library as LB
from jmsnas.cost import networks as NW

GROUPINGS = ("expand", "kernel_expand", "op", "stage", "stage_expand")
STRUCTURES = ("kernels",)
LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
COMBINATION = "combination"
LEVEL = 0.9
OUTLIER_REL = 0.15  # a measured network this far off the combination may be an outlier (docstring, 5)
SCORE_LEVELS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.825, 0.85, 0.875, 0.9, 0.925, 0.95, 0.975, 0.99,
                1.0)


def cell_groups(op_names, num_layers: int, grouping: str, stages=None) -> np.ndarray:
    """int[N, R]: the group of every (layer, op) cell; None when the grouping needs stages that are not known."""
    if grouping in ("stage", "stage_expand"):
        if stages is None:
            return None
        st = np.asarray(stages, np.int64)[:, None]
        if grouping == "stage":
            g = np.broadcast_to(st, (num_layers, len(op_names)))
        else:
            g = st * (len(op_names) + 1) + AD.op_groups(op_names, "expand")[None]
    elif grouping == COMBINATION:
        g = np.zeros((num_layers, len(op_names)), np.int64)
    else:
        g = np.broadcast_to(AD.op_groups(op_names, grouping)[None], (num_layers, len(op_names)))
    return np.unique(np.asarray(g).ravel(), return_inverse=True)[1].reshape(num_layers, len(op_names))


def _reshaping(base: LT.LayerTable) -> np.ndarray:
    """bool[N]: the layers whose output shape differs from their input's (a skip there is a 1 x 1 convolution, it
    runs), from the registered space of the table; all False when the space is not registered or has no layers."""
    from jmsnas import spaces
    try:
        layers = getattr(spaces.get(base.space), "layers", None)
    except ValueError:
        layers = None
    if not layers or len(layers) != base.num_layers:
        return np.zeros(base.num_layers, bool)
    return np.array([(l.in_ch, l.in_hw, l.stride) != (l.out_ch, l.out_hw, 1) for l in layers], bool)


def _named(op_names, part: str) -> np.ndarray:
    """bool[R]: the ops whose name holds ``part`` (a regular expression) as one of its _-separated pieces: ``k\\d+``
    a block with a kernel size, ``g\\d+`` a grouped one."""
    return np.array([re.search(rf"(?:^|_){part}(?:_|$)", n) is not None for n in op_names], bool)


def block_ops(op_names) -> np.ndarray:
    """bool[R]: the ops that run a block (an op with a kernel size in its name, ``k3_e1``...); the others are skips."""
    return _named(op_names, r"k\d+")


def structural_tables(base: LT.LayerTable, structure: str) -> tuple:
    """The tables that describe a cost no library device need show (module docstring, 1b), built from the space
    alone (no device's data): ``kernels`` holds, for every (layer, op), the kernels the layer launches with that op:
    3 for a block (an op with a kernel size: 1 x 1 expansion, depthwise, 1 x 1 projection), one more for a grouped
    block's channel shuffle (``_g<n>`` in its name), 1 for a skip where the layer changes the shape (a 1 x 1
    convolution), 0 for an identity; ``none`` adds nothing."""
    if structure == "none":
        return ()
    if structure != "kernels":
        raise ValueError(f"structure must be one of {list(STRUCTURES) + ['none']}, got {structure!r}")
    block, grouped = block_ops(base.op_names), _named(base.op_names, r"g\d+")
    per_op = np.where(block, 3.0 + grouped, 0.0)[None, :]
    cells = np.where(block[None, :], per_op, np.where(_reshaping(base)[:, None], 1.0, 0.0))
    entry = np.where(base.valid, cells, np.nan)
    return (LT.make(0.0, entry, base.op_names, space=base.space, device="kernels (ms per kernel launched)",
                    source="jmsnas.cost.adapt_prior.structural_tables: the kernels each layer launches"),)


def _combine(lib_pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    """w >= 0 minimising sum_k ((lib_pred[k] . w - y_k) / y_k)^2."""
    return nnls(lib_pred / y[:, None], np.ones(len(y)))[0]


def _features(cells: np.ndarray, const: float, groups: np.ndarray, archs: np.ndarray) -> np.ndarray:
    """float64[K, 1 + G]: cells[k, l] = m[l, a_kl]; the fixed term, then per group the sum of its cells."""
    f = np.zeros((len(archs), 1 + int(groups.max()) + 1))
    f[:, 0] = const
    g = groups[np.arange(archs.shape[1])[None], archs]
    np.add.at(f, (np.repeat(np.arange(len(archs)), archs.shape[1]), 1 + g.ravel()), cells.ravel())
    return f


def _model_predict(w, lib, groups, lam, archs_fit, y_fit, archs_new):
    """Fit the combination and the corrections on (archs_fit, y_fit); predict archs_new (and return theta)."""
    m_const = sum(wi * t.const_ms for wi, t in zip(w, lib))
    m_entry = sum(wi * np.nan_to_num(t.entry_ms) for wi, t in zip(w, lib))
    rows = np.arange(archs_fit.shape[1])[None]
    f = _features(m_entry[rows, archs_fit], m_const, groups, archs_fit)
    if groups.max() == 0 and math.isinf(lam):
        theta = np.ones(f.shape[1])
    else:
        theta, _ = AD.fit_features(f, y_fit, lam)
    fn = _features(m_entry[rows, archs_new], m_const, groups, archs_new)
    return fn @ theta, theta, m_const, m_entry


def _loo(lib_pred, lib, groups, lam, archs, y) -> np.ndarray:
    """Signed relative leave-one-out errors of the whole procedure (combination refitted in every fold)."""
    out = np.empty(len(y))
    for k in range(len(y)):
        keep = np.arange(len(y)) != k
        w = _combine(lib_pred[keep], y[keep])
        p, *_ = _model_predict(w, lib, groups, lam, archs[keep], y[keep], archs[k:k + 1])
        out[k] = (p[0] - y[k]) / y[k]
    return out


def _drop_outliers(lib_pred, y) -> np.ndarray:
    """bool[K]: networks kept (module docstring, 5)."""
    keep = np.ones(len(y), bool)
    if len(y) < 5:
        return keep
    r = (lib_pred @ _combine(lib_pred, y) - y) / y
    mad = 1.4826 * np.median(np.abs(r - np.median(r)))
    bad = np.flatnonzero((np.abs(r) > OUTLIER_REL) & (np.abs(r - np.median(r)) > 5 * max(mad, 1e-12)))
    bad = bad[np.argsort(-np.abs(r[bad]))][: len(y) // 5]
    keep[bad] = False
    return keep


def _within_one_standard_error(scores) -> list:
    """The candidates whose leave-one-out MAPE is within one standard error of the lowest (module docstring, 3)."""
    if not scores:
        return []
    low = min(scores, key=lambda c: c["loo_mape_pct"])
    e = np.abs(low["_r"])
    bar = low["loo_mape_pct"] + 100 * e.std(ddof=1) / math.sqrt(len(e))
    return [c for c in scores if c["loo_mape_pct"] <= bar + 1e-9]


def _score(base, bases, a, yk, stages, groupings, lambdas) -> tuple:
    """(one_loo, scores): the one-factor rescale's signed leave-one-out errors and every candidate's (None, [] below
    3 networks). ``bases``: {structure: (tables, their predictions of a)}; a candidate is (structure, grouping,
    lam)."""
    if len(yk) < 3:
        return None, []
    pb = LT.predict_ms(base, a)
    one_loo = np.array([(AD.single_factor(np.delete(pb, k), np.delete(yk, k)) * pb[k] - yk[k]) / yk[k]
                        for k in range(len(yk))])
    scores = []
    for structure, (tabs, lp) in bases.items():
        for grouping, lam in [(COMBINATION, math.inf)] + [(g, float(l)) for g in groupings
                                                          for l in sorted(lambdas, reverse=True)]:
            groups = cell_groups(base.op_names, base.num_layers, grouping, stages)
            if groups is not None:
                r = _loo(lp, tabs, groups, lam, a, yk)
                scores.append({"structure": structure, "grouping": grouping,
                               "lambda": None if math.isinf(lam) else lam,
                               "loo_mape_pct": float(100 * np.abs(r).mean()), "_r": r, "_g": groups, "_lam": lam})
    return one_loo, scores


def _decide(chosen, one_loo, k: int) -> tuple:
    """(use the library?, why, the averaged candidates' signed leave-one-out errors) (module docstring, 4)."""
    if not chosen:
        return False, f"{k} networks are too few to tell (need >= 3)", None
    r = np.mean([c["_r"] for c in chosen], axis=0)
    d = np.abs(r) - np.abs(one_loo)
    se = d.std(ddof=1) / math.sqrt(len(d))
    why = (f"leave-one-out MAPE {100 * np.abs(r).mean():.2f}% against {100 * np.abs(one_loo).mean():.2f}% for the "
           f"one-factor rescale (paired difference {100 * d.mean():+.2f} +- {100 * se:.2f} points)")
    return bool(d.mean() + se < 0), why, r


def _average(chosen, bases, a, yk, valid, rows=None) -> tuple:
    """(const, entry, thetas, weights): the average of the chosen candidates' tables fitted on the kept networks
    ``rows`` (default all; each with the combination of its own basis), and the average combination weights."""
    rows = np.arange(len(yk)) if rows is None else rows
    entry, const, thetas, weights = 0.0, 0.0, [], {}
    for c in chosen:
        tabs, lp = bases[c["structure"]]
        w = _combine(lp[rows], yk[rows])
        _, th, m_const, m_entry = _model_predict(w, tabs, c["_g"], c["_lam"], a[rows], yk[rows], a[:1])
        entry = entry + m_entry * th[1 + c["_g"]] / len(chosen)
        const = const + th[0] * m_const / len(chosen)
        thetas.append([float(v) for v in th])
        for t, wi in zip(tabs, w):
            weights[t.device] = weights.get(t.device, 0.0) + float(wi) / len(chosen)
    return float(const), np.where(valid, entry, np.nan), thetas, weights


def _floor(lib) -> float:
    """The error no additive table removes (module docstring, 6): the mean over the library's tables of their own
    held-out RMS relative error (``validation["rms_error_pct"]``, ``layerfit``); 0 when a table has none."""
    v = [t.validation.get("rms_error_pct") if isinstance(t.validation, dict) else None for t in lib]
    if not v or any(not isinstance(x, (int, float)) for x in v):
        return 0.0
    return float(np.mean(v) / 100)


NOISE_PRIOR_NETWORKS = 2.0     # the floor's weight in the device's noise, in networks (module docstring, 6)


def _noise(residual: float, floor: float, k: int) -> float:
    """The device's relative noise (module docstring, 6): the residual over ``k`` networks pooled with the floor
    worth ``NOISE_PRIOR_NETWORKS`` networks, sqrt((k r^2 + nu f^2) / (k + nu))."""
    return float(math.sqrt((k * residual ** 2 + NOISE_PRIOR_NETWORKS * floor ** 2) / (k + NOISE_PRIOR_NETWORKS)))


def _interval(r, lib, k: int, use_lib: bool, target=None, archs=None, fit=None) -> dict | None:
    """The 90% interval (module docstring, 6). ``fit`` (library model only): (pred, y, folds) with the table's
    predictions of every measured network (dropped ones too), their measurements, and the leave-one-out tables
    [(const, entry)] of the jackknife. The fallback: Student's t times the rescale's leave-one-out RMS."""
    if r is None or len(r) < 3:
        return None
    sigma = float(np.sqrt(np.mean(r ** 2)))
    if not use_lib:
        factor = float(stats.t.ppf(0.5 + LEVEL / 2, len(r) - 1))
        return {"level": LEVEL, "rel_halfwidth": factor * sigma, "loo_rms_rel": sigma, "factor": factor,
                "factor_from": f"Student t, {len(r) - 1} degrees of freedom"}
    pred, y, folds = fit
    residual = float(np.sqrt(np.mean(np.minimum(np.abs(y - pred) / pred, OUTLIER_REL) ** 2)))
    factor, how = LB.interval_factor(lib, k, target, archs, LEVEL)
    if factor is None:
        factor, how = float(stats.t.ppf(0.5 + LEVEL / 2, len(r) - 1)), f"Student t, {len(r) - 1} degrees of freedom"
    floor = _floor(lib)
    iv = {"level": LEVEL, "factor": factor, "factor_from": how, "loo_rms_rel": sigma, "residual_rel": residual,
          "floor_rel": floor, "noise_rel": _noise(residual, floor, len(y)),
          "jackknife": {"const_ms": [float(c) for c, _ in folds],
                        "entry_ms": [[[None if not math.isfinite(v) else float(v) for v in row] for row in e.tolist()]
                                     for _, e in folds]}}
    h = factor * _relative_scale(iv, pred, archs)
    iv["rel_halfwidth_measured"] = {"min": float(h.min()), "median": float(np.median(h)), "max": float(h.max())}
    return iv


def _relative_scale(iv: dict, pred: np.ndarray, archs: np.ndarray) -> np.ndarray:
    """u(a) of every network (module docstring, 6) from an interval dict holding a jackknife."""
    jk = iv["jackknife"]
    const = np.asarray(jk["const_ms"], np.float64)
    entry = np.array([[[np.nan if v is None else v for v in row] for row in e] for e in jk["entry_ms"]], np.float64)
    folds = const[:, None] + entry[:, np.arange(archs.shape[1])[None], archs].sum(axis=2)     # [K folds, networks]
    n = len(const)
    jack = np.sqrt((n - 1) / n * ((folds - folds.mean(axis=0)) ** 2).sum(axis=0)) / pred
    if "noise_rel" not in iv:     # a table adapted before the noise was pooled: its z was calibrated on the sum
        return np.sqrt(jack ** 2 + float(iv["residual_rel"]) ** 2 + float(iv["floor_rel"]) ** 2)
    return np.sqrt(jack ** 2 + float(iv["noise_rel"]) ** 2)


def relative_scale(table: LT.LayerTable, archs) -> np.ndarray:
    """float64[K]: the relative half-width of the table's interval at each network divided by its factor z: u(a)
    (module docstring, 6) for a library adaptation, the constant leave-one-out RMS for the others; TableError when
    the table carries no interval."""
    iv = (table.adaptation or {}).get("interval") if isinstance(table.adaptation, dict) else None
    if not isinstance(iv, dict) or not isinstance(iv.get("factor"), (int, float)):
        raise LT.TableError(f"table {table.source!r} carries no prediction interval (jmsnas adapt's tables from 3 "
                            f"measured networks on do)")
    a = LT.check_archs(table, archs)
    if isinstance(iv.get("jackknife"), dict):
        return _relative_scale(iv, LT.predict_ms(table, a), a)
    return np.full(len(a), float(iv["rel_halfwidth"]) / float(iv["factor"]))


def describe_interval(iv: dict) -> str:
    """The interval's relative half-width in words: constant, or its range over the measured networks."""
    if "rel_halfwidth" in iv:
        return f"prediction ±{100 * iv['rel_halfwidth']:.1f}%"
    h = iv["rel_halfwidth_measured"]
    return (f"prediction ±{100 * h['min']:.1f}-{100 * h['max']:.1f}% on the measured networks (median "
            f"{100 * h['median']:.1f}%; wider the further a network is from them; residual "
            f"{100 * iv['residual_rel']:.2f}%, floor {100 * iv['floor_rel']:.2f}%"
            + (f", noise {100 * iv['noise_rel']:.2f}%)" if "noise_rel" in iv else ")"))


def _take(m: NW.Measured, idx) -> NW.Measured:
    return m._replace(archs=m.archs[idx], ms=m.ms[idx])


def learning_curve(base: LT.LayerTable, library, pool: NW.Measured, held: NW.Measured, *, ks=(5, 10, 20, 50),
                   draws: int = 5, seed: int = 0, reference=None, stages=None) -> dict:
    """How ``adapt_library`` does on a device of which everything is known (``pool``: networks to draw from,
    ``held``: networks to score on, both measured on it) from ``library`` (which must not hold it): at each K of
    ``ks``, ``draws`` random draws of K networks of ``pool``; the medians of the held-out MAPE, share within +-10%
    and RMS relative error, and the quantiles at ``SCORE_LEVELS`` of the pooled calibration scores
    |y - p| / p / u(a) (u: the adapted table's ``relative_scale``, module docstring 6; draws that fell back
    are left out of the scores, their interval is Student's; None at a K where every draw fell back). ``reference`` (a
    Measured of the same device, e.g. HELP's 10 reference networks): the same for that one sample, scored on
    ``held`` without those networks (``library.interval_factor`` uses it when a target measured exactly those
    networks)."""
    rng = np.random.default_rng(seed)

    def one(sample, on):
        t = adapt_library(base, sample, library, stages=stages)
        p = LT.predict_ms(t, on.archs)
        e = np.abs(p - on.ms) / on.ms
        # the interval of the library's model is calibrated on every draw, also where the rescale was used
        m = adapt_library(base, sample, library, stages=stages, fallback=False) if t.adaptation["fallback"] else t
        sc = np.empty(0)
        if m.adaptation["interval"] and not m.adaptation["fallback"]:
            pm = LT.predict_ms(m, on.archs)
            sc = np.abs(pm - on.ms) / pm / relative_scale(m, on.archs)
        return (float(100 * e.mean()), float(100 * np.mean(e <= 0.1)), float(np.sqrt(np.mean(e ** 2)))), sc

    def pct(sc):
        return [round(float(v), 4) for v in np.quantile(sc, SCORE_LEVELS)] if sc.size else None

    out = {"networks": [int(k) for k in ks], "mape_pct": [], "within_10pct": [], "rms_rel": [],
           "score_levels": list(SCORE_LEVELS), "score_percentiles": []}
    for k in ks:
        got = [one(_take(pool, rng.choice(len(pool.ms), k, replace=False)), held) for _ in range(draws)]
        for key, v in zip(("mape_pct", "within_10pct", "rms_rel"), np.median([g[0] for g in got], axis=0)):
            out[key].append(float(v))
        out["score_percentiles"].append(pct(np.concatenate([g[1] for g in got])))
    if reference is not None:
        refset = {tuple(r) for r in NW.for_table(reference, base).tolist()}
        on = _take(held, np.array([tuple(r) not in refset for r in NW.for_table(held, base).tolist()]))
        (m, w, rms), sc = one(reference, on)
        out["reference"] = {"archs": [",".join(map(str, r)) for r in NW.for_table(reference, base).tolist()],
                            "mape_pct": m, "within_10pct": w,
                            "rms_rel": rms, "score_percentiles": pct(sc)}
        if out["reference"]["score_percentiles"] is None:
            del out["reference"]
    out["how"] = (f"median over {draws} draws of K networks, adapted from {len(library)} library device(s) "
                  f"({', '.join(sorted(t.device for t in library))}) by jmsnas.cost.adapt_prior, scored on "
                  f"{len(held.ms)} held-out networks")
    return out


def adapt_library(base: LT.LayerTable, measured: NW.Measured, library, *, stages=None, groupings=GROUPINGS,
                  lambdas=LAMBDAS, structures=STRUCTURES, device: str | None = None,
                  fallback: bool = True) -> LT.LayerTable:
    """The target's table (module docstring) with ``adaptation`` holding the choice, the weights, the leave-one-out
    errors of every candidate, the fallback decision, the interval and the expected error from the library.
    ``fallback=False`` keeps the library's model where step 4 would fall back (``learning_curve`` calibrates the
    interval of that model on every draw that way)."""
    archs = NW.for_table(measured, base)
    y = measured.ms
    if len(y) == 0:
        raise LT.TableError("no measured networks to adapt from: give at least 1 (10 recommended)")
    lib = LB.check(library, base, measured, device)
    target = device or measured.device
    lib_pred = np.stack([LT.predict_ms(t, archs) for t in lib], axis=1)
    keep = _drop_outliers(lib_pred, y)
    a, yk, lp = archs[keep], y[keep], lib_pred[keep]
    bases = {}
    for st in structures:
        extra = structural_tables(base, st)
        tabs = lib + extra
        bases[st] = (tabs, np.concatenate([lp] + [LT.predict_ms(t, a)[:, None] for t in extra], axis=1))
    one_loo, scores = _score(base, bases, a, yk, stages, groupings, lambdas)
    chosen = _within_one_standard_error(scores)
    use_lib, why, r = _decide(chosen, one_loo, len(yk))
    if not fallback and chosen and not use_lib:
        use_lib, why = True, why + "; the library's model is used all the same (fallback=False)"
    w = thetas = None
    if use_lib:
        const, entry, thetas, w = _average(chosen, bases, a, yk, base.valid)
        folds = [_average(chosen, bases, a, yk, base.valid, np.flatnonzero(np.arange(len(yk)) != i))[:2]
                 for i in range(len(yk))]
        pred = max(float(const), 0.0) + np.nan_to_num(np.maximum(entry, 0.0))[np.arange(base.num_layers)[None],
                                                                                archs].sum(axis=1)
        model = [("" if c["structure"] == "none" else f"{c['structure']} + ") + c["grouping"]
                 + ("" if math.isinf(c["_lam"]) else f" lambda={c['_lam']:g}") for c in chosen]
    else:
        s = AD.single_factor(LT.predict_ms(base, a), yk)
        entry, const, r, model = s * base.entry_ms, s * base.const_ms, one_loo, ["single_factor"]
    info = {"model": "library combination + per-type corrections (jmsnas.cost.adapt_prior)",
            "base": {"device": base.device, "source": base.source},
            "networks": int(len(y)), "measured_device": measured.device, "library": [t.device for t in lib],
            "weights": w,
            "fallback": not use_lib, "why": why, "chosen": model, "theta": thetas,
            "dropped": [int(i) for i in np.flatnonzero(~keep)],
            "loo_mape_pct": None if r is None else float(100 * np.abs(r).mean()),
            "single_factor_loo_mape_pct": None if one_loo is None else float(100 * np.abs(one_loo).mean()),
            "interval": _interval(r, lib, len(yk), use_lib, target, archs,
                                  None if not use_lib else (pred, y, folds)),
            "expected": LB.expected_error(lib, len(yk), target),
            "candidates": [{k: v for k, v in c.items() if not k.startswith("_")} for c in scores]}
    return LT.make(max(float(const), 0.0), np.where(np.isnan(entry), np.nan, np.maximum(entry, 0.0)), base.op_names,
                   space=base.space, device=device or measured.device,
                   source=f"adapted from {base.source} and a library of {len(lib)} device(s) with {len(y)} networks "
                          f"measured on {measured.device}", adaptation=info)


def interval_ms(table: LT.LayerTable, archs) -> tuple:
    """(low, high) float64[K]: the table's 90% interval (``adaptation["interval"]``) around its predictions,
    [p (1 - z u(a)), p (1 + z u(a))] (``relative_scale``); TableError when the table carries none."""
    h = relative_scale(table, archs) * float(table.adaptation["interval"]["factor"])
    p = LT.predict_ms(table, archs)
    return np.maximum(p * (1 - h), 0.0), p * (1 + h)
