"""What the documentation says is what the code does. In the README, docs/, the notebooks and the pages of
experiments/, benchmarks/ and tests/: every dotted ``jmsnas...`` name imports; every ``jmsnas COMMAND --flag`` shown
is a flag of that command's parser; every config key named (``--config.KEY=VALUE``, or a backticked
``section.key``) exists in a built-in configuration; every relative link outside docs/ names a file that exists
(docs/' own links: test_docs.py). Plain text reading and one import of each named module: a few seconds in all."""
import functools
import glob
import importlib
import os
import re

import nbformat
import pytest

from paths import REPO

from jmsnas import cli
from jmsnas.commands import configref


def _notebook_text(path):
    nb = nbformat.read(path, as_version=4)
    return "\n\n".join(c.source for c in nb.cells)


def _documents():
    """{relative path: text} of the README, every docs/ page, every notebook (all cells), and the pages of
    experiments/, benchmarks/ and tests/ a reader follows from them."""
    out = {"README.md": open(os.path.join(REPO, "README.md"), encoding="utf-8").read()}
    pages = [os.path.join(REPO, "docs", "*.md"), os.path.join(REPO, "experiments", "*.md"),
             os.path.join(REPO, "benchmarks", "README.md"), os.path.join(REPO, "tests", "README.md")]
    for path in sorted(p for pattern in pages for p in glob.glob(pattern)):
        out[os.path.relpath(path, REPO)] = open(path, encoding="utf-8").read()
    for path in sorted(glob.glob(os.path.join(REPO, "colab", "*.ipynb"))):
        out[os.path.relpath(path, REPO)] = _notebook_text(path)
    return out


DOCS = _documents()

# ----------------------------------------------------------------------------------------------- dotted names

NAME = re.compile(r"(?<![\w./~-])jmsnas(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")


def resolves(name: str) -> bool:
    """True when ``jmsnas.a.b.c`` (or ``jmsnas.a.b:c``) names a module or an attribute chain under one."""
    parts = name.replace(":", ".").split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not ".".join(parts[:i]).startswith(e.name):
                raise  # the module exists but one of its own imports is missing: not a doc error
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                try:  # a submodule not imported by its package's __init__
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")
                    continue
                except (ModuleNotFoundError, AttributeError):
                    return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_imports():
    bad = sorted({f"{doc}: {n}" for doc, text in DOCS.items() for n in NAME.findall(text)
                  if not resolves(n.rstrip("."))})
    assert not bad, "names that do not exist:\n" + "\n".join(bad)


def test_the_name_check_catches_a_missing_name():
    assert resolves("jmsnas.run.loop") and resolves("jmsnas.limits.best_split") and resolves("jmsnas.cli:main")
    assert not resolves("jmsnas.pipeline.EpochSaves") and not resolves("jmsnas.splitnets.init")

# ----------------------------------------------------------------------------------------------- commands, flags


@functools.lru_cache(maxsize=None)
def _parsers():
    return cli.build_parser()[1].choices


def _code(text):
    """Every code span and every line of a fenced block (continuation lines joined), and every notebook line."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    out = []
    for b in blocks:
        out += b.replace("\\\n", " ").splitlines()
    out += re.findall(r"`([^`\n]+)`", rest)
    out += [ln for ln in rest.replace("\\\n", " ").splitlines() if ln.lstrip().startswith(("!jmsnas", "%"))]
    return out


INVOCATION = re.compile(r"(?<![\w./-])(?<!from )(?<!import )jmsnas\s+([a-z]+)\b(.*)")
# a notebook or docs example calling the command in Python: cli.main(["search", "--workdir", w, ...])
CALL = re.compile(r"""(?:cli\.main|main)\(\s*\[\s*["']([a-z]+)["']((?:[^\]]|\n)*)\]""")


def commands_shown(text):
    """[(command, [flags])] of every ``jmsnas COMMAND ...`` in the code of ``text``."""
    found = []
    for line in _code(text):
        for m in INVOCATION.finditer(line):
            rest = re.split(r"&&|\s\|\s|;|\s/\s|`", m.group(2))[0]
            found.append((m.group(1), re.findall(r"(?<![\w-])(--[a-z][\w-]*)(?![\w.-])", rest)))
    for m in CALL.finditer(text):
        found.append((m.group(1), re.findall(r"""["'](--[a-z][\w-]*)(?:=[^"']*)?["']""", m.group(2))))
    return found


def bad_flags(text):
    parsers, bad = _parsers(), []
    for command, flags in commands_shown(text):
        if command not in parsers:
            bad.append(f"jmsnas {command}: no such command")
            continue
        known = set(parsers[command]._option_string_actions) | {"--no-compile-cache"}
        bad += [f"jmsnas {command} {f}" for f in flags if f not in known]
    return bad


def test_every_command_and_flag_shown_exists():
    bad = sorted({f"{doc}: {b}" for doc, text in DOCS.items() for b in bad_flags(text)})
    assert not bad, "commands or flags that do not exist:\n" + "\n".join(bad)


def test_the_flag_check_catches_a_missing_flag():
    assert bad_flags("`jmsnas split --model resnet50 --topology chain --no-such-flag`") == [
        "jmsnas split --no-such-flag"]
    assert bad_flags("```bash\njmsnas frobnicate --x\n```") == ["jmsnas frobnicate: no such command"]
    assert bad_flags('cli.main(["search", "--workdir", w, "--resumee"])') == ["jmsnas search --resumee"]
    assert not bad_flags("```bash\njmsnas search --config C \\\n  --workdir W --resume\n```")

# ----------------------------------------------------------------------------------------------- config keys


OVERRIDE = re.compile(r"--config\.([A-Za-z_][\w.]*\w)")
REF = re.compile(r"`([a-z_]\w*(?:\.[a-z_]\w*)+)`")
FILE = re.compile(r"\.(json|py|md|ya?ml|txt|npz|ipynb|toml|cc|h|so|csv|png|svg|config)$")


@functools.lru_cache(maxsize=None)
def _modules():
    """{basename: [dotted module names]} of every module of the package (``search``: commands.search, ...)."""
    out = {}
    root = os.path.join(REPO, "jmsnas")
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                name = "jmsnas." + os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                name = name.removesuffix(".__init__")
                out.setdefault(name.rpartition(".")[2], []).append(name)
    return out


def resolves_short(ref: str) -> bool:
    """``limits.best_split``: a name under some module of the package whose last part is ``limits``."""
    head, _, rest = ref.partition(".")
    return any(resolves(f"{m}.{rest}") for m in _modules().get(head, ()))


def bad_refs(text):
    """``--config.KEY`` overrides that name no key, and backticked ``a.b`` (``a`` a config section or a module of
    the package) that is neither a config key nor a name under such a module."""
    keys = configref.all_keys()
    sections = {k.split(".")[0] for k in keys if "." in k}
    bad = [f"--config.{k}" for k in OVERRIDE.findall(text) if k not in keys and not k.isupper()]
    for ref in REF.findall(text):
        head = ref.split(".")[0]
        if FILE.search(ref) or (head not in sections and head not in _modules()):
            continue
        if ref not in keys and not resolves_short(ref):
            bad.append(ref)
    return bad


def test_every_config_key_and_short_name_exists():
    bad = sorted({f"{doc}: {b}" for doc, text in DOCS.items() for b in bad_refs(text)})
    assert not bad, "config keys or names that do not exist:\n" + "\n".join(bad)


def test_the_key_check_catches_a_missing_key_or_name():
    assert bad_refs("`--config.search.epochs=3` `--config.cost.tables={ue: t.json}` `cost.tables` "
                    "`--config.KEY=VALUE` `limits.best_split` `cost.latency` `config.json`") == []
    assert bad_refs("--config.search.epoch=3 and `search.epoch` and `evolve.populaton` `limits.best_chain_split`"
                    ) == ["--config.search.epoch", "search.epoch", "evolve.populaton", "limits.best_chain_split"]

# ----------------------------------------------------------------------------------------------- links


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", [d for d in DOCS if not d.startswith("docs/")])  # docs/: test_docs.py
def test_relative_links_resolve(doc):
    here = os.path.dirname(os.path.join(REPO, doc))
    for target in LINK.findall(DOCS[doc]):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        full = os.path.normpath(os.path.join(here, target.split("#")[0]))
        assert full.startswith(REPO + os.sep) and os.path.exists(full), f"{doc}: {target}"

# ----------------------------------------------------------------------------------------------- the library page


@pytest.mark.slow
def test_the_library_page_example_runs():
    """docs/library.md's example, as a reader pastes it (a fresh interpreter; about 15 s of compiling on 2 cores)."""
    import subprocess
    import sys
    text = open(os.path.join(REPO, "docs", "library.md"), encoding="utf-8").read()
    code = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(code) == 1
    out = subprocess.run([sys.executable, "-c", code[0]], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'per_link'" in out.stdout and "'ue->sbs'" in out.stdout  # the printed E[T] breakdown
