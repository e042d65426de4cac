"""Native CPU kernels, compiled on first use and registered as XLA FFI targets.

``load()`` compiles ``dwconv_cpu.cc`` (depthwise convolution and its gradients), ``batchnorm_cpu.cc`` (training
batch norm fused with its activation, forward and backward) and ``matmul_cpu.cc`` (x^T g, the 1x1 convolutions'
weight gradient) into one library with the machine's C++ compiler
(``$CXX``, else ``g++``, else ``c++``; ``-O3 -march=native``) against the XLA FFI headers that ship with jaxlib
(``jax.ffi.include_dir()``), loads it and registers its handlers for the CPU platform. The library is cached under
``jmsnas.cache.native_dir()`` (``<cache root>/native``, the root ``$JMSNAS_CACHE_DIR``, else
``$XDG_CACHE_HOME/jmsnas``, else ``~/.cache/jmsnas``; the system's temporary directory when that is not writable)
in a file named by a hash of the sources, the flags, the compiler's version, jaxlib's version and the CPU's
instruction-set flags, so a changed input compiles anew and concurrent processes (pytest workers) never load a
half-written file: each compiles to a private temporary name and renames it into place.

When no compiler is found or the build fails, ``load()`` returns False and ``error()`` says why; callers
(``jmsnas.dwconv`` and ``jmsnas.ops`` with impl "auto") then fall back to the pure-XLA implementations.
``JMSNAS_NATIVE=0`` turns the kernels off (``load()`` returns False without building anything): the CPU then
runs the implementations other backends use (``benchmarks/gpu_check.sh`` checks them that way in CI).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from jmsnas import cache

HERE = Path(__file__).parent
SOURCES = (HERE / "dwconv_cpu.cc", HERE / "batchnorm_cpu.cc", HERE / "matmul_cpu.cc")
HEADERS = (HERE / "parallel.h",)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
TARGETS = {  # FFI target name -> exported symbol
    "jmsnas_depthwise_forward": "JmsnasDepthwiseForward",
    "jmsnas_depthwise_input_grad": "JmsnasDepthwiseInputGrad",
    "jmsnas_depthwise_weight_grad": "JmsnasDepthwiseWeightGrad",
    "jmsnas_batch_norm_act_forward": "JmsnasBatchNormActForward",
    "jmsnas_batch_norm_act_backward": "JmsnasBatchNormActBackward",
    "jmsnas_matmul_tn": "JmsnasMatmulTN",
}

ENV_SWITCH = "JMSNAS_NATIVE"  # 0: do not build or use the kernels
_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "error": str; when ok also "path" (the library) and "lib" (kept loaded)


def cache_dir() -> Path:
    """Where the compiled library is kept: ``jmsnas.cache.native_dir()``."""
    return cache.native_dir()


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else g++ or c++ on PATH; None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS), version, jaxlib.__version__,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"jmsnas_cpu_{key}.so"


def _build(cxx: str, out: Path, sources=SOURCES) -> None:
    """Compile ``sources`` into the shared library ``out`` (written under a temporary name, then renamed).

    Each source is compiled to its own object file by its own compiler process, all at once (the C++ compiler
    runs one translation unit per process anyway, so the objects are the ones a single command would make; on
    two cores the build takes about half the wall time), then they are linked."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    objects = tempfile.mkdtemp(prefix=".objects-", dir=out.parent)
    jobs = []  # (command, object file, process)
    try:
        compile_flags = [f for f in FLAGS if f != "-shared"]
        include = [f"-I{jax.ffi.include_dir()}", f"-I{HERE}"]
        for i, src in enumerate(sources):
            obj = os.path.join(objects, f"{i}-{Path(src).stem}.o")
            cmd = [cxx, *compile_flags, *include, "-c", str(src), "-o", obj]
            jobs.append((cmd, obj, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                    text=True)))
        for cmd, _, proc in jobs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {Path(cmd[-3]).name} failed ({' '.join(cmd)}):\n{err[-4000:]}")
        cmd = [cxx, *FLAGS, *[obj for _, obj, _ in jobs], "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"linking the native kernels failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        for _, _, proc in jobs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(objects, ignore_errors=True)
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> bool:
    """Compile (once per machine and source), load and register the CPU kernels; True when they are usable."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            switch = os.environ.get(ENV_SWITCH, "1").strip()
            if switch not in ("0", "1"):
                raise RuntimeError(f"{ENV_SWITCH} must be 0 (no native kernels) or 1, got {switch!r}")
            if switch == "0":
                raise RuntimeError(f"turned off ({ENV_SWITCH}=0)")
            cxx = compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            path = _library_path(cxx)
            if not path.exists():
                try:
                    _build(cxx, path)
                except OSError:  # an unwritable cache directory: build under the system's temporary directory
                    path = Path(tempfile.gettempdir()) / f"jmsnas-{os.getuid()}" / path.name
                    if not path.exists():
                        _build(cxx, path)
            lib = ctypes.CDLL(str(path))
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state.update(ok=True, error="", path=path, lib=lib)
        except (OSError, RuntimeError, AttributeError) as e:
            _state.update(ok=False, error=str(e))
        return _state["ok"]


def require() -> None:
    """``load()``, raising RuntimeError with the reason when the kernels cannot be used."""
    if not load():
        raise RuntimeError(f"the native CPU kernels are unavailable: {error()}")


def call(target: str, shapes, *args, **attrs):
    """Run the kernel ``target`` on ``args`` with the static attributes ``attrs``, after ``require()``.

    ``shapes``: the float32 output's shape (a tuple of ints; one array back), or a list of shapes (a list back).
    Under ``vmap`` the kernel runs once per mapped element (a loop in the compiled program)."""
    require()
    if isinstance(shapes, list):
        out = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    else:
        out = jax.ShapeDtypeStruct(shapes, jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, **attrs)


def error() -> str:
    """Why ``load()`` failed ("" when it succeeded or was not called)."""
    return _state.get("error", "")
