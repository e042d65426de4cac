"""colab/: every notebook says how to run it (a clone, Colab), installs jmsnas first from a clone (nothing where it is
importable, as CI runs them), links to no unpublished address, is stored without outputs and has a quick mode for
CI; the repository's address is written in pyproject.toml only. (The notebooks themselves execute as tests
through nbmake: pyproject.toml.)"""
import os
import re
import subprocess
import sys
import tomllib

import nbformat
import pytest

from paths import REPO
COLAB = os.path.join(REPO, "colab")
NOTEBOOKS = ("quickstart", "compose", "split", "your_topology", "your_model", "splitnets", "autosplit", "modular",
             "separable", "deploy", "device_tables")


def _repository():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"]


def test_the_notebooks_are_there():
    assert sorted(f for f in os.listdir(COLAB) if f.endswith(".ipynb")) == sorted(f"{n}.ipynb" for n in NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_how_to_run_install_cell_no_outputs(name):
    nb = nbformat.read(os.path.join(COLAB, f"{name}.ipynb"), as_version=4)
    nbformat.validate(nb)
    first, install, quick = nb.cells[:3]
    assert first.cell_type == "markdown"
    assert "from a clone" in first.source and "Colab" in first.source
    # the install cell comes first, does nothing where jmsnas is importable (CI), installs a clone otherwise
    assert install.cell_type == "code" and 'importlib.util.find_spec("jmsnas") is None' in install.source
    assert '"pip", "install", "-q", "-e", root' in install.source and "Colab" in install.source
    assert 'os.environ.get("JMSNAS_NOTEBOOK_QUICK") == "1"' in quick.source
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, f"{name}: outputs are stored"
        # no link to a repository address or a Colab page of it: the address lives in pyproject.toml only
        assert "github.com" not in c.source and "colab.research.google.com" not in c.source, name
    assert nb.metadata.kernelspec.name == "python3"


def _install_cell():
    cells = {nbformat.read(os.path.join(COLAB, f"{n}.ipynb"), as_version=4).cells[1].source for n in NOTEBOOKS}
    assert len(cells) == 1, "the notebooks' install cells differ"
    return cells.pop()


def _run_install_cell(cwd):
    """The install cell in a fresh interpreter that cannot import jmsnas, started in ``cwd``, with pip replaced by
    a recorder: (exit code, stdout, stderr)."""
    prog = (
        "import importlib.util, subprocess, sys\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'jmsnas' else find(n, *a)\n"
        "subprocess.run = lambda cmd, check: print('RAN', cmd[1:])\n"
        f"exec(compile({_install_cell()!r}, 'install-cell', 'exec'))\n"
        "print('PATH0', sys.path[0])\n")
    out = subprocess.run([sys.executable, "-c", prog], cwd=cwd, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return out.returncode, out.stdout, out.stderr


def test_the_install_cell_installs_the_clone_it_sits_in(tmp_path):
    code, out, err = _run_install_cell(COLAB)  # a notebook opened from colab/ of a clone
    assert code == 0, err
    assert f"RAN ['-m', 'pip', 'install', '-q', '-e', {REPO!r}]" in out and f"PATH0 {REPO}" in out


def test_the_install_cell_installs_a_clone_in_the_working_folder(tmp_path):
    clone = tmp_path / "jmsnas-clone"
    (clone / "jmsnas").mkdir(parents=True)
    (clone / "jmsnas" / "cli.py").write_text("")
    code, out, err = _run_install_cell(tmp_path)  # Colab: the repository uploaded into /content
    assert code == 0, err
    assert f"'-e', {str(clone)!r}]" in out


def test_the_install_cell_says_what_to_do_without_a_clone(tmp_path):
    code, out, err = _run_install_cell(tmp_path)
    assert code != 0 and "RAN" not in out
    assert "RuntimeError: jmsnas is not installed and no clone of its repository is here" in err


def test_the_repository_address_is_written_once():
    """Publishing the repository elsewhere is one line: pyproject.toml's [project.urls] Repository."""
    url = _repository()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url)
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    holders = []
    for f in files:
        path = os.path.join(REPO, f)
        if not os.path.isfile(path) or os.path.getsize(path) > 5_000_000:
            continue
        with open(path, "rb") as fh:
            if url.encode() in fh.read():
                holders.append(f)
    assert holders == ["pyproject.toml"]


def test_ci_runs_the_quick_settings():
    with open(os.path.join(COLAB, "conftest.py")) as f:
        assert 'os.environ.setdefault("JMSNAS_NOTEBOOK_QUICK", "1")' in f.read()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert "colab" in cfg["testpaths"] and "--nbmake" in cfg["addopts"]
