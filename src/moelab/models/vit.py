"""A small ViT-style patch transformer for image classification (non-overlapping square patches, a
linear patch embedding plus a learned position embedding, pre-LayerNorm blocks of bidirectional
attention and a GELU MLP, mean-pooled patches, a linear head), whose attention is the standard one or
Active-Attention of Ho (2025), ``softmax(QKᵀ/√d) σ(V)``: the same
:func:`moelab.functional.multi_head_attention` the language models call, without the causal mask.
It exists to test the slides' image-classification claim at CPU scale (docs/results.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from ..functional import attention_activation, multi_head_attention
from ..io.model import Persistent

__all__ = ["PatchTransformer", "ViTConfig"]

#: ``standard``: softmax(QKᵀ/√d) V; ``active``: Active-Attention of Ho (2025), softmax(QKᵀ/√d) σ(V)


@dataclass
class ViTConfig:
    """Everything that defines a :class:`PatchTransformer`.

    Attributes:
        image_size: side of the square input images (8 for scikit-learn's digits).
        patch_size: side of a square patch; must divide ``image_size``.
        channels: input channels.
        num_classes: classes of the linear head.
        d_model: width.
        n_layer: attention blocks.
        n_head: heads per attention; must divide ``d_model``.
        mlp_ratio: MLP hidden width over ``d_model``.
        dropout: dropout on attention weights and residual branches.
        attention: ``standard`` (default) or ``active`` (Ho (2025)).
        attention_activation: σ of ``active`` attention, one of
            :data:`moelab.functional.ATTENTION_ACTIVATIONS` (default ``gelu``); refused with
            ``standard``.
    """

    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    mlp_ratio: int = 2
    dropout: float = 0.0
    attention: str = "standard"
    attention_activation: str | None = None

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size={self.patch_size} is not allowed with image_size={self.image_size}; "
                "it must divide the image side"
            )
        if self.d_model % self.n_head:
            raise ValueError(
                f"n_head={self.n_head} is not allowed with d_model={self.d_model}; it must divide d_model"
            )
        self.attention_activation = attention_activation(self.attention, self.attention_activation)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config keys {unknown} are not allowed; expected some of {sorted(known)}")
        return cls(**data)


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention over patches, standard or Active-Attention."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.value_activation = cfg.attention_activation if cfg.attention == "active" else None

    def forward(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        q, k, v = self.qkv(x).split(d, dim=2)
        y = multi_head_attention(
            q,
            k,
            v,
            self.n_head,
            causal=False,
            value_activation=self.value_activation,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj(y)


class _Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class PatchTransformer(Persistent, nn.Module):
    """ViT-style classifier: ``(B, C, S, S)`` images → ``(B, num_classes)`` logits."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.embed = nn.Linear(cfg.channels * p * p, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(1, cfg.num_patches, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)

    def patches(self, x: Tensor) -> Tensor:
        """``(B, C, S, S)`` → ``(B, num_patches, C·p·p)``, patches in row-major order."""
        B, C, S, _ = x.shape
        if (C, S) != (self.cfg.channels, self.cfg.image_size):
            raise ValueError(
                f"x of shape {tuple(x.shape)} is not allowed; expected (B, {self.cfg.channels}, "
                f"{self.cfg.image_size}, {self.cfg.image_size})"
            )
        p = self.cfg.patch_size
        x = x.reshape(B, C, S // p, p, S // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (S // p) ** 2, C * p * p)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(self.patches(x)) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h).mean(dim=1))

    def moelab_config(self) -> dict[str, Any]:
        """What :func:`moelab.save` records to rebuild this model (the :class:`ViTConfig`)."""
        return self.cfg.to_dict()

    @classmethod
    def from_moelab_config(cls, config: dict[str, Any]) -> PatchTransformer:
        return cls(ViTConfig.from_dict(config))
