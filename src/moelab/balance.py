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

Nothing of a forward stays on the module but numbers written in place: each global-scope layer owns
a :class:`StepStatistics` (its submodule ``step_statistics``, built with the layer) that writes the
statistics of its training forward into its buffers, and the gradient reaches the layer's
probability sums through its output, as the layers' own aux losses do
(:class:`moelab.aux_grad.StepGradInjection`): :meth:`StepBalance.loss` computes the gradient of the
losses with respect to each layer's sums and puts it in a buffer the layer's backward reads.  So a
block compiled with ``torch.compile(fullgraph=True)``, with or without activation checkpointing,
trains with the global scope, and the loss :meth:`StepBalance.loss` returns is a value to add to the
micro-batch's loss (its gradient checks only that the loss weighs it as :func:`moelab.set_aux_scale`
says, like :func:`moelab.aux_loss`).  Run the backward of each :meth:`StepBalance.loss` before the
next one.

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

from .aux_grad import StepGradInjection, readout
from .functional import expert_counts
from .losses import LOAD_LOSSES, balance_from_load, entropy_from_mean, importance_from_sums
from .routers.base import counts_this_forward
from .routing import Routing, RoutingContext

__all__ = ["BALANCE_SCOPES", "StepBalance", "StepStatistics", "attached_step_balance", "step_balance_loss"]

#: where the load-based losses (``balance``, ``importance``, ``entropy``) measure the load
BALANCE_SCOPES = ("micro", "sequence", "global")


class StepStatistics(nn.Module):
    """What one ``balance_scope="global"`` layer gives its step: per training forward, its expert
    counts, router probability sums and token count, written in place into :attr:`stats` (as
    BatchNorm's running statistics: compile- and checkpoint-clean; not again in a checkpoint's
    recomputation), which :meth:`StepBalance.record` reads after the forward; and :attr:`grad`, the
    gradient of the step's losses for this forward's sums, which :meth:`StepBalance.loss` writes
    and the layer's backward reads.  Owned by the layer (``layer.step_statistics``); neither buffer
    is saved with the model.

    Args:
        num_experts: N.
        coefs: the layer's coefficients of the load-based losses it forms over the step.
    """

    def __init__(self, num_experts: int, coefs: dict[str, float]) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.coefs = dict(coefs)
        # per forward: counts (N), probability sums (N), tokens, the load losses the router formed
        # itself (3), the training forwards written since record() read them (1)
        self.register_buffer("stats", torch.zeros(2 * num_experts + 5, dtype=torch.float64), persistent=False)
        self.register_buffer("grad", torch.zeros(num_experts), persistent=False)
        #: the :class:`StepBalance` forming this layer's losses (set and cleared by it), or ``None``
        self.balance: StepBalance | None = None

    def forward(self, y: Tensor, routing: Routing, scale: Tensor) -> Tensor:
        """Record this training forward's statistics and tie the step's gradient to ``y``."""
        n = self.num_experts
        counts_this = counts_this_forward()
        # eager only, and first: a traced graph neither reads nor guards on the Python-side balance
        if not torch.compiler.is_compiling() and counts_this and self.balance is not None:
            self.balance._forward_ran(self)  # refuses a second forward that no record() read
        if routing.probs is None or routing.indices.shape[0] == 0:
            if counts_this:  # nothing to gather: no tokens (a forward all the same)
                self.stats.copy_(torch.cat([self.stats.new_zeros(2 * n + 4), self.stats[-1:] + 1]))
            return y
        compute = torch.promote_types(routing.probs.dtype, torch.float32)
        sums = routing.probs.to(compute).sum(dim=0)  # (N,), with autograd
        if counts_this:
            counts = expert_counts(routing.indices, n).to(self.stats.dtype)
            # the load losses the router formed itself on this forward (densemoe's dense steps) stay its own
            own = [float(name in routing.losses) for name in LOAD_LOSSES]
            extra = counts.new_tensor([float(routing.indices.shape[0]), *own])  # tokens, own
            # the last slot counts the training forwards record() has not read (in place, no host read)
            written = self.stats[-1:] + 1
            self.stats.copy_(torch.cat([counts, sums.detach().to(self.stats.dtype), extra, written]))
        return StepGradInjection.apply(y, sums, self.grad, scale)

    def _apply(self, fn, recurse: bool = True):
        """The counts and sums stay float64, as gathered; the gradient at least float32."""
        super()._apply(fn, recurse)
        if self.stats.dtype != torch.float64:
            self.stats = self.stats.double()
        if self.grad.dtype in (torch.float16, torch.bfloat16):
            self.grad = self.grad.float()
        return self

    def __getstate__(self) -> dict:
        """A copy is not attached to the original's training loop."""
        state = super().__getstate__()
        state["balance"] = None
        return state

    def clear(self) -> None:
        with torch.no_grad():
            self.stats.zero_()
            self.grad.zero_()


class StepBalance:
    """The step's statistics of every ``balance_scope="global"`` layer of ``model`` (those with a
    load-based loss: ``balance``, ``importance`` or ``entropy``), owned by a training loop.

    Per micro-batch: run the forward, then :meth:`record` (reads each layer's last forward,
    all-reduces its statistics: one collective of ``Σ (2N + 1)`` numbers), then :meth:`loss` (the
    global losses, weighted by the layers' coefficients, to add to the micro-batch's loss before its
    backward) — or, for the exact step,
    :meth:`record` after every micro-batch's forward and :meth:`loss` once, before the one backward.
    :meth:`end_step` clears the statistics; with ``ctx`` it runs as a step hook of
    :meth:`moelab.RoutingContext.advance`, once per optimizer step.  ``with StepBalance(model, ctx)
    as balance:`` closes it when the block ends, however it ends.

    A balance left attached or half used would drop the global-scope losses without a word (the
    layers leave them to it), so it refuses in one line: a second training forward of a layer
    before :meth:`record` read the first (at that forward, eagerly; under torch.compile at the
    :meth:`record`), and at :meth:`end_step` a step with a forward no :meth:`record` read, with
    recorded forwards no :meth:`loss` formed, or with :meth:`record` calls that found no forward of
    ``model`` (it drives another model).  The checks read Python counters, and the step's end one
    small tensor: nothing in a compiled forward.

    Args:
        model: the model (its global-scope layers are attached to this object until :meth:`close`).
        ctx: the routing context whose step hooks clear the statistics, or ``None`` (call
            :meth:`end_step` yourself).
        group: the data-parallel process group (default: the default group when torch.distributed
            is initialised; none otherwise).
    """

    def __init__(self, model: nn.Module, ctx: RoutingContext | None = None, group=None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
        #: (the layer's name in ``model``, the layer, its statistics), in module order
        self._owners = [
            (name, m, m.step_statistics)
            for name, m in model.named_modules()
            if isinstance(getattr(m, "step_statistics", None), StepStatistics)
        ]
        self.layers = [layer for _, layer, _ in self._owners]
        for _, layer, stats in self._owners:
            if stats.balance is not None and stats.balance is not self:
                raise ValueError(
                    f"MoE layer {layer.layer_index} is already attached to another StepBalance; "
                    "expected one training loop at a time (close() the other first)"
                )
        for _, _, stats in self._owners:
            stats.clear()
            stats.balance = self
        self.group = group
        self.ctx = ctx if self.layers else None
        self._closed = False
        self._position = {id(stats): i for i, (_, _, stats) in enumerate(self._owners)}
        #: the layers (positions) whose last eager training forward no record() has read yet
        self._unrecorded: set[int] = set()
        self._records = 0  # record() calls in this step, and how many found a forward of the model
        self._records_with_forward = 0
        self._awaiting_backward = False
        #: the step's statistics so far, float64, layer after layer: counts (N), probability sums (N), tokens
        self._totals: Tensor | None = None
        self._offsets = [0]
        for _, _, stats in self._owners:
            self._offsets.append(self._offsets[-1] + 2 * stats.num_experts + 1)
        self._local: list[list[Tensor | None]] = []  # per forward not yet formed: each layer's Σ p (detached)
        self._names: list[list[tuple[str, ...]]] = []  # the losses each layer forms for that forward
        self._forwards = 0
        #: the weighted losses of the last :meth:`loss` by name, detached (summed over the layers)
        self.last_terms: dict[str, Tensor] = {}
        if ctx is not None and self.layers:
            ctx.add_step_hook(self.end_step)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def __enter__(self) -> StepBalance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ValueError(
                f"StepBalance.{call}() after close() is not allowed: the layers form their global-scope losses "
                "themselves again; expected a new StepBalance(model) for another training loop"
            )

    def _forward_ran(self, stats: StepStatistics) -> None:
        """An eager training forward of the layer owning ``stats`` wrote its statistics: refuse it
        when the last one's were not read (their global-scope losses would be lost)."""
        i = self._position[id(stats)]
        if i in self._unrecorded:
            self._unrecorded.clear()  # one refusal, not one per layer
            raise ValueError(
                f"a second training forward of MoE layer {self._owners[i][1].layer_index} before "
                "StepBalance.record() read the first is not allowed: the StepBalance attached to the model "
                "forms the global-scope losses (balance_scope='global') of each forward, and the first one's "
                "would be lost; expected record() and loss() after each training forward, or close() a "
                "StepBalance that no loop drives (moelab.balance.attached_step_balance(model).close(), or "
                "`with StepBalance(model, ctx) as balance:`)"
            )
        self._unrecorded.add(i)

    def _world(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(self.group)
        return 1

    def record(self) -> None:
        """Gather the statistics of the forward that just ran (call it after each micro-batch's
        forward, on every rank, before anything reads the layers' ``aux_loss``)."""
        self._check_open("record")
        if not self.layers:
            return
        # the statistics live where the model does (a collective over NCCL needs CUDA tensors)
        owners = [stats for _, _, stats in self._owners]
        device = owners[0].stats.device
        written = [stats.stats.detach().clone().to(device) for stats in owners]
        for stats in owners:  # read once: a layer that does not run in the next forward adds nothing
            stats.stats.zero_()
        # per layer: tokens, the losses the router formed itself (3), written; one host read for all
        flags = torch.cat([w[2 * st.num_experts :] for w, st in zip(written, owners)]).tolist()
        self._unrecorded.clear()
        self._records += 1
        self._records_with_forward += any(flags[5 * i + 4] for i in range(len(owners)))
        rows, local, names = [], [], []
        for i, (layer, w) in enumerate(zip(owners, written)):
            n = layer.num_experts
            tokens, *own, fresh = flags[5 * i : 5 * i + 5]
            if fresh > 1:  # under torch.compile (eagerly the second forward refused itself)
                raise ValueError(
                    f"StepBalance.record() after {int(fresh)} training forwards of MoE layer "
                    f"{self._owners[i][1].layer_index} is not allowed: each forward overwrites the statistics "
                    "of the one before, whose global-scope losses would be lost; expected record() after each "
                    "training forward (and a layer run once per forward)"
                )
            if not fresh or not tokens:  # no training forward, or no tokens
                rows.append(torch.zeros(2 * n + 1, dtype=torch.float64, device=device))
                local.append(None)
                names.append(())
                continue
            rows.append(w[: 2 * n + 1])
            local.append(w[n : 2 * n])
            names.append(tuple(k for k, o in zip(LOAD_LOSSES, own) if k in layer.coefs and not o))
        stats = torch.cat(rows)  # layers of different N: one flat tensor, one collective
        if self._world() > 1:  # the one collective of a micro-batch, outside the forward
            torch.distributed.all_reduce(stats, group=self.group)
        self._totals = stats if self._totals is None else self._totals + stats
        self._local.append(local)
        self._names.append(names)
        self._forwards += 1

    def loss(self) -> Tensor:
        """The global losses of the forwards recorded since the last call, averaged over them,
        each from the step's statistics so far (module docstring); 0 without any.  Their gradient
        with respect to each layer's probability sums goes into the layer's buffer, which the
        backward to come reads (the returned value carries none: add it to the loss as
        :func:`moelab.aux_loss`).

        Raises:
            ValueError: the backward of the previous :meth:`loss` has not run yet (its layers would
                read this call's gradient), or the forwards formed since differ in which losses
                they take (their layers share one gradient buffer): call :meth:`record` and
                :meth:`loss` after each micro-batch's forward, and its backward before the next.
        """
        self._check_open("loss")
        if self._awaiting_backward:
            raise ValueError(
                "StepBalance.loss() is not allowed before the backward of the previous loss() (the layers "
                "read the gradient of the last one); expected the backward of each loss() before the next"
            )
        device = self._totals.device if self._totals is not None else torch.device("cpu")
        total = torch.zeros((), device=device)
        if not self._local:
            return total
        pieces = self._world() * self._forwards
        terms: dict[str, Tensor] = {}
        leaves: list[tuple[int, Tensor]] = []  # (layer, this forward's sums as a leaf)
        for local, names in zip(self._local, self._names):
            for i, ((_, _, layer), sums) in enumerate(zip(self._owners, local)):
                if sums is None or not names[i]:
                    continue
                n = layer.num_experts
                row = self._totals[self._offsets[i] : self._offsets[i + 1]]
                counts, sums_g, tokens = row[:n], row[n : 2 * n], row[2 * n]
                sums = sums.to(layer.grad.dtype).requires_grad_()
                leaves.append((i, sums))
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
        total = total / forwards
        if not leaves:
            return total.detach()
        grads: dict[int, Tensor] = {}
        for (i, _), g in zip(leaves, torch.autograd.grad(total, [leaf for _, leaf in leaves])):
            if i in grads and not torch.equal(grads[i], g):
                raise ValueError(
                    f"StepBalance.loss() over forwards whose global losses differ (MoE layer "
                    f"{self._owners[i][1].layer_index}) is not allowed; expected record() and loss() after each "
                    "micro-batch's forward, then its backward"
                )
            grads[i] = g
        for i, (_, _, layer) in enumerate(self._owners):
            g = grads.get(i)
            # through .data: the forward saved this buffer for its backward (StepGradInjection)
            if g is None:
                layer.grad.data.zero_()
            else:
                layer.grad.data.copy_(g)
        out = readout(total, self._owners[0][1].aux_scale)
        if out.requires_grad:
            self._awaiting_backward = True
            out.register_hook(self._backward_ran)
        return out

    def _backward_ran(self, grad: Tensor) -> None:
        self._awaiting_backward = False

    def end_step(self, ctx: RoutingContext | None = None) -> None:
        """The optimizer has stepped: forget the step's statistics (a step hook with ``ctx``).

        Raises:
            ValueError: the step dropped global-scope losses: a training forward that no
                :meth:`record` read, recorded forwards that no :meth:`loss` formed, or
                :meth:`record` calls that found no training forward of the model (class docstring).
        """
        if self._closed:
            return
        problem = self._unfinished_step()
        self._clear()
        if problem:
            raise ValueError(problem)

    def _unfinished_step(self) -> str | None:
        """What the step that ends dropped, in one line, or ``None``."""
        if self._local:
            return (
                f"a step with {len(self._local)} forward(s) recorded by StepBalance.record() but no loss() is "
                "not allowed: their global-scope losses (balance_scope='global') were never formed and their "
                "gradient is lost; expected loss() after record(), before the backward"
            )
        if self.layers:  # one small host read a step, outside any forward
            unread = torch.stack([stats.stats[-1] for _, _, stats in self._owners]).tolist()
            late = next((i for i, count in enumerate(unread) if count), None)
            if late is not None:
                return (
                    f"a step with a training forward of MoE layer {self._owners[late][1].layer_index} that "
                    "StepBalance.record() never read is not allowed: its global-scope losses "
                    "(balance_scope='global') were never formed; expected record() and loss() after each "
                    "training forward, or close() a StepBalance that no loop drives"
                )
        if self._records and not self._records_with_forward:
            return (
                f"a step whose {self._records} StepBalance.record() call(s) found no training forward of the "
                "model it was built for is not allowed: it drives another model than the one that trains (or "
                "the forward ran under torch.utils.checkpoint with use_reentrant=True, whose first pass has no "
                "gradients); expected StepBalance(model) of the model whose forward runs"
            )
        return None

    def _clear(self) -> None:
        self._totals, self._local, self._names, self._forwards = None, [], [], 0
        self._records = self._records_with_forward = 0
        self._unrecorded.clear()
        self._awaiting_backward = False
        for _, _, stats in self._owners:
            stats.stats.data.zero_()
            stats.grad.data.zero_()

    def close(self) -> None:
        """Detach from the layers (their ``aux_loss`` forms the global-scope losses again) and from
        the routing context's step hooks; what the step left unfinished is not checked (a training
        loop closes it on any way out).  Idempotent."""
        if self._closed:
            return
        self._clear()
        self._closed = True
        for _, _, stats in self._owners:
            if stats.balance is self:
                stats.balance = None
        if self.ctx is not None and self.end_step in self.ctx.hooks:
            self.ctx.hooks.remove(self.end_step)


def attached_step_balance(model: nn.Module) -> StepBalance | None:
    """The :class:`StepBalance` attached to ``model``'s layers, or ``None``."""
    return next(
        (m.balance for m in model.modules() if isinstance(m, StepStatistics) and m.balance is not None), None
    )


def step_balance_loss(model: nn.Module) -> Tensor | None:
    """For a training loop's step: :meth:`StepBalance.record` then :meth:`StepBalance.loss` of the
    StepBalance attached to ``model``'s layers; ``None`` when none is."""
    balance = attached_step_balance(model)
    if balance is None:
        return None
    balance.record()
    return balance.loss()
