"""A griffe extension for the docs site (mkdocs.yml): kvblock's docstrings name things with
Sphinx roles (``:class:`KVCacheManager```, ``:func:`~kvblock.hashing.hash_blocks```), which
Markdown would show as literal text; this turns each into inline code (``KVCacheManager``)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):`~?([^`]+)`")


class RstRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring griffe loads as Markdown inline code."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring in place, as griffe loads it."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: f"`{m[1]}`", obj.docstring.value)
