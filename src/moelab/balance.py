"""The global balance scope: the load-based losses of a whole optimizer step, over every
micro-batch on every data-parallel rank (Qwen's global-batch balance: Qiu et al. 2025, "Demons in
the Detail: On Implementing Load Balancing Loss for Training Specialized Mixture-of-Expert Models";
Megatron-Core's ``global_aux_loss``).

A layer measures the load of the tokens it sees; a step spans micro-batches and ranks.  The
:class:`StepBalance` a training loop owns gathers what the losses need — per layer, the expert
counts, the sums of the router probabilities and the token count — after each micro-batch's
forward (one all-reduce of ``2N + 1`` numbers per layer, outside any forward), and forms the losses
from the statistics of the step so far, with this micro-batch's own probability sums carrying the
gradient.  The layers of ``balance_scope="global"`` then leave these losses out of their
``aux_loss``.  docs/methods.md ("Balance scope") gives the formulas.

The gradient.  For a loss ``L(S)`` of additive statistics ``S = Σ_pieces S_piece`` (a piece: one
micro-batch on one rank) the piece contributes ``L(S_g + P·(S_piece − sg(S_piece)))`` with ``S_g``
the statistics gathered so far, ``P`` = ranks × micro-batches recorded in the step and ``sg`` the
stop-gradient: its value is ``L(S_g)``, its gradient ``P·∇L(S_g)·∂S_piece``.  DDP averages the
gradients over the ranks and the loop averages the micro-batches, so the step's gradient is
``∇L(S_g)·∂S_g`` — one process on the whole batch, whatever the number of ranks (the averaging
over the ranks is undone, which Megatron-Core's router does with ``reduce_group_has_dp`` /
``needs_dp_avg``).

When the step's backward runs once after every micro-batch was recorded (:meth:`StepBalance.loss`
called once per step), ``S_g`` is the whole step's: the loss value and the gradient are exactly
those of one process on the whole batch.  When each micro-batch runs its own backward (gradient
accumulation; :meth:`loss` after each :meth:`record`), micro-batch ``m`` uses the counts of
micro-batches ``1..m``: the running counts of Megatron-Core's ``global_aux_loss``
(``global_tokens_per_expert`` / ``ga_steps``) and of Qwen's buffer.  With one micro-batch a step
(:class:`moelab.train.Trainer`) the two coincide.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .functional import expert_counts
from .layer import moe_layers
from .losses import LOAD_LOSSES, balance_from_load, entropy_from_mean, importance_from_sums
from .routing import RoutingContext

__all__ = ["StepBalance", "attached_step_balance", "step_balance_loss"]


class StepBalance:
    """The step's statistics of every ``balance_scope="global"`` layer of ``model`` (those with a
    load-based loss: ``balance``, ``importance`` or ``entropy``), owned by a training loop.

    Per micro-batch: run the forward, then :meth:`record` (reads each layer's last forward,
    all-reduces its statistics: one collective of ``Σ (2N + 1)`` numbers), then :meth:`loss` (the
    global losses, weighted by the layers' coefficients, to add to the micro-batch's loss before its
    backward) — or, for the exact step,
    :meth:`record` after every micro-batch's forward and :meth:`loss` once, before the one backward.
    :meth:`end_step` clears the statistics; with ``ctx`` it runs as a step hook of
    :meth:`moelab.RoutingContext.advance`, once per optimizer step.

    Args:
        model: the model (its global-scope layers are attached to this object until :meth:`close`).
        ctx: the routing context whose step hooks clear the statistics, or ``None`` (call
            :meth:`end_step` yourself).
        group: the data-parallel process group (default: the default group when torch.distributed
            is initialised; none otherwise).
    """

    def __init__(self, model: nn.Module, ctx: RoutingContext | None = None, group=None) -> None:
        self.layers = [
            layer
            for layer in moe_layers(model)
            if layer.balance_scope == "global" and any(n in layer.coefs for n in LOAD_LOSSES)
        ]
        for layer in self.layers:
            if layer.step_balance is not None and layer.step_balance is not self:
                raise ValueError(
                    f"MoE layer {layer.layer_index} is already attached to another StepBalance; "
                    "expected one training loop at a time (close() the other first)"
                )
            layer.step_balance = self
        self.group = group
        #: the step's statistics so far, float64, layer after layer: counts (N), probability sums (N), tokens
        self._totals: Tensor | None = None
        self._offsets = [0]
        for layer in self.layers:
            self._offsets.append(self._offsets[-1] + 2 * layer.num_experts + 1)
        self._local: list[list[Tensor | None]] = []  # per forward not yet formed: each layer's Σ p
        self._names: list[list[tuple[str, ...]]] = []  # the losses each layer forms for that forward
        self._forwards = 0
        #: the weighted losses of the last :meth:`loss` by name, detached (summed over the layers)
        self.last_terms: dict[str, Tensor] = {}
        if ctx is not None and self.layers:
            ctx.add_step_hook(self.end_step)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _world(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(self.group)
        return 1

    def record(self) -> None:
        """Gather the statistics of the forward that just ran (call it after each micro-batch's
        forward, on every rank, before anything reads the layers' ``aux_loss``)."""
        if not self.layers:
            return
        routings = [layer._step_routing for layer in self.layers]  # this forward's, with autograd
        for layer in self.layers:  # read once: nothing of the forward stays on the layer
            layer._step_routing = None
        # the statistics live where the model does (a collective over NCCL needs CUDA tensors)
        first = next(iter(self.layers[0].parameters()), None)
        device = next(
            (r.probs.device for r in routings if r is not None and r.probs is not None),
            None if first is None else first.device,
        )
        rows, local, names = [], [], []
        for layer, routing in zip(self.layers, routings):
            n = layer.num_experts
            if routing is None or routing.probs is None or routing.indices.shape[0] == 0:
                rows.append(torch.zeros(2 * n + 1, dtype=torch.float64, device=device))
                local.append(None)
                names.append(())
                continue
            compute = torch.promote_types(routing.probs.dtype, torch.float32)
            sums = routing.probs.to(compute).sum(dim=0)  # (N,), with autograd
            counts = expert_counts(routing.indices, n).to(torch.float64)
            tokens = counts.new_full((1,), routing.indices.shape[0])
            rows.append(torch.cat([counts, sums.detach().double(), tokens]))
            local.append(sums)
            # a loss the router computed itself on this forward (densemoe's dense steps) stays its own
            names.append(tuple(k for k in LOAD_LOSSES if k in layer.coefs and k not in routing.losses))
        stats = torch.cat(rows)  # layers of different N: one flat tensor, one collective
        if self._world() > 1:  # the one collective of a micro-batch, outside the forward
            torch.distributed.all_reduce(stats, group=self.group)
        self._totals = stats if self._totals is None else self._totals + stats
        self._local.append(local)
        self._names.append(names)
        self._forwards += 1

    def loss(self) -> Tensor:
        """The global losses of the forwards recorded since the last call, averaged over them,
        each from the step's statistics so far (module docstring); 0 without any."""
        device = self._totals.device if self._totals is not None else torch.device("cpu")
        total = torch.zeros((), device=device)
        if not self._local:
            return total
        pieces = self._world() * self._forwards
        terms: dict[str, Tensor] = {}
        for local, names in zip(self._local, self._names):
            for i, (layer, sums) in enumerate(zip(self.layers, local)):
                if sums is None or not names[i]:
                    continue
                n = layer.num_experts
                row = self._totals[self._offsets[i] : self._offsets[i + 1]]
                counts, sums_g, tokens = row[:n], row[n : 2 * n], row[2 * n]
                swapped = sums_g.to(sums.dtype) + pieces * (sums - sums.detach())  # value S_g, gradient P·∂S
                for name in names[i]:
                    if name == "balance":
                        value = balance_from_load((counts / counts.sum()).to(sums.dtype), swapped / tokens, n)
                    elif name == "importance":
                        value = importance_from_sums(swapped)
                    else:
                        value = entropy_from_mean(swapped / tokens)
                    term = layer.coefs[name] * value
                    total = total + term
                    terms[name] = terms.get(name, 0.0) + term.detach()
        forwards = len(self._local)
        self._local, self._names = [], []
        self.last_terms = {k: v / forwards for k, v in terms.items()}
        return total / forwards

    def end_step(self, ctx: RoutingContext | None = None) -> None:
        """The optimizer has stepped: forget the step's statistics (a step hook with ``ctx``)."""
        self._totals, self._local, self._names, self._forwards = None, [], [], 0

    def close(self) -> None:
        """Detach from the layers (their ``aux_loss`` forms the global-scope losses again)."""
        for layer in self.layers:
            if layer.step_balance is self:
                layer.step_balance = None
        self.end_step()


def attached_step_balance(model: nn.Module) -> StepBalance | None:
    """The :class:`StepBalance` attached to ``model``'s layers, or ``None``."""
    return next((m.step_balance for m in moe_layers(model) if m.step_balance is not None), None)


def step_balance_loss(model: nn.Module) -> Tensor | None:
    """For a training loop's step: :meth:`StepBalance.record` then :meth:`StepBalance.loss` of the
    StepBalance attached to ``model``'s layers; ``None`` when none is."""
    balance = attached_step_balance(model)
    if balance is None:
        return None
    balance.record()
    return balance.loss()
