""":class:`MoEConfig`: every option of a :class:`moelab.MoE` layer, declared once as a typed field
with its constraint (:mod:`moelab.config`, the vocabulary the commands use too), and the rules that
tie options together beside the fields (:meth:`MoEConfig.check`).

``moelab.MoE(d_model, num_experts, top_k, method=..., **options)`` maps into it
(:meth:`MoEConfig.from_arguments`): a method is a preset (:mod:`moelab.methods`), a partial config
that the options override.  An option is a layer field (``num_shared``, ``capacity_factor``, ...),
a loss coefficient ``<loss>_coef``, or an option of the method's router; anything else is refused
with the allowed list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from . import _validate
from .balance import BALANCE_SCOPES
from .config import Interval, Options, setting, validate
from .experts.capacity import TOKEN_DROP_POLICIES
from .experts.rounding import TOKEN_ROUNDINGS
from .functional import ACTIVATIONS
from .losses import LOAD_LOSSES, LOSS_NAMES
from .methods import get_method, method_router_options
from .routers import ROUTERS

__all__ = ["LAYER_LOSSES", "MoEConfig"]

#: the layer's own losses (of the router rows and the experts, not of a routing), each with ``<name>_coef``
LAYER_LOSSES = ("erc",)
#: the router families whose weights are their softmax probabilities on the chosen experts (up to a
#: per-token scale): those DenseMixer's dense router gradient is defined for
DENSEMIXER_ROUTERS = ("topk", "cosine", "hyper")
#: the routers that run the experts themselves (CompeteSMoE's competition, Default MoE in training): a padded layout has
#: nothing to pad there
ROUTERS_RUNNING_EXPERTS = ("competition", "competesmoe", "default-moe")

_POSITIVE = Interval(int, 1)
_LAYER = {"layer": True}  # the fields given as ``MoE(**options)`` (the others are its arguments)
#: the fields derived from the preset and the options rather than given as ``MoE`` arguments
_DERIVED = ("coefs", "router_options", "options")


def _option(default: Any, *, help: str, allowed: Any = ()) -> Any:
    field = setting(default, help=help, allowed=allowed)
    return dataclasses.field(default=default, metadata={**field.metadata, **_LAYER})


@dataclass(frozen=True)
class MoEConfig:
    """The options of one MoE layer (docs/methods.md lists what each method's preset sets)."""

    d_model: int = setting(help="token width d", allowed=_POSITIVE)
    num_experts: int = setting(help="routed experts N", allowed=_POSITIVE)
    top_k: int = setting(help="experts per token K, in [1, N] (checked with N)")
    d_hidden: int = setting(help="hidden width of each expert", allowed=_POSITIVE)
    method: str = setting("smoe", help="a name of moelab.methods()")
    activation: str = setting("relu", help="expert activation", allowed=Options(tuple(sorted(ACTIVATIONS))))
    bias: bool = setting(False, help="expert biases")
    impl: str = setting("auto", help="expert kernel: 'auto' or a name of moelab.experts.KERNELS")
    check_finite: bool = setting(True, help="raise when router logits are NaN or inf")
    num_shared: int = _option(0, help="shared experts (weight 1)", allowed=Interval(int, 0))
    balance_scope: str = _option(
        "micro", help="where the load-based losses measure the load", allowed=Options(BALANCE_SCOPES)
    )
    densemixer: bool = _option(False, help="DenseMixer's dense router gradient in training")
    router_dtype: str | None = _option(
        None, help="the dtype the router computes in", allowed=(Options(("float32",)), None)
    )
    capacity_factor: float | None = _option(
        None,
        help="expert capacity C = ceil(factor·T·K/N)",
        allowed=(Interval(float, 0, closed="neither"), None),
    )
    min_capacity: int = _option(
        0, help="the fewest slots an expert takes (DeepSpeed's min_capacity)", allowed=Interval(int, 0)
    )
    token_drop_policy: str = _option(
        "probs", help="which slots an expert over capacity keeps", allowed=Options(TOKEN_DROP_POLICIES)
    )
    pad_to_capacity: bool = _option(False, help="every expert runs on exactly C rows")
    token_rounding: str | None = _option(
        None,
        help="in training, round each expert's token count to a multiple of rounding_tile (SonicMoE's token "
        "rounding): 'up', 'down' or 'nearest'",
        allowed=(Options(TOKEN_ROUNDINGS), None),
    )
    rounding_tile: int = _option(
        128, help="the multiple token_rounding rounds to (the GEMM tile's rows)", allowed=Interval(int, 1)
    )
    erc_alpha: float = _option(
        1.0, help="the ERC loss's margin", allowed=Interval(float, 0, closed="neither")
    )
    #: the aux-loss coefficients by loss name (``<loss>_coef``), those > 0 only
    coefs: dict[str, float] = setting(default_factory=dict, help="aux-loss coefficients by loss name")
    #: the options given to the method's router (over its preset's)
    router_options: dict[str, Any] = setting(default_factory=dict, help="options of the method's router")
    #: the options as given to ``MoE(**options)``, over the preset (what :meth:`arguments` writes back)
    options: dict[str, Any] = setting(default_factory=dict, help="the options as given")

    # ------------------------------------------------------------------ from MoE(...)'s arguments
    @classmethod
    def from_arguments(cls, arguments: dict[str, Any], options: dict[str, Any]) -> MoEConfig:
        """The config of ``moelab.MoE(**arguments, **options)``: ``arguments`` are its named
        parameters (``d_model``, ``num_experts``, ``top_k``, ``d_hidden`` (``None``: ``d_model``),
        ``method``, ``activation``, ``bias``, ``impl``, ``check_finite``), the method's preset
        overridden by ``options``."""
        d_model, method, d_hidden = arguments["d_model"], arguments["method"], arguments["d_hidden"]
        preset = get_method(method)
        router = ROUTERS[preset.router]
        layer_fields = [f.name for f in dataclasses.fields(cls) if f.metadata.get("layer")]
        router_names = method_router_options(method)
        loss_names = (*LOSS_NAMES, *router.loss_names, *LAYER_LOSSES)
        layer = {**preset.layer_options, "num_shared": preset.num_shared}
        coefs = dict(preset.coefs)
        router_options = {}
        for key, value in options.items():
            if key in router_names:  # a router with an option of a layer's name (capacity_factor) takes it
                router_options[key] = value
            elif key in layer_fields:
                layer[key] = value
            elif key.endswith("_coef") and key.removesuffix("_coef") in loss_names:
                coefs[key.removesuffix("_coef")] = _validate.non_negative(key, value)
            else:
                allowed = sorted([*router_names, *(f"{n}_coef" for n in loss_names), *layer_fields])
                raise ValueError(f"option {key!r} is not accepted by method={method!r}; allowed: {allowed}")
        config = cls(
            **{**arguments, "d_hidden": d_model if d_hidden is None else d_hidden},
            coefs={k: float(v) for k, v in coefs.items() if v > 0},
            router_options=router_options,
            options=dict(options),
            **layer,
        )
        return validate(config, names="arguments")

    def arguments(self) -> dict[str, Any]:
        """The ``moelab.MoE`` arguments that build this config again: what :func:`moelab.save`
        records of a layer (its named arguments and the options as given)."""
        named = [f.name for f in dataclasses.fields(self) if not f.metadata.get("layer")]
        out = {name: getattr(self, name) for name in named if name not in _DERIVED}
        return {**out, "options": dict(self.options)}

    @property
    def router(self) -> str:
        """The router family of the method."""
        return get_method(self.method).router

    @property
    def load_coefs(self) -> dict[str, float]:
        """The coefficients of the load-based losses (those ``balance_scope`` applies to)."""
        return {n: c for n, c in self.coefs.items() if n in LOAD_LOSSES}

    # ------------------------------------------------------------------ the rules between options
    def check(self) -> None:
        """The rules that tie options together; each refusal in one line."""
        method = self.method
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k!r} is not allowed; expected an integer in [1, {self.num_experts}]"
            )
        variable_k = ROUTERS[self.router].variable_k
        if self.balance_scope != "micro" and variable_k:
            raise ValueError(
                f"balance_scope={self.balance_scope!r} is not allowed with method={method!r}: it routes a variable "
                "number of experts per token, which only the 'micro' scope counts; expected 'micro'"
            )
        if self.densemixer and self.router not in DENSEMIXER_ROUTERS:
            raise ValueError(
                f"densemixer=True is not allowed with method={method!r}; expected a method whose weights are "
                f"its softmax probabilities (routers {list(DENSEMIXER_ROUTERS)}: smoe, xmoe, pcosine, ...)"
            )
        if self.router_dtype is not None and self.router == "competition":
            raise ValueError(
                f"router_dtype={self.router_dtype!r} is not allowed with method={method!r}, which has no router "
                "(the competition routes by the experts' outputs)"
            )
        capacity = self.capacity_factor
        for name in ("token_drop_policy", "min_capacity"):
            if name in self.options and capacity is None:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not allowed without capacity_factor; "
                    "expected capacity_factor=<float> with it"
                )
        if capacity is not None and variable_k:
            raise ValueError(
                f"capacity_factor={capacity!r} is not allowed with method={method!r}: it routes a variable number "
                "of experts per token; expected a method with a fixed top-K"
            )
        rounding = self.token_rounding
        if "rounding_tile" in self.options and rounding is None:
            raise ValueError(
                f"rounding_tile={self.rounding_tile!r} is not allowed without token_rounding; expected "
                "token_rounding='up', 'down' or 'nearest' with it"
            )
        if rounding is not None:
            other = (
                ("a variable number of experts per token", variable_k),
                ("experts it runs itself (competition)", self.router in ROUTERS_RUNNING_EXPERTS),
                (f"capacity_factor={capacity!r}", capacity is not None),
                ("densemixer=True", self.densemixer),
                (
                    f"balance_scope={self.balance_scope!r}, which counts K slots a token",
                    self.balance_scope != "micro",
                ),
            )
            for what, clash in other:
                if clash:
                    raise ValueError(
                        f"token_rounding={rounding!r} is not allowed with method={method!r} and {what}; expected a "
                        "fixed top-K router, no capacity_factor, densemixer=False and balance_scope='micro'"
                    )
        if self.pad_to_capacity:
            if capacity is None:
                raise ValueError(
                    "pad_to_capacity=True is not allowed without capacity_factor; expected "
                    "capacity_factor=<float> with it (each expert is padded to its capacity)"
                )
            if self.router in ROUTERS_RUNNING_EXPERTS:
                raise ValueError(
                    f"pad_to_capacity=True is not allowed with method={method!r}: its router runs the experts "
                    "itself (competition); expected a method whose experts run after the routing"
                )
            if self.densemixer:
                raise ValueError(
                    "pad_to_capacity=True is not allowed with densemixer=True: DenseMixer runs every expert on "
                    "every token in training; expected densemixer=False"
                )

    def check_input(self, x: Any, token_mask: Any, dtype: Any) -> None:
        """A forward's input ``x (..., d_model)`` and ``token_mask`` (``x.shape[:-1]``, bool, or
        ``None``), for a layer whose parameters are in ``dtype`` (``None``: no parameters): each
        refusal in one line."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(
                f"input of type {type(x).__name__} is not allowed; expected a torch.Tensor of shape "
                f"(..., d_model={self.d_model})"
            )
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"input of shape {tuple(x.shape)} is not allowed; expected the last dimension to be "
                f"d_model={self.d_model}"
            )
        if not x.is_floating_point():
            raise ValueError(f"input of dtype {x.dtype} is not allowed; expected a floating-point tensor")
        if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(
                f"input of dtype {x.dtype} is not allowed; expected the layer's dtype {dtype} "
                f"(cast one: layer.to({x.dtype}) or x.to({dtype}), or run under torch.autocast)"
            )
        if self.balance_scope == "sequence" and x.dim() < 3:
            raise ValueError(
                f"input of shape {tuple(x.shape)} is not allowed with balance_scope='sequence'; expected the "
                "sequence structure (..., S, d_model)"
            )
        if token_mask is None:
            return
        if self.balance_scope == "sequence":
            raise ValueError(
                "token_mask is not allowed with balance_scope='sequence' (the masked tokens would break "
                "the sequences); expected balance_scope='micro' or 'global' with a mask"
            )
        if not isinstance(token_mask, torch.Tensor) or token_mask.shape != x.shape[:-1]:
            got = (
                tuple(token_mask.shape) if isinstance(token_mask, torch.Tensor) else type(token_mask).__name__
            )
            raise ValueError(
                f"token_mask of shape {got} is not allowed; expected the input's shape without its last "
                f"dimension, {tuple(x.shape[:-1])}"
            )
        if token_mask.dtype != torch.bool:
            raise ValueError(f"token_mask of dtype {token_mask.dtype} is not allowed; expected torch.bool")
