"""HELP's FBNet data (Lee et al., NeurIPS 2021, github HayeonLee/HELP, data/fbnet/, MIT licence) as jmsnas objects.

``fbnet_latency.json``: ``op_idx_list`` (architectures x 22 op indices), ``latency_ms`` {device: one value per
architecture}, ``hardware_embedding_index`` (the 10 reference architectures HELP measures on a new device).
``fbnet_lut_pixel3_raspi4.json``: the Pixel 3 and Raspberry Pi 4 per-layer tables in relative form
(``layertable.from_relative``). The copy under tests/data/help_fbnet keeps a subset of the architectures.
"""
from __future__ import annotations

import json
import os

import numpy as np

from jmsnas.cost import layertable as LT
from jmsnas.cost import networks as NW
from jmsnas.fbnet.space import OP_NAMES, fbnet_c100

LATENCY_FILE = "fbnet_latency.json"
LUT_FILE = "fbnet_lut_pixel3_raspi4.json"


def _read(path) -> dict:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise LT.TableError(f"cannot read HELP data {os.fspath(path)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise LT.TableError(f"HELP data {os.fspath(path)!r} is not JSON: {e}") from None


def _check_ops(names, path) -> None:
    if tuple(names) != OP_NAMES:
        raise LT.TableError(f"{os.fspath(path)}: op_names {list(names)} are not the FBNet space's {list(OP_NAMES)}")


def tables(directory) -> dict:
    """{device: LayerTable} of the per-layer tables in ``directory``/fbnet_lut_pixel3_raspi4.json."""
    path = os.path.join(directory, LUT_FILE)
    d = _read(path)
    _check_ops(d["op_names"], path)
    space = fbnet_c100()
    out = {}
    for dev, t in d["devices"].items():
        out[dev] = LT.from_relative(t["base_all_k3_e1_ms"], t["delta_ms[layer][op]"], OP_NAMES, space=space.name,
                                    device=dev, source=f"HELP/HW-NAS-Bench {dev} per-layer table ({LUT_FILE})")
        if out[dev].num_layers != space.num_layers:
            raise LT.TableError(f"{path}: {dev} has {out[dev].num_layers} layers, the space {space.num_layers}")
    return out


class Data(dict):
    """The whole-network data: ``archs`` int64[K, 22], ``ms`` {device: float64[K]}, ``reference`` (HELP's 10
    architecture indices), ``index`` int64[K] (each row's index in HELP's 5000; the test copy keeps a subset)."""


def load(directory) -> Data:
    path = os.path.join(directory, LATENCY_FILE)
    d = _read(path)
    _check_ops(d["op_names"], path)
    archs = np.asarray(d["op_idx_list"], np.int64)
    index = np.asarray(d.get("arch_index", range(len(archs))), np.int64)
    return Data(archs=archs, ms={k: np.asarray(v, np.float64) for k, v in d["latency_ms"].items()},
                reference=[int(i) for i in d["hardware_embedding_index"]], index=index)


def measured(data: Data, device: str, indices) -> NW.Measured:
    """The networks with HELP indices ``indices`` measured on ``device``, as a Measured (for ``adapt``)."""
    if device not in data["ms"]:
        raise LT.TableError(f"unknown device {device!r}; the data has {sorted(data['ms'])}")
    pos = {int(i): k for k, i in enumerate(data["index"])}
    missing = [int(i) for i in indices if int(i) not in pos]
    if missing:
        raise LT.TableError(f"architecture(s) {missing[:5]} are not in the data")
    rows = np.array([pos[int(i)] for i in indices], np.int64)
    return NW.make(data["archs"][rows], data["ms"][device][rows], OP_NAMES, space=fbnet_c100().name, device=device,
                   info={"source": "HELP fbnet_latency.json", "arch_index": [int(i) for i in indices]})


def table_from_spec(spec: str):
    """(LayerTable, path of the file it may be recorded in, or None) from a table file or ``HELP_FILE:DEVICE``
    (HELP's relative-form file, fbnet_lut_pixel3_raspi4.json, and one of its devices)."""
    path, sep, device = str(spec).rpartition(":")
    if sep and path and os.path.isfile(path) and not os.path.isfile(spec):
        if os.path.basename(path) != LUT_FILE:
            raise LT.TableError(f"{path!r}: only HELP's {LUT_FILE} takes a :DEVICE suffix")
        found = tables(os.path.dirname(path) or ".")
        if device not in found:
            raise LT.TableError(f"{path!r} has no device {device!r}; devices are {sorted(found)}")
        return found[device], None
    return LT.load(spec), spec
