"""Load and call an exported part with nothing but jax and numpy (this file imports no other jmsnas module).

An export directory (``jmsnas export``) holds ``manifest.json`` and, per device, ``<device>.jaxexport`` (a
serialized ``jax.export.Exported``: StableHLO for the platforms it was exported for, with its input and output
shapes and dtypes) and ``<device>.npz`` (its weights, the program's leading arguments in the manifest's
``weight_names`` order). The manifest records the SHA-256 of both files; a part whose bytes, program signature or
weights do not match the manifest is refused with one ``DeployError`` line naming the device and the file::

    from jmsnas.deploy.runtime import load_part
    part = load_part("RUN/export", "sbs")
    y = part(x)                     # x: float32[batch, H, W, C] as part.inputs[0]["shape"]

The manifest records what made the programs (``versions()``: jax, jaxlib, the serialization schema version and
the calling convention; and the platforms). ``load_part`` refuses, before deserializing, a program this jax cannot
run — a newer serialization schema, or a calling convention outside the range this jax supports — with one line
naming both sides' versions and the command that exports the run again.

This file can be copied next to an export directory and imported on a machine without jmsnas.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import NamedTuple

import jax
import numpy as np
from jax import export as jax_export

FORMAT = "jmsnas-deploy/1"
MANIFEST = "manifest.json"


class DeployError(RuntimeError):
    """An export directory, part or pipeline that cannot be used; the message is one line naming the cause."""


def versions() -> dict:
    """What this process reads (and writes): jax and jaxlib versions, jax.export's serialization schema version and
    the range of calling conventions it runs (an export records the one its program uses)."""
    import jaxlib
    from jax._src.export import serialization as _ser  # the schema version has no public name
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "serialization_version": int(getattr(_ser, "_SERIALIZATION_VERSION", 0)),
            "calling_convention_supported": [int(jax_export.minimum_supported_calling_convention_version),
                                             int(jax_export.maximum_supported_calling_convention_version)]}


def export_versions(calling_convention: int | None = None) -> dict:
    """What an export records under ``versions``: ``versions()`` without the readable range, with the calling
    convention its programs use (default: the one this jax writes)."""
    made = {k: v for k, v in versions().items() if k != "calling_convention_supported"}
    cc = calling_convention if calling_convention is not None else jax.config.jax_export_calling_convention_version
    made["calling_convention_version"] = int(cc)
    return made


def reexport_command(manifest: dict, directory: str) -> str:
    """The command that exports the manifest's run again into ``directory`` (on the machine that loads it)."""
    cmd = f"jmsnas export --workdir {manifest.get('run', 'RUN')} --out {directory}"
    plats = manifest.get("platforms") or []
    return cmd + (f" --platforms {','.join(plats)}" if plats and plats != ["cpu"] else "")


def check_versions(manifest: dict, device: str, directory: str) -> None:
    """DeployError (one line, both sides' versions, the re-export command) if this jax cannot run the part."""
    made = manifest.get("versions")
    if not isinstance(made, dict):
        return  # an export from before the versions were recorded: deserialization itself decides
    here = versions()
    lo, hi = here["calling_convention_supported"]
    cc, ser = made.get("calling_convention_version"), made.get("serialization_version")
    problems = []
    if isinstance(ser, int) and ser > here["serialization_version"]:
        problems.append(f"serialization version {ser} > {here['serialization_version']} readable here")
    if isinstance(cc, int) and not lo <= cc <= hi:
        problems.append(f"calling convention {cc} outside {lo}..{hi} supported here")
    if problems:
        raise DeployError(f"part {device!r} was exported by jax {made.get('jax')} / jaxlib {made.get('jaxlib')} "
                          f"(serialization {ser}, calling convention {cc}); this is jax {here['jax']} / jaxlib "
                          f"{here['jaxlib']} ({'; '.join(problems)}); export it again here: "
                          f"{reexport_command(manifest, directory)}")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_manifest(directory: str) -> dict:
    """The export manifest; DeployError if it is missing, not JSON, of another format or lacks its parts."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "r", encoding="utf-8") as f:
            manifest = json.load(f)
    except OSError as e:
        raise DeployError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise DeployError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DeployError(f"{path} has format {got!r}, expected {FORMAT!r}")
    for key in ("parts", "links", "order", "kind"):
        if key not in manifest:
            raise DeployError(f"{path} lacks the key {key!r}")
    missing = [d for d in manifest["order"] if d not in manifest["parts"]]
    if missing:
        raise DeployError(f"{path}: devices {missing} of the execution order have no part")
    return manifest


class Part(NamedTuple):
    """A loaded part: ``part(*inputs)`` runs it on the default backend and returns a NumPy array.

    inputs: [{"from": device or "image", "shape": [...], "dtype": "float32"}] in argument order;
    output: {"shape": [...], "dtype": ...}; exported: the ``jax.export.Exported``; weights: its leading arguments.
    """

    device: str
    inputs: list
    output: dict
    exported: object
    weights: tuple
    fn: object

    def __call__(self, *xs):
        return np.asarray(self.fn(self.weights, *xs))


def check_file(directory: str, device: str, entry: dict, key: str) -> str:
    """The path of ``entry``'s ``key`` file (program or weights); DeployError when it is missing or its SHA-256
    differs from the recorded one."""
    name = entry.get(key)
    if not isinstance(name, str):
        raise DeployError(f"manifest part {device!r} has no {key!r} file")
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise DeployError(f"part {device!r}: file {path} is missing")
    want = entry.get(key + "_sha256")
    if want is not None and sha256(path) != want:
        raise DeployError(f"part {device!r}: file {path} is corrupt or does not match the manifest "
                          f"(SHA-256 differs from the recorded one)")
    return path


def part_files(entry: dict) -> list:
    """(stage entry, "program" or "weights") of every file of a part's manifest ``entry``, in the order the
    coordinator sends them: two per stage of a staged part (``Stages``), else its two."""
    return [(st, key) for st in entry.get("stages", [entry]) for key in ("program", "weights")]


def _avals(items) -> list:
    """(shape, dtype name) of arrays, avals or manifest entries {"shape", "dtype"}."""
    get = lambda a, k: a[k] if isinstance(a, dict) else getattr(a, k)
    return [(tuple(int(d) for d in get(a, "shape")), str(np.dtype(get(a, "dtype")))) for a in items]


def load_part(directory: str, device: str, manifest: dict | None = None) -> Part:
    """Deserializes ``device``'s program and weights and checks them against the manifest (DeployError if not)."""
    manifest = load_manifest(directory) if manifest is None else manifest
    if device not in manifest["parts"]:
        raise DeployError(f"no part for device {device!r} in {directory}; parts: {sorted(manifest['parts'])}")
    entry = manifest["parts"][device]
    prog_path = check_file(directory, device, entry, "program")
    w_path = check_file(directory, device, entry, "weights")
    check_versions(manifest, device, directory)
    try:
        with open(prog_path, "rb") as f:
            exported = jax_export.deserialize(bytearray(f.read()))
    except Exception as e:  # flatbuffer / version errors have no common type
        made = manifest.get("versions", {})
        raise DeployError(f"part {device!r}: {prog_path} is not a jax.export program this jax {jax.__version__} "
                          f"can read (exported by jax {made.get('jax', 'unknown')}): {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}; export it again here: "
                          f"{reexport_command(manifest, directory)}") from None
    try:
        with np.load(w_path, allow_pickle=False) as z:
            stored = {k: z[k] for k in z.files}
    except Exception as e:
        raise DeployError(f"part {device!r}: {w_path} is not a readable .npz: {type(e).__name__}: {e}") from None
    names = list(entry.get("weight_names", []))
    if sorted(stored) != sorted(names):
        extra, lacking = sorted(set(stored) - set(names)), sorted(set(names) - set(stored))
        raise DeployError(f"part {device!r}: {w_path} does not match the manifest's weights "
                          f"(extra {extra[:3]}, missing {lacking[:3]})")
    weights = tuple(stored[k] for k in names)
    want, got = _avals(weights) + _avals(entry["inputs"]), _avals(exported.in_avals)
    if want != got:
        raise DeployError(f"part {device!r}: the program's arguments {got[len(weights):]} (after "
                          f"{len(weights)} weights) do not match the manifest's inputs and weights "
                          f"{want[len(weights):]}")
    out, got_out = _avals([entry["output"]]), _avals(exported.out_avals)
    if got_out != out:
        raise DeployError(f"part {device!r}: the program returns {got_out}, the manifest says {out}")
    platform = jax.default_backend()
    platform = "cuda" if platform == "gpu" else platform
    if platform not in exported.platforms:
        raise DeployError(f"part {device!r} was exported for {list(exported.platforms)}, this backend is "
                          f"{platform!r} (export again with --platforms {platform})")
    fn = jax.jit(lambda w, *xs: exported.call(*w, *xs))
    return Part(device, list(entry["inputs"]), dict(entry["output"]), exported, weights, fn)


class Stages(NamedTuple):
    """A part as the worker runs it: a sequence of programs (a separable network's group,
    ``jmsnas.deploy.separable``; any other part is one stage): ``stages`` holds (Part, its manifest entry) in order;
    ``inputs`` the part's remote inputs (one per source)."""

    device: str
    inputs: list
    stages: tuple


def load_stages(directory: str, device: str, manifest: dict) -> Stages:
    """Loads every stage of ``device``'s part (``load_part`` on each: SHA-256, signature, versions, platform). A
    part of one program is one stage: it takes every input, sends its output to every device it goes to and, on
    the last device, to the result; a destination in its ``send_channels`` {device: k} gets only the output's first
    k channels (0: an empty frame, the trigger of an idle mesh branch), one in its ``send_slices`` {device: [start,
    stop]} only those bytes of its flat output (a composed part: one wire format per link)."""
    entry = manifest["parts"][device]
    if "stages" not in entry:
        cut, sl = entry.get("send_channels", {}), entry.get("send_slices", {})
        st = {"inputs": entry["inputs"], "send": [{"to": d, "channels": cut.get(d), "slice": sl.get(d),
                                                   "dtype": entry["output"]["dtype"]}
                                                  for d in entry["to"] if d != "result"],
              "carry": False, "result": "result" in entry["to"]}
        return Stages(device, list(entry["inputs"]), ((load_part(directory, device, manifest), st),))
    stages = tuple((load_part(directory, st["stage"], {**manifest, "parts": {st["stage"]: st}}), st)
                   for st in entry["stages"])
    return Stages(device, list(entry["inputs"]), stages)
