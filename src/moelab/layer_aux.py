"""The aux losses a :class:`moelab.MoE` layer forms in a training forward: each coefficient of its
config names a loss, which the router gave (``Routing.losses``) or which is formed here from the
routing — the standard ones of :mod:`moelab.losses` in the config's balance scope, and the layer's
own ERC loss (Lv et al. 2025, "Coupling Experts and Routers in Mixture-of-Experts via an Auxiliary
Loss"), which couples the router rows to the experts' gate projections."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .errors import NonFiniteError
from .experts import ExpertBank
from .layer_config import MoEConfig
from .losses import (
    LOAD_LOSSES,
    erc_loss,
    erc_noise,
    importance_loss,
    mean_entropy_loss,
    sequence_balance_loss,
    switch_balance_loss,
    z_loss,
)
from .routing import Routing

__all__ = ["aux_terms_of", "check_erc", "check_finite_scores", "erc_of"]

#: the non-finite message under torch.compile: a constant, since a per-layer value (the layer's
#: index, its method) read in the traced code becomes a guard and recompiles every layer
_NON_FINITE_COMPILED = (
    "MoE layer: router logits are not finite (NaN or inf); check the input and the learning rate, "
    "or pass check_finite=False"
)


def check_finite_scores(routing: Routing, layer_index: int, method: str) -> None:
    """Raise :class:`moelab.NonFiniteError` when the router's logits (or, for a router without
    logits, the routing weights: the competition's) are NaN or inf."""
    scores = routing.logits if routing.logits is not None else routing.weights
    if torch.compiler.is_compiling():
        # a Python ``if`` on a tensor is a graph break; the asserting op is traced instead
        # (it raises RuntimeError when the graph runs; on CUDA it fires asynchronously)
        torch._assert_async(torch.isfinite(scores).all(), _NON_FINITE_COMPILED)
    # one reduction: the sum of finite scores is finite unless it overflows, which the exact check
    # below (run only then) tells apart
    elif not math.isfinite(scores.sum().item()) and not torch.isfinite(scores).all():
        raise NonFiniteError(
            f"MoE layer {layer_index} (method={method!r}): router logits are not finite (NaN or inf); "
            "check the input and the learning rate, or pass check_finite=False"
        )


def aux_terms_of(
    config: MoEConfig,
    routing: Routing,
    x: Tensor,
    seq_len: int | None,
    step_balanced: bool,
    layer_index: int,
    erc: Callable[[], Tensor],
) -> dict[str, Tensor]:
    """The weighted aux losses ``coef · loss`` of a training forward on ``x (T, d)`` by name (their
    sum is the layer's ``aux_loss``; :mod:`moelab.hf.trainer` logs them one by one).
    ``step_balanced``: a :class:`moelab.balance.StepBalance` forms the global-scope load losses
    (left out here); ``erc``: the layer's ERC loss."""
    terms: dict[str, Tensor] = {}
    if x.shape[0] == 0:  # no tokens: the means of the losses are undefined (NaN); nothing to balance
        return terms
    for name, coef in config.coefs.items():
        loss = routing.losses.get(name)
        if loss is None:
            loss = (
                erc()
                if name == "erc"
                else _standard(config, name, routing, seq_len, step_balanced, layer_index)
            )
        if loss is not None:
            terms[name] = coef * loss
    return terms


def _standard(
    config: MoEConfig, name: str, routing: Routing, seq_len: int | None, step_balanced: bool, layer_index: int
) -> Tensor | None:
    if name == "z":
        return None if routing.logits is None else z_loss(routing.logits)
    if routing.probs is None or name not in LOAD_LOSSES:
        return None
    if config.balance_scope == "global":
        if step_balanced:  # it forms the step's loss (moelab.balance)
            return None
        _refuse_unsynchronised_global(layer_index)
    seq = seq_len if config.balance_scope == "sequence" else None
    if name == "balance":
        if seq is not None:
            return sequence_balance_loss(routing.probs, routing.indices, config.num_experts, seq)
        # a variable number of experts per token: the active slots (only the micro scope allows it)
        return switch_balance_loss(routing.probs, routing.indices, config.num_experts, routing.mask)
    if name == "importance":
        return importance_loss(routing.probs, seq_len=seq)
    return mean_entropy_loss(routing.probs, seq_len=seq)


def _refuse_unsynchronised_global(layer_index: int) -> None:
    """A global-scope loss read without the step's statistics under torch.distributed would be this
    rank's micro-batch loss under another name."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            raise ValueError(
                f"balance_scope='global' (MoE layer {layer_index}) is not allowed without the step's "
                "statistics under torch.distributed; expected a moelab.balance.StepBalance attached by the "
                "training loop (moelab.train.Trainer and moelab.hf.MoETrainer attach one)"
            )


def erc_of(
    router: nn.Module, experts: nn.Module, config: MoEConfig, noise: Tensor | bool | None = True
) -> Tensor:
    """The ERC loss of the router rows and the experts' gate projections
    (:func:`moelab.losses.erc_loss`, margin ``erc_alpha``): ``noise=True`` draws the proxy tokens'
    noise (:func:`moelab.losses.erc_noise`), a tensor is used as it is, ``None`` or ``False`` leaves
    the router rows unperturbed."""
    r = router.base_router.weight
    w = experts.expert_weights
    if w.num_experts != config.num_experts:  # an expert-parallel bank computes on its local block
        raise ValueError(
            f"erc_coef > 0 is not allowed with expert parallelism (this rank holds {w.num_experts} of "
            f"{config.num_experts} experts); expected every expert's gate projection on every rank"
        )
    gate = w.w_in[:, : w.d_hidden]  # [gate | up] for swiglu, else the whole input projection
    if noise is True:
        noise = erc_noise(r)
    return erc_loss(r, gate, config.erc_alpha, noise if isinstance(noise, Tensor) else None)


def check_erc(router: nn.Module, experts: nn.Module, config: MoEConfig) -> None:
    """The ERC loss needs router rows ``(N, d)`` and experts with gate projections."""
    weight = getattr(router.base_router, "weight", None)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (config.num_experts, config.d_model):
        raise ValueError(
            f"erc_coef > 0 is not allowed with method={config.method!r}: its router has no (num_experts, "
            "d_model) weight whose rows the ERC loss couples to the experts; expected a linear router (smoe, "
            "sharede-v3, remoe, top-p, expert-choice, ...)"
        )
    if not isinstance(experts, ExpertBank):
        raise ValueError(
            f"erc_coef > 0 is not allowed with experts of type {type(experts).__name__}: the ERC loss "
            "reads each expert's gate projection; expected an ExpertBank"
        )
