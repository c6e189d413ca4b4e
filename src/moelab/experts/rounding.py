"""Token rounding (SonicMoE, Guo et al. 2025, arXiv 2512.14080; its code's
``benchmarks/moe-token-rounding.py``, ``forward_token_choice_rounding``): in training, each expert's
token count is rounded to a multiple of the GEMM tile by dropping its lowest-ranked tokens or
adding the best-scoring tokens that did not choose it, so no expert's grouped GEMM runs a partial
tile.  :func:`round_tokens` turns a top-K :class:`moelab.Routing` into the rounded one (a variable
number of experts per token, ``Routing.mask``)."""

from __future__ import annotations

import dataclasses

import torch

from ..routing import Routing

__all__ = ["TOKEN_ROUNDINGS", "round_tokens", "rounded_counts"]

#: how each expert's count is rounded to a multiple of the tile (SonicMoE's ``up``, ``down``, ``nr``)
TOKEN_ROUNDINGS = ("up", "down", "nearest")


def rounded_counts(counts: torch.Tensor, tile: int, mode: str) -> torch.Tensor:
    """Each count rounded to a multiple of ``tile``: up, down or to the nearest (halves to even,
    ``torch.round``, as SonicMoE's ``nr``)."""
    if mode == "up":
        return torch.ceil(counts / tile).long() * tile
    if mode == "down":
        return torch.div(counts, tile, rounding_mode="floor").long() * tile
    return torch.round(counts / tile).long() * tile


def round_tokens(routing: Routing, num_experts: int, tile: int, mode: str) -> Routing:
    """The routing with each expert's token count rounded to a multiple of ``tile`` (``mode`` one of
    :data:`TOKEN_ROUNDINGS`; at most ``T``), as SonicMoE's token rounding:

    * each expert ranks the tokens that chose it first, by their routing weight (the renormalised
      top-K score of a softmax router), then the others by ``Routing.probs − 1`` (so the order among
      them is their probability's, always below the chosen); ties keep the token order (a stable
      sort: the code's is not);
    * it keeps its first ``rounded(count)`` tokens: rounding down drops its lowest-weighted chosen
      tokens, rounding up adds the best-scoring tokens that did not choose it;
    * every kept pair ``(t, e)`` is weighted by the router's distribution ``Routing.probs[t, e]`` (the
      softmax over all N of a softmax router, not renormalised: the code's ``router_scores``), with
      its gradient.

    Returns ``indices`` / ``weights`` of width N (a token's kept experts first, by decreasing
    probability) and ``mask`` the kept ones.  No loop, no host sync.

    Raises:
        ValueError: the routing has no distribution over the experts (``Routing.probs``).
    """
    if routing.probs is None:
        raise ValueError(
            "token_rounding is not allowed with a router that gives no distribution over the experts "
            "(Routing.probs is None); expected a router with probabilities (smoe, xmoe, sigmoid routers, ...)"
        )
    indices, probs = routing.indices, routing.probs
    T, n = probs.shape[0], num_experts
    device = indices.device
    chosen = torch.zeros(T, n, dtype=torch.bool, device=device).scatter(1, indices, True)
    weight = torch.zeros(T, n, dtype=torch.float32, device=device).scatter(
        1, indices, routing.weights.detach().float()
    )
    rank = torch.where(
        chosen, weight, probs.detach().float() - 1
    )  # the chosen first, each group by its score
    order = rank.argsort(dim=0, descending=True, stable=True)  # (T, N): each expert's tokens, best first
    limit = rounded_counts(chosen.sum(dim=0), tile, mode).clamp(max=T)  # (N,)
    place = torch.arange(T, device=device).unsqueeze(1) < limit.unsqueeze(
        0
    )  # (T, N): within the rounded count
    keep = torch.zeros_like(chosen).scatter(0, order, place)
    by_token = probs.detach().masked_fill(~keep, -1.0).argsort(dim=1, descending=True, stable=True)
    mask = keep.gather(1, by_token)
    weights = (probs * keep.to(probs.dtype)).gather(1, by_token)
    return dataclasses.replace(routing, indices=by_token, weights=weights, mask=mask)
