"""Griffe extension for the API reference (mkdocs.yml): the docstrings write indexing as ``U[m][n]`` or
``entry[l][op]``, which Markdown would read as a reference link ``[text][id]`` (and mkdocs-autorefs as a
cross-reference to an object named ``n`` or ``op``). The second bracket of every ``][`` outside code spans is
escaped, so the notation prints as written."""
from __future__ import annotations

import re

import griffe

_CODE_OR_PAIR = re.compile(r"(``.*?``|`[^`]*`)|\]\[")


class IndexNotation(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        doc = obj.docstring
        if doc is not None and "][" in doc.value:
            doc.value = _CODE_OR_PAIR.sub(lambda m: m.group(1) or "]\\[", doc.value)
