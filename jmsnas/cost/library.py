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


def expected_error(library, k: int) -> dict | None:
    """Median over the library's learning curves of the adapted table's MAPE (%) and share within +-10% (%) at
    ``k`` networks and at ``k + 10`` (interpolated in log k, clamped to the measured range); None without
    curves."""
    curves = [t.adaptation.get("learning_curve") for t in library if isinstance(t.adaptation, dict)]
    curves = [c for c in curves if isinstance(c, dict) and c.get("networks")]
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


def interval_factor(library, k: int) -> tuple:
    """(z, how): the median over the library's learning curves of ``interval_factor`` (the 90% quantile of the
    held-out relative errors over the leave-one-out RMS relative error) at ``k`` networks, interpolated in log k;
    (None, None) without curves."""
    curves = [t.adaptation.get("learning_curve") for t in library if isinstance(t.adaptation, dict)]
    curves = [c for c in curves if isinstance(c, dict) and c.get("interval_factor")]
    if not curves:
        return None, None
    z = [float(np.interp(np.log(k), np.log(np.asarray(c["networks"], float)), np.asarray(c["interval_factor"], float)))
         for c in curves]
    return float(np.median(z)), f"median of {len(z)} library devices' calibration at {k} networks"
