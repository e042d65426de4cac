"""Where jmsnas keeps what it compiles: XLA executables (JAX's persistent compilation cache) and the native kernels.

The cache root is ``$JMSNAS_CACHE_DIR``, else ``$XDG_CACHE_HOME/jmsnas``, else ``~/.cache/jmsnas``:

- ``<root>/xla/``: JAX's persistent compilation cache. Every jitted function's executable is stored under a hash
  of its program (StableHLO), the compile options, the backend and the jax/jaxlib versions, so a second run of the
  same configuration loads its steps instead of compiling them again (the same executable, so the same numbers).
- ``<root>/native/``: the C++ kernels of :mod:`jmsnas.native`, named by a hash of their sources and compiler.
- ``<root>/programs/``: the traced programs of the commands' steps (:mod:`jmsnas.programs`), so that a rerun
  skips tracing and lowering them as well; kept only while the compilation cache is on.
- ``<root>/data/``: the embedded digits' splits (:mod:`jmsnas.data`), so that a rerun need not import
  scikit-learn to make them again.

Every ``jmsnas`` command turns the compilation cache on (:func:`enable_compilation_cache`); ``--no-compile-cache``
or ``JMSNAS_COMPILE_CACHE=0`` leave it off. A library user calls :func:`enable_compilation_cache` once before the
first jitted call. A directory that JAX was already pointed at (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``)
is kept as it is.

The cache is bounded (:data:`MAX_BYTES`) by :func:`trim`, at most once every :data:`TRIM_EVERY_S` per directory,
when a command turns the cache on: the least recently used executables go first. JAX's own bound
(``jax_compilation_cache_max_size``) is left off because it re-reads the whole directory, under a lock, on every
entry it writes: with this machine's 6,463 entries that is 0.32 s per new executable, and the main job's first run
against that cache took 79.4 s instead of 59.3 s against an empty one (``benchmarks/README.md``). Without it JAX
writes an entry in place with no lock; only process 0 of a multi-process run writes, and another process that
reads an entry while it is being written gets an unreadable entry, which JAX reports with a warning and compiles
again (never a wrong executable: an entry is a compressed, checked frame).
"""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

ENV_DIR = "JMSNAS_CACHE_DIR"
ENV_SWITCH = "JMSNAS_COMPILE_CACHE"
# bound of the executables kept (bytes); the main job's are ~25 MB, a CIFAR-sized search's a few hundred MB
MAX_BYTES = 4 * 1024 ** 3
# how often (seconds) a directory is trimmed to MAX_BYTES; Linux's default relatime updates a file's access time
# at most once a day, so a day is also the resolution of "least recently used"
TRIM_EVERY_S = 24 * 3600
TRIM_STAMP = ".trimmed"
_ENTRY, _ATIME = "-cache", "-atime"  # JAX's names: an executable, and the access time its own bound keeps


def root() -> Path:
    """The cache root: $JMSNAS_CACHE_DIR, else $XDG_CACHE_HOME/jmsnas, else ~/.cache/jmsnas."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "jmsnas"


def xla_dir() -> Path:
    """JAX's persistent compilation cache: ``<root>/xla``."""
    return root() / "xla"


def native_dir() -> Path:
    """The native kernels' libraries: ``<root>/native``."""
    return root() / "native"


def requested() -> bool:
    """Whether the environment leaves the compilation cache on: ``JMSNAS_COMPILE_CACHE`` unset or ``1`` yes, ``0``
    no, anything else a ValueError naming the value."""
    value = os.environ.get(ENV_SWITCH)
    if value is None or value.strip() == "1":
        return True
    if value.strip() == "0":
        return False
    raise ValueError(f"{ENV_SWITCH} must be 0 (no persistent compilation cache) or 1 (use it), got {value!r}")


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache in ``directory`` (default :func:`xla_dir`).

    Returns the directory in use, or None when the cache stays off (``JMSNAS_COMPILE_CACHE=0``, or the directory
    cannot be written: a warning says so and every run compiles). Every executable is stored whatever its compile
    time (JAX's default keeps only those that took more than 1 s; the main job's many small ones add up).
    A directory that JAX already has (``JAX_COMPILATION_CACHE_DIR``) is kept, with its settings. Call it before
    the first jitted call (later calls reset JAX's cache handle, so they also work).
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    if not requested():
        return None
    current = jax.config.jax_compilation_cache_dir
    if current and directory is None:
        return str(current)
    path = Path(directory).expanduser() if directory is not None else xla_dir()
    if not _writable(path):
        warnings.warn(f"the compilation cache directory {str(path)!r} is not writable; every run compiles anew "
                      f"(set {ENV_DIR} to a writable directory, or {ENV_SWITCH}=0 to silence this)",
                      RuntimeWarning, stacklevel=2)
        return None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    trim_if_due(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    cc.reset_cache()  # JAX opens its cache once, at the first compilation: point it at the new directory
    return str(path)


def disable_compilation_cache() -> None:
    """Turn JAX's persistent compilation cache off for the rest of the process."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()


def trim(directory: str | os.PathLike, max_bytes: int = MAX_BYTES) -> int:
    """Delete the least recently used executables of the JAX cache in ``directory`` (by the later of each file's
    access and modification time) until the rest take at most ``max_bytes``; returns the bytes deleted. An entry
    another process deletes first is skipped, one this process may not delete stays."""
    entries, total = [], 0
    with os.scandir(directory) as it:
        for e in it:
            if e.name.endswith(_ENTRY) and e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                entries.append((max(st.st_atime_ns, st.st_mtime_ns), e.name, st.st_size))
                total += st.st_size
    entries.sort()
    deleted = 0
    for _, name, size in entries:
        if total <= max_bytes:
            break
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass  # another process deleted it first
        except OSError:
            continue  # not this user's to delete (a shared directory): it stays, and counts
        try:
            os.unlink(os.path.join(directory, name[:-len(_ENTRY)] + _ATIME))
        except OSError:
            pass
        total -= size
        deleted += size
    return deleted


def trim_if_due(directory: str | os.PathLike, max_bytes: int | None = None, every_s: float | None = None) -> bool:
    """:func:`trim` ``directory`` to ``max_bytes`` (None: :data:`MAX_BYTES`) unless it was trimmed less than
    ``every_s`` seconds (None: :data:`TRIM_EVERY_S`) ago, as its ``.trimmed`` stamp says; returns whether it
    trimmed."""
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    every_s = TRIM_EVERY_S if every_s is None else every_s
    stamp = Path(directory) / TRIM_STAMP
    try:
        if time.time() - stamp.stat().st_mtime < every_s:
            return False
    except FileNotFoundError:
        pass
    trim(directory, max_bytes)
    stamp.touch()
    return True
