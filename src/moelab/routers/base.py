"""What every router shares: the registry of router families (name → :class:`Router` subclass),
sizes, validation, the step a context reports, and a default for every optional hook."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .. import _validate
from ..routing import RoutingContext

__all__ = ["ROUTERS", "Router", "build_router", "register", "router_options"]

#: router family name → class; filled by :func:`register` when ``moelab.routers`` is imported
ROUTERS: dict[str, type[Router]] = {}


def register(name: str):
    """Class decorator: make a router available to the presets under ``name``.

    Raises:
        ValueError: the class is not a :class:`Router` subclass (whose hooks callers rely on), or
            ``name`` is taken.
    """

    def deco(cls: type[Router]) -> type[Router]:
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise ValueError(
                f"router {name!r} of type {getattr(cls, '__name__', cls)!r} is not allowed; expected a "
                "subclass of moelab.routers.Router"
            )
        if name in ROUTERS:
            raise ValueError(f"router {name!r} is already registered")
        ROUTERS[name] = cls
        return cls

    return deco


def router_options(cls: type[Router]) -> list[str]:
    """The keyword options a router class accepts (beyond d_model, num_experts, top_k)."""
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p not in ("self", "d_model", "num_experts", "top_k")]


def build_router(name: str, d_model: int, num_experts: int, top_k: int, **options) -> Router:
    """Build the router family ``name`` (a key of :data:`ROUTERS`) with its own options."""
    if name not in ROUTERS:
        raise ValueError(f"router={name!r} is not registered; allowed: {sorted(ROUTERS)}")
    return ROUTERS[name](d_model, num_experts, top_k, **options)


class Router(nn.Module):
    """Base of every registered router: holds ``d_model``, ``num_experts``, ``top_k``,
    ``layer_index``, and gives every hook the layer, :func:`moelab.attach`, the diagnostics and
    conversion call a default, so a router overrides only what it has.

    A router's ``forward(x, experts, ctx)`` maps tokens ``x (T, d)`` to a :class:`moelab.Routing`
    whose chosen experts are sorted by decreasing score.
    """

    #: names of the method-specific losses this router may put in ``Routing.losses``
    loss_names: tuple[str, ...] = ()

    #: whether the chosen experts' weights are renormalised to sum to 1 over the K chosen; the
    #: top-(K+1) swap evaluation (:func:`moelab.metrics.swap_top1`) renormalises after dropping the
    #: top-1 iff so
    weights_sum_to_one: bool = True

    #: whether the router routes a variable number of experts per token (``Routing.mask``; K is then
    #: the most a token may take): diagnostics that replace "the K-th expert" refuse such a router
    variable_k: bool = False

    #: whether a token's routing depends on the later tokens of its batch (expert-choice): a causal
    #: language model built with such a router sees the future, and warns
    leaks_future_tokens: bool = False

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.d_model = _validate.positive_int("d_model", d_model)
        self.num_experts = _validate.positive_int("num_experts", num_experts)
        self.top_k = _validate.int_in_range("top_k", top_k, 1, num_experts)
        self.layer_index = 0

    def reset_parameters(self) -> None:
        """Initialise the router's parameters and state as at construction (e.g. after
        ``to_empty`` from the meta device).  A router without parameters has nothing to do."""

    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """The step hook: update state once per optimizer step (sharede-v3's selection bias), run
        by :meth:`moelab.RoutingContext.advance` (:func:`moelab.attach` registers it).  A router
        without such state has nothing to do."""

    @property
    def base_router(self) -> Router:
        """The router whose scores and rule this one routes with: itself, or the base of a router
        composed around another (competesmoe's)."""
        return self

    def rule_options(self) -> dict[str, Any]:
        """The options that say how this router turns scores into weights — normalisation,
        ``scale``, group limits, the selection bias (its tensor, or ``None``), expert dropout, a
        schedule of K — by their constructor names: what conversion to and from transformers
        compares and carries over (:mod:`moelab.hf`).  None for a router without such options."""
        return {}

    @staticmethod
    def step_of(ctx: RoutingContext | None) -> int | None:
        return None if ctx is None else ctx.step

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}"
