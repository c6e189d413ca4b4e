"""A moelab LoRA / RepLoRA adapter of a :func:`moelab.from_hf` model written for the original
transformers model: in PEFT's layout (:func:`export_peft`, loaded by ``PeftModel.from_pretrained``)
and in the per-expert ``[out, in]`` layout vLLM's MoE LoRA reads (:func:`export_vllm`).

PEFT (0.18 and later) reaches transformers 5's fused expert tensors through ``target_parameters``: a
``lora.ParamWrapper`` around the experts module for each targeted tensor.  Its file layout for a
tensor of ``E`` experts whose matrices map ``n`` inputs to ``m`` outputs is ``lora_A.weight
(E·r, n)`` (rows ``e·r … e·r + r − 1``: expert ``e``'s ``A``) and ``lora_B.weight (m, r·E)``
(column ``j·E + e``: column ``j`` of expert ``e``'s ``B``), whichever order the tensor stores its
two dimensions in: PEFT reads that order from the experts module's ``is_transposed`` attribute.
Here ``n`` and ``m`` come from what each tensor *is* (the conversion's plan: ``gate_up_proj`` maps
``d`` to ``[gate | up]``, ``down_proj`` maps ``h`` to ``d``), never from its shape, which is
ambiguous when ``2·I = H`` (a square ``gate_up_proj``) or ``I = H`` (a square ``down_proj``).  Two
targeted tensors of one module nest, the first registered innermost, so its keys carry
``base_layer.``: the order is read from the module, not assumed.

PEFT has one rank for a whole adapter and adapts ``gate_up_proj`` as one matrix.  moelab's separate
gate and up updates ``B_g A_g`` and ``B_u A_u`` are therefore written as one update of rank ``2r``,
``A = [A_g; A_u]`` and ``B = diag(B_g, B_u)``, and every update is padded with zero rows of ``A``
and columns of ``B`` to the largest rank ``R``, with ``lora_alpha = (α/r) · R`` so that PEFT's
``lora_alpha / R`` is moelab's scale.  Both are exact: the zeros add nothing.  RepLoRA is written as
the LoRA factors its reparameterisation computes (``φ₁(A)``, ``φ₂(B)``): the same update.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor, nn

from ..adapters import adapted_linears, adapted_weights, adapter_config
from ..io.atomic import atomic_write_bytes
from ..layer import MoE
from .export import block_plan

__all__ = ["export_peft", "export_vllm"]

_PREFIX = "base_model.model."


@dataclass
class _Update:
    """One adapted tensor of the transformers model and its factors."""

    module: str  # the transformers module's path
    param: str | None  # the tensor PEFT's target_parameters names; None: an nn.Linear (target_modules)
    order: list[str]  # the module's own tensors in registration order (PEFT's nesting order)
    experts: int | None
    rows: int  # m: the output width of one matrix
    cols: int  # n: its input width
    pieces: list[
        tuple[int, int, str, Tensor, Tensor]
    ]  # (start, stop, projection, A (E?, r, n), B (E?, m_s, r))


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(f"{what} cannot be exported: {why}")


def _layer_of(model: nn.Module, name: str) -> tuple[str, MoE] | None:
    """The moelab layer that holds the module named ``name``, and its path."""
    best = None
    for path, m in model.named_modules():
        if isinstance(m, MoE) and (path == "" or name == path or name.startswith(path + ".")):
            if best is None or len(path) > len(best[0]):
                best = (path, m)
    return best


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _updates(model: nn.Module) -> tuple[list[_Update], dict]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
    config = adapter_config(model)
    if config is None:
        raise ValueError(
            f"model of type {type(model).__name__} holds no adapter (moelab.adapters.add_adapter first)"
        )
    out = []
    with torch.no_grad():
        for owner_name, owner, tensor, adapted in adapted_weights(model):
            what = _join(owner_name, tensor)
            found = _layer_of(model, owner_name)
            if found is None or getattr(found[1], "_hf_plan", None) is None:
                raise _refuse(
                    what,
                    "it is not part of a layer converted by moelab.from_hf (a transformers model has no place for it)",
                )
            path, layer = found
            plan = block_plan(path, layer)  # the layer still is its transformers block
            skeleton = layer._hf_block
            if owner is layer.router and tensor == "weight":
                sub, _, param = plan.weight_name.rpartition(".")
                module = _join(path, plan.router_name, sub)
                order = [
                    n
                    for n, _ in skeleton.get_submodule(_join(plan.router_name, sub)).named_parameters(
                        recurse=False
                    )
                ]
                experts, rows, cols, names = None, plan.num_experts, plan.d_model, {0: "router"}
            elif owner is layer.experts and plan.experts_stacked:
                module, order = (
                    _join(path, "experts"),
                    [n for n, _ in skeleton.experts.named_parameters(recurse=False)],
                )
                experts, h = plan.num_experts, plan.d_hidden
                if tensor == "w_in":  # [gate | up] rows, as transformers 5 concatenates them
                    param, rows, cols, names = (
                        "gate_up_proj",
                        2 * h,
                        plan.d_model,
                        {0: "gate_proj", h: "up_proj"},
                    )
                else:
                    param, rows, cols, names = "down_proj", plan.d_model, h, {0: "down_proj"}
            else:
                why = (
                    "its transformers block lists its experts as modules (per-expert nn.Linear), not as the fused "
                    "tensors PEFT's target_parameters reach"
                    if owner is layer.experts
                    else "its tensor has no counterpart in the transformers block"
                )
                raise _refuse(what, why)
            pieces = []
            for (start, stop), f in sorted(zip(adapted.slices, adapted.factors), key=lambda t: t[0][0]):
                A, B = (t.detach().clone() for t in f.factors())
                pieces.append((start, stop, names[start], A, B))
            out.append(_Update(module, param, order, experts, rows, cols, pieces))
        for name, linear in adapted_linears(model):
            if _layer_of(model, name) is not None:
                raise _refuse(
                    name,
                    "it is an nn.Linear inside a moelab layer (its shared experts), which to_hf rebuilds",
                )
            m, n = linear.base.out_features, linear.base.in_features
            if linear.slices != [(0, m)]:
                raise _refuse(
                    name, f"its update covers rows {linear.slices} only (a fused moelab qkv projection)"
                )
            A, B = (t.detach().clone() for t in linear.factors[0].factors())
            out.append(_Update(name, None, [], None, m, n, [(0, m, name.rpartition(".")[2], A, B)]))
    return out, config


def _key(module: str, depth: int, factor: str) -> str:
    return f"{_PREFIX}{module}.{'base_layer.' * depth}lora_{factor}.weight"


def _alpha(scale: float, rank: int) -> float | int:
    alpha = scale * rank
    return int(alpha) if float(alpha).is_integer() else alpha


def _config(rank: int, alpha: float | int, modules: list[str], parameters: list[str]) -> dict:
    """An ``adapter_config.json`` of PEFT's LoRA: no dropout, no bias, no rsLoRA (α / r)."""
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": modules,
        "target_parameters": parameters or None,
    }


def _write(path: str | Path, tensors: dict[str, Tensor], config: dict) -> Path:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"path={str(path)!r} is not allowed: it is a file; expected a folder for the adapter"
        )
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path / "adapter_model.safetensors", save(tensors))
    atomic_write_bytes(path / "adapter_config.json", (json.dumps(config, indent=2) + "\n").encode())
    return path


def export_peft(model: nn.Module, path: str | Path) -> Path:
    """Write the LoRA / RepLoRA adapter of ``model`` (a transformers model converted with
    :func:`moelab.from_hf`) as a PEFT adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``) of the original transformers model.

    ``PeftModel.from_pretrained(transformers_model, path)`` then computes what the adapted moelab
    model computes: every expert's gate, up and down updates on the fused ``gate_up_proj`` /
    ``down_proj`` tensors and a router's update on its weight (``target_parameters``), the updates
    of the attention's ``nn.Linear`` layers (``target_modules``).

    Raises:
        ValueError: ``model`` holds no adapter, or an adapted tensor has no place in the
            transformers model (a layer not from ``from_hf``, switched to a method its block does
            not express, listed per-expert modules, shared experts, a fused moelab ``qkv``).
    """
    updates, config = _updates(model)
    rank = max(sum(A.shape[-2] for _, _, _, A, _ in u.pieces) for u in updates)
    tensors: dict[str, Tensor] = {}
    for u in updates:
        lead = () if u.experts is None else (u.experts,)
        dtype = u.pieces[0][3].dtype
        A = torch.zeros(*lead, rank, u.cols, dtype=dtype)
        B = torch.zeros(*lead, u.rows, rank, dtype=dtype)
        col = 0
        for start, stop, _, a, b in u.pieces:  # gate and up side by side: A stacked, B block-diagonal
            r = a.shape[-2]
            A[..., col : col + r, :] = a
            B[..., start:stop, col : col + r] = b
            col += r
        if u.experts is not None:  # PEFT's ParamWrapper: A (E·R, n), B (m, R·E) with column j·E + e
            A = A.reshape(u.experts * rank, u.cols)
            B = B.permute(1, 2, 0).reshape(u.rows, rank * u.experts)
        targeted = [n for n in u.order if any(v.module == u.module and v.param == n for v in updates)]
        depth = 0 if u.param is None else len(targeted) - 1 - targeted.index(u.param)
        tensors[_key(u.module, depth, "A")] = A
        tensors[_key(u.module, depth, "B")] = B
    scale = config["alpha"] / config["rank"]
    modules = [u.module for u in updates if u.param is None]
    parameters = [f"{u.module}.{u.param}" for u in updates if u.param is not None]
    return _write(path, tensors, _config(rank, _alpha(scale, rank), modules, parameters))


def export_vllm(model: nn.Module, path: str | Path) -> Path:
    """Write the adapter of ``model`` (as :func:`export_peft` takes it) in the per-expert layout
    vLLM's MoE LoRA reads: for expert ``e`` of the block at ``P``,
    ``base_model.model.P.experts.e.{gate_proj,up_proj,down_proj}.lora_A.weight (r, in)`` and
    ``.lora_B.weight (out, r)``, each expert's update in ``nn.Linear``'s ``[out, in]`` convention
    (``ΔW_e = (α/r) B_e A_e``, the transpose of the ``[E, in, out]`` reading of PEFT's fused layout
    that vLLM's kernels do not take); attention updates as PEFT writes them.

    Raises:
        ValueError: as :func:`export_peft`, and for a router update (vLLM's expert LoRA adapts the
            experts, not the router).
    """
    updates, config = _updates(model)
    tensors: dict[str, Tensor] = {}
    modules: set[str] = set()
    for u in updates:
        if u.param is not None and u.experts is None:
            raise _refuse(f"{u.module}.{u.param}", "vLLM's expert LoRA has no place for a router's update")
        for _, _, proj, A, B in u.pieces:
            modules.add(proj)
            if u.experts is None:
                tensors[_key(u.module, 0, "A")], tensors[_key(u.module, 0, "B")] = A, B
                continue
            for e in range(u.experts):  # a shared update is every expert's
                module = f"{u.module}.{e}.{proj}"
                tensors[_key(module, 0, "A")] = A[e] if A.dim() == 3 else A
                tensors[_key(module, 0, "B")] = B[e] if B.dim() == 3 else B
    return _write(
        path,
        tensors,
        _config(
            config["rank"], _alpha(config["alpha"] / config["rank"], config["rank"]), sorted(modules), []
        ),
    )
