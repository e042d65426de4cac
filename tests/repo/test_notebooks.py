"""colab/: every notebook opens in Colab from the repository, installs jmsnas first, is stored without outputs and
has a quick mode for CI. (The notebooks themselves execute as tests through nbmake: pyproject.toml.)"""
import os
import re
import tomllib

import nbformat
import pytest

from paths import REPO
COLAB = os.path.join(REPO, "colab")
NOTEBOOKS = ("quickstart", "compose", "split", "your_topology", "your_model", "splitnets", "autosplit", "modular",
             "separable", "deploy")


def _repository():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        url = tomllib.load(f)["project"]["urls"]["Repository"]
    return re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+)", url).group(1)


def test_the_notebooks_are_there():
    assert sorted(f for f in os.listdir(COLAB) if f.endswith(".ipynb")) == sorted(f"{n}.ipynb" for n in NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_badge_install_cell_no_outputs(name):
    nb = nbformat.read(os.path.join(COLAB, f"{name}.ipynb"), as_version=4)
    nbformat.validate(nb)
    repo = _repository()
    first, install, quick = nb.cells[:3]
    assert first.cell_type == "markdown"
    assert (f"(https://colab.research.google.com/github/{repo}/blob/main/colab/{name}.ipynb)" in first.source
            and "colab-badge.svg" in first.source)
    # the install cell comes first, installs this repository, and is skipped where jmsnas is importable (CI)
    assert install.cell_type == "code" and 'importlib.util.find_spec("jmsnas") is None' in install.source
    assert f"git+https://github.com/{repo}" in install.source
    assert 'os.environ.get("JMSNAS_NOTEBOOK_QUICK") == "1"' in quick.source
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, f"{name}: outputs are stored"
    assert nb.metadata.kernelspec.name == "python3"


def test_ci_runs_the_quick_settings():
    with open(os.path.join(COLAB, "conftest.py")) as f:
        assert 'os.environ.setdefault("JMSNAS_NOTEBOOK_QUICK", "1")' in f.read()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert "colab" in cfg["testpaths"] and "--nbmake" in cfg["addopts"]
