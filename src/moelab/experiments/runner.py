"""The run lifecycle every ``moelab`` command shares: a command declares a config dataclass whose
fields carry their flag, help and constraints (:func:`moelab.config.setting`) and one function that
executes it; this module adds the flags (:func:`moelab.config.add_arguments`), reads ``--config
FILE`` (a run's own ``config.yaml`` included), validates with the flag names in the message, opens
the run directory (lock, ``--force``,
``--resume`` with the recorded-config and data-fingerprint checks, ``--allow-changes``), writes
``config.yaml`` and ``metrics.json``, and sets up rank 0 first under torchrun.  Every refusal
sentence of the lifecycle is written here once.  See docs/architecture-flows.md ("An experiment").
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import (
    build,
    changed_input,
    config_from_mapping,
    flag_of,
    flatten_settings,
    given_values,
    leaf_fields,
    plain,
    setting_of,
    validate,
    values,
)
from ..io.rundir import RUN_ENTRIES, RunDir, read_yaml
from ..train.parallel import process_group

__all__ = [
    "Command",
    "Run",
    "check_memory",
    "check_out_is_no_input",
    "check_run_flags",
    "check_world_size",
    "execute",
    "given_by_args",
    "machine_memory",
    "new_config",
    "read_run_config",
    "refuse_change",
    "refuse_other_data",
    "resolve_config",
    "resume_config",
    "run_command",
]


def _file_values(cls: type, path: str, flag: str) -> dict[str, Any]:
    source = f"{flag} {path!r}"
    data = read_yaml(Path(path), source, empty=True, what="flag names to values")
    data = {k: v for k, v in data.items() if k not in ("command", "recorded")}
    values = flatten_settings(cls, data, source)
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


def check_out_is_no_input(
    cls: type, config: Any, out: str | Path | None, extra: Mapping[str, Any] | None = None
) -> None:
    """Refuse an ``--out`` that is an input of the command or holds one (a ``--from`` run, a
    ``--task`` or ``--data`` file, ``extra``: flag → path such as ``--config``): the run would write
    over it, and ``--force`` remove it."""
    if out is None:
        return
    target = Path(out).resolve()
    given = {
        flag_of(cls, p): values(config).get(p) for p, f, _ in leaf_fields(cls) if setting_of(f).reads_path
    }
    for flag, value in {**given, **(extra or {})}.items():
        if not isinstance(value, (str, os.PathLike)) or not os.path.exists(value):
            continue
        source = Path(value).resolve()
        if source == target or target in source.parents:
            raise ValueError(
                f"{flag} {os.fspath(value)!r} lies in --out {os.fspath(out)!r}: the run would write over "
                f"what it reads (and --force remove it); choose another --out"
                if source != target
                else f"--out {os.fspath(out)!r} is the input {flag} of the command: the run would write over "
                "what it reads (and --force remove it); choose another --out"
            )


def check_run_flags(*, resume: bool, force: bool, allow_changes: bool) -> None:
    """Refuse ``--resume`` with ``--force``, and ``--allow-changes`` without ``--resume``."""
    if resume and force:
        raise ValueError(
            "--resume and --force are not allowed together; --resume continues the run in --out, "
            "--force starts it afresh"
        )
    if allow_changes and not resume:
        raise ValueError(
            "--allow-changes is not allowed without --resume; it lets --resume continue a run with changed "
            "settings (a new run takes any settings: drop --allow-changes)"
        )


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
        for p, f, _ in leaf_fields(cls)
        if setting_of(f).fingerprint in recorded
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
    given = given_values(args, cls)
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
    inputs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole lifecycle: config → run directory → ``command.execute`` → ``metrics.json``.

    ``given``: the settings by field path, or a whole config (every field then counts as given,
    so ``--resume`` of a run made with other settings is refused, as ``compare`` needs); ``inputs``:
    other files the command reads (flag → path: ``--config``), which ``--out`` may not hold."""
    if is_dataclass(given):
        given = values(given)
    if command.out_required and not out:
        raise ValueError("--out is required (the run directory)")
    config, stored = resolve_config(
        command, given, out=out, resume=resume, force=force, allow_changes=allow_changes
    )
    check_out_is_no_input(command.config, config, out, inputs)
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
    check_world_size(run, out)
    try:
        metrics = dict(command.execute(run.config, run) or {})
        if run.dir is not None and rank == 0 and metrics:
            run.dir.write_metrics(metrics)
        return metrics
    finally:
        if run.dir is not None:
            run.dir.close()


def check_world_size(run: Run, out: str | Path | None) -> None:
    """Say once (rank 0) that a resumed run continues on another number of processes than it was
    trained on, and record the number of a new run (or of one resumed with ``--allow-changes``)."""
    old = run.recorded.get("world_size")
    if run.resuming and old is not None and old != run.world and run.rank == 0:
        print(
            f"--resume: the run in {out} was trained on {old} process(es) and continues on {run.world}: the "
            "data order and the per-rank terms (each rank's share of the batch, rank-local balance "
            "statistics) change from here on, so it will not end as an uninterrupted run would"
        )
    if not run.resuming or run.allow_changes:
        run.recorded["world_size"] = run.world


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
            inputs={"--config": args.config} if getattr(args, "config", None) else {},
        )
        return metrics if rank == 0 else {}
    finally:
        if started:
            torch.distributed.destroy_process_group()
