"""Padding masks for the MoE layers a model's forward reaches without an argument.

A model hands its layers their input only (``self.mlp(hidden_states)``): a padding mask given to
the model's forward never reaches them, so padding would be routed, balanced and take expert
capacity.  :func:`masked_tokens` scopes a mask over one forward: within it, an :class:`moelab.MoE`
called without ``token_mask`` whose input has as many tokens as the mask routes the real tokens
alone, exactly as ``MoE(x, token_mask=mask)``.  The real tokens' indices are found once when the
scope opens (one host sync a forward, not one a layer) and an all-real mask masks nothing.

:func:`scope_padding` opens the scope around a module's forward with a forward pre-hook and a
forward hook that runs whatever happens (``always_call``): how :func:`moelab.from_hf` wires a
transformers model's ``attention_mask`` to its converted layers.  The scopes live on one
process-wide stack, a plain object that ``torch.compile`` reads (it guards on it; a
``ContextVar`` or ``threading.local`` it cannot read or guard): forwards of masked models in
several threads at once are not supported.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Scope", "current_mask", "masked_tokens", "scope_padding"]


class Scope:
    """A padding mask in force: ``mask`` (flat, bool, True for a real token) and ``real`` (the
    real tokens' flat indices, ``None`` when every token is real)."""

    __slots__ = ("mask", "owner", "real")

    def __init__(self, mask: Tensor, real: Tensor | None, owner: int) -> None:
        self.mask, self.real, self.owner = mask, real, owner


class _Stack:
    """The open scopes, innermost last (a plain attribute: torch.compile reads it and guards on it)."""

    scopes: tuple[Scope, ...] = ()


_STACK = _Stack()


def _scope(mask: Tensor, owner: int) -> Scope:
    if not isinstance(mask, Tensor) or mask.dim() == 0:
        raise ValueError(
            f"padding mask {mask!r} is not allowed; expected a tensor (batch, ...) of 0/1 or bool"
        )
    flat = mask.reshape(-1)
    flat = flat if flat.dtype == torch.bool else flat != 0
    real = flat.nonzero().squeeze(1)  # the one host sync of the forward
    return Scope(flat, None if real.numel() == flat.numel() else real, owner)


@contextlib.contextmanager
def masked_tokens(mask: Tensor | None) -> Iterator[None]:
    """Within the block, every :class:`moelab.MoE` called without ``token_mask`` on an input of
    ``mask.numel()`` tokens routes only the tokens where ``mask`` is true (``mask``: bool or 0/1,
    in the order of the layer's flattened input, e.g. ``(B, L)`` for ``(B, L, d)``); ``None``
    masks nothing.  For a model's forward: open it there, around the blocks."""
    if mask is None:
        yield
        return
    scope = _scope(mask, 0)
    _STACK.scopes = (*_STACK.scopes, scope)
    try:
        yield
    finally:
        _STACK.scopes = tuple(s for s in _STACK.scopes if s is not scope)


def current_mask(tokens: int) -> Scope | None:
    """The innermost open scope if it masks ``tokens`` tokens and some of them are padding, else
    ``None`` (an input of another length, e.g. a vision tower's, is not the mask's)."""
    scopes = _STACK.scopes
    if not scopes:
        return None
    scope = scopes[-1]
    if scope.real is None or scope.mask.shape[0] != tokens:
        return None
    return scope


def _open(mask_of: Callable, module: nn.Module, args: tuple, kwargs: dict) -> None:
    mask = mask_of(module, args, kwargs)
    if mask is not None:
        _STACK.scopes = (*_STACK.scopes, _scope(mask, id(module)))


def _pop(module: nn.Module, *args: Any) -> None:
    scopes = _STACK.scopes
    if scopes and scopes[-1].owner == id(module):
        _STACK.scopes = scopes[:-1]


def scope_padding(module: nn.Module, mask_of: Callable[[nn.Module, tuple, dict], Tensor | None]) -> None:
    """Open :func:`masked_tokens` around every forward of ``module`` with the mask
    ``mask_of(module, args, kwargs)`` returns (``None``: no scope), closed when the forward ends,
    raised or not.  Idempotent per ``module``."""
    if getattr(module, "_moelab_padding_scoped", False):
        return
    module.register_forward_pre_hook(functools.partial(_open, mask_of), with_kwargs=True)
    module.register_forward_hook(_pop, always_call=True)
    module._moelab_padding_scoped = True
