"""docs/: the MkDocs site (every page, the API reference from the docstrings) builds with warnings as errors; the
index links every page; every link leaves the repository only for a public https URL, and every relative link
names a file that exists."""
import os
import re
import subprocess
import sys

import pytest

from paths import REPO as ROOT
DOCS = os.path.join(ROOT, "docs")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages():
    return sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").stat().st_size > 100_000  # the whole package documented
    html = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("jmsnas.tensorboard", "jmsnas.runplot", "jmsnas.cost.latency", "jmsnas.splitnets.search"):
        assert name in html, name
    # the configuration reference, generated from jmsnas.configs and friends (tests/repo/test_configref.py)
    reference = (tmp_path / "site" / "configuration" / "index.html").read_text(encoding="utf-8")
    assert "cost.tables" in reference and "t_const_ms" in reference and "cluster.bandwidth_mbps" in reference


def test_the_index_links_every_page():
    index = open(os.path.join(DOCS, "index.md"), encoding="utf-8").read()
    linked = {m.split("#")[0] for m in LINK.findall(index)}
    missing = [p for p in _pages() if p != "index.md" and p not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def test_links_stay_in_the_repository_or_are_public_urls():
    for page in _pages():
        text = open(os.path.join(DOCS, page), encoding="utf-8").read()
        for target in LINK.findall(text):
            where = f"docs/{page}: {target}"
            if re.match(r"[a-z]+:", target):
                assert target.startswith("https://"), where  # public web pages only (no file:, no http:)
                continue
            path = target.split("#")[0]
            if not path:
                continue  # an anchor on the same page
            assert not os.path.isabs(path), where
            full = os.path.normpath(os.path.join(DOCS, path))
            assert full.startswith(ROOT + os.sep) and os.path.exists(full), where
        # paths of the machine a page was written on are not links a reader can follow
        assert not re.search(r"(?<![\w.])\.\./shared/|/work/|/home/", text), page
