"""The README is a front page: under 1,000 words, its two set-up commands as they are, one click from install to
the reader's own devices, own model and deployment, full citations; and every figure it quotes is the figure of
benchmarks/README.md (one home per figure)."""
import os
import re

from paths import REPO

README = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
BENCH = open(os.path.join(REPO, "benchmarks", "README.md"), encoding="utf-8").read()
SETUP = ("pip install -e . && jmsnas search --config experiments/configs/default.py --workdir runs/default",
         "pip install -e '.[test]' && pytest -q -n 2")
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def _section(text, title):
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"no section {title!r}"
    return m.group(1)


def _rows(text):
    """[(command, result)] of every table row whose second cell is a command in backticks."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 3 and re.fullmatch(r"`[^`]+`", cells[1]):
            out.append((cells[1].strip("`"), " | ".join(cells[2:])))
    return out


def test_the_front_page_is_under_1000_words():
    words = len(README.split())
    assert words < 1000, f"README.md has {words} words"


def test_the_two_setup_commands_are_there_unchanged():
    blocks = re.findall(r"^```bash\n(.*?)^```", README, flags=re.S | re.M)
    assert [b.strip() for b in blocks[:2]] == list(SETUP)


def test_install_says_clone_and_python_version():
    install = _section(README, "Install")
    assert "Clone" in install and re.search(r"Python 3\.11", install)


def test_own_devices_own_model_deployment_one_click_away():
    nxt = _section(README, "Next")
    for page in ("docs/topology.md", "docs/your_model.md", "docs/deploy.md", "docs/library.md",
                 "docs/configuration.md"):
        assert f"]({page})" in nxt, page
        assert os.path.isfile(os.path.join(REPO, page)), page


def test_five_papers_cited_in_full():
    papers = _section(README, "Papers")
    entries = re.findall(r"^\d\. (.+?)(?=^\d\. |\Z)", papers, flags=re.S | re.M)
    assert len(entries) == 5
    index = re.sub(r"\s+", " ", open(os.path.join(REPO, "docs", "index.md"), encoding="utf-8").read())
    for e in entries:
        assert re.search(r"\*[^*]{20,}\*", e) and re.search(r"20\d\d", e), e  # a title and a year
        title = re.search(r"\*([^*]+)\*", e).group(1)
        assert re.sub(r"\s+", " ", title) in index, f"docs/index.md lacks {title!r}"


def prose_mismatches(text, bench):
    """Every number with a unit (%, s, ms, MB, GB, ×) outside the code blocks of ``text`` that benchmarks/README.md
    does not hold."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    home = set(NUMBER.findall(bench))
    return [f"{n} is not in benchmarks/README.md" for n in
            re.findall(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)(?=\s?(?:%|s\b|ms\b|MB\b|GB\b|×))", prose)
            if n not in home]


def test_the_main_job_page_quotes_benchmarks_figures():
    """docs/main_job.md, the README's page for the main job, quotes the same homes."""
    page = open(os.path.join(REPO, "docs", "main_job.md"), encoding="utf-8").read()
    assert not prose_mismatches(page, BENCH)


def figure_mismatches(readme, bench):
    """Every README figure row's command must be a row of benchmarks/README.md, and every number of the README's
    result must appear in that row's result; the main job's printed time and accuracy lines likewise in one line
    of benchmarks/README.md."""
    bad = []
    homes = {}
    for command, result in _rows(bench):
        homes.setdefault(command, result)
    rows = _rows(_section(readme, "Figures"))
    if not rows:
        bad.append("the README quotes no figure row")
    for command, result in rows:
        if command not in homes:
            bad.append(f"{command}: no row of benchmarks/README.md")
            continue
        home = set(NUMBER.findall(homes[command]))
        bad += [f"{command}: {n} is not in its benchmarks/README.md row" for n in NUMBER.findall(result)
                if n not in home]
    bad += prose_mismatches(readme.split("\n## Figures")[0], bench)  # the pitch, install, the main job
    out = re.search(r"^```\n(Architecture per device:.*?)^```", readme, flags=re.S | re.M)
    for key in ("Time:", "Accuracy:", "Parameters:"):
        line = next((ln for ln in out.group(1).splitlines() if ln.startswith(key)), None) if out else None
        if line is None:
            continue
        numbers = NUMBER.findall(line)
        if not any(all(n in NUMBER.findall(b) for n in numbers) for b in bench.splitlines()):
            bad.append(f"the main job's {line!r}: no line of benchmarks/README.md has all of {numbers}")
    return bad


def test_every_figure_the_readme_quotes_is_benchmarks_figure():
    assert not figure_mismatches(README, BENCH)


def test_the_figure_check_catches_a_changed_figure():
    assert figure_mismatches(README.replace("60.1-62.1 s", "58.1-62.1 s"), BENCH)
    time = "Time: {} s wall (59.9 s CPU): compiling 27.0 s (30.0 s CPU), running 13.7 s (20.9 s CPU)\n"
    with_time = lambda wall: README.replace("Parameters: 216,362\n", "Parameters: 216,362\n" + time.format(wall))
    assert not figure_mismatches(with_time("43.1"), BENCH)  # a line of benchmarks/README.md's table
    assert figure_mismatches(with_time("40.7"), BENCH)
    assert figure_mismatches(README.replace("test 96.67%", "test 96.76%"), BENCH)
