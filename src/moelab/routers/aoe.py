"""Router-free routing: ``aoe`` (Autonomy-of-Experts, Lv et al. 2025): the experts rank themselves by
the norm of their own low-rank gate pre-activation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import topk_gate
from ..routing import Routing, RoutingContext
from .base import RenormalizeOptions, Router, SelectionBiasOptions, option_default, register, softmax_over_all


@dataclass(frozen=True)
class AoEConfig(RenormalizeOptions, SelectionBiasOptions):
    """The options of :class:`AoERouter` (its docstring says what each does)."""

    #: the authors' code: the weights are P at the chosen, not renormalised
    renormalize: bool | None = option_default(RenormalizeOptions, "renormalize", False)
    rank: int | None = setting(
        None,
        help="r, the rank of the experts' gate factors; None: max(1, d_model // 4)",
        allowed=(Interval(int, 1), None),
    )


@register("aoe")
class AoERouter(Router):
    """No router: each expert's gate projection is factorised, ``W_g^e = B_e A_e`` of rank ``r``, every
    expert computes its low-rank pre-activation ``a_e = A_e x`` on every token, and the experts are
    ranked by its L2 norm ``s_e = ‖a_e‖`` — Autonomy-of-Experts (Lv, Xie, Qian, Wu, Sun, Kang, Wang,
    Yan, *Autonomy-of-Experts Models*, 2025, arXiv 2501.13074).  The top-K experts finish their computation with
    the factorised ``W_g`` (the expert bank built with ``gate_rank=r``,
    :class:`moelab.ExpertBank`; the others stop after ``A_e x``).

    The weights follow the authors' public code (``trestad/Autonomy-of-Experts``, ``VanillaAoE``):
    ``P = softmax(s)`` over all N, the K experts of largest ``P``, weighted by their ``P_e``, not
    renormalised (megablocks' default); ``P`` is ``Routing.probs`` (their load-balancing loss reads
    it), the norms ``s`` are ``Routing.logits``.

    This router owns no parameter: the factors ``A``, ``B`` belong to the experts (the layer builds
    its bank with ``gate_rank = rank``), so the router and the experts cannot disagree — the
    point of the paper.

    Options:
        rank: ``r`` (``d_low`` of the paper).  The authors' code reads it from the ``D_LOW``
            environment variable and has no default; the default here, ``max(1, d_model // 4)``,
            is ours.
        renormalize: ``False`` (default, the authors' code): the weights are ``P`` at the chosen;
            ``True``: the softmax over the K chosen norms (``None``: ``True`` for K > 1 only).
        selection_bias: the aux-loss-free selection bias (DeepSeek-V3) on ``P``; default off.
        bias_update_rate: its step γ (1e-3).
    """

    config_class = AoEConfig

    def removal_problem(self, kept: int) -> str | None:  # ranks by the bank's own gates: nothing to slice
        return softmax_over_all(self.weights_sum_to_one)

    factorised_gates = "Autonomy-of-Experts"

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        self.rank = max(1, d_model // 4) if o.rank is None else o.rank
        self.renormalize = o.renormalize

    @property
    def expert_gate_rank(self) -> int:
        """The rank of the factorised gate projections the layer's expert bank must have."""
        return self.rank

    @property
    def weights_sum_to_one(self) -> bool:
        return bool(self.renormalize) if self.renormalize is not None else self.top_k > 1

    def rule_options(self) -> dict[str, Any]:
        return {"rank": self.rank, "renormalize": self.renormalize, "selection_bias": self.selection_bias}

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        if getattr(experts, "gate_rank", None) != self.rank:
            raise ValueError(
                f"experts of type {type(experts).__name__} are not allowed with the aoe router; expected an "
                f"ExpertBank with gate_rank={self.rank} (Autonomy-of-Experts ranks the experts by their own "
                "low-rank gate pre-activations)"
            )
        norms = experts.gate_low_rank(x).norm(dim=-1)  # (T, N): ‖A_e x‖
        weights, indices, probs = topk_gate(norms, self.top_k, self.renormalize, self.selection_bias)
        self.count_load(indices)
        return Routing(indices=indices, weights=weights, probs=probs, logits=norms)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}"
