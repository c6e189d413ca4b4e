"""Training checkpoints: a :func:`moelab.save` folder (so :func:`moelab.load` opens one like any saved
model) plus ``state.pt`` with the optimizer, scheduler, routing-context, RNG and counter state,
written atomically by the one atomic writer, the newest ``keep`` kept; :func:`latest_checkpoint`
verifies the digests and falls back to the newest good one.  docs/errors.md ("Training
checkpoints") gives the layout, what a kill or a failed write leaves and the refusals.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..io.atomic import atomic_directory
from ..io.model import CONFIG_NAME, list_checkpoints, load_weights, read_config, save
from ..io.model import latest_checkpoint as _latest_verified

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

STATE = "state.pt"


def save_checkpoint(
    root: str | os.PathLike, step: int, model: nn.Module, state: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint ``root/step-{step:08d}`` atomically and keep the newest ``keep``.

    ``state`` (tensors, numbers, strings, containers) goes to ``state.pt``; its ``"ctx"`` entry,
    when given, is the routing context recorded in ``config.json`` (else the model's own).
    """
    from ..routing import RoutingContext

    root = Path(root)
    final = root / f"step-{step:08d}"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    ctx = None
    if isinstance(state.get("ctx"), dict):
        ctx = RoutingContext(step=int(state["ctx"]["step"]), total_steps=state["ctx"].get("total_steps"))
        ctx.schedule = _schedule_of(model)
    try:
        with atomic_directory(final) as tmp:
            save(model, tmp, ctx=ctx, metadata={"step": step}, extra_files={STATE: buffer.getvalue()})
    except OSError as exc:  # a full disk, a quota, a read-only folder: keep what is there
        kept = [p.name for p in list_checkpoints(root)]
        raise CheckpointError(
            f"cannot write checkpoint {final}: {exc.strerror or exc}; the previous checkpoints are kept "
            f"({', '.join(kept) or 'none'}); free disk space and run again with --resume"
        ) from exc
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _schedule_of(model: nn.Module) -> Any:
    from ..layer import moe_layers

    return next((layer.ctx.schedule for layer in moe_layers(model) if layer.ctx is not None), None)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming the file when ``path`` is incomplete or corrupted."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {path / CONFIG_NAME} is missing")
    config = read_config(path)
    if STATE not in config.get("files", {}):
        raise CheckpointError(
            f"checkpoint {path} has no {STATE}; it is a saved model, not a training checkpoint"
        )


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest training checkpoint under ``root`` that verifies (model files and ``state.pt``);
    a bad one is skipped with a warning naming its file.  ``None`` when there is none."""
    return _latest_verified(root, verify_checkpoint)


def load_checkpoint(path: str | os.PathLike, model: nn.Module) -> dict[str, Any]:
    """Verify checkpoint ``path``, load its weights into ``model`` and return its training state
    (``torch.load(..., weights_only=True)``)."""
    path = Path(path)
    verify_checkpoint(path)
    load_weights(path, model)
    return torch.load(path / STATE, weights_only=True)
