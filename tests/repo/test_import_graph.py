"""The package's import graph (DESIGN.md: every arrow points down): no cycle among jmsnas' modules, counting
module-level and function-level imports alike, and no module importing another module's private (_name) names."""
import ast
import os

from paths import REPO

ROOT = os.path.join(REPO, "jmsnas")


def _graph():
    """({module: set of jmsnas modules it imports}, [(module, source, private name)])."""
    mods = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = "jmsnas." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name[:-9] if name.endswith(".__init__") else name] = path

    def owner(name):  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges, private = {m: set() for m in mods}, []
    for m, path in mods.items():
        package = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
                private += [(m, base, a.name) for a in node.names if a.name.startswith("_")
                            and not a.name.startswith("__") and owner(base) not in (None, m)]
            else:
                continue
            edges[m] |= {owner(t) for t in targets if t.startswith("jmsnas") and owner(t) not in (None, m)}
    return edges, private


def _cycle(edges):
    """One cycle of the graph as a list of modules, or None (depth-first search)."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = "done"
        stack.pop()
        return None

    for v in sorted(edges):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    edges, _ = _graph()
    assert len(edges) > 100  # the whole package was read
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_another_modules_private_names():
    _, private = _graph()
    assert private == [], private
