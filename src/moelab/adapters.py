"""LoRA and RepLoRA adapters on chosen ``nn.Linear`` layers, merged back into plain weights for inference.

LoRA (Hu et al. 2021; Ho (2025) "LoRA on pretrained Transformers"): a frozen ``W₀ ∈ R^{m×n}`` gets a
trainable low-rank update, ``y = W₀ x + b + (α/r) B A x`` with ``A ∈ R^{r×n}`` (Kaiming-uniform, as
Hu et al.'s code) and ``B ∈ R^{m×r}`` (zeros, so training starts from the pretrained model); dropout,
when set, acts on the input of the update only.

RepLoRA (Ho (2025); Truong et al., "RepLoRA", ICML 2025): Ho (2025) reads each row of attention with LoRA
on ``W_Q`` and ``W_V`` as a mixture of linear experts with quadratic gating whose parameters
``B_Q, A_Q, B_V, A_V``, estimated separately, need exponentially many samples; RepLoRA shares one
reparameterisation, ``A_Q = A_V = φ₁(A)`` and ``B_Q = B_V = φ₂(B)`` with two-layer MLPs φ₁, φ₂ and
diagonal shared matrices (the slides' words).  Here, per group (the adapted layers of one attention
module; a group must share its shapes): ``A = diag(a)``, ``B = diag(b)`` (``a, b ∈ R^r``), the rows of
``φ₁(A) ∈ R^{r×n}`` are ``φ₁(A_i) = W₂ GELU(W₁ A_i + c₁) + c₂`` and the columns of
``φ₂(B) ∈ R^{m×r}`` are ``φ₂(B_j)`` alike, hidden width ``hidden`` (default ``max(4r, 32)``).  What
the slides leave open is our choice: GELU (a "sufficiently non-linear" activation of Ho (2025)), the
hidden width, ``a = b = 1`` at start, and φ₂'s output layer at zero so that, like LoRA's ``B``, the
update starts at zero.  The authors' code was not found (the ICML 2025 reproducibility listing records
no released code), so nothing here follows it.

Expert banks and routers (:class:`AdaptedWeight`): every expert's gate, up and down projection of an
:class:`moelab.ExpertBank` (``<bank>.gate``, ``<bank>.up``, ``<bank>.down``: row ranges of its stacked
``w_in (N, 2h, d)`` and ``w_out (N, d, h)``) and a router's ``(N, d)`` weight (``<router>``) get
``W_e ← W_e + (α/r) B_e A_e``, one pair per expert or one shared by all (``share_experts``), folded
into the weight the kernels read, as PEFT's ``target_parameters`` does.  RepLoRA on a bank gives each
expert its own ``a_e, b_e`` and one φ₁, φ₂ for the experts of a projection: the experts are the
mixture whose shared reparameterisation Ho (2025) argues for.  :func:`moelab.hf.lora.export_peft`
writes such an adapter of a :func:`moelab.from_hf` model in PEFT's layout.

Targets are module names matched by :func:`fnmatch.fnmatch` patterns.  moelab's own language models fuse
Q, K and V in one ``qkv`` projection; its thirds are addressed as ``<name>.q``, ``<name>.k`` and
``<name>.v``.  The default targets are Q and V: ``*.attn.qkv.q``, ``*.attn.qkv.v`` (moelab) and
``*q_proj``, ``*v_proj``, ``*.query``, ``*.value`` (transformers).

    names = moelab.adapters.add_adapter(model, "replora", rank=8)   # freezes everything else
    ...train...
    moelab.adapters.save_adapter(model, "task.safetensors")          # the adapter alone
    moelab.adapters.load_adapter(fresh_model, "task.safetensors")
    moelab.adapters.merge_adapter(model)                             # plain nn.Linear again
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import _validate
from .experts.bank import ExpertBank
from .functional import GATED_ACTIVATIONS
from .routers.base import Router

__all__ = [
    "ADAPTERS",
    "DEFAULT_TARGETS",
    "TARGET_GROUPS",
    "AdaptedLinear",
    "AdaptedWeight",
    "LoRAFactors",
    "RepLoRAFactors",
    "adapted_linears",
    "adapted_weights",
    "adapter_config",
    "adapter_parameters",
    "add_adapter",
    "base_structure",
    "load_adapter",
    "merge_adapter",
    "restore_adapter",
    "save_adapter",
]

ADAPTERS = ("lora", "replora")
DEFAULT_TARGETS = ("*.attn.qkv.q", "*.attn.qkv.v", "*q_proj", "*v_proj", "*.query", "*.value")
#: the target patterns of ``moelab finetune --targets``' groups: attention (Q and V), every expert's
#: gate / up / down projection, the routers' weights
TARGET_GROUPS = {
    "attention": DEFAULT_TARGETS,
    "experts": tuple(f"{w}experts.{part}" for part in ("gate", "up", "down") for w in ("", "*.")),
    "router": ("router", "*.router"),
}
_CONFIG_ATTR = "_moelab_adapter"
_METADATA_KEY = "moelab_adapter"
#: the metadata key of the base model's structure (parameter names and shapes) in an adapter file
_BASE_KEY = "moelab_adapter_base"


class LoRAFactors(nn.Module):
    """LoRA's ``A (r, n)`` and ``B (m, r)``; ``B`` starts at zero.  With ``num_experts=E`` one pair
    per expert: ``A (E, r, n)``, ``B (E, m, r)``, each expert's ``A`` initialised as a layer's."""

    def __init__(
        self, in_features: int, out_features: int, rank: int, num_experts: int | None = None
    ) -> None:
        super().__init__()
        lead = () if num_experts is None else (num_experts,)
        self.A = nn.Parameter(torch.empty(*lead, rank, in_features))
        self.B = nn.Parameter(torch.zeros(*lead, out_features, rank))
        with torch.no_grad():  # Kaiming-uniform with fan-in n, per expert as per layer
            nn.init.kaiming_uniform_(self.A.view(-1, in_features), a=math.sqrt(5))

    def factors(self) -> tuple[Tensor, Tensor]:
        return self.A, self.B


class RepLoRAFactors(nn.Module):
    """RepLoRA's ``(φ₁(A), φ₂(B))`` from the diagonal shared matrices ``A = diag(a)``, ``B = diag(b)``.

    With ``num_experts=E`` every expert ``e`` has its own ``a_e, b_e`` and all share φ₁, φ₂ (the
    shared reparameterisation of Ho (2025) across the experts of one projection):
    ``A (E, r, n)``, ``B (E, m, r)``."""

    def __init__(
        self, in_features: int, out_features: int, rank: int, hidden: int, num_experts: int | None = None
    ) -> None:
        super().__init__()
        lead = () if num_experts is None else (num_experts,)
        self.a = nn.Parameter(torch.ones(*lead, rank))
        self.b = nn.Parameter(torch.ones(*lead, rank))
        self.phi1 = nn.Sequential(nn.Linear(rank, hidden), nn.GELU(), nn.Linear(hidden, in_features))
        self.phi2 = nn.Sequential(nn.Linear(rank, hidden), nn.GELU(), nn.Linear(hidden, out_features))
        nn.init.zeros_(self.phi2[2].weight)  # φ₂(B) = 0 at start: the update starts at zero, as LoRA's
        nn.init.zeros_(self.phi2[2].bias)

    def factors(self) -> tuple[Tensor, Tensor]:
        A = self.phi1(torch.diag_embed(self.a))  # (.., r, n): row i is φ₁ of row i of A
        # (.., m, r): column j is φ₂ of column j of B
        B = self.phi2(torch.diag_embed(self.b)).transpose(-1, -2)
        return A, B


class AdaptedLinear(nn.Module):
    """A frozen ``nn.Linear`` plus low-rank updates on row ranges of its output (the whole output, or
    thirds of a fused ``qkv``): ``y = base(x) + scale · [.. B A dropout(x) ..]``."""

    def __init__(
        self,
        base: nn.Linear,
        slices: list[tuple[int, int]],
        factors: list[nn.Module],
        scale: float,
        dropout: float,
    ) -> None:
        super().__init__()
        self.base = base
        self.slices = [tuple(s) for s in slices]
        self.factors = nn.ModuleList(factors)  # a RepLoRA group's module is shared with its other layers
        self.scale = scale
        self.dropout = nn.Dropout(dropout)

    @property
    def weight(self) -> Tensor:  # what code that reads ``.weight`` of the projection expects
        return self.base.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base.bias

    def delta_weight(self) -> Tensor:
        """``ΔW (out, in)``: the update as a dense matrix (zeros outside the adapted rows)."""
        rows = []
        n = self.base.in_features
        pos = 0
        w = self.base.weight
        for (start, stop), f in sorted(zip(self.slices, self.factors), key=lambda t: t[0][0]):
            if start > pos:
                rows.append(w.new_zeros(start - pos, n))
            A, B = f.factors()
            rows.append(self.scale * (B @ A).to(w.dtype))
            pos = stop
        if pos < self.base.out_features:
            rows.append(w.new_zeros(self.base.out_features - pos, n))
        return torch.cat(rows, 0)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        h = self.dropout(x)
        pieces = []
        pos = 0
        for (start, stop), f in sorted(zip(self.slices, self.factors), key=lambda t: t[0][0]):
            if start > pos:
                pieces.append(y.new_zeros(*y.shape[:-1], start - pos))
            A, B = f.factors()
            pieces.append(F.linear(F.linear(h, A.to(h.dtype)), B.to(h.dtype)) * self.scale)
            pos = stop
        if pos < y.shape[-1]:
            pieces.append(y.new_zeros(*y.shape[:-1], y.shape[-1] - pos))
        return y + torch.cat(pieces, -1)


class AdaptedWeight(nn.Module):
    """The parametrization (:mod:`torch.nn.utils.parametrize`) of an expert bank's stacked weight
    ``(N, m, n)`` or a router's ``(N, d)`` weight: ``W ↦ W + scale · [.. B A ..]`` on row ranges of
    each matrix (the gate rows ``[0, h)`` and up rows ``[h, 2h)`` of a SwiGLU bank's ``w_in``).

    The update is folded into the weight that every reader (each kernel of the bank, the router's
    logits) takes, as PEFT's ``target_parameters`` does: the kernels run unchanged and the
    gradient reaches ``A`` and ``B`` through the sum; the price is one ``(N, m, n)`` tensor a
    forward, and no dropout on the update's input (it has none of its own).  Per-expert factors
    (``A (N, r, n)``, ``B (N, m, r)``) give each expert its own update; shared ones (``A (r, n)``,
    ``B (m, r)``) add one update to every expert."""

    def __init__(self, slices: list[tuple[int, int]], factors: list[nn.Module], scale: float) -> None:
        super().__init__()
        self.slices = [tuple(s) for s in slices]
        self.factors = nn.ModuleList(factors)
        self.scale = scale

    def delta(self, weight: Tensor) -> Tensor:
        """``ΔW``, the shape of ``weight`` (zeros outside the adapted rows)."""
        lead, rows, n = weight.shape[:-2], weight.shape[-2], weight.shape[-1]
        pieces = []
        pos = 0
        for (start, stop), f in sorted(zip(self.slices, self.factors), key=lambda t: t[0][0]):
            if start > pos:
                pieces.append(weight.new_zeros(*lead, start - pos, n))
            A, B = f.factors()
            pieces.append((self.scale * (B @ A).to(weight.dtype)).expand(*lead, stop - start, n))
            pos = stop
        if pos < rows:
            pieces.append(weight.new_zeros(*lead, rows - pos, n))
        return torch.cat(pieces, -2) if len(pieces) > 1 else pieces[0]

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.delta(weight)


def _candidates(model: nn.Module) -> list[tuple[str, str, nn.Linear, tuple[int, int]]]:
    """``(target name, module name, linear, (start, stop))`` of every addressable projection."""
    out = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        out.append((name, name, module, (0, module.out_features)))
        # moelab's fused attention projection: Q, K, V are thirds of its output
        if name.rsplit(".", 1)[-1] == "qkv" and module.out_features == 3 * module.in_features:
            d = module.in_features
            for i, part in enumerate("qkv"):
                out.append((f"{name}.{part}", name, module, (i * d, (i + 1) * d)))
    return out


def _param_candidates(
    model: nn.Module,
) -> list[tuple[str, str, nn.Module, str, tuple[int, int], int | None]]:
    """``(target name, owner name, owner, tensor name, (start, stop), experts)`` of every expert
    projection and router weight: ``<bank>.gate`` / ``<bank>.up`` / ``<bank>.down`` of an
    :class:`~moelab.ExpertBank` (rows of its stacked ``w_in`` / ``w_out``, ``experts`` = N; a bank
    without a gate, not SwiGLU, has ``up`` and ``down``) and ``<router>`` for a router's ``(N, d)``
    weight (``experts`` = ``None``)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, ExpertBank):
            n, h = m.num_experts, m.d_hidden
            ins = {"gate": (0, h), "up": (h, 2 * h)} if m.activation in GATED_ACTIVATIONS else {"up": (0, h)}
            for part, rows in ins.items():
                out.append((_join(name, part), name, m, "w_in", rows, n))
            out.append((_join(name, "down"), name, m, "w_out", (0, m.d_model), n))
        elif (
            isinstance(m, Router)
            and isinstance(getattr(m, "weight", None), nn.Parameter)
            and m.weight.dim() == 2
        ):
            out.append((name, name, m, "weight", (0, m.weight.shape[0]), None))
    return out


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def adapted_weights(model: nn.Module) -> list[tuple[str, nn.Module, str, AdaptedWeight]]:
    """``(owner name, owner, tensor name, parametrization)`` of every adapted expert or router weight."""
    out = []
    for name, m in model.named_modules():
        if parametrize.is_parametrized(m):
            for tensor, plist in m.parametrizations.items():
                out.extend((name, m, tensor, f) for f in plist if isinstance(f, AdaptedWeight))
    return out


def adapter_config(model: nn.Module) -> dict[str, Any] | None:
    """The settings of the adapter on ``model`` (``None`` if it has none)."""
    cfg = getattr(model, _CONFIG_ATTR, None)
    return dict(cfg) if cfg is not None else None


def add_adapter(
    model: nn.Module,
    kind: str = "lora",
    rank: int = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: Sequence[str] | None = None,
    hidden: int | None = None,
    freeze: bool = True,
    share_experts: bool = False,
) -> list[str]:
    """Wrap the layers of ``model`` named by ``targets`` with a LoRA or RepLoRA update, in place.

    Args:
        model: any module; its matching ``nn.Linear`` layers are replaced by :class:`AdaptedLinear`,
            its matching expert projections and router weights get an :class:`AdaptedWeight`
            parametrization.
        kind: ``lora`` or ``replora``.
        rank: ``r``.
        alpha: the update is scaled by ``alpha / rank`` (default ``alpha = rank``: scale 1).
        dropout: dropout on the update's input (LoRA dropout; ``nn.Linear`` targets only).
        targets: :func:`fnmatch.fnmatch` patterns of target names (default :data:`DEFAULT_TARGETS`:
            Q and V of attention); a fused ``qkv`` projection's thirds are ``<name>.q/.k/.v``, an
            expert bank's projections ``<bank>.gate``, ``<bank>.up``, ``<bank>.down`` (every
            expert's), a router's weight the router's own name (:data:`TARGET_GROUPS`).
        hidden: RepLoRA's MLP width (default ``max(4 r, 32)``).
        freeze: stop gradients to every parameter of ``model`` that is not the adapter's.
        share_experts: one update shared by all experts of a projection instead of one per
            expert (RepLoRA: shared ``a, b``; per expert, each expert has its own ``a_e, b_e`` and
            they share φ₁, φ₂).

    Returns:
        the adapted target names, in module order (``nn.Linear`` targets first).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
    _validate.one_of("kind", kind, ADAPTERS)
    _validate.positive_int("rank", rank)
    alpha = float(rank) if alpha is None else _validate.positive("alpha", alpha)
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1):
        raise ValueError(f"dropout={dropout!r} is not allowed; expected a number in [0, 1)")
    if not isinstance(share_experts, bool):
        raise ValueError(f"share_experts={share_experts!r} is not allowed; expected True or False")
    hidden = max(4 * rank, 32) if hidden is None else _validate.positive_int("hidden", hidden)
    if kind == "lora" and hidden != max(4 * rank, 32):
        raise ValueError(f"hidden={hidden!r} is not allowed with kind='lora'; it is RepLoRA's MLP width")
    if getattr(model, _CONFIG_ATTR, None) is not None:
        raise ValueError("model already holds an adapter; merge_adapter(model) first or use a fresh model")
    if any(isinstance(m, (AdaptedLinear, AdaptedWeight)) for m in model.modules()):
        raise ValueError("model already holds adapted layers; merge_adapter(model) first")
    patterns = list(DEFAULT_TARGETS if targets is None else targets)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"targets={targets!r} is not allowed; expected a non-empty list of name patterns")
    chosen = [c for c in _candidates(model) if any(fnmatch(c[0], p) for p in patterns)]
    params = [c for c in _param_candidates(model) if any(fnmatch(c[0], p) for p in patterns)]
    if not chosen and not params:
        raise ValueError(
            f"targets={patterns!r} match no nn.Linear, expert projection or router of {type(model).__name__} "
            "(a fused moelab qkv projection's thirds are '<name>.q', '<name>.k', '<name>.v'; an expert "
            "bank's projections '<bank>.gate', '<bank>.up', '<bank>.down'; a router its own name)"
        )
    for target, _, owner, tensor, _, _ in params:
        if isinstance(owner, ExpertBank) and owner.gate_rank is not None:
            raise ValueError(
                f"target {target!r} is not allowed: its bank's gate projections are Autonomy-of-Experts' "
                f"low-rank factors (gate_rank={owner.gate_rank}); expected a bank with full-rank experts"
            )
        if parametrize.is_parametrized(owner, tensor):
            raise ValueError(f"target {target!r} is not allowed: its {tensor} is already parametrized")
    if params and dropout:
        raise ValueError(
            f"dropout={dropout!r} is not allowed with targets {[t[0] for t in params]}: an expert or router "
            "update is folded into the weight (as PEFT's target_parameters), which has no input of its own to "
            "drop; expected dropout=0"
        )
    by_module: dict[str, list[tuple[str, nn.Linear, tuple[int, int]]]] = {}
    for target, mod_name, linear, rows in chosen:
        by_module.setdefault(mod_name, []).append((target, linear, rows))
    for parts in by_module.values():
        whole = [t for t, _, rows in parts if rows == (0, parts[0][1].out_features)]
        if whole and len(parts) > 1:
            raise ValueError(
                f"targets={patterns!r} match both {whole[0]!r} and parts of it ({[t for t, _, _ in parts]}); "
                "choose one"
            )

    # RepLoRA groups: the adapted projections of one parent module (Q and V of one attention) share
    # one reparameterisation, so they must share a shape; checked before anything changes
    def group_of(target: str, mod_name: str) -> str:
        return target.rsplit(".", 2)[0] if target != mod_name else mod_name.rpartition(".")[0]

    if kind == "replora":
        shapes: dict[str, tuple[int, int]] = {}
        for mod_name, parts in by_module.items():
            for target, linear, (start, stop) in parts:
                shape = (stop - start, linear.in_features)
                group = group_of(target, mod_name)
                if shapes.setdefault(group, shape) != shape:
                    raise ValueError(
                        f"target {target!r} ({shape[0]}x{shape[1]}) cannot share RepLoRA's reparameterisation "
                        f"with the other targets of {group or 'the model'!r} ({shapes[group][0]}x"
                        f"{shapes[group][1]}); choose targets of one shape"
                    )
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    groups: dict[str, RepLoRAFactors] = {}
    names = []
    for mod_name, parts in by_module.items():
        linear = parts[0][1]
        factors: list[nn.Module] = []
        for target, _, (start, stop) in parts:
            m, n = stop - start, linear.in_features
            if kind == "lora":
                f: nn.Module = LoRAFactors(n, m, rank)
            else:
                group = group_of(target, mod_name)
                if group not in groups:
                    groups[group] = RepLoRAFactors(n, m, rank, hidden)
                f = groups[group]
            factors.append(f.to(device=linear.weight.device, dtype=linear.weight.dtype))
            names.append(target)
        adapted = AdaptedLinear(linear, [rows for _, _, rows in parts], factors, alpha / rank, dropout)
        adapted.train(linear.training)  # a model in eval mode stays there (no dropout)
        parent_name, _, attr = mod_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, adapted)
    # expert projections and router weights: one parametrization per tensor, one factor pair per
    # target (a RepLoRA group is the experts of one projection: they share φ₁, φ₂)
    by_tensor: dict[tuple[str, str], list[tuple[str, nn.Module, tuple[int, int], int | None]]] = {}
    for target, owner_name, owner, tensor, rows, experts in params:
        by_tensor.setdefault((owner_name, tensor), []).append((target, owner, rows, experts))
    for (_, tensor), parts in by_tensor.items():
        owner = parts[0][1]
        weight = getattr(owner, tensor)
        factors = []
        for target, _, (start, stop), experts in parts:
            m, n = stop - start, weight.shape[-1]
            lead = None if share_experts else experts
            if kind == "lora":
                f = LoRAFactors(n, m, rank, num_experts=lead)
            else:
                f = RepLoRAFactors(n, m, rank, hidden, num_experts=lead)
            factors.append(f.to(device=weight.device, dtype=weight.dtype))
            names.append(target)
        adapted_w = AdaptedWeight([rows for _, _, rows, _ in parts], factors, alpha / rank)
        parametrize.register_parametrization(owner, tensor, adapted_w)
    for p in adapter_parameters(model).values():
        p.requires_grad_(True)
    config = {
        "kind": kind,
        "rank": rank,
        "alpha": alpha,
        "dropout": dropout,
        "hidden": hidden,
        "targets": names,
    }
    if share_experts:  # recorded only when set: files of plain adapters stay as they were
        config["share_experts"] = True
    object.__setattr__(model, _CONFIG_ATTR, config)
    return names


def adapted_linears(model: nn.Module) -> list[tuple[str, AdaptedLinear]]:
    """``(name, layer)`` of every adapted ``nn.Linear`` of ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AdaptedLinear)]


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter's trainable parameters by name (a shared RepLoRA module once)."""
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, layer in adapted_linears(model):
        for pname, p in layer.factors.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[f"{name}.factors.{pname}"] = p
    for owner, _, tensor, adapted in adapted_weights(model):  # the names model.named_parameters() gives
        for pname, p in adapted.factors.named_parameters():
            out[_join(owner, f"parametrizations.{tensor}.0.factors.{pname}")] = p
    return out


def merge_adapter(model: nn.Module) -> nn.Module:
    """Fold every update into its base weight (``W ← W + (α/r) B A``) and put the plain
    ``nn.Linear`` layers back; returns ``model``.  The merged model computes the same function
    (dropout aside), saves and loads as a model without adapter (:func:`moelab.save`), and its
    parameters' ``requires_grad`` is left as it was.  An adapted expert or router weight becomes
    the very tensor its forward computed (``W + ΔW``, bit for bit), in the same ``nn.Parameter``."""
    layers = adapted_linears(model)
    weights = adapted_weights(model)
    if not layers and not weights:
        raise ValueError(f"model of type {type(model).__name__} holds no adapter; nothing to merge")
    with torch.no_grad():
        merged = [(name, layer.base, layer.delta_weight()) for name, layer in layers]  # before any change
        for name, base, delta in merged:
            base.weight.add_(delta)
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, base)
        for _, owner, tensor, _ in weights:  # the forward's W + ΔW written into the original Parameter
            parametrize.remove_parametrizations(owner, tensor, leave_parametrized=True)
    for module in model.modules():  # the adapter's settings, wherever add_adapter put them (a
        if _CONFIG_ATTR in vars(module):  # classifier's trunk): a save records no adapter any more
            object.__delattr__(module, _CONFIG_ATTR)
    return model


def base_structure(model: nn.Module) -> dict[str, list[int]]:
    """The shapes of ``model``'s parameters by name as without its adapter (an adapted layer's
    base weight under the layer's own name, its factors left out): what an adapter was trained on."""
    adapted = {n for n, m in model.named_modules() if isinstance(m, AdaptedLinear)}
    # an adapted expert or router weight: "<owner>.parametrizations.<tensor>.original" is "<owner>.<tensor>"
    originals = {
        _join(o, f"parametrizations.{t}.original"): _join(o, t) for o, _, t, _ in adapted_weights(model)
    }
    factors = tuple(_join(o, f"parametrizations.{t}.0.") for o, _, t, _ in adapted_weights(model))
    out: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        owner, _, rest = name.rpartition(".")  # "<layer>.base.weight" -> ("<layer>.base", "weight")
        layer, _, part = owner.rpartition(".")
        if part == "base" and layer in adapted:
            name = f"{layer}.{rest}"
        elif name in originals:
            name = originals[name]
        elif any(name.startswith(f"{a}.factors.") for a in adapted) or name.startswith(factors):
            continue
        out[name] = list(p.shape)
    return out


def _structure_difference(saved: dict[str, list[int]], model: dict[str, list[int]]) -> str | None:
    """What differs between two :func:`base_structure` maps, in a few words (``None``: nothing)."""

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    extra = [n for n in model if n not in saved]
    missing = [n for n in saved if n not in model]
    shapes = [
        f"{n} {tuple(model[n])} (the base's {tuple(saved[n])})"
        for n in saved
        if n in model and saved[n] != model[n]
    ]
    parts = []
    if extra:
        parts.append(f"this model has {len(extra)} parameters its base had not ({few(extra)})")
    if missing:
        parts.append(f"it lacks {len(missing)} of the base's ({few(missing)})")
    if shapes:
        parts.append(f"shapes differ: {few(shapes)}")
    return "; ".join(parts) or None


def save_adapter(model: nn.Module, path: str | Path) -> Path:
    """Write the adapter alone (its parameters and settings) to a safetensors file."""
    from safetensors.torch import save

    from .io.atomic import atomic_write_bytes

    cfg = adapter_config(model)
    if cfg is None:
        raise ValueError(f"model of type {type(model).__name__} holds no adapter (add_adapter first)")
    path = Path(path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in adapter_parameters(model).items()}
    metadata = {_METADATA_KEY: json.dumps(cfg), _BASE_KEY: json.dumps(base_structure(model))}
    return atomic_write_bytes(path, save(tensors, metadata=metadata))


def load_adapter(model: nn.Module, path: str | Path, freeze: bool = True) -> list[str]:
    """Add the adapter saved in ``path`` to ``model`` (the same architecture) and load its weights;
    returns the adapted target names.  A model whose parameters (names, shapes) differ from the
    base the adapter was trained on (a deeper or wider model) is refused, naming what differs:
    the adapter would adapt some of its layers only."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"adapter file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        meta, base = metadata.get(_METADATA_KEY), metadata.get(_BASE_KEY)
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{str(path)!r} is not a safetensors file ({exc})") from None
    if meta is None:
        raise ValueError(f"{str(path)!r} holds no moelab adapter (no {_METADATA_KEY!r} metadata)")
    cfg = json.loads(meta)
    if base is not None:  # files written before the base was recorded: the target check below only
        if getattr(model, _CONFIG_ATTR, None) is None:  # (a model with an adapter: add_adapter says so)
            differ = _structure_difference(json.loads(base), base_structure(model))
            if differ is not None:
                raise ValueError(
                    f"{str(path)!r} was trained on a base of another structure: {differ}; expected the "
                    "model it was trained on"
                )
    names = restore_adapter(model, cfg, freeze=freeze)
    params = adapter_parameters(model)
    if names != cfg["targets"] or set(params) != set(tensors):
        merge_adapter(model)  # nothing half-loaded stays behind (the factors are still at zero update)
        raise ValueError(
            f"{str(path)!r} was saved from another architecture: its targets {cfg['targets']} do not match "
            f"this model's {names}"
        )
    with torch.no_grad():
        for k, p in params.items():
            t = tensors[k]
            if t.shape != p.shape:
                raise ValueError(
                    f"{str(path)!r}: {k} has shape {tuple(t.shape)}, this model {tuple(p.shape)}"
                )
            p.copy_(t)
    return names


def restore_adapter(model: nn.Module, config: dict[str, Any], freeze: bool = True) -> list[str]:
    """Add the adapter :func:`adapter_config` described (its exact targets, zero update) to ``model``;
    its weights come from a state dict or :func:`load_adapter`."""
    return add_adapter(
        model,
        config["kind"],
        rank=config["rank"],
        alpha=config["alpha"],
        dropout=config["dropout"],
        targets=[_exact(t) for t in config["targets"]],
        hidden=config["hidden"],
        freeze=freeze,
        share_experts=config.get("share_experts", False),
    )


def _exact(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
