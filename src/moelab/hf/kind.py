"""The ``"transformers"`` kind of :func:`moelab.save` / :func:`moelab.load`: a transformers model
with moelab's steps applied to it (:func:`moelab.upcycle`, :func:`moelab.from_hf`,
:func:`moelab.set_method`), recorded as its transformers config and the list of those steps (its
recipe), and rebuilt offline by replaying the recipe on a model built from the config.  Registered
with :mod:`moelab.io.model`'s kinds table when this package is imported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import CheckpointError
from ..io.model import Kind, register_kind
from .convert import from_hf, set_method
from .upcycle import upcycle

__all__ = ["build", "describe"]

#: the recipe steps a saved model may ask for: a fixed table, nothing named in a file is called
_STEPS = {"upcycle", "from_hf", "set_method"}


def _is_transformers_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
               for c in type(model).__mro__)  # fmt: skip


def describe(model: nn.Module) -> dict[str, Any] | None:
    """The class name, the full transformers config and the moelab recipe of a transformers
    model; ``None`` for any other module."""
    if not _is_transformers_model(model):
        return None
    return {
        "model_class": type(model).__name__,
        "transformers_config": json.loads(model.config.to_json_string(use_diff=False)),
        "recipe": list(getattr(model, "_moelab_recipe", [])),
    }


def build(config: dict[str, Any], file: Path) -> nn.Module:
    """A transformers model from its config (offline, random init), then the recorded moelab steps."""
    try:
        import transformers
    except ImportError:  # pragma: no cover
        raise CheckpointError(f"{str(file)!r} holds a transformers model; pip install transformers") from None
    raw = dict(config["transformers_config"])
    model_type = raw.pop("model_type", None)
    if not model_type:
        raise CheckpointError(
            f"{str(file)!r} has no transformers_config.model_type; cannot rebuild the model"
        )
    hf_config = transformers.AutoConfig.for_model(model_type, **raw)
    cls = getattr(transformers, str(config["model_class"]), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(
            f"{str(file)!r} has model_class={config['model_class']!r}; expected a transformers model class"
        )
    model = cls(hf_config)
    for step in config.get("recipe", []):
        step = dict(step)
        op = step.pop("op", None)
        if op not in _STEPS:
            raise CheckpointError(
                f"{str(file)!r} has recipe step op={op!r}; expected 'upcycle', 'from_hf' or 'set_method'"
            )
        if op == "upcycle":
            options = step.pop("options", {})
            upcycle(model, **step, **options)
        elif op == "from_hf":
            from_hf(model)
        else:
            set_method(model, **step)
    return model


register_kind("transformers", Kind(describe=describe, build=build))
