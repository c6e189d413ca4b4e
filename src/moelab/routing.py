"""What a router decides (:class:`Routing`) and the state shared by a model's layers
(:class:`RoutingContext`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
    """

    indices: Tensor
    weights: Tensor
    probs: Tensor | None = None
    logits: Tensor | None = None
    losses: dict[str, Tensor] = field(default_factory=dict)
    outputs: Tensor | None = None

    @property
    def top_k(self) -> int:
        return self.indices.shape[-1]

    def detach(self) -> Routing:
        """A copy with every tensor detached (and no expert outputs): what ``last_routing`` keeps."""

        def d(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach()

        return Routing(
            indices=self.indices.detach(),
            weights=self.weights.detach(),
            probs=d(self.probs),
            logits=d(self.logits),
            losses={k: v.detach() for k, v in self.losses.items()},
            outputs=None,
        )


@dataclass
class RoutingContext:
    """Training state shared by all MoE layers of one model.

    The trainer advances :attr:`step`; routers read it for their schedules (SMoE-Dropout's
    growing K, StableMoE's stage switch, CompeteSMoE's competition schedule).

    Attributes:
        step: the current optimisation step (0-based).
        total_steps: the planned length of training, or ``None`` if unknown.
        schedule: an object with ``active(layer, step) -> bool`` (the competition schedule),
            or ``None``.
        extra: free-form state for user routers.
    """

    step: int = 0
    total_steps: int | None = None
    schedule: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

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

    def advance(self, steps: int = 1) -> None:
        self.step += steps

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.total_steps = state.get("total_steps", self.total_steps)

    def replace(self, **changes: Any) -> RoutingContext:
        return dataclasses.replace(self, **changes)
