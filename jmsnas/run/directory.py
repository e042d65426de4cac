"""A run directory, read and written in one place (docs/run_directory.md).

Every flow (``search``, ``retrain``, ``evolve``, SplitNets, separable networks, FBNet) writes its workdir through the
writers here, and every command that reads a finished run (``modularize``, ``autosplit``, ``export``,
``pipeline``, ``split --model RUN/result.json``) reads it through the readers here; no other module parses
``result.json`` or ``config.json``.

Layout::

    config.json             {"command": "search"|"evolve"|"separable", "config": {...}}  (written when claimed)
    result.json             the flow's result; top level: RESULT_KEYS (every flow) plus the flow's own keys
    history.json            one row per epoch
    evolution.json          per-generation log (evolve, SplitNets)
    parts/manifest.json     {"devices": {name: {"file", "layers", ...}}, "space": ...} and parts/<device>.npz
    checkpoints/<stage>/    orbax checkpoints (jmsnas.checkpoint)

Writers are atomic (``safeio.atomic_write``: a kill while writing leaves the previous file or none, never half of
one) and write only in process 0 of a multi-process run (``writes()``); an OSError becomes one ConfigError line
(``output_errors``). Readers raise ``RunDirError`` (a ValueError) naming the file and what is wrong with it.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from jmsnas import safeio
from jmsnas.runcheck import ConfigError

CONFIG = "config.json"
RESULT = "result.json"
HISTORY = "history.json"
EVOLUTION = "evolution.json"
PARTS = "parts"
MANIFEST = "manifest.json"

# the top-level keys of every flow's result.json (docs/run_directory.md); a flow adds its own beside them
RESULT_KEYS = ("flow", "topology", "dataset", "seed", "time")
FLOWS = ("search", "evolve", "splitnets", "separable", "fbnet")  # the values of its "flow"


class RunDirError(ValueError):
    """A run directory, or one of its files, that cannot be read; the message names the file."""


# ------------------------------------------------------------------------------------------------ writing

def writes() -> bool:
    """Whether this process writes the run's files: process 0 (the only one of a single-process run)."""
    import jax
    return jax.process_index() == 0


@contextlib.contextmanager
def output_errors(workdir: str):
    """An OSError while writing the outputs becomes one ConfigError line; the checkpoints stay, so the same
    command with --resume writes them once the workdir is writable again."""
    try:
        yield
    except OSError as e:
        where = e.filename or workdir
        raise ConfigError(f"cannot write the run's outputs to {where!r}: {e.strerror or e}; the checkpoints are "
                          f"kept: fix that and rerun the same command with --resume") from None


def write_json(workdir: str, name: str, obj) -> None:
    """``obj`` as ``workdir/name`` (indented JSON), atomically, by process 0 only."""
    if not writes():
        return
    with output_errors(workdir), safeio.atomic_write(os.path.join(workdir, name), encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")


def write_config(workdir: str, command: str, config: dict) -> None:
    """``config.json``: the command and its whole configuration (``workdir.claim`` calls it once)."""
    with safeio.atomic_write(os.path.join(workdir, CONFIG), encoding="utf-8") as f:
        json.dump({"command": command, "config": config}, f, indent=2, default=str)


def flat_arrays(tree, prefix: str) -> dict:
    """{"prefix/key/key/...": numpy array} of a pytree of dicts and tuples (the npz keys of a part)."""
    import jax
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[prefix + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = np.asarray(leaf)
    return out


def write_parts(workdir: str, parts: dict, manifest: dict) -> dict:
    """``parts/<device>.npz`` for each {device: {"params": tree, "bn": tree, **entry}} and ``parts/manifest.json``
    (``manifest`` plus {"devices": {device: {"file", **entry}}}), as one folder (``safeio.atomic_dir``: a kill or a
    failure leaves the previous folder or none, never part of one), by process 0 only. Returns the manifest."""
    manifest = {**manifest, "devices": {}}
    for dev, part in parts.items():
        entry = {k: v for k, v in part.items() if k not in ("params", "bn")}
        manifest["devices"][dev] = {"file": f"{dev}.npz", **entry}
    if not writes():
        return manifest
    with output_errors(workdir):
        os.makedirs(workdir, exist_ok=True)
        safeio.npz_folder(os.path.join(workdir, PARTS), {
            dev: {**flat_arrays(part["params"], "params"), **flat_arrays(part["bn"], "bn")}
            for dev, part in parts.items()}, manifest)
    return manifest


def write_outputs(workdir: str, result: dict, history: list, parts) -> list:
    """A finished run's outputs, in one order: history.json, the report (summary.txt and plots,
    ``report.write_report``), parts/ (``parts()`` writes them) and last result.json, whose presence marks a
    finished run. Returns the report's figure paths (none in processes other than 0)."""
    from jmsnas import report
    write_json(workdir, HISTORY, history)
    figures = []
    if writes():
        with output_errors(workdir):
            figures = report.write_report(result, history, workdir)
    parts()
    write_json(workdir, RESULT, result)
    return figures


# ------------------------------------------------------------------------------------------------ reading

def read_json(path: str, what: str):
    """The parsed JSON file ``path`` (``safeio.read_json``: size and depth caps; ``what`` names it in errors)."""
    if not os.path.isfile(path):
        raise RunDirError(f"{path} is missing: {os.path.dirname(path) or '.'!r} has no {what}, so it holds no "
                          "finished run (expected the workdir of a jmsnas run that ran to its end)")
    try:
        return safeio.read_json(path, what)
    except ValueError as e:
        raise RunDirError(str(e)) from None


def _run(run: str) -> str:
    if not os.path.isdir(run):
        raise RunDirError(f"run directory {run!r} does not exist")
    return run


def stored_config(workdir: str) -> dict | None:
    """``{"command", "config"}`` of ``workdir/config.json``, None when there is none; ConfigError when unreadable."""
    path = os.path.join(workdir, CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        d = read_json(path, "stored configuration")
    except RunDirError as e:
        raise ConfigError(f"cannot read the run's stored configuration {path!r}: {safeio.clip(e)}") from None
    if not isinstance(d, dict) or not isinstance(d.get("config"), dict) or not isinstance(d.get("command"), str):
        raise ConfigError(f"{path!r} is not a stored run configuration (expected {{'command', 'config'}})")
    return d


def read_config(run: str) -> dict:
    """The run's configuration (the ``config`` of config.json, lists as tuples as the built-in configs hold)."""
    d = read_json(os.path.join(_run(run), CONFIG), "configuration (written by jmsnas search/evolve)")
    if isinstance(d, dict) and set(d) == {"command", "config"}:
        d = d["config"]
    if not isinstance(d, dict):
        raise RunDirError(f"{os.path.join(run, CONFIG)} is not a run configuration (a mapping)")
    return tuples(d)


def read_result(run: str) -> dict:
    """The parsed result.json of the run (a mapping)."""
    d = read_json(os.path.join(_run(run), RESULT), "result")
    if not isinstance(d, dict):
        raise RunDirError(f"{os.path.join(run, RESULT)} is not a run result (a mapping)")
    return d


def is_result(obj) -> bool:
    """True for the parsed result.json of a search/evolve run (it records its space and architecture)."""
    return isinstance(obj, dict) and isinstance(obj.get("space"), dict) and "architecture" in obj


def read_space(run: str):
    """The run's SearchSpace, from result.json's ``space`` (``jmsnas.space.to_dict``)."""
    from jmsnas.space import from_dict
    result = read_result(run)
    if not isinstance(result.get("space"), dict):
        raise RunDirError(f"{os.path.join(run, RESULT)} records no search space; expected the workdir of a "
                          "finished `jmsnas search` or `jmsnas evolve`")
    return from_dict(result["space"], f"{os.path.join(run, RESULT)}: space")


def read_ops(run: str, space) -> tuple:
    """The op index of every layer slot, from result.json's ``architecture``."""
    from jmsnas.space import OP_NAMES
    arch = read_result(run).get("architecture")
    path = os.path.join(run, RESULT)
    try:
        ops = [OP_NAMES.index(e["op"]) for e in sorted(arch, key=lambda e: e["layer"])]
    except (TypeError, KeyError, ValueError) as e:
        raise RunDirError(f"{path}: architecture is not a list of {{layer, op}} with known ops ({e})") from None
    if len(ops) != space.num_layers:
        raise RunDirError(f"{path}: architecture lists {len(ops)} layers, its space has {space.num_layers}")
    return tuple(ops)


def read_compact(run: str) -> tuple:
    """(space, ops, params, bn) of the run's compact network: the space and architecture from result.json, the
    weights from parts/, every layer's tree in a tuple as ``supernet.compact_apply`` takes it."""
    space = read_space(run)
    return (space, read_ops(run, space), *read_weights(run, num_layers=space.num_layers))


def read_manifest(run: str) -> dict:
    """parts/manifest.json of the run."""
    d = read_json(os.path.join(_run(run), PARTS, MANIFEST), "parts manifest")
    if not isinstance(d, dict) or not isinstance(d.get("devices"), dict):
        raise RunDirError(f"{os.path.join(run, PARTS, MANIFEST)} lists no devices")
    return d


def read_part(run: str, device: str, entry: dict) -> dict:
    """{"params/...": array, "bn/...": array} of one device's part file (a name inside ``parts/`` only)."""
    try:
        name = str(entry.get("file", f"{device}.npz") if isinstance(entry, dict) else f"{device}.npz")
        path = safeio.child_path(os.path.join(run, PARTS), name[:-4] if name.endswith(".npz") else name, ".npz",
                                 "parts/manifest.json: part file")
        return safeio.load_npz(path, "part file")
    except ValueError as e:
        raise RunDirError(str(e)) from None


def unflatten(flat: dict) -> dict:
    """{"a/b/c": x} -> {"a": {"b": {"c": x}}}."""
    out = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def read_weights(run: str, manifest: dict | None = None, num_layers: int | None = None) -> tuple:
    """(params, bn) of the run's compact network, every device's part merged: nested dicts whose ``layers`` maps
    the layer index (int) to that layer's tree, or with ``num_layers`` is a tuple of that length (``{}`` for a
    layer without weights, e.g. identity), as ``supernet.compact_apply`` takes it."""
    manifest = read_manifest(run) if manifest is None else manifest
    params, bn = {"layers": {}}, {"layers": {}}
    for dev, entry in manifest["devices"].items():
        tree = unflatten(read_part(run, dev, entry))
        for src, dst in ((tree.get("params", {}), params), (tree.get("bn", {}), bn)):
            for key, sub in src.items():
                if key == "layers":
                    dst["layers"].update({int(k): v for k, v in sub.items()})
                else:
                    dst[key] = sub
    if num_layers is not None:
        for t in (params, bn):
            t["layers"] = tuple(t["layers"].get(n, {}) for n in range(num_layers))
    return params, bn


def tuples(d):
    """Lists in a stored configuration back to tuples (the built-in configs hold tuples)."""
    if isinstance(d, dict):
        return {k: tuples(v) for k, v in d.items()}
    if isinstance(d, list):
        return tuple(tuples(v) for v in d)
    return d
