"""The run directory every experiment writes, ``config.yaml``, ``metrics.json`` and ``log.csv``,
each by the one atomic writer (:mod:`moelab.io.atomic`) so that a killed run never leaves a
half-written file behind; the model of a run is :func:`moelab.load` of the folder.
docs/architecture-flows.md ("An experiment") and docs/errors-cli.md ("Run directories and CLI commands").
"""

from __future__ import annotations

import csv
import fcntl
import fnmatch
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .atomic import (
    MANIFEST,
    atomic_write_bytes,
    atomic_write_checked,
    atomic_write_text,
    manifest_entries,
    own_folder,
    read_json,
    record_write,
    release_folder,
    remove_stale_temporaries,
    reset_manifest,
    vouched,
    write_event,
)

__all__ = [
    "MANIFEST",
    "MARKERS",
    "OUTPUTS",
    "RunDir",
    "atomic_write_bytes",
    "atomic_write_text",
    "clear_run",
    "holds_run",
    "read_yaml",
]


def _plain(value: Any) -> Any:
    """Make ``value`` YAML/JSON-safe (tuples → lists, paths → str, non-finite floats → None)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _plain(value.item())
    return value


#: what a run directory holds (the markers of a run); ``fits``: the runs of the models a run trains
#: one after another (``moelab specialize``)
RUN_ENTRIES = ("config.yaml", "metrics.json", "log.csv", "tokenizer.json", "best", "ckpt", "fits")
#: the markers of any moelab output folder: a run, a ``moelab.save`` folder (``moelab upcycle``
#: writes one into its run) and a comparison
MARKERS = (*RUN_ENTRIES, "config.json", "results.csv")
#: every other entry a moelab command writes into its folder (``--force`` removes what the folder's
#: manifest lists, not these names): a saved model, ``diagnose``'s, ``compare``'s and ``report``'s
#: tables and plots, ``simulate``'s and ``specialize``'s outputs, the trainer's ``curves.png`` (:mod:`moelab.train.plots`)
OUTPUTS = (
    *MARKERS, "model.safetensors", "diagnostics.json", "runs.csv", "count_models.csv", "val_curves.csv",
    "val_curves.png", "diagnostics.csv", "table.txt", "paper.txt", "losses.csv", "table.csv",
    "estimates.npz", "rates.png", "table.md", "welch.md", "curves.png", "tensorboard",
)  # fmt: skip
LOCK = ".lock"
#: run directories this process owns (path → open lock file): a process may open its own run again
_HELD: dict[Path, int] = {}


#: the longest file name and path the usual file systems allow (ext4, XFS, APFS: 255 bytes a name)
NAME_MAX, PATH_MAX = 255, 4095


def _check_name_lengths(path: Path) -> None:
    """Refuse an ``--out`` the file system cannot create, before anything is written."""
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            raise ValueError(
                f"--out {str(path)[:60]!r}…: the folder name {part[:20]!r}… is {size} bytes; "
                f"expected at most {NAME_MAX} bytes a name"
            )
    if len(os.fsencode(str(path.absolute()))) > PATH_MAX:
        raise ValueError(f"--out {str(path)[:60]!r}… is longer than {PATH_MAX} bytes; choose a shorter path")


def read_yaml(path: Path, source: str, *, empty: bool = False, what: str = "run settings") -> dict[str, Any]:
    """The mapping of a YAML file (``empty``: an empty file is an empty mapping)."""
    if not path.is_file():
        raise FileNotFoundError(f"{source} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if data is None and empty:
            data = {}
    except UnicodeDecodeError:
        raise ValueError(f"{source} is not UTF-8 text (a damaged or binary file)") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{source} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a mapping of {what}, got {type(data).__name__}")
    return data


def _saved_by_moelab(file: Path) -> bool:
    """Whether ``file`` (a ``config.json``) is a ``moelab.save`` folder's, not a transformers model's."""
    try:
        return file.is_file() and json.loads(file.read_bytes()).get("format") == "moelab"
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not a mapping
        return False


def holds_run(path: Path) -> bool:
    """Whether the folder ``path`` holds the output of a moelab command (its manifest, or any of
    :data:`MARKERS`; a ``config.json`` only when ``moelab.save`` wrote it)."""
    return any((path / e.rstrip("/")).exists() for e in manifest_entries(path)) or any(
        (path / name).exists() if name != "config.json" else _saved_by_moelab(path / name) for name in MARKERS
    )


def clear_run(path: Path) -> None:
    """Remove what moelab wrote in ``path``: the entries of its manifest (:data:`MANIFEST`, every
    file and folder a moelab command recorded writing there, the runs of a comparison included) and
    the folders they leave empty; nothing else (a user's CSV, folder or the input of a command)."""
    root = path.resolve()
    entries = manifest_entries(path)
    for entry in entries:  # a nested run's own manifest (written by another process): its files first
        nested = (path / entry).parent
        if entry.endswith(MANIFEST) and nested.resolve() != root and root in nested.resolve().parents:
            clear_run(nested)
    for entry in sorted(entries, key=lambda e: e.count("/"), reverse=True):
        target = path / entry.rstrip("/")
        if root not in target.parent.resolve().parents and target.parent.resolve() != root:
            continue  # beneath a link that leads elsewhere: not the run's
        if target.is_dir() and not target.is_symlink():
            if entry.endswith("/"):
                shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    for entry in entries:  # the folders moelab's writes made and left empty (with their own runs' books)
        for parent in (path / entry.rstrip("/")).parents:
            if parent.resolve() == root or root not in parent.resolve().parents:
                break
            for book in (MANIFEST, LOCK):
                (parent / book).unlink(missing_ok=True)
        for parent in (path / entry.rstrip("/")).parents:
            if parent.resolve() == root or root not in parent.resolve().parents:
                break
            try:
                parent.rmdir()
            except OSError:  # not empty (a user's file), or gone
                break
    reset_manifest(path)


def _unlisted(path: Path) -> list[str]:
    """The marker entries of ``path`` its manifest does not list (a user's files, or a run an older
    moelab wrote before runs kept a manifest)."""
    listed = {e.rstrip("/").split("/")[0] for e in manifest_entries(path)}
    return [
        name
        for name in MARKERS
        if name not in listed
        and ((path / name).exists() if name != "config.json" else _saved_by_moelab(path / name))
    ]


class RunDir:
    """An experiment's output folder, owned by one process.

    Args:
        path: the ``--out`` directory.
        resume: continue a run already in ``path``.
        force: start afresh: the old run in ``path`` is removed first.
        lock: take the folder's advisory lock (every writer does; the reading ranks of a
            ``torchrun`` job do not).

    A folder that already holds a run (a ``config.yaml``, checkpoints or best weights) is refused
    unless ``resume`` or ``force`` is given, so finished work is never overwritten by accident;
    ``resume`` of checkpoints without their ``config.yaml`` is refused (the run cannot continue
    exactly).  While a process holds the folder, a second process is refused in one line naming
    the holder's PID.
    """

    def __init__(
        self, path: str | os.PathLike, resume: bool = False, force: bool = False, lock: bool = True
    ) -> None:
        self.path = Path(path)
        _check_name_lengths(self.path)
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"--out {self.path} exists and is not a directory")
        has_config = (self.path / "config.yaml").exists()
        held = holds_run(self.path)
        unlisted = _unlisted(self.path) if held else []
        if held and not (resume or force):
            raise FileExistsError(
                f"--out {self.path} already holds a run; pass --resume to continue it or --force to remove "
                "the files moelab wrote there"
                if not unlisted
                else f"--out {self.path} already holds {', '.join(unlisted)}, which no moelab run recorded "
                "writing (your files, or a run of an older moelab); pass --resume to continue a run, or "
                "choose another --out"
            )
        if force and not resume and unlisted:
            raise FileExistsError(
                f"--force: --out {self.path} holds {', '.join(unlisted)}, which no moelab run recorded "
                "writing (your files, or a run of an older moelab); --force removes only what moelab "
                "wrote: remove them yourself or choose another --out"
            )
        if resume and not force and not has_config and (self.path / "ckpt").exists():
            raise FileExistsError(
                f"--out {self.path} holds checkpoints but no config.yaml: the run cannot continue exactly; "
                + ("pass --force to start afresh" if not unlisted else "choose another --out")
            )
        if lock:
            self._lock()
            # the folder is ours: what killed writes left (a model-sized temporary file) goes
            remove_stale_temporaries(self.path)
        if force and not resume and held:  # start afresh: nothing of the old run may survive
            clear_run(self.path)
        self.path.mkdir(parents=True, exist_ok=True)

    def remove_written(self, patterns: tuple[str, ...]) -> None:
        """Remove the entries of this folder whose name matches one of the glob ``patterns`` and
        that moelab wrote (its manifest lists them); a user's file of such a name stays."""
        listed = {e.split("/")[0] for e in manifest_entries(self.path)}
        for name in sorted(n for n in listed if any(fnmatch.fnmatchcase(n, p) for p in patterns)):
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)

    def _lock(self) -> None:
        """Take ``path/.lock`` (``fcntl.flock``; released by :meth:`close` or when the process
        ends, even by SIGKILL)."""
        self.path.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in _HELD:
            return
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FileExistsError(
                f"--out {self.path} is in use by another moelab process (PID {holder}); wait for it or "
                "choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[key] = fd
        own_folder(self.path)  # every write beneath it is listed in its manifest

    def close(self) -> None:
        """Release the folder's lock (another process may then open the run)."""
        fd = _HELD.pop(self.path.resolve(), None)
        if fd is not None:
            release_folder(self.path)
            os.close(fd)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_config(self, config: Mapping[str, Any]) -> None:
        atomic_write_text(self.file("config.yaml"), yaml.safe_dump(_plain(config), sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        """``config.yaml`` as a mapping; a damaged file is a one-line ``ValueError`` naming it."""
        path = self.file("config.yaml")
        return read_yaml(path, repr(str(path)))

    def write_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics.json`` (nothing is written when the file already holds exactly these)."""
        data = (json.dumps(_plain(metrics), indent=2, sort_keys=True) + "\n").encode("utf-8")
        path = self.file("metrics.json")
        if path.is_file() and path.read_bytes() == data and vouched(path, data):
            return
        atomic_write_checked(path, data)

    def read_metrics(self) -> dict[str, Any]:
        return read_json(self.file("metrics.json"))

    def append_log(self, row: Mapping[str, Any], name: str = "log.csv") -> None:
        """Append one row to a CSV log (header written on first use; the columns of the first row)."""
        path = self.file(name)
        new = not path.exists() or path.stat().st_size == 0
        fields = list(row)
        write_event()  # the crash harness's kill point (a test hook; no effect unless it is set)
        record_write(path)
        if not new:  # the header already written fixes the columns and their order
            with path.open(newline="") as f:
                fields = next(csv.reader(f), fields)
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(_plain(dict(row)))
            f.flush()

    def read_log(self, name: str = "log.csv") -> list[dict[str, str]]:
        path = self.file(name)
        if not path.exists():
            return []
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
