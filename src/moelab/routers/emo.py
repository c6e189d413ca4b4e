"""EMO, document-pool routing: ``emo`` (Bhagia, Wang, Min, *EMO: Pretraining Mixture of Experts for
Emergent Modularity*, arXiv 2605.06663; code allenai/EMO and OLMo-core ``nn/moe/v2/emo_router.py``):
each document's tokens choose their top-K among a pool of experts, the experts of highest mean
router score over the document; the pool size is drawn per document in training."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import resolve_renormalize
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, RenormalizeOptions, Router, option_default, register


@dataclass(frozen=True)
class EMOConfig(InitStdOptions, RenormalizeOptions):
    """The options of :class:`EMORouter` (its docstring says what each does)."""

    renormalize: bool | None = option_default(RenormalizeOptions, "renormalize", False)
    min_pool: int | None = setting(
        None,
        help="the smallest document pool drawn in training; None: top_k (allenai/EMO: 8 with K = 8)",
        allowed=(Interval(int, 1), None),
    )
    max_pool: int | None = setting(
        None,
        help="the largest document pool drawn in training; None: num_experts (allenai/EMO: 128 of 128)",
        allowed=(Interval(int, 1), None),
    )
    eval_pool: int | None = setting(
        None,
        help="the document pool at inference; None: max(top_k, num_experts // 4) (the released EMO: 32 of 128)",
        allowed=(Interval(int, 1), None),
    )


def document_pools(scores: Tensor, docs: Tensor, pool: Tensor) -> Tensor:
    """``(T, N)`` bool: each token's document pool — the ``pool[d]`` experts of largest summed
    ``scores (T, N)`` over the tokens of its document ``d = docs[t]`` (``docs (T,)`` in ``[0, T)``,
    :func:`moelab.functional.document_index`; ``pool (T,)`` a size per document index).  The sum
    ranks the experts as the mean does (allenai/EMO and OLMo-core sum); ties go to the lower expert
    index (a stable sort)."""
    totals = scores.new_zeros(scores.shape).index_add_(0, docs, scores)  # (T docs at most, N)
    rank = totals.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return (rank < pool.unsqueeze(1)).index_select(0, docs)


@register("emo")
class EMORouter(Router):
    """``h = W x``, ``p = softmax(h)``; per document ``d``, the pool ``P_d`` = the ``n_d`` experts of
    largest ``Σ_{t∈d} p_t`` (the mean score's order); token ``t`` of ``d`` takes the K experts of
    largest ``h`` inside ``P_d``, weighted by the softmax over the pool, ``q = softmax(h|P_d)`` (the
    logits outside the pool at −∞): EMO's document-pool routing (arXiv 2605.06663), as allenai/EMO's
    router that trained the released models (``MoETwoLevelBatchLBReduceDPSharedExpRandPoolRouter``).

    The pool size ``n_d`` is drawn per document, uniformly from ``[min_pool, max_pool]``, in every
    training forward (from torch's global generator, as the authors' ``torch.randint``); evaluation
    uses ``eval_pool`` for every document.  ``Routing.probs`` is ``q`` (what the global-batch
    balance loss of the preset reads, as allenai/EMO's), ``Routing.logits`` the raw ``h``.

    A document is the tokens of one sequence sharing an id (``layer(x, doc_ids=ids)``,
    :func:`moelab.functional.document_index`); the layer hands the router a dense index in ``[0, T)``
    and refuses a batch without ids in one line.

    Options:
        min_pool, max_pool: the training pool sizes (default ``top_k`` and ``num_experts``, the
            released recipe's 8 and 128 with K = 8, N = 128), in ``[top_k, num_experts]``.
        eval_pool: the inference pool (default ``max(top_k, num_experts // 4)``: the released
            recipe's 32 of 128).
        renormalize: the K weights renormalised to sum to 1 (default ``False``, OLMoE's router).
        init_std: std of the N(0, σ²) init of ``W``; default ``d^-1/2``.
    """

    takes_doc_ids = True

    config_class = EMOConfig

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.min_pool = self._pool("min_pool", o.min_pool, top_k)
        self.max_pool = self._pool("max_pool", o.max_pool, num_experts)
        if self.min_pool > self.max_pool:
            raise ValueError(
                f"min_pool={self.min_pool} is not allowed with max_pool={self.max_pool}; expected min_pool <= max_pool"
            )
        self.eval_pool = self._pool("eval_pool", o.eval_pool, max(top_k, num_experts // 4))
        self.renormalize = resolve_renormalize(o.renormalize, top_k)
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def _pool(self, name: str, value: int | None, default: int) -> int:
        size = default if value is None else value
        if not self.top_k <= size <= self.num_experts:
            raise ValueError(
                f"{name}={size} is not allowed with top_k={self.top_k}, num_experts={self.num_experts}; expected "
                f"an integer in [{self.top_k}, {self.num_experts}] (a pool holds at least the K a token takes)"
            )
        return size

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)

    def pool_sizes(self, n: int, device: torch.device) -> Tensor:
        """``(n,)`` a pool size per document index: drawn uniformly from ``[min_pool, max_pool]`` in
        training, ``eval_pool`` otherwise; never fewer than the router's K (the top-(K+1) swap
        diagnostic routes with K + 1)."""
        if self.training:
            sizes = torch.randint(self.min_pool, self.max_pool + 1, (n,), device=device)
        else:
            sizes = torch.full((n,), self.eval_pool, device=device, dtype=torch.long)
        return sizes.clamp(min=self.top_k)

    def forward(
        self,
        x: Tensor,
        experts: Experts | None = None,
        ctx: RoutingContext | None = None,
        doc_ids: Tensor | None = None,
    ) -> Routing:
        if doc_ids is None:
            raise ValueError(
                "doc_ids=None is not allowed with EMO's document pools; expected layer(x, doc_ids=ids), ids of "
                "x.shape[:-1] giving each token's document (a TransformerLM passes each sequence as one)"
            )
        logits = F.linear(x, self.weight)  # (T, N)
        with torch.no_grad():
            scores = logits.detach().to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
            pools = document_pools(scores, doc_ids, self.pool_sizes(logits.shape[0], logits.device))
        pooled = logits.masked_fill(~pools, float("-inf"))
        probs = pooled.softmax(dim=-1)  # q: the softmax over the document's pool
        indices = pooled.detach().topk(self.top_k, dim=-1).indices
        weights = probs.gather(1, indices)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(indices=indices, weights=weights, probs=probs, logits=logits)

    @property
    def weights_sum_to_one(self) -> bool:
        return self.renormalize

    def rule_options(self) -> dict[str, Any]:
        return {"renormalize": self.renormalize, "min_pool": self.min_pool, "max_pool": self.max_pool,
                "eval_pool": self.eval_pool}  # fmt: skip
