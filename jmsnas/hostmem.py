"""Host memory: keep freed memory in the process so that XLA:CPU does not fault it in again every step.

XLA:CPU allocates each execution's temporaries as one block (the supernet weight step's is 992 MB) on one of its
worker threads and frees it at the end. glibc gives such a thread its own arena, whose heaps hold at most 64 MB,
so the block is always a fresh ``mmap``: every step the kernel zero-fills and maps it page by page again
(244,000 minor page faults and 0.45 s of system CPU time in each 0.53 s step on two cores;
``benchmarks/bench_vs_pytorch.py``, README). :func:`keep_freed_memory` sets glibc's allocator (``mallopt``) to one
arena, no ``mmap`` and no trimming, so the block is carved from the main heap once and reused by every later step.
The cost: the process keeps its peak heap size until it exits.

It is opt-in, because one arena also has a price: threads that allocate at the same time wait for each other.
XLA's compiler does, and compiling a supernet step took ~25% longer with it (the README's main job, small images
and compile-bound, 62 → 74 s), while the steps themselves ran up to 1.5x faster on 32x32 images (README benchmark).
``JMSNAS_KEEP_FREED_MEMORY=1`` makes :func:`apply` choose it; :func:`keep_freed_memory` applies it on call.
Either must come before JAX creates its CPU client (the first array or jit call), because threads that already
own an arena keep it. Only glibc (Linux) has these settings; elsewhere nothing is changed.

The default (``JMSNAS_KEEP_FREED_MEMORY`` unset): :func:`keep_step_memory` gets the same steady heap without one shared arena, so XLA's compiler threads keep theirs. JAX's CPU client runs
each computation on the thread that calls it (``jax_cpu_enable_async_dispatch=False``; the calling thread
waits for the step, which the search loop does within a few steps anyway), so XLA allocates a step's temporaries
from the main thread's arena, the main heap; and glibc is told to serve large blocks from that heap rather than
``mmap`` (``M_MMAP_MAX=0``) and never to trim it (``M_TRIM_THRESHOLD=-1``). Both ``mallopt`` settings act at
once on the main arena whenever they are made, and neither touches the other threads' arenas. What still
faults: blocks that XLA's worker threads allocate themselves inside a kernel (in their own arenas) and
computations over several devices, which JAX dispatches asynchronously whatever the setting.
``JMSNAS_KEEP_FREED_MEMORY=0`` leaves glibc and JAX's dispatch as they are; ``=1`` applies the full setting above.

Importing jmsnas changes none of this: the process belongs to its caller. The ``jmsnas`` command calls
:func:`apply` first thing, before JAX starts; a program that uses the library and wants the same fast CPU steps
calls it too, before its first JAX array::

    import jmsnas.hostmem
    jmsnas.hostmem.apply()   # what the jmsnas command does; JMSNAS_KEEP_FREED_MEMORY chooses the setting
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import warnings

ENV = "JMSNAS_KEEP_FREED_MEMORY"

# glibc <malloc.h> parameter numbers
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely" (its largest int, 2 GB, would still
# trim after the mixture steps, whose temporaries are 5.1 GB)
_NO_TRIM = -1

_applied: bool | None = None


def _setting() -> str | None:
    """JMSNAS_KEEP_FREED_MEMORY: "0", "1" or None (unset: the default, keep_step_memory); any other value is an
    error naming it."""
    value = os.environ.get(ENV)
    if value is None:
        return None
    value = value.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (leave the allocator and JAX's dispatch alone), 1 (one untrimmed heap "
                         f"for every thread) or unset (the default: steps on the calling thread's untrimmed heap), "
                         f"got {value!r}")
    return value


def apply() -> dict:
    """The jmsnas command's host settings, chosen by ``JMSNAS_KEEP_FREED_MEMORY`` (module doc): unset,
    :func:`keep_step_memory`; ``1``, :func:`keep_freed_memory`; ``0``, nothing. Call it before JAX's first array.

    Returns {"one_heap": whether keep_freed_memory is in force, "dispatch": whether JAX's CPU dispatch is
    synchronous by it, "heap": whether glibc's main heap keeps large freed blocks by it}. Raises ValueError naming a
    bad ``JMSNAS_KEEP_FREED_MEMORY`` value.
    """
    if requested():
        return {"one_heap": keep_freed_memory(), "dispatch": False, "heap": False}
    if forbidden():
        return {"one_heap": False, "dispatch": False, "heap": False}
    return {"one_heap": False, **keep_step_memory()}


def requested() -> bool:
    """Whether the environment asks for the setting at import: ``1`` yes, unset or ``0`` no, anything else an error."""
    return _setting() == "1"


def forbidden() -> bool:
    """Whether the environment rules the setting out (``JMSNAS_KEEP_FREED_MEMORY=0``)."""
    return _setting() == "0"


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Set glibc malloc to one arena, no mmap, no trimming (once per process). True if the settings are in force.

    Does nothing (returns False) when ``JMSNAS_KEEP_FREED_MEMORY=0`` or the C library is not glibc.

    Warns when JAX's backends already exist: their worker threads keep the arenas they have, so XLA's per-step
    blocks are still mapped afresh (call it before creating JAX arrays, or start Python with ``GLIBC_TUNABLES=``
    ``glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615``).
    """
    global _applied
    if _applied is not None:
        return _applied
    if forbidden():
        _applied = False
        return False
    libc = _glibc()
    if libc is None:
        _applied = False
        return False
    ok = all(libc.mallopt(param, value) == 1
             for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _NO_TRIM)))
    _applied = ok
    if ok and _backends_exist():
        warnings.warn("jmsnas.hostmem.keep_freed_memory() ran after JAX created its backends: XLA's worker "
                      "threads keep their own malloc arenas, so its per-step temporaries are still mapped afresh "
                      f"every step (slower on CPU). Call it (or jmsnas.hostmem.apply() with {ENV}=1) before JAX's first "
                      f"array, "
                      f"or set {ENV}=0 to silence this.", RuntimeWarning, stacklevel=2)
    return ok


def applied() -> bool:
    """Whether keep_freed_memory() has put the settings in force in this process."""
    return bool(_applied)


_step_memory: dict = {}


def keep_step_memory() -> dict:
    """The default: run CPU steps on the calling thread and keep their blocks in its untrimmed heap (module doc).

    Returns {"dispatch": whether JAX's CPU dispatch is synchronous, "heap": whether glibc's main heap keeps large
    freed blocks}; both False with ``JMSNAS_KEEP_FREED_MEMORY=0``. Synchronous dispatch can only be chosen before
    JAX creates its CPU client (later, "dispatch" reports the flag as it stands; a user who wants asynchronous
    dispatch back sets ``jax.config.update("jax_cpu_enable_async_dispatch", True)`` after calling it). The heap
    part works at any time.
    """
    if _step_memory:
        return dict(_step_memory)
    if forbidden():
        _step_memory.update(dispatch=False, heap=False)
        return dict(_step_memory)
    import jax
    if not _backends_exist():
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    libc = _glibc()
    heap = libc is not None and all(libc.mallopt(param, value) == 1
                                    for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _NO_TRIM)))
    _step_memory.update(dispatch=not _async_dispatch(), heap=bool(heap))
    return dict(_step_memory)


def _async_dispatch() -> bool:
    """Whether JAX's CPU client dispatches asynchronously (what it reads, or has read, when it is created)."""
    import jax
    return bool(jax.config.read("jax_cpu_enable_async_dispatch"))


def _backends_exist() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(check()) if check is not None else False
