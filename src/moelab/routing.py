"""What a router decides (:class:`Routing`) and the state shared by a model's layers
(:class:`RoutingContext`)."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from . import _validate

__all__ = ["Routing", "RoutingContext"]


@dataclass
class Routing:
    """The decision of a router for ``T`` tokens.

    Attributes:
        indices: ``(T, K)`` int64, the chosen experts of each token (distinct per token).
        weights: ``(T, K)`` the weights of the chosen experts' outputs.
        probs: ``(T, N)`` the router's distribution over all experts (softmax of the logits for
            every built-in router), used by the balance loss and the metrics; ``None`` when a
            router has none.
        logits: ``(T, N)`` the raw router scores, or ``None``.
        losses: unweighted auxiliary losses by name (``"balance"``, ``"z"``, ...); the layer
            multiplies each by its coefficient.
        outputs: ``(T, K, d)`` the chosen experts' outputs when the router already computed them
            (competition runs every expert); the layer then combines them instead of running
            the experts again.  ``None`` otherwise.
        mask: ``(T, K)`` bool, which slots are active, for a router that routes a variable
            number of experts per token (``remoe``, ``top-p``): ``K`` is then the most a token
            may take, an inactive slot's expert does not run in the bank
            (:func:`moelab.experts.dispatch.dispatch_masked`) and its weight is 0 — unless the
            router computed that expert itself (``direct``, MoE++'s copy and constant experts,
            whose indices lie beyond the bank's N).  ``None``: every slot is active.
        direct: ``(T, d)`` the weighted output of the experts the router computes itself, which
            the expert bank does not hold (MoE++'s copy and constant experts); the layer adds it
            to the bank's output.  ``None`` otherwise.
        inputs: ``(T, d)`` the tokens the routed experts run on, for a router that changes them
            (Latent Prototype Routing's aligner adds a projection of the token's prototype mixture);
            ``None``: the layer's input (the shared experts always run on that).

    How the experts run it — set by the layer after the router, read by the bank
    (:meth:`moelab.experts.SparseExperts.forward`):

    Attributes:
        keep: ``(T, K)`` bool, the slots within their expert's capacity
            (:mod:`moelab.experts.capacity`); a dropped slot's expert does not run and adds 0.
            ``None``: no capacity, every slot is kept.
        pad_to: ``C``: every expert runs on exactly ``C`` rows, its kept slots then zero padding
            (the padded layout of ``pad_to_capacity``).  ``None``: the experts run on their slots.
        dense_gradient: every expert runs and the router gets the gradient of the dense mixture
            (DenseMixer; :func:`moelab.experts.dispatch.combine_densemixer`).
    """

    indices: Tensor
    weights: Tensor
    probs: Tensor | None = None
    logits: Tensor | None = None
    losses: dict[str, Tensor] = field(default_factory=dict)
    outputs: Tensor | None = None
    mask: Tensor | None = None
    direct: Tensor | None = None
    inputs: Tensor | None = None
    keep: Tensor | None = None
    pad_to: int | None = None
    dense_gradient: bool = False

    @property
    def top_k(self) -> int:
        return self.indices.shape[-1]

    @property
    def kept_weights(self) -> Tensor:
        """``(T, K)`` the weights the experts' outputs get: 0 for a slot over its expert's capacity."""
        return self.weights if self.keep is None else self.weights * self.keep.to(self.weights.dtype)

    @property
    def active_indices(self) -> Tensor:
        """``(S,)`` the experts of the active slots, flattened: what an expert's load counts (all
        ``T·K`` slots without a mask)."""
        flat = self.indices.reshape(-1)
        return flat if self.mask is None else flat[self.mask.reshape(-1)]

    def detach(self) -> Routing:
        """A copy with every tensor detached (and no ``(T, K, d)`` expert outputs): what
        ``last_routing`` keeps."""

        def d(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach()

        return Routing(
            indices=self.indices.detach(),
            weights=self.weights.detach(),
            probs=d(self.probs),
            logits=d(self.logits),
            losses={k: v.detach() for k, v in self.losses.items()},
            outputs=None,
            mask=d(self.mask),
            direct=d(self.direct),
            inputs=d(self.inputs),
            keep=d(self.keep),
            pad_to=self.pad_to,
            dense_gradient=self.dense_gradient,
        )


@dataclass
class RoutingContext:
    """Training state shared by all MoE layers of one model.

    The trainer advances :attr:`step`; routers read it for their schedules (SMoE-Dropout's
    growing K, StableMoE's stage switch, CompeteSMoE's competition schedule).

    State that changes with training (sharede-v3's selection bias) changes in *step hooks*, never
    in ``forward``: :func:`moelab.attach` registers every router's ``on_step(ctx)``, and
    :meth:`advance` — called once after each optimizer step — runs them, then counts the step.  A
    loop of forwards without ``advance`` changes no such state (gradient accumulation and
    activation checkpointing therefore update it once per optimizer step).

    Attributes:
        step: the current optimisation step (0-based).
        total_steps: the planned length of training, or ``None`` if unknown.
        schedule: an object with ``active(layer, step) -> bool`` (the competition schedule),
            or ``None``.
        extra: free-form state for user routers.
        hooks: the step hooks ``fn(ctx)`` :meth:`advance` runs (registered by
            :func:`moelab.attach`; not part of :meth:`state_dict`).
        watchers: the step watchers ``fn(ctx)`` run whenever :attr:`step` or :attr:`total_steps`
            is set (:meth:`add_step_watcher`; not an argument, not copied by :meth:`replace`).
        frozen: a class flag: ``True`` for a context whose routing state never moves by design
            (fine-tuning with frozen routers keeps the LM's), so a step-dependent method training
            under it is not warned about (:func:`moelab.layer.check_context`).
    """

    frozen: ClassVar[bool] = False

    step: int = 0
    total_steps: int | None = None
    schedule: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    hooks: list[Callable[[RoutingContext], None]] = field(default_factory=list, repr=False, compare=False)
    watchers: list[Callable[[RoutingContext], None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    _advancing: _AdvanceWatch = field(
        default_factory=lambda: _AdvanceWatch(), init=False, repr=False, compare=False
    )

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("step", "total_steps"):
            for watcher in self.__dict__.get("watchers", ()):  # none yet while __init__ runs
                watcher(self)

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"step={self.step!r} is not allowed; expected an integer >= 0")
        if self.total_steps is not None:
            _validate.positive_int("total_steps", self.total_steps)

    @property
    def progress(self) -> float | None:
        """``step / total_steps`` clipped to [0, 1], or ``None`` when ``total_steps`` is unknown."""
        if self.total_steps is None:
            return None
        return min(max(self.step / self.total_steps, 0.0), 1.0)

    def add_step_hook(self, hook: Callable[[RoutingContext], None]) -> None:
        """Run ``hook(ctx)`` at every :meth:`advance` (once, however often it is added)."""
        if not callable(hook):
            raise ValueError(f"hook={hook!r} is not allowed; expected a callable taking the context")
        if hook not in self.hooks:
            self.hooks.append(hook)

    def add_step_watcher(self, watcher: Callable[[RoutingContext], None]) -> None:
        """Run ``watcher(ctx)`` now and whenever :attr:`step` or :attr:`total_steps` is set
        (:meth:`advance`, :meth:`load_state_dict`, an assignment; once, however often it is added).
        A router derives from the step, here, the values its traced ``forward`` reads (SMoE-Dropout's
        K, StableMoE's stage), so ``torch.compile`` guards on those few values rather than on the
        step, which changes every call."""
        if not callable(watcher):
            raise ValueError(f"watcher={watcher!r} is not allowed; expected a callable taking the context")
        if watcher not in self.watchers:
            self.watchers.append(watcher)
        watcher(self)

    def advance(self, steps: int = 1) -> None:
        """The optimizer has stepped: run the step hooks (in registration order), then count
        ``steps`` steps.  Call it once per optimizer step, on every rank (a hook may all-reduce)."""
        for hook in self.hooks:
            hook(self)
        self.step += steps

    def state_dict(self) -> dict[str, Any]:
        """The step, the planned steps and the schedule's ``state_dict`` (its arguments): the one
        serialisation of the context, used by checkpoints and by ``moelab.save``."""
        schedule = None if self.schedule is None else self.schedule.state_dict()
        return {"step": self.step, "total_steps": self.total_steps, "schedule": schedule}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``.  The schedule is not rebuilt here: this context must already
        hold the saved one (:func:`moelab.schedules.routing_context` builds it from the model, the
        steps, the seed and the options; :func:`moelab.schedules.schedule_from_state` from a saved
        state); a different one is refused, since the run would compete at other steps."""
        saved = state.get("schedule")
        current = None if self.schedule is None else self.schedule.state_dict()
        if saved != current:
            raise ValueError(
                f"the saved routing state has schedule {saved}, this context {current}; "
                "expected the same schedule (same model, steps, seed and schedule options)"
            )
        self.step = int(state["step"])
        self.total_steps = state.get("total_steps", self.total_steps)

    def watch_optimizers(self) -> None:
        """Count every torch optimizer's steps from now on, so that :meth:`check_advancing` can
        tell a context whose step stays put while an optimizer steps (:func:`moelab.attach` calls
        it for a model whose routing depends on the step).  The hook is this context's: removed
        when the context is garbage-collected."""
        watch = self._advancing
        if watch.handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            ref = weakref.ref(watch)

            def count(optimizer: Any, args: Any, kwargs: Any) -> None:
                alive = ref()
                if alive is not None:
                    alive.optimizer_steps += 1

            watch.handle = register_optimizer_step_post_hook(count)
            weakref.finalize(watch, watch.handle.remove)

    def check_advancing(self, method: str, what: str) -> None:
        """Warn, once per method, when an optimizer stepped since the last training forward but
        :attr:`step` stayed put (``ctx.advance()`` forgotten); ``what`` says what of the method's
        routing depends on the step.  Called by training forwards (not while compiling), after
        :meth:`watch_optimizers`; it records only in this context's own watch."""
        watch = self._advancing
        if watch.handle is None:
            return
        if watch.step != self.step:  # the context advanced (or was set): watch from here
            watch.step, watch.seen = self.step, watch.optimizer_steps
        elif watch.seen != watch.optimizer_steps and method not in watch.told:
            watch.told.add(method)
            warnings.warn(
                f"MoE layer of method={method!r} trains with a RoutingContext that does not advance: an "
                f"optimizer stepped since the last training forward, but ctx.step stayed {self.step}; {what}. "
                "Call ctx.advance() once after every optimizer step",
                stacklevel=2,
            )

    def replace(self, **changes: Any) -> RoutingContext:
        return dataclasses.replace(self, **changes)


@dataclass(eq=False)
class _AdvanceWatch:
    """A context's watch on its own advancing (:meth:`RoutingContext.check_advancing`): the
    optimizer steps counted by its hook, the step and count at the last training forward, and
    the methods already told."""

    handle: Any = None
    optimizer_steps: int = 0
    step: int | None = None
    seen: int = 0
    told: set[str] = field(default_factory=set)
