"""Atomic training checkpoints: safetensors weights + the rest of the training state.

A checkpoint is a folder ``ckpt/step-00000100/`` holding

* ``model.safetensors`` — the model weights (``safetensors.torch.save_model``: tied weights
  stored once);
* ``state.pt`` — optimizer, LR scheduler, the routing-context step, every RNG state (python,
  numpy, torch, the data-order generator) and the trainer's counters, saved with ``torch.save``
  and read back with ``weights_only=True`` (no pickled code is executed on load);
* ``meta.json`` — the step and the sha256 of the two files, written last.

The folder is written under a temporary name, every file fsynced, then renamed into place in one
``os.replace``: a process killed at any moment leaves either the complete checkpoint or only a
``.tmp-*`` folder that is ignored (and removed by the next save); a write that fails (a full
disk) removes its temporary folder and raises :class:`CheckpointError`, the older checkpoints
untouched.  The newest ``keep`` checkpoints
are kept.  :func:`latest_checkpoint` verifies the digests and falls back to the newest good one,
saying which file was refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "save_checkpoint",
    "save_weights",
]

WEIGHTS = "model.safetensors"
STATE = "state.pt"
META = "meta.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_weights(path: Path, model: nn.Module) -> None:
    from safetensors.torch import save_model

    save_model(model, str(path))
    _fsync_file(path)


def save_weights(path: str | os.PathLike, model: nn.Module, meta: dict[str, Any] | None = None) -> Path:
    """Write ``model``'s weights to ``path`` (safetensors) atomically, with a ``.json`` sidecar
    holding ``meta`` and the file's sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    _write_weights(tmp, model)
    sidecar = {**(meta or {}), "sha256": _sha256(tmp)}
    side_tmp = path.with_name(f".{path.name}.json.tmp")
    side_tmp.write_text(json.dumps(sidecar, indent=2, sort_keys=True))
    _fsync_file(side_tmp)
    os.replace(tmp, path)
    os.replace(side_tmp, path.with_name(path.name + ".json"))
    _fsync_dir(path.parent)
    return path


def load_weights(path: str | os.PathLike, model: nn.Module) -> dict[str, Any]:
    """Load weights written by :func:`save_weights` (sha256-verified); returns the sidecar meta."""
    from safetensors.torch import load_model

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    side = path.with_name(path.name + ".json")
    meta: dict[str, Any] = {}
    if side.exists():
        meta = json.loads(side.read_text())
        if meta.get("sha256") and _sha256(path) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupted (sha256 does not match {side.name})")
    try:
        load_model(model, str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {exc}") from None
    return meta


def save_checkpoint(
    root: str | os.PathLike, step: int, model: nn.Module, state: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint ``root/step-{step:08d}`` atomically and keep the newest ``keep``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    try:
        tmp.mkdir()
        _write_weights(tmp / WEIGHTS, model)
        torch.save(state, tmp / STATE)
        _fsync_file(tmp / STATE)
        meta = {"step": step, "files": {WEIGHTS: _sha256(tmp / WEIGHTS), STATE: _sha256(tmp / STATE)}}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        _fsync_file(tmp / META)
        _fsync_dir(tmp)
    except OSError as exc:  # a full disk, a quota, a read-only folder: keep what is there
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [p.name for p in list_checkpoints(root)]
        raise CheckpointError(
            f"cannot write checkpoint {final}: {exc.strerror or exc}; the previous checkpoints are kept "
            f"({', '.join(kept) or 'none'}); free disk space and run again with --resume"
        ) from exc
    if final.exists():  # re-saving the same step (resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoint folders under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir())


def verify_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointError` naming the file when ``path`` is incomplete or corrupted."""
    meta_path = path / META
    if not meta_path.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete: {meta_path} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint file {meta_path} is corrupted (not JSON)") from None
    for name, digest in meta.get("files", {}).items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"checkpoint file {f} is truncated or corrupted (sha256 mismatch)")


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``root`` that verifies; a bad one is skipped with a warning
    naming its file.  ``None`` when there is none."""
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            warnings.warn(f"{exc}; falling back to an older checkpoint", stacklevel=2)
            continue
        return path
    return None


def load_checkpoint(path: str | os.PathLike, model: nn.Module) -> dict[str, Any]:
    """Verify checkpoint ``path``, load its weights into ``model`` and return its state dict."""
    from safetensors.torch import load_model

    path = Path(path)
    verify_checkpoint(path)
    load_model(model, str(path / WEIGHTS))
    return torch.load(path / STATE, weights_only=True)
