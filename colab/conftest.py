"""The notebooks here run as tests (nbmake, see pyproject.toml) on their quick settings: each reads
JMSNAS_NOTEBOOK_QUICK, which the kernel inherits from this process. Set it to 0 to execute the real runs."""
import os

os.environ.setdefault("JMSNAS_NOTEBOOK_QUICK", "1")


def pytest_collection_modifyitems(config, items):
    """Every notebook is an end-to-end run (minutes each): marked ``slow``, so ``pytest -m "not slow"`` (the quick
    loop) leaves them to CI, which runs everything."""
    import pytest
    for item in items:
        if item.nodeid.endswith(".ipynb") or ".ipynb" in item.nodeid.split("::")[0]:
            item.add_marker(pytest.mark.slow)
