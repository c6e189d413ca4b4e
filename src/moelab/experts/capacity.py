"""Expert capacity (GShard's / Switch's; Megatron-Core's ``--moe-expert-capacity-factor``): each
expert takes at most ``C = min(max(⌈factor · T · K / N⌉, min_capacity), T)`` of the token slots routed to it, the
others are dropped (their expert does not run, they add 0), and optionally every expert runs on
exactly ``C`` rows (the padded layout).  :func:`limit` marks the kept slots on a
:class:`moelab.Routing`; the bank reads them (:meth:`moelab.experts.SparseExperts.forward`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from ..routing import Routing

__all__ = ["TOKEN_DROP_POLICIES", "capacity_keep", "expert_capacity", "limit"]

#: which slots an expert over its capacity keeps: the highest routing weights, or the earliest tokens
TOKEN_DROP_POLICIES = ("probs", "position")


def expert_capacity(factor: float, tokens: int, top_k: int, num_experts: int, minimum: int = 0) -> int:
    """C = ``min(max(⌈factor · T · K / N⌉, minimum), T)``: an expert takes at most one slot a token,
    and at least ``minimum`` slots where there are that many tokens (DeepSpeed's ``min_capacity``:
    a small batch does not drop nearly every slot)."""
    return min(max(math.ceil(factor * tokens * top_k / num_experts), minimum), tokens)


def capacity_keep(indices: Tensor, weights: Tensor, num_experts: int, capacity: int, policy: str) -> Tensor:
    """``(T, K)`` bool: the token slots that fit their expert's capacity (GShard's / Switch's
    capacity, Megatron-Core's ``--moe-token-drop-policy``).

    Each expert takes at most ``capacity`` of the slots routed to it: those of the highest routing
    weight (``policy="probs"``) or of the earliest tokens (``policy="position"``); the others are
    dropped.  One ``topk`` over the tokens per expert, no loop and no host sync.
    """
    T = indices.shape[0]
    routed = torch.zeros(T, num_experts, dtype=torch.bool, device=indices.device).scatter_(1, indices, True)
    if policy == "probs":
        score = torch.zeros(T, num_experts, dtype=torch.float32, device=indices.device)
        score = score.scatter(1, indices, weights.detach().float())
    else:  # "position": the earlier token first
        position = -torch.arange(T, dtype=torch.float32, device=indices.device)
        score = position.unsqueeze(1).expand(T, num_experts)
    score = score.masked_fill(~routed, float("-inf"))
    c = min(capacity, T)
    chosen = score.topk(c, dim=0).indices  # (c, N): the tokens each expert keeps
    fits = torch.zeros_like(routed).scatter_(0, chosen, True) & routed
    return fits.gather(1, indices)


def limit(routing: Routing, config: Any) -> tuple[Routing, Tensor | None]:
    """``routing`` with its kept slots marked (``keep``; ``pad_to = C`` with ``pad_to_capacity``)
    and the fraction of its ``T·K`` slots dropped (0-dim), or ``routing`` unchanged and ``None`` for
    no tokens.  ``config``: the layer's :class:`moelab.layer_config.MoEConfig` (``num_experts``,
    ``capacity_factor``, ``min_capacity``, ``token_drop_policy``, ``pad_to_capacity``)."""
    T, K = routing.indices.shape
    if T == 0:
        return routing, None
    N = config.num_experts
    C = expert_capacity(config.capacity_factor, T, K, N, config.min_capacity)
    keep = capacity_keep(routing.indices, routing.weights, N, C, config.token_drop_policy)
    dropped = 1.0 - keep.float().mean()
    return dataclasses.replace(routing, keep=keep, pad_to=C if config.pad_to_capacity else None), dropped
