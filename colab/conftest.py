"""The notebooks here run as tests (nbmake, see pyproject.toml) on their quick settings: each reads
JMSNAS_NOTEBOOK_QUICK, which the kernel inherits from this process. Set it to 0 to execute the real runs.

The kernels of one pytest process share a JAX compilation cache (a temporary directory, every executable kept):
quickstart and deploy run the same tiny search, so whichever runs second loads its executables instead of
compiling them (the same executables, so the same numbers). On the quick settings the kernels also compile with
XLA's optimisation passes off (JAX_DISABLE_MOST_OPTIMIZATIONS): they check that the code runs and its asserts
hold, and their tiny programs spend most of their time compiling."""
import os
import shutil
import tempfile

os.environ.setdefault("JMSNAS_NOTEBOOK_QUICK", "1")


def pytest_collection_modifyitems(config, items):
    """Every notebook is an end-to-end run (minutes each): marked ``slow``, so ``pytest -m "not slow"`` (the quick
    loop) leaves them to CI, which runs everything."""
    import pytest
    for item in items:
        if item.nodeid.endswith(".ipynb") or ".ipynb" in item.nodeid.split("::")[0]:
            item.add_marker(pytest.mark.slow)


_KERNEL_ENV = {"JAX_COMPILATION_CACHE_DIR": None, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
_before: dict = {}


def _cache_dir(config) -> str:
    if _KERNEL_ENV["JAX_COMPILATION_CACHE_DIR"] is None:
        path = tempfile.mkdtemp(prefix="jmsnas-notebook-cache-")
        config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
        _KERNEL_ENV["JAX_COMPILATION_CACHE_DIR"] = path
    return _KERNEL_ENV["JAX_COMPILATION_CACHE_DIR"]


def pytest_runtest_setup(item):
    """A notebook's kernel starts with the shared cache and the optimisation setting in its environment; this
    process's own JAX (already configured) and the other tests' subprocesses never see them
    (``pytest_runtest_teardown`` restores the environment)."""
    _cache_dir(item.config)
    for name, value in _KERNEL_ENV.items():
        if name == "JAX_DISABLE_MOST_OPTIMIZATIONS" and os.environ.get("JMSNAS_NOTEBOOK_QUICK") != "1":
            continue  # the real runs compile as a user's do
        _before[name] = os.environ.get(name)
        os.environ[name] = value


def pytest_runtest_teardown(item):
    for name, value in _before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _before.clear()
