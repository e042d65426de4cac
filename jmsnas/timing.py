"""Time to result, split into compiling and running (wall and CPU seconds).

:class:`Phases` listens to JAX's monitoring events for the three stages of turning a Python function into an
executable — tracing to a jaxpr, lowering to StableHLO, and the XLA compilation (or, with the persistent cache
of :mod:`jmsnas.cache`, loading the stored executable) — and adds up the wall time and the process CPU time spent
inside them (nested events count once), and inside blocks marked with :func:`compiling` (loading a stored program
of :mod:`jmsnas.programs`). Everything else between :meth:`Phases.start` and :meth:`Phases.summary` is run time.
CPU time is the whole process's (``time.process_time``: every thread), so XLA's compiler threads count as
compiling and, while a step still runs asynchronously when the next compilation starts, that step's CPU counts
there too. Compilations running at once in several threads (``jmsnas.ahead``) count once, as the wall time
during which any of them ran (and the process's CPU time meanwhile, the main thread's included). The summary
also counts persistent-cache hits and misses.

``measure()`` is the context manager the flows use (``pipeline.search``, ``evolve.run``): nested uses share the
outer timer, :func:`active` returns it, and :func:`label` makes a tqdm progress bar read "<desc> (compiling)"
while a compilation runs.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time

import jax.monitoring as monitoring

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_MISS = "/jax/compilation_cache/cache_misses"
BACKEND_COMPILE = COMPILE_EVENTS[2]

_stack: list["Phases"] = []


class Phases:
    """Wall and CPU seconds inside JAX compilations and outside them, from :meth:`start` on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._enter = (0.0, 0.0)
        self.compile_wall = self.compile_cpu = 0.0
        self.compilations = self.cache_hits = self.cache_misses = 0
        self._t0 = None
        self._bar = None
        self._desc = ""

    # -- JAX monitoring listeners (JAX calls record_scalar(event, start) on entry, the duration on exit)
    def _on_scalar(self, event, value, **kw):
        if event in COMPILE_EVENTS:
            self.begin()

    def _on_duration(self, event, duration, **kw):
        if event not in COMPILE_EVENTS:
            return
        if event == BACKEND_COMPILE:
            with self._lock:
                self.compilations += 1
        self.end()

    def begin(self) -> None:
        """Compiling from now (nested begin/end pairs count once)."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._enter = (time.perf_counter(), time.process_time())
                self._show(True)

    def end(self) -> None:
        """The end of the innermost :meth:`begin`."""
        with self._lock:
            if self._depth == 0:  # its start came before this timer existed
                return
            self._depth -= 1
            if self._depth == 0:
                w0, c0 = self._enter
                self.compile_wall += time.perf_counter() - w0
                self.compile_cpu += time.process_time() - c0
                self._show(False)

    def _on_event(self, event, **kw):
        if event == CACHE_HIT:
            self.cache_hits += 1
        elif event == CACHE_MISS:
            self.cache_misses += 1

    def _show(self, compiling: bool) -> None:
        bar = self._bar
        if bar is not None and not getattr(bar, "disable", False):
            bar.set_description(f"{self._desc} (compiling)" if compiling else self._desc)

    def label(self, bar) -> None:
        """Make ``bar`` (tqdm) read "<its description> (compiling)" while a compilation runs (one bar at a time)."""
        self._bar, self._desc = bar, (getattr(bar, "desc", "") or "").rstrip(": ")

    def start(self) -> "Phases":
        self._t0 = (time.perf_counter(), time.process_time())
        monitoring.register_scalar_listener(self._on_scalar)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def stop(self) -> None:
        monitoring.unregister_scalar_listener(self._on_scalar)
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)
        self._bar = None

    def summary(self) -> dict:
        """{"compile": {"wall_s", "cpu_s"}, "run": {...}, "total": {...}, "compilations", "cache_hits",
        "cache_misses"}: seconds since :meth:`start`, rounded to ms."""
        w0, c0 = self._t0
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        with self._lock:
            cw, cc = self.compile_wall, self.compile_cpu
            if self._depth:  # inside a compilation now
                cw += time.perf_counter() - self._enter[0]
                cc += time.process_time() - self._enter[1]
        r = lambda v: round(max(v, 0.0), 3)
        return {"compile": {"wall_s": r(cw), "cpu_s": r(cc)}, "run": {"wall_s": r(wall - cw), "cpu_s": r(cpu - cc)},
                "total": {"wall_s": r(wall), "cpu_s": r(cpu)}, "compilations": self.compilations,
                "cache_hits": self.cache_hits, "cache_misses": self.cache_misses}


@contextlib.contextmanager
def measure():
    """A :class:`Phases` timer for the block; inside another ``measure()`` the outer timer is reused."""
    if _stack:
        yield _stack[-1]
        return
    timer = Phases().start()
    _stack.append(timer)
    try:
        yield timer
    finally:
        _stack.pop()
        timer.stop()


def measured(fn):
    """Decorator: run ``fn`` inside ``measure()``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with measure():
            return fn(*args, **kwargs)
    return wrapper


def active() -> Phases | None:
    """The timer of the innermost ``measure()`` block, or None."""
    return _stack[-1] if _stack else None


@contextlib.contextmanager
def compiling():
    """Count the block as compiling in the active timer (work that prepares an executable without JAX's own
    compile events: loading a stored program, building the native kernels); outside ``measure()`` it does nothing."""
    timer = active()
    if timer is None:
        yield
        return
    timer.begin()
    try:
        yield
    finally:
        timer.end()


def label(bar):
    """``active().label(bar)`` when a timer runs; returns ``bar``."""
    if _stack:
        _stack[-1].label(bar)
    return bar


def summary() -> dict | None:
    """The active timer's summary, or None outside ``measure()``."""
    return _stack[-1].summary() if _stack else None
