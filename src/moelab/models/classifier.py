"""A pre-trained MoE language model turned into a text classifier (CompeteSMoE (2024) §6.3, App. C.3).

CompeteSMoE (2024): "remove the last layer and employ two randomly initialized fully connected layers as the
classifier", with the routers frozen ("Following Chen et al. (2023), we freeze the router").  The
LM head is dropped; the final hidden states are mean-pooled over the real (non-padding) tokens
and fed to ``Linear(d, d) → ReLU → Dropout → Linear(d, C)``.  Causal attention means right
padding never changes the real tokens' states, and the mask keeps padding out of the MoE layers
(their routing, balance and expert capacity).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..adapters import adapter_config, restore_adapter
from ..io.model import Persistent
from ..layer import moe_layers
from ..optim import param_groups
from .lm import TransformerLM

__all__ = ["LMClassifier", "freeze_all_but_experts", "freeze_routers"]


def freeze_routers(model: nn.Module) -> int:
    """Stop gradients to every router of ``model``; returns how many parameters were frozen."""
    frozen = 0
    for layer in moe_layers(model):
        for p in layer.router.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


def freeze_all_but_experts(lm: nn.Module) -> int:
    """Stop gradients to every parameter of ``lm`` but its MoE layers' experts (routed and
    shared): CompeteSMoE (2024) §6.3 "only optimize the experts' parameters" (attention,
    embeddings, norms, routers and dense FFNs frozen).  Returns how many parameters were frozen."""
    keep = {id(p) for layer in moe_layers(lm) for part in (layer.experts, layer.shared) if part is not None
            for p in part.parameters()}  # fmt: skip
    frozen = 0
    for p in lm.parameters():
        if id(p) not in keep and p.requires_grad:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


class LMClassifier(Persistent, nn.Module):
    """``(idx (B, L), mask (B, L)) → logits (B, C)`` on top of a :class:`TransformerLM` trunk."""

    def __init__(self, lm: TransformerLM, num_classes: int, dropout: float = 0.1) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} is not allowed; expected an integer >= 2")
        if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
            raise ValueError(f"dropout={dropout!r} is not allowed; expected a number in [0, 1)")
        d = lm.cfg.d_model
        lm.head = nn.Identity()  # the LM head is removed (its weight was tied to the embedding)
        self.lm = lm
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, num_classes)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: Tensor, mask: Tensor) -> Tensor:
        h = self.lm.features(idx, mask)  # (B, L, d); padding is routed by no MoE layer
        m = mask.to(h.dtype).unsqueeze(-1)  # (B, L, 1)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)  # (B, d)
        return self.fc2(self.drop(torch.relu(self.fc1(pooled))))

    def moelab_config(self) -> dict[str, Any]:
        """What :func:`moelab.save` records: the trunk's :class:`LMConfig`, classes, dropout."""
        config = {"lm": self.lm.cfg.to_dict(), "num_classes": self.fc2.out_features, "dropout": self.drop.p}
        adapter = adapter_config(self.lm)
        if adapter is not None:  # a LoRA / RepLoRA trunk (moelab finetune --adapter) rebuilds with it
            config["adapter"] = adapter
        return config

    @classmethod
    def from_moelab_config(cls, config: dict[str, Any]) -> LMClassifier:
        from .lm import LMConfig

        model = cls(TransformerLM(LMConfig.from_dict(config["lm"])), config["num_classes"], config["dropout"])
        if config.get("adapter"):
            restore_adapter(model.lm, config["adapter"], freeze=False)
        return model

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """The optimizer groups: weight decay on the matrices only (:func:`moelab.optim.param_groups`)."""
        return param_groups(self, weight_decay)
