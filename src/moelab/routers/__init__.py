"""Routers, one file per family; each registers its names with :func:`register`.

A router is a :class:`Router` subclass (the registry refuses anything else; the base gives every
optional hook a default) built as ``cls(d_model, num_experts, top_k, **options)`` whose
``forward(x, experts, ctx)`` maps tokens ``x (T, d)`` to a :class:`moelab.Routing`.  ``experts``
is the layer's expert bank (competition runs it); ``ctx`` the shared
:class:`moelab.RoutingContext` or ``None``.  ``layer_index`` is set by :func:`moelab.attach`.
The registry lives in :mod:`moelab.routers.base`; importing this package registers every family.
"""

from . import (  # noqa: F401  (registration)
    aoe,
    choice,
    compete,
    cosine,
    deepseek,
    default,
    dynamic,
    emo,
    hyper,
    prototype,
    quantile,
    relu,
    routing_free,
    sigmoid,
    stable,
    threshold,
    topk,
    zero,
)
from .base import ROUTERS, Router, build_router, register, router_options

__all__ = ["ROUTERS", "Router", "build_router", "register", "router_options"]
