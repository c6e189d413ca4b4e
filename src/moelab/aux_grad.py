"""The identity-with-backward functions that carry the aux-loss and step-balance gradients on a
layer's output (the Megatron-Core / torchtitan way to train on an aux loss): the losses leave a
forward through the autograd graph of its output, not through module state, so per-block
``torch.compile(fullgraph=True)`` and activation checkpointing trace them.  Also :func:`readout`,
the value of an aux loss that a user may add to a loss without counting its gradient twice."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["AuxLossInjection", "StepGradInjection", "readout"]


class AuxLossInjection(torch.autograd.Function):
    """Identity on the layer's output ``y`` whose backward adds ``scale · ∂aux``."""

    @staticmethod
    def forward(ctx, y: Tensor, aux: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        ctx.aux_dtype = aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.aux_dtype), None


@torch.library.custom_op("moelab::step_balance_grad", mutates_args=())
def _step_balance_grad(grad: Tensor, scale: Tensor, anchor: Tensor) -> Tensor:
    """``grad · scale``, read when the backward runs: ``anchor`` (the incoming gradient of the
    layer's output, unused) ties the read to the backward, and the op is opaque, so a compiler's
    partition cannot compute it in the forward, before :meth:`moelab.balance.StepBalance.loss` has
    written ``grad`` (``grad * scale`` alone would be: both are forward inputs)."""
    return grad * scale


@_step_balance_grad.register_fake
def _(grad: Tensor, scale: Tensor, anchor: Tensor) -> Tensor:
    return grad.new_empty(grad.shape, dtype=torch.promote_types(grad.dtype, scale.dtype))


class StepGradInjection(torch.autograd.Function):
    """Identity on the layer's output whose backward gives this forward's router probability sums
    ``Σ p (N,)`` the gradient ``scale · g``, ``g`` the buffer :meth:`moelab.balance.StepBalance.loss`
    fills (after the forward, before the backward) with the gradient of the step's global-scope
    losses: the global balance of a compiled, activation-checkpointed layer, with no routing kept on
    the module.  ``g`` is written through ``.data`` (autograd's version check would refuse a saved
    tensor changed in place; here the change is the point)."""

    @staticmethod
    def forward(ctx, y: Tensor, sums: Tensor, grad: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(grad, scale)
        ctx.sums_dtype = sums.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor, None, None]:
        grad, scale = ctx.saved_tensors
        return g, _step_balance_grad(grad, scale, g).to(ctx.sums_dtype), None, None


def _check_aux_weight(grad: Tensor, scale: Tensor) -> None:
    g, s = float(grad.detach().float()), float(scale.detach().float())
    if not math.isclose(g, s, rel_tol=1e-5, abs_tol=0.0):
        raise ValueError(
            f"moelab.aux_loss enters this loss with weight {g:.6g}, but the MoE layers already add its "
            f"gradient with weight {s:.6g}; expected the same weight: call moelab.set_aux_scale(model, {g:.6g}) "
            "before the forward (or add the aux loss to the loss unscaled)"
        )


def readout(value: Tensor, scale: Tensor) -> Tensor:
    """``value`` as a fresh leaf that may be added to a loss: its gradient only checks the weight
    (the aux gradient itself was attached to the layer's output in forward)."""
    out = value.detach().clone()
    if torch.is_grad_enabled():
        out.requires_grad_()
        out.register_hook(lambda grad: _check_aux_weight(grad, scale))
    return out
