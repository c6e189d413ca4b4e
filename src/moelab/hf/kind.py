"""The ``"transformers"`` kind of :func:`moelab.save` / :func:`moelab.load`: a transformers model
with moelab's steps applied to it (:func:`moelab.upcycle`, :func:`moelab.from_hf`,
:func:`moelab.set_method`), recorded as its transformers config and the list of those steps (its
recipe), and rebuilt offline by replaying the recipe on a model built from the config.  Registered
with :mod:`moelab.io.model`'s kinds table when this package is imported."""

from __future__ import annotations

import json
import warnings
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


#: the kernels a transformers config chooses that its JSON leaves out (private attributes):
#: recorded beside it, since eager and sdpa attention differ in the last bits of the logits
_IMPLEMENTATIONS = ("attn_implementation", "experts_implementation")


def _implementation(config: Any, name: str) -> str | dict[str, str | None] | None:
    """``config._<name>``: one string when the config and its sub-configs agree, else a dict
    ``{"": top, sub-config key: its own}`` (the form transformers' setter takes)."""
    top = getattr(config, f"_{name}", None)
    subs = {
        k: getattr(getattr(config, k, None), f"_{name}", None) for k in getattr(config, "sub_configs", {})
    }
    subs = {k: v for k, v in subs.items() if getattr(config, k, None) is not None}
    if all(v == top for v in subs.values()):
        return top
    return {"": top, **subs}


def describe(model: nn.Module) -> dict[str, Any] | None:
    """The class name, the full transformers config, its attention and experts implementations
    and the moelab recipe of a transformers model; ``None`` for any other module."""
    if not _is_transformers_model(model):
        return None
    return {
        "model_class": type(model).__name__,
        "transformers_config": json.loads(model.config.to_json_string(use_diff=False)),
        **{name: _implementation(model.config, name) for name in _IMPLEMENTATIONS},
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
    for name in _IMPLEMENTATIONS:  # the kernels it was saved with (older folders: the default)
        value = config.get(name)
        if value is not None:
            setattr(hf_config, f"_{name}", value)
    try:
        model = cls(hf_config)
    except (ImportError, ValueError) as exc:  # e.g. flash attention saved on a machine that had it
        chosen = {n: config.get(n) for n in _IMPLEMENTATIONS if config.get(n) is not None}
        warnings.warn(
            f"{str(file)!r} was saved with {chosen}, which this machine cannot build "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); loaded with transformers' "
            "default kernels instead: the outputs may differ in the last bits",
            stacklevel=3,
        )
        for name in _IMPLEMENTATIONS:
            setattr(hf_config, f"_{name}", None)
        model = cls(hf_config)
    with warnings.catch_warnings():  # said when the steps first ran; the saved weights follow
        warnings.simplefilter("ignore", UserWarning)
        _replay(model, config.get("recipe", []), file)
    return model


def _replay(model: nn.Module, recipe: list, file: Path) -> None:
    for step in recipe:
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


register_kind("transformers", Kind(describe=describe, build=build))
