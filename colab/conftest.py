"""The notebooks here run as tests (nbmake, see pyproject.toml) on their quick settings: each reads
JMSNAS_NOTEBOOK_QUICK, which the kernel inherits from this process. Set it to 0 to execute the real runs."""
import os

os.environ.setdefault("JMSNAS_NOTEBOOK_QUICK", "1")
