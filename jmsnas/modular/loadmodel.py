"""Loading time of a child, measured on this machine and fitted as a linear model (Algorithm 1, lines 2-5).

    T_child = overhead_ms + per_array_ms * arrays + ms_per_mb * MB        (MB = 1e6 bytes of parameters)

``overhead_ms`` is paid once per child (opening its checkpoint, its manifest entry, a thread hand-off),
``per_array_ms`` once per stored array (orbax keeps one record per array), ``ms_per_mb`` per byte. A block's load
time is its share without the overhead, so a child's time is the overhead plus the sum of its blocks'.

The samples are *cold* reads through the loader itself (``store.load`` of a one-child directory of synthetic
arrays): the files are written fresh, flushed (fsync) and dropped from the page cache with
``os.posix_fadvise(POSIX_FADV_DONTNEED)`` before every read (no root needed). ``resident_bytes`` (mincore)
confirms the drop. ``raw_read_ms`` times plain file reads of the same bytes the same way: the disk's floor, which
tells whether loading is disk-bound or CPU-bound (deserialising) on a machine.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import tempfile
import time
from typing import NamedTuple

import numpy as np

from jmsnas.modular.blocks import Block, ModularError, Network, block_arrays, block_bytes, forward


def _files(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def drop_cache(path: str) -> int:
    """fsync every file under ``path`` and drop its pages from the page cache; returns the number of files."""
    files = _files(path)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_bytes(path: str) -> int:
    """Bytes of the files under ``path`` that are in the page cache now (mincore on a read-only mapping)."""
    page = mmap.PAGESIZE
    total = 0
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    for p in _files(path):
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {p} failed")
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            try:
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {p} failed")
            finally:
                _libc.munmap(addr, size)
            total += sum(1 for b in vec.raw if b & 1) * page
        finally:
            os.close(fd)
    return total


class LoadModel(NamedTuple):
    overhead_ms: float  # per child
    per_array_ms: float  # per stored array
    ms_per_mb: float  # per 1e6 bytes
    rmse_ms: float  # fit residual
    samples: list  # [{"bytes", "arrays", "ms" (median), "runs_ms"}]

    def to_json(self) -> dict:
        return self._asdict()

    @classmethod
    def from_json(cls, d: dict) -> "LoadModel":
        try:
            m = cls(float(d["overhead_ms"]), float(d["per_array_ms"]), float(d["ms_per_mb"]), float(d["rmse_ms"]),
                    list(d.get("samples", [])))
        except (KeyError, TypeError, ValueError) as e:
            raise ModularError(f"load model must have overhead_ms, per_array_ms, ms_per_mb, rmse_ms: {e}") from None
        if min(m.overhead_ms, m.per_array_ms, m.ms_per_mb) < 0:
            raise ModularError(f"load model coefficients must be >= 0, got {m[:3]}")
        return m


def _synthetic(nbytes: int, arrays: int, seed: int) -> Network:
    rng = np.random.default_rng(seed)
    per = max(1, nbytes // 4 // arrays)
    params = {f"a{i}": rng.standard_normal(per, dtype=np.float32) for i in range(arrays)}
    return Network("synthetic", (1,), (Block("synthetic", {"kind": "zoo", "layers": []}, params),))


def measure(sizes_bytes=(2**16, 2**20, 2**23), arrays=(1, 8, 64), reps: int = 3, directory: str | None = None,
            seed: int = 0) -> list:
    """Cold loads (median of ``reps``) of one child for every (bytes, arrays) pair, through ``store.load``: wall
    ms and the process's CPU ms (all threads; CPU ms near or above wall ms means loading is CPU-bound)."""
    from jmsnas.modular import store
    root = tempfile.mkdtemp(prefix="jmsnas-loadmodel-", dir=directory)
    out = []
    try:
        for nb in sizes_bytes:
            for na in arrays:
                net = _synthetic(int(nb), int(na), seed)
                d = os.path.join(root, f"c_{nb}_{na}")
                store.write(net, [0, 1], d)
                runs, cpu = [], []
                for _ in range(reps):
                    drop_cache(d)
                    t, c = time.perf_counter(), time.process_time()
                    store.load(d, parallel=1)
                    runs.append(1e3 * (time.perf_counter() - t))
                    cpu.append(1e3 * (time.process_time() - c))
                out.append({"bytes": block_bytes(net.blocks[0]), "arrays": int(na), "ms": float(np.median(runs)),
                            "cpu_ms": float(np.median(cpu)), "runs_ms": runs})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def fit(samples) -> LoadModel:
    """Non-negative least squares of ms on [1, arrays, MB] over the samples."""
    from scipy.optimize import nnls
    if len(samples) < 3:
        raise ModularError(f"fitting the load model needs at least 3 samples, got {len(samples)}")
    a = np.array([[1.0, s["arrays"], s["bytes"] / 1e6] for s in samples])
    y = np.array([s["ms"] for s in samples])
    coef, _ = nnls(a, y)
    rmse = float(np.sqrt(np.mean((a @ coef - y) ** 2)))
    return LoadModel(float(coef[0]), float(coef[1]), float(coef[2]), rmse, list(samples))


def block_ms(model: LoadModel, blocks) -> np.ndarray:
    """float64[N]: predicted load time (ms) of each block, without the per-child overhead. ``blocks``: Blocks or
    manifest entries with "bytes" and "arrays"."""
    stats = [(b["bytes"], b["arrays"]) if isinstance(b, dict) else (block_bytes(b), block_arrays(b)) for b in blocks]
    return np.array([model.per_array_ms * na + model.ms_per_mb * nb / 1e6 for nb, na in stats], np.float64)


def makespan_ms(children_ms, threads: int) -> float:
    """Time until every child is loaded when ``threads`` workers take the children in order, each starting the
    next child as soon as it is free (the thread pool of ``store.load``), with no contention between them."""
    free = np.zeros(max(1, int(threads)))
    for t in children_ms:
        i = int(np.argmin(free))
        free[i] += t
    return float(free.max())


def raw_read_ms(nbytes: int, files: int, reps: int = 3, directory: str | None = None) -> float:
    """Median cold time (ms) of reading ``files`` fresh files of ``nbytes`` in total with plain ``read``."""
    root = tempfile.mkdtemp(prefix="jmsnas-rawread-", dir=directory)
    try:
        per = max(1, nbytes // files)
        data = os.urandom(per)
        paths = [os.path.join(root, f"f{i}") for i in range(files)]
        for p in paths:
            with open(p, "wb") as f:
                f.write(data)
        runs = []
        for _ in range(reps):
            drop_cache(root)
            t = time.perf_counter()
            for p in paths:
                with open(p, "rb") as f:
                    f.read()
            runs.append(1e3 * (time.perf_counter() - t))
        return float(np.median(runs))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def inference_ms(net: Network, batch: int = 1, reps: int = 3, seed: int = 0) -> np.ndarray:
    """float64[N]: median time (ms) of each block's jitted forward on a batch (compiled before timing)."""
    x = np.random.default_rng(seed).standard_normal((batch,) + tuple(net.input_shape)).astype(np.float32)
    out = []
    for b in net.blocks:
        f = forward([b.spec])
        y = f([b.params], x)
        y.block_until_ready()
        runs = []
        for _ in range(reps):
            t = time.perf_counter()
            f([b.params], x).block_until_ready()
            runs.append(1e3 * (time.perf_counter() - t))
        out.append(float(np.median(runs)))
        x = np.asarray(y)
    return np.array(out)
