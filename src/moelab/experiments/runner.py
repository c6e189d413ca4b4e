"""The run lifecycle every ``moelab`` command shares: a command declares a config dataclass whose
fields carry their flag, help and constraints (:func:`setting`, in the spirit of scikit-learn's
``_parameter_constraints``) and one function that executes it; this module derives the argparse
flags from the dataclass, reads ``--config FILE`` (a run's own ``config.yaml`` included),
validates with the flag names in the message, opens the run directory (lock, ``--force``,
``--resume`` with the recorded-config and data-fingerprint checks, ``--allow-changes``), writes
``config.yaml`` and ``metrics.json``, and sets up rank 0 first under torchrun.  Every refusal
sentence of the lifecycle is written here once.  See docs/architecture.md ("An experiment").
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch

from ..io.rundir import RUN_ENTRIES, RunDir, read_yaml
from ..train.parallel import process_group
from .args import format_value, parse_key_values

__all__ = [
    "Command",
    "Interval",
    "Options",
    "Run",
    "add_arguments",
    "build",
    "changed_input",
    "check_memory",
    "check_run_flags",
    "config_from_mapping",
    "execute",
    "flag_of",
    "given_by_args",
    "machine_memory",
    "new_config",
    "plain",
    "read_run_config",
    "refuse_change",
    "refuse_other_data",
    "resolve_config",
    "resume_config",
    "run_command",
    "setting",
    "validate",
    "values",
]

_META = "moelab"


# ------------------------------------------------------------------------------ constraints
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
        )
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _setting_of(f: dataclasses.Field) -> Setting:
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


def _items(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """Every leaf field of ``cls`` as ``(path, field, type hint)``; a field whose type is a dataclass
    contributes its own fields (its flags stand beside the others)."""
    out = []
    hints = _hints(cls)
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            out.extend(_items(hint, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", f, hint))
    return out


def flag_of(cls: type, path: str) -> str:
    """The flag of the field at ``path`` (``"train.steps"`` → ``--steps``)."""
    for p, f, _ in _items(cls):
        if p == path:
            return _setting_of(f).flag or "--" + f.name.replace("_", "-")
    return "--" + path.rsplit(".", 1)[-1].replace("_", "-")


# ------------------------------------------------------------------------------ validation
def _check(flag: str, value: Any, hint: Any, s: Setting) -> Any:
    """``value`` checked against the field's type and constraints; returned converted (an int given
    to a float field becomes a float, a list to a tuple field a tuple)."""
    base, optional = _base_type(hint)
    if value is None:
        if optional or None in s.allowed:
            return None
        raise ValueError(f"{flag}=None is not allowed; expected {_expected(base, s)}")
    origin = typing.get_origin(base) or base
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        value = origin(value)
    ok_type = (
        isinstance(value, bool)
        if base is bool
        else (isinstance(value, origin) and not isinstance(value, bool))
        if isinstance(origin, type)
        else True
    )
    constraints = [c for c in s.allowed if c is not None]
    ok = ok_type and (not constraints or any(_allows(c, value) for c in constraints))
    if not ok:
        raise ValueError(f"{flag}={value!r} is not allowed; expected {_expected(base, s)}")
    return value


def _allows(constraint: Any, value: Any) -> bool:
    if isinstance(constraint, type):
        return isinstance(value, constraint)
    return constraint.allows(value)


def _expected(base: Any, s: Setting) -> str:
    constraints = [str(c) if not isinstance(c, type) else _type_name(c) for c in s.allowed if c is not None]
    if not constraints:
        constraints = [_type_name(typing.get_origin(base) or base)]
    return " or ".join(constraints)


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


def validate(config: Any) -> Any:
    """Check every field of ``config`` against its type and constraints; a one-line
    ``ValueError`` names the flag, the value and what is allowed.  Returns ``config`` with values
    converted (ints given to float fields become floats)."""
    changes = {}
    hints = _hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(hints[f.name]):
            changes[f.name] = validate(value)
            continue
        flag = _setting_of(f).flag or "--" + f.name.replace("_", "-")
        changes[f.name] = _check(flag, value, hints[f.name], _setting_of(f))
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
    ``--out`` names."""
    for path, f, hint in _items(cls):
        if path in exclude:
            continue
        s = _setting_of(f)
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
            "--force", action="store_true", help="start afresh: remove the run in --out first"
        )
        parser.add_argument(
            "--allow-changes",
            action="store_true",
            dest="allow_changes",
            help="with --resume: continue even though flags or the data differ from the run's config.yaml",
        )


def _scalar(base: Any) -> Callable[[str], Any]:
    if base is int:
        return int
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


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields the command line gave, by path; ``--opt``-style items parsed to a mapping."""
    given = {}
    for path, f, hint in _items(cls):
        if hasattr(args, path):
            value = getattr(args, path)
            base, _ = _base_type(hint)
            if (typing.get_origin(base) or base) is dict:
                flag = _setting_of(f).flag or "--" + f.name.replace("_", "-")
                value = parse_key_values(value, flag)
            given[path] = value
    return given


# ------------------------------------------------------------------------------ config files
def _flatten(cls: type, data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A settings mapping (a run's nested ``config.yaml``, or flag names as keys) → values by field
    path; an unknown key is refused naming ``source`` and what is allowed."""
    items = _items(cls)
    by_key: dict[str, str] = {}
    for path, f, _ in items:
        s = _setting_of(f)
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
                flag = _setting_of(f).flag or "--" + f.name.replace("_", "-")
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
    values = _flatten(cls, {k: v for k, v in data.items() if k not in ("command", "recorded")}, source)
    if recorded:
        missing = [flag_of(cls, p) for p, f, _ in _items(cls) if _setting_of(f).input and p not in values]
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


def _file_values(cls: type, path: str, flag: str) -> dict[str, Any]:
    source = f"{flag} {path!r}"
    data = read_yaml(Path(path), source, empty=True, what="flag names to values")
    data = {k: v for k, v in data.items() if k not in ("command", "recorded")}
    values = _flatten(cls, data, source)
    try:  # each value on its own, so that the message names the file
        validate(build(cls, values))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return values


# ------------------------------------------------------------------------------ memory
def machine_memory() -> int:
    """This machine's physical memory in bytes (``os.sysconf``; ``psutil`` where that is missing;
    ``0``: unknown, nothing is refused)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except ImportError:
            return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n < 2**40 else f"{n / 2**40:,.0f} TiB"


def check_memory(config: Any, need: Callable[[Any], int], candidates: Mapping[str, Any], what: str) -> None:
    """Refuse, before anything is allocated, a run whose estimated memory ``need(config)`` (bytes,
    a lower bound) exceeds the machine's, naming the flag that makes it so: of the fields
    ``candidates`` (path → the ordinary value, e.g. the preset's), the one whose ordinary value
    saves most.  ``what``: what the memory holds, for the message."""
    total = machine_memory()
    needed = need(config)
    if not total or needed <= total:
        return
    saved = {}
    for path, ordinary in candidates.items():
        value = values(config).get(path)
        if value is None or ordinary is None or value == ordinary:
            continue
        saved[path] = needed - need(build(type(config), {**values(config), path: ordinary}))
    path = max(saved, key=saved.get) if saved else next(iter(candidates))
    flag, value = flag_of(type(config), path), values(config).get(path)
    raise ValueError(
        f"{flag}={value!r} is not allowed here: {what} would need at least {_gib(needed)}, more than this "
        f"machine's {_gib(total)} of memory; expected a smaller {flag}"
    )


# ------------------------------------------------------------------------------ resume checks
def refuse_change(flag: str, new: Any, old: Any, where: Any) -> ValueError:
    """The one sentence of a ``--resume`` whose setting differs from the recorded one."""
    return ValueError(
        f"--resume: {flag}={new!r} differs from {old!r} recorded in {where}; the run cannot continue "
        "with other settings (pass --allow-changes to continue it with the new ones, or --force to start afresh)"
    )


def refuse_other_data(flag: str, value: Any, new: str, old: str, where: Any) -> ValueError:
    """The one sentence of a ``--resume`` on data whose fingerprint differs from the recorded one."""
    return ValueError(
        f"--resume: {flag} {value!r} has sha256 {new[:12]}…, but the run in {where} was trained on "
        f"{old[:12]}…; the run cannot continue on other data (--allow-changes to continue anyway)"
    )


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
    for path, f, _ in _items(cls):
        if not _setting_of(f).input or path not in new:
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


# ------------------------------------------------------------------------------ the lifecycle
@dataclass
class Command:
    """A ``moelab`` command run through the lifecycle.

    Args:
        name: the subcommand (recorded as ``command`` in ``config.yaml``).
        config: the config dataclass.
        execute: ``execute(config, run) -> metrics`` (``run``: the :class:`Run`).
        resolve: optional ``resolve(config) -> config`` filling values a preset decides (recorded
            resolved, so that a later change of a preset cannot change a resumed run).
        prepare: optional ``prepare(config, world_size)`` run before the run directory is opened:
            checks that need the number of processes, torch's thread count.
        out_required: whether ``--out`` must be given.
    """

    name: str
    config: type
    execute: Callable[[Any, Run], Mapping[str, Any] | None]
    resolve: Callable[[Any], Any] | None = None
    prepare: Callable[[Any, int], None] | None = None
    out_required: bool = True


class Run:
    """One run of a command: its validated ``config``, its directory (``None`` without ``--out``),
    the recorded config when resuming, the process's rank and world size."""

    def __init__(
        self,
        command: Command,
        config: Any,
        rundir: RunDir | None,
        stored: dict | None,
        *,
        resume: bool,
        allow_changes: bool,
        rank: int,
        world: int,
    ) -> None:
        self.command = command
        self.config = config
        self.dir = rundir
        #: whether the run continues from what its directory holds (checkpoints, logs)
        self.resume = resume
        self.stored = stored
        self.allow_changes = allow_changes
        self.rank, self.world = rank, world
        self.recorded: dict[str, Any] = dict((stored or {}).get("recorded") or {})

    @property
    def resuming(self) -> bool:
        return self.stored is not None

    @property
    def path(self) -> Path | None:
        return None if self.dir is None else self.dir.path

    def check_fingerprint(self, flag: str, value: Any, digest: str | None, key: str = "data_sha256") -> None:
        """Refuse to resume on data whose ``digest`` (sha256) differs from the one recorded under
        ``key`` (unless ``--allow-changes``); record it for a new run."""
        old = self.recorded.get(key)
        if self.resuming and not self.allow_changes and old and digest and old != digest:
            raise refuse_other_data(flag, value, digest, old, self.path)
        if digest is not None:
            self.recorded[key] = digest

    def record(self, **values: Any) -> None:
        """What the run measured when it began (parameter counts, data sizes), kept in
        ``config.yaml`` under ``recorded`` and ignored as input."""
        self.recorded.update(values)

    @property
    def writes_config(self) -> bool:
        """Whether this process writes ``config.yaml``: rank 0 of a new run, or of a resumed one
        with ``--allow-changes`` (the new settings); a resumed run keeps its own."""
        return self.dir is not None and self.rank == 0 and (not self.resuming or self.allow_changes)

    def write_config(self) -> None:
        """Write ``config.yaml`` when :attr:`writes_config`."""
        if not self.writes_config:
            return
        self.dir.write_config({"command": self.command.name, **plain(self.config), "recorded": self.recorded})


def read_run_config(cls: type, path: str | Path, command: str | None = None) -> tuple[Any, dict[str, Any]]:
    """The config and the ``recorded`` mapping of a run directory's ``config.yaml``; a file of
    another command (``command``) or a damaged one is refused in one line."""
    file = Path(path) / "config.yaml" if Path(path).is_dir() else Path(path)
    data = read_yaml(file, repr(str(file)))
    if command is not None and data.get("command") != command:
        raise ValueError(
            f"{str(file)!r} is not the config of a moelab {command} run (command={data.get('command')!r})"
        )
    return config_from_mapping(cls, data, repr(str(file)), recorded=True), dict(data.get("recorded") or {})


def check_run_flags(*, resume: bool, force: bool, allow_changes: bool) -> None:
    """Refuse ``--resume`` with ``--force``, and ``--allow-changes`` without ``--resume``."""
    if resume and force:
        raise ValueError(
            "--resume and --force are not allowed together; --resume continues the run in --out, "
            "--force starts it afresh"
        )
    if allow_changes and not resume:
        raise ValueError("--allow-changes is not allowed without --resume; it lets --resume continue a run")


def resume_config(
    command: Command,
    given: Mapping[str, Any],
    stored: Mapping[str, Any],
    where: Any,
    *,
    allow_changes: bool = False,
) -> Any:
    """The config of a resumed run: the settings ``given`` (by field path) over the ``stored``
    ones (the run's recorded mapping, read from ``where``); a given input that differs from the
    recorded value is refused (:func:`refuse_change`) unless ``allow_changes``."""
    cls = command.config
    source = f"--resume: the run's {str(where)!r}"
    if stored.get("command") != command.name:
        raise ValueError(
            f"--resume: {where} is not the config of a moelab {command.name} run "
            f"(command={stored.get('command')!r}); choose another --out or pass --force to start afresh"
        )
    old = values(config_from_mapping(cls, stored, source, recorded=True))
    candidate = validate(build(cls, {**old, **given}))
    if command.resolve is not None:
        candidate = validate(command.resolve(candidate))
    recorded = stored.get("recorded") or {}
    by_digest = {  # files whose recorded sha256 decides, checked when the run reads them
        p
        for p, f, _ in _items(cls)
        if _setting_of(f).fingerprint in recorded
        and isinstance(given.get(p), str)
        and Path(given[p]).is_file()
    }
    new = {p: v for p, v in values(candidate).items() if p in given and p not in by_digest}
    changed = changed_input(cls, new, old)
    if changed is not None and not allow_changes:
        raise refuse_change(*changed, where)
    return candidate


def new_config(command: Command, given: Mapping[str, Any]) -> Any:
    """The config of a new run from the settings ``given`` (by field path), validated and resolved."""
    config = validate(build(command.config, given))
    return validate(command.resolve(config)) if command.resolve else config


def resolve_config(
    command: Command,
    given: Mapping[str, Any],
    *,
    out: str | Path | None,
    resume: bool = False,
    force: bool = False,
    allow_changes: bool = False,
) -> tuple[Any, dict[str, Any] | None]:
    """The command's config from the settings ``given`` (by field path) and, with ``resume``, the
    run's own ``config.yaml`` in ``out`` (:func:`resume_config`).  Returns ``(config, stored
    config.yaml mapping or None)``."""
    check_run_flags(resume=resume, force=force, allow_changes=allow_changes)
    file = None if out is None else Path(out) / "config.yaml"
    if not (resume and file is not None and file.is_file()):
        return new_config(command, given), None
    stored = read_yaml(file, f"--resume: the run's {str(file)!r}")
    return resume_config(command, given, stored, file, allow_changes=allow_changes), stored


def given_by_args(command: Command | type, args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave (flags, then ``--config FILE`` under them), by field path."""
    cls = command.config if isinstance(command, Command) else command
    given = _given(args, cls)
    if getattr(args, "config", None):
        given = {**_file_values(cls, args.config, "--config"), **given}
    return given


def rank_zero_first(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 first, then (after a barrier) on the other ranks of a torchrun job: rank
    0 refuses or clears an existing run and fetches the data once; the others then read it."""
    rank, world = process_group()
    if world == 1:
        return fn()
    if rank == 0:
        result = fn()
        torch.distributed.barrier()
        return result
    torch.distributed.barrier()
    return fn()


def execute(
    command: Command,
    given: Mapping[str, Any] | Any,
    *,
    out: str | Path | None,
    resume: bool = False,
    force: bool = False,
    allow_changes: bool = False,
) -> dict[str, Any]:
    """The whole lifecycle: config → run directory → ``command.execute`` → ``metrics.json``.

    ``given``: the settings by field path, or a whole config (every field then counts as given,
    so ``--resume`` of a run made with other settings is refused, as ``compare`` needs)."""
    if is_dataclass(given):
        given = values(given)
    if command.out_required and not out:
        raise ValueError("--out is required (the run directory)")
    config, stored = resolve_config(
        command, given, out=out, resume=resume, force=force, allow_changes=allow_changes
    )
    rank, world = process_group()
    if command.prepare is not None:
        command.prepare(config, world)

    def open_dir() -> RunDir | None:
        if out is None:
            return None
        return RunDir(out, resume=resume or rank > 0, force=force and rank == 0, lock=rank == 0)

    if resume and out is not None and not any(Path(out, n).exists() for n in RUN_ENTRIES):
        if rank == 0:
            print(f"--resume: {out} holds no run yet; starting one")
        resume, stored = False, None
    run = Run(
        command,
        config,
        rank_zero_first(open_dir),
        stored,
        resume=resume,
        allow_changes=allow_changes,
        rank=rank,
        world=world,
    )
    try:
        metrics = dict(command.execute(run.config, run) or {})
        if run.dir is not None and rank == 0 and metrics:
            run.dir.write_metrics(metrics)
        return metrics
    finally:
        if run.dir is not None:
            run.dir.close()


def run_command(command: Command, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`execute` with the settings, ``--out``, ``--resume``, ``--force`` and
    ``--allow-changes`` of the command line; under torchrun, in the process group it starts (and
    ends).  Returns the metrics on rank 0, ``{}`` on the other ranks."""
    from ..train.distributed import init_from_env

    given = given_by_args(command, args)
    started = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    rank, _ = init_from_env()  # under torchrun: one process of a data-parallel group
    started = started and torch.distributed.is_initialized()
    try:
        metrics = execute(
            command,
            given,
            out=getattr(args, "out", None),
            resume=bool(getattr(args, "resume", False)),
            force=bool(getattr(args, "force", False)),
            allow_changes=bool(getattr(args, "allow_changes", False)),
        )
        return metrics if rank == 0 else {}
    finally:
        if started:
            torch.distributed.destroy_process_group()
