"""Routers, one file per family; each registers its names with :func:`register`.

A router is an ``nn.Module`` built as ``cls(d_model, num_experts, top_k, **options)`` whose
``forward(x, experts, ctx)`` maps tokens ``x (T, d)`` to a :class:`moelab.Routing`.  ``experts``
is the layer's expert bank (competition runs it); ``ctx`` the shared
:class:`moelab.RoutingContext` or ``None``.  ``layer_index`` is set by :func:`moelab.attach`.
"""

from __future__ import annotations

import inspect

from torch import nn

ROUTERS: dict[str, type[nn.Module]] = {}


def register(name: str):
    """Class decorator: make a router available to the presets under ``name``."""

    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        if name in ROUTERS:
            raise ValueError(f"router {name!r} is already registered")
        ROUTERS[name] = cls
        return cls

    return deco


def router_options(cls: type[nn.Module]) -> list[str]:
    """The keyword options a router class accepts (beyond d_model, num_experts, top_k)."""
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p not in ("self", "d_model", "num_experts", "top_k")]


def build_router(name: str, d_model: int, num_experts: int, top_k: int, **options) -> nn.Module:
    if name not in ROUTERS:
        raise ValueError(f"router={name!r} is not registered; allowed: {sorted(ROUTERS)}")
    return ROUTERS[name](d_model, num_experts, top_k, **options)


from . import compete, cosine, hyper, sigmoid, stable, topk  # noqa: E402,F401  (registration)
