"""MkDocs hooks: the site's repository link is pyproject.toml's ``[project.urls] Repository`` (the one place the
address is written, so publishing elsewhere is a one-line change), and links from docs/ to files of the repository
outside docs/ (``../experiments/x.md``, ``../README.md``, ``../colab/x.ipynb``) point at the file in that
repository in the built site, where the relative path would lead nowhere. In the repository itself (GitHub, an editor) the relative links work as
written; ``tests/repo/test_docs.py`` checks that each one names a file that exists."""
from __future__ import annotations

import os
import re
import tomllib

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def repository() -> str:
    """The repository's address, from pyproject.toml."""
    with open(os.path.join(_REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"]


def on_config(config):
    config["repo_url"] = repository()
    config["repo_name"] = "GitHub" if "github.com" in config["repo_url"] else "Repository"
    return config


def on_page_markdown(markdown, page, config, files):
    base = repository().rstrip("/") + "/blob/main/"
    here = os.path.dirname(os.path.join(config["docs_dir"], page.file.src_path))

    def rewrite(m):
        target = os.path.relpath(os.path.normpath(os.path.join(here, m.group(1))), _REPO)
        return f"]({base}{target.replace(os.sep, '/')}{m.group(2) or ''})"

    return _LINK.sub(rewrite, markdown)
