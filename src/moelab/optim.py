"""The optimizer, Adam or AdamW with decoupled weight decay on the matrices only: one rule says
which parameters weight decay applies to (:func:`decayed_parameter_names`), the models own their
groups (``model.param_groups(weight_decay)``, which calls :func:`param_groups`), and
:func:`build_optimizer` builds the optimizer every trainer uses from them.  The command line
exposes it as ``--optimizer`` and ``--weight-decay`` (docs/cli.md, "Optimizer").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from . import _validate
from .experts.protocol import Experts

__all__ = [
    "OPTIMIZERS",
    "OwnsParamGroups",
    "build_optimizer",
    "check_optimizer",
    "decayed_parameter_names",
    "param_groups",
]

#: ``adam``: torch.optim.Adam without weight decay; ``adamw``: torch.optim.AdamW (Loshchilov &
#: Hutter 2019, decoupled weight decay), the decay on the matrices only
OPTIMIZERS = ("adam", "adamw")


@runtime_checkable
class OwnsParamGroups(Protocol):
    """A model that says how its parameters are optimised (moelab's models do)."""

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]: ...


def check_optimizer(name: object, weight_decay: object) -> None:
    """Refuse an unknown optimizer, a negative or infinite decay, and ``adam`` with a decay:
    Adam's ``weight_decay`` adds ``λθ`` to the gradient, which the moment estimates then rescale
    (an L2 penalty, not the decay AdamW applies to the weights); ``adamw`` is the decay users mean."""
    _validate.one_of("optimizer", name, OPTIMIZERS)
    _validate.non_negative("weight_decay", weight_decay)
    if name == "adam" and weight_decay > 0:
        raise ValueError(
            f"optimizer='adam' with weight_decay={weight_decay!r} is not allowed; expected weight_decay=0 with "
            "adam (its decay is an L2 term coupled to the gradient), or optimizer='adamw' for decoupled decay"
        )


def decayed_parameter_names(model: nn.Module) -> list[str]:
    """The names of the parameters weight decay applies to (as ``model.named_parameters()`` names
    them; a tied weight under each of its names).

    The rule is nanoGPT's: every tensor of two or more dimensions decays — linear and attention
    weights, router weight matrices and expert embeddings, token and position embeddings (the LM
    head is tied to the token embedding, so it is one matrix either way) — and no 0-dimensional or
    1-dimensional tensor does: norm scales and shifts, biases, learned temperatures (``xmoe``), the
    hyper-router's embedding vector.  Decay pulls a weight matrix towards zero; a scale, a shift or a
    temperature has no such resting point, and decaying it only changes what the layer computes.

    An expert bank (an :class:`moelab.experts.Experts`) holds each weight as a stack over its
    experts, first axis ``num_experts``: its parameters count their dimensions without that axis,
    so the ``(N, h)`` bias stack of an ``ExpertBank(bias=True)`` and the stacked BatchNorm scales of
    ``BatchedExperts`` do not decay while the ``(N, h, d)`` weight stacks do.  Buffers (``sharede-v3``'s
    selection bias, frozen hyper-network weights) are not parameters and are never optimised.
    """
    stacked = {
        id(p)
        for m in model.modules()
        if isinstance(m, Experts)
        for p in m.parameters(recurse=False)
        if p.dim() >= 1 and p.shape[0] == m.num_experts
    }
    named = model.named_parameters(remove_duplicate=False)  # every name of a tied weight
    return [n for n, p in named if p.dim() - (id(p) in stacked) >= 2]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """``model``'s trainable parameters as two optimizer groups: the matrices of
    :func:`decayed_parameter_names` with ``weight_decay``, every other one with none.

    Each parameter with ``requires_grad`` is in exactly one group (tied weights once); frozen ones
    (fine-tuning's routers) are left out.  Both groups are always there, either may be empty, so an
    optimizer's state has the same layout for every model.
    """
    weight_decay = _validate.non_negative("weight_decay", weight_decay)
    decayed = set(decayed_parameter_names(model))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in trainable if n in decayed], "weight_decay": weight_decay},
        {"params": [p for n, p in trainable if n not in decayed], "weight_decay": 0.0},
    ]


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """``torch.optim.Adam`` (``name="adam"``) or ``torch.optim.AdamW`` (``"adamw"``) over the
    groups ``model`` owns (``model.param_groups(weight_decay)``; :func:`param_groups` for a model
    without its own).

    With ``weight_decay=0`` both make exactly the same updates.  ``foreach``: one multi-tensor
    update per step (torch's default on GPUs; on the CPU torch picks the per-parameter loop, a
    visible share of a small model's step: docs/performance.md).
    """
    check_optimizer(name, weight_decay)
    _validate.positive("lr", lr)
    groups = (
        model.param_groups(weight_decay)
        if isinstance(model, OwnsParamGroups)
        else param_groups(model, weight_decay)
    )
    if not any(group["params"] for group in groups):
        raise ValueError(
            f"a {type(model).__name__} with no trainable parameter is not allowed; expected at least one "
            "parameter with requires_grad=True"
        )
    optimizer = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return optimizer(groups, lr=lr, foreach=True)
