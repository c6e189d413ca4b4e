"""The one configuration vocabulary of moelab (the ground floor): a config is a dataclass whose
fields carry their constraint, help and flag (:func:`setting`, in the spirit of scikit-learn's
``_parameter_constraints``); from it come validation (:func:`validate`: a one-line ``ValueError``
naming the field or flag, the value and what is allowed, and the config's ``check()`` for the rules
that tie fields together), the argparse flags and ``--help`` (:func:`add_arguments`), reading a
settings mapping (:func:`config_from_mapping`), and the one ``KEY=VALUE`` rule for ``--opt``,
``--option`` and ``--sweep`` (docs/errors-cli.md, "The ``KEY=VALUE`` rule").  The layer's
:class:`moelab.layer_config.MoEConfig` and every command's config are declared with it; the run
lifecycle that reads them is :mod:`moelab.experiments.runner`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

__all__ = [
    "INT64",
    "MAX_COUNT",
    "Interval",
    "Options",
    "Setting",
    "Sweep",
    "add_arguments",
    "build",
    "changed_input",
    "config_from_mapping",
    "flag_of",
    "flatten_settings",
    "format_value",
    "given_values",
    "leaf_fields",
    "parse_key_values",
    "parse_sweep",
    "parse_value",
    "plain",
    "setting",
    "setting_of",
    "validate",
    "values",
]

_META = "moelab"


# ------------------------------------------------------------------------------ constraints
#: the most steps, epochs, iterations, rounds or runs a command accepts: at a millisecond each (no
#: step of moelab's is faster) 10**9 take eleven days; a count beyond cannot finish
MAX_COUNT = 10**9
#: the range of a 64-bit integer, the most any integer setting can hold (a seed, a size)
INT64 = 2**63 - 1


@dataclass(frozen=True)
class Interval:
    """Numbers of ``kind`` (``int`` or ``float``) between ``low`` and ``high`` (``None``: unbounded);
    ``closed`` says which ends belong: ``both``, ``left``, ``right`` or ``neither``.  Floats must be
    finite."""

    kind: type
    low: float | None = None
    high: float | None = None
    closed: str = "both"

    def allows(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        left = self.closed in ("both", "left")
        right = self.closed in ("both", "right")
        if self.low is not None and not (value >= self.low if left else value > self.low):
            return False
        return self.high is None or (value <= self.high if right else value < self.high)

    def __str__(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        left, right = self.closed in ("both", "left"), self.closed in ("both", "right")
        if self.low is not None and self.high is not None:
            low, high = _number(self.low), _number(self.high)
            return f"{what} in {'[' if left else '('}{low}, {high}{']' if right else ')'}"
        if self.kind is int and self.low == 1 and left and self.high is None:
            return "a positive integer"
        if self.low is not None:
            return f"{what} {'>=' if left else '>'} {_number(self.low)}"
        if self.high is not None:
            return f"{what} {'<=' if right else '<'} {_number(self.high)}"
        return what


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Options:
    """One of a fixed set of values."""

    values: tuple[Any, ...]

    def allows(self, value: Any) -> bool:
        return any(type(value) is type(v) and value == v for v in self.values)

    def __str__(self) -> str:
        return f"one of {list(self.values)}"


@dataclass(frozen=True)
class Setting:
    """The flag metadata of a config field (see :func:`setting`)."""

    help: str
    flag: str | None = None
    allowed: tuple[Any, ...] = ()
    input: bool = True
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    fingerprint: str | None = None
    path: bool = False

    @property
    def reads_path(self) -> bool:
        """Whether the value may name a file or folder the run reads (never its ``--out``)."""
        return self.path or self.fingerprint is not None


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    allowed: tuple[Any, ...] | Any = (),
    input: bool = True,
    metavar: str | None = None,
    aliases: tuple[str, ...] = (),
    fingerprint: str | None = None,
    path: bool = False,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A config field with its flag.

    Args:
        default: the value when neither the flag nor ``--config`` gives one.
        help: the flag's ``--help`` text.
        flag: the flag when it is not ``--field-name``.
        allowed: constraints; the value must satisfy one of them: an :class:`Interval`, an
            :class:`Options`, ``None`` (the value may be unset) or a type (``str``, ``bool``, ``dict``).
            Empty: any value of the field's type.
        input: whether the field is an input of the run, compared by ``--resume`` (``False`` for
            how a run is executed rather than what it computes: threads, progress bars, where the
            data lies when its fingerprint decides).
        metavar: the flag's metavar in ``--help``.
        aliases: other spellings of the flag (``-T`` beside ``--tokens``).
        fingerprint: for a file or folder input, the key under ``recorded`` of its sha256
            (:meth:`Run.check_fingerprint`): when the run recorded one and the value given to
            ``--resume`` names an existing path, the digest decides, not the path (the same data
            moved elsewhere continues the run).
        path: the value may name a file or folder the run reads (a field with a ``fingerprint``
            does too): ``--out`` may neither be nor hold it.
    """
    if not isinstance(allowed, tuple):
        allowed = (allowed,)
    meta = {
        _META: Setting(
            help=help,
            flag=flag,
            allowed=allowed,
            input=input,
            metavar=metavar,
            aliases=tuple(aliases),
            fingerprint=fingerprint,
            path=path,
        )
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_of(f: dataclasses.Field) -> Setting:
    return f.metadata.get(_META) or Setting(help="")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(hint: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of an annotation: ``int | None`` → ``(int, True)``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """Every leaf field of ``cls`` as ``(path, field, type hint)``; a field whose type is a dataclass
    contributes its own fields (its flags stand beside the others)."""
    out = []
    hints = _hints(cls)
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            out.extend(leaf_fields(hint, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", f, hint))
    return out


def flag_of(cls: type, path: str) -> str:
    """The flag of the field at ``path`` (``"train.steps"`` → ``--steps``)."""
    for p, f, _ in leaf_fields(cls):
        if p == path:
            return setting_of(f).flag or "--" + f.name.replace("_", "-")
    return "--" + path.rsplit(".", 1)[-1].replace("_", "-")


# ------------------------------------------------------------------------------ validation
def _check(flag: str, value: Any, hint: Any, s: Setting, python: bool = False) -> Any:
    """``value`` checked against the field's type and constraints; returned converted (an int given
    to a float field becomes a float, a list to a tuple field a tuple).  ``python``: the message
    spells values as Python does (``True or False``), for a config given as arguments."""
    base, optional = _base_type(hint)
    given = value
    if value is None:
        if optional or None in s.allowed:
            return None
        raise ValueError(f"{flag}=None is not allowed; expected {_expected(base, s, python)}")
    origin = typing.get_origin(base) or base
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        value = origin(value)
    ok_type = (
        isinstance(value, bool)
        if base is bool
        else (isinstance(value, typing.get_args(base)) and not isinstance(value, bool))
        if origin in (typing.Union, types.UnionType)
        else (isinstance(value, origin) and not isinstance(value, bool))
        if isinstance(origin, type)
        else True
    )
    constraints = [c for c in s.allowed if c is not None]
    ok = ok_type and (not constraints or any(_allows(c, value) for c in constraints))
    if not ok:
        raise ValueError(f"{flag}={given!r} is not allowed; expected {_expected(base, s, python)}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64:
        raise ValueError(
            f"{flag}={given!r} is not allowed; expected {_expected(base, s, python)} of at most 2**63 - 1 "
            "(a 64-bit integer)"
        )
    return value


def _allows(constraint: Any, value: Any) -> bool:
    if isinstance(constraint, type):
        return isinstance(value, constraint)
    return constraint.allows(value)


def _expected(base: Any, s: Setting, python: bool = False) -> str:
    constraints = [str(c) if not isinstance(c, type) else _type_name(c) for c in s.allowed if c is not None]
    if not constraints:
        constraints = [_type_name(typing.get_origin(base) or base)]
    text = " or ".join(constraints)
    return text.replace("true or false", "True or False") if python else text


def _type_name(t: Any) -> str:
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        dict: "a mapping",
        tuple: "a list",
        list: "a list",
    }.get(t, getattr(t, "__name__", str(t)))


def validate(config: Any, names: str = "flags") -> Any:
    """Check every field of ``config`` against its type and constraints; a one-line
    ``ValueError`` names the field — by its flag (``names="flags"``, a command's config) or its
    argument name (``names="arguments"``, a config given as Python arguments) — the value and what
    is allowed.  Then the config's ``check()``, if it has one, for the rules that tie fields
    together.  Returns ``config`` with values converted (ints given to float fields become floats)."""
    changes = {}
    hints = _hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(hints[f.name]):
            changes[f.name] = validate(value, names)
            continue
        s = setting_of(f)
        name = f.name if names == "arguments" else s.flag or "--" + f.name.replace("_", "-")
        changes[f.name] = _check(name, value, hints[f.name], s, python=names == "arguments")
    checked = dataclasses.replace(config, **changes)
    if hasattr(checked, "check"):  # rules that tie fields together
        checked.check()
    return checked


# ------------------------------------------------------------------------------ flags
def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    run: bool = True,
    exclude: tuple[str, ...] = (),
    out_default: str | None = None,
    out_help: str = "run directory",
) -> None:
    """The flags of every field of ``cls`` (defaults shown in ``--help``; a flag not given leaves no
    attribute, so the config file, the recorded run or the dataclass default decides), plus
    ``--config`` and, with ``run``, ``--out``, ``--resume``, ``--force`` and ``--allow-changes``.
    ``exclude``: fields (by path) the command sets itself, which get no flag; ``out_help``: what
    ``--out`` names.  The parser's default ``_config_class`` is ``cls``: what a command line of this
    parser configures (the CLI's tests find every command's config there)."""
    parser.set_defaults(_config_class=cls)
    for path, f, hint in leaf_fields(cls):
        if path in exclude:
            continue
        s = setting_of(f)
        flag = s.flag or "--" + f.name.replace("_", "-")
        base, _ = _base_type(hint)
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = (
            ""
            if default is None or default == {}
            else f" (default: {format_value(default) if not isinstance(default, (tuple, list)) else ','.join(map(str, default))})"
        )
        kw: dict[str, Any] = dict(
            dest=path, default=argparse.SUPPRESS, help=(s.help + shown).replace("%", "%%")
        )
        origin = typing.get_origin(base) or base
        if base is bool:
            if default is True:
                flag = s.flag or "--no-" + f.name.replace("_", "-")
                kw.update(action="store_false")
            else:
                kw.update(action="store_true")
        elif origin is dict:
            kw.update(action="append", metavar=s.metavar or "KEY=VALUE", type=str)
        elif origin in (tuple, list):
            item = (typing.get_args(base) or (str,))[0]
            kw.update(type=_list_of(flag, item), metavar=s.metavar or "V1,V2,...")
        else:
            kw.update(type=_scalar(base), metavar=s.metavar)
            options = [c for c in s.allowed if isinstance(c, Options)]
            if options and all(isinstance(v, str) for v in options[0].values) and s.metavar is None:
                # shown, not enforced by argparse: validation refuses a bad value in the house's words
                kw.update(metavar="{" + ",".join(options[0].values) + "}")
        parser.add_argument(flag, *s.aliases, **kw)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of settings (flag names as keys), e.g. a run's config.yaml",
    )
    if run:
        parser.add_argument(
            "--out",
            default=out_default,
            help=out_help + (f" (default: {out_default})" if out_default else ""),
        )
        parser.add_argument("--resume", action="store_true", help="continue the run in --out")
        parser.add_argument(
            "--force",
            action="store_true",
            help="start afresh: first remove what moelab wrote in --out (never other files)",
        )
        parser.add_argument(
            "--allow-changes",
            action="store_true",
            dest="allow_changes",
            help="with --resume: continue even though flags or the data differ from the run's config.yaml",
        )


def _integer(text: str) -> int:
    """An integer flag's value: digits, or a whole number in exponent notation (``--steps 1e6``; the
    bounds of the field then decide, e.g. :data:`MAX_COUNT`)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (expected a whole number)")
    return int(number)


def _int_or_text(text: str) -> int | str:
    try:
        return _integer(text)
    except argparse.ArgumentTypeError:
        return text


def _scalar(base: Any) -> Callable[[str], Any]:
    if base is int:
        return _integer
    if set(typing.get_args(base)) == {int, str}:  # a count or a word (--keep-ckpts 5 or all)
        return _int_or_text
    if base is float:
        return float
    return str


def _list_of(flag: str, item: Any) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        parts = [p.strip() for p in text.split(",")]
        try:
            return [item(p) for p in parts if p]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of "
                + {int: "integers", float: "numbers"}.get(item, _type_name(item))
            ) from None

    return parse


def given_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields the command line gave, by path; ``--opt``-style items parsed to a mapping."""
    given = {}
    for path, f, hint in leaf_fields(cls):
        if hasattr(args, path):
            value = getattr(args, path)
            base, _ = _base_type(hint)
            if (typing.get_origin(base) or base) is dict:
                flag = setting_of(f).flag or "--" + f.name.replace("_", "-")
                value = parse_key_values(value, flag)
            given[path] = value
    return given


# ------------------------------------------------------------------------------ config files
def flatten_settings(cls: type, data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A settings mapping (a run's nested ``config.yaml``, or flag names as keys) → values by field
    path; an unknown key is refused naming ``source`` and what is allowed."""
    items = leaf_fields(cls)
    by_key: dict[str, str] = {}
    for path, f, _ in items:
        s = setting_of(f)
        by_key[path] = path
        by_key[f.name] = path
        by_key[(s.flag or "--" + f.name).lstrip("-").replace("-", "_")] = path
    nested = {f.name for f in fields(cls) if is_dataclass(_hints(cls)[f.name])}
    fields_by_path = {path: (f, hint) for path, f, hint in items}
    out: dict[str, Any] = {}
    unknown: list[str] = []

    def walk(mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            name = str(key).replace("-", "_")
            if not prefix and name in nested and isinstance(value, Mapping):
                walk(value, name + ".")
                continue
            path = by_key.get(prefix + name) or (by_key.get(name) if not prefix else None)
            if path is None:
                unknown.append(str(key))
                continue
            f, hint = fields_by_path[path]
            base, _ = _base_type(hint)
            if (typing.get_origin(base) or base) is dict and isinstance(value, (list, str)):
                # the items of a repeatable KEY=VALUE flag, as on the command line
                flag = setting_of(f).flag or "--" + f.name.replace("_", "-")
                try:
                    value = parse_key_values([value] if isinstance(value, str) else value, flag)
                except ValueError as exc:
                    raise ValueError(f"{source}: {exc}") from None
            out[path] = value

    walk(data, "")
    if unknown:
        allowed = sorted({p.rsplit(".", 1)[-1] for p, _, _ in items})
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}; allowed: {allowed}")
    return out


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls`` from values by field path (the rest at their defaults); not yet validated."""
    kwargs: dict[str, Any] = {}
    hints = _hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            sub = {p.split(".", 1)[1]: v for p, v in values.items() if p.startswith(f.name + ".")}
            kwargs[f.name] = build(hints[f.name], sub)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a field without a default that nothing gave
        missing = [f.name for f in fields(cls) if f.name not in kwargs and f.default is dataclasses.MISSING]
        raise ValueError(f"{', '.join(flag_of(cls, m) for m in missing) or exc} is required") from None


def config_from_mapping(cls: type, data: Mapping[str, Any], source: str, *, recorded: bool = False) -> Any:
    """A config from a settings mapping (``--config`` file or a run's ``config.yaml``), validated;
    errors name ``source``.  ``recorded``: the mapping is a run's own record, which holds every
    input setting: one missing (a truncated or damaged file) is refused rather than read as its
    default, a value the run never recorded."""
    values = flatten_settings(
        cls, {k: v for k, v in data.items() if k not in ("command", "recorded")}, source
    )
    if recorded:
        missing = [flag_of(cls, p) for p, f, _ in leaf_fields(cls) if setting_of(f).input and p not in values]
        if missing:
            raise ValueError(
                f"{source} lacks the recorded settings {', '.join(missing[:5])}"
                f"{' and more' if len(missing) > 5 else ''} (a truncated or damaged file): the run's "
                "settings are unknown"
            )
    try:
        return validate(build(cls, values))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def changed_input(cls: type, new: Mapping[str, Any], old: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first input field (by path) whose value in ``new`` differs from ``old``:
    ``(flag, new value, old value)``; fields absent from ``new`` are not compared."""
    for path, f, _ in leaf_fields(cls):
        if not setting_of(f).input or path not in new:
            continue
        if not _same(new[path], old.get(path)):
            return flag_of(cls, path), new[path], old.get(path)
    return None


def values(config: Any, prefix: str = "") -> dict[str, Any]:
    """The fields of ``config`` by path (nested configs flattened: ``run.steps``)."""
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            out.update(values(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def plain(config: Any) -> dict[str, Any]:
    """``config`` as the nested mapping ``config.yaml`` records."""
    return dataclasses.asdict(config)


# ------------------------------------------------------------------------------ KEY=VALUE
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
