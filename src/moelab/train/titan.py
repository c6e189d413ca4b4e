"""A moelab router in torchtitan's MoE: :class:`TitanRouter` takes the router slot of
``torchtitan.models.common.moe.MoE`` (torchtitan 0.3), so torchtitan keeps its experts, token
dispatch, expert parallelism, FSDP2 and compile path and moelab decides the routing.

torchtitan's MoE calls ``router(x (B, L, D), expert_bias (E,) | None)`` and expects
``(weights (B, L, K), indices (B, L, K), scores (B, L, E))``; it has no channel for auxiliary
losses and never gives the router its experts.  What cannot be right there is refused in one line:
a method with auxiliary losses (their coefficients must be 0: torchtitan would drop them), an
expert capacity (torchtitan keeps every token), a competition method (it runs the experts itself), a step schedule, and torchtitan's own
aux-loss-free bias (``load_balance_coeff``: ``sharede-v3`` carries its own selection bias).
:func:`titan_moe` builds torchtitan's MoE with a moelab layer's weights (experts, shared experts, and
its own softmax router or a :class:`TitanRouter`), for comparisons.  docs/scaling.md ("torchtitan") has the recipe.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["TitanRouter", "refuse_what_titan_drops", "titan_moe"]


class TitanRouter(nn.Module):
    """The router of ``layer`` (a :class:`moelab.MoE`) behind torchtitan's router interface.

    Args:
        layer: the moelab layer whose router decides (its experts are not used; its router's
            parameters are this module's, ``router.*``).

    Raises:
        ValueError: the layer's method needs what torchtitan's MoE does not give, or the layer
            has aux losses or a capacity torchtitan's MoE would drop.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        from ..layer import MoE

        if not isinstance(layer, MoE):
            raise ValueError(f"layer of type {type(layer).__name__} is not allowed; expected a moelab.MoE")
        refuse_what_titan_drops(layer)
        import inspect

        from ..methods import get_method

        experts = inspect.signature(layer.router.forward).parameters.get("experts")
        needs_experts = experts is not None and experts.default is inspect.Parameter.empty
        if needs_experts or get_method(layer.method).schedule is not None:
            raise ValueError(
                f"method={layer.method!r} is not allowed in torchtitan's MoE: its router runs on a step schedule "
                "or runs the experts itself (competition), which torchtitan's router slot cannot give it"
            )
        self.router = layer.router
        self.ctx = layer.ctx  # a step-dependent router (StableMoE, SMoE-Dropout) reads its step
        self.num_experts = layer.num_experts
        self.top_k = layer.top_k

    def forward(self, x: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if expert_bias is not None:
            raise ValueError(
                "torchtitan's expert_bias_E is not allowed with a moelab router (it would be ignored); build "
                "torchtitan's MoE with load_balance_coeff=None (sharede-v3 carries its own selection bias)"
            )
        B, L, D = x.shape
        routing = self.router(x.reshape(B * L, D), None, self.ctx)
        if routing.outputs is not None:
            raise ValueError(
                "a router that runs the experts (competition) is not allowed in torchtitan's MoE; use moelab's layer"
            )
        if routing.inputs is not None:
            raise ValueError(
                "a router that changes the experts' input (latent-prototype's aligner) is not allowed in "
                "torchtitan's MoE; use moelab's layer, or aligner=False"
            )
        scores = routing.probs if routing.probs is not None else routing.logits.softmax(-1)
        K = routing.indices.shape[-1]
        return (
            routing.weights.reshape(B, L, K),
            routing.indices.reshape(B, L, K),
            scores.reshape(B, L, self.num_experts),
        )


def refuse_what_titan_drops(layer: nn.Module) -> None:
    """Refuse, in one line, a layer whose aux losses or expert capacity torchtitan's MoE would
    drop without a word: it has no aux-loss channel and keeps every token."""
    if layer.coefs:
        raise ValueError(
            f"method={layer.method!r} with aux-loss coefficients {layer.coefs} is not allowed in torchtitan's "
            "MoE, which has no aux-loss channel (the losses would be dropped); build the layer with those "
            "coefficients at 0 or train with moelab's own layer"
        )
    if layer.capacity_factor is not None:
        raise ValueError(
            f"capacity_factor={layer.capacity_factor} is not allowed; expected None (torchtitan's MoE keeps every "
            "token, the capacity would not be applied)"
        )


def titan_moe(layer: nn.Module, router: nn.Module | None = None) -> nn.Module:
    """torchtitan 0.3's ``MoE`` computing what ``layer`` (a :class:`moelab.MoE` of SwiGLU experts
    without biases, aux-loss coefficients or capacity) computes: its grouped experts and shared experts with the layer's weights, no
    aux-loss-free bias, and in its router slot ``router`` (e.g. :class:`TitanRouter` of the layer)
    or, by default, torchtitan's token-choice router (softmax over the experts, top-K, renormalised
    as the layer's router is, times its scale) with the layer's gate weight.  torchtitan's experts
    compute in bfloat16, so the outputs agree to that rounding.

    Raises:
        ValueError: the layer is not a moelab.MoE of SwiGLU experts without biases, without a
            capacity and without aux losses (torchtitan's MoE would drop them); or, without
            ``router``, its routing is not a softmax top-K of one linear gate (another router, a K
            that grows or differs in evaluation, a selection bias).
        ImportError: torchtitan ≥ 0.3 is not installed.
    """
    from torchtitan.models.common import moe as titan
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    from ..layer import MoE
    from ..routers.topk import TopKRouter

    if not isinstance(layer, MoE):
        raise ValueError(f"layer of type {type(layer).__name__} is not allowed; expected a moelab.MoE")
    bank = layer.experts
    bias = bank.b_in is not None or (layer.shared is not None and layer.shared.fc_in.bias is not None)
    if bank.activation != "swiglu" or bias:
        raise ValueError(
            f"layer with activation={bank.activation!r}, bias={bias} is not allowed; expected SwiGLU experts "
            "without biases (torchtitan's GroupedExperts and FeedForward)"
        )
    refuse_what_titan_drops(layer)
    gate = layer.router
    if router is None and not (
        isinstance(gate, TopKRouter)
        and gate.k_max in (None, gate.top_k)
        and gate.eval_k in (None, gate.top_k)
        and gate.selection_bias is None
    ):
        raise ValueError(
            f"method={layer.method!r} is not allowed without router=: its routing is not torchtitan's softmax "
            "top-K of one linear gate; pass router=TitanRouter(layer)"
        )
    h, d, n, k = bank.d_hidden, layer.d_model, layer.num_experts, layer.top_k
    sh = layer.num_shared * h
    shared = None
    if layer.shared is not None:
        shared = FeedForward.Config(
            w1=Linear.Config(in_features=d, out_features=sh),
            w2=Linear.Config(in_features=sh, out_features=d),
            w3=Linear.Config(in_features=d, out_features=sh),
        )
    config = titan.MoE.Config(
        num_experts=n,
        routed_experts=titan.RoutedExperts.Config(
            inner_experts=titan.GroupedExperts.Config(dim=d, hidden_dim=h, num_experts=n),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=n, top_k=k),
        ),
        router=titan.TokenChoiceTopKRouter.Config(
            gate=Linear.Config(in_features=d, out_features=n),
            num_experts=n,
            top_k=k,
            score_func="softmax",
            route_norm=router is not None or gate.renormalize,
            route_scale=1.0 if router is not None else gate.scale,
        ),
        load_balance_coeff=None,
        shared_experts=shared,
    )
    with torch.device(bank.w_in.device):
        moe = config.build()
    experts = moe.routed_experts.inner_experts
    with torch.no_grad():  # moelab's swiglu w_in is [gate | up]; torchtitan's w1 gate, w3 up
        if router is None:
            moe.router.gate.weight.copy_(gate.weight)
        experts.w1_EFD.copy_(bank.w_in[:, :h])
        experts.w3_EFD.copy_(bank.w_in[:, h:])
        experts.w2_EDF.copy_(bank.w_out)
        if layer.shared is not None:
            moe.shared_experts.w1.weight.copy_(layer.shared.fc_in.weight[:sh])
            moe.shared_experts.w3.weight.copy_(layer.shared.fc_in.weight[sh:])
            moe.shared_experts.w2.weight.copy_(layer.shared.fc_out.weight)
    if router is not None:
        moe.router = router
    return moe
