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
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import reprlib
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


def load_yaml(data, source: str, *, max_bytes: int = MAX_YAML_BYTES, max_depth: int = MAX_YAML_DEPTH):
    """Parse YAML ``data`` (str or bytes, bytes must be UTF-8) from ``source`` (a name for messages).

    Raises ValueError (one line) for text over ``max_bytes``, bytes that are not UTF-8, invalid YAML, nesting
    deeper than ``max_depth`` or a key defined twice in one mapping.
    """
    if isinstance(data, bytes):
        if len(data) > max_bytes:
            raise ValueError(f"{source} is {len(data)} bytes, more than the {max_bytes} accepted")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    elif len(data) > max_bytes:
        raise ValueError(f"{source} is {len(data)} characters, more than the {max_bytes} accepted")
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
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{what} {path!r} cannot be loaded: {type(e).__name__}: {clip(e)}") from None
    return module
