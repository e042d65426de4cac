"""Traced programs kept across runs: a rerun of the same configuration skips tracing and lowering its steps.

JAX's persistent compilation cache (:mod:`jmsnas.cache`) stores XLA's executables under a hash of the lowered
program, so even a run that finds every executable there first traces each jitted step to a jaxpr and lowers it
to StableHLO to compute that hash (in the main job's second run, compiling took 3.9-4.2 s with the executables
alone and takes 2.0-2.4 s with the programs kept as well). :func:`persistent_jit` keeps the lowered program itself (``jax.export``, serialized as a flatbuffer:
no pickle) under ``<cache root>/programs/``, named by a hash of everything that determines it:

- ``name`` and ``identity``: what the step is and the values its Python closure was built from (the search
  space, the cost table, the hyper-parameters; :func:`digest` hashes dataclasses, NamedTuples, containers, NumPy
  and JAX arrays and plain scalars exactly, and refuses anything else, which then runs as plain ``jax.jit``);
- the arguments' tree structure, shapes, dtypes, weak types and shardings;
- the environment that shapes a trace: every source file of the jmsnas package, the versions of jax, jaxlib,
  optax, flax, chex and numpy, JAX's configuration (all options but caching and logging), the ``JMSNAS_*``,
  ``JAX_*`` and ``XLA_*`` environment variables, the backend and its devices, and whether the native CPU
  kernels load.

On a hit the stored program is deserialized and inlined into the wrapper's own ``jax.jit`` (``exported.call``),
whose executable comes from the compilation cache as before; on a miss the step is exported (one trace and lowering, as ``jax.jit`` would
do), stored atomically (a temporary file, then ``os.replace``, so several processes may share the directory), and
called the same way. Both runs therefore execute the same executable: the second run's numbers equal the first's.
A damaged entry is replaced. The directory is bounded (:data:`MAX_BYTES`; the least recently used entries go).

The programs are kept only where JAX's persistent compilation cache is on (every ``jmsnas`` command, unless
``--no-compile-cache`` or ``JMSNAS_COMPILE_CACHE=0``) and the run is a single process; otherwise, and for steps
whose arguments, closure values or effects ``jax.export`` cannot take, :func:`persistent_jit` is ``jax.jit``.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.metadata
import os
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
from jax import export

from jmsnas import cache, safeio, timing

MAX_BYTES = 512 * 1024 ** 2  # the main job's five steps take 1.1 MB
SUFFIX = ".jaxprog"
_PACKAGES = ("jax", "jaxlib", "optax", "flax", "chex", "numpy")
# JAX options that do not change a traced program (where things are cached or logged)
_IGNORED_OPTION_WORDS = ("cache", "log", "explain", "dump", "debug_info")

_lock = threading.Lock()
_environment: list = []  # [digest of the sources and versions] once computed
_registered: set = set()


def directory() -> Path:
    """``<cache root>/programs``."""
    return cache.root() / "programs"


def enabled() -> bool:
    """Whether programs are kept: JAX's persistent compilation cache is on and this is a single-process run."""
    return bool(cache.requested() and jax.config.jax_compilation_cache_dir and jax.process_count() == 1)


def digest(value) -> str:
    """A SHA-256 of ``value``'s content: dataclasses and NamedTuples (type name and fields), dicts (sorted keys),
    lists, tuples, NumPy and JAX arrays (dtype, shape, bytes), str, bytes, bool, int, float, None and enums.
    Raises TypeError for anything else (a function, an object with state of its own), which has no content hash."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, v) -> None:
    if v is None or isinstance(v, (bool, int, float, str, bytes, np.generic, enum.Enum)):
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, (np.ndarray, jax.Array)):
        a = np.asarray(v)
        h.update(f"array:{a.dtype.str}:{a.shape}:".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        h.update(f"dataclass:{type(v).__module__}.{type(v).__qualname__}(".encode())
        for f in dataclasses.fields(v):
            h.update(f"{f.name}=".encode())
            _feed(h, getattr(v, f.name))
        h.update(b")")
    elif isinstance(v, tuple) and hasattr(v, "_fields"):
        h.update(f"namedtuple:{type(v).__module__}.{type(v).__qualname__}(".encode())
        for name in v._fields:
            h.update(f"{name}=".encode())
            _feed(h, getattr(v, name))
        h.update(b")")
    elif isinstance(v, (tuple, list)):
        h.update(f"{type(v).__name__}[{len(v)}](".encode())
        for item in v:
            _feed(h, item)
        h.update(b")")
    elif isinstance(v, dict):
        h.update(f"dict[{len(v)}](".encode())
        for key in sorted(v, key=repr):
            _feed(h, key)
            _feed(h, v[key])
        h.update(b")")
    else:
        raise TypeError(f"no content hash for a {type(v).__module__}.{type(v).__qualname__}")


def _package_sources() -> list[Path]:
    root = Path(__file__).resolve().parent
    return sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h") and p.is_file())


def _installed_digest() -> str:
    """The hash of the package's source files and the libraries' versions (fixed for a process: computed once)."""
    with _lock:
        if _environment:
            return _environment[0]
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in _package_sources():
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for pkg in _PACKAGES:
        try:
            version = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            version = None
        h.update(f"{pkg}={version};".encode())
    with _lock:
        if not _environment:
            _environment.append(h.hexdigest())
        return _environment[0]


def environment_digest() -> str:
    """The hash of what shapes a trace besides a step's own arguments (see the module docstring). The options,
    variables and devices are read at every call (a notebook may change them between runs); on the CPU backend
    it loads the native kernels, which a stored program may call."""
    from jmsnas import native

    h = hashlib.sha256(_installed_digest().encode())
    for key in sorted(jax.config.values):
        if not any(word in key for word in _IGNORED_OPTION_WORDS):
            h.update(f"{key}={jax.config.values[key]!r};".encode())
    for key in sorted(os.environ):
        if key.startswith(("JMSNAS_", "JAX_", "XLA_")) and key not in (cache.ENV_DIR, cache.ENV_SWITCH):
            h.update(f"{key}={os.environ[key]};".encode())
    backend = jax.default_backend()
    h.update(f"backend={backend};devices={[d.device_kind for d in jax.devices()]};".encode())
    h.update(f"native={native.load() if backend == 'cpu' else None};".encode())
    return h.hexdigest()


def _register_namedtuples(tree) -> None:
    """Let ``jax.export`` serialize the NamedTuple nodes of ``tree`` (a step's state types, optax's states)."""
    stack = [tree]
    while stack:
        t = stack.pop()
        if isinstance(t, tuple):
            cls = type(t)
            if hasattr(t, "_fields") and cls not in _registered:
                with _lock:
                    if cls not in _registered:
                        export.register_namedtuple_serialization(
                            cls, serialized_name=f"{cls.__module__}.{cls.__qualname__}")
                        _registered.add(cls)
            stack.extend(t)
        elif isinstance(t, list):
            stack.extend(t)
        elif isinstance(t, dict):
            stack.extend(t.values())


def _signature(args) -> str:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    parts = [str(treedef)]
    for a in leaves:
        aval = jax.typeof(a)
        parts.append(f"{aval.str_short()}:{getattr(aval, 'weak_type', False)}:{getattr(a, 'sharding', None)}")
    return "|".join(parts)


def _native_checks():
    from jmsnas import native
    return [export.DisabledSafetyCheck.custom_call(target) for target in native.TARGETS]


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with safeio.atomic_write(path, "wb") as f:  # its temporary name does not end in SUFFIX: _bound skips it
        f.write(data)
    _bound(path.parent, keep=path)


def _bound(folder: Path, keep: Path, limit: int = MAX_BYTES) -> None:
    """Remove the least recently used entries until the folder holds at most ``limit`` bytes (``keep`` stays)."""
    entries = []
    for p in folder.glob(f"*{SUFFIX}"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= limit:
            break
        if p != keep:
            try:
                p.unlink()
                total -= size
            except OSError:
                pass


class _Persistent:
    """The callable :func:`persistent_jit` returns.

    It is itself a ``jax.jit`` function (so JAX's own dispatch tells argument signatures apart, at no cost per
    call), whose Python body runs only when JAX traces it for a new signature: it then finds or makes the stored
    program for the concrete arguments of the call (their shardings included, which a trace does not see) and
    inlines it."""

    def __init__(self, jitted, name: str, identity, donate_argnums: tuple):
        self._jitted, self._name, self._donate = jitted, name, donate_argnums
        self._local = threading.local()
        self._outer = jax.jit(self._trace, donate_argnums=donate_argnums)
        try:
            self._identity = digest((name, identity))
        except TypeError:  # a closure value without a content hash: plain jax.jit
            self._identity = None
        self.__name__ = name
        self.__wrapped__ = jitted

    def __call__(self, *args):
        if self._identity is None or not enabled():
            return self._jitted(*args)
        self._local.args = args
        try:
            return self._outer(*args)
        finally:
            self._local.args = None

    def lower(self, *args):
        """``jax.jit``'s ``lower`` for these arguments (arrays, or ``jax.ShapeDtypeStruct`` with the shardings the
        arrays will have), through the stored program as a call traces: compiling the result gives the executable
        that a call with such arguments then runs without tracing again (``jmsnas.ahead``)."""
        if self._identity is None or not enabled():
            return self._jitted.lower(*args)
        self._local.args = args
        try:
            return self._outer.lower(*args)
        finally:
            self._local.args = None

    def _trace(self, *tracers):
        with timing.compiling():
            exported = self._program(self._local.args)
        return self._jitted(*tracers) if exported is None else exported.call(*tracers)

    def _program(self, args):
        """The stored program for these concrete arguments (exported and stored on a miss), or None."""
        key = hashlib.sha256(f"{self._identity}|{environment_digest()}|{_signature(args)}|{self._donate}"
                             .encode()).hexdigest()
        path = directory() / f"{self._name}-{key[:40]}{SUFFIX}"
        try:
            _register_namedtuples(args)
        except Exception:  # noqa: BLE001 - a tree export cannot describe runs as plain jit
            return None
        exported = self._load(path)
        if exported is not None:
            return exported
        try:
            exported = export.export(self._jitted, disabled_checks=_native_checks())(*args)
            data = exported.serialize()
        except Exception:  # noqa: BLE001 - callbacks, effects, unserializable outputs: plain jit
            return None
        try:
            _write(path, bytes(data))
        except OSError as e:
            warnings.warn(f"jmsnas: could not store the traced program {path}: {e}", RuntimeWarning, stacklevel=2)
        return exported

    @staticmethod
    def _load(path: Path):
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            exported = export.deserialize(bytearray(data))
        except Exception:  # noqa: BLE001 - a damaged or foreign entry: export again and replace it
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return exported


def persistent_jit(jitted, *, name: str, identity, donate_argnums=()):
    """``jitted`` (a ``jax.jit`` function) whose traced program is stored for later runs (module docstring).

    Args:
      jitted: the jitted step; called with positional arguments only.
      name: what it is (also the start of its file name), e.g. ``"search.weight_step"``.
      identity: every value the step's Python closure was built from (hashed with :func:`digest`); two steps with
        the same name and identity must trace to the same program.
      donate_argnums: the positional arguments ``jitted`` donates (the stored program is called with the same).

    Returns:
      a callable with ``jitted``'s signature and results.
    """
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a non-empty file-name-safe string, got {name!r}")
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return _Persistent(jitted, name, identity, donate)
