"""Persistence: the one atomic writer (:mod:`.atomic`), the one model format (:mod:`.model`:
``config.json`` + ``model.safetensors``, :func:`save` / :func:`load`) and run directories
(:mod:`.rundir`)."""

from .atomic import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    atomic_write_torch,
)
from .model import load, load_weights, read_config, save
from .rundir import RunDir

__all__ = [
    "RunDir",
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_write_torch",
    "load",
    "load_weights",
    "read_config",
    "save",
]
