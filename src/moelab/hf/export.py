"""moelab layers back to Hugging Face transformers MoE blocks: :func:`to_hf`, the inverse of
:func:`moelab.from_hf`, rebuilds each converted layer's original block and copies its current
weights back, so that ``save_pretrained`` of the result loads in plain transformers; a layer whose
rule has no transformers counterpart is refused naming the method, and
:func:`guard_save_pretrained` makes ``save_pretrained`` raise while moelab layers remain.
docs/scaling-hf.md ("``from_hf``, ``to_hf``, ``set_method``") says what is copied back and what is
refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..layer import MoE, moe_layers
from .convert import GatedSharedExpert, Plan, guard_save_pretrained

__all__ = ["block_plan", "guard_save_pretrained", "to_hf"]  # the guard lives in .convert (which installs it)

_LOST = {
    "cosine": "the cosine router's projection, expert embeddings and temperature",
    "competesmoe": "the competition schedule and its distillation / diversity losses",
    "competition": "competition routing (every expert runs; no learned router)",
    "stable": "StableMoE's centroid router and distilled light router",
    "hyper": "the hypernetwork that generates the router",
}


def _router_options(layer: MoE) -> dict[str, Any]:
    rule = layer.router.rule_options()
    out = {k: v for k, v in rule.items() if k not in ("selection_bias", "expert_dropout")}
    out["selection_bias"] = rule.get("selection_bias") is not None
    out["expert_dropout"] = rule.get("expert_dropout", 0.0)
    return out


def _expected_options(plan: Plan) -> dict[str, Any]:
    o = plan.options
    if plan.method == "sharede-v3":
        return {
            "normalize": o.get("normalize", False),
            "scale": float(o.get("scale", 1.0)),
            "num_groups": o.get("num_groups", 1),
            "topk_groups": o.get("topk_groups", o.get("num_groups", 1)),
            "selection_bias": bool(o.get("selection_bias", False)),
            "expert_dropout": 0.0,
            "gate_bias": False,  # no transformers sigmoid router has a learned bias inside the sigmoid
        }
    if plan.method == "deepseek-v4":  # a top-K layer (its bias) or a hash layer (its table)
        return {
            "normalize": True,
            "scale": float(o.get("scale", 1.0)),
            "selection_bias": bool(o.get("selection_bias", False)),
            "hash_layers": o.get("hash_layers", 0),
        }
    return {
        "renormalize": o.get("renormalize", True),
        "scale": float(o.get("scale", 1.0)),
        "frozen": False,
        "k_max": None,
        "eval_k": None,
        "selection_bias": False,
        "expert_dropout": 0.0,
    }


def _refuse(path: str, layer: MoE, why: str) -> ValueError:
    where = path or "the layer"
    return ValueError(
        f"{where} (method={layer.method!r}) cannot go back to transformers: {why}; save it with "
        "moelab.save(model, path) and reload it with moelab.load(path) instead"
    )


def _check(path: str, layer: MoE, adapted: bool = False) -> Plan:
    plan: Plan | None = getattr(layer, "_hf_plan", None)
    skeleton = getattr(layer, "_hf_block", None)
    router_kind = type(layer.router).__name__
    if plan is None or skeleton is None:
        raise _refuse(
            path,
            layer,
            "it was never a transformers block (built by moelab, e.g. upcycle or MoE); "
            "a transformers model has no place for it",
        )
    from ..methods import get_method

    # another preset of the block's router family (smoe-sg of a sharede-v3 block) is the same
    # block when its rule options agree, which the check below does
    if get_method(layer.method).router != get_method(plan.method).router:
        family = get_method(layer.method).router
        lost = _LOST.get(family, f"the {router_kind} rule '{get_method(layer.method).summary}'")
        raise _refuse(
            path,
            layer,
            f"{type(skeleton).__name__} has no counterpart of method {layer.method!r} (it was "
            f"converted as {plan.method!r}); {lost} would be lost",
        )
    got, want = _router_options(layer), _expected_options(plan)
    diff = {k: got.get(k) for k in want if got.get(k) != want[k]}
    if diff:
        raise _refuse(
            path,
            layer,
            f"router options {diff} differ from what {type(skeleton).__name__} expresses "
            f"({ {k: want[k] for k in diff} }); they would be lost",
        )
    if bool(getattr(layer.router, "hashed", False)) != bool(plan.extra.get("hash")):
        raise _refuse(
            path,
            layer,
            f"it routes {'by its token id table' if plan.extra.get('hash') is False else 'by top-K'} now "
            f"(layer_index={layer.layer_index}), {type(skeleton).__name__} the other way",
        )
    if layer.experts.activation != plan.extra.get("activation", "swiglu"):
        raise _refuse(
            path, layer, f"its experts' activation {layer.experts.activation!r} differs from the block's"
        )
    if (layer.shared is None) != (plan.shared_name is None):
        raise _refuse(path, layer, "its shared experts differ from the block's")
    if not adapted and any(
        parametrize.is_parametrized(m) for m in layer.modules()
    ):  # a LoRA / RepLoRA update
        raise _refuse(
            path,
            layer,
            "its weights carry an adapter's update (moelab.adapters); merge_adapter(model) first to fold it in, "
            "or write the adapter for PEFT with moelab.hf.lora.export_peft",
        )
    return plan


def block_plan(path: str, layer: MoE) -> Plan:
    """The :class:`~moelab.hf.convert.Plan` of a converted layer that can go back to its
    transformers block (what :func:`to_hf` checks: a ``ValueError`` naming what would be lost
    otherwise), an adapter's update on it allowed; ``path`` names the layer in the message."""
    return _check(path, layer, adapted=True)


def _sources(layer: MoE, plan: Plan) -> dict[str, torch.Tensor]:
    """Each tensor of the transformers block by its name in the block, from the moelab tensor it
    is copied from (a slice of the expert stacks for listed experts)."""
    r = plan.router_name
    out: dict[str, torch.Tensor] = {f"{r}.{plan.weight_name}": layer.router.weight}
    if plan.bias_owner:
        name = plan.bias_name if plan.bias_owner == "block" else f"{r}.{plan.bias_name}"
        out[name] = layer.router.selection_bias
    if plan.extra.get("hash"):  # DeepSeek-V4's token id → experts table
        out[f"{r}.tid2eid"] = layer.router.tid2eid
    w_in, w_out, h = layer.experts.w_in, layer.experts.w_out, plan.d_hidden
    if plan.experts_stacked:
        out["experts.gate_up_proj"], out["experts.down_proj"] = w_in, w_out
    else:
        for i in range(plan.num_experts):
            out[f"experts.{i}.gate_proj.weight"] = w_in[i, :h]
            out[f"experts.{i}.up_proj.weight"] = w_in[i, h:]
            out[f"experts.{i}.down_proj.weight"] = w_out[i]
    if plan.shared_name:
        shared = layer.shared
        mlp = shared.mlp if isinstance(shared, GatedSharedExpert) else shared
        hs = mlp.fc_in.weight.shape[0] // 2
        s = plan.shared_name
        out[f"{s}.gate_proj.weight"] = mlp.fc_in.weight[:hs]
        out[f"{s}.up_proj.weight"] = mlp.fc_in.weight[hs:]
        out[f"{s}.down_proj.weight"] = mlp.fc_out.weight
        if plan.shared_gate:
            out["shared_expert_gate.weight"] = shared.gate.weight
    return out


def _block_of(layer: MoE, plan: Plan) -> nn.Module:
    """The block rebuilt from its meta skeleton, each tensor a copy of its moelab counterpart in
    that tensor's dtype and device (a model cast after conversion exports as cast: float64 stays
    float64, bf16 experts with a float32 selection bias stay so)."""
    block = _copy(layer._hf_block)  # every tensor on the meta device
    block.train(layer.training)
    sources = _sources(layer, plan)
    with torch.no_grad():
        for name, src in sources.items():
            owner_path, _, attr = name.rpartition(".")
            owner = block.get_submodule(owner_path) if owner_path else block
            old = getattr(owner, attr)
            if tuple(old.shape) != tuple(src.shape):
                raise ValueError(
                    f"{type(block).__name__}.{name} has shape {tuple(old.shape)}; its moelab counterpart "
                    f"{tuple(src.shape)} (the layer was changed after conversion)"
                )
            value = src.detach().clone()
            if isinstance(old, nn.Parameter):
                setattr(owner, attr, nn.Parameter(value, requires_grad=old.requires_grad))
            else:
                owner._buffers[attr] = value
    # a tensor the plan does not map (none in a convertible block) would stay on the meta device
    for name, t in [*block.named_parameters(), *block.named_buffers()]:
        if t.is_meta:
            raise ValueError(f"{type(block).__name__}.{name} has no moelab counterpart to restore from")
    return block


def _copy(skeleton: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(skeleton)


def to_hf(model: nn.Module) -> nn.Module:
    """Give every moelab layer of ``model`` that came from :func:`moelab.from_hf` back its
    transformers block, with the layer's current weights (the exact inverse: same outputs).

    Args:
        model: a converted transformers model, or one converted layer.

    Returns:
        the transformers block for a layer; for a model, the same model with its layers replaced
        in place (all or nothing), ready for ``save_pretrained``.

    Raises:
        ValueError: ``model`` holds no moelab layer, or a layer's method or options have no
            counterpart in its transformers block (the message names the method and what would
            be lost; use :func:`moelab.save` / :func:`moelab.load` for those).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
    if isinstance(model, MoE):
        return _block_of(model, _check("", model))
    layers = {id(m): m for m in moe_layers(model)}
    if not layers:
        raise ValueError(
            f"model of type {type(model).__name__} holds no moelab MoE layer; nothing to give back"
        )
    paths = [(p, m) for p, m in model.named_modules() if id(m) in layers]
    blocks = [(p, _block_of(m, _check(p, m))) for p, m in paths]  # all checked before any change
    for path, block in blocks:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, block)
    recipe = [s for s in getattr(model, "_moelab_recipe", []) if s.get("op") not in ("from_hf", "set_method")]
    if hasattr(model, "_moelab_recipe"):
        model._moelab_recipe = recipe
    return model
