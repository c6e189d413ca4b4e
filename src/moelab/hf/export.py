"""moelab layers back to Hugging Face transformers MoE blocks: :func:`to_hf`, the inverse of
:func:`moelab.from_hf`, rebuilds each converted layer's original block and copies its current
weights back, so that ``save_pretrained`` of the result loads in plain transformers; a layer whose
rule has no transformers counterpart is refused naming the method, and
:func:`guard_save_pretrained` makes ``save_pretrained`` raise while moelab layers remain.
docs/scaling.md ("``from_hf``, ``to_hf``, ``set_method``") says what is copied back and what is
refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layer import MoE, moe_layers
from .convert import GatedSharedExpert, _Plan, guard_save_pretrained

__all__ = ["guard_save_pretrained", "to_hf"]  # the guard lives in .convert (which installs it)

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


def _expected_options(plan: _Plan) -> dict[str, Any]:
    o = plan.options
    if plan.method == "sharede-v3":
        return {
            "normalize": o.get("normalize", False),
            "scale": float(o.get("scale", 1.0)),
            "num_groups": o.get("num_groups", 1),
            "topk_groups": o.get("topk_groups", o.get("num_groups", 1)),
            "selection_bias": bool(o.get("selection_bias", False)),
            "expert_dropout": 0.0,
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


def _check(path: str, layer: MoE) -> _Plan:
    plan: _Plan | None = getattr(layer, "_hf_plan", None)
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
    if (layer.shared is None) != (plan.shared_name is None):
        raise _refuse(path, layer, "its shared experts differ from the block's")
    return plan


def _block_of(layer: MoE, plan: _Plan) -> nn.Module:
    skeleton: nn.Module = layer._hf_block
    w = layer.router.weight
    block = _copy(skeleton).to_empty(device=w.device)
    block.train(layer.training)
    router = getattr(block, plan.router_name)
    with torch.no_grad():
        dict(router.named_parameters())[plan.weight_name].copy_(layer.router.weight)
        if plan.bias_owner:
            owner = block if plan.bias_owner == "block" else router
            getattr(owner, plan.bias_name).copy_(layer.router.selection_bias)
        experts = block.experts
        h = plan.d_hidden
        if plan.experts_stacked:
            experts.gate_up_proj.copy_(layer.experts.w_in)
            experts.down_proj.copy_(layer.experts.w_out)
        else:
            for i, m in enumerate(experts):
                m.gate_proj.weight.copy_(layer.experts.w_in[i, :h])
                m.up_proj.weight.copy_(layer.experts.w_in[i, h:])
                m.down_proj.weight.copy_(layer.experts.w_out[i])
        if plan.shared_name:
            shared = layer.shared
            mlp = shared.mlp if isinstance(shared, GatedSharedExpert) else shared
            hf_mlp = getattr(block, plan.shared_name)
            hs = hf_mlp.gate_proj.out_features
            hf_mlp.gate_proj.weight.copy_(mlp.fc_in.weight[:hs])
            hf_mlp.up_proj.weight.copy_(mlp.fc_in.weight[hs:])
            hf_mlp.down_proj.weight.copy_(mlp.fc_out.weight)
            if plan.shared_gate:
                block.shared_expert_gate.weight.copy_(shared.gate.weight)
    # tensors the plan does not map (none in a convertible block) would be left uninitialised
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
