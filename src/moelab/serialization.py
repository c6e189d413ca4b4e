"""Checkpoints as two files: ``model.safetensors`` (every tensor of the state dict) and
``state.json`` (everything else: step, routing context, config), both written atomically.

safetensors stores raw little-endian bytes with dtype and shape, so a checkpoint loads
bit-exactly in a fresh process, on any machine, without unpickling code.  Tensors that share
storage (tied embeddings) are written once per key; loading copies each key into the model, so
the tie survives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .layer import moe_layers
from .rundir import atomic_write_bytes, atomic_write_text

__all__ = ["STATE_NAME", "WEIGHTS_NAME", "load_checkpoint", "load_state_dict", "save_checkpoint"]

WEIGHTS_NAME = "model.safetensors"
STATE_NAME = "state.json"
FORMAT = "moelab-checkpoint"


def _safetensors_torch():
    try:
        import safetensors.torch as st
    except ImportError as exc:  # pragma: no cover - safetensors ships with transformers
        raise ImportError("moelab checkpoints need safetensors: pip install safetensors") from exc
    return st


def _tensors(model_or_state: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in state.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"state entry {key!r} is a {type(value).__name__}, not a tensor")
        t = value.detach().to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses shared or partial storage: store this key on its own
        seen.add((t.untyped_storage().data_ptr(), t.storage_offset()))
        out[key] = t
    return out


def _routing_context_state(model: nn.Module) -> dict[str, Any] | None:
    for layer in moe_layers(model):
        if layer.ctx is not None:
            return layer.ctx.state_dict()
    return None


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module | Mapping[str, Tensor],
    state: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``directory/model.safetensors`` and ``directory/state.json``.

    Args:
        directory: created if missing; existing checkpoint files are replaced atomically.
        model: a module (its ``state_dict()``, buffers included) or a mapping of tensors.
        state: JSON-serialisable extra state (step, config, ...), stored under ``"state"``.  The
            :class:`moelab.RoutingContext` attached to the model's MoE layers is stored too.

    Returns:
        the directory.
    """
    from ._version import __version__

    directory = Path(directory)
    payload: dict[str, Any] = {"format": FORMAT, "moelab_version": __version__, "state": dict(state or {})}
    if isinstance(model, nn.Module):
        payload["routing_context"] = _routing_context_state(model)
    try:
        text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"state={state!r} is not allowed; expected JSON-serialisable values ({exc})"
        ) from None
    data = _safetensors_torch().save(_tensors(model), metadata={"format": FORMAT})
    atomic_write_bytes(directory / WEIGHTS_NAME, data)
    atomic_write_text(directory / STATE_NAME, text + "\n")
    return directory


def _check_directory(directory: Path) -> None:
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    for name in (WEIGHTS_NAME, STATE_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{str(directory / name)!r} is missing; not a moelab checkpoint")


def load_state_dict(directory: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors and the JSON payload of a checkpoint, without a model."""
    directory = Path(directory)
    _check_directory(directory)
    payload = json.loads((directory / STATE_NAME).read_text(encoding="utf-8"))
    if payload.get("format") != FORMAT:
        raise ValueError(
            f"{str(directory / STATE_NAME)!r} has format={payload.get('format')!r}; expected {FORMAT!r}"
        )
    tensors = _safetensors_torch().load_file(str(directory / WEIGHTS_NAME))
    return tensors, payload


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (bit-exact copy).

    Restores the step of the :class:`moelab.RoutingContext` attached to the model's MoE layers
    when the checkpoint recorded one.

    Returns:
        the extra ``state`` mapping given to :func:`save_checkpoint`.
    """
    tensors, payload = load_state_dict(directory)
    with torch.no_grad():
        model.load_state_dict(tensors, strict=strict)
    ctx_state = payload.get("routing_context")
    if ctx_state is not None:
        for layer in moe_layers(model):
            if layer.ctx is not None:
                layer.ctx.load_state_dict(ctx_state)
                break  # one context is shared by all layers
    return payload.get("state", {})
