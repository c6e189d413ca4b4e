"""Pure tensor math shared by the routers, the losses and the statistics toolkit.

One source of truth for each formula: a router, a loss and ``moelab.stats`` call the
functions here, never a private copy.  Notation follows docs/methods.md: ``T``
tokens, ``N`` experts, ``K`` experts per token, logits ``h`` of shape ``(T, N)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _validate

__all__ = [
    "ACTIVATIONS",
    "ATTENTIONS",
    "ATTENTION_ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "SWIGLU_LIMIT",
    "activation",
    "attention_activation",
    "competition_affinity",
    "cosine_logits",
    "document_index",
    "expert_counts",
    "multi_head_attention",
    "normalized_weights",
    "resolve_renormalize",
    "taken_weights",
    "topk_gate",
    "topk_softmax",
]


def topk_softmax(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-K softmax gating: ``w = softmax(TopK_-inf(h))``.

    The Switch / GShard / Mixtral router (CompeteSMoE (2024) eq. 1-2; CompeteSMoE (2025) eq. 1).  Mixtral
    computes the softmax over all N experts and renormalises the chosen K: mathematically the same weights.

    Args:
        logits: ``(T, N)`` router logits ``h``.
        k: experts per token.

    Returns:
        ``(weights, indices)``, both ``(T, K)``; weights sum to 1 over K, indices are int64
        and sorted by decreasing logit.
    """
    if k == 1:  # the weight of a single expert is 1: one reduction instead of topk + softmax
        top, indices = logits.max(dim=-1, keepdim=True)
        return torch.ones_like(top), indices
    top, indices = logits.topk(k, dim=-1)  # (T, K)
    return top.softmax(dim=-1), indices


def resolve_renormalize(renormalize: bool | None, k: int) -> bool:
    """Whether the K chosen weights are renormalised to sum to 1: ``renormalize`` when given, else
    ``k > 1``.  At K = 1 a renormalised weight is the constant 1 and the task loss never reaches
    the router, so the default there is Switch Transformer's weighting (Fedus et al. 2022): the
    chosen expert's probability over all N."""
    if renormalize is None:
        return k > 1
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize={renormalize!r} is not allowed; expected True, False or None (K > 1)")
    return renormalize


def topk_gate(
    logits: Tensor, k: int, renormalize: bool | None = None, bias: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The softmax top-K gate of every softmax router: ``(weights (T, K), indices (T, K), probs (T, N))``.

    * ``probs = softmax(h)`` over all N experts;
    * the K chosen are ``TopK(softmax(h) + b)``: ``bias`` ``b (N,)`` is a selection-only offset on
      the gating scores (the aux-loss-free bias of DeepSeek-V3 and of Wang et al. 2024, added to
      the scores after their activation, as torchtitan does), absent by default: ``TopK(h)``;
    * weights: renormalised over the chosen (``softmax`` of their logits, :func:`topk_softmax`), or
      ``probs`` at the chosen (Switch Transformer at K = 1; Qwen2-MoE / OLMoE with
      ``norm_topk_prob=False``); ``renormalize=None`` renormalises for K > 1 only
      (:func:`resolve_renormalize`).
    """
    probs = logits.softmax(dim=-1)
    if bias is None:
        if resolve_renormalize(renormalize, k):
            weights, indices = topk_softmax(logits, k)
        else:  # the same choice as topk_softmax's (max at K = 1)
            indices = logits.argmax(dim=-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1).indices
            weights = probs.gather(1, indices)
        return weights, indices, probs
    indices = (probs.detach() + bias.to(probs.dtype)).topk(k, dim=-1).indices
    if resolve_renormalize(renormalize, k):
        weights = logits.gather(1, indices).softmax(dim=-1)
    else:
        weights = probs.gather(1, indices)
    return weights, indices, probs


def topk_gate_weights_at(logits: Tensor, probs: Tensor, indices: Tensor, renormalize: bool) -> Tensor:
    """The weights :func:`topk_gate` gives the experts ``indices (T, K)`` from the scores
    ``logits`` / ``probs = softmax(logits)``: the softmax of their logits (renormalised over the K)
    or their probabilities over all N; a choice :func:`topk_gate` made itself gets its own weights
    bit for bit.  Routing replay weighs recorded choices by it, so the router keeps its gradient."""
    if renormalize:
        return logits.gather(1, indices).softmax(dim=-1)
    return probs.gather(1, indices)


def taken_weights(probs: Tensor, indices: Tensor) -> Tensor:
    """``(T, W)`` the scores ``probs (T, N)`` at ``indices (T, W)``, 0 in a slot of ``-1`` (no expert):
    the weights of a variable number of experts per token weighed by their probability, not
    renormalised (expert-threshold's rule, token rounding's).  Routing replay weighs a recorded
    variable choice by it."""
    return probs.gather(1, indices.clamp(min=0)) * (indices >= 0).to(probs.dtype)


def normalized_weights(scores: Tensor, eps: float = 0.0) -> Tensor:
    """Normalise non-negative scores over the last dimension: ``s / Σ s``.

    Used by the normalised-sigmoid gate of DeepSeek-V3 (Ho (2025), "normalized sigmoid gating";
    CompeteSMoE (2025) SharedE-V3 baseline) and by the competition weights ``TopK_0(s) / Σ TopK_0(s)``
    (CompeteSMoE (2025) eq. 5).
    """
    return scores / (scores.sum(dim=-1, keepdim=True) + eps)


def cosine_logits(
    x: Tensor,
    embeddings: Tensor,
    tau_x: float | Tensor = 0.0,
    tau_e: float | Tensor = 0.0,
    eps: float = 1e-6,
) -> Tensor:
    """(Perturbed) cosine similarity between tokens and expert embeddings.

    ``ℓ_i(x) = xᵀ e_i / ((‖x‖ + τ₂)(‖e_i‖ + τ₁))`` — perturbed cosine router (2024) eq. (7);
    with ``τ₁ = τ₂ = 0`` it is the vanilla cosine router of X-MoE (perturbed cosine router (2024) eq. (2)).
    The same function serves the ``xmoe`` / ``pcosine`` routers and the regression models of
    ``moelab.stats``.  ``eps`` only guards the unperturbed case against a zero norm; it is added as
    ``max(‖·‖, eps)`` so that a non-zero vector's cosine is exact.

    Args:
        x: ``(..., T, d)`` tokens (already projected, for X-MoE).
        embeddings: ``(..., N, d)`` expert embeddings ``e_i``.
        tau_x: ``τ₂``, added to the token norms.
        tau_e: ``τ₁``, added to the expert-embedding norms.

    Returns:
        ``(..., T, N)`` similarities.
    """
    x_norm = x.norm(dim=-1, keepdim=True).clamp_min(eps) + tau_x  # (..., T, 1)
    e_norm = embeddings.norm(dim=-1).clamp_min(eps) + tau_e  # (..., N)
    dots = x @ embeddings.transpose(-2, -1)  # (..., T, N)
    return dots / (x_norm * e_norm.unsqueeze(-2))


def _swiglu(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


#: DeepSeek-V4's ``swiglu_limit`` (transformers' ``DeepseekV4Config`` default, the value of its
#: released configs): the bound of :func:`swiglu_clamp`
SWIGLU_LIMIT = 10.0


def _swiglu_clamp(h: Tensor) -> Tensor:
    """DeepSeek-V4's clamped SwiGLU: ``silu(min(gate, L)) * clamp(up, -L, L)`` with ``L =``
    :data:`SWIGLU_LIMIT` (transformers' ``DeepseekV4Experts._apply_gate`` and ``DeepseekV4MLP``):
    the gate is bounded above only, the up projection on both sides."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=SWIGLU_LIMIT)) * up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)


def _gelu_tanh(h: Tensor) -> Tensor:
    """The tanh approximation of GELU: GPT-2's ``gelu_new``, SigLIP's ``gelu_pytorch_tanh``."""
    return F.gelu(h, approximate="tanh")


def _quick_gelu(h: Tensor) -> Tensor:
    """``x · sigmoid(1.702 x)``: CLIP's ``quick_gelu``."""
    return h * torch.sigmoid(1.702 * h)


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "swiglu": _swiglu,
    "swiglu_clamp": _swiglu_clamp,
}

#: the activations that take a ``(..., 2h)`` input laid out ``[gate | up]`` (their ``W_in`` has ``2h`` rows)
GATED_ACTIVATIONS = ("swiglu", "swiglu_clamp")


def activation(name: str):
    """The expert activation ``name`` (``relu``, ``gelu``, ``gelu_tanh``, ``quick_gelu``, ``silu``,
    ``swiglu``, ``swiglu_clamp``).

    ``swiglu`` takes a ``(..., 2h)`` input laid out ``[gate | up]`` and returns
    ``silu(gate) * up`` — the layout of transformers' Mixtral experts; ``swiglu_clamp`` is
    DeepSeek-V4's: ``silu(min(gate, 10)) * clamp(up, -10, 10)``.
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation={name!r} is not supported; allowed: {sorted(ACTIVATIONS)}") from None


COMPETITION_ACTIVATIONS = ("softplus", "silu", "sigmoid", "relu", "softmax", "exp")


def competition_affinity(outputs: Tensor, activation: str = "softplus", reduce: str = "mean") -> Tensor:
    """Expert affinity scores of the competition mechanism.

    * ``reduce="mean"``: ``s_i = mean_d κ(g_i(x))`` — CompeteSMoE (2025) eq. (4) with κ = softplus by default
      and the alternatives of CompeteSMoE (2025) App. C.3 / eq. (10) (silu, sigmoid, relu, softmax, exp).  For
      ``softmax`` the softmax runs across the N experts for each feature (a softmax over the features would
      average to the constant 1/d).
    * ``reduce="norm"``: ``s_i = ‖g_i(x)‖₂`` — CompeteSMoE (2024) eq. (3) (CompeteSMoE v1).

    ``κ = exp`` overflows in float32 once an output exceeds ~88 (CompeteSMoE (2025) App. C.3 reports NaNs).
    Here it is computed in log space and shifted per token by the largest log-affinity, so the
    returned scores are ``mean(exp(g_i)) / max_j mean(exp(g_j))``: finite, with the same ranking
    and the same normalised weights ``s / Σ s`` as the exact values.

    Args:
        outputs: ``(..., N, d)`` expert outputs ``g_i(x)``.

    Returns:
        ``(..., N)`` affinities.
    """
    if reduce == "norm":
        return outputs.norm(dim=-1)
    if reduce != "mean":
        raise ValueError(f"reduce={reduce!r} is not supported; allowed: ['mean', 'norm']")
    if activation == "softplus":
        return F.softplus(outputs).mean(dim=-1)
    if activation == "silu":
        return F.silu(outputs).mean(dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(outputs).mean(dim=-1)
    if activation == "relu":
        return F.relu(outputs).mean(dim=-1)
    if activation == "softmax":
        # The mean over features of a softmax over the same features is the constant 1/d, so the
        # softmax is taken across experts, per feature (our reading of CompeteSMoE (2025) App. C.3).
        return outputs.softmax(dim=-2).mean(dim=-1)
    if activation == "exp":
        log_mean = outputs.logsumexp(dim=-1) - math.log(outputs.shape[-1])  # (..., N)
        return (log_mean - log_mean.amax(dim=-1, keepdim=True).detach()).exp()
    raise ValueError(
        f"activation={activation!r} is not a competition activation; allowed: {list(COMPETITION_ACTIVATIONS)}"
    )


def expert_counts(indices: Tensor, num_experts: int) -> Tensor:
    """``(N,)`` int64: how many of the slots in ``indices`` (any shape) chose each expert.

    ``torch.bincount(indices.flatten(), minlength=N)`` for indices in ``[0, N)``, written as a
    scatter-add of ones so that the output shape does not depend on the data: torch.compile traces
    it without a graph break (``bincount``'s length is ``max(N, max(indices) + 1)``).
    """
    flat = indices.reshape(-1)
    return flat.new_zeros(num_experts, dtype=torch.int64).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64)
    )


#: the attentions a model may build: the standard one and Active-Attention (Ho (2025))
ATTENTIONS = ("standard", "active")
#: the σ of Active-Attention (Ho (2025)): the activations of its time-series table (GELU, ReLU,
#: sigmoid, SiLU, tanh), applied elementwise to V = X W_V + b_V
ATTENTION_ACTIVATIONS = {
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
}


def attention_activation(attention: str, activation: str | None) -> str | None:
    """The σ of ``attention``, checked: ``None`` for ``"standard"`` (which takes none), ``activation``
    (default ``"gelu"``) for ``"active"``; anything else is refused naming the argument."""
    _validate.one_of("attention", attention, ATTENTIONS)
    if attention == "active":
        activation = "gelu" if activation is None else activation
        _validate.one_of("attention_activation", activation, list(ATTENTION_ACTIVATIONS))
        return activation
    if activation is not None:
        raise ValueError(
            f"attention_activation={activation!r} is not allowed with attention={attention!r}; it is the σ "
            "of attention='active'"
        )
    return None


def multi_head_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    n_head: int,
    *,
    causal: bool,
    value_activation: str | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Multi-head scaled dot-product attention ``softmax(QKᵀ/√d_h) V`` per head, or with
    ``value_activation`` Active-Attention of Ho (2025), ``softmax(QKᵀ/√d_h) σ(V)``: each row of
    attention then mixes non-linear experts ``σ(x_j W_V)`` instead of linear ones.

    The one computation every moelab attention (the LMs' causal attention, the image patch
    transformer's) calls, so that the two options mean the same everywhere.

    Args:
        q, k, v: ``(B, L, d)`` projections, ``d`` divisible by ``n_head``.
        n_head: heads, each of width ``d / n_head``.
        causal: mask out later positions (language models) or not (image patches).
        value_activation: ``None`` for standard attention, else a key of
            :data:`ATTENTION_ACTIVATIONS` (σ applied to V before the heads are split).
        dropout_p: attention dropout (pass 0 at evaluation).

    Returns:
        ``(B, L, d)``, the heads concatenated (before the output projection).
    """
    B, L, d = q.shape
    if value_activation is not None:
        v = ATTENTION_ACTIVATIONS[value_activation](v)
    q, k, v = (t.view(B, L, n_head, d // n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)  # (B, H, L, d/H)
    return y.transpose(1, 2).reshape(B, L, d)


def document_index(doc_ids: Tensor, rows: Tensor) -> Tensor:
    """``(T,)`` int64 in ``[0, T)``: one index per document, a document being the tokens that share
    a ``(row, id)`` pair (``doc_ids (T,)``, ``rows (T,)`` integer).  Ids are any integers (a packer's
    document ids, or segment ids counted from each sequence's start, as OLMo-core's
    ``segment_ids_from_eos``); two rows never share a document.

    Vectorised, with no host sync and no shape that depends on the data: a stable sort by
    ``(row, id)``, a new index wherever the pair changes, scattered back; so a per-document
    statistic is an ``index_add`` into ``T`` rows (at most ``T`` documents), which ``torch.compile``
    traces without a graph break."""
    order = doc_ids.argsort(stable=True)
    order = order.index_select(0, rows.index_select(0, order).argsort(stable=True))  # by row, then id
    r, i = rows.index_select(0, order), doc_ids.index_select(0, order)
    change = (r[1:] != r[:-1]) | (i[1:] != i[:-1])
    segment = torch.cat([change.new_zeros(min(1, order.numel())), change]).long().cumsum(0)
    return torch.empty_like(segment).scatter_(0, order, segment)
