"""The run directory every experiment writes: ``config.yaml``, ``metrics.json``, ``log.csv``.

Files are written by the one atomic writer (:mod:`moelab.io.atomic`) so a killed run never
leaves a half-written file behind.  The model of a run: :func:`moelab.load` of the folder.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .atomic import atomic_write_bytes, atomic_write_text

__all__ = ["RunDir", "atomic_write_bytes", "atomic_write_text"]


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


class RunDir:
    """An experiment's output folder.

    Args:
        path: the ``--out`` directory.
        resume: continue a run already in ``path``.
        force: overwrite a run already in ``path``.

    A folder that already holds a run (a ``config.yaml``) is refused unless ``resume`` or
    ``force`` is given, so finished work is never overwritten by accident.
    """

    def __init__(self, path: str | os.PathLike, resume: bool = False, force: bool = False) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"--out {self.path} exists and is not a directory")
        if (self.path / "config.yaml").exists() and not (resume or force):
            raise FileExistsError(
                f"--out {self.path} already holds a run; pass --resume to continue it or --force"
            )
        if force and not resume and (self.path / "config.yaml").exists():
            # start afresh: the old run's config, metrics and CSV logs would otherwise mix with the new
            for old in [self.path / "config.yaml", self.path / "metrics.json", *self.path.glob("*.csv")]:
                old.unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_config(self, config: Mapping[str, Any]) -> None:
        atomic_write_text(self.file("config.yaml"), yaml.safe_dump(_plain(config), sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.file("config.yaml").read_text())

    def write_metrics(self, metrics: Mapping[str, Any]) -> None:
        atomic_write_text(
            self.file("metrics.json"), json.dumps(_plain(metrics), indent=2, sort_keys=True) + "\n"
        )

    def read_metrics(self) -> dict[str, Any]:
        return json.loads(self.file("metrics.json").read_text())

    def append_log(self, row: Mapping[str, Any], name: str = "log.csv") -> None:
        """Append one row to a CSV log (header written on first use; the columns of the first row)."""
        path = self.file(name)
        new = not path.exists() or path.stat().st_size == 0
        fields = list(row)
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
