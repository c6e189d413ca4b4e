"""The one training loop: every command that trains (``train``, ``compare``, ``finetune``,
``specialize``) runs its task through :class:`Trainer`, which writes checkpoints in one format
(:mod:`moelab.train.checkpoint`, opened by :func:`moelab.load`) and resumes them exactly.  The flow
of a step, what a :class:`Task` provides, data parallelism and what a checkpoint holds are in
docs/architecture.md ("The training loop") and docs/scaling.md.
"""

from __future__ import annotations

import math
import pickle
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from .. import _validate
from ..balance import StepBalance, attached_step_balance
from ..errors import CheckpointError, NonFiniteError, TrainingError
from ..experts import autotune as autotune_kernels
from ..extras import require
from ..io.model import load_weights, save
from ..io.rundir import RunDir
from ..layer import attach, aux_terms, count_parameters, moe_layers
from ..metrics import max_violation, routing_loads, routing_summary
from ..optim import build_optimizer, check_optimizer
from ..routing import RoutingContext
from ..schedules import LR_SCHEDULES, lr_factor, routing_context
from . import checkpoint as ckpt
from . import live
from .parallel import Parallel, choose
from .plots import CURVES_NAME, plot_log

__all__ = [
    "Task",
    "TrainConfig",
    "Trainer",
    "TrainingError",
]


class Task(Protocol):
    metric: str
    lower_is_better: bool

    def sample(self, generator: torch.Generator, batch_size: int, step: int) -> Any: ...
    def shard(self, batch: Any, rank: int, world: int) -> Any: ...
    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, int]: ...
    def evaluate(self, model: nn.Module, split: str, max_tokens: int | None) -> dict[str, float]: ...


#: the largest learning rate: float32's largest number (Adam casts its step size to the parameters' dtype)
_MAX_LR = float(torch.finfo(torch.float32).max)


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping settings (defaults: CompeteSMoE (2024) App. C.2 where it states them).

    Attributes:
        steps: optimisation steps.
        batch_size: global batch (sequences); 48 in CompeteSMoE (2024).
        lr: learning rate (7e-4 in CompeteSMoE (2024)).
        schedule: ``inverse_sqrt`` (CompeteSMoE (2024): "a learning rate schedule of 1/√t"), ``cosine`` or
            ``constant``; all with linear warm-up.
        warmup: warm-up steps; ``None`` = 5% of ``steps`` (CompeteSMoE (2024) does not state it: our choice).
        min_lr_ratio: floor of the cosine schedule, as a fraction of ``lr``.
        grad_clip: max global gradient norm (0 = off); CompeteSMoE (2024) does not state it: 1.0 is our choice.
        eval_every: evaluate on the validation split every this many steps (and at the end).
        eval_tokens: cap on the validation tokens per evaluation (``None`` = the whole split).
        test_tokens: cap on the test tokens of the final test (``None`` = the whole split).
        ckpt_every: write a checkpoint every this many steps (and at the end); 0 = only at the end.
        keep_ckpts: how many checkpoints to keep (the newest); 0 = every checkpoint (the curves over
            training of ``moelab diagnose``).
        seed: seeds python, numpy, torch and the data order.
        weight_decay: AdamW's decoupled weight decay, on the matrices only (:func:`moelab.optim.param_groups`).
            0 by default: CompeteSMoE (2024) trains with Adam and no decay, and 0 keeps every paper preset
            and every documented number as it was (AdamW without decay makes Adam's updates exactly).
        optimizer: ``adamw`` (default) or ``adam``; ``adam`` refuses a weight decay (its decay would be an
            L2 term coupled to the gradient, not the decay users expect).
        keep_best: save the best-validation weights (``best/``) and test them; ``False``: the
            evaluations are only logged and the final weights are tested (a paper that reports the
            model at the end of training, as Krishnamurthy et al. (2023)).
    """

    steps: int
    batch_size: int
    lr: float = 7e-4
    schedule: str = "inverse_sqrt"
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int | None = None
    test_tokens: int | None = None
    ckpt_every: int = 0
    keep_ckpts: int = 2
    seed: int = 0
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    keep_best: bool = True

    def __post_init__(self) -> None:
        _validate.positive_int("steps", self.steps)
        _validate.positive_int("batch_size", self.batch_size)
        _validate.positive("lr", self.lr)
        if self.lr > _MAX_LR:  # Adam casts the step size to the parameters' float32 and overflows
            raise ValueError(
                f"lr={self.lr!r} is not allowed; expected a number > 0 and <= {_MAX_LR:.3g} (float32's largest)"
            )
        _validate.one_of("schedule", self.schedule, LR_SCHEDULES)
        if self.warmup is not None:
            _validate.int_in_range("warmup", self.warmup, 0, 1 << 40)
        _validate.probability("min_lr_ratio", self.min_lr_ratio)
        _validate.non_negative("grad_clip", self.grad_clip)
        _validate.positive_int("eval_every", self.eval_every)
        for name in ("eval_tokens", "test_tokens"):
            if getattr(self, name) is not None:
                _validate.positive_int(name, getattr(self, name))
        _validate.int_in_range("ckpt_every", self.ckpt_every, 0, 1 << 40)
        _validate.int_in_range("keep_ckpts", self.keep_ckpts, 0, 1 << 40)
        _validate.int_in_range("seed", self.seed, 0, 2**63 - 1)
        check_optimizer(self.optimizer, self.weight_decay)

    @property
    def warmup_steps(self) -> int:
        return round(0.05 * self.steps) if self.warmup is None else self.warmup


def _rng_state(generator: torch.Generator) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": list(_flatten_py_state(random.getstate())),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "data": generator.get_state(),
    }


def _flatten_py_state(state: tuple) -> tuple:
    version, internal, gauss = state
    return version, torch.tensor(internal, dtype=torch.int64), gauss


def _set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)  # dropout on the GPU continues the same stream
    generator.set_state(state["data"])


class Trainer:
    """Train ``model`` on ``task`` and write the run into ``run`` (a :class:`moelab.io.RunDir`).

    Args:
        model: the model (its MoE layers get a shared :class:`moelab.RoutingContext`).
        task: the :class:`Task`.
        config: :class:`TrainConfig`.
        run: the run directory, or ``None`` to write nothing (tests, notebooks); a run directory
            needs matplotlib (``moelab[plot]``) for its ``curves.png``.
        schedule_options: options of the schedule the layers' method declares
            (:data:`moelab.schedules.SCHEDULE_OPTIONS`; :func:`moelab.schedules.routing_context`).
        ctx: the routing context to train with, attached here; default the one
            :func:`moelab.schedules.routing_context` builds from the model, ``config.steps``,
            ``config.seed`` and ``schedule_options`` (fine-tuning passes one without a schedule:
            its routers are frozen, so no layer competes).
        progress: show a tqdm bar.
        extra_metrics: added to ``metrics.json``.
        on_eval: called with ``(step, validation results)`` after each evaluation.
        parallel: how the model is spread over processes (:mod:`moelab.train.parallel`: one
            process ``Parallel()``, DDP ``DataParallel()``, expert parallel ``ExpertParallel()``,
            FSDP2 ``Parallelized(ep=1, fsdp=True)`` or EP × FSDP2 ``Parallelized(fsdp=True)``);
            default :func:`moelab.train.parallel.choose` (DDP under ``torchrun``, else one
            process).
        autotune: before the first step, measure ``impl="auto"``'s candidate kernels on one
            training batch (:func:`moelab.experts.autotune`; its own generator, the global RNG
            untouched), print one line saying what it picked, and train with the picks (kept in
            :attr:`autotuned`).  Autotune picks only among kernels that round as the rule's by
            construction (:func:`moelab.experts.kernels.rounds_alike`): in training that is the rule's
            kernel alone, so the weights are those of a run without it, and two runs of the same
            command give the same weights.  One process only.
        log: the live view beside ``log.csv`` (:mod:`moelab.train.live`): ``auto`` (default) =
            ``tensorboard`` when the package is installed, else ``csv``; ``tensorboard`` writes event
            files under ``<run>/tensorboard/`` (rank 0); ``csv`` = ``log.csv`` only.
        log_every: the per-layer diagnostics, load histograms and load image every this many steps
            (and at the last); the step scalars are written every step.

    Only parameters with ``requires_grad`` are optimised (fine-tuning freezes the routers).
    """

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        config: TrainConfig,
        run: RunDir | None = None,
        *,
        schedule_options: dict[str, Any] | None = None,
        ctx: RoutingContext | None = None,
        progress: bool = True,
        extra_metrics: dict[str, Any] | None = None,
        on_eval: Callable[[int, dict[str, float]], None] | None = None,
        parallel: Parallel | None = None,
        autotune: bool = False,
        log: str = "auto",
        log_every: int = 10,
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config of type {type(config).__name__} is not allowed; expected a TrainConfig")
        if run is not None:  # the run's curves.png, drawn when it finishes: refused now, not then
            require("plot", "Trainer(run=...), which draws the run's curves.png,")
        self.model = model
        self.task = task
        self.config = config
        self.run = run
        self.progress = progress
        self.extra_metrics = dict(extra_metrics or {})
        self.on_eval = on_eval
        self.parallel = parallel if parallel is not None else choose()
        self.rank, self.world_size = self.parallel.rank, self.parallel.world_size
        if config.batch_size % self.world_size:
            raise ValueError(
                f"batch_size={config.batch_size} is not allowed with {self.world_size} processes; "
                "expected a multiple of the world size"
            )
        if autotune and self.world_size > 1:
            raise ValueError(
                f"autotune=True is not allowed with {self.world_size} processes; expected one process "
                "(each rank would measure and pick on its own)"
            )
        self.autotune = bool(autotune)
        #: the live view this run writes (``log`` resolved: ``tensorboard`` or ``csv``)
        self.log = live.resolve_log(log)
        self.log_every = live.check_every(log_every)
        #: the :class:`moelab.experts.AutotuneReport` of ``autotune=True``, once :meth:`fit` measured
        self.autotuned = None
        if ctx is None:
            ctx = routing_context(model, config.steps, config.seed, **dict(schedule_options or {}))
        else:
            attach(model, ctx)
        self.ctx = ctx
        self._step_loads: list[Tensor] | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ckpt_dir(self) -> Path | None:
        return None if self.run is None else self.run.file("ckpt")

    def _mean_over_ranks(self, task_loss: Tensor, aux: Tensor) -> tuple[float, float, dict[str, float]]:
        """``(task loss, aux loss, the weighted aux terms by name)`` as floats, averaged over the
        ranks (what rank 0 logs), in one collective."""
        terms = aux_terms(self.model)
        balance = attached_step_balance(self.model)  # the global-scope terms, left out of the layers'
        for name, value in (getattr(balance, "last_terms", None) or {}).items():
            terms[name] = terms.get(name, 0.0) + value.detach().float().cpu()
        values = self.parallel.mean(
            torch.stack(
                [task_loss.detach(), aux.detach().to(task_loss), *(t.to(task_loss) for t in terms.values())]
            )
        ).tolist()
        return values[0], values[1], dict(zip(terms, values[2:]))

    def _evaluate(self, split: str, max_tokens: int | None) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self.task.evaluate(self.model, split, max_tokens)
        finally:
            self.model.train(was_training)

    def _better(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        return value < best if self.task.lower_is_better else value > best

    # ------------------------------------------------------------------ the loop
    def fit(self, resume: bool = False) -> dict[str, Any]:
        """Train, test the best-validation weights and return (and write) the metrics."""
        cfg = self.config
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        torch.manual_seed(cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        self._prune_checkpoints()
        saved = self._latest_checkpoint() if resume else None
        if self.autotune:
            self._autotune(int(saved["step"]) if saved else 0)
        self.parallel.apply(self.model)  # after a resume has loaded the full weights
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = build_optimizer(cfg.optimizer, self.model, cfg.lr, cfg.weight_decay)  # the model's groups
        self.parallel.prepare_optimizer(optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(cfg.schedule, s, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        )
        state: dict[str, Any] = {
            "best_val": None,
            "best_step": 0,
            "train_tokens": 0,
            "train_time": 0.0,
            "recent_losses": [],
            "last_val": None,
            "run_load": [],  # per MoE layer, the expert counts of every training step on every rank
        }
        start = self._resume(saved, optimizer, scheduler, generator, state) if resume else 0
        if start >= cfg.steps and self.run is not None and self.run.file("metrics.json").exists():
            return self.run.read_metrics()
        forward = self.parallel.wrap(self.model, self.task)
        self.model.train()
        bar = self._progress_bar(start)
        # balance_scope="global" layers: the step's statistics over the ranks (moelab.balance),
        # cleared by the step hooks of ctx.advance()
        balance = StepBalance(self.model, self.ctx)
        view = None
        if self.log == "tensorboard" and self.is_main and self.run is not None:
            view = live.TensorBoardLog(self.run.file(live.TENSORBOARD_DIR), start, self.log_every)
        try:
            for step in range(start, cfg.steps):
                row = self._step(step, forward, params, optimizer, scheduler, generator, state)
                done = step + 1
                if view is not None:  # before validation: the layers hold the training step's routing
                    view.layers(done, self.model, self._step_loads, last=done == cfg.steps)
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    self._evaluate_and_keep_best(done, row, state)
                if view is not None:
                    view.scalars(row)
                self.ctx.advance()  # the step hooks (selection biases, step statistics), then ctx.step = done
                if self.is_main and self.run is not None:
                    self.run.append_log(row)
                if self.run is not None and (
                    (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps
                ):
                    self._checkpoint(done, optimizer, scheduler, generator, state)
                if bar is not None:
                    self._show(bar, row, state)
        finally:
            balance.close()
            if view is not None:
                view.close()
        if bar is not None:
            bar.close()
        return self._finish(state)

    # ------------------------------------------------------------------ the loop's parts
    def _autotune(self, step: int) -> None:
        """``autotune=True``: measure on one training batch of step ``step`` drawn with a generator of
        its own (the run's data order and RNG streams stay as they are), and say what it picked."""
        sample = self.task.sample(
            torch.Generator().manual_seed(self.config.seed), self.config.batch_size, step
        )
        batch = self.task.shard(sample, self.rank, self.world_size)
        self.autotuned = autotune_kernels(
            self.model, lambda model: self.task.loss(model, batch), training=True
        )
        print(f"moelab: {self.autotuned.summary()}; this run trains with the picks", flush=True)

    def _prune_checkpoints(self) -> None:
        """Keep the newest ``keep_ckpts`` checkpoints (0: all), as every checkpoint write does: a kill
        between a checkpoint's rename and the removal of the oldest leaves one more.  Only when the
        ones kept all verify (an older one is the fallback of a damaged newer one)."""
        if not (self.is_main and self.ckpt_dir is not None) or self.config.keep_ckpts == 0:
            return
        found = ckpt.list_checkpoints(self.ckpt_dir)
        extra, kept = found[: -self.config.keep_ckpts], found[-self.config.keep_ckpts :]
        if not extra:
            return
        try:
            for path in kept:
                ckpt.verify_checkpoint(path)
        except CheckpointError:
            return
        for path in extra:
            shutil.rmtree(path, ignore_errors=True)

    def _latest_checkpoint(self) -> dict[str, Any] | None:
        """The training state of the newest good checkpoint, its weights loaded into the full
        model (a checkpoint never depends on the parallel layout); ``None`` without one.  A sharded
        checkpoint resumed by a sharded run keeps its weights for :meth:`_resume` (read shard by
        shard into the layout: ``"sharded_path"``); any other pairing goes through the full model."""
        if self.ckpt_dir is None:
            return None
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            return None
        try:
            if self.parallel.sharded_checkpoints and ckpt.is_sharded(path):  # verified just above
                return {**torch.load(path / ckpt.STATE, weights_only=True), "sharded_path": path}
            return ckpt.load_checkpoint(path, self.model)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:  # digests that match a crafted file
            raise CheckpointError(
                f"checkpoint {path}: {ckpt.STATE} cannot be read as a training state "
                f"({str(exc).splitlines()[0][:120]}); nothing of it was run. Remove {path} to resume from "
                "an older checkpoint, or pass --force to start afresh"
            ) from None

    def _resume(self, saved, optimizer, scheduler, generator, state: dict[str, Any]) -> int:
        """Restore the optimizer, schedules, RNG streams and trainer state of ``saved``; return
        the step to continue from (0 without a checkpoint)."""
        start = 0
        if saved is not None:
            if "sharded_path" in saved:  # every rank reads the pieces of its own shards
                ckpt.load_sharded_checkpoint(
                    saved["sharded_path"], self.model, optimizer, saved["optimizer_groups"]
                )
            else:
                self.parallel.load_optimizer_state(optimizer, self.model, saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            self.ctx.load_state_dict(saved["ctx"])  # refuses another competition schedule
            _set_rng_state(saved["rng"], generator)
            state.update(saved["trainer"])
            start = int(saved["step"])
        if self.is_main and self.run is not None:
            self._restore_log(saved)  # the log as it was at the checkpoint, whatever became of the file
        return start

    def _step(self, step, forward, params, optimizer, scheduler, generator, state) -> dict[str, Any]:
        """One optimisation step; returns its ``log.csv`` row (validation columns empty)."""
        cfg = self.config
        t0 = time.perf_counter()
        batch = self.task.shard(self.task.sample(generator, cfg.batch_size, step), self.rank, self.world_size)
        try:  # this rank's shard; DDP averages the gradients over the ranks in backward
            task_loss, aux, tokens = forward(batch)
        except NonFiniteError as exc:  # the routers saw NaN/inf before the loss did
            raise TrainingError(
                f"non-finite values at step {step + 1} ({exc}); stopped; {self._last_good()}. "
                "Lower --lr or check the data"
            ) from exc
        task_value, aux_value, term_values = self._mean_over_ranks(task_loss, aux)
        if not math.isfinite(task_value + aux_value):  # the same decision on every rank
            raise TrainingError(
                f"non-finite loss at step {step + 1} (task {task_value:.4g}, aux {aux_value:.4g}); "
                f"stopped; {self._last_good()}. Lower --lr or check the data"
            )
        optimizer.zero_grad(set_to_none=True)
        (task_loss + aux).backward()
        # the norm is measured whatever the clipping (0: off = an infinite bound): a non-finite
        # gradient is never applied, so no checkpoint can hold a poisoned update
        grad_norm = float(self.parallel.clip(params, cfg.grad_clip or math.inf, self.model))
        if not math.isfinite(grad_norm):  # the step would poison the weights
            raise TrainingError(
                f"non-finite gradient norm at step {step + 1}; stopped before the update; "
                f"{self._last_good()}. Lower --lr or check the data"
            )
        lr = optimizer.param_groups[0]["lr"]
        try:
            optimizer.step()
        except RuntimeError as exc:  # e.g. a step size the parameters' dtype cannot hold
            if "overflow" not in str(exc):
                raise
            raise TrainingError(
                f"the update at step {step + 1} overflowed ({str(exc).splitlines()[0]}); stopped; "
                f"{self._last_good()}. Lower --lr"
            ) from None
        scheduler.step()
        state["train_time"] += time.perf_counter() - t0
        state["train_tokens"] += tokens * self.world_size
        window = max(1, min(100, cfg.eval_every))
        state["recent_losses"] = [*state["recent_losses"], task_value][-window:]
        metric = self.task.metric
        row = {
            "step": step + 1,
            "lr": lr,
            "loss": task_value,
            "aux_loss": aux_value,
            # each weighted term of the aux loss (CompeteSMoE (2025) App. D.2 Fig. 7: the router's
            # dynamics), summed over the layers
            **{f"aux_{name}": value for name, value in term_values.items()},
            "grad_norm": grad_norm,
            "tokens": state["train_tokens"],
            "time_s": round(state["train_time"], 4),
        }
        if moe_layers(self.model):  # this step's routing (this rank's shard), from the forward's routings
            summary = routing_summary(self.model)
            row.update({k: "" if v is None else v for k, v in summary.items()})
            self._add_run_load(state)
        row.update({"val_loss": "", f"val_{metric}": ""})
        return row

    def _add_run_load(self, state: dict[str, Any]) -> None:
        """Add the step's expert counts (summed over the ranks) to the run's, for MaxVio over the run;
        keep them in :attr:`_step_loads` for the live view."""
        self._step_loads = None
        loads = routing_loads(self.model)
        if any(load is None for load in loads):
            return
        flat = torch.cat(loads)
        if self.world_size > 1:  # the same on every rank: the whole step's load
            flat = self.parallel.mean(flat.to(next(self.model.parameters()).device)).cpu() * self.world_size
        sizes = [load.numel() for load in loads]
        self._step_loads = list(flat.split(sizes))
        step = [part.tolist() for part in self._step_loads]
        run = state["run_load"]
        if len(run) != len(step) or any(len(a) != len(b) for a, b in zip(run, step)):
            run = [[0.0] * n for n in sizes]
        state["run_load"] = [[a + b for a, b in zip(ra, rb)] for ra, rb in zip(run, step)]

    def _evaluate_and_keep_best(self, done: int, row: dict[str, Any], state: dict[str, Any]) -> None:
        """Validate, fill ``row``'s validation columns, and save ``best/`` on an improvement."""
        metric = self.task.metric
        try:
            val = self._evaluate("valid", self.config.eval_tokens)
        except NonFiniteError as exc:  # the routers saw NaN/inf before the metric did
            raise TrainingError(
                f"validation {metric} is not finite at step {done} ({exc}) although the training loss was; "
                f"stopped before saving this step; {self._last_good()}. Lower --lr or check the data"
            ) from exc
        if not math.isfinite(val[metric]):  # the same decision on every rank (the values are reduced)
            raise TrainingError(
                f"validation {metric} is not finite at step {done} ({val[metric]}) although the training "
                f"loss was; stopped before saving this step; {self._last_good()}. Lower --lr or check the data"
            )
        row["val_loss"], row[f"val_{metric}"] = val["loss"], val[metric]
        state["last_val"] = val[metric]
        if self._better(val[metric], state["best_val"]):  # the same decision on every rank
            state["best_val"], state["best_step"] = val[metric], done
            if self.run is not None and self.config.keep_best:
                weights = self.parallel.weights(self.model)  # a collective under expert parallelism
                if self.is_main:
                    save(  # the routing context of this validation (step done - 1)
                        weights,
                        self.run.file("best"),
                        ctx=self.ctx,
                        metadata={"step": done, f"val_{metric}": val[metric]},
                    )
        if self.on_eval is not None:
            self.on_eval(done, val)

    def _checkpoint(self, done: int, optimizer, scheduler, generator, state: dict[str, Any]) -> None:
        """Write ``ckpt/step-{done}``: the full model and optimizer state from rank 0, or, for a
        sharded layout (FSDP2 / expert parallelism), each rank's shards (a collective)."""
        log = self.run.file("log.csv")
        log_text = log.read_text() if self.is_main and log.exists() else ""
        record = {
            "step": done,
            "scheduler": scheduler.state_dict(),
            "ctx": self.ctx.state_dict(),
            "rng": _rng_state(generator),
            "trainer": state,
            "log": log_text,  # log.csv up to this step: resume rewrites it exactly
        }
        if self.parallel.sharded_checkpoints:
            ckpt.save_sharded_checkpoint(
                self.ckpt_dir, done, self.parallel.full_model(self.model), self.model, optimizer, record,
                keep=self.config.keep_ckpts,
            )  # fmt: skip
            return
        weights = self.parallel.weights(self.model)
        optimizer_state = self.parallel.optimizer_state(optimizer, self.model)
        if self.is_main:
            ckpt.save_checkpoint(
                self.ckpt_dir,
                done,
                weights,
                {**record, "optimizer": optimizer_state},
                keep=self.config.keep_ckpts,
            )

    def _progress_bar(self, start: int):
        if not (self.progress and self.is_main):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.config.steps, initial=start, desc=self.extra_metrics.get("method", "train"))

    def _show(self, bar, row: dict[str, Any], state: dict[str, Any]) -> None:
        postfix = {"loss": f"{row['loss']:.3f}"}
        if state["last_val"] is not None:
            postfix[f"val_{self.task.metric}"] = f"{state['last_val']:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)

    def _finish(self, state: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        metric = self.task.metric
        if self.world_size > 1:  # rank 0 has written the last best weights
            torch.distributed.barrier()
        best = (
            self.config.keep_best
            and self.run is not None
            and self.run.file("best").joinpath("config.json").exists()
        )
        if best:
            self.parallel.load_weights(self.model, lambda module: load_weights(self.run.file("best"), module))
        try:
            test = self._evaluate("test", cfg.test_tokens)
        except NonFiniteError as exc:
            raise TrainingError(
                f"the test {metric} of the best-validation weights is not finite ({exc}); "
                f"{self._last_good()}. Check the data"
            ) from exc
        if best and self.is_main:  # best/ now records the routing context the test ran with
            save(
                self.parallel.full_model(self.model),
                self.run.file("best"),
                ctx=self.ctx,
                metadata={
                    "step": state["best_step"],
                    f"val_{metric}": state["best_val"],
                    f"test_{metric}": test[metric],
                },
            )
        total, active = count_parameters(self.parallel.full_model(self.model))
        recent = state["recent_losses"]
        metrics = {
            "train_loss": sum(recent) / len(recent) if recent else None,
            f"val_{metric}": state["best_val"],
            f"test_{metric}": test[metric],
            "test_loss": test["loss"],
            "best_step": state["best_step"],
            "steps": cfg.steps,
            "tokens_per_s": state["train_tokens"] / state["train_time"] if state["train_time"] > 0 else None,
            "train_time_s": state["train_time"],
            "params": total,
            "active_params": active,
            "world_size": self.world_size,
            "seed": cfg.seed,
            "method": "+".join(sorted({layer.method for layer in moe_layers(self.model)})) or None,
            # MaxVio of the load accumulated over the run's training steps (every rank), mean over the layers
            "max_vio_run": (
                sum(max_violation(torch.tensor(load)) for load in state["run_load"]) / len(state["run_load"])
                if state.get("run_load")
                else None
            ),
            **self.extra_metrics,
        }
        # a run too short for its first competition says so (report, compare); a user's own
        # schedule object (only `active`) is not asked
        first_active = getattr(self.ctx.schedule, "first_active_step", None)
        if first_active is not None:
            metrics["first_competition_step"] = first_active(cfg.steps)
        if self.is_main and self.run is not None:
            # the figure before metrics.json, which marks the run finished: a finished run has it
            plot_log(self.run.file("log.csv"), self.run.file(CURVES_NAME), metric, metrics["method"] or "")
            self.run.write_metrics(metrics)
        return metrics

    def _last_good(self) -> str:
        """Where a stopped run can be resumed from (for the non-finite messages)."""
        if self.ckpt_dir is not None and (good := ckpt.latest_checkpoint(self.ckpt_dir)):
            return f"the last good checkpoint is {good}"
        return "no checkpoint was written yet"

    def _restore_log(self, saved: dict[str, Any] | None) -> None:
        """``log.csv`` as the checkpoint recorded it (its rows up to the checkpoint's step, byte for
        byte: a torn append, a damaged row or the rows written after the checkpoint are gone); with
        no checkpoint, no log (the run starts again at step 0)."""
        from ..io.atomic import atomic_write_text

        path = self.run.file("log.csv")
        if saved is None:
            path.unlink(missing_ok=True)
        elif saved.get("log") is not None:
            atomic_write_text(path, saved["log"])
