"""Children on disk: each child is an orbax checkpoint of its own (orbax ``StandardCheckpointer``) next to one
``manifest.json``; ``load`` restores them in parallel threads and can run inference on child i as soon
as children 1..i are loaded (Algorithm 2 of paper 002, case #2; case #1 is ``parallel >= k``).

Layout::

    OUT/manifest.json            {"format", "network", "fingerprint", "input_shape", "blocks": [{"name", "spec",
                                  "bytes", "arrays"}], "children": [{"index", "dir", "blocks": [a, b], "bytes",
                                  "leaves", "sha256"}], ...}   (blocks a..b-1 form the child)
    OUT/child_00/state/          orbax checkpoint of {"block_003": params of block 3, ..., "range": [a, b]}
    OUT/child_00/child.json      {"network": fingerprint, "child": i, "blocks": [a, b]}

Safety: ``write`` builds everything in a temporary sibling directory and renames it to OUT at the end
(``safeio.atomic_dir``), so OUT is never half-written; it refuses an OUT that exists and is not empty. ``load``
checks the manifest and that every child directory exists before reading any array; every child's meta must name the
manifest's network and block range (children of two networks mixed in one directory are refused), and the sha256 of
each restored child must equal the manifest's (a flipped byte is caught even where the file format has no checksum).
Any failure raises a one-line ``ModularError`` and returns nothing: no partially loaded network.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

import orbax.checkpoint as ocp

from jmsnas import runcheck, safeio
from jmsnas.checkpoint import CheckpointError, file_digests, leaf_specs, verify_digests
from jmsnas.run.directory import unflatten
from jmsnas.modular.blocks import (ModularError, Network, block_arrays, block_bytes, fingerprint, forward,
                                   tree_sha256)

FORMAT = "jmsnas-modular/1"
MANIFEST = "manifest.json"
CHILD_META = "child.json"


def child_dir(i: int) -> str:
    return f"child_{i:02d}"


def block_key(j: int) -> str:
    return f"block_{j:03d}"


def prune(tree):
    """``tree`` without empty dicts (orbax does not store them; the loader treats a missing key as empty)."""
    if not isinstance(tree, dict):
        return tree
    out = {k: prune(v) for k, v in tree.items()}
    return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}


def check_cuts(cuts, num_blocks: int) -> list:
    """Child boundaries [0, c1, ..., N] as ints, strictly increasing (every child has a block), or ModularError."""
    c = [int(x) for x in cuts]
    if len(c) < 2 or c[0] != 0 or c[-1] != num_blocks or any(b <= a for a, b in zip(c, c[1:])):
        raise ModularError(f"child boundaries {c} must increase strictly from 0 to the {num_blocks} blocks")
    return c


def write_child(path: str, tree, meta: dict) -> None:
    """Save one child: the orbax checkpoint ``<path>/state`` and its identity ``<path>/child.json`` (meta)."""
    os.makedirs(path, exist_ok=True)
    ck = ocp.StandardCheckpointer()
    try:
        ck.save(os.path.abspath(os.path.join(path, "state")), tree)  # orbax needs an absolute path
        ck.wait_until_finished()
    finally:
        ck.close()
    # the sha256 of every file orbax wrote, checked before a restore hands them to orbax (a damaged file is one
    # line, and tensorstore never meets it)
    meta = {**meta, "files_sha256": file_digests(os.path.join(path, "state"))}
    with open(os.path.join(path, CHILD_META), "w", encoding="utf-8") as f:
        json.dump(meta, f)


def template(leaves: dict) -> dict:
    """Nested dict of empty numpy arrays from ``{"a/b": [shape, dtype]}`` (the restore template)."""
    return unflatten({name: np.empty(tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in leaves.items()})


def read_child(path: str, leaves: dict, expect_meta: dict, where: str) -> dict:
    """Restore one child as numpy arrays after checking its ``child.json`` against ``expect_meta``; the tree must
    match ``leaves`` (orbax checks it against the stored metadata before reading arrays). Raises ModularError.

    orbax is used directly rather than through ``jmsnas.checkpoint.Checkpointer``: that class's manager, its
    separate meta and metadata reads and its garbage collection after every read cost ~0.4 s per checkpoint
    here (measured), which would swamp the loading time of small children."""
    try:
        with open(os.path.join(path, CHILD_META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ModularError(f"{where} is corrupt or missing its {CHILD_META}: {safeio.error_line(e)}") from None
    if not isinstance(meta, dict):
        raise ModularError(f"{where} is corrupt: {CHILD_META} is not a JSON object")
    if meta.get("network") != expect_meta["network"]:
        raise ModularError(f"{where} belongs to network {meta.get('network')!r}, not to the manifest's "
                           f"{expect_meta['network']!r}: children of two networks are mixed")
    for key in ("child", "blocks"):
        if meta.get(key) != expect_meta[key]:
            raise ModularError(f"{where}: its {key} is {meta.get(key)!r}, the manifest expects {expect_meta[key]!r} "
                               "(children of two modularizations are mixed)")
    if isinstance(meta.get("files_sha256"), dict):
        try:
            verify_digests(os.path.join(path, "state"), where, meta["files_sha256"])
        except CheckpointError as e:
            raise ModularError(str(e)) from None
    ck = ocp.StandardCheckpointer()
    try:
        return ck.restore(os.path.abspath(os.path.join(path, "state")), template(leaves))
    except Exception as e:
        raise ModularError(f"{where} is corrupt or unreadable: {safeio.error_line(e)}") from None
    finally:
        ck.close()


# ------------------------------------------------------------------------------------------------ write

def _check_out(out_dir: str) -> None:
    try:
        runcheck.check_out_dir(out_dir, "output directory")
    except ValueError as e:
        raise ModularError(str(e)) from None
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ModularError(f"output directory {out_dir!r} exists and is not empty; choose a new one "
                           "(nothing was written)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ModularError(f"cannot create output directory {out_dir!r}: {parent!r} is not a writable directory")


def write(net: Network, cuts, out_dir: str, extra: dict | None = None,
          progress: Callable[[int, int], None] | None = None) -> dict:
    """Save ``net`` as children ``cuts`` (boundaries [0, ..., N]) into the new directory ``out_dir``; returns the
    manifest. ``extra`` adds keys to the manifest (the split strategy, the load model, predictions)."""
    cuts = check_cuts(cuts, len(net.blocks))
    _check_out(out_dir)
    fp = fingerprint(net)
    with safeio.atomic_dir(out_dir) as tmp:  # out_dir (empty, checked above) is replaced only when all is written
        children = []
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            tree = prune({block_key(j): net.blocks[j].params for j in range(a, b)})
            tree["range"] = np.asarray([a, b], np.int32)  # never empty, even for a child of parameter-free blocks
            write_child(os.path.join(tmp, child_dir(i)), tree, {"network": fp, "child": i, "blocks": [a, b]})
            children.append({"index": i, "dir": child_dir(i), "blocks": [a, b],
                             "bytes": sum(block_bytes(net.blocks[j]) for j in range(a, b)),
                             "leaves": {k: [list(s), d] for k, (s, d) in leaf_specs(tree).items()},
                             "sha256": tree_sha256(tree)})
            if progress:
                progress(i + 1, len(cuts) - 1)
        manifest = {"format": FORMAT, "network": net.name, "fingerprint": fp, "input_shape": list(net.input_shape),
                    "blocks": [{"name": b.name, "spec": b.spec, "bytes": block_bytes(b), "arrays": block_arrays(b)}
                               for b in net.blocks],
                    "children": children, **(extra or {})}
        write_manifest(tmp, manifest)
    return manifest


def write_manifest(directory: str, manifest: dict) -> None:
    """Atomically (``safeio.atomic_write``) write ``manifest.json``."""
    with safeio.atomic_write(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


# ------------------------------------------------------------------------------------------------ read

def read_manifest(directory: str) -> dict:
    """The manifest of a modularized network, checked for format and consistency, or ModularError."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise ModularError(f"{directory!r} is not a directory of children")
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        raise ModularError(f"{directory!r} has no {MANIFEST}; it was not written by jmsnas modularize") from None
    except (OSError, ValueError) as e:
        raise ModularError(f"{path!r} is corrupt: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ModularError(f"{path!r} has format {m.get('format') if isinstance(m, dict) else None!r}, "
                           f"expected {FORMAT!r}")
    try:
        n = len(m["blocks"])
        bounds = [c["blocks"] for c in m["children"]]
        check_cuts([0] + [b for _, b in bounds], n)
        if [a for a, _ in bounds] != [0] + [b for _, b in bounds[:-1]]:
            raise ModularError("children are not contiguous")
        for i, c in enumerate(m["children"]):
            d = c.get("dir")
            if c.get("index") != i or not isinstance(d, str) or not isinstance(c.get("leaves"), dict) \
                    or not isinstance(c.get("sha256"), str) or os.sep in d or d in ("", ".", ".."):
                raise ModularError(f"child entry {i} is malformed")
        if not isinstance(m.get("fingerprint"), str) or not isinstance(m.get("input_shape"), list):
            raise ModularError("fingerprint or input_shape is malformed")
    except (KeyError, TypeError, ValueError) as e:
        raise ModularError(f"{path!r} is corrupt: {e}") from None
    missing = [c["dir"] for c in m["children"] if not os.path.isdir(os.path.join(directory, c["dir"]))]
    if missing:
        raise ModularError(f"{directory!r}: child directories {missing} are missing (nothing was loaded)")
    return m


class Event(NamedTuple):
    child: int
    what: str  # "loaded" or "inferred"
    t_s: float  # seconds since the start of the load


class LoadResult(NamedTuple):
    threads: int  # loading threads used
    children: list  # per child: dict block_key -> params (numpy)
    output: object  # the prediction (None without an input)
    load_s: float  # until every child is restored
    first_prediction_s: float | None  # until the network's output is ready (None without an input)
    child_loaded_s: list  # per child: when its restore finished
    child_restore_s: list  # per child: how long its restore took (in its thread)
    manifest: dict


def load(directory: str, parallel: int | None = None, x=None, verify: bool = True,
         on_event: Callable[[Event], None] | None = None) -> LoadResult:
    """Restore every child of ``directory`` with ``parallel`` threads (default and cap: the hardware threads and the
    number of children); with an input ``x`` [B, H, W, C], child i runs as soon as it and every earlier child are
    loaded, overlapping inference with the loading of later children. All or nothing: on any error the pending
    restores are cancelled and a ModularError is raised."""
    m = read_manifest(directory)
    k = len(m["children"])
    hw = os.cpu_count() or 1
    p = min(hw, k) if parallel is None else parallel
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ModularError(f"--parallel must be an integer >= 1, got {parallel!r}")
    p = min(p, hw, k)  # more threads than hardware threads only adds contention (paper 002, section 4.2.2)
    if x is not None and tuple(np.shape(x)[1:]) != tuple(m["input_shape"]):
        raise ModularError(f"input shape {tuple(np.shape(x)[1:])} per example does not match the network's "
                           f"{tuple(m['input_shape'])}")
    lock = threading.Lock()
    t0 = time.perf_counter()
    loaded_at, restore_s, trees = [None] * k, [None] * k, [None] * k
    emit = (lambda ev: on_event(ev)) if on_event else (lambda ev: None)

    def job(c):  # restore child c, checked against the manifest; (its tree, how long the restore took)
        start, where = time.perf_counter(), f"child {c['index']} ({c['dir']})"
        expect = {"network": m["fingerprint"], "child": c["index"], "blocks": list(c["blocks"])}
        tree = read_child(os.path.join(directory, c["dir"]), c["leaves"], expect, where)
        if verify and tree_sha256(tree) != c["sha256"]:
            raise ModularError(f"{where} is corrupt: its arrays' sha256 differs from the manifest's")
        dt = time.perf_counter() - start
        with lock:
            loaded_at[c["index"]] = time.perf_counter() - t0
            emit(Event(c["index"], "loaded", loaded_at[c["index"]]))
        return tree, dt

    pool = cf.ThreadPoolExecutor(max_workers=p, thread_name_prefix="jmsnas-load")
    futures = [pool.submit(job, c) for c in m["children"]]
    y, first = None, None
    try:
        h = None if x is None else np.asarray(x, np.float32)
        for i, (c, fut) in enumerate(zip(m["children"], futures)):
            trees[i], restore_s[i] = fut.result()
            if h is not None:
                h = run_child(m, c, trees[i], h)
                h.block_until_ready()
                emit(Event(i, "inferred", time.perf_counter() - t0))
        if h is not None:
            y, first = np.asarray(h), time.perf_counter() - t0
    except BaseException:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)
        raise
    pool.shutdown(wait=True)
    return LoadResult(p, trees, y, max(loaded_at), first, loaded_at, restore_s, m)


def run_child(m: dict, c: dict, tree: dict, h):
    """The output of child ``c`` of manifest ``m`` (its restored ``tree``) on the previous child's output ``h``."""
    a, b = c["blocks"]
    return forward([bl["spec"] for bl in m["blocks"][a:b]])([tree.get(block_key(j), {}) for j in range(a, b)], h)

