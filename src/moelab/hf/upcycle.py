"""Sparse upcycling: replace the dense MLPs of a model by MoE layers whose experts copy them.

Komatsuzaki et al. 2023 ("Sparse Upcycling"), the VIT setting of CompeteSMoE (2025) (§5.1 "Tasks" and App. H,
"Visual Instruction Tuning"): "each expert is initialized from its corresponding pretrained MLP,
while the Top-K router is learned from scratch", the router "initialized ... using Gaussian noise
N(0, 0.02), following ... GPT-2" (std 0.02; CompeteSMoE (2025) uses N_E = 4 experts, K = 2 there).  Since
all experts are equal, ``Σ_k w_k · FFN(x) = FFN(x)`` whenever the routing weights sum to 1, so
the upcycled model computes exactly what the dense one did until training moves the experts
apart.  For methods with ``S`` shared experts (``sharede-v2``, ``sharede-v3``) the routed experts
and each shared expert copy ``W_in`` and carry ``W_out / (S + 1)`` (and ``b_out / (S + 1)``),
which keeps the identity.  Methods whose weights do not sum to 1 (``sigma-moe``, ``smoe`` with
``renormalize=False``) change the output by the factor ``Σ_k w_k``.

Recognised MLPs (``SUPPORTED_MLPS``):

* GPT-2 style: ``c_fc`` / ``c_proj`` ``Conv1D`` (weights stored ``(in, out)``) and ``act``;
* LLaMA style: ``gate_proj`` / ``up_proj`` / ``down_proj`` ``Linear`` with a SiLU ``act_fn``
  (SwiGLU; Mistral, Qwen, Gemma-with-SiLU, ...);
* ViT / SigLIP / CLIP / timm style: ``fc1`` / ``fc2`` ``Linear`` with ``activation_fn``, ``act``
  or ``act_fn``;
* moelab's own :class:`moelab.experts.MLP` (``fc_in`` / ``fc_out``);
* ``nn.Sequential(Linear, activation, Linear)``.

Activations map to moelab's: ReLU, GELU (exact or tanh), CLIP's quick GELU, SiLU; others are
refused.  Dropout after the MLP (GPT-2's ``dropout``, timm's ``drop2``) is kept after the MoE
layer; dropout between the two projections (timm's ``drop1``) is dropped (identical in eval
mode).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from ..layer import MoE
from ..methods import get_method
from ..routers import ROUTERS, router_options

__all__ = ["SUPPORTED_MLPS", "find_mlps", "upcycle"]

SUPPORTED_MLPS = (
    "GPT-2 Conv1D MLP (c_fc, c_proj, act)",
    "LLaMA-style SwiGLU MLP (gate_proj, up_proj, down_proj, act_fn=silu)",
    "ViT/SigLIP/CLIP/timm MLP (fc1, fc2, activation_fn|act|act_fn)",
    "moelab.experts.MLP (fc_in, fc_out)",
    "nn.Sequential(Linear, activation, Linear)",
)

#: std of the upcycled router's N(0, 0.02²) init (CompeteSMoE (2025) App. H, VIT stage hyper-parameters)
ROUTER_INIT_STD = 0.02


class _Dense:
    """The weights of one recognised dense MLP, in ``nn.Linear`` layout."""

    def __init__(self, w_in: Tensor, b_in, w_out: Tensor, b_out, activation: str, dropout: float) -> None:
        self.w_in, self.b_in, self.w_out, self.b_out = w_in, b_in, w_out, b_out
        self.activation, self.dropout = activation, dropout

    @property
    def d_model(self) -> int:
        return self.w_in.shape[1]

    @property
    def d_hidden(self) -> int:
        return self.w_out.shape[1]


def _activation_name(act: Any) -> str | None:
    """moelab's name for a dense MLP's activation (module or function), else ``None``."""
    from ..functional import ACTIVATIONS

    for name, fn in ACTIVATIONS.items():
        if act is fn:
            return name
    if act in (F.relu, torch.relu):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if act is F.silu:
        return "silu"
    cls = type(act).__name__
    if cls == "GELU":  # torch.nn.GELU
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    if cls == "GELUActivation":  # transformers "gelu" (exact; gelu_python is the same function)
        return "gelu"
    return {
        "ReLU": "relu",
        "NewGELUActivation": "gelu_tanh",
        "GELUTanh": "gelu_tanh",
        "PytorchGELUTanh": "gelu_tanh",
        "SiLU": "silu",
        "SiLUActivation": "silu",
        "QuickGELUActivation": "quick_gelu",
    }.get(cls)


def _bias(layer: nn.Module) -> Tensor | None:
    return getattr(layer, "bias", None)


def _dropout_p(module: nn.Module | None) -> float:
    return float(module.p) if isinstance(module, nn.Dropout) else 0.0


def _act_of(module: nn.Module, names: Iterable[str]) -> tuple[str | None, Any]:
    for n in names:
        if hasattr(module, n):
            act = getattr(module, n)
            return _activation_name(act), act
    return None, None


def _refuse_activation(module: nn.Module, act: Any) -> None:
    raise ValueError(
        f"{type(module).__name__} uses activation {act!r}, which moelab experts do not have; "
        "supported: ReLU, GELU (exact or tanh), quick GELU, SiLU (SwiGLU for gate/up/down MLPs)"
    )


def _as_dense(module: nn.Module) -> _Dense | None:
    """The dense weights of ``module`` if it is a recognised MLP, else ``None``."""
    if all(hasattr(module, n) for n in ("c_fc", "c_proj", "act")) and type(module.c_fc).__name__ == "Conv1D":
        name, act = _act_of(module, ("act",))
        if name is None:
            _refuse_activation(module, act)
        c_fc, c_proj = module.c_fc, module.c_proj  # Conv1D: y = x @ W + b, W (in, out)
        return _Dense(
            c_fc.weight.T, c_fc.bias, c_proj.weight.T, c_proj.bias, name, _dropout_p(module.dropout)
        )
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        name, act = _act_of(module, ("act_fn", "act", "activation_fn"))
        if name != "silu":
            _refuse_activation(module, act)
        g, u, d = module.gate_proj, module.up_proj, module.down_proj
        if (_bias(g) is None) != (_bias(u) is None):
            raise ValueError(
                f"{type(module).__name__} with a bias on only one of gate_proj/up_proj is not supported"
            )
        b_in = None if _bias(g) is None else torch.cat([g.bias, u.bias])
        return _Dense(torch.cat([g.weight, u.weight]), b_in, d.weight, d.bias, "swiglu", 0.0)
    for first, second in (("fc1", "fc2"), ("fc_in", "fc_out")):
        if isinstance(getattr(module, first, None), nn.Linear) and isinstance(
            getattr(module, second, None), nn.Linear
        ):
            name, act = _act_of(module, ("activation_fn", "act", "act_fn"))
            if name is None:
                _refuse_activation(module, act)
            if getattr(module, "norm", None) is not None and not isinstance(module.norm, nn.Identity):
                raise ValueError(
                    f"{type(module).__name__} with a norm between {first} and {second} is not supported"
                )
            f1, f2 = getattr(module, first), getattr(module, second)
            return _Dense(
                f1.weight, f1.bias, f2.weight, f2.bias, name, _dropout_p(getattr(module, "drop2", None))
            )
    if isinstance(module, nn.Sequential) and len(module) == 3:
        f1, act, f2 = module
        if isinstance(f1, nn.Linear) and isinstance(f2, nn.Linear) and f1.out_features == f2.in_features:
            name = _activation_name(act)
            if name is None and (
                any(True for _ in act.parameters()) or isinstance(act, (nn.Identity, nn.Dropout))
            ):
                return None  # e.g. Linear, LayerNorm, Linear: not an MLP
            if name is None:
                _refuse_activation(module, act)
            return _Dense(f1.weight, f1.bias, f2.weight, f2.bias, name, 0.0)
    return None


def find_mlps(model: nn.Module) -> list[str]:
    """The qualified names of the recognised dense MLPs of ``model``, in module order.

    A recognised MLP's own submodules are not searched again; ``""`` is ``model`` itself.
    """
    found: list[str] = []

    def visit(module: nn.Module, name: str) -> None:
        if isinstance(module, MoE):
            return  # already sparse (its shared experts are not dense MLPs to upcycle)
        if _as_dense(module) is not None:
            found.append(name)
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return found


def _router_kwargs(method: str, options: dict[str, Any]) -> dict[str, Any]:
    preset = get_method(method)
    if "init_std" in router_options(ROUTERS[preset.router]) and "init_std" not in options:
        return {"init_std": ROUTER_INIT_STD}
    return {}


def _build_moe(
    dense: _Dense, num_experts: int, top_k: int, method: str, options: dict[str, Any]
) -> nn.Module:
    w = dense.w_in
    layer = MoE(
        dense.d_model,
        num_experts,
        top_k,
        d_hidden=dense.d_hidden,
        method=method,
        activation=dense.activation,
        bias=dense.b_in is not None or dense.b_out is not None,
        **_router_kwargs(method, options),
        **options,
    )
    layer.to(device=w.device, dtype=w.dtype)
    share = 1.0 / (1 + layer.num_shared)  # the routed experts and each shared expert carry W_out/(S+1)
    with torch.no_grad():
        bank = layer.experts
        bank.w_in.copy_(dense.w_in.expand_as(bank.w_in))
        bank.w_out.copy_(dense.w_out.expand_as(bank.w_out) * share)
        if bank.b_in is not None:
            bank.b_in.copy_(
                torch.zeros_like(bank.b_in) if dense.b_in is None else dense.b_in.expand_as(bank.b_in)
            )
            bank.b_out.copy_(
                torch.zeros_like(bank.b_out)
                if dense.b_out is None
                else dense.b_out.expand_as(bank.b_out) * share
            )
        if layer.shared is not None:
            S = layer.num_shared
            fc_in, fc_out = layer.shared.fc_in, layer.shared.fc_out
            if dense.activation == "swiglu":  # [gate_1..gate_S | up_1..up_S]
                gate, up = dense.w_in.chunk(2)
                fc_in.weight.copy_(torch.cat([gate.repeat(S, 1), up.repeat(S, 1)]))
            else:
                fc_in.weight.copy_(dense.w_in.repeat(S, 1))
            fc_out.weight.copy_(dense.w_out.repeat(1, S) * share)
            if fc_in.bias is not None:
                if dense.b_in is None:
                    fc_in.bias.zero_()
                elif dense.activation == "swiglu":
                    bg, bu = dense.b_in.chunk(2)
                    fc_in.bias.copy_(torch.cat([bg.repeat(S), bu.repeat(S)]))
                else:
                    fc_in.bias.copy_(dense.b_in.repeat(S))
                fc_out.bias.copy_(
                    torch.zeros_like(fc_out.bias) if dense.b_out is None else dense.b_out * share
                )
    if dense.dropout > 0:
        return nn.Sequential(layer, nn.Dropout(dense.dropout))
    return layer


def upcycle(
    model: nn.Module,
    num_experts: int,
    top_k: int,
    method: str = "smoe",
    layers: Iterable[int] | None = None,
    **options: Any,
) -> nn.Module:
    """Replace the dense MLPs of ``model`` (in place) by :class:`moelab.MoE` layers.

    Args:
        model: a torch or transformers model, or a single recognised MLP.
        num_experts: experts per MoE layer, N.
        top_k: experts per token, K.
        method: a name from :func:`moelab.methods`.
        layers: indices into the model's recognised MLPs (:func:`find_mlps`, module order) to
            upcycle, e.g. ``range(1, L, 2)`` for every other block (GLaM); ``None``: all.
        **options: method options passed to every :class:`moelab.MoE` (the router's
            ``init_std`` defaults to 0.02 when the router has one).

    Returns:
        ``model`` with its MLPs replaced; for a single MLP, the new layer.  The new layers keep
        the dense weights' dtype and device, and the model's train/eval mode.

    Raises:
        ValueError: no recognised MLP, an unsupported activation, or bad sizes / indices.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
    _validate.positive_int("num_experts", num_experts)
    _validate.int_in_range("top_k", top_k, 1, num_experts)
    get_method(method)
    names = find_mlps(model)
    if not names:
        raise ValueError(
            f"model of type {type(model).__name__} has no recognisable dense MLP; supported: {list(SUPPORTED_MLPS)}"
        )
    if layers is not None:
        layers = list(layers)
        for i in layers:
            _validate.int_in_range("layers", i, 0, len(names) - 1)
        names = [names[i] for i in sorted(set(layers))]
    if names == [""]:
        return _build_moe(_as_dense(model), num_experts, top_k, method, options).train(model.training)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense_module = getattr(parent, attr)
        new = _build_moe(_as_dense(dense_module), num_experts, top_k, method, options)
        new.train(dense_module.training)
        if isinstance(parent, nn.Sequential) or attr.isdigit():
            parent[int(attr)] = new
        else:
            setattr(parent, attr, new)
    # what moelab.save records to rebuild the model offline (transformers config + these steps)
    recipe = list(getattr(model, "_moelab_recipe", []))
    recipe.append({"op": "upcycle", "num_experts": num_experts, "top_k": top_k, "method": method,
                   "layers": layers, "options": dict(options)})  # fmt: skip
    model._moelab_recipe = recipe
    if hasattr(type(model), "save_pretrained"):  # a transformers model: it cannot read the layers back
        from .convert import guard_save_pretrained

        guard_save_pretrained(model)
    return model


# ---------------------------------------------------------------------------------------- CLI + reload


def load_hf_model(source: str | Path) -> nn.Module:
    """A transformers model from a local ``save_pretrained`` directory (weights loaded) or a
    config JSON file / directory holding only ``config.json`` (random init under the seed)."""
    import transformers

    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(
            f"--model {str(source)!r} does not exist (expected a local directory or a config JSON)"
        )
    config_file = source / "config.json" if source.is_dir() else source
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(config_file)!r} is missing; --model needs a transformers config.json")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {str(config_file)!r} is not valid JSON ({exc})") from None
    if "model_type" not in raw:
        raise ValueError(
            f"--model {str(config_file)!r} has no 'model_type'; expected a transformers config.json"
        )
    model_type = raw.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **raw)
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if arch is not None and not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(
            f"--model {str(config_file)!r} has architectures[0]={arch!r}, which is not a transformers "
            "model class; expected e.g. 'LlamaForCausalLM'"
        )
    if source.is_dir() and any(source.glob("*.bin")) and not any(source.glob("*.safetensors")):
        raise ValueError(
            f"--model {str(source)!r} holds .bin weights (a pickle, which moelab does not read); "
            "save the model with safetensors (save_pretrained's default) and run again"
        )
    has_weights = source.is_dir() and any(source.glob("*.safetensors"))
    if cls is None:
        cls = transformers.AutoModel
        return (
            cls.from_config(config) if not has_weights else cls.from_pretrained(source, local_files_only=True)
        )
    if has_weights:
        return cls.from_pretrained(source, local_files_only=True)
    return cls(config)
