"""A moelab router in torchtitan's MoE: :class:`TitanRouter` takes the router slot of
``torchtitan.models.common.moe.MoE`` (torchtitan 0.3), so torchtitan keeps its experts, token
dispatch, expert parallelism, FSDP2 and compile path and moelab decides the routing.

torchtitan's MoE calls ``router(x (B, L, D), expert_bias (E,) | None)`` and expects
``(weights (B, L, K), indices (B, L, K), scores (B, L, E))``; it has no channel for auxiliary
losses and never gives the router its experts.  What cannot be right there is refused in one line:
a method with auxiliary losses (their coefficients must be 0: torchtitan would drop them), a
competition method (it runs the experts itself), a step schedule, and torchtitan's own
aux-loss-free bias (``load_balance_coeff``: ``sharede-v3`` carries its own selection bias).
docs/scaling.md ("torchtitan") has the recipe.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["TitanRouter"]


class TitanRouter(nn.Module):
    """The router of ``layer`` (a :class:`moelab.MoE`) behind torchtitan's router interface.

    Args:
        layer: the moelab layer whose router decides (its experts are not used; its router's
            parameters are this module's, ``router.*``).

    Raises:
        ValueError: the layer's method needs what torchtitan's MoE does not give.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        from ..layer import MoE

        if not isinstance(layer, MoE):
            raise ValueError(f"layer of type {type(layer).__name__} is not allowed; expected a moelab.MoE")
        if layer.coefs:
            raise ValueError(
                f"method={layer.method!r} with aux-loss coefficients {layer.coefs} is not allowed in torchtitan's "
                "MoE, which has no aux-loss channel (the losses would be dropped); build the layer with those "
                "coefficients at 0 or train with moelab's own layer"
            )
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
        scores = routing.probs if routing.probs is not None else routing.logits.softmax(-1)
        K = routing.indices.shape[-1]
        return (
            routing.weights.reshape(B, L, K),
            routing.indices.reshape(B, L, K),
            scores.reshape(B, L, self.num_experts),
        )
