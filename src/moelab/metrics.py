"""Routing diagnostics and expert-specialization metrics: the CompeteSMoE diagnostics (router
entropy, router/competition overlap, expert change rate, expert output norms, the top-1 swap),
usable on any model with ``moelab.MoE`` layers whatever its method, the cheap per-step summary the
trainer logs (:func:`routing_summary`), tensor-level versions that take routings directly, and the
specialization metrics and selection table of Krishnamurthy et al. (2023).  docs/methods.md
("Diagnostics") gives each function with its formula and paper section.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from . import _validate
from .functional import competition_affinity
from .io.atomic import atomic_write_png
from .padding import current_mask
from .routers import Router
from .routing import Routing, RoutingContext

__all__ = [
    "SwappedRouter",
    "assignment_change_rate",
    "competition_overlap",
    "expert_change_rate",
    "expert_output_norms",
    "max_violation",
    "router_entropy",
    "routing_entropy",
    "routing_loads",
    "routing_summary",
    "swap_top1",
    "topk_overlap",
]


# ---------------------------------------------------------------- on routings
def routing_entropy(probs: Tensor, base: float = math.e) -> Tensor:
    """Mean per-token entropy ``mean_x −Σ_i p_i log p_i`` of a ``(T, N)`` router distribution, in
    nats by default (``base=2`` for bits).  CompeteSMoE (2024) Table 10 reports it per layer (a uniform router
    over 16 experts has ln 16 ≈ 2.77)."""
    if probs.dim() != 2:
        raise ValueError(f"probs of shape {tuple(probs.shape)} is not allowed; expected (T, N)")
    p = probs.double()
    h = -(p * p.clamp_min(1e-30).log()).sum(dim=-1).mean()
    return (h / math.log(base)).to(probs.dtype)


def topk_overlap(indices_a: Tensor, indices_b: Tensor) -> Tensor:
    """Mean ``|A ∩ B|`` per token of two ``(T, K)`` expert choices (the "level learning" of CompeteSMoE (2025)
    App. C.5 when A is the router's top-K and B the competition's); 0-dim float."""
    if indices_a.dim() != 2 or indices_a.shape[0] != indices_b.shape[0]:
        raise ValueError(
            f"indices of shapes {tuple(indices_a.shape)} and {tuple(indices_b.shape)} are not allowed; "
            "expected (T, K_a) and (T, K_b) with the same T"
        )
    hits = (indices_a.unsqueeze(-1) == indices_b.unsqueeze(-2)).any(dim=-1)  # (T, K_a)
    return hits.sum(dim=-1).float().mean()


def _mismatches(indices_a: Tensor, indices_b: Tensor) -> tuple[int, int]:
    if indices_a.shape != indices_b.shape:
        raise ValueError(
            f"indices of shapes {tuple(indices_a.shape)} and {tuple(indices_b.shape)} are not allowed; "
            "expected the same (T, K) (the same data through both checkpoints)"
        )
    same = (indices_a.unsqueeze(-1) == indices_b.unsqueeze(-2)).any(dim=-1).sum()
    return indices_a.numel() - int(same), indices_a.numel()


def assignment_change_rate(indices_a: Tensor | list[Tensor], indices_b: Tensor | list[Tensor]) -> float:
    """Expert change rate (CompeteSMoE (2025) §5.2.2 b): the fraction of (token, layer, slot) assignments that
    differ between two routings of the same tokens.  Each token's K experts are compared as a set
    (a swap of order is no change): per token ``K − |A ∩ B|`` mismatches out of K.

    Args:
        indices_a, indices_b: ``(T, K)`` choices, or lists of them (one per layer).
    """
    if isinstance(indices_a, Tensor):
        indices_a, indices_b = [indices_a], [indices_b]
    if len(indices_a) != len(indices_b):
        raise ValueError(f"got {len(indices_a)} and {len(indices_b)} layers; expected the same number")
    bad = total = 0
    for a, b in zip(indices_a, indices_b):
        m, n = _mismatches(a, b)
        bad, total = bad + m, total + n
    return bad / total if total else 0.0


# ---------------------------------------------------------------- on models
def layers_of(model: nn.Module) -> list[nn.Module]:
    """The :class:`moelab.MoE` layers of ``model`` in module order; ``ValueError`` when it has none
    (a metric of a model without one has nothing to measure)."""
    from .layer import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"model of type {type(model).__name__} has no moelab.MoE layer")
    return layers


def _call(model: nn.Module, batch: Any, forward: Callable | None) -> None:
    if forward is not None:
        forward(model, batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    from .layer import recording_routing

    was_training = model.training
    model.eval()
    try:  # an inference forward keeps no routing unless asked: the diagnostics read it
        with torch.no_grad(), recording_routing(model):
            yield
    finally:
        model.train(was_training)


def _run(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Callable | None,
    on_layer: Callable[[int, nn.Module, Tensor], None],
) -> int:
    """Run ``model`` over ``batches``; after each MoE layer's forward call ``on_layer(i, layer, x)``
    with its flattened input ``(T, d)`` (``layer.last_routing`` is that call's routing): the real
    tokens alone where the model's forward scoped a padding mask (:mod:`moelab.padding`)."""
    layers = layers_of(model)

    def make_hook(i: int):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            x = args[0].reshape(-1, module.d_model)
            scope = current_mask(x.shape[0])  # still open: the hook runs inside the model's forward
            on_layer(i, module, x if scope is None else x.index_select(0, scope.real))

        return hook

    handles = [layer.register_forward_hook(make_hook(i)) for i, layer in enumerate(layers)]
    try:
        with _evaluating(model):
            for batch in batches:
                _call(model, batch, forward)
    finally:
        for h in handles:
            h.remove()
    return len(layers)


def router_entropy(
    model: nn.Module, batches: Iterable[Any], forward: Callable | None = None, base: float = math.e
) -> list[float | None]:
    """Mean entropy of each MoE layer's router distribution (``Routing.probs``) over the tokens of
    ``batches``, in layer order (CompeteSMoE (2024) App. C.5, Table 10); ``None`` for a layer without a router
    distribution (pure competition)."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        probs = layer.last_routing.probs
        if probs is None:
            return
        sums[i] = sums.get(i, 0.0) + float(routing_entropy(probs, base)) * probs.shape[0]
        counts[i] = counts.get(i, 0) + probs.shape[0]

    n = _run(model, batches, forward, on_layer)
    return [sums[i] / counts[i] if counts.get(i) else None for i in range(n)]


def competition_overlap(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Callable | None = None,
    kappa: str = "softplus",
    reduce: str = "mean",
) -> list[float]:
    """Per layer, the mean number of experts shared by the layer's routing (its top-K) and the
    top-K of the competition on the same input (CompeteSMoE (2025) App. C.5 "level learning"; K means the
    router has learned the competition policy).  The competition runs on demand (``forward_all`` on the
    layer's input, affinity :func:`moelab.functional.competition_affinity` with ``kappa`` / ``reduce``), for
    any method."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        chosen = layer.last_routing.indices
        if layer.last_routing.mask is not None:  # a variable K: the router's K best against the K winners
            chosen = chosen[:, : layer.top_k]
        scores = competition_affinity(layer.experts.forward_all(x), kappa, reduce)
        winners = scores.topk(chosen.shape[-1], dim=-1).indices
        sums[i] = sums.get(i, 0.0) + float(topk_overlap(chosen, winners)) * x.shape[0]
        counts[i] = counts.get(i, 0) + x.shape[0]

    n = _run(model, batches, forward, on_layer)
    return [sums[i] / counts[i] for i in range(n)]


def expert_output_norms(model: nn.Module, batches: Iterable[Any], forward: Callable | None = None) -> Tensor:
    """``(L, N)``: the mean ``‖g_i(x)‖₂`` of every expert i of every MoE layer over that layer's
    tokens (all experts run on all tokens; CompeteSMoE (2025) App. D.1, Fig. 6 plots their layer-wise
    evolution)."""
    sums: dict[int, Tensor] = {}
    counts: dict[int, int] = {}

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        norms = layer.experts.forward_all(x).flatten(2).norm(dim=-1).double().sum(dim=0)  # (N,)
        sums[i] = sums[i] + norms if i in sums else norms
        counts[i] = counts.get(i, 0) + x.shape[0]

    n = _run(model, batches, forward, on_layer)
    return torch.stack([(sums[i] / counts[i]).float() for i in range(n)])


def _routings(model: nn.Module, batch: Any, forward: Callable | None) -> list[Tensor]:
    out: dict[int, list[Tensor]] = {}

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        out.setdefault(i, []).append(layer.last_routing.indices)

    n = _run(model, [batch], forward, on_layer)
    return [torch.cat(out[i]) for i in range(n)]


def expert_change_rate(
    model_a: nn.Module, model_b: nn.Module, batches: Iterable[Any], forward: Callable | None = None
) -> float:
    """Expert change rate between two checkpoints of one model on the same data (CompeteSMoE (2025) §5.2.2 b,
    Fig. 3): :func:`assignment_change_rate` over every token, MoE layer and slot of ``batches``.
    ``batches`` is iterated once; each batch goes through both models."""
    bad = total = 0
    for batch in batches:
        ra, rb = _routings(model_a, batch, forward), _routings(model_b, batch, forward)
        if len(ra) != len(rb):
            raise ValueError(f"the models have {len(ra)} and {len(rb)} MoE layers; expected the same number")
        for a, b in zip(ra, rb):
            m, t = _mismatches(a, b)
            bad, total = bad + m, total + t
    return bad / total if total else 0.0


class SwappedRouter(Router):
    """The choice of ``router`` with its expert of rank ``rank`` replaced by its (K+1)-th
    (CompeteSMoE (2025) Table 3): the wrapped router, set to route with K+1 experts, chooses; the
    column of rank ``rank`` is dropped (routers sort their choice by decreasing score) and, for
    routers whose weights sum to one, the K left are renormalised.  Installed by
    :func:`swap_top1` for its duration, which sets the wrapped router's ``top_k`` to K+1 and back.
    """

    def __init__(self, router: Router, rank: int) -> None:
        super().__init__(router.d_model, router.num_experts, router.top_k)
        self.router = router
        self.rank = _validate.int_in_range("rank", rank, 0, router.top_k - 1)
        self.layer_index = router.layer_index
        self.train(router.training)

    @property
    def weights_sum_to_one(self) -> bool:
        return self.router.weights_sum_to_one

    @property
    def base_router(self) -> Router:
        return self.router.base_router

    def rule_options(self) -> dict[str, Any]:
        return self.router.rule_options()

    @property
    def takes_token_ids(self) -> bool:
        return self.router.takes_token_ids

    @property
    def takes_doc_ids(self) -> bool:
        return self.router.takes_doc_ids

    def forward(
        self, x: Tensor, experts: nn.Module, ctx: RoutingContext | None = None, **ids: Tensor
    ) -> Routing:
        r = self.router(x, experts, ctx, **ids)  # K+1 experts, by decreasing score (ids: as the layer passes)
        keep = [j for j in range(self.top_k + 1) if j != self.rank]  # the (K+1)-th replaces rank ``rank``
        weights = r.weights[:, keep]
        if self.router.weights_sum_to_one:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(
            indices=r.indices[:, keep],
            weights=weights,
            probs=r.probs,
            logits=r.logits,
            losses=r.losses,
            outputs=None if r.outputs is None else r.outputs[:, keep],
            inputs=r.inputs,
        )


@contextlib.contextmanager
def swap_top1(model: nn.Module, rank: int = 0) -> Iterator[nn.Module]:
    """Within the block every MoE layer of ``model`` replaces its expert of rank ``rank`` (0: the
    top-1, CompeteSMoE (2025) §5.2.2 a, Table 3: "shifting the selected experts down by one rank";
    K-1: the K-th) by its (K+1)-th; the weights are the router's rule on the new set (top-K softmax
    renormalised over it, σ-MoE's raw scores kept). Meant for evaluation; needs
    ``top_k < num_experts``.

    Each layer's router is wrapped in a :class:`SwappedRouter` on entry and put back on exit,
    also when the block raises.  A layer whose choice no parameter learns (``Router.learns_choice``:
    DeepSeek-V4's hash layers, a token id table) has no ranking to shift: it keeps its router.

    >>> with moelab.metrics.swap_top1(model):
    ...     loss = evaluate(model)
    """
    layers = layers_of(model)
    for layer in layers:
        _validate.int_in_range("rank", rank, 0, layer.top_k - 1)
        if isinstance(layer.router, SwappedRouter):
            raise ValueError(
                f"swap_top1 is already active on MoE layer {layer.layer_index}; it does not nest"
            )
        if layer.router.variable_k:
            raise ValueError(
                f"swap_top1 is not allowed on MoE layer {layer.layer_index} (method={layer.method!r}): it "
                "routes a variable number of experts per token, so there is no K-th expert to replace"
            )
        k = layer.router.top_k
        if k >= layer.num_experts:
            raise ValueError(
                f"swap_top1 needs top_k < num_experts; got top_k={k}, num_experts={layer.num_experts}"
            )
    installed: list[tuple[nn.Module, Router, int]] = []
    try:
        for layer in layers:
            router = layer.router
            if not router.learns_choice:
                continue
            layer.router = SwappedRouter(router, rank)
            installed.append((layer, router, router.top_k))
            router.top_k += 1
        yield model
    finally:
        for layer, router, k in reversed(installed):
            router.top_k = k
            layer.router = router


def max_violation(load: Tensor) -> float:
    """MaxVio: the most-loaded expert's excess over the mean load, ``max_i load_i / mean_i load_i − 1``
    (0 = perfectly balanced; N − 1 = every slot on one expert), from the counts or fractions
    ``load (N,)`` — the balance measure of the aux-loss-free balancing paper (Wang et al. 2024,
    "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"), measured on one batch
    (MaxVio_batch) or on the load accumulated over a run or a data set (MaxVio_global).  ``None``-free:
    an empty load gives 0."""
    load = load.double()
    mean = load.mean()
    return float(load.max() / mean - 1) if mean > 0 else 0.0


def load_cv(
    model: nn.Module, batches: Iterable[Any], forward: Callable | None = None
) -> list[dict[str, Any]]:
    """Per MoE layer: the fraction of token slots each expert received over ``batches``, its
    coefficient of variation (std / mean; 0 = perfectly balanced) and its MaxVio
    (:func:`max_violation`, over all of ``batches``); for a layer with an expert capacity
    (``capacity_factor``) also ``dropped``, the fraction of the slots it dropped."""
    counts: dict[int, Tensor] = {}
    dropped: dict[int, float] = {}

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        c = torch.bincount(layer.last_routing.active_indices, minlength=layer.num_experts).double()
        counts[i] = counts[i] + c if i in counts else c
        dropped[i] = dropped.get(i, 0.0) + layer.dropped_fraction * float(c.sum())

    n = _run(model, batches, forward, on_layer)
    layers = layers_of(model)
    out = []
    for i in range(n):
        load = counts[i] / counts[i].sum()
        row = {
            "load": load.tolist(),
            "cv": float(load.std(unbiased=False) / load.mean()),
            "max_vio": max_violation(load),
        }
        if layers[i].capacity_factor is not None:
            row["dropped"] = dropped[i] / float(counts[i].sum())
        out.append(row)
    return out


def routing_summary(model: nn.Module) -> dict[str, float | None]:
    """The cheap diagnostics of the last forward pass, averaged over ``model``'s MoE layers, read from
    each layer's ``last_routing`` (no extra forward): ``router_entropy`` (nats, mean over tokens of the
    router distribution's entropy; ``None`` without one), ``load_cv`` (std / mean of the experts' share
    of the token slots), ``max_vio`` (:func:`max_violation` of the batch's load, MaxVio_batch) and
    ``competition_overlap`` (mean ``|TopK(router) ∩ winners|`` per token, K = learned, over the
    layers that competed in that pass, CompeteSMoE (2025) App. C.5; ``None`` when none did).  A layer
    competed when its routing carries a ``distill`` loss.  :func:`routing_loads` gives the loads."""
    entropies: list[float] = []
    cvs: list[float] = []
    vios: list[float] = []
    overlaps: list[float] = []
    for layer, load in zip(layers_of(model), routing_loads(model)):
        routing = layer.recorded_routing
        if routing is None:
            continue
        if routing.probs is not None:
            entropies.append(float(routing_entropy(routing.probs)))
        cvs.append(float(load.std(unbiased=False) / load.mean()))
        vios.append(max_violation(load))
        if "distill" in routing.losses and routing.probs is not None:
            k = routing.indices.shape[-1]
            router_top = routing.probs.topk(k, dim=-1).indices
            overlaps.append(float(topk_overlap(router_top, routing.indices)))
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    out = {
        "router_entropy": mean(entropies),
        "load_cv": mean(cvs),
        "max_vio": mean(vios),
        "competition_overlap": mean(overlaps),
    }
    capped = [layer.dropped_fraction for layer in layers_of(model) if layer.capacity_factor is not None]
    if capped:  # a model with an expert capacity: the mean fraction of token slots dropped
        out["dropped"] = mean(capped)
    return out


def routing_loads(model: nn.Module) -> list[Tensor | None]:
    """Per MoE layer of ``model``: the expert counts ``(N,)`` (float64) of its last forward's token
    slots (the active ones, for a router with a variable number of experts per token), or ``None``
    for a layer that has not run."""
    loads: list[Tensor | None] = []
    for layer in layers_of(model):
        routing = layer.recorded_routing
        loads.append(
            None
            if routing is None
            else torch.bincount(routing.active_indices, minlength=layer.num_experts).double()
        )
    return loads


__all__ += [
    "active_choices",
    "jain_index",
    "router_distributions",
    "router_saturation",
    "routing_balance",
    "routing_parameters",
    "selection_entropy",
    "slot_agreement",
    "topk_weight_entropy",
]


# ---------------------------------------------------------------- balance and stability (Ho (2025),
# CompeteSMoE (2025) Figs. 9-10)
def _shares(load: Tensor) -> Tensor:
    if load.dim() != 1 or load.numel() == 0:
        raise ValueError(f"load of shape {tuple(load.shape)} is not allowed; expected (N,) with N >= 1")
    if bool((load < 0).any()):
        raise ValueError("load has a negative entry; expected token counts or shares >= 0")
    return load.double()


def jain_index(load: Tensor) -> float:
    """Jain's fairness index of expert utilisation (Ho (2025)): ``J = (Σ_i r_i)² / (N Σ_i r_i²)``
    of the counts or shares ``load (N,)`` of token slots routed to each expert; 1 = uniform,
    1/N = every slot on one expert.  An all-zero load (no token) gives 1: nothing is unfair."""
    r = _shares(load)
    sq = float((r * r).sum())
    return float(r.sum()) ** 2 / (r.numel() * sq) if sq > 0 else 1.0


def selection_entropy(load: Tensor, base: float = math.e) -> float:
    """Entropy of the expert-selection frequency ``−Σ_i r_i log r_i`` with ``r = load / Σ load``
    (CompeteSMoE (2025) Fig. 9), nats by default: ln N = uniform use, 0 = one expert.  An all-zero
    load gives 0."""
    r = _shares(load)
    total = float(r.sum())
    if total <= 0:
        return 0.0
    return float(entropy_bits(r / total)) * math.log(2) / math.log(base)


def topk_weight_entropy(weights: Tensor, base: float = math.e) -> Tensor:
    """Per token, the entropy of its K routing weights renormalised to sum 1 (CompeteSMoE (2025)
    Fig. 10): ln K = the K experts weighted alike, 0 = one expert carries the token.  ``(T,)``;
    negative weights count as 0 and a token whose weights are all 0 (ReMoE, a dropped token) has
    entropy 0."""
    if weights.dim() != 2:
        raise ValueError(f"weights of shape {tuple(weights.shape)} is not allowed; expected (T, K)")
    w = weights.detach().double().clamp_min(0)
    total = w.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, w / total.clamp_min(1e-300), torch.zeros_like(w))
    return entropy_bits(p) * (math.log(2) / math.log(base))


def routing_balance(
    model: nn.Module, batches: Iterable[Any], forward: Callable | None = None
) -> list[dict[str, Any]]:
    """Per MoE layer, over every token of ``batches``: ``load`` (each expert's share of the token
    slots, the active ones for a router with a variable number of experts per token), ``jain`` (:func:`jain_index`), ``selection_entropy`` (:func:`selection_entropy`, nats),
    ``max_vio`` (:func:`max_violation`), ``topk_weight_entropy`` (mean over tokens of
    :func:`topk_weight_entropy`, nats), ``router_entropy_mean`` / ``router_entropy_sd`` (mean and
    population sd over tokens of the entropy of ``Routing.probs``, nats, CompeteSMoE (2024) Table 10;
    ``None`` for a router without a distribution) and ``tokens``."""
    counts: dict[int, Tensor] = {}
    sums: dict[int, list[float]] = {}  # Σ weight entropy, Σ H, Σ H², tokens, tokens with probs

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        routing = layer.last_routing
        c = torch.bincount(routing.active_indices, minlength=layer.num_experts).double()
        counts[i] = counts[i] + c if i in counts else c
        acc = sums.setdefault(i, [0.0, 0.0, 0.0, 0, 0])
        acc[0] += float(topk_weight_entropy(routing.weights).sum())
        acc[3] += routing.indices.shape[0]
        if routing.probs is not None:
            p = routing.probs.double()
            h = -(p * p.clamp_min(1e-30).log()).sum(dim=-1)
            acc[1] += float(h.sum())
            acc[2] += float((h * h).sum())
            acc[4] += h.shape[0]

    n = _run(model, batches, forward, on_layer)
    out = []
    for i in range(n):
        w_sum, h_sum, h2_sum, tokens, with_probs = sums[i]
        mean = h_sum / with_probs if with_probs else None
        sd = math.sqrt(max(h2_sum / with_probs - mean * mean, 0.0)) if with_probs else None
        out.append(
            {
                "load": (counts[i] / counts[i].sum()).tolist(),
                "jain": jain_index(counts[i]),
                "selection_entropy": selection_entropy(counts[i]),
                "max_vio": max_violation(counts[i]),
                "topk_weight_entropy": w_sum / tokens,
                "router_entropy_mean": mean,
                "router_entropy_sd": sd,
                "tokens": tokens,
            }
        )
    return out


def slot_agreement(indices_a: Tensor, indices_b: Tensor) -> Tensor:
    """Per token, how many of its K slots two routings of it agree on, ``(T,)``: the experts both chose
    (as sets: order is no change) plus, for a router with a variable number of experts per token, the
    empty slots both left (an inactive slot is ``-1``, :func:`active_choices`), ``min(empty_a,
    empty_b)``.  With every slot active it is ``|A ∩ B|``, so ``1 − Σ / (T·K)`` is
    :func:`assignment_change_rate`."""
    if indices_a.shape != indices_b.shape or indices_a.dim() != 2:
        raise ValueError(
            f"indices of shapes {tuple(indices_a.shape)} and {tuple(indices_b.shape)} are not allowed; "
            "expected the same (T, K) (the same data through both checkpoints)"
        )
    hits = ((indices_a.unsqueeze(-1) == indices_b.unsqueeze(-2)) & (indices_a >= 0).unsqueeze(-1)).any(-1)
    empty = torch.minimum((indices_a < 0).sum(-1), (indices_b < 0).sum(-1))
    return hits.sum(-1) + empty


def routing_parameters(model: nn.Module) -> list[int]:
    """Per MoE layer, the learnable parameters (``requires_grad``) its choice of experts depends on:
    its router's, or 0 for a router whose choice is fixed (``Router.learns_choice``: DeepSeek-V4's
    hash layers, whose gate learns only the weights of the table's experts)."""
    return [
        sum(p.numel() for p in layer.router.parameters() if p.requires_grad)
        if layer.router.learns_choice
        else 0
        for layer in layers_of(model)
    ]


def active_choices(model: nn.Module, batch: Any, forward: Callable | None = None) -> list[Tensor]:
    """Per MoE layer, the ``(T, K)`` experts every token of ``batch`` chose, an inactive slot
    (``Routing.mask``: a router with a variable number of experts per token) as ``-1``."""
    out: dict[int, list[Tensor]] = {}

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        routing = layer.last_routing
        idx = routing.indices
        if routing.mask is not None:
            idx = torch.where(routing.mask, idx, torch.full_like(idx, -1))
        out.setdefault(i, []).append(idx)

    n = _run(model, [batch], forward, on_layer)
    return [torch.cat(out[i]) for i in range(n)]


def router_saturation(
    model: nn.Module, final: nn.Module, batches: Iterable[Any], forward: Callable | None = None
) -> list[float]:
    """Router saturation of a checkpoint against the final one (Ho (2025)): per MoE layer, the mean
    over the tokens of ``batches`` of ``|TopK_t(x) ∩ TopK_final(x)| / K`` (1 = the final choice
    already, order ignored; a router with a variable number of experts per token: the slots
    :func:`slot_agreement` counts, over K).  Each batch goes through both models; each layer sees its own model's
    input (the choices of the whole network at step t, as Ho (2025) measures)."""
    hits: dict[int, float] = {}
    counts: dict[int, int] = {}
    n = None
    for batch in batches:
        ra, rb = active_choices(model, batch, forward), active_choices(final, batch, forward)
        if len(ra) != len(rb):
            raise ValueError(f"the models have {len(ra)} and {len(rb)} MoE layers; expected the same number")
        n = len(ra)
        for i, (a, b) in enumerate(zip(ra, rb)):
            if a.shape != b.shape:
                raise ValueError(
                    f"MoE layer {i} chose {tuple(a.shape)} and {tuple(b.shape)} experts; expected the same "
                    "(T, K) (the same top_k in both checkpoints)"
                )
            hits[i] = hits.get(i, 0.0) + float(slot_agreement(a, b).double().sum()) / a.shape[1]
            counts[i] = counts.get(i, 0) + a.shape[0]
    if n is None:
        raise ValueError("batches is empty; expected at least one batch")
    return [hits[i] / counts[i] if counts[i] else 0.0 for i in range(n)]


def router_distributions(
    model: nn.Module, batch: Any, forward: Callable | None = None
) -> list[Tensor | None]:
    """Per MoE layer, the router distribution ``Routing.probs (T, N)`` of every token of ``batch`` (one
    sample: CompeteSMoE (2024) Figs. 4-6 draw them), ``None`` for a layer whose router has none."""
    out: dict[int, list[Tensor]] = {}
    missing: set[int] = set()

    def on_layer(i: int, layer: nn.Module, x: Tensor) -> None:
        probs = layer.last_routing.probs
        if probs is None:
            missing.add(i)
        else:
            out.setdefault(i, []).append(probs.float().cpu())

    n = _run(model, [batch], forward, on_layer)
    return [None if i in missing or i not in out else torch.cat(out[i]) for i in range(n)]


__all__ += [
    "entropy_bits",
    "mutual_information_bits",
    "plot_selection_table",
    "selection_table",
    "specialization",
]


# ---------------------------------------------------------------------- expert specialization (Krishnamurthy
# et al. (2023))
def entropy_bits(p: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy ``−Σ p log₂ p`` along ``dim`` with ``0 log 0 = 0``."""
    p = p.double()
    return -(torch.where(p > 0, p * torch.log2(p.clamp_min(1e-300)), torch.zeros_like(p))).sum(dim)


def selection_table(experts: Tensor, labels: Tensor, num_experts: int, num_classes: int) -> Tensor:
    """The count matrix ``C (M, K)``: ``C[i, j]`` = samples of class ``j`` sent to expert ``i``
    (Krishnamurthy et al. (2023) Appendix A, Table 4).

    Args:
        experts: ``(B,)`` the selected (argmax) expert of each sample.
        labels: ``(B,)`` the TRUE class of each sample.
    """
    if experts.shape != labels.shape or experts.dim() != 1:
        raise ValueError(
            f"experts of shape {tuple(experts.shape)} and labels of shape {tuple(labels.shape)} are not "
            "allowed; expected two 1-d tensors of the same length"
        )
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, num_classes={num_classes}); got [{labels.min()}, {labels.max()}]"
        )
    flat = experts.long() * num_classes + labels.long()
    return torch.bincount(flat, minlength=num_experts * num_classes).view(num_experts, num_classes)


def mutual_information_bits(table: Tensor) -> Tensor:
    """``I(E;Y) = H(E) + H(Y) − H(E,Y)`` from a count table (Krishnamurthy et al. (2023) eq. 3, 11–16)."""
    joint = table.double() / table.sum()
    return entropy_bits(joint.sum(1)) + entropy_bits(joint.sum(0)) - entropy_bits(joint.reshape(-1))


def specialization(
    gate_probs: Tensor, labels: Tensor, num_classes: int, predictions: Tensor | None = None
) -> dict[str, float]:
    """The information-theoretic routing metrics of Krishnamurthy et al. (2023) §3, in bits.

    * ``H_s`` — mean per-sample entropy of the gate distribution (Krishnamurthy et al. (2023) eq. 1): low =
      sparse gating.
    * ``H_u`` — entropy of the batch-mean gate distribution (Krishnamurthy et al. (2023) eq. 2): high =
      balanced use.
    * ``I_EY`` — mutual information between the argmax expert ``E`` and the TRUE class ``Y``
      (Krishnamurthy et al. (2023) eq. 3, Appendix A); the paper defines ``Y`` as the class distribution,
      so true labels.
    * ``I_EY_pred`` (only with ``predictions``) — the same with the model's PREDICTED class in place of
      ``Y``: the quantity the authors' code computed, reported beside ``I_EY`` for comparison with their
      tables.

    Args:
        gate_probs: ``(B, M)`` gate distribution p(e|x) of each sample (rows sum to 1).
        labels: ``(B,)`` int true classes in ``[0, num_classes)``.
        num_classes: K.
        predictions: optional ``(B,)`` int predicted classes in ``[0, num_classes)``.

    Returns:
        ``{"H_s", "H_u", "I_EY"}`` (and ``"I_EY_pred"`` with ``predictions``) as floats.
    """
    if gate_probs.dim() != 2 or labels.dim() != 1 or gate_probs.shape[0] != labels.shape[0]:
        raise ValueError(
            f"gate_probs of shape {tuple(gate_probs.shape)} and labels of shape {tuple(labels.shape)} are "
            "not allowed; expected (B, M) and (B,)"
        )
    if gate_probs.shape[0] == 0:
        raise ValueError("gate_probs is empty; expected at least one sample")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} is not allowed; expected a positive integer")
    p = gate_probs.detach().double()
    table = selection_table(p.argmax(dim=1), labels.detach(), p.shape[1], num_classes)
    out = {
        "H_s": float(entropy_bits(p).mean()),
        "H_u": float(entropy_bits(p.mean(dim=0))),
        "I_EY": float(mutual_information_bits(table)),
    }
    if predictions is not None:
        if predictions.shape != labels.shape:
            raise ValueError(
                f"predictions of shape {tuple(predictions.shape)} is not allowed; expected {tuple(labels.shape)}"
            )
        pred_table = selection_table(p.argmax(dim=1), predictions.detach(), p.shape[1], num_classes)
        out["I_EY_pred"] = float(mutual_information_bits(pred_table))
    return out


def plot_selection_table(
    table: Tensor,
    path: str | os.PathLike,
    class_names: list[str] | None = None,
    title: str = "",
) -> None:
    """Save the expert × class count table as an annotated heatmap PNG (like Krishnamurthy et al. (2023) Fig.
    2 and 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table.detach().cpu().numpy()
    m, k = t.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * k + 1.5), max(3.0, 0.45 * m + 1.2)))
    im = ax.imshow(t, cmap="viridis", aspect="auto")
    ax.set_xticks(
        range(k), class_names if class_names else [str(j) for j in range(k)], rotation=45, ha="right"
    )
    ax.set_yticks(range(m), [f"E{i}" for i in range(m)])
    ax.set_xlabel("class")
    ax.set_ylabel("expert")
    threshold = t.max() / 2 if t.size else 0
    for i in range(m):
        for j in range(k):
            ax.text(
                j,
                i,
                int(t[i, j]),
                ha="center",
                va="center",
                fontsize=7,
                color="k" if t[i, j] > threshold else "w",
            )
    fig.colorbar(im, ax=ax)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=100)
