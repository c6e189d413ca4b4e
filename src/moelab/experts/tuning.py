""":func:`autotune`: the one place moelab times its kernels, and only when the user calls it.

``impl="auto"`` in a forward is a rule (:func:`moelab.experts.kernels.choose_kernel`); no forward
reads a clock.  Where the rule cannot know which kernel is fastest on this host (the CPU with
several torch threads whose idle OpenMP workers spin, docs/performance.md), the user may measure:
``moelab.experts.autotune(model, example_input)`` runs the model once on the example, times the
candidate kernels of every ``impl="auto"`` expert bank's calls per shape class, and records the
fastest so that later forwards of that class run it (``moelab train --autotune`` does it on one
batch).  docs/kernels.md ("Measuring: autotune") says what it guarantees and what it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validate
from . import kernels
from .bank import ExpertBank
from .kernels import Probe, ShapeClass
from .parallel import ExpertParallelBank

__all__ = ["AutotuneReport", "TunedClass", "autotune", "forget_tuned"]


@dataclass(frozen=True)
class TunedClass:
    """What :func:`autotune` measured for one shape class."""

    shape_class: ShapeClass
    #: the kernel it picked: the fastest by median of the candidates that competed
    pick: str
    #: what ``impl="auto"``'s rule runs for this class without a measurement
    rule: str
    #: median milliseconds of the clock per candidate that competed (forward + backward in training)
    medians_ms: dict[str, float]
    #: candidates left out: their outputs or gradients differed from the rule's kernel's on a probe
    excluded: tuple[str, ...]
    #: the expert-bank calls of this class in the example (every one a probe of the bit check)
    calls: int
    #: candidates timed for the report but never picked: they do not round as the rule's kernel by
    #: construction (:func:`moelab.experts.kernels.rounds_alike`); ``impl=`` fixes one of them
    other_rounding: tuple[str, ...] = ()

    def describe(self) -> str:
        times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.medians_ms.items())
        out = [f"{self.shape_class.describe()}: {self.pick} (rule: {self.rule}); {times}"]
        if self.excluded:
            out.append(f"; excluded (numbers differ from {self.rule}'s): {', '.join(self.excluded)}")
        if self.other_rounding:
            out.append(
                f"; not picked, they round otherwise than {self.rule} (fix one with impl=): "
                f"{', '.join(self.other_rounding)}"
            )
        return "".join(out)


@dataclass(frozen=True)
class AutotuneReport:
    """What :func:`autotune` measured and picked, per shape class; ``print(report)`` shows it."""

    classes: tuple[TunedClass, ...]

    @property
    def picks(self) -> dict[ShapeClass, str]:
        """The kernel picked per shape class (what later ``impl="auto"`` forwards of it run)."""
        return {c.shape_class: c.pick for c in self.classes}

    def summary(self) -> str:
        """One line: how many shape classes were measured and each pick."""
        picks = "; ".join(f"{c.shape_class.describe()} -> {c.pick} (rule {c.rule})" for c in self.classes)
        n = len(self.classes)
        return f"autotune measured {n} shape class{'es' if n != 1 else ''}: {picks}"

    def __str__(self) -> str:
        return "\n".join(["moelab.experts.autotune:", *(f"  {c.describe()}" for c in self.classes)])


def autotune(
    model: nn.Module,
    example_input: Any,
    *,
    training: bool | None = None,
    repeats: int = 5,
    clock: Callable[[], float] | None = None,
    verbose: bool = False,
) -> AutotuneReport:
    """Measure ``impl="auto"``'s candidate kernels on ``model``'s expert banks and keep the fastest.

    Runs ``model`` once on ``example_input``, with autograd when ``training`` (default:
    ``model.training``) and without otherwise, and records every call of every
    :class:`~moelab.ExpertBank` with ``impl="auto"`` in it (``model`` may be such a bank itself).
    Per shape class of those calls (:class:`~moelab.experts.kernels.ShapeClass`: device, dtype,
    autocast dtype, training or not, threads, wait policy, widths, N, K, tokens to a power of
    two) it times the candidates (``"loop"``, ``"grouped"`` where it runs, ``"stream"`` in
    inference; :func:`~moelab.experts.kernels.measure`): one call of each on every recorded call
    of the class and on one random routing, then ``repeats`` interleaved rounds on the first call
    (forward and backward in training).  Only the candidates that round as the rule's kernel by
    construction (:func:`~moelab.experts.kernels.rounds_alike`: the loop and the stream in
    inference on one CPU thread) and whose outputs, and in training whose gradients of the tokens,
    routing weights and expert weights, equal its own bit for bit on every one of those probes
    compete; the others are timed for the report (``other_rounding``; ``impl=`` fixes one) and
    never picked.  The fastest by median is recorded for its class on each of ``model``'s auto
    banks (their ``tuned``, until :func:`forget_tuned`): every later ``impl="auto"`` forward of
    that class in ``model`` runs it; other classes, and other models, keep the rule.

    The model's forward runs under a forked RNG (the global RNG streams are as before the call),
    and it and the measurement under their own saved-tensor hooks (an enclosing activation
    checkpoint or offloading hook sees neither); nothing is timed inside a forward.

    What it promises: whatever the clock says, the numbers.  Two processes that call ``autotune``
    may pick differently (timings on this host at this moment), but every kernel it may pick
    computes the same bits as the rule's on every routing of the class, by construction, not by a
    probe (a probe's bit identity does not hold for every real routing: the threaded loop and
    ``grouped_mm`` agree on some routings and not on others); so two runs of the same command that
    autotune give the same weights, those of a run without it.

    Args:
        model: a model holding :class:`~moelab.ExpertBank` s with ``impl="auto"``, or one such bank.
        example_input: what ``model`` is called with: a tensor (``model(x)``), a tuple
            (``model(*args)``; for a bank ``(x, routing)``), a dict (``model(**kwargs)``),
            or a callable run as ``example_input(model)`` (e.g. ``lambda m: task.loss(m, batch)``).
        training: measure the training classes (autograd) or the inference ones.
        repeats: timed rounds per candidate.
        clock: replaces ``time.perf_counter`` (tests).
        verbose: print the report.

    Returns:
        The :class:`AutotuneReport`: per shape class, the candidates' medians, those excluded,
        the pick and the rule's choice.

    Raises:
        ValueError: while torch.compile traces, on a compiled module, on a bank off the CPU or
            spread over processes, when ``model`` has no ``impl="auto"`` bank or the example
            calls none, or ``repeats`` is not a positive integer.
    """
    _validate.positive_int("repeats", repeats)
    if torch.compiler.is_compiling():
        raise ValueError(
            "autotune is not allowed while torch.compile traces; call it once, eagerly, before compiling "
            "(a compiled forward runs auto's rule)"
        )
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model of type {type(model).__name__} is not allowed; expected a torch.nn.Module "
            "(a model or an ExpertBank)"
        )
    if hasattr(model, "_orig_mod"):
        raise ValueError(
            "model is a torch.compile'd module, which is not allowed; autotune the eager model "
            "(model._orig_mod) before compiling: a compiled forward runs auto's rule"
        )
    banks = [m for m in model.modules() if isinstance(m, ExpertBank) and m.impl == "auto"]
    if not banks:
        raise ValueError(
            f"model of type {type(model).__name__} is not allowed: it holds no ExpertBank with impl='auto', "
            "whose kernel autotune would pick"
        )
    for bank in banks:
        if isinstance(bank, ExpertParallelBank):
            raise ValueError(
                "an expert-parallel ExpertBank is not allowed: autotune measures in one process; "
                "call it before parallelize(...)"
            )
        device = bank.w_out.device.type
        if device != "cpu":
            raise ValueError(
                f"an ExpertBank on device={device} is not allowed; autotune measures on the CPU only "
                "(elsewhere auto's rule runs grouped_mm where it can)"
            )
    training = model.training if training is None else bool(training)
    calls: list[tuple[ShapeClass, Probe, str]] = []

    def record(bank: nn.Module, args: tuple, kwargs: dict) -> None:
        x, indices, weights = _bank_inputs(args, kwargs)
        grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (x, weights, *bank.parameters())
        )  # as the bank's forward decides it
        experts = bank.expert_weights  # unchanged until the measurement: no step runs in between
        key = kernels.shape_class(x, indices.shape[1], experts, grad)
        rule = kernels.rule_kernel(x, indices.shape[1], experts, grad)
        probe = Probe(x.detach().clone(), indices.detach().clone(), weights.detach().clone(), experts)
        calls.append((key, probe, rule))

    handles = [bank.register_forward_pre_hook(record, with_kwargs=True) for bank in banks]
    try:
        with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(training), _own_saved_tensors():
            _call(model, example_input)
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        raise ValueError(
            f"example_input is not allowed: running {type(model).__name__} on it called no ExpertBank "
            "with impl='auto', so there is nothing to measure"
        )
    groups: dict[ShapeClass, list[tuple[Probe, str]]] = {}
    for key, probe, rule in calls:
        groups.setdefault(key, []).append((probe, rule))
    classes = []
    for key, group in groups.items():
        probes = [probe for probe, _ in group]
        first = probes[0]
        probes.append(kernels.random_probe(first.x, key.top_k, first.experts))
        autocast = (
            torch.autocast(key.device, dtype=key.autocast) if key.autocast is not None else nullcontext()
        )
        with autocast:
            found = kernels.measure(probes, key.grad, repeats=repeats, clock=clock, reference=group[0][1])
        medians = {name: seconds * 1e3 for name, seconds in found.medians.items()}
        classes.append(
            TunedClass(
                key, found.pick, group[0][1], medians, found.excluded, len(group), found.other_rounding
            )
        )
    report = AutotuneReport(tuple(classes))
    picks = kernels.check_picks(report.picks)
    for bank in banks:  # the model's own banks: another model of the same shapes keeps its rule
        bank.tuned.update(picks)
    if verbose:
        print(report)
    return report


def forget_tuned(model: nn.Module) -> None:
    """Forget what :func:`autotune` picked for ``model``'s expert banks: ``impl="auto"`` follows its
    rule again."""
    for bank in model.modules():
        if isinstance(bank, ExpertBank):
            bank.tuned.clear()


def _own_saved_tensors():
    """Saved-tensor hooks that keep the tensors as they are: an enclosing hook (an activation
    checkpoint, offloading) does not see the example's autograd graph."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _call(model: nn.Module, example: Any) -> None:
    if callable(example) and not isinstance(example, (Tensor, nn.Module)):
        example(model)
    elif isinstance(example, tuple):
        model(*example)
    elif isinstance(example, Mapping):
        model(**example)
    else:
        model(example)


def _bank_inputs(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, indices, weights)`` of a bank call ``bank(x, indices, weights)`` or ``bank(x, routing)``
    (a routing with ``.indices`` and ``.weights``), positional or by keyword."""
    values = list(args)
    for name in ("x", "indices", "weights", "routing"):
        if name in kwargs:
            values.append(kwargs[name])
    x, rest = values[0], values[1:]
    if rest and hasattr(rest[0], "indices") and hasattr(rest[0], "weights"):
        return x, rest[0].indices, rest[0].weights
    return x, rest[0], rest[1]
