"""Hugging Face transformers MoE blocks → :class:`moelab.MoE` layers with the same outputs.

:func:`from_hf` converts one block, or every MoE block inside a model (in place), recognised by
its parts (a router ``gate`` with one ``(N, d)`` weight and the attributes that set its rule,
stacked or listed SiLU experts, plain or with DeepSeek-V4's clamp ``swiglu_clamp``, optional
shared experts), not by its class name; the rule those parts propose (softmax top-K → ``smoe`` /
``sharede-v2``, the DeepSeek-V3 sigmoid with a selection bias → ``sharede-v3``, DeepSeek-V4's
sqrt-softplus top-K and hash layers → ``deepseek-v4``) is checked on random tokens against the
block's own router before anything is converted, and a block that does not fit is refused with a
``ValueError`` naming it, its class and why.  :func:`set_method` switches converted layers to
another method; :func:`moelab.to_hf` is the inverse.  docs/scaling-hf.md ("from_hf, to_hf,
set_method") has the parts, the table of methods and options, what is not carried over, and every
transformers family.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..balance import StepStatistics
from ..experts import MLP
from ..functional import activation as get_activation
from ..layer import MoE, aux_loss, moe_layers
from ..methods import get_method, method_router_options
from ..padding import scope_padding
from ..routers import ROUTERS

__all__ = [
    "GatedSharedExpert",
    "add_aux_to_output_loss",
    "attention_padding",
    "from_hf",
    "guard_save_pretrained",
    "padded_decoder",
    "set_method",
    "wire_padding",
]

_ROUTER_NAMES = ("gate", "router")
_SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
_BIAS_NAMES = ("e_score_correction_bias", "expert_bias")
#: the token id → experts table of a hash-routed router (DeepSeek-V4's ``DeepseekV4HashRouter``)
_HASH_NAMES = ("tid2eid",)
#: the router options of a conversion that set_method carries to another method
_CARRIED = ("renormalize", "normalize", "scale", "num_groups", "topk_groups", "selection_bias")


class GatedSharedExpert(nn.Module):
    """A shared expert scaled by a learned sigmoid gate: ``sigmoid(g·x) · MLP(x)`` (Qwen2-MoE).

    Used as ``MoE.shared`` of a converted Qwen2-MoE-style block; moelab's own ``sharede-v2`` adds
    its shared experts with weight 1.
    """

    def __init__(self, mlp: nn.Module, d_model: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.gate = nn.Linear(d_model, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


class Unconvertible(ValueError):
    """A block moelab cannot reproduce exactly (the message names it, its class and why)."""


@dataclass
class Plan:
    """How one transformers block becomes a moelab layer (and back, :mod:`moelab.hf.export`)."""

    method: str
    router_name: str
    weight_name: str  # the router's (N, d) parameter
    bias_owner: str | None  # "router" / "block" / None: where the selection bias lives
    bias_name: str | None
    options: dict[str, Any]
    shared_name: str | None = None
    shared_gate: bool = False
    experts_stacked: bool = True
    num_experts: int = 0
    top_k: int = 0
    d_model: int = 0
    d_hidden: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _name(module: nn.Module) -> str:
    return type(module).__name__


def _refuse(path: str, block: nn.Module, why: str) -> Unconvertible:
    where = f"{path} " if path else ""
    return Unconvertible(f"{where}({_name(block)}) cannot be converted by moelab.from_hf: {why}")


def _is_silu(module: nn.Module | None, config: Any) -> bool:
    act = getattr(config, "hidden_act", None)
    if act is not None:
        return act == "silu"
    if module is torch.nn.functional.silu:
        return True
    return _name(module) in ("SiLU", "SiLUActivation") if module is not None else False


def _clamp_limit(module: nn.Module) -> Any:
    """The SwiGLU clamp bound a transformers expert or MLP carries (``None``: no clamp)."""
    return _attr(module, "swiglu_limit", "limit")


def _same_activation(fn: Any, name: str, width: int, dtype: torch.dtype, device: Any) -> bool:
    """Whether ``fn`` of a ``(T, 2h)`` ``[gate | up]`` pre-activation is moelab's activation
    ``name`` on random pre-activations of every sign and size up to ±40 (where a clamp bites)."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(256, 2 * width, generator=g, dtype=torch.float64) * 12).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            got = fn(h)
    except Exception:  # a gate that needs more than its pre-activations
        return False
    return isinstance(got, Tensor) and got.shape == (256, width) and torch.equal(got, get_activation(name)(h))


def _clamped_mlp_ok(mlp: nn.Module) -> bool:
    """Whether a clamped ``gate_proj / up_proj / down_proj`` MLP computes ``swiglu_clamp``: its
    output against ``down(swiglu_clamp([gate(x) | up(x)]))`` on tokens whose pre-activations pass ±10."""
    w = mlp.gate_proj.weight
    if w.is_meta:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, w.shape[1], generator=g, dtype=torch.float64).to(device=w.device, dtype=w.dtype)
    x = x * (30.0 / w.detach().norm(dim=1).mean().clamp_min(1e-6))
    with torch.no_grad():
        h = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        want = mlp.down_proj(get_activation("swiglu_clamp")(h))
        try:
            got = mlp(x)
        except Exception:
            return False
    return isinstance(got, Tensor) and torch.equal(got, want)


def _check_swiglu_mlp(mlp: nn.Module, what: str) -> str | None:
    """``None`` when ``mlp`` is a bias-free SiLU ``gate_proj / up_proj / down_proj`` MLP (plain, or
    clamped as DeepSeek-V4's, :func:`_mlp_activation`), else why not."""
    parts = {n for n, _ in mlp.named_children()}
    if not {"gate_proj", "up_proj", "down_proj"} <= parts:
        return f"{what} {_name(mlp)} is not a gate_proj/up_proj/down_proj MLP (has {sorted(parts)})"
    extra = parts - {"gate_proj", "up_proj", "down_proj", "act_fn"}
    if extra:
        return f"{what} {_name(mlp)} has parts moelab does not reproduce: {sorted(extra)}"
    for n in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, n)
        if not isinstance(lin, nn.Linear) or lin.bias is not None:
            return f"{what} {_name(mlp)}.{n} is not a bias-free nn.Linear"
    if not _is_silu(getattr(mlp, "act_fn", None), getattr(mlp, "config", None)):
        act = getattr(getattr(mlp, "config", None), "hidden_act", None) or _name(
            getattr(mlp, "act_fn", nn.Identity())
        )
        return f"{what} {_name(mlp)} has activation {act!r} (only 'silu' maps to moelab's 'swiglu')"
    limit = _clamp_limit(mlp)
    if limit is not None and not _clamped_mlp_ok(mlp):
        return f"{what} {_name(mlp)} with a clamped SwiGLU (limit={limit!r}) other than {_CLAMP_RULE}"
    return None


#: the one clamped SwiGLU moelab reproduces (``swiglu_clamp``), in the words of a refusal
_CLAMP_RULE = "DeepSeek-V4's silu(min(gate, 10)) * clamp(up, -10, 10)"


def _mlp_activation(mlp: nn.Module) -> str:
    """moelab's activation of a checked (:func:`_check_swiglu_mlp`) transformers MLP."""
    return "swiglu" if _clamp_limit(mlp) is None else "swiglu_clamp"


def _check_experts(experts: nn.Module) -> tuple[bool, int, int, int, str] | str:
    """``(stacked, N, d_model, d_hidden, activation)`` for a supported expert bank, else why not."""
    if isinstance(experts, nn.ModuleList):
        if len(experts) == 0:
            return "experts is an empty ModuleList"
        for i, mlp in enumerate(experts):
            why = _check_swiglu_mlp(mlp, f"expert {i}")
            if why:
                return why
        d_hidden, d_model = experts[0].gate_proj.weight.shape
        if any(m.gate_proj.weight.shape != (d_hidden, d_model) for m in experts):
            return "experts of different widths"
        acts = {_mlp_activation(m) for m in experts}
        if len(acts) > 1:
            return "experts with different activations (some clamped)"
        return False, len(experts), d_model, d_hidden, acts.pop()
    problems = []
    if getattr(experts, "has_bias", False) or any(n.endswith("bias") for n, _ in experts.named_parameters()):
        problems.append("expert biases")
    if getattr(experts, "is_transposed", False):
        problems.append("transposed expert weights")
    if not hasattr(experts, "gate_up_proj"):
        names = sorted(n for n, _ in experts.named_parameters())
        return f"experts {_name(experts)} store their weights in another layout ({names}; expected gate_up_proj, down_proj)"
    if not getattr(experts, "has_gate", True):
        problems.append("experts without a gate projection (non-gated MLP experts)")
    if not getattr(experts, "is_concatenated", True):
        problems.append("interleaved gate/up weights")
    act_name = "swiglu"
    if getattr(experts, "alpha", None) is not None:  # gpt-oss's: a sigmoid of alpha·gate, not SiLU
        if _clamp_limit(experts) is not None:
            problems.append(f"a clamped SwiGLU (limit={_clamp_limit(experts)!r})")
        problems.append(f"a clamped SwiGLU (alpha={experts.alpha!r})")
    elif _clamp_limit(experts) is not None:  # DeepSeek-V4's clamp, checked on its gate function
        w = getattr(experts, "gate_up_proj", None)
        fn = getattr(experts, "_apply_gate", None)
        if (
            w is None
            or fn is None
            or w.is_meta
            or not _same_activation(fn, "swiglu_clamp", w.shape[1] // 2, w.dtype, w.device)
        ):
            problems.append(f"a clamped SwiGLU (limit={_clamp_limit(experts)!r}) other than {_CLAMP_RULE}")
        act_name = "swiglu_clamp"
    names = {n for n, _ in experts.named_parameters()}
    if not problems and names != {"gate_up_proj", "down_proj"}:
        problems.append(f"expert parameters {sorted(names)} (expected gate_up_proj, down_proj)")
    if not problems and not _is_silu(getattr(experts, "act_fn", None), getattr(experts, "config", None)):
        act = getattr(getattr(experts, "config", None), "hidden_act", None)
        act = act or _name(getattr(experts, "act_fn", nn.Identity()))
        problems.append(f"activation {act!r} (only 'silu' maps to moelab's 'swiglu')")
    if problems:
        return f"experts {_name(experts)} with {', '.join(problems)}"
    n, h2, d = experts.gate_up_proj.shape
    if tuple(experts.down_proj.shape) != (n, d, h2 // 2) or h2 % 2:
        return (
            f"experts {_name(experts)} with gate_up_proj {tuple(experts.gate_up_proj.shape)} and down_proj "
            f"{tuple(experts.down_proj.shape)} (expected (N, 2h, d) and (N, d, h): another layout)"
        )
    return True, n, d, h2 // 2, act_name


def _attr(obj: Any, *names: str) -> Any:
    for n in names:
        value = getattr(obj, n, None)
        if value is not None:
            return value
    return None


def _plan(block: nn.Module, path: str = "") -> Plan:
    """Recognise ``block`` by its parts; raise :class:`Unconvertible` naming what does not fit."""
    router_name = next((n for n in _ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    if router_name is None:
        raise _refuse(path, block, "it has experts but no router child 'gate'")
    experts = block.experts
    checked = _check_experts(experts)
    if isinstance(checked, str):
        raise _refuse(path, block, checked)
    stacked, num_experts, d_model, d_hidden, act_name = checked
    shared_name = next((n for n in _SHARED_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    has_shared_gate = isinstance(getattr(block, "shared_expert_gate", None), nn.Module)
    known = {
        router_name,
        "experts",
        *([shared_name] if shared_name else []),
        *(["shared_expert_gate"] * has_shared_gate),
    }
    extra = [n for n, _ in block.named_children() if n not in known]
    if extra:
        what = ", ".join(f"{n} ({_name(getattr(block, n))})" for n in extra)
        raise _refuse(path, block, f"parts moelab does not reproduce: {what}")
    # the block's own tensors: only a selection bias handed to the router
    own = [n for n, _ in block.named_parameters(recurse=False)] + [
        n for n, _ in block.named_buffers(recurse=False)
    ]
    bias_owner = bias_name = None
    for n in own:
        if n in _BIAS_NAMES and bias_name is None:
            bias_owner, bias_name = "block", n
        else:
            raise _refuse(path, block, f"block tensor {n!r} moelab does not reproduce")
    if bias_owner and getattr(block, "use_expert_bias", True) is False:
        bias_owner = bias_name = None
    jitter = _attr(block, "jitter_noise", "input_jitter_noise")
    if jitter:
        raise _refuse(
            path, block, f"input jitter noise {jitter} during training (moelab has none); set it to 0"
        )
    strategy = getattr(block, "shared_expert_combination_strategy", "sum")
    if shared_name and getattr(block, "num_shared_experts", 1) and strategy != "sum":
        raise _refuse(path, block, f"shared experts combined by {strategy!r} (moelab adds them)")
    if shared_name:
        why = _check_swiglu_mlp(getattr(block, shared_name), "shared expert")
        if why:
            raise _refuse(path, block, why)
    if has_shared_gate:
        g = block.shared_expert_gate
        if not isinstance(g, nn.Linear) or g.bias is not None or g.out_features != 1:
            raise _refuse(path, block, "shared_expert_gate is not a bias-free nn.Linear(d, 1)")

    router = getattr(block, router_name)
    params = list(router.named_parameters())
    mats = [(n, p) for n, p in params if tuple(p.shape) == (num_experts, d_model)]
    if len(mats) != 1:
        raise _refuse(path, block, f"router {_name(router)} has no single ({num_experts}, {d_model}) weight")
    weight_name = mats[0][0]
    others = [n for n, _ in params if n != weight_name]
    others = [n for n in others if n not in _BIAS_NAMES]
    others += [n for n, b in router.named_buffers() if b is not None and n not in _BIAS_NAMES + _HASH_NAMES]
    if others:
        raise _refuse(path, block, f"router {_name(router)} has parameters moelab's routers lack: {others}")
    tensors = [*router.named_parameters(), *router.named_buffers()]
    router_bias = next((n for n, b in tensors if b is not None and n in _BIAS_NAMES), None)
    if router_bias:
        if bias_owner:
            raise _refuse(path, block, "selection biases on both the router and the block")
        bias_owner, bias_name = "router", router_bias
    top_k = _attr(router, "top_k") or _attr(block, "top_k")
    if not isinstance(top_k, int):
        raise _refuse(path, block, f"router {_name(router)} has no integer top_k")
    if _attr(router, "router_jitter_noise", "jitter_noise"):
        raise _refuse(
            path, block, f"router {_name(router)} adds jitter noise during training (moelab has none)"
        )
    if _attr(router, "topk_method") not in (None, "greedy", "noaux_tc"):
        raise _refuse(path, block, f"router {_name(router)} with topk_method={router.topk_method!r}")
    if _attr(router, "router_logit_softcapping"):
        raise _refuse(
            path, block, f"router {_name(router)} soft-caps its logits (tanh), which moelab's routers do not"
        )
    scale = _attr(router, "routed_scaling_factor", "route_scale")
    block_scale = 1.0
    if scale is None:  # a block that scales the routed output (the same: the experts are linear in w)
        scale = block_scale = _attr(block, "routed_scaling_factor")
    scale = 1.0 if scale is None else float(scale)
    block_scale = 1.0 if block_scale is None else float(block_scale)
    norm = _attr(router, "norm_topk_prob")
    groups = int(_attr(router, "num_group", "n_group") or 1)
    topk_groups = int(_attr(router, "topk_group") or groups)
    candidates: list[tuple[str, dict]] = []
    table = next((b for n, b in router.named_buffers() if n in _HASH_NAMES and b is not None), None)
    sqrt_softplus = _name(getattr(router, "score_fn", nn.Identity())) == "SqrtSoftplusActivation"
    if table is not None and not sqrt_softplus:
        raise _refuse(
            path,
            block,
            f"router {_name(router)} routes by a token id table with scores other than sqrt(softplus)",
        )
    if sqrt_softplus:  # DeepSeek-V4: the bias chooses (top-K layers) or the table does (hash layers)
        opts = dict(normalize=True, selection_bias=bias_owner is not None, scale=scale)
        if table is not None:  # one hash layer; from_hf sets the model's count (hash_layers)
            opts.update(hash_layers=1, vocab_size=int(table.shape[0]))
        candidates.append(("deepseek-v4", opts))
    elif bias_owner:  # the DeepSeek-V3 rule: sigmoid scores, the bias for the selection only
        for normalize in [bool(norm)] if norm is not None else [True, False]:
            opts = dict(normalize=normalize, selection_bias=True, scale=scale)
            if groups > 1:
                opts.update(num_groups=groups, topk_groups=topk_groups)
            candidates.append(("sharede-v3", opts))
    else:
        for renorm in [bool(norm)] if norm is not None else [True, False]:
            candidates.append(
                ("smoe", dict(renormalize=renorm, **({"scale": scale} if scale != 1.0 else {})))
            )
        if groups == 1:  # a sigmoid router without a bias (LFM2 with use_expert_bias=False)
            for normalize in [bool(norm)] if norm is not None else [True, False]:
                candidates.append(
                    ("sharede-v3", dict(normalize=normalize, selection_bias=False, scale=scale))
                )
    plan = None
    for method, opts in candidates:
        trial = Plan(
            method,
            router_name,
            weight_name,
            bias_owner,
            bias_name,
            opts,
            shared_name,
            has_shared_gate,
            stacked,
            num_experts,
            int(top_k),
            d_model,
            d_hidden,
            extra={"block_scale": block_scale, "activation": act_name, "hash": table is not None},
        )
        if _probe(block, trial):
            plan = trial
            break
    if plan is None:
        tried = "; ".join(f"{m} {o}" for m, o in candidates)
        hint = ""
        if groups > 1 and not bias_owner:
            hint = (
                " (group-limited top-K over softmax scores: moelab limits groups for the sigmoid rule only)"
            )
        raise _refuse(
            path,
            block,
            f"router {_name(router)} picks or weighs experts by a rule none of moelab's routers "
            f"reproduces{hint}; checked on random tokens against: {tried}",
        )
    if shared_name and plan.method == "smoe":
        plan.method = "sharede-v2"
    plan.options = dict(plan.options)
    if plan.method == "sharede-v2":
        plan.options.pop("selection_bias", None)
    return plan


def _router_call(
    block: nn.Module, plan: Plan, router: nn.Module, x: Tensor, bias: Tensor | None, ids: Tensor | None
):
    if ids is not None:  # a hash router: the token ids choose
        return router(x, ids.view(x.shape[:-1]))
    if plan.bias_owner == "block":
        return router(x, bias)
    return router(x)


def _probe(block: nn.Module, plan: Plan, tokens: int = 256) -> bool:
    """Whether the moelab router of ``plan`` picks the same experts with the same weights as the
    block's router on random tokens (both in float64; the block's router is copied)."""
    from ..methods import build_method_router

    router = getattr(block, plan.router_name)
    w = dict(router.named_parameters())[plan.weight_name]
    if w.is_meta:
        return False
    hf = copy.deepcopy(router).to(torch.float64).eval()
    bias = None
    if plan.bias_owner == "block":
        bias = getattr(block, plan.bias_name).detach().to(torch.float64)
    elif plan.bias_owner == "router":
        bias = getattr(router, plan.bias_name).detach().to(torch.float64)
    method = "smoe" if plan.method == "sharede-v2" else plan.method
    ml = build_method_router(method, plan.d_model, plan.num_experts, plan.top_k, **plan.options)
    ml = ml.to(device=w.device, dtype=torch.float64).eval()
    with torch.no_grad():
        ml.weight.copy_(w)
        if bias is not None and getattr(ml, "selection_bias", None) is not None:
            ml.selection_bias.copy_(bias)
        g = torch.Generator(device="cpu").manual_seed(0)
        scale = w.detach().double().norm(dim=1).mean().clamp_min(1e-6)
        x = (torch.randn(tokens, plan.d_model, generator=g, dtype=torch.float64) / scale).to(w.device)
        ids = None
        if plan.extra.get("hash"):  # the block's own table, on random token ids
            table = next(b for n, b in router.named_buffers() if n in _HASH_NAMES)
            if table.is_meta:
                return False
            ml.tid2eid.copy_(table)
            ids = torch.randint(0, table.shape[0], (tokens,), generator=g).to(w.device)
        try:  # (T, d) as most blocks hand it over, else (1, T, d)
            out = _router_call(block, plan, hf, x, bias, ids)
        except Exception:
            try:
                out = _router_call(block, plan, hf, x.unsqueeze(0), bias, ids)
            except Exception:  # a router that needs inputs the parts do not show
                return False
        if not isinstance(out, tuple) or len(out) < 3:
            return False
        hf_w, hf_i = out[1], out[2]
        if not (isinstance(hf_w, Tensor) and isinstance(hf_i, Tensor)) or hf_i.dtype.is_floating_point:
            return False
        if hf_i.numel() != tokens * plan.top_k or hf_w.numel() != tokens * plan.top_k:
            return False
        hf_i, hf_w = hf_i.reshape(tokens, -1), hf_w.reshape(tokens, -1) * plan.extra.get("block_scale", 1.0)
        r = ml(x) if ids is None else ml(x, token_ids=ids)
        # compare as sets per token: routers may order their K differently
        oh, om = hf_i.argsort(-1), r.indices.argsort(-1)
        same_idx = torch.equal(hf_i.gather(1, oh), r.indices.gather(1, om))
        got, want = r.weights.gather(1, om).double(), hf_w.double().gather(1, oh)
        # float32 routers: rounding of float32; float64 ones: much tighter
        return same_idx and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-7))


def _swiglu_mlp(hf_mlp: nn.Module, d_model: int) -> MLP:
    """A transformers ``gate_proj / up_proj / down_proj`` MLP as a moelab :class:`MLP` (its
    activation ``swiglu``, or ``swiglu_clamp`` for DeepSeek-V4's clamped one)."""
    hidden = hf_mlp.gate_proj.out_features
    mlp = MLP(d_model, hidden, activation=_mlp_activation(hf_mlp), bias=False)
    w = hf_mlp.gate_proj.weight
    mlp.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        mlp.fc_in.weight.copy_(torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight], dim=0))
        mlp.fc_out.weight.copy_(hf_mlp.down_proj.weight)
    return mlp


def _coefs(block: nn.Module) -> dict[str, float]:
    config = getattr(block, "config", None) or getattr(block.experts, "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    out = {"z_coef": 0.0}
    if isinstance(coef, (int, float)) and not isinstance(coef, bool):
        out["balance_coef"] = float(coef)
    return out


def _meta_skeleton(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose tensors live on the meta device (no memory): what
    :func:`moelab.to_hf` rebuilds the block from."""
    memo: dict[int, Any] = {}
    for t in [*block.parameters(), *block.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        )
    return copy.deepcopy(block, memo)


def _convert_block(block: nn.Module, path: str = "", hash_layers: int = 1, position: int = 0) -> MoE:
    """``block`` as a moelab layer; a hash-routed block (DeepSeek-V4) is MoE layer ``position`` of
    a model whose first ``hash_layers`` MoE layers are hash-routed (a lone block: the first of one)."""
    plan = _plan(block, path)
    if plan.extra.get("hash"):
        plan.options["hash_layers"] = hash_layers
    router = getattr(block, plan.router_name)
    w = dict(router.named_parameters())[plan.weight_name]
    options = {**_coefs(block), **plan.options}
    options["num_shared"] = 1 if plan.shared_name else 0  # the block's own shared expert, set below
    layer = MoE(
        plan.d_model,
        plan.num_experts,
        plan.top_k,
        d_hidden=plan.d_hidden,
        method=plan.method,
        activation=plan.extra.get("activation", "swiglu"),
        **options,
    )
    layer.to(device=w.device, dtype=w.dtype)
    if plan.extra.get("hash"):  # numbered as in the model: it routes by its table
        layer.layer_index = position
        with torch.no_grad():
            layer.router.tid2eid.copy_(next(b for n, b in router.named_buffers() if n in _HASH_NAMES))
    experts = block.experts
    with torch.no_grad():
        layer.router.weight.copy_(w)
        if plan.bias_owner:
            owner = block if plan.bias_owner == "block" else router
            layer.router.selection_bias.copy_(getattr(owner, plan.bias_name))
        if plan.experts_stacked:
            layer.experts.w_in.copy_(experts.gate_up_proj)
            layer.experts.w_out.copy_(experts.down_proj)
        else:
            layer.experts.w_in.copy_(
                torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in experts])
            )
            layer.experts.w_out.copy_(torch.stack([m.down_proj.weight for m in experts]))
    if plan.shared_name:
        mlp = _swiglu_mlp(getattr(block, plan.shared_name), plan.d_model)
        if plan.shared_gate:
            shared = GatedSharedExpert(mlp, plan.d_model).to(device=w.device, dtype=w.dtype)
            with torch.no_grad():
                shared.gate.weight.copy_(block.shared_expert_gate.weight)
            mlp = shared
        layer.shared = mlp
    layer.train(block.training)
    if "input_ids" in _forward_params(type(block)):  # the caller hands the ids over as input_ids
        layer.register_forward_pre_hook(_input_ids_as_token_ids, with_kwargs=True)
    # what moelab.to_hf needs to give the block back (not a submodule: nothing is saved twice)
    object.__setattr__(layer, "_hf_block", _meta_skeleton(block))
    object.__setattr__(layer, "_hf_plan", plan)
    return layer


def _input_ids_as_token_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A converted block's ``input_ids`` keyword (DeepSeek-V4's decoder layer calls
    ``self.mlp(h, input_ids=input_ids)``) as the layer's ``token_ids``, for its hash router."""
    if "input_ids" in kwargs:
        kwargs = dict(kwargs)
        ids = kwargs.pop("input_ids")
        if ids is not None and kwargs.get("token_ids") is None:
            kwargs["token_ids"] = ids
    return args, kwargs


def _hash_layers(targets: list[tuple[str, nn.Module]]) -> int:
    """How many of the blocks ``targets`` (in model order) route by a token id table; they must be
    the first ones, as moelab's ``deepseek-v4`` hashes the first ``hash_layers`` MoE layers."""
    hashed = [
        any(n in _HASH_NAMES for n, _ in getattr(b, r).named_buffers())
        for _, b in targets
        for r in [next((n for n in _ROUTER_NAMES if isinstance(getattr(b, n, None), nn.Module)), None)]
        if r is not None
    ]
    n = sum(hashed)
    if hashed[:n] != [True] * n:
        where = [p for (p, _), h in zip(targets, hashed) if h]
        raise ValueError(
            f"hash-routed blocks at {where} are not allowed by moelab.from_hf; expected them to be the model's "
            "first MoE blocks (moelab's deepseek-v4 hashes its first hash_layers MoE layers)"
        )
    return n


def _is_candidate(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module) and not isinstance(module, MoE)


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE blocks of ``model`` by their parts (a module with an ``experts`` child that is not
    a moelab layer), outermost first; those inside another block are left to it."""
    found: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        if _is_candidate(m) and not any(path.startswith(p + ".") or p == "" for p, _ in found):
            if not any(isinstance(a, MoE) for a in _ancestors(model, path)):
                found.append((path, m))
    return found


def _ancestors(model: nn.Module, path: str) -> list[nn.Module]:
    out, parts = [model], path.split(".") if path else []
    for i in range(1, len(parts)):
        out.append(model.get_submodule(".".join(parts[:i])))
    return out


def from_hf(module: nn.Module, method: str | None = None, **options: Any) -> nn.Module:
    """Convert transformers MoE blocks to :class:`moelab.MoE` layers with identical outputs.

    Args:
        module: an MoE block (recognised by its parts, see the module docstring), or a model
            containing such blocks.
        method: if given, switch the converted layers to this moelab method afterwards
            (:func:`set_method`), carrying the block's own options (scaling, normalisation,
            group limits, selection bias) over.
        **options: options of ``method`` (only with ``method``), overriding the carried ones.

    Returns:
        the new :class:`moelab.MoE` for a block; for a model, the same model with every block
        replaced in place (its other modules untouched).

    Raises:
        ValueError: ``module`` is not an ``nn.Module``, contains no MoE block, or a block (named
            with its class and why) is not one moelab reproduces exactly; nothing is converted then.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={module!r} is not allowed; expected a torch.nn.Module")
    if options and method is None:
        raise ValueError(f"options {sorted(options)} are not allowed without method=; pass method='...' too")
    if method is not None:
        get_method(method)  # checked before anything changes
        refuse_factorised_gates(method, "from_hf")
    if _is_candidate(module):
        layer = _convert_block(module)
        if method is not None:
            set_method(layer, method, **options)
        return layer
    targets = find_blocks(module)
    if not targets:
        if moe_layers(module):
            raise ValueError(
                f"module of type {_name(module)} holds moelab MoE layers already and no transformers MoE block"
            )
        raise ValueError(
            f"module of type {_name(module)} is not a transformers MoE block and contains none (no module "
            "with an 'experts' child); moelab.upcycle turns a dense model's MLPs into MoE layers"
        )
    n_hash = _hash_layers(targets)
    converted = [  # all or nothing
        (path, _convert_block(block, path, n_hash, i)) for i, (path, block) in enumerate(targets)
    ]
    for path, layer in converted:
        parent_path, _, attr = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, attr, layer)
    # what moelab.save records to rebuild the model offline (transformers config + this step)
    module._moelab_recipe = [*getattr(module, "_moelab_recipe", []), {"op": "from_hf"}]
    guard_save_pretrained(module)
    add_aux_to_output_loss(module)
    wire_padding(module)
    if not getattr(module, "_moelab_router_logits_hook", False):  # called directly, not only by MoETrainer
        module.register_forward_pre_hook(_refuse_router_logits, with_kwargs=True)
        module._moelab_router_logits_hook = True
    if method is not None:
        set_method(module, method, **options)
    return module


# ---------------------------------------------------------------- the padding mask


@functools.cache
def _forward_params(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters after ``self``, in order."""
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return ()
    return tuple(params[1:])


def _takes_attention_mask(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes one stack's ids and padding mask (not an encoder-decoder's
    two stacks, whose ``attention_mask`` is the encoder's only)."""
    names = _forward_params(type(module))
    return (
        "attention_mask" in names
        and ("input_ids" in names or "inputs_embeds" in names)
        and "decoder_input_ids" not in names
    )


def wire_padding(model: nn.Module) -> None:
    """Scope the padding mask of the decoder of ``model`` that holds its moelab layers
    (:func:`padded_decoder`) over that decoder's forward (:func:`moelab.padding.scope_padding`)."""
    paths = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    decoder = padded_decoder(model, paths) if paths else None
    if decoder is not None:  # its attention_mask reaches the layers
        scope_padding(decoder, attention_padding)


def padded_decoder(model: nn.Module, paths: list[str]) -> nn.Module | None:
    """The innermost module of ``model`` that holds every converted layer (at ``paths``) and whose
    forward takes ``attention_mask`` with ``input_ids`` / ``inputs_embeds`` (``MixtralModel`` inside
    ``MixtralForCausalLM``): the module whose forward sees the padding mask the layers need.
    ``None`` when no such module holds them all (a lone block; layers in both stacks of an
    encoder-decoder, whose one ``attention_mask`` is the encoder's)."""
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    chain = [model] + [model.get_submodule(".".join(common[: i + 1])) for i in range(len(common))]
    return next((m for m in reversed(chain) if _takes_attention_mask(m)), None)


def attention_padding(module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
    """The padding mask of a transformers decoder's forward: its 2-D ``attention_mask`` (1 for a
    real token) over the positions of this call's ``input_ids`` / ``inputs_embeds`` (the last
    ones: with a cache, the mask also covers the earlier positions); ``None`` without one.  A
    4-D or per-layer-type mask (packed sequences) is not a padding mask: no scope."""
    names = _forward_params(type(module))
    given = {**dict(zip(names, args)), **kwargs}
    mask = given.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        return None
    tokens = next(
        (given[n] for n in ("input_ids", "inputs_embeds") if isinstance(given.get(n), Tensor)), None
    )
    length = mask.shape[1] if tokens is None or tokens.dim() < 2 else tokens.shape[1]
    if length > mask.shape[1]:
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} is not allowed for {length} positions; expected "
            "(batch, at least the positions of input_ids / inputs_embeds)"
        )
    return mask[:, mask.shape[1] - length :]


# ---------------------------------------------------------------- switching method


def carried_options(layer: MoE) -> dict[str, Any]:
    """The router options of ``layer`` that describe its block's rule (normalisation, scaling,
    group limits, selection bias), read from its router (a competition router's base).  A
    sigmoid router without a selection bias carries ``selection_bias=False`` (Flint, LFM2 with
    ``use_expert_bias=False``): the ``sharede-v3`` preset would add one."""
    rule = layer.router.base_router.rule_options()
    out: dict[str, Any] = {}
    for key in _CARRIED:
        if key == "selection_bias":
            if rule.get(key) is not None:
                out[key] = rule[key].detach().clone()
            elif key in rule:
                out[key] = False
        elif key in rule:
            out[key] = rule[key]
    return out


def _neutral(key: str, value: Any, carried: dict[str, Any]) -> bool:
    """Whether dropping option ``key`` changes nothing."""
    if key == "scale":
        return value == 1.0
    if key in ("num_groups", "topk_groups"):
        return carried.get("topk_groups") == carried.get("num_groups")
    if key == "selection_bias":
        return value is False or not bool(value.ne(0).any())
    return False


def _translate(carried: dict[str, Any], accepted: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``carried`` in the option names a router accepts; and what it cannot take."""
    out: dict[str, Any] = {}
    lost: list[str] = []
    for key, value in carried.items():
        target = key
        if key not in accepted:
            target = {"normalize": "renormalize", "renormalize": "normalize"}.get(key, key)
        if target in out:
            continue
        if target in accepted:
            out[target] = value
        elif key in ("renormalize", "normalize"):
            if not value:  # weights not normalised: a router that always normalises changes them
                lost.append(f"{key}=False")
        elif not _neutral(key, value, carried):
            lost.append(f"{key}={'<per-expert bias>' if key == 'selection_bias' else value!r}")
    return out, lost


def _coef_options(layer: MoE, method: str) -> dict[str, float]:
    """Every loss coefficient of ``layer`` as ``<loss>_coef`` options, zeros included (a zero is
    not kept in ``layer.coefs``, and leaving it out would bring back the preset's)."""
    names = {*layer.coefs, *get_method(method).coefs}
    return {f"{k}_coef": float(layer.coefs.get(k, 0.0)) for k in sorted(names)}


def _router_options(layer: MoE, method: str, options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The options of the new layer (router, coefficients) and what of the old rule is lost."""
    if method == layer.method:  # the layer's own options and coefficients, changed where asked
        return {**layer.config.options, **_coef_options(layer, method), **options}, []
    carried = carried_options(layer)
    accepted = method_router_options(method)
    if "base" in accepted and "base" not in options:
        base = layer.method if get_method(layer.method).router in ("topk", "sigmoid") else "smoe"
        if base == "sharede-v2":
            base = "smoe"
        base_opts, lost = _translate(carried, _bias_if_same_gate(layer, base, method_router_options(base)))
        router_opts = {"base": base, "base_options": {**base_opts, **options.pop("base_options", {})}}
    else:
        chooser = options.get("base", "smoe") if "base" in accepted else method  # the router that chooses
        router_opts, lost = _translate(carried, _bias_if_same_gate(layer, chooser, accepted))
    return {**router_opts, **options}, lost


def _router_state(router: nn.Module) -> dict[str, Tensor]:
    """A router's saved tensors (parameters, persistent buffers) by name, as live tensors."""
    return dict(router.state_dict(keep_vars=True))


def _switch(layer: MoE, method: str, options: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Switch one layer in place; returns what of its rule the new method could not take and
    the new router's tensors initialised afresh (not copied from the old router)."""
    num_shared = options.pop("num_shared", layer.num_shared)
    if num_shared != layer.num_shared:
        raise ValueError(
            f"num_shared={num_shared!r} is not allowed; set_method keeps the layer's shared experts "
            f"(num_shared={layer.num_shared})"
        )
    new_opts, lost = _router_options(layer, method, options)
    selection = {}  # the carried selection bias tensors, handed to the router built below
    for opts in (new_opts, new_opts.get("base_options") or {}):
        if isinstance(opts.get("selection_bias"), Tensor):
            selection[id(opts)] = opts["selection_bias"]
            opts["selection_bias"] = True
    new_opts["num_shared"] = layer.num_shared
    if layer.balance_scope != "micro":  # a layer option: the layer keeps it, so does its config
        new_opts.setdefault("balance_scope", layer.balance_scope)
    cfg = layer.config
    # validate and build on the meta device, then move the router over
    with torch.device("meta"):
        tmp = MoE(
            cfg.d_model,
            cfg.num_experts,
            cfg.top_k,
            cfg.d_hidden,
            method=method,
            activation=cfg.activation,
            bias=cfg.bias,
            impl=cfg.impl,
            check_finite=cfg.check_finite,
            **new_opts,
        )
    old = layer.router
    w = next(iter(old.parameters()), None)
    ref = w if w is not None else next(layer.experts.parameters())
    router = tmp.router.to_empty(device=ref.device).to(dtype=ref.dtype)
    router.reset_parameters()
    for m in router.modules():
        if m is not router and callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    copied = _copy_router_state(old, router, [*selection.values()])
    prefix = "base." if router.base_router is not router else ""
    fresh = [n for n in _router_state(router) if n.removeprefix(prefix) not in copied]
    router.train(old.training)
    router.layer_index = old.layer_index
    layer.router = router
    layer.config = dataclasses.replace(tmp.config, options=_json_options(new_opts))
    # the global scope's statistics follow the new coefficients
    stats = layer.config.load_coefs if tmp.step_statistics is not None else None
    layer.step_statistics = (
        None if not stats else StepStatistics(cfg.num_experts, stats).to(ref.device, ref.dtype)
    )
    if layer.ctx is not None:  # the context keeps stepping the new router (sharede-v3's bias)
        _rehook(layer.ctx, old, router)
    return lost, fresh


def _copy_router_state(old: nn.Module, new: nn.Module, selection: list[Tensor]) -> set[str]:
    """Copy into ``new``'s base router what it shares with ``old``'s: the ``(N, d)`` weight
    whatever the family, every tensor of the same name, shape and kind within a family (a
    cosine router's projection, embeddings and learned temperature), and the carried selection
    bias.  Returns the names copied (relative to the base router)."""
    old_base, new_base = old.base_router, new.base_router
    old_state, new_state = _router_state(old_base), _router_state(new_base)
    same_family = type(old_base) is type(new_base)
    copied: set[str] = set()
    with torch.no_grad():
        for name, t in new_state.items():
            src = old_state.get(name)
            if name == "selection_bias" and selection:
                src = selection[0]
            if src is None or src.shape != t.shape:
                continue
            if name in ("weight", "selection_bias") or (
                same_family and isinstance(src, nn.Parameter) == isinstance(t, nn.Parameter)
            ):
                t.copy_(src)
                copied.add(name)
    return copied


def _rehook(ctx: Any, old: nn.Module, new: nn.Module) -> None:
    """Replace the step hooks of ``old``'s routers in ``ctx`` by ``new``'s (as attach registers them)."""
    from ..routers import Router

    gone = {id(m) for m in old.modules()}
    ctx.hooks[:] = [h for h in ctx.hooks if id(getattr(h, "__self__", None)) not in gone]
    for module in new.modules():
        if isinstance(module, Router):
            ctx.add_step_hook(module.on_step)


def _bias_if_same_gate(layer: MoE, method: str, accepted: list[str]) -> list[str]:
    """``accepted`` without ``selection_bias`` when ``method``'s router gates with another activation
    than the layer's (a bias on sigmoid scores is no bias on softmax probabilities): it is then
    reported as lost, not carried."""
    if ROUTERS[get_method(method).router].gate == layer.router.base_router.gate:
        return accepted
    return [name for name in accepted if name != "selection_bias"]


def _json_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.tolist() if isinstance(v, Tensor) else v) for k, v in options.items()}


def refuse_factorised_gates(method: str, op: str) -> None:
    """Autonomy-of-Experts' and Routing-Free MoE's experts have low-rank gate projections
    ``W_g = B A`` (:attr:`moelab.routers.Router.factorised_gates`): full-rank experts (a transformers
    block's, another method's) have no exact counterpart."""
    paper = ROUTERS[get_method(method).router].factorised_gates
    if paper is not None:
        raise ValueError(
            f"{op}(method={method!r}) is not allowed: {paper} needs experts whose gate projections "
            "are low-rank factors (W_g = B A), which full-rank experts are not; build the layer with "
            f"moelab.MoE(..., method={method!r}) instead"
        )


def set_method(model: nn.Module, method: str, **options: Any) -> nn.Module:
    """Switch every moelab MoE layer of ``model`` (``model`` itself if it is one) to ``method``.

    A layer already of ``method`` is left as it is when no ``options`` are given (its own
    method is a no-op); with ``options`` it keeps its own options, coefficients and router
    tensors, changed where asked.  Otherwise the experts and shared experts are kept; the router
    becomes ``method``'s, its ``(N, d)`` weight copied over where the new router has one (the
    softmax and sigmoid routers, a competition router's base), every tensor of the same name,
    shape and kind copied within a router family (``xmoe`` → ``pcosine`` keeps the projection and
    the expert embeddings), and the rest initialised afresh, which a ``UserWarning`` names.  The
    rule of the old router is carried over: normalisation (``renormalize`` ↔ ``normalize``),
    ``scale``, ``num_groups`` / ``topk_groups`` and the selection bias — or its absence — as far
    as ``method`` takes them (a ``competesmoe``-family method gets the old rule as its base
    router: ``base`` = the old method, ``base_options`` = its options).  Whatever ``method``
    cannot take is reported with a ``UserWarning`` naming it.  The loss coefficients become
    ``method``'s preset, announced with a ``UserWarning`` (old → new) unless every changed one was
    passed as ``<loss>_coef``.  ``options`` override all of this; ``num_shared`` cannot change.
    A layer attached to a :class:`moelab.RoutingContext` stays attached: the old router's step
    hooks are replaced by the new router's (sharede-v3's selection bias keeps updating).

    Returns:
        ``model``.

    Raises:
        ValueError: ``method`` is not a moelab method, an option is not accepted by it, or
            ``model`` holds no moelab MoE layer.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
    get_method(method)
    layers = moe_layers(model)
    if not layers:
        raise ValueError(
            f"model of type {_name(model)} holds no moelab MoE layer; convert it first (moelab.from_hf)"
        )
    if any(get_method(layer.method).router != get_method(method).router for layer in layers):
        refuse_factorised_gates(method, "set_method")
        for layer in layers:
            if layer.method != method and ROUTERS[get_method(layer.method).router].factorised_gates:
                raise ValueError(
                    f"set_method(method={method!r}) is not allowed on a layer of method={layer.method!r}: its "
                    "experts' gate projections are low-rank factors (W_g = B A) that the new method's experts "
                    "are not; build a new layer instead"
                )
    lost_all: dict[str, list[int]] = {}
    fresh_all: dict[str, list[int]] = {}
    coefs_all: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        if layer.method == method and not options:  # its own method: nothing to change
            continue
        before = dict(layer.coefs)
        lost, fresh = _switch(layer, method, dict(options))
        for item in lost:
            lost_all.setdefault(item, []).append(i)
        if fresh:
            fresh_all.setdefault(", ".join(fresh), []).append(i)
        changed = {k for k in {*before, *layer.coefs} if before.get(k, 0.0) != layer.coefs.get(k, 0.0)}
        if any(f"{k}_coef" not in options for k in changed):  # not all of them asked for
            coefs_all.setdefault((str(before), str(layer.coefs)), []).append(i)
    if lost_all:
        what = "; ".join(f"{k} (layers {v})" for k, v in lost_all.items())
        warnings.warn(
            f"set_method(method={method!r}) drops what this method cannot express: {what}", stacklevel=2
        )
    if fresh_all:
        what = "; ".join(f"{k} (layers {v})" for k, v in fresh_all.items())
        warnings.warn(
            f"set_method(method={method!r}) initialises router tensors the old router has no counterpart "
            f"of afresh: {what}; the routing differs from the old one until they are trained",
            stacklevel=2,
        )
    if coefs_all:
        what = "; ".join(f"{old} -> {new} (layers {v})" for (old, new), v in coefs_all.items())
        warnings.warn(
            f"set_method(method={method!r}) changes the loss coefficients to the method's preset: {what}; "
            "pass <loss>_coef options to set them",
            stacklevel=2,
        )
    if not isinstance(model, MoE):
        step = {"op": "set_method", "method": method, **_json_options(options)}
        model._moelab_recipe = [*getattr(model, "_moelab_recipe", []), step]
    return model


# ---------------------------------------------------------------- save_pretrained guard


def _guarded_save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    layers = moe_layers(self)
    if layers:
        raise ValueError(
            f"save_pretrained refused: the model holds {len(layers)} moelab MoE layers, which transformers "
            "would silently re-initialise on from_pretrained; call moelab.to_hf(model) first, or save with "
            "moelab.save(model, path) and load with moelab.load(path)"
        )
    return type(self).save_pretrained(self, *args, **kwargs)


_ROUTER_LOGITS = (
    "output_router_logits=True is not allowed on a model with moelab MoE layers: transformers' "
    "load-balancing loss reads router logits these layers do not record; set "
    "model.config.output_router_logits=False (each moelab layer adds its own balance loss, "
    "balance_coef from router_aux_loss_coef: moelab.aux_loss(model), which MoETrainer trains on)"
)


def check_router_logits(model: nn.Module, requested: Any = None) -> None:
    """Refuse ``output_router_logits`` (asked for by ``requested`` or ``model.config``) on a model
    with moelab MoE layers: transformers' load-balancing loss would fail on them."""
    flag = (
        requested
        if requested is not None
        else getattr(getattr(model, "config", None), "output_router_logits", False)
    )
    if flag is True and moe_layers(model):
        raise ValueError(_ROUTER_LOGITS)


def _refuse_router_logits(module: nn.Module, args: tuple, kwargs: dict) -> None:
    check_router_logits(module, kwargs.get("output_router_logits"))


def _aux_into_loss(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    if not module.training or not torch.is_grad_enabled() or getattr(module, "_moelab_aux_by_trainer", False):
        return None
    if isinstance(output, dict):  # a ModelOutput
        loss = output.get("loss")
        if loss is not None:
            output["loss"] = loss + aux_loss(module).to(loss.device)
            return output
    elif (
        isinstance(output, tuple)
        and kwargs.get("labels") is not None
        and output
        and torch.is_tensor(output[0])
    ):
        if output[0].dim() == 0:  # return_dict=False: the loss first
            return (output[0] + aux_loss(module).to(output[0].device), *output[1:])
    return None


def add_aux_to_output_loss(model: nn.Module) -> None:
    """Add ``moelab.aux_loss(model)`` to the model's output loss in a training forward with labels,
    as transformers' MoE models add their balance loss with ``output_router_logits``: the plain
    ``transformers.Trainer`` then logs task + aux, and a loss it scales otherwise than the layers'
    ``set_aux_scale`` (gradient accumulation, fp16 scaling) is refused in backward instead of
    training on a wrongly weighted aux loss.  :class:`moelab.hf.MoETrainer` adds it its own way."""
    if not getattr(model, "_moelab_aux_hook", False):
        model.register_forward_hook(_aux_into_loss, with_kwargs=True)
        model._moelab_aux_hook = True


def guard_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` raise while ``model`` holds moelab layers (a transformers
    checkpoint of it would load with those blocks silently re-initialised); once :func:`to_hf`
    has given the blocks back it saves as usual.  No-op for models without ``save_pretrained``."""
    if callable(getattr(type(model), "save_pretrained", None)) and "save_pretrained" not in vars(model):
        model.save_pretrained = types.MethodType(_guarded_save_pretrained, model)
