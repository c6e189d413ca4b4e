"""Argument helpers shared by the subcommands: one ``KEY=VALUE`` rule for ``--opt`` (``train``,
``compare``), ``--option`` (``upcycle``) and ``--sweep`` (``compare``), which docs/errors.md ("The
``KEY=VALUE`` rule") states in full.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Sweep", "format_value", "parse_key_values", "parse_sweep", "parse_value"]

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INT = re.compile(r"[+-]?\d+\Z")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?\Z")
_EXAMPLES = {"--sweep": "omega=0.03,0.05", "--option": "balance_coef=0.02"}


def parse_value(text: str) -> Any:
    """``text`` read by the one rule of the module docstring: bool, ``None``, int, float or str."""
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def format_value(value: Any) -> str:
    """The ``VALUE`` text that :func:`parse_value` reads back as ``value`` (bool, None, int, float
    or str); a string that would read as something else is quoted."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return (
            value
            if value and parse_value(value) == value
            else f'"{value}"'
            if '"' not in value
            else f"'{value}'"
        )
    raise ValueError(f"value={value!r} is not allowed; expected a bool, None, a number or a string")


def _split(flag: str, item: object, form: str) -> tuple[str, str]:
    """``(KEY, VALUE text)`` of one ``flag`` item, or a ``ValueError`` naming the flag and the form."""
    example = _EXAMPLES.get(flag, "balance_coef=0")
    allowed = f"expected {form}, e.g. {flag} {example}"
    if not isinstance(item, str) or "=" not in item:
        raise ValueError(f"{flag} {item!r} is not allowed; {allowed}")
    key, value = (part.strip() for part in item.split("=", 1))
    if not _KEY.match(key):
        raise ValueError(
            f"{flag} {item!r} is not allowed; KEY {key!r} must be a name of letters, digits and _ "
            f"not starting with a digit ({allowed})"
        )
    if not value:
        raise ValueError(
            f'{flag} {item!r} is not allowed; VALUE is empty ({allowed}; {key}="" is the empty string)'
        )
    return key, value


def parse_key_values(items: Iterable[str] | None, flag: str) -> dict[str, Any]:
    """``["key=value", ...]`` given to ``flag`` → ``{key: value}``, each value read by
    :func:`parse_value`; a malformed item raises a ``ValueError`` naming ``flag``, the item and the
    allowed form."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, value = _split(flag, item, "KEY=VALUE")
        out[key] = parse_value(value)
    return out


@dataclass(frozen=True)
class Sweep:
    """A parsed ``--sweep``: the option ``key``, its ``values`` and each value's ``labels`` (the text
    as written, used in folder names)."""

    key: str
    values: list[Any]
    labels: list[str]


def parse_sweep(text: str | None, flag: str = "--sweep") -> Sweep | None:
    """``"omega=0.01,0.05"`` → ``Sweep("omega", [0.01, 0.05], ["0.01", "0.05"])`` (``None`` for no
    sweep).  Each label becomes part of a folder name under ``--out``, so a value holding a path
    separator or ``..`` is refused: a sweep never writes outside ``--out``."""
    if text is None or not text.strip():
        return None
    form = "KEY=V1,V2,..."
    key, value = _split(flag, text, form)
    labels = [part.strip() for part in value.split(",")]
    for i, label in enumerate(labels, 1):
        if not label:
            raise ValueError(
                f"{flag} {text!r} is not allowed; value {i} of the list is empty (expected {form}, "
                f"e.g. {flag} {_EXAMPLES['--sweep']})"
            )
        seps = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
        if ".." in label or any(s in label for s in seps) or any(ord(c) < 32 for c in label):
            raise ValueError(
                f"{flag} {text!r} is not allowed; value {label!r} names a folder under --out, so it "
                "may not hold '/', '\\', '..' or control characters"
            )
    values = [parse_value(label) for label in labels]
    seen: list[Any] = []
    for label, v in zip(labels, values):
        if any(type(v) is type(s) and v == s for s in seen):
            raise ValueError(f"{flag} {text!r} is not allowed; value {label!r} is given twice")
        seen.append(v)
    return Sweep(key, values, labels)
