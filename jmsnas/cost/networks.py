"""Whole networks measured on a device: the file ``jmsnas adapt`` learns from and ``jmsnas validate`` checks against.

JSON: ``{"format": "jmsnas-measured-networks/1", "space": NAME, "device": NAME, "units": "ms", "op_names": [...],
"networks": [{"ops": [op name or index per layer], "ms": latency}, ...]}``; ``ms`` is the whole network's
latency on the device (median of its timings), ``ops`` one entry per searchable layer of the space.
"""
from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import numpy as np

from jmsnas import safeio
from jmsnas.cost.layertable import LayerTable, TableError, check_archs

FORMAT = "jmsnas-measured-networks/1"


class Measured(NamedTuple):
    """archs: int64[K, N] op indices into op_names; ms: float64[K] (> 0); space, device: names; info: dict."""

    archs: np.ndarray
    ms: np.ndarray
    op_names: tuple
    space: str
    device: str
    info: dict = {}


MIN_MS, MAX_MS = 1e-6, 1e7  # one network's plausible time: a nanosecond to 2.8 hours (1e-300 scaled a table by 1e-302)


def make(archs, ms, op_names, *, space: str, device: str, info=None) -> Measured:
    a = np.asarray(archs, dtype=np.int64).reshape(len(ms), -1) if len(ms) else np.zeros((0, 0), np.int64)
    y = np.asarray(ms, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(y) | (y < MIN_MS) | (y > MAX_MS))
    if bad.size:
        raise TableError(f"network {int(bad[0])}: measured latency must be {MIN_MS:g}-{MAX_MS:g} ms (a plausible "
                         f"time for one network), got {float(y[bad[0]])!r}")
    return Measured(a, y, tuple(op_names), str(space), str(device), dict(info or {}))


def for_table(measured: Measured, table: LayerTable, what: str = "measured networks") -> np.ndarray:
    """The measured architectures as op indices of ``table`` (int64[K, N]); TableError (one line) when they come
    from another space or use an op the table lacks."""
    if measured.space != table.space:
        raise TableError(f"{what} are of space {measured.space!r}, the table {table.source!r} of space "
                         f"{table.space!r}")
    if measured.archs.size == 0:
        return np.zeros((0, table.num_layers), np.int64)
    unknown = sorted(set(measured.op_names[i] for i in np.unique(measured.archs)) - set(table.op_names))
    if unknown:
        raise TableError(f"{what} use op(s) {unknown} that the table's ops {list(table.op_names)} lack")
    remap = np.array([table.op_names.index(n) if n in table.op_names else -1 for n in measured.op_names])
    return check_archs(table, remap[measured.archs])


def to_dict(m: Measured) -> dict:
    return {"format": FORMAT, "space": m.space, "device": m.device, "units": "ms", "op_names": list(m.op_names),
            "networks": [{"ops": [m.op_names[i] for i in a], "ms": float(t)} for a, t in zip(m.archs.tolist(), m.ms)],
            **({"info": m.info} if m.info else {})}


def from_dict(d, source: str = "measured networks") -> Measured:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise TableError(f"{source}: not a file of measured networks (format {safeio.short(got)}, expected "
                         f"{FORMAT!r})")
    for k in ("space", "device", "op_names", "networks"):
        if k not in d:
            raise TableError(f"{source}: missing field {k!r}")
    if d.get("units", "ms") != "ms":
        raise TableError(f"{source}: units must be 'ms', got {safeio.short(d['units'])}")
    names = d["op_names"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise TableError(f"{source}: op_names must be a non-empty list of names, got {safeio.short(names)}")
    nets = d["networks"]
    if not isinstance(nets, list):
        raise TableError(f"{source}: networks must be a list, got {safeio.short(nets)}")
    archs, ms, width = [], [], None
    for k, net in enumerate(nets):
        where = f"{source}: networks[{k}]"
        if not isinstance(net, dict) or set(net) - {"ops", "ms", "arch_index"} or "ops" not in net or "ms" not in net:
            raise TableError(f"{where} must be {{'ops': [...], 'ms': number}}, got {safeio.short(net)}")
        ops, t = net["ops"], net["ms"]
        if not isinstance(ops, list) or not ops:
            raise TableError(f"{where}.ops must be a non-empty list, got {safeio.short(ops)}")
        idx = []
        for o in ops:
            if isinstance(o, str) and o in names:
                idx.append(names.index(o))
            elif isinstance(o, int) and not isinstance(o, bool) and 0 <= o < len(names):
                idx.append(o)
            else:
                raise TableError(f"{where}.ops: {safeio.short(o)} is not one of {names} or an index into them")
        if width is not None and len(idx) != width:
            raise TableError(f"{where} has {len(idx)} layers, networks[0] has {width}")
        width = len(idx)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not MIN_MS <= t <= MAX_MS:
            raise TableError(f"{where}.ms must be a latency of {MIN_MS:g}-{MAX_MS:g} ms (a plausible time for one "
                             f"network), got {safeio.short(t)}")
        archs.append(idx)
        ms.append(float(t))
    return make(np.array(archs, np.int64) if archs else np.zeros((0, 0), np.int64), ms, names, space=d["space"],
                device=d["device"], info=d.get("info") if isinstance(d.get("info"), dict) else None)


def load(path) -> Measured:
    try:
        raw = safeio.read_bytes(path, "measured networks")
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TableError(f"measured networks {os.fspath(path)!r} are not JSON: {e}") from None
    except ValueError as e:
        raise TableError(str(e)) from None
    return from_dict(d, os.fspath(path))


def save(m: Measured, path) -> None:
    with safeio.atomic_write(path) as f:
        json.dump(to_dict(m), f, indent=1)
        f.write("\n")
