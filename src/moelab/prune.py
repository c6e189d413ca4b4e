"""Expert pruning and merging: a trained model's MoE layers shrunk to fewer experts, as a model of
the same class that :func:`moelab.save` / :func:`moelab.load` and :func:`moelab.to_hf` handle as
any other.  The experts are scored on calibration batches (:func:`expert_statistics`: routed-token
counts, REAP saliency, the router-logit similarity of the experts), chosen per layer
(:func:`choose_experts`: REAP, frequency or random; :func:`merge_groups`: M-SMoE's dominant
experts and groups), and the model rebuilt with the kept experts (:func:`shrink`).  The formulas,
their sources and the measured effect: docs/methods.md ("Expert pruning and merging") and
docs/results.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .experts import ExpertBank
from .io.model import describe, rebuild
from .layer import MoE, attach, recording_routing
from .routing import RoutingContext
from .schedules import schedule_from_state

__all__ = [
    "EXPERT_COUNT_KEYS",
    "MERGE_METHODS",
    "PRUNE_METHODS",
    "ExpertStatistics",
    "choose_experts",
    "expert_statistics",
    "kept_count",
    "merge_coefficients",
    "merge_groups",
    "shrink",
]

#: how :func:`choose_experts` ranks the experts of a layer
PRUNE_METHODS = ("reap", "frequency", "random")
#: how :func:`merge_coefficients` weighs the experts of a group
MERGE_METHODS = ("average", "frequency")
#: the keys of a transformers config that hold the number of routed experts per layer
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class ExpertStatistics:
    """One layer's calibration statistics.

    Attributes:
        counts: ``(N,)`` float64, the (token, expert) slots routed to each expert (a token counts
            once per expert it is routed to; slots a capacity dropped or a variable-K router left
            empty do not count).
        reap: ``(N,)`` float64, REAP saliency: the mean over those slots of the gate weight times
            the L2 norm of the expert's output; 0 for an expert no token was routed to.
        logit_gram: ``(N, N)`` float64, ``Σ_t h_t h_tᵀ`` of the router logits ``h_t`` (the
            routed experts' columns), whose normalised entries are the cosine similarity of two
            experts' logits over the calibration tokens; ``None`` for a router without logits.
        tokens: the calibration tokens seen.
    """

    counts: Tensor
    reap: Tensor
    logit_gram: Tensor | None
    tokens: int


def _moe_paths(model: nn.Module) -> dict[str, MoE]:
    layers = {path: m for path, m in model.named_modules() if isinstance(m, MoE)}
    if not layers:
        raise ValueError(f"model of type {type(model).__name__} holds no moelab MoE layer; nothing to prune")
    return layers


@torch.no_grad()
def expert_statistics(model: nn.Module, batches: Iterable[Tensor]) -> dict[str, ExpertStatistics]:
    """Run ``model`` on each batch of token ids (evaluation mode, no gradients) and gather, per MoE
    layer (by its module path), the :class:`ExpertStatistics` of the tokens it routed.

    REAP (Lasby et al., "REAP the Experts: Why Pruning Prevails for One-Shot MoE compression", ICLR 2026; the code of
    CerebrasResearch/reap, ``pruning_metrics.update_pruning_state``): the saliency of expert ``e``
    is ``mean over the tokens routed to e of g_e(x) · ‖E_e(x)‖₂``, ``E_e(x)`` the expert's output
    before weighting and ``g_e(x)`` the weight the layer gives it (REAP's code: the softmax weight,
    renormalised over the chosen K when the model renormalises: the weight the layer applies); an
    expert no token is routed to scores 0, as there.  Each expert runs on the tokens routed to it
    (REAP's code runs every expert on every token and reads the routed ones); nothing loops over
    tokens.
    """
    layers = _moe_paths(model)
    for path, layer in layers.items():
        if not isinstance(layer.experts, ExpertBank):
            raise ValueError(
                f"{path or 'the layer'} has experts of type {type(layer.experts).__name__}; expected an "
                "ExpertBank (stacked MLP experts), the bank whose experts can be removed"
            )
    inputs: dict[str, Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args, kw, p=path: inputs.__setitem__(p, args[0]), with_kwargs=True
        )
        for path, layer in layers.items()
    ]
    sums: dict[str, dict[str, Any]] = {}
    was_training = model.training
    model.eval()
    try:
        with recording_routing(model):
            for batch in batches:
                model(batch)
                for path, layer in layers.items():
                    _accumulate(sums.setdefault(path, {}), layer, inputs.pop(path), layer.last_routing)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    if not sums:
        raise ValueError("batches is empty; expected at least one batch of calibration tokens")
    out = {}
    for path, s in sums.items():
        counts = s["counts"]
        reap = torch.where(counts > 0, s["reap"] / counts.clamp(min=1), torch.zeros_like(counts))
        out[path] = ExpertStatistics(counts=counts, reap=reap, logit_gram=s.get("gram"), tokens=s["tokens"])
    return out


def _accumulate(s: dict[str, Any], layer: MoE, x: Tensor, routing: Any) -> None:
    """Add one batch's slots of ``layer`` to the running sums ``s``."""
    n = layer.experts.num_experts
    x = x.reshape(-1, x.shape[-1])
    idx = routing.indices  # (T, K); a zero-computation expert (MoE++) has an index >= N
    active = idx < n
    if routing.mask is not None:
        active = active & routing.mask
    if routing.keep is not None:
        active = active & routing.keep
    chosen = idx[active]  # the routed slots, flat
    token = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)[active]
    gate = routing.weights.double()[active]
    order = chosen.argsort(stable=True)
    sizes = torch.bincount(chosen, minlength=n)
    saliency = torch.zeros(n, dtype=torch.float64, device=x.device)
    # each expert on its own routed tokens (a loop over experts, as the dispatch): Σ g · ‖E_e(x)‖₂
    parts = zip(token[order].split(sizes.tolist()), gate[order].split(sizes.tolist()), strict=True)
    for e, (rows, g) in enumerate(parts):
        if rows.numel():
            saliency[e] = (g * layer.experts.expert_forward(x[rows], e).double().norm(dim=-1)).sum()
    s["counts"] = s.get("counts", 0) + sizes.double()
    s["reap"] = s.get("reap", 0) + saliency
    s["tokens"] = s.get("tokens", 0) + x.shape[0]
    if routing.logits is not None and "nogram" not in s:
        h = routing.logits[:, :n].double()
        s["gram"] = s.get("gram", 0) + h.T @ h
    else:
        s["nogram"] = True
        s.pop("gram", None)


def kept_count(num_experts: int, keep: float) -> int:
    """The experts a layer of ``num_experts`` keeps at the fraction ``keep``: ``round(keep · N)``
    (halves up), refused below one expert."""
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
        raise ValueError(f"keep={keep!r} is not allowed; expected a fraction of the experts in (0, 1]")
    n = math.floor(keep * num_experts + 0.5)
    if n < 1:
        raise ValueError(
            f"keep={keep!r} is not allowed for num_experts={num_experts}; it keeps no expert (at least "
            f"{1 / num_experts:.4g})"
        )
    return n


def _top(score: Tensor, n: int) -> Tensor:
    """The ``n`` highest-scoring experts (ties: the lower index), in increasing index order."""
    order = torch.sort(score.double(), descending=True, stable=True).indices
    return order[:n].sort().values


def choose_experts(
    stats: dict[str, ExpertStatistics] | None,
    method: str,
    keep: float,
    *,
    num_experts: dict[str, int] | None = None,
    seed: int = 0,
) -> dict[str, Tensor]:
    """The experts each layer keeps: the ``kept_count(N, keep)`` with the highest REAP saliency
    (``reap``) or routed-token count (``frequency``), or a uniformly random set (``random``, drawn
    from ``seed``; it needs no statistics, only ``num_experts`` per layer).  REAP prunes the
    lowest-scoring experts of every layer at the same rate (its ``prune.py``)."""
    if method not in PRUNE_METHODS:
        raise ValueError(f"method={method!r} is not allowed; expected one of {list(PRUNE_METHODS)}")
    if method == "random":
        sizes = (
            num_experts
            if num_experts is not None
            else {p: s.counts.numel() for p, s in (stats or {}).items()}
        )
        gen = torch.Generator().manual_seed(seed)
        return {
            p: torch.randperm(n, generator=gen)[: kept_count(n, keep)].sort().values for p, n in sizes.items()
        }
    if stats is None:
        raise ValueError(
            f"method={method!r} needs calibration statistics; expected stats from expert_statistics"
        )
    return {
        p: _top(s.reap if method == "reap" else s.counts, kept_count(s.counts.numel(), keep))
        for p, s in stats.items()
    }


def merge_groups(stats: dict[str, ExpertStatistics], keep: float) -> dict[str, tuple[Tensor, Tensor]]:
    """M-SMoE's grouping (Li et al., "Merge, Then Compress: Demystify Efficient SMoE with Hints from
    Its Routing Policy", ICLR 2024): per layer, the ``kept_count(N, keep)`` most frequently routed
    experts are the dominant ones; every other expert joins the dominant expert whose router
    logits over the calibration tokens are the most similar (cosine similarity of the two experts'
    logit columns; ties: the lower index).  Per layer ``(dominant (n,), group (N,))``, ``group[e]``
    the position in ``dominant`` of the group expert ``e`` joins (a dominant expert heads its own).

    Unlike M-SMoE, which keeps all N router outputs and points a group's outputs at one merged
    expert, the merged layer keeps the dominant experts' router rows only (one row per expert, as
    every moelab layer): a token whose chosen experts were all dominant routes as before; one that
    chose a merged expert now takes the next dominant expert by its score.
    """
    out = {}
    for p, s in stats.items():
        if s.logit_gram is None:
            raise ValueError(
                f"{p or 'the layer'} has a router without logits; merging groups the experts by their router logits"
            )
        n_experts = s.counts.numel()
        dominant = _top(s.counts, kept_count(n_experts, keep))
        norm = s.logit_gram.diagonal().clamp(min=1e-300).sqrt()
        similarity = s.logit_gram / (norm[:, None] * norm[None, :])
        group = similarity[:, dominant].argmax(dim=1)  # first maximum: the lower index
        group[dominant] = torch.arange(dominant.numel())
        out[p] = (dominant, group)
    return out


def merge_coefficients(group: Tensor, counts: Tensor, method: str) -> Tensor:
    """``C (n, N)``: row ``g`` the weights of the experts of group ``g`` in its merged expert
    (zero outside the group, summing to 1).  ``average``: uniform, ``1 / |g|``; ``frequency``: each
    expert's routed-token count over its group's (M-SMoE's frequency-weighted averaging; a group no
    token was routed to: uniform)."""
    if method not in MERGE_METHODS:
        raise ValueError(f"method={method!r} is not allowed; expected one of {list(MERGE_METHODS)}")
    n = int(group.max()) + 1
    member = torch.zeros(n, group.numel(), dtype=torch.float64)
    member[group, torch.arange(group.numel())] = 1.0
    weight = member if method == "average" else member * counts.double()[None, :]
    total = weight.sum(dim=1, keepdim=True)
    weight = torch.where(total > 0, weight, member)  # a group with no routed token: uniform
    return weight / weight.sum(dim=1, keepdim=True)


#: the stacked per-expert tensors of an ExpertBank (every one has the experts as its first dimension)
_BANK_TENSORS = ("w_in", "w_out", "b_in", "b_out", "gate_down", "gate_up")


def _check_layer(path: str, layer: MoE, kept: int) -> None:
    where = path or "the layer"
    if type(layer.experts) is not ExpertBank:
        raise ValueError(
            f"{where} has experts of type {type(layer.experts).__name__}; expected an ExpertBank (stacked "
            "MLP experts), the bank whose experts can be removed"
        )
    if layer.config.top_k > kept:
        raise ValueError(
            f"keep leaves {kept} experts in {where}, fewer than its top_k={layer.config.top_k}; expected at "
            f"least top_k experts kept"
        )
    problem = layer.router.removal_problem(kept)
    if problem is not None:
        raise ValueError(f"{where} (method={layer.method!r}) cannot lose experts: {problem}")


def _shrunk_config(
    model: nn.Module, old: int, new: int, pinned: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The kind and constructor config of ``model`` with ``new`` experts per MoE layer, the router
    options in ``pinned`` (:meth:`moelab.routers.Router.kept_options`) set."""
    kind, config = describe(model)
    config = dict(config or {})
    for key in ("method_options", "options"):  # a language model's, a bare layer's
        if key in config and pinned:
            config[key] = {**config[key], **pinned}
    if kind == "transformers":
        tc = dict(config["transformers_config"])
        subs = {
            k: dict(v)
            for k, v in tc.items()
            if isinstance(v, dict) and any(c in v for c in EXPERT_COUNT_KEYS)
        }
        found = False
        for d in (tc, *subs.values()):
            for key in EXPERT_COUNT_KEYS:
                if d.get(key) == old:
                    d[key], found = new, True
        if not found:
            raise ValueError(
                f"the transformers config of {config['model_class']} holds none of {list(EXPERT_COUNT_KEYS)} "
                f"equal to its {old} experts; cannot rebuild it with fewer"
            )
        config["transformers_config"] = {**tc, **subs}
    elif config.get("num_experts") == old:
        config["num_experts"] = new
    else:
        raise ValueError(
            f"model of kind {kind!r} is not allowed; expected a moelab language model, a moelab.MoE or a "
            "transformers model converted with moelab.from_hf"
        )
    return kind, config


def shrink(
    model: nn.Module,
    keep: dict[str, Tensor],
    coefficients: dict[str, Tensor] | None = None,
) -> nn.Module:
    """A new model of ``model``'s class whose MoE layer at each path of ``keep`` holds the experts
    ``keep[path]`` only (their router rows, selection bias and every per-expert state of the
    router, :meth:`moelab.routers.Router.kept_state`; the shared experts and everything else as
    they are).  With ``coefficients[path]`` ``(n, N)`` (:func:`merge_coefficients`), kept expert
    ``g`` is instead ``Σ_e C[g, e] · expert_e``, tensor by tensor (merging); the router rows stay
    the kept experts'.

    The model is rebuilt from its own config with the new number of experts (what
    :func:`moelab.load` of the saved result builds), its routing context carried over.  Refused
    in one line: a layer left with fewer experts than its top_k, a router whose rule reads every
    expert (:meth:`moelab.routers.Router.removal_problem`), a bank other than an ExpertBank, a
    layer missing from ``keep`` or layers kept at different sizes.
    """
    layers = _moe_paths(model)
    missing = sorted(set(layers) - set(keep))
    extra = sorted(set(keep) - set(layers))
    if missing or extra:
        raise ValueError(
            f"keep names layers {extra[:3]} that are not MoE layers and misses {missing[:3]}; expected "
            "every MoE layer's path"
        )
    sizes = {p: int(k.numel()) for p, k in keep.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"keep={sizes} is not allowed; expected the same number of experts in every layer")
    olds = {layer.config.num_experts for layer in layers.values()}
    if len(olds) != 1:
        raise ValueError(
            f"the MoE layers have {sorted(olds)} experts; expected the same number in every layer"
        )
    old, new = olds.pop(), next(iter(sizes.values()))
    for path, layer in layers.items():
        k = keep[path]
        if (
            k.dtype != torch.int64
            or k.dim() != 1
            or k.unique().numel() != k.numel()
            or int(k.min()) < 0
            or int(k.max()) >= old
        ):
            raise ValueError(
                f"keep[{path!r}]={k.tolist()} is not allowed; expected distinct int64 expert indices in [0, {old})"
            )
        _check_layer(path, layer, new)
        c = None if coefficients is None else coefficients.get(path)
        if c is not None and tuple(c.shape) != (new, old):
            raise ValueError(f"coefficients[{path!r}] has shape {tuple(c.shape)}; expected ({new}, {old})")
    pinned: dict[str, Any] = {}
    for layer in layers.values():
        pinned.update(layer.router.kept_options())
    kind, config = _shrunk_config(model, old, new, pinned)
    state = model.state_dict()
    for path, layer in layers.items():
        pre = f"{path}." if path else ""
        rows = keep[path]
        router = {k[len(pre) + 7 :]: v for k, v in state.items() if k.startswith(f"{pre}router.")}
        for k, v in layer.router.kept_state(router, rows).items():
            state[f"{pre}router.{k}"] = v
        c = None if coefficients is None else coefficients.get(path)
        for name in _BANK_TENSORS:
            key = f"{pre}experts.{name}"
            if key in state:
                t = state[key]
                if c is None:
                    state[key] = t.index_select(0, rows.to(t.device))
                else:
                    merged = torch.einsum("gn,n...->g...", c.to(torch.float64), t.double())
                    state[key] = merged.to(t.dtype)
    shrunk = rebuild(kind, config)
    with torch.no_grad():  # each tensor in its source's dtype (mixed dtypes stay mixed)
        for name, t in [*shrunk.named_parameters(), *shrunk.named_buffers()]:
            src = state.get(name)
            if src is not None and src.dtype != t.dtype:
                t.data = t.data.to(src.dtype)
    shrunk.load_state_dict(state, strict=True)
    _carry_context(model, shrunk)
    return shrunk.train(model.training)


def _carry_context(model: nn.Module, shrunk: nn.Module) -> None:
    """Attach to ``shrunk`` a routing context at the step of ``model``'s (StableMoE's stage,
    SMoE-Dropout's K and the schedules read it)."""
    ctx = next((m.ctx for m in model.modules() if isinstance(m, MoE) and m.ctx is not None), None)
    if ctx is None:
        return
    state = ctx.state_dict()
    fresh = RoutingContext(
        total_steps=state.get("total_steps"), schedule=schedule_from_state(state.get("schedule"))
    )
    fresh.load_state_dict(state)
    attach(shrunk, fresh)
