"""A library of per-layer tables of devices already measured: the prior ``adapt.adapt_library`` learns a new device
from.

A library is a tuple of ``LayerTable``s of one space, sorted by device name (so the order the tables are given in
changes nothing), with distinct devices. ``check`` refuses, in one line and before anything is fitted: a library
of another space or other ops or layers than the base table, two tables of one device, and a table that is the
target itself (its device name is the target's, or it reproduces every measured network to 1e-6: the target's
own data would be in its prior).

The package ships the library of HELP's six visible devices of the FBNet space (``jmsnas/fbnet/library/``, MIT;
``shipped(space)``), each fitted by ``layerfit`` on the device's networks 0-3999 (3600 fitted, 400 held out), with
the learning curve of its adaptation from the other five (``adaptation["learning_curve"]``: the error of
``adapt_library`` at 5, 10, 20 and 50 networks, on that device's held-out networks). ``expected_error`` reads
those curves: what a user can expect at K networks, and with 10 more.
"""
from __future__ import annotations

import os

import numpy as np

from jmsnas.cost import layertable as LT
from jmsnas.cost import networks as NW

SHIPPED = {"fbnet_c100": os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                      "jmsnas", "fbnet", "library")}


def shipped_paths(space: str) -> list:
    """The table files of the library shipped for ``space`` (TableError when none is)."""
    d = SHIPPED.get(space)
    if d is None or not os.path.isdir(d):
        raise LT.TableError(f"no library ships for space {space!r}; spaces with one: {sorted(SHIPPED)}")
    return [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".json")]


def load(specs) -> tuple:
    """The tables named by ``specs`` (table files, or directories of them), sorted by device."""
    paths = []
    for s in specs:
        if os.path.isdir(s):
            found = sorted(os.path.join(s, f) for f in os.listdir(s) if f.endswith(".json"))
            if not found:
                raise LT.TableError(f"library directory {os.fspath(s)!r} holds no table file (*.json)")
            paths += found
        else:
            paths.append(s)
    if not paths:
        raise LT.TableError("the library is empty: give at least one table")
    return make([LT.load(p) for p in paths])


def make(tables) -> tuple:
    """The tables as a library: sorted by device name, devices distinct, one space/ops/layer count."""
    tables = sorted(tables, key=lambda t: t.device)
    if not tables:
        raise LT.TableError("the library is empty: give at least one table")
    first = tables[0]
    seen = set()
    for t in tables:
        if t.device in seen:
            raise LT.TableError(f"the library holds two tables of device {t.device!r}")
        seen.add(t.device)
        if (t.space, t.op_names, t.num_layers) != (first.space, first.op_names, first.num_layers):
            raise LT.TableError(f"library table {t.device!r} is of space {t.space!r} ({t.num_layers} layers, ops "
                                f"{list(t.op_names)}), {first.device!r} of {first.space!r} ({first.num_layers} "
                                f"layers, ops {list(first.op_names)})")
    return tuple(tables)


def check(library, base: LT.LayerTable, measured: NW.Measured, target: str | None = None) -> tuple:
    """``library`` checked against the base table and the target's measured networks (module docstring)."""
    lib = make(library)
    t = lib[0]
    if (t.space, t.op_names, t.num_layers) != (base.space, base.op_names, base.num_layers):
        raise LT.TableError(f"the library is of space {t.space!r} ({t.num_layers} layers, ops {list(t.op_names)}), "
                            f"the base table of {base.space!r} ({base.num_layers} layers, ops "
                            f"{list(base.op_names)})")
    names = {measured.device} | ({target} if target else set())
    for tab in lib:
        if tab.device in names:
            raise LT.TableError(f"the library holds a table of the target device {tab.device!r}: its own data "
                                f"cannot be in its prior (leave it out of --library)")
    archs = NW.for_table(measured, base)
    if len(measured.ms):
        for tab in lib:
            err = np.abs(LT.predict_ms(tab, archs) - measured.ms) / measured.ms
            if err.max() < 1e-6:
                raise LT.TableError(f"library table {tab.device!r} reproduces all {len(measured.ms)} measured "
                                    f"networks exactly: it is the target itself (leave it out of --library)")
    return lib


def _curve(table, target: str | None):
    """The learning curve of ``table`` that holds nothing of ``target``: the one built with ``target`` out of the
    library (``adaptation["learning_curve_without"][target]``) when ``target`` was a device of the library the curve
    was built from, else ``adaptation["learning_curve"]`` (built from every other library device); None without."""
    a = table.adaptation if isinstance(table.adaptation, dict) else {}
    without = a.get("learning_curve_without")
    c = without.get(target) if isinstance(without, dict) and target is not None else None
    c = c if c is not None else a.get("learning_curve")
    return c if isinstance(c, dict) and c.get("networks") else None


def expected_error(library, k: int, target: str | None = None) -> dict | None:
    """Median over the library's learning curves (``_curve``: none built with ``target``'s data) of the adapted
    table's MAPE (%) and share within +-10% (%) at ``k`` networks and at ``k + 10`` (interpolated in log k, clamped
    to the measured range); None without curves."""
    curves = [c for c in (_curve(t, target) for t in library) if c is not None]
    if not curves:
        return None

    def at(c, kk, key):
        ks = np.log(np.asarray(c["networks"], float))
        return float(np.interp(np.log(kk), ks, np.asarray(c[key], float)))

    out = {"devices": len(curves)}
    for name, kk in (("at", k), ("plus_10", k + 10)):
        out[name] = {"networks": int(kk),
                     "mape_pct": float(np.median([at(c, kk, "mape_pct") for c in curves])),
                     "within_10pct": float(np.median([at(c, kk, "within_10pct") for c in curves])),
                     "rms_rel": float(np.median([at(c, kk, "rms_rel") for c in curves]))}
    return out


def _same_networks(stored, archs) -> bool:
    """Whether ``stored`` (a curve's reference networks, "op,op,..." per network) are the networks ``archs``."""
    a = np.asarray(archs)
    return isinstance(stored, list) and len(stored) == len(a) and \
        set(stored) == {",".join(map(str, r)) for r in a.tolist()}


def interval_factor(library, k: int, target: str | None = None, archs=None, level: float = 0.9) -> tuple:
    """(z, how): the split-conformal factor of the 90% interval (``adapt_prior`` module docstring, 6): the ``level``
    quantile of the pooled scores |measured - predicted| / predicted / (leave-one-out RMS relative error) of the
    library's devices, each adapted from the other library devices (none of them ``target``: ``_curve``) and scored
    on its own held-out networks. Each curve stores its score distribution as quantiles (``score_levels``); the
    pooled quantile is the z where the mean of the devices' distribution functions reaches ``level``. When ``archs``
    are the networks a curve's ``reference`` block was calibrated on (HELP's 10 reference networks), that block is
    used (pooled over the devices that have it: a reference adaptation that fell back stores none), else the
    random-draw scores at ``k`` networks (interpolated in log k). (None, None) without curves."""
    curves = [c for c in (_curve(t, target) for t in library)
              if c is not None and any(p is not None for p in c.get("score_percentiles") or [])]
    if not curves:
        return None, None
    ref = [c.get("reference") if archs is not None else None for c in curves]
    ref = [r if isinstance(r, dict) and _same_networks(r.get("archs"), archs) else None for r in ref]
    use_ref = any(r is not None for r in ref)      # those devices whose reference adaptation did not fall back
    qs = []
    for c, r in zip(curves, ref):
        if use_ref:
            if r is not None:
                qs.append(np.asarray(r["score_percentiles"], float))
        else:
            ok = [i for i, p in enumerate(c["score_percentiles"]) if p is not None]  # None: every draw fell back
            table = np.asarray([c["score_percentiles"][i] for i in ok], float)    # [K values, levels]
            lk = np.log(np.asarray(c["networks"], float)[ok])
            qs.append(np.array([np.interp(np.log(k), lk, table[:, j]) for j in range(table.shape[1])]))
    levels = np.asarray(curves[0].get("score_levels") or np.linspace(0.0, 1.0, qs[0].size), float)
    grid = np.unique(np.concatenate(qs))
    cdf = np.mean([np.interp(grid, q, levels) for q in qs], axis=0)
    z = float(np.interp(level, cdf, grid))
    how = (f"split-conformal: {int(100 * level)}% quantile of the pooled held-out scores of {len(qs)} library "
           f"devices, " + ("adapted from the same reference networks" if use_ref else f"at {k} random networks"))
    return z, how
