"""Hugging Face transformers MoE blocks → :class:`moelab.MoE` layers with the same outputs.

:func:`from_hf` converts one block, or every supported block inside a model (in place).  The
weights are copied (transformers' experts already use moelab's stacked ``nn.Linear`` layout:
``gate_up_proj (N, 2h, d)`` laid out ``[gate | up]`` = ``ExpertBank.w_in`` with ``swiglu``,
``down_proj (N, d, h)`` = ``ExpertBank.w_out``); the router becomes the moelab router of the same
rule:

==========================  ==============  ===================================================
transformers block          moelab method   router options
==========================  ==============  ===================================================
``MixtralSparseMoeBlock``   ``smoe``        softmax over the top-K (Mixtral renormalises)
``Qwen3MoeSparseMoeBlock``  ``smoe``        ``renormalize = norm_topk_prob``
``OlmoeSparseMoeBlock``     ``smoe``        ``renormalize = norm_topk_prob``
``Qwen2MoeSparseMoeBlock``  ``sharede-v2``  ``renormalize = norm_topk_prob``; the shared expert
                                            keeps its sigmoid gate (:class:`GatedSharedExpert`)
``DeepseekV3MoE``           ``sharede-v3``  ``selection_bias`` ← ``e_score_correction_bias``,
                                            ``num_groups`` / ``topk_groups`` (group-limited
                                            routing), ``scale`` ← ``routed_scaling_factor``,
                                            ``normalize`` ← ``norm_topk_prob``
==========================  ==============  ===================================================

Not supported (refused with a ``ValueError``, never silently changed): Mixtral's training-time
``router_jitter_noise > 0``; experts with biases, a transposed or interleaved weight layout, no
gate, or an activation other than SiLU (moelab's ``swiglu``).  Not carried over: transformers'
router-logit recording (``output_router_logits``) — use ``layer.last_routing`` and
``moelab.aux_loss(model)`` instead.  Differences to keep in mind: the converted layers take
their aux-loss coefficients from the block's config (``router_aux_loss_coef`` → ``balance_coef``,
no z-loss), and a converted ``sharede-v3`` layer updates its selection bias during training
(DeepSeek-V3's aux-loss-free balancing, γ = 1e-3), which transformers does not do.  transformers
computes the DeepSeek-V3 router in float32 whatever the model dtype; moelab in the model dtype.

Fine-tuning with the transformers ``Trainer`` (converted or upcycled models alike):
:mod:`moelab.hf.trainer`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..experts import MLP
from ..layer import MoE

__all__ = ["SUPPORTED_BLOCKS", "GatedSharedExpert", "from_hf"]

SUPPORTED_BLOCKS = (
    "MixtralSparseMoeBlock",
    "Qwen2MoeSparseMoeBlock",
    "Qwen3MoeSparseMoeBlock",
    "OlmoeSparseMoeBlock",
    "DeepseekV3MoE",
)


class GatedSharedExpert(nn.Module):
    """A shared expert scaled by a learned sigmoid gate: ``sigmoid(g·x) · MLP(x)`` (Qwen2-MoE).

    Used as ``MoE.shared`` of a converted Qwen2-MoE block; moelab's own ``sharede-v2`` adds its
    shared experts with weight 1.
    """

    def __init__(self, mlp: nn.Module, d_model: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.gate = nn.Linear(d_model, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


def _name(module: nn.Module) -> str:
    return type(module).__name__


def _check_experts(experts: nn.Module, block: str) -> None:
    problems = []
    if getattr(experts, "has_bias", False):
        problems.append("expert biases")
    if getattr(experts, "is_transposed", False):
        problems.append("transposed expert weights")
    if not getattr(experts, "has_gate", True) or not hasattr(experts, "gate_up_proj"):
        problems.append("experts without a gate projection")
    if not getattr(experts, "is_concatenated", True):
        problems.append("interleaved gate/up weights")
    act = getattr(getattr(experts, "config", None), "hidden_act", None)
    act_cls = _name(getattr(experts, "act_fn", nn.Identity()))
    if (act is not None and act != "silu") or (act is None and act_cls not in ("SiLU", "SiLUActivation")):
        problems.append(f"activation {act or act_cls!r} (only 'silu' maps to moelab's 'swiglu')")
    if problems:
        raise ValueError(f"{block} with {', '.join(problems)} is not supported by moelab.from_hf")


def _swiglu_mlp(hf_mlp: nn.Module, d_model: int) -> MLP:
    """A transformers ``gate_proj / up_proj / down_proj`` MLP as a moelab :class:`MLP`."""
    hidden = hf_mlp.gate_proj.out_features
    mlp = MLP(d_model, hidden, activation="swiglu", bias=False)
    w = hf_mlp.gate_proj.weight
    mlp.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        mlp.fc_in.weight.copy_(torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight], dim=0))
        mlp.fc_out.weight.copy_(hf_mlp.down_proj.weight)
    return mlp


def _coefs(config) -> dict[str, float]:
    coef = getattr(config, "router_aux_loss_coef", None)
    out = {"z_coef": 0.0}
    if coef is not None:
        out["balance_coef"] = float(coef)
    return out


def _convert_block(block: nn.Module) -> MoE:
    name = _name(block)
    gate, experts = block.gate, block.experts
    _check_experts(experts, name)
    config = getattr(experts, "config", None)
    num_experts, h2, d_model = experts.gate_up_proj.shape
    top_k = int(gate.top_k)
    w = gate.weight
    options: dict = {}
    if name == "MixtralSparseMoeBlock":
        if getattr(block, "jitter_noise", 0) > 0:
            raise ValueError(
                f"MixtralSparseMoeBlock with router_jitter_noise={block.jitter_noise} is not supported by "
                "moelab.from_hf (moelab has no input jitter); set config.router_jitter_noise=0"
            )
        method = "smoe"
        options.update(_coefs(config))
    elif name in ("Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock"):
        method = "sharede-v2" if name == "Qwen2MoeSparseMoeBlock" else "smoe"
        options.update(_coefs(config), renormalize=bool(gate.norm_topk_prob))
    else:  # DeepseekV3MoE
        method = "sharede-v3"
        options.update(
            normalize=bool(gate.norm_topk_prob),
            num_groups=int(gate.num_group),
            topk_groups=int(gate.topk_group),
            scale=float(gate.routed_scaling_factor),
        )
    layer = MoE(d_model, num_experts, top_k, d_hidden=h2 // 2, method=method, activation="swiglu", **options)
    layer.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(w)
        layer.experts.w_in.copy_(experts.gate_up_proj)
        layer.experts.w_out.copy_(experts.down_proj)
        if name == "DeepseekV3MoE":
            layer.router.selection_bias.copy_(gate.e_score_correction_bias)
    if name == "Qwen2MoeSparseMoeBlock":
        shared = GatedSharedExpert(_swiglu_mlp(block.shared_expert, d_model), d_model)
        shared.gate.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            shared.gate.weight.copy_(block.shared_expert_gate.weight)
        layer.shared = shared
    elif name == "DeepseekV3MoE":
        layer.shared = _swiglu_mlp(block.shared_experts, d_model)
    layer.train(block.training)
    return layer


def from_hf(module: nn.Module) -> nn.Module:
    """Convert transformers MoE blocks to :class:`moelab.MoE` layers with identical outputs.

    Args:
        module: a supported block (see :data:`SUPPORTED_BLOCKS` and the module docstring), or a
            model containing such blocks.

    Returns:
        the new :class:`moelab.MoE` for a block; for a model, the same model with every
        supported block replaced in place (its other modules untouched).

    Raises:
        ValueError: ``module`` is neither a supported block nor contains one, or a block uses a
            feature moelab does not reproduce.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={module!r} is not allowed; expected a torch.nn.Module")
    if _name(module) in SUPPORTED_BLOCKS:
        return _convert_block(module)
    targets = [(n, m) for n, m in module.named_modules() if _name(m) in SUPPORTED_BLOCKS]
    if not targets:
        raise ValueError(
            f"module of type {_name(module)} is not a supported transformers MoE block and contains none; "
            f"supported: {list(SUPPORTED_BLOCKS)}"
        )
    converted = [(path, _convert_block(block)) for path, block in targets]  # all or nothing
    for path, layer in converted:
        parent_path, _, attr = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, attr, layer)
    # what moelab.save records to rebuild the model offline (transformers config + this step)
    module._moelab_recipe = [*getattr(module, "_moelab_recipe", []), {"op": "from_hf"}]
    return module
