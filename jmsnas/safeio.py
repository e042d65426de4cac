"""Safe input and output shared by every command: capped YAML parsing, short reprs, atomic writes, the workdir guard.

* :func:`load_yaml` parses untrusted YAML text after checking its size, its nesting depth and duplicate mapping
  keys with libyaml's event parser (iterative, so a file of 100,000 nested ``[`` cannot overflow the C stack of the
  recursive composer), and reports every problem as one ``ValueError`` line.
* :func:`short` is ``repr`` capped in length and nesting (a "billion laughs" alias chain has a tiny object graph but
  an astronomically long repr; messages must never format one in full).
* :func:`atomic_write` writes a file through a temporary file in the same directory and ``os.replace``: a process
  killed while writing leaves the previous file (or none), never a truncated one.
* :func:`run_outputs` lists what in a workdir belongs to a run (checkpoints, result.json, plots, parts, ...), so a
  new run refuses a workdir holding any of it, not only checkpoints.
* :func:`load_json` / :func:`read_json` parse untrusted JSON with the same caps (size, depth) and refuse a key
  defined twice in one object; :func:`load_npz` opens an ``.npz`` file and reports a truncated or foreign file as
  one line.
* :func:`safe_name` checks a name that becomes a file name (a device's ``<name>.npz``): one path component, no
  separator, no ``..``, printable, at most 64 characters; :func:`child_path` joins such a name under a folder and
  proves the result stays inside it.
* :func:`atomic_dir` builds a folder under a temporary sibling name and renames it into place at the end, so a
  failure (a full disk, a kill) leaves the previous folder or none, never a partial one; :func:`write_errors`
  turns an OSError while writing (ENOSPC, EACCES, EROFS, ...) into one ValueError line naming what was written.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import re
import reprlib
import shutil
import tempfile

import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Parser = getattr(yaml, "CParser", None)

MAX_YAML_BYTES = 64 * 2**20  # 64 MiB: the published tables are a few hundred kB
MAX_YAML_DEPTH = 64  # the project's formats nest at most 4 deep

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 80, 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8


def short(value, limit: int = 120) -> str:
    """``repr(value)`` shortened to at most ``limit`` characters and 3 levels of nesting (never expands a huge
    or deeply shared structure)."""
    text = _repr.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(message, limit: int = 240) -> str:
    """``message`` on one line, cut to ``limit`` characters."""
    text = one_line(message)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message`` of an exception, shortened to ``limit`` characters."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(message: str) -> str:
    """``message`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(message).split())


def _check_events(text: str, source: str, max_depth: int) -> None:
    """Walk the YAML event stream: depth <= max_depth, no duplicate scalar key in any mapping."""
    stack = []  # per open collection: [is_mapping, seen keys, next node is a key]
    for ev in yaml.parse(text, Loader=_Loader):
        if isinstance(ev, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent)) and stack:
            top = stack[-1]
            if top[0]:
                if top[2] and isinstance(ev, yaml.ScalarEvent):
                    if ev.value in top[1]:
                        line = ev.start_mark.line + 1 if ev.start_mark is not None else "?"
                        raise ValueError(f"{source}: key {short(ev.value)} is defined twice in one mapping "
                                         f"(line {line}); expected each key once")
                    top[1].add(ev.value)
                top[2] = not top[2]
        if isinstance(ev, yaml.CollectionStartEvent):
            stack.append([isinstance(ev, yaml.MappingStartEvent), set(), True])
            if len(stack) > max_depth:
                raise ValueError(f"{source}: YAML nested more than {max_depth} levels deep; expected a flat table")
        elif isinstance(ev, yaml.CollectionEndEvent):
            stack.pop()


def _text(data, source: str, max_bytes: int) -> str:
    """``data`` as text: at most ``max_bytes`` long, bytes decoded as UTF-8; one ValueError line otherwise."""
    if isinstance(data, bytes):
        if len(data) > max_bytes:
            raise ValueError(f"{source} is {len(data)} bytes, more than the {max_bytes} accepted")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{source} is {len(data)} characters, more than the {max_bytes} accepted")
    return data


def load_yaml(data, source: str, *, max_bytes: int = MAX_YAML_BYTES, max_depth: int = MAX_YAML_DEPTH):
    """Parse YAML ``data`` (str or bytes, bytes must be UTF-8) from ``source`` (a name for messages).

    Raises ValueError (one line) for text over ``max_bytes``, bytes that are not UTF-8, invalid YAML, nesting
    deeper than ``max_depth`` or a key defined twice in one mapping.
    """
    data = _text(data, source, max_bytes)
    try:
        _check_events(data, source, max_depth)
        return yaml.load(data, Loader=_Loader)
    except yaml.YAMLError as e:
        if "maximum nesting depth" in str(e):  # libyaml >= 0.2.5 stops at its own limit (1000) while scanning ahead
            raise ValueError(f"{source}: YAML nested more than {max_depth} levels deep; expected a flat table") \
                from None
        raise ValueError(f"{source} is not valid YAML: {one_line(e)}") from None
    except RecursionError:
        raise ValueError(f"{source}: YAML nested too deeply") from None


def read_bytes(path, what: str, max_bytes: int = MAX_YAML_BYTES) -> bytes:
    """The bytes of ``path``; ValueError (one line, naming ``what``) when it cannot be read or is too large."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise ValueError(f"{what} {path!r} is {size} bytes, more than the {max_bytes} accepted")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


@contextlib.contextmanager
def atomic_write(path, mode: str = "w", **kwargs):
    """Open a temporary file next to ``path`` for writing; on success it replaces ``path`` atomically (fsync'd),
    on an exception it is removed and ``path`` is left as it was."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# names a run writes into its workdir (checkpoints/ counts only when it holds a file)
RUN_OUTPUTS = ("result.json", "history.json", "summary.txt", "evolution.json", "config.json", "history.png",
               "latency_breakdown.png", "architecture.png", "parts")


def _has_file(directory: str) -> bool:
    return any(files for _, _, files in os.walk(directory))


def run_outputs(workdir: str) -> list:
    """The run outputs present in ``workdir`` (names of RUN_OUTPUTS, plus checkpoints/ if it holds any file)."""
    if not os.path.isdir(workdir):
        return []
    found = [n for n in RUN_OUTPUTS if os.path.lexists(os.path.join(workdir, n))]
    ckpt = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt) and _has_file(ckpt):
        found.insert(0, "checkpoints/")
    return found


def call_user(fn, what: str, *args):
    """``fn(*args)`` for user code (a config's get_config); any exception becomes one ValueError line."""
    try:
        return fn(*args)
    except SystemExit as e:  # sys.exit() in user code is a failing user file, not the command's own exit
        raise ValueError(f"{what} called sys.exit({clip(e.code)!s}); a config or model must return, not exit"
                         ) from None
    except Exception as e:  # noqa: BLE001 - user code may raise anything; report it in one line
        raise ValueError(f"{what} failed: {type(e).__name__}: {clip(e)}") from None


def import_file(path: str, what: str, module_name: str):
    """Execute the Python file ``path`` as a module; a missing file or any error while executing it (a
    SyntaxError, an ImportError, ...) becomes one ValueError line naming ``what`` and the error's line."""
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(f"{what} {path!r} has a Python syntax error at line {e.lineno}: {e.msg}") from None
    except SystemExit as e:  # sys.exit() at import is a failing user file, not the command's own exit
        raise ValueError(f"{what} {path!r} called sys.exit({clip(e.code)!s}) while loading; it must define, not "
                         "exit") from None
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{what} {path!r} cannot be loaded: {type(e).__name__}: {clip(e)}") from None
    return module


# ------------------------------------------------------------------------------------------ JSON and npz

MAX_JSON_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64


def _no_duplicates(source: str):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"{source}: key {short(k)} is defined twice in one object; expected each key once")
            seen.add(k)
        return dict(pairs)
    return hook


def _json_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` outside strings (checked before parsing: json's parser recurses)."""
    depth = worst = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            worst = max(worst, depth)
        elif ch in "]}":
            depth -= 1
    return worst


def load_json(data, source: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """Parse JSON ``data`` (str or UTF-8 bytes) from ``source``; ValueError (one line) for text over ``max_bytes``,
    bytes that are not UTF-8, invalid JSON, nesting deeper than ``max_depth`` or a key defined twice."""
    data = _text(data, source, max_bytes)
    if _json_depth(data) > max_depth:
        raise ValueError(f"{source}: JSON nested more than {max_depth} levels deep")
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates(source))
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{source}: JSON nested too deeply") from None


def read_json(path, what: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """The parsed JSON file ``path`` (``load_json`` after ``read_bytes``): one ValueError line naming ``what``."""
    path = os.fspath(path)
    return load_json(read_bytes(path, what, max_bytes), f"{what} {path!r}", max_bytes=max_bytes, max_depth=max_depth)


def load_npz(path, what: str) -> dict:
    """Every array of the ``.npz`` file ``path`` (read without pickles); ValueError (one line) for a missing,
    truncated or foreign file."""
    import numpy as np
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise ValueError(f"{what} {path!r} is missing") from None
    except Exception as e:  # noqa: BLE001 - BadZipFile, zlib.error, EOFError, ValueError, OSError: all "damaged"
        raise ValueError(f"{what} {path!r} is damaged or not an .npz file ({type(e).__name__}: {clip(e, 120)})") \
            from None


# ------------------------------------------------------------------------------------------ names and folders

MAX_NAME = 64
_NAME_BAD = re.compile(r"[/\\\x00-\x1f\x7f:*?\"<>|]")


def name_problem(name) -> str | None:
    """Why ``name`` cannot be a file name of its own (None when it can): it must be a non-empty string of at most
    MAX_NAME characters without path separators, control characters or ``:*?"<>|``, not ``.``/``..``, not
    starting with ``-`` or ``.`` and without surrounding spaces."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if len(name) > MAX_NAME:
        return f"must be at most {MAX_NAME} characters"
    bad = _NAME_BAD.search(name)
    if bad:
        return f"must not contain {bad.group(0)!r} (it names a file: no path separators or special characters)"
    if name.startswith((".", "-")):
        return "must not start with '.' or '-' (it names a file)"
    if name != name.strip():
        return "must not start or end with a space"
    return None


def safe_name(name, what: str) -> str:
    """``name`` when it can be a file name of its own (``name_problem``), else one ValueError line."""
    problem = name_problem(name)
    if problem:
        raise ValueError(f"{what} {problem}, got {short(name)}")
    return name


def inside(path, folder) -> bool:
    """True when ``path`` is ``folder`` or under it (both resolved: links followed, ``..`` removed)."""
    p, f = os.path.realpath(os.fspath(path)), os.path.realpath(os.fspath(folder))
    return p == f or p.startswith(f.rstrip(os.sep) + os.sep)


def child_path(folder, name: str, suffix: str = "", what: str = "name") -> str:
    """``folder/<name><suffix>`` for a safe ``name``; ValueError if the result would leave ``folder``."""
    safe_name(name, what)
    path = os.path.join(os.fspath(folder), name + suffix)
    if not inside(path, folder) or os.path.realpath(path) == os.path.realpath(folder):
        raise ValueError(f"{what} {short(name)} would write outside {os.fspath(folder)!r}")
    return path


DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
               errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "the file system is read-only"}


def os_error_text(e: OSError) -> str:
    """An OSError as a few words: what went wrong and the file."""
    what = DISK_ERRORS.get(e.errno) or e.strerror or type(e).__name__
    return f"{what} ({e.filename})" if e.filename else what


@contextlib.contextmanager
def write_errors(what: str):
    """An OSError inside the block (ENOSPC, EACCES, EROFS, ...) becomes one ValueError line naming ``what``."""
    try:
        yield
    except OSError as e:
        why = DISK_ERRORS.get(e.errno) or e.strerror or type(e).__name__  # not the file: a temporary name
        raise ValueError(f"cannot write {what}: {why}; nothing partial was left") from None


def npz_folder(path, arrays: dict, manifest: dict) -> None:
    """``path`` as one folder (``atomic_dir``): ``<name>.npz`` of every {name: {key: array}} of ``arrays`` (a name
    inside the folder only, ``child_path``) and ``manifest.json`` (indented JSON): a run's parts/, Auto-Split's."""
    import numpy as np
    with atomic_dir(path) as tmp:
        for name, flat in arrays.items():
            np.savez(child_path(tmp, name, ".npz", "device name"), **flat)
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)


def remove_partial_writes(directory) -> None:
    """Delete what :func:`atomic_write` and :func:`atomic_dir` leave when their process is killed mid-write (a
    file or folder named ``.<name>.<random>.tmp`` or ``.old``) anywhere under ``directory``; the caller must be its
    only writer (e.g. it holds the workdir's lock)."""
    for root, dirs, files in os.walk(os.fspath(directory)):
        for name in [*files, *dirs]:
            if name.startswith(".") and name.endswith((".tmp", ".old")) and name.count(".") >= 3:
                path = os.path.join(root, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.remove(path)
        dirs[:] = [d for d in dirs if os.path.isdir(os.path.join(root, d))]  # not into the folders just removed


@contextlib.contextmanager
def atomic_dir(path):
    """Yield a new temporary folder next to ``path``; on success it replaces ``path`` (an existing ``path`` is
    removed only then), on any exception it is deleted and ``path`` is left as it was."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        old = None
        if os.path.lexists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".old", dir=parent)
            os.rename(path, os.path.join(old, "x"))
        os.rename(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
