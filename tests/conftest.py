"""Fixtures shared by every folder of tests/.

- ``tiny_config``: the main job's tiny configuration (``configs.tiny`` of the default chain: one layer per device,
  8 channels, 256 training examples) on the XLA depthwise path, which compiles fastest (the shifted and native
  paths have their own tests). A fresh ConfigDict for every test, which the test may change.
- ``tiny_config_file``: the same configuration as a ``--config`` file (``TINY_CONFIG``).
- ``tiny_run``: a finished tiny search run directory with random weights (``tinyrun.make``: parts/, result.json,
  config.json, no training), for the commands that read a run.
- ``trained_run``: a tiny run trained by ``jmsnas search --config TINY_CONFIG`` in its own process, as a user runs
  it (result.json, history.json, summary, figures, parts/, checkpoints/); ``tiny_compile_cache`` is the persistent
  compile cache that run filled, for tests that start more runs of the same configuration.

The run directories are built once per session (under ``pytest -n`` once per worker process) and every test gets
its own copy (in a folder of its own beside its tmp_path), so nothing one test writes reaches another.
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


@pytest.fixture
def tiny_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_config") / "tiny.py"  # beside the test's tmp_path, not in it
    path.write_text(TINY_CONFIG)
    return path


@pytest.fixture(scope="session")
def _tiny_run_once(tmp_path_factory):
    return tinyrun.make(str(tmp_path_factory.mktemp("tiny_run") / "run"))


@pytest.fixture
def tiny_run(_tiny_run_once, tmp_path_factory):
    return shutil.copytree(_tiny_run_once, tmp_path_factory.mktemp("tiny_run") / "run", symlinks=True)


@pytest.fixture(scope="session")
def tiny_compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_compile_cache")


@pytest.fixture(scope="session")
def _trained_run_once(tmp_path_factory, tiny_compile_cache):
    root = tmp_path_factory.mktemp("trained_run")
    (root / "tiny.py").write_text(TINY_CONFIG)
    procs.finish(procs.start(procs.env(tiny_compile_cache), "search", root / "tiny.py", root / "run"))
    return root / "run"


@pytest.fixture
def trained_run(_trained_run_once, tmp_path_factory):
    return shutil.copytree(_trained_run_once, tmp_path_factory.mktemp("trained_run") / "run", symlinks=True)
