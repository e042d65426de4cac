"""TensorFlow is optional: ``pip install -e .`` pulls neither tensorflow nor tensorflow-datasets (they are the
``tfds`` extra, which the ``test`` extra includes so the tfds tests run in CI), every module of jmsnas imports
without them, and asking for a tfds dataset without them is one line naming the install command."""
import os
import subprocess
import sys
import textwrap
import tomllib

from paths import REPO

WITHOUT_TF = textwrap.dedent("""
    import importlib, pkgutil, sys
    for name in ("tensorflow", "tensorflow_datasets"):  # as if neither were installed
        sys.modules[name] = None
    import jmsnas
    for m in pkgutil.walk_packages(jmsnas.__path__, "jmsnas."):
        importlib.import_module(m.name)
    from jmsnas import cli
    code = cli.main(["search", "--workdir", sys.argv[1], "--config.dataset=cifar10", "--no-progress"])
    print("CODE", code, "TF", "tensorflow" in sys.modules and sys.modules["tensorflow"] is not None)
""")


def test_without_tensorflow_everything_imports_and_a_tfds_dataset_names_the_extra(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", WITHOUT_TF, str(tmp_path / "w")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.stdout.split() == ["CODE", "2", "TF", "False"], out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jmsnas search: error: dataset 'cifar10'"), out.stderr[-3000:]
    assert "pip install -e '.[tfds]'" in lines[0]
    assert not (tmp_path / "w").exists()


def test_the_base_install_has_no_tensorflow_and_the_test_extra_has_the_tfds_one():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    base = [d.split(";")[0].strip().lower() for d in project["dependencies"]]
    assert not [d for d in base if d.startswith("tensorflow")], base
    extras = project["optional-dependencies"]
    assert any(d.startswith("tensorflow-datasets") for d in extras["tfds"])
    assert "jmsnas[tfds]" in extras["test"]  # the README's `pip install -e '.[test]'` runs the tfds tests
