"""Ahead-of-time compilation of a run's steps, in threads, while the run does other work.

A step's first call traces it, lowers it and has XLA compile it, and the run waits. :class:`Ahead` starts that
work as soon as the step's argument shapes are known: :meth:`Ahead.compile` runs ``step.lower(*args).compile()``
for abstract arguments (``jax.ShapeDtypeStruct`` with the shardings the real arguments will have: :func:`abstract`)
in one of its threads. JAX keeps the executable, so the step's first call with arguments of those shapes, dtypes
and shardings runs it without tracing or compiling again: the same executable the call would have compiled, hence
the same numbers. XLA's compiler releases the GIL (and the native kernels' C++ compiler is a child process), so
several steps compile at once, beside the main thread's own work (loading data, initialising the supernet,
training while the next stage's steps compile).

:meth:`Ahead.compile` returns the step wrapped so that its first call waits for its compilation (instead of
compiling it a second time beside it). A compilation that fails leaves the step as it was: its first call
compiles it and raises what went wrong there. ``Ahead(workers=0)`` compiles nothing ahead (every step compiles
at its first call, as a plain run does).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading

import jax

__all__ = ["Ahead", "abstract", "Waiting"]


def abstract(tree, sharding=None):
    """``tree`` with every array replaced by a ``jax.ShapeDtypeStruct`` (shape, dtype, weak type) carrying
    ``sharding`` (default: the array's own sharding, when it has one)."""
    def one(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            return a if sharding is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                                                   weak_type=a.weak_type)
        aval = jax.typeof(a)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False),
                                    sharding=sharding if sharding is not None else getattr(a, "sharding", None))
    return jax.tree_util.tree_map(one, tree)


class Waiting:
    """``step`` whose first call waits until ``future`` (its ahead-of-time compilation) is done."""

    def __init__(self, step, future: cf.Future | None):
        self.step, self._future = step, future
        self.__wrapped__ = step
        self.__name__ = getattr(step, "__name__", "step")

    def wait(self) -> None:
        future, self._future = self._future, None
        if future is not None:
            cf.wait([future])

    def __call__(self, *args):
        if self._future is not None:
            self.wait()
        return self.step(*args)


class Ahead:
    """A pool of threads compiling steps ahead of their first call (module docstring).

    Args:
      workers: threads (default: the number of CPUs, at least 2); 0 compiles nothing ahead.
    """

    def __init__(self, workers: int | None = None):
        self.workers = max(2, os.cpu_count() or 1) if workers is None else int(workers)
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers!r}")
        self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="jmsnas-ahead") if self.workers else None
        self._lock = threading.Lock()
        self._futures: list[cf.Future] = []
        self._speculations: list[dict] = []
        self.errors: list[BaseException] = []  # what failed ahead (the step then compiles at its first call)

    def submit(self, fn, *args) -> cf.Future | None:
        """Run ``fn(*args)`` in a thread; None (and nothing run) with no workers or after :meth:`close`."""
        with self._lock:
            if self._pool is None:
                return None
            future = self._pool.submit(self._guarded, fn, *args)
            self._futures.append(future)
            return future

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the step's own first call compiles it again and raises there
            with self._lock:
                self.errors.append(e)
            return None

    def compile(self, step, *args) -> Waiting:
        """Compile ``step`` (a ``jax.jit`` function, or ``programs.persistent_jit``'s) for the abstract
        arguments ``args`` in a thread; returns the step wrapped so that its first call waits for that."""
        return Waiting(step, self.submit(lambda: step.lower(*args).compile()))

    def speculate(self, guess, build) -> None:
        """Prepare what a later stage will probably need: in a thread, ``key = guess()`` and then ``build(key)``
        (e.g. the architecture the search would end with if it ended now, then that architecture's steps
        compiled). :meth:`wait_for` of that key waits until ``build`` is done (:meth:`built` also returns what it
        returned); other keys do not wait for it."""
        entry = {"key": None, "value": None, "decided": threading.Event(), "built": threading.Event()}

        def run():
            try:
                entry["key"] = guess()
            finally:
                entry["decided"].set()
            try:
                entry["value"] = build(entry["key"])
            finally:
                entry["built"].set()

        with self._lock:
            self._speculations.append(entry)
        if self.submit(run) is None:
            entry["decided"].set()
            entry["built"].set()

    def wait_for(self, key) -> bool:
        """Wait for the speculations (:meth:`speculate`) that guessed ``key`` to be built; True if there was one."""
        return bool(self._built(key))

    def built(self, key):
        """What ``build`` returned for a speculation that guessed ``key`` (waiting for it to be built; the last
        such one), else None."""
        hits = self._built(key)
        return hits[-1]["value"] if hits else None

    def _built(self, key) -> list:
        with self._lock:
            entries = list(self._speculations)
        hits = []
        for entry in entries:
            entry["decided"].wait()
            if entry["key"] is not None and entry["key"] == key:
                entry["built"].wait()
                hits.append(entry)
        return hits

    def wait(self) -> None:
        """Wait for everything submitted so far."""
        with self._lock:
            pending = list(self._futures)
        cf.wait(pending)

    def close(self, wait: bool = True) -> None:
        """Stop accepting work; with ``wait`` also wait for the work in flight (a compilation cannot be stopped)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> "Ahead":
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=True)
