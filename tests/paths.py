"""Where the tests find the repository and their vendored data, from any folder under tests/ (pyproject.toml puts
tests/ on the import path): REPO is the repository's root, DATA is tests/data."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")
