"""Fixtures shared by every folder of tests/.

- ``tiny_config``: the main job's tiny configuration (``configs.tiny`` of the default chain: one layer per device,
  8 channels, 256 training examples) on the XLA depthwise path, which compiles fastest (the shifted and native
  paths have their own tests). A fresh ConfigDict for every test, which the test may change.
- ``tiny_config_file``: the same configuration as a ``--config`` file (``TINY_CONFIG``).
- ``tiny_run``: a finished tiny search run directory with random weights (``tinyrun.make``: parts/, result.json,
  config.json, no training), for the commands that read a run.
- ``trained_run``: a tiny run trained by ``jmsnas search --config TINY_CONFIG`` in its own process, as a user runs
  it (result.json, history.json, summary, figures, parts/, checkpoints/); ``tiny_compile_cache`` is the persistent
  compile cache that run filled, for tests that start more runs of the same configuration, and ``tiny_env`` the
  environment every run with that cache starts in (``procs.env`` with XLA's optimisation passes off: the tiny runs
  spend most of their time compiling; every run a test compares with these starts in it).
- ``evolved_run``: a tiny run of ``jmsnas evolve --config`` ``EVOLVE_CONFIG`` (the tiny config under a 0.85 ms
  budget, 2 generations of 9, the shifted depthwise path) in its own process with ``tiny_env``, as a user runs it (result.json,
  evolution.json, history.json, checkpoints/supernet and checkpoints/evolution, ...); ``evolve_config_file`` is that
  configuration as a file.
- ``fast_compiles``: XLA's optimisation passes off for a whole module whose programs are tiny
  (``pytestmark = pytest.mark.usefixtures("fast_compiles")``).

The run directories are built once per session (under ``pytest -n`` once per worker process) and every test gets
its own copy (in a folder of its own beside its tmp_path), so nothing one test writes reaches another.

Every test also ends with JAX's persistent compilation cache set as the session began (``_compile_cache_as_found``).
"""
import shutil
import textwrap

import pytest

import procs
import tinyrun
from jmsnas import configs

TINY_CONFIG = textwrap.dedent("""
    from jmsnas.configs import default_config, tiny
    def get_config():
        c = tiny(default_config())
        c.dw_impl = "xla"
        return c
""")


@pytest.fixture
def tiny_config():
    cfg = configs.tiny(configs.default_config())
    cfg.dw_impl = "xla"
    return cfg


def _config_file(tmp_path_factory, name: str, text: str):
    """``text`` as ``config.py`` in a new folder ``name``."""
    path = tmp_path_factory.mktemp(name) / "config.py"  # beside the test's tmp_path, not in it
    path.write_text(text)
    return path


def _copy(run, tmp_path_factory, name: str):
    """A test's own copy of a session's run directory (in a folder of its own beside its tmp_path)."""
    return shutil.copytree(run, tmp_path_factory.mktemp(name) / "run", symlinks=True)


def _command_run(tmp_path_factory, environ: dict, command: str, text: str, name: str):
    """``jmsnas COMMAND --config <text>`` in its own process with the environment ``environ``."""
    config = _config_file(tmp_path_factory, name, text)
    procs.finish(procs.start(environ, command, config, config.parent / "run"))
    return config.parent / "run"


@pytest.fixture
def tiny_config_file(tmp_path_factory):
    return _config_file(tmp_path_factory, "tiny_config", TINY_CONFIG)


@pytest.fixture(scope="session")
def _tiny_run_once(tmp_path_factory):
    return tinyrun.make(str(tmp_path_factory.mktemp("tiny_run") / "run"))


@pytest.fixture
def tiny_run(_tiny_run_once, tmp_path_factory):
    return _copy(_tiny_run_once, tmp_path_factory, "tiny_run")


@pytest.fixture(scope="session")
def tiny_compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_compile_cache")


@pytest.fixture(scope="session")
def tiny_env(tiny_compile_cache):
    return procs.env(tiny_compile_cache, fast_compile=True)


@pytest.fixture(scope="session")
def _trained_run_once(tmp_path_factory, tiny_env):
    return _command_run(tmp_path_factory, tiny_env, "search", TINY_CONFIG, "trained_run")


@pytest.fixture
def trained_run(_trained_run_once, tmp_path_factory):
    return _copy(_trained_run_once, tmp_path_factory, "trained_run")


EVOLVE_CONFIG = textwrap.dedent("""
    from jmsnas.configs import default_config, tiny
    def get_config(arg=None):
        c = tiny(default_config())
        # the shifted depthwise path: with XLA's optimisation passes off (tiny_env) the sandwich steps on "xla"'s
        # grouped convolutions ran 5.5 times as long (the whole run 27.5 s CPU on "shifted", 57.2 on "xla" with
        # the passes on, 114.6 with them off)
        c.dw_impl = "shifted"
        c.t_const_ms = 0.85  # the tiny chain spans about 0.80-0.90 ms: the largest networks are over budget
        # 9 rows: two processes evaluate 5 and 4 of them plus a repeated row (tests/test_multiprocess.py)
        c.evolve = dict(epochs=1, num_random=1, population=9, generations=2, fitness_examples=48, bn_batches=1,
                        bn_batch_size=32)
        return c
""")


@pytest.fixture
def evolve_config_file(tmp_path_factory):
    return _config_file(tmp_path_factory, "evolve_config", EVOLVE_CONFIG)


@pytest.fixture(scope="session")
def _evolved_run_once(tmp_path_factory, tiny_env):
    return _command_run(tmp_path_factory, tiny_env, "evolve", EVOLVE_CONFIG, "evolved_run")


@pytest.fixture
def evolved_run(_evolved_run_once, tmp_path_factory):
    return _copy(_evolved_run_once, tmp_path_factory, "evolved_run")


@pytest.fixture(scope="module")
def fast_compiles():
    """XLA's optimisation passes off for a module of tests whose programs are tiny (compile time dominates);
    a module asks for it with ``pytestmark = pytest.mark.usefixtures("fast_compiles")``."""
    import jax
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


_CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_compilation_cache_max_size")


@pytest.fixture(scope="session")
def _compile_cache_at_start():
    import jax
    return {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}


@pytest.fixture(autouse=True)
def _compile_cache_as_found(_compile_cache_at_start):
    """A command run in-process (``cli.main``) turns JAX's persistent compilation cache on for the rest of the
    process, storing every executable (jmsnas.cache). Left on, each new executable of every later test in that
    process, eager ops included, is written to the shared cache directory (test_conv_patches took 179 s instead
    of 12 s in a quick loop after such a test, when JAX still scanned the whole directory on every write; writing
    every eager op still costs a file each). So every test ends with the settings the session began with."""
    yield
    import jax
    if any(getattr(jax.config, name) != value for name, value in _compile_cache_at_start.items()):
        from jax.experimental.compilation_cache import compilation_cache as cc
        for name, value in _compile_cache_at_start.items():
            jax.config.update(name, value)
        cc.reset_cache()
