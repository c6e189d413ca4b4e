"""A griffe extension for the API reference (mkdocs.yml): moelab's docstrings name other objects with
Sphinx roles (``:class:`moelab.Routing```, ``:func:`aux_loss```), which Markdown would print as they are.
This shows each as inline code, the way the rest of the docs name code."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc):`~?([^`]+)`")


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
