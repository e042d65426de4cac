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
first jitted call. Several processes may share the directory: the cache is bounded (:data:`MAX_BYTES`, least
recently used entries go first), and JAX then reads and writes every entry under an inter-process file lock
(``filelock``), so no process sees another's half-written entry. A directory that JAX was already pointed at
(``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept as it is.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

ENV_DIR = "JMSNAS_CACHE_DIR"
ENV_SWITCH = "JMSNAS_COMPILE_CACHE"
# bound of the executables kept (bytes); the main job's are ~25 MB, a CIFAR-sized search's a few hundred MB
MAX_BYTES = 4 * 1024 ** 3


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
    if jax.config.jax_compilation_cache_max_size == -1 and _have_filelock():
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", str(path))
    cc.reset_cache()  # JAX opens its cache once, at the first compilation: point it at the new directory
    return str(path)


def disable_compilation_cache() -> None:
    """Turn JAX's persistent compilation cache off for the rest of the process."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()


def _have_filelock() -> bool:
    try:
        import filelock  # noqa: F401  (JAX locks its cache with it when the cache is bounded)
        return True
    except ImportError:
        return False
