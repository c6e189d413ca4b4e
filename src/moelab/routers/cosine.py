"""Cosine routers: ``xmoe`` (X-MoE) and ``pcosine`` (the perturbed cosine router (2024))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import cosine_logits, resolve_renormalize, topk_gate, topk_gate_weights_at
from ..routing import Routing, RoutingContext
from .base import RenormalizeOptions, Router, SelectionBiasOptions, register, softmax_over_all

_POSITIVE = Interval(float, 0, closed="neither")


@dataclass(frozen=True)
class CosineConfig(RenormalizeOptions, SelectionBiasOptions):
    """The options of :class:`CosineRouter` (its docstring says what each does)."""

    proj_dim: int | None = setting(
        None,
        help="d_e, the dimension of the routing space; None: max(2, N // 2)",
        allowed=(Interval(int, 1), None),
    )
    temperature: float = setting(0.3, help="t, its initial value", allowed=_POSITIVE)
    learn_temperature: bool = setting(False, help="train t (kept >= 0.01)")
    perturbation: float = setting(0.0, help="τ added to both norms (0: X-MoE)", allowed=Interval(float, 0))
    init_gain: float = setting(
        0.32, help="gain of the orthogonal init of the expert embeddings", allowed=_POSITIVE
    )


@register("cosine")
class CosineRouter(Router):
    """``logits_i = (P x)ᵀ e_i / ((‖P x‖ + τ)(‖e_i‖ + τ)) / t``, then top-K softmax.

    X-MoE (Chi et al. 2022; the ``xmoe`` baseline of CompeteSMoE (2024) and CompeteSMoE (2025)) with
    ``perturbation=0``; the perturbed cosine router (2024) eq. (7) (``pcosine``, CompeteSMoE (2025) baseline)
    with ``perturbation=τ > 0`` (τ₁ = τ₂ = τ, as perturbed cosine router (2024) App. E.1 does).
    With ``τ = 0`` the two are the same function (:func:`moelab.functional.cosine_logits`).

    Options:
        proj_dim: ``d_e``, the dimension of the routing space; default ``max(2, N // 2)``
            (perturbed cosine router (2024) App. E.2 and LibMoE: half the number of experts).
        temperature: ``t``, initial value 0.3 (LibMoE).
        learn_temperature: train ``t`` (kept ≥ 0.01): the ``xmoe`` preset does, as X-MoE and the
            CompeteSMoE (2024) baseline ("a gating network with learnable temperatures", §6);
            ``learn_temperature=False`` keeps it fixed (LibMoE).
        perturbation: τ added to both norms; 0 for ``xmoe``, 0.1 for ``pcosine`` (LibMoE's value;
            perturbed cosine router (2024) does not state the LM value, other code uses 1e-4 … 1e-3).
        init_gain: gain of the orthogonal init of the expert embeddings ``e_i`` (0.32, LibMoE).
        selection_bias: carry the aux-loss-free selection bias of DeepSeek-V3 (added to
            ``softmax(h)`` for the choice only, moved once per optimizer step towards the mean
            load; :meth:`moelab.routers.Router.init_selection_bias`); default off.
        bias_update_rate: its step γ (1e-3, DeepSeek-V3).
        renormalize: the chosen weights renormalised (``softmax(TopK_-inf(h))``, ``True``) or the
            softmax over all N at the chosen (``False``, Switch Transformer); default ``None``:
            renormalised when K > 1 (at K = 1 a renormalised weight is the constant 1, which no
            task loss can train; :func:`moelab.functional.resolve_renormalize`).
    """

    config_class = CosineConfig
    expert_tensors = ("embeddings",)

    def removal_problem(self, kept: int) -> str | None:
        return softmax_over_all(self.renormalize)

    def kept_options(self) -> dict[str, Any]:
        return {"proj_dim": self.proj.out_features}  # its default, N // 2, follows N

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        self.renormalize = resolve_renormalize(o.renormalize, top_k)
        proj_dim = max(2, num_experts // 2) if o.proj_dim is None else o.proj_dim
        self.perturbation = o.perturbation
        self.init_gain = o.init_gain
        self.init_temperature = o.temperature
        self.proj = nn.Linear(d_model, proj_dim, bias=False)
        self.embeddings = nn.Parameter(torch.empty(num_experts, proj_dim))
        # shape (1,), not a 0-dim scalar: FSDP2's fully_shard refuses scalar parameters
        t = torch.empty(1)
        if o.learn_temperature:
            self.temperature = nn.Parameter(t)
        else:
            self.register_buffer("temperature", t)
        self.reset_parameters(proj=False)

    def reset_parameters(self, proj: bool = True) -> None:
        """``P`` as ``nn.Linear`` initialises it, ``e_i`` orthogonal (gain ``init_gain``), ``t`` its
        initial value."""
        if proj:
            self.proj.reset_parameters()
        nn.init.orthogonal_(self.embeddings, gain=self.init_gain)
        with torch.no_grad():
            self.temperature.fill_(self.init_temperature)
        self.reset_selection_bias()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # checkpoints written before the temperature became shape (1,) hold a 0-dim scalar
        key = prefix + "temperature"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def logits(self, x: Tensor) -> Tensor:
        tau = self.perturbation
        cos = cosine_logits(self.proj(x), self.embeddings, tau_x=tau, tau_e=tau)
        return cos / self.temperature.clamp_min(0.01)

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = self.logits(x)
        weights, indices, probs = topk_gate(logits, self.top_k, self.renormalize, self.selection_bias)
        self.count_load(indices)
        return Routing(indices=indices, weights=weights, probs=probs, logits=logits)

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor:
        """:func:`moelab.functional.topk_gate_weights_at` of the live scores."""
        return topk_gate_weights_at(routing.logits, routing.probs, indices, self.renormalize)

    @property
    def weights_sum_to_one(self) -> bool:
        return self.renormalize
