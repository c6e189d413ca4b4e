"""DeepSeek-V4 routing: ``deepseek-v4`` — ``sqrt(softplus(h))`` scores with the aux-loss-free
expert bias, and the hash-routed first layers (a fixed token id → experts table)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, Options, setting
from ..experts.protocol import Experts
from ..functional import normalized_weights, resolve_renormalize
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, Router, ScaleOptions, SelectionBiasOptions, register

#: the ε of the weights' normalisation, as transformers' DeepseekV4TopKRouter and Megatron-LM
NORMALIZE_EPS = 1e-20


@dataclass(frozen=True)
class SqrtSoftplusConfig(InitStdOptions, ScaleOptions, SelectionBiasOptions):
    """The options of :class:`SqrtSoftplusRouter` (its docstring says what each does)."""

    normalize: bool | None = setting(
        None,
        help="weights s / Σ s over the chosen (DeepSeek-V4); None: when K > 1 (Megatron-LM's rule)",
        allowed=Options((True, False, None)),
    )
    hash_layers: int = setting(
        0,
        help="the first hash_layers MoE layers of a model (by layer_index) route by a fixed token id → "
        "experts table (DeepSeek-V4's hash layers; 3 in V4-Flash); they need the token ids",
        allowed=Interval(int, 0),
    )
    vocab_size: int | None = setting(
        None,
        help="the token ids' range of the hash table (needed with hash_layers; the LM passes its own)",
        allowed=(Interval(int, 1), None),
    )
    hash_seed: int = setting(0, help="the seed of the random hash table", allowed=Interval(int, 0))

    def check(self) -> None:
        if self.hash_layers and self.vocab_size is None:
            raise ValueError(
                f"hash_layers={self.hash_layers} is not allowed without vocab_size; expected vocab_size=<the "
                "number of token ids> with it (the hash table has a row per token id)"
            )


def hash_table(vocab_size: int, num_experts: int, top_k: int, seed: int) -> Tensor:
    """``(V, K)`` int64: for each token id ``K`` distinct experts drawn uniformly at random from a
    generator seeded with ``seed`` (a random hash, as Roller et al. 2021's hash layers; DeepSeek-V4
    ships its table ``tid2eid`` in the checkpoint and does not say how it was drawn)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(vocab_size, num_experts, generator=gen).argsort(dim=1)[:, :top_k].contiguous()


@register("sqrtsoftplus")
class SqrtSoftplusRouter(Router):
    """``s = sqrt(softplus(W x))``; the K experts with the largest ``s + b`` are chosen, weighted by
    ``s / (Σ_chosen s + 1e-20)`` (DeepSeek-V4: transformers' ``DeepseekV4TopKRouter``; Megatron-LM's
    ``moe_router_score_function="sqrtsoftplus"`` with ``moe_router_enable_expert_bias``).

    The first ``hash_layers`` MoE layers of a model (``layer_index < hash_layers``, numbered by
    :func:`moelab.attach`) are hash-routed (transformers' ``DeepseekV4HashRouter``; the
    Megatron-Bridge DeepSeek-V4 bridge's ``moe_n_hash_layers``): the experts of a token are the row
    of a fixed table ``tid2eid[token_id]`` (:func:`hash_table`; a buffer, saved), the weights the
    same normalised ``s`` at those experts — the gate learns the weights, never the choice.  Such a
    layer needs the token ids: ``layer(x, token_ids=ids)`` (:class:`moelab.models.lm.TransformerLM`
    passes its input ids); without them it refuses in one line.

    ``Routing.probs`` is ``s / Σ_N s`` (Megatron-LM's scores for the aux losses of
    ``sqrtsoftplus``).

    Options:
        selection_bias: the aux-loss-free bias ``b`` (DeepSeek-V3's update,
            :meth:`moelab.routers.Router.init_selection_bias`); on in the preset; unused by the hash
            layers (their choice is the table's).
        normalize: ``s / Σ s`` over the chosen; ``None`` (preset): for K > 1 (Megatron-LM; at K = 1
            the score itself, which transformers would normalise to the constant 1).
        scale: ``routed_scaling_factor`` (1.5 in DeepSeek-V4-Flash; 1 in the preset).
        hash_layers, vocab_size, hash_seed: the hash layers, the table's rows, its seed.
        init_std: std of the N(0, σ²) init of ``W``; default ``d^-1/2``.
    """

    gate = "sqrtsoftplus"
    takes_token_ids = True

    config_class = SqrtSoftplusConfig
    expert_tensors = ("weight",)

    def removal_problem(self, kept: int) -> str | None:
        if self.hash_layers:  # the table is drawn for N experts from its seed
            return f"its first hash_layers={self.hash_layers} layers route by a token id → expert table of all N experts"
        return None

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.normalize = resolve_renormalize(o.normalize, top_k)
        self.scale = o.scale
        self.hash_layers = o.hash_layers
        self.layer_index = self.layer_index  # whether layer 0 is hashed, now that hash_layers is known
        self.vocab_size, self.hash_seed = o.vocab_size, o.hash_seed
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        table = None if not self.hash_layers else torch.empty(self.vocab_size, top_k, dtype=torch.long)
        #: the token id → experts table of the hash layers ``(V, K)``, or ``None`` (no hash layer)
        self.register_buffer("tid2eid", table)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``, the selection bias zero, the hash table drawn from its seed."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            if self.tid2eid is not None:
                self.tid2eid.copy_(hash_table(self.vocab_size, self.num_experts, self.top_k, self.hash_seed))
        self.reset_selection_bias()

    @property
    def layer_index(self) -> int:
        return self._layer_index

    @layer_index.setter
    def layer_index(self, value: int) -> None:
        """Set by :func:`moelab.attach`; whether the layer is hash-routed follows it here, outside any
        forward, so a compiled forward reads one bool (shared by the layers of a kind), not the index
        (a guard per layer would recompile every layer)."""
        self._layer_index = value
        #: whether this layer is one of the model's first ``hash_layers`` (routes by token id)
        self.hashed = value < getattr(self, "hash_layers", 0)

    def forward(
        self,
        x: Tensor,
        experts: Experts | None = None,
        ctx: RoutingContext | None = None,
        token_ids: Tensor | None = None,
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        scores = F.softplus(logits).sqrt()
        if self.hashed:
            if token_ids is None:
                raise ValueError(
                    f"token_ids=None is not allowed for MoE layer {self.layer_index}, hash-routed (hash_layers="
                    f"{self.hash_layers}, DeepSeek-V4); expected layer(x, token_ids=ids) with the input's token ids"
                )
            indices = self.tid2eid[token_ids]  # (T, K)
        else:
            indices = self.biased(scores.detach()).topk(self.top_k, dim=-1).indices
            self.count_load(indices)
        probs = normalized_weights(scores, NORMALIZE_EPS)
        return Routing(indices=indices, weights=self._weigh(scores, indices), probs=probs, logits=logits)

    def _weigh(self, scores: Tensor, indices: Tensor) -> Tensor:
        """``s`` at ``indices``, normalised over them (``s / (Σ s + 1e-20)``) and scaled."""
        weights = scores.gather(1, indices)
        if self.normalize:
            weights = normalized_weights(weights, NORMALIZE_EPS)
        return weights * self.scale if self.scale != 1.0 else weights

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor:
        """``sqrt(softplus(h))`` of the live logits at ``indices``, normalised and scaled as its own
        choice (the bias chooses, it never weighs).  A hash layer's choice is its table: routing
        replay keeps it (:mod:`moelab.routes` refuses a trace that differs from it)."""
        return self._weigh(F.softplus(routing.logits).sqrt(), indices)

    @property
    def learns_choice(self) -> bool:
        """A hash layer's choice is its table: no parameter learns it."""
        return not self.hashed

    @property
    def weights_sum_to_one(self) -> bool:
        return self.normalize

    def rule_options(self) -> dict[str, Any]:
        return {"normalize": self.normalize, "scale": self.scale, "selection_bias": self.selection_bias,
                "hash_layers": self.hash_layers}  # fmt: skip
