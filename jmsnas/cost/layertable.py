"""An additive per-layer latency table of one device: latency(arch) = const_ms + sum_l entry_ms[l, arch[l]] (ms).

This is the form of HW-NAS-Bench's per-device lookup tables of the FBNet space (and of any table profiled per
layer): one fixed term (stem, head, call overhead) plus one entry per searchable layer and candidate op. Every
entry and the fixed term are >= 0, so any architecture's predicted latency is >= 0.

HELP publishes the Pixel 3 and Raspberry Pi 4 tables in a *relative* form, latency = base_ms + sum_l delta[l][op_l]
with delta[l][0] = 0 (the per-layer constants of the original table cannot be separated from the base, and deltas
may be negative). ``from_relative`` turns it into this form without changing any architecture's latency: each
layer's entries are shifted by the layer's smallest delta, which the fixed term absorbs,
entry[l, o] = delta[l][o] - min_o delta[l][o] >= 0 and const = base + sum_l min_o delta[l][o] (an error if that
is negative: such a table predicts a negative latency for some network).

A table file (JSON) holds ``format``, ``space``, ``device``, ``units`` ("ms"), ``op_names``, ``const_ms``,
``entry_ms`` (N x R, ``null`` where an op is not a candidate of a layer), ``source``, and optionally
``adaptation`` (how ``jmsnas adapt`` fitted it) and ``validation`` (the table's last accuracy report,
``jmsnas validate``).
"""
from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import numpy as np

from jmsnas import safeio

FORMAT = "jmsnas-layer-table/1"


class TableError(ValueError):
    """A bad table file or a bad architecture for a table; the message names the value and what was expected."""


class LayerTable(NamedTuple):
    """const_ms: float; entry_ms: float64[N, R] (nan where op r is not a candidate of layer l); op_names: R names;
    space: the search space's name; device: the device measured; source: where the numbers come from;
    adaptation / validation: dicts or None."""

    const_ms: float
    entry_ms: np.ndarray
    op_names: tuple
    space: str
    device: str
    source: str
    adaptation: dict | None = None
    validation: dict | None = None

    @property
    def num_layers(self) -> int:
        return int(self.entry_ms.shape[0])

    @property
    def valid(self) -> np.ndarray:
        """bool[N, R]: which ops are candidates of each layer."""
        return np.isfinite(self.entry_ms)


def check_archs(table: LayerTable, archs) -> np.ndarray:
    """archs as int64[K, N] (a single architecture becomes K = 1); TableError names a bad one."""
    a = np.asarray(archs)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2 or a.shape[1] != table.num_layers:
        raise TableError(f"architectures must have {table.num_layers} op indices each (space {table.space!r}), "
                         f"got shape {a.shape}")
    if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= len(table.op_names)):
        raise TableError(f"op indices must be integers in [0, {len(table.op_names)}) (ops {list(table.op_names)}), "
                         f"got {safeio.short(a.tolist())}")
    a = a.astype(np.int64)
    if a.size:
        ok = table.valid[np.arange(table.num_layers)[None], a]
        if not ok.all():
            k, n = (int(i) for i in np.argwhere(~ok)[0])
            raise TableError(f"architecture {k}: op {table.op_names[a[k, n]]!r} is not a candidate of layer {n}")
    return a


def predict_ms(table: LayerTable, archs) -> np.ndarray:
    """float64[K]: the table's latency (ms) of each architecture in ``archs`` (int[K, N] or int[N])."""
    a = check_archs(table, archs)
    return table.const_ms + table.entry_ms[np.arange(table.num_layers)[None], a].sum(axis=1)


def make(const_ms, entry_ms, op_names, *, space: str, device: str, source: str, adaptation=None,
         validation=None) -> LayerTable:
    """A checked LayerTable: finite, non-negative const and entries (nan marks a non-candidate)."""
    e = np.array(entry_ms, dtype=np.float64)
    if e.ndim != 2 or e.shape[1] != len(op_names) or e.shape[0] < 1:
        raise TableError(f"entry_ms must be layers x {len(op_names)} ops {list(op_names)}, got shape {e.shape}")
    if isinstance(const_ms, bool) or not isinstance(const_ms, (int, float, np.floating, np.integer)) \
            or not math.isfinite(const_ms) or const_ms < 0:
        raise TableError(f"const_ms must be a finite latency >= 0 ms, got {safeio.short(const_ms)}")
    bad = np.argwhere(np.isinf(e) | (e < 0))
    if bad.size:
        n, r = (int(i) for i in bad[0])
        raise TableError(f"entry_ms[{n}][{r}] (op {op_names[r]!r}) must be a finite latency >= 0 ms, got {e[n, r]!r}")
    empty = np.flatnonzero(~np.isfinite(e).any(axis=1))
    if empty.size:
        raise TableError(f"layer {int(empty[0])} has no candidate op (every entry null)")
    return LayerTable(float(const_ms), e, tuple(op_names), str(space), str(device), str(source), adaptation,
                      validation)


def from_relative(base_ms: float, delta_ms, op_names, *, space: str, device: str, source: str) -> LayerTable:
    """The table of HELP's relative form latency = base_ms + sum_l delta_ms[l][op_l] (see the module docstring)."""
    d = np.array(delta_ms, dtype=np.float64)
    if d.ndim != 2 or d.shape[1] != len(op_names) or not np.isfinite(d).all():
        raise TableError(f"delta_ms must be a finite layers x {len(op_names)} array, got shape {d.shape}")
    low = d.min(axis=1)
    const = float(base_ms) + float(low.sum())
    if const < 0:
        raise TableError(f"relative table of {device!r} predicts {const:.6g} ms < 0 for its fastest network")
    return make(const, d - low[:, None], op_names, space=space, device=device, source=source)


def to_dict(table: LayerTable) -> dict:
    e = [[None if not math.isfinite(v) else float(v) for v in row] for row in table.entry_ms.tolist()]
    out = {"format": FORMAT, "space": table.space, "device": table.device, "units": "ms",
           "op_names": list(table.op_names), "const_ms": table.const_ms, "entry_ms": e, "source": table.source}
    if table.adaptation is not None:
        out["adaptation"] = table.adaptation
    if table.validation is not None:
        out["validation"] = table.validation
    return out


def from_dict(d, source: str = "table") -> LayerTable:
    """A LayerTable from ``to_dict``'s form; TableError names the first bad field."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise TableError(f"{source}: not a per-layer latency table (format {safeio.short(got)}, expected {FORMAT!r})")
    missing = [k for k in ("space", "device", "op_names", "const_ms", "entry_ms") if k not in d]
    if missing:
        raise TableError(f"{source}: missing field(s) {missing}")
    if d.get("units", "ms") != "ms":
        raise TableError(f"{source}: units must be 'ms', got {safeio.short(d['units'])}")
    names = d["op_names"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names) \
            or len(set(names)) != len(names):
        raise TableError(f"{source}: op_names must be a list of distinct names, got {safeio.short(names)}")
    rows = d["entry_ms"]
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == len(names) for r in rows):
        raise TableError(f"{source}: entry_ms must be a list of rows of {len(names)} numbers or null")
    try:
        e = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=np.float64)
    except (TypeError, ValueError):
        raise TableError(f"{source}: entry_ms holds a value that is not a number or null") from None
    try:
        return make(d["const_ms"], e, names, space=d["space"], device=d["device"], source=d.get("source", source),
                    adaptation=d.get("adaptation"), validation=d.get("validation"))
    except TableError as err:
        raise TableError(f"{source}: {err}") from None


def load(path) -> LayerTable:
    """Reads a table file (``to_dict``'s JSON)."""
    try:
        raw = safeio.read_bytes(path, "latency table")
    except ValueError as e:
        raise TableError(str(e)) from None
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TableError(f"latency table {os.fspath(path)!r} is not JSON: {e}") from None
    return from_dict(d, os.fspath(path))


def save(table: LayerTable, path) -> None:
    with safeio.atomic_write(path) as f:
        json.dump(to_dict(table), f, indent=1)
        f.write("\n")
