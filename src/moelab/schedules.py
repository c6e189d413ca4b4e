"""Training schedules, when each MoE layer competes: :class:`CompetitionSchedule` (CompeteSMoE
(2025) §2.3.2, §2.4, App. B: built once before training, a Bernoulli(ω) draw per layer and step
after a warm-up, at most ``A_max`` competing layers per step) and :class:`CoinFlipSchedule`
(CompeteSMoE (2024) §3.2-3.3: an independent coin flip per layer and step with probability λ(t)).
Both expose ``num_layers`` and ``active(layer, step) -> bool``, which the routers read through
``moelab.RoutingContext(schedule=...)``, so a layer has one code path whatever the schedule.
docs/methods.md ("Competition") gives the rules.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from . import _validate
from .layer import attach, moe_layers
from .methods import get_method
from .routing import RoutingContext

__all__ = [
    "LR_SCHEDULES",
    "SCHEDULE_OPTIONS",
    "CoinFlipSchedule",
    "CompetitionSchedule",
    "build_schedule",
    "default_a_max",
    "lr_factor",
    "model_schedule",
    "routing_context",
    "schedule_from_state",
    "split_schedule_options",
]


def default_a_max(num_layers: int) -> int:
    """The default cap ``A_max`` for a model with ``num_layers`` MoE layers.

    CompeteSMoE (2025) uses ``A_max = 6`` for its language models (24 layers, §2.3.2 and App. G) and
    ``A_max = 9`` for the VLM (Phi-3.5-mini, 32 layers; Table 20).  The rule here: 6 up to 24
    layers, 9 from 27 layers on, one more per layer in between (25 → 7, 26 → 8).  For models
    with at most 6 layers the cap is never reached (every layer may compete at once).
    """
    _validate.positive_int("num_layers", num_layers)
    if num_layers <= 24:
        return 6
    return min(9, num_layers - 18)


def _broadcast_from_rank0(table: torch.Tensor) -> torch.Tensor:
    """Broadcast a bool table from rank 0 when torch.distributed is initialised (CompeteSMoE (2025) App. B: the
    reference code builds the schedule on rank 0 and broadcasts it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return table
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    buf = table.to(device=device, dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return buf.to("cpu").bool()


def _machine_memory() -> int | None:
    """This machine's physical memory in bytes, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def _check_table_fits(num_layers: int, total_steps: int) -> None:
    """Refuse a competition schedule whose table cannot be built here, before allocating it: the
    ``(L, T)`` bool table and, per step, an int64 count, the float64 draws and their int64 indices."""
    memory = _machine_memory()
    per_step = num_layers + 24
    if memory is None or total_steps * per_step <= memory // 2:
        return
    raise ValueError(
        f"total_steps={total_steps!r} is not allowed: the competition schedule of {num_layers} layers needs "
        f"about {total_steps * per_step / 2**30:.1f} GiB for its table, more than half of this machine's "
        f"{memory / 2**30:.1f} GiB; expected at most {memory // 2 // per_step} steps"
    )


class CompetitionSchedule:
    """The competition schedule Λ(l, t) of CompeteSMoE (2025) §2.3.2, §2.4, App. B, Table 20.

    Built once before training from the arguments alone (numpy ``PCG64`` seeded with ``seed``;
    under ``torch.distributed`` broadcast from rank 0, so every rank holds the same table): a
    warm-up without competition, then ``Λ(l, t) ~ Bernoulli(ω)`` per layer and step, an activation
    beyond the cap of ``A_max`` layers a step moved to the nearest free step.  docs/methods.md
    ("``competesmoe``") gives the rules.

    Args:
        num_layers: L, the model's MoE layers (``moelab.attach`` checks it against the model).
        total_steps: T, the planned optimisation steps.
        omega: ω in [0, 1] (0.07).
        a_max: A_max ≥ 1; default :func:`default_a_max` of ``num_layers``.
        warmup: warm-up fraction in [0, 1] (0.05).
        seed: seed of the draws.

    Attributes:
        table: ``(L, T)`` bool tensor, ``table[l, t] = Λ(l, t)``.
    """

    def __init__(
        self,
        num_layers: int,
        total_steps: int,
        omega: float = 0.07,
        a_max: int | None = None,
        warmup: float = 0.05,
        seed: int = 0,
    ) -> None:
        self.num_layers = _validate.positive_int("num_layers", num_layers)
        self.total_steps = _validate.positive_int("total_steps", total_steps)
        self.omega = _validate.probability("omega", omega)
        self.a_max = default_a_max(num_layers) if a_max is None else _validate.positive_int("a_max", a_max)
        self.warmup = _validate.probability("warmup", warmup)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is not allowed; expected an integer >= 0")
        self.seed = seed
        _check_table_fits(self.num_layers, self.total_steps)
        self.warmup_steps = int(self.warmup * self.total_steps)
        self.dropped = 0
        self.table = _broadcast_from_rank0(self._build())

    def _build(self) -> torch.Tensor:
        L, T, start = self.num_layers, self.total_steps, self.warmup_steps
        rng = np.random.Generator(np.random.PCG64(self.seed))
        table = np.zeros((L, T), dtype=bool)
        q = np.zeros(T, dtype=np.int64)  # Q_prev(t): active layers < l at t
        for layer in range(L):
            draws = np.flatnonzero(rng.random(T - start) < self.omega) + start
            row = table[layer]
            for t in draws:
                if q[t] < self.a_max and not row[t]:
                    row[t] = True
                    continue
                t_new = self._nearest_free(row, q, int(t), start)
                if t_new is None:
                    self.dropped += 1
                else:
                    row[t_new] = True
            q += row
        if self.dropped:
            warnings.warn(
                f"CompetitionSchedule: {self.dropped} activations had no free step under a_max={self.a_max} "
                f"and were dropped (omega={self.omega}, num_layers={L})",
                stacklevel=3,
            )
        return torch.from_numpy(table)

    def _nearest_free(self, row: np.ndarray, q: np.ndarray, t: int, start: int) -> int | None:
        free = (q < self.a_max) & ~row
        free[:start] = False
        left = np.flatnonzero(free[:t])
        right = np.flatnonzero(free[t + 1 :])
        best_left = t - int(left[-1]) if left.size else None
        best_right = int(right[0]) + 1 if right.size else None
        if best_left is None and best_right is None:
            return None
        if best_right is None or (best_left is not None and best_left <= best_right):
            return t - best_left
        return t + best_right

    def active(self, layer: int, step: int) -> bool:
        """Λ(layer, step); ``False`` for steps at or past ``total_steps`` (training ran longer than
        planned: no competition is scheduled there)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(
                f"layer={layer!r} is not allowed; expected an integer in [0, {self.num_layers - 1}]"
            )
        if step >= self.total_steps or step < 0:
            return False
        return bool(self.table[layer, step])

    def active_per_step(self) -> torch.Tensor:
        """``(T,)`` the number of competing layers at each step (at most ``a_max``)."""
        return self.table.sum(dim=0)

    def first_active_step(self, steps: int) -> int | None:
        """The first of the steps ``0 .. steps - 1`` at which some layer competes, ``None`` when
        none does (a run that short trained as plain top-K routing)."""
        active = torch.nonzero(self.active_per_step()[: max(int(steps), 0)]).flatten()
        return int(active[0]) if active.numel() else None

    def state_dict(self) -> dict[str, Any]:
        """The schedule's arguments (its table is a function of them): :func:`schedule_from_state`
        rebuilds it."""
        keys = ("num_layers", "total_steps", "omega", "a_max", "warmup", "seed")
        return {"type": "competition", **{k: getattr(self, k) for k in keys}}

    def __repr__(self) -> str:
        return (
            f"CompetitionSchedule(num_layers={self.num_layers}, total_steps={self.total_steps}, "
            f"omega={self.omega}, a_max={self.a_max}, warmup={self.warmup}, seed={self.seed})"
        )


class CoinFlipSchedule:
    """CompeteSMoE (2024)'s schedule (§3.2-3.3): at step t each layer competes with probability
    λ(t), independently of the other layers.

    The flip of ``(layer, step)`` is drawn from a generator seeded with ``(seed, layer, step)``:
    it does not depend on the call order, is the same on every rank and after a resume, and needs
    no table (``total_steps`` may be unknown).

    Args:
        num_layers: L.
        rate: λ, a number in [0, 1] (CompeteSMoE (2024) uses 0.05; 0.03-0.09 robust, Table 4) or a callable
            ``step -> λ``.
        seed: seed of the flips.
    """

    def __init__(self, num_layers: int, rate: float | Callable[[int], float] = 0.05, seed: int = 0) -> None:
        self.num_layers = _validate.positive_int("num_layers", num_layers)
        if not callable(rate):
            _validate.probability("rate", rate)
        self.rate = rate
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is not allowed; expected an integer >= 0")
        self.seed = seed

    def rate_at(self, step: int) -> float:
        """λ(step), checked to lie in [0, 1]."""
        value = self.rate(step) if callable(self.rate) else self.rate
        return _validate.probability(f"rate({step})", value)

    def active(self, layer: int, step: int) -> bool:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(
                f"layer={layer!r} is not allowed; expected an integer in [0, {self.num_layers - 1}]"
            )
        if step < 0:
            return False
        u = np.random.Generator(np.random.PCG64([self.seed, layer, int(step)])).random()
        return bool(u < self.rate_at(step))

    def first_active_step(self, steps: int) -> int | None:
        """The first of the steps ``0 .. steps - 1`` at which some layer's flip comes up, ``None``
        when none does.  Stops at the first: about 1 / (L·λ) steps are drawn."""
        for step in range(max(int(steps), 0)):
            if any(self.active(layer, step) for layer in range(self.num_layers)):
                return step
        return None

    def flips(self, total_steps: int) -> torch.Tensor:
        """``(L, total_steps)`` bool: the flips of the first ``total_steps`` steps."""
        _validate.positive_int("total_steps", total_steps)
        return torch.tensor([[self.active(i, t) for t in range(total_steps)] for i in range(self.num_layers)])

    def state_dict(self) -> dict[str, Any]:
        """The schedule's arguments: :func:`schedule_from_state` rebuilds it."""
        if callable(self.rate):
            raise ValueError("a CoinFlipSchedule with a callable rate has no state_dict; rebuild it instead")
        return {"type": "coin-flip", "num_layers": self.num_layers, "rate": self.rate, "seed": self.seed}

    def __repr__(self) -> str:
        return f"CoinFlipSchedule(num_layers={self.num_layers}, rate={self.rate!r}, seed={self.seed})"


def build_schedule(method: str, num_layers: int, total_steps: int, seed: int = 0, **options: Any) -> Any:
    """The schedule that ``method``'s preset declares (``Method.schedule``) for a model of
    ``num_layers`` MoE layers, or ``None``.

    ``"coin-flip"`` (``competesmoe-v1``, CompeteSMoE (2024)) gets a :class:`CoinFlipSchedule` with
    λ = ``rate`` (0.05); ``"competition"`` (``competesmoe``, ``densemoe``, CompeteSMoE (2025)) a
    :class:`CompetitionSchedule` with ``omega``, ``a_max`` (capped at ``num_layers``) and
    ``competition_warmup`` (the warm-up fraction).  Other keys of ``options`` (the layer's own
    options) are ignored here.
    """
    kind = get_method(method).schedule
    if num_layers == 0 or kind is None:
        return None
    if kind == "coin-flip":
        return CoinFlipSchedule(num_layers, rate=options.get("rate", 0.05), seed=seed)
    kwargs: dict[str, Any] = {k: options[k] for k in ("omega", "a_max") if k in options}
    if "a_max" in kwargs:  # the cap cannot exceed the model's depth (docs/references.md: scaled with depth)
        kwargs["a_max"] = min(int(kwargs["a_max"]), num_layers)
    if "competition_warmup" in options:
        kwargs["warmup"] = options["competition_warmup"]
    return CompetitionSchedule(num_layers=num_layers, total_steps=total_steps, seed=seed, **kwargs)


def schedule_from_state(state: dict[str, Any] | None) -> Any:
    """The schedule whose :meth:`state_dict` is ``state`` (``None`` for none): the one way a saved
    schedule comes back, in checkpoints, ``moelab.save`` folders and the transformers Trainer's."""
    if state is None:
        return None
    kinds = {"competition": CompetitionSchedule, "coin-flip": CoinFlipSchedule}
    kind = state.get("type") if isinstance(state, dict) else None
    if kind not in kinds:
        raise ValueError(f"schedule state of type {kind!r} is not allowed; expected one of {list(kinds)}")
    return kinds[kind](**{k: v for k, v in state.items() if k != "type"})


def model_schedule(
    model: nn.Module, total_steps: int | None, seed: int = 0, options: dict[str, Any] | None = None
) -> Any:
    """The training schedule the MoE layers of ``model`` declare (``Method.schedule``), built by
    :func:`build_schedule` for all of them (layers of other methods ignore it), or ``None`` when no
    layer's method needs one.

    Args:
        model: the model.
        total_steps: the planned optimizer steps (needed by the competition schedule).
        seed: the seed of the schedule's draws.
        options: schedule options, keys of :data:`SCHEDULE_OPTIONS` (``omega``, ``a_max``,
            ``competition_warmup``, ``rate``).
    """
    options = dict(options or {})
    bad = sorted(k for k in options if k not in SCHEDULE_OPTIONS)
    if bad:
        raise ValueError(f"schedule_options keys {bad} are not allowed; allowed: {list(SCHEDULE_OPTIONS)}")
    layers = moe_layers(model)
    scheduled = sorted({m.method for m in layers if get_method(m.method).schedule is not None})
    if not scheduled:
        return None
    kinds = sorted({get_method(m).schedule for m in scheduled})
    if len(kinds) > 1:
        raise ValueError(
            f"the model's MoE layers use methods {scheduled}, which need different schedules {kinds}; "
            "one model trains with one schedule"
        )
    if kinds == ["competition"] and total_steps is None:
        raise ValueError(
            f"method {scheduled[0]!r} needs the planned number of steps for its competition schedule; "
            "set max_steps (or a dataset with a length)"
        )
    return build_schedule(scheduled[0], len(layers), total_steps, seed, **options)


def routing_context(
    model: nn.Module, total_steps: int | None = None, seed: int = 0, **schedule_options: Any
) -> RoutingContext:
    """A :class:`moelab.RoutingContext` for training ``model``, attached to its MoE layers, holding
    the schedule its layers' method declares (:func:`model_schedule`): built once, from the seed,
    identical on every rank and after a resume."""
    ctx = RoutingContext(
        total_steps=total_steps, schedule=model_schedule(model, total_steps, seed, schedule_options)
    )
    attach(model, ctx)
    return ctx


# ---------------------------------------------------------------------------------- learning rate
#: the learning-rate schedules of :func:`lr_factor` (all with linear warm-up)
LR_SCHEDULES = ("inverse_sqrt", "cosine", "constant")


def lr_factor(schedule: str, step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    """The learning-rate multiplier after ``step`` completed steps (``LambdaLR`` convention).

    * warm-up (``step < warmup``): ``(step + 1) / warmup``;
    * ``inverse_sqrt``: ``sqrt(max(warmup, 1) / (step + 1))`` — CompeteSMoE (2024)'s ``1/√t``, equal to 1 at the
      end of warm-up (fairseq's ``inverse_sqrt``);
    * ``cosine``: ``min_ratio + (1 − min_ratio)·½(1 + cos(π·p))``, ``p`` the post-warm-up progress;
    * ``constant``: 1.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / (step + 1))
    if schedule == "cosine":
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if schedule == "constant":
        return 1.0
    raise ValueError(f"schedule={schedule!r} is not allowed; expected one of {list(LR_SCHEDULES)}")


#: ``--opt`` keys that configure the competition schedule (not the layer): ω, A_max and the
#: warm-up fraction of CompeteSMoE (2025)'s schedule, λ of CompeteSMoE (2024)'s coin flips
SCHEDULE_OPTIONS = ("omega", "a_max", "competition_warmup", "rate")


def split_schedule_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(layer options, schedule options)`` of a method's ``--opt`` values."""
    layer = {k: v for k, v in options.items() if k not in SCHEDULE_OPTIONS}
    schedule = {k: v for k, v in options.items() if k in SCHEDULE_OPTIONS}
    return layer, schedule
