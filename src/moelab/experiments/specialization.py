"""The expert-specialization lab of Krishnamurthy et al. (2023): ``moelab specialize``.

Modes (``--mode``):

* ``run`` (default): one model — ``--gate {original,attentive}`` with ``--reg {none,importance,ls}``,
  optionally ``--distill`` (Krishnamurthy et al. (2023) §5.1); with ``--sweep``, the Krishnamurthy et al.
  (2023) Appendix C grid × ``--runs`` seeds, selecting the run with the minimum training error as the paper
  does (Krishnamurthy et al. (2023) §7).
* ``single``: the single-model baseline (one expert's architecture; Krishnamurthy et al. (2023) §7 row 1).
* ``table``: every row of Krishnamurthy et al. (2023) Table 2 / 3 / 7 for ``--data``, each as ``run`` would do
  it.
* ``partition``: the intuitive-partition experiment (Krishnamurthy et al. (2023) §4.2, Fig. 4, Table 1).
* ``scaling``: expert-count scaling (Krishnamurthy et al. (2023) §7, Fig. 6): how many experts each
  regulariser uses.

Training (Krishnamurthy et al. (2023) §7, docs/references.md): Adam, lr 1e-3, batch 512, 20 epochs
(MNIST-like) or 40 (CIFAR-100); loss NLL of ``log(Σ_e p(e|x) y_e(x) + 1e-7)`` plus the regulariser on the
gate's ``p(e|x)``: ``w · CV(Σ_x p)`` (:func:`moelab.losses.importance_loss`, Krishnamurthy et al. (2023) eq.
7) or ``L_s`` (:func:`moelab.losses.sample_similarity_loss`, Krishnamurthy et al. (2023) eq. 8–10) on the
normalised input pixels.

``metrics.json`` keys (stable): ``test_error``, ``train_error`` (dense output mixture),
``train_loss`` (task NLL on the train set), ``test_error_top1`` (top-1 conditional computation),
``H_s``, ``H_u``, ``I_EY`` (bits, test set, true labels: Krishnamurthy et al. (2023) eq. 3),
``I_EY_pred`` (the same with the model's predicted labels, the quantity the authors' code computed;
:func:`moelab.metrics.specialization`), ``experts_used`` (experts that are the argmax for ≥ 1% of the
test samples), ``seed``, and for sweeps and ``--runs N`` ``test_error_std`` (over the seeds of the
selected setting), ``selected``, ``num_runs``, ``seeds`` (each of :data:`SUMMARY_METRICS` per seed of
the selected setting) and ``over_seeds`` (their ``n``, ``mean``, ``sd``, 95 % t-interval ``ci_low`` /
``ci_high``).  ``--mode table`` adds ``welch`` (Welch's t-test between every pair of rows for each
summary metric; also ``welch.md``) beside ``table.md``; ``--rows`` runs a subset of the nine rows.
``log.csv`` has one row per epoch (``row``, ``seed``, the setting, losses, the test error at the end
of the epoch); a distilled model's folder also gets its teacher's selection table
(``*_teacher_selection.png``).

Resume (as ``moelab train``): ``--out`` is locked while a run writes it; a folder holding a run is refused
unless ``--resume`` (continue it) or ``--force`` (empty it first).  Every epoch of every trained model is
checkpointed (``ckpt/fit-{k}.pt``, :class:`Progress`); ``--resume`` takes the flags not given from the
run's ``config.yaml``, refuses a given flag that differs or other data (``data_sha256``) in one line unless
``--allow-changes``, and ends with the same ``metrics.json`` numbers (but ``seconds``), weights and CSV rows
as an uninterrupted run.  The checkpoints are removed once ``metrics.json`` is written.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from torch import Tensor, nn

from .. import _validate
from ..data.images import DATASETS, ImageData, load_images
from ..errors import CheckpointError
from ..io.atomic import atomic_write_text, atomic_write_torch
from ..io.model import save
from ..io.rundir import RUN_ENTRIES, RunDir
from ..losses import importance_loss, sample_similarity_loss
from ..metrics import plot_selection_table, selection_table, specialization
from ..models.vision import ImageMoE, MoEOutput, SingleModel, distill_gate, vision_config
from .summary import format_interval, format_mean_sd, mean, sd, seed_summary, welch

__all__ = [
    "GRIDS",
    "Progress",
    "SpecConfig",
    "add_arguments",
    "add_image_arguments",
    "checkpointing",
    "evaluate",
    "run",
    "train_once",
]

GATES = ("original", "attentive")
REGS = ("none", "importance", "ls")
MODES = ("run", "single", "table", "partition", "scaling")

#: Krishnamurthy et al. (2023) Appendix C: w_importance for every dataset; (β_s, β_d) per dataset (Table 6).
#: digits is not in the paper: its 64-pixel inputs have ~12× smaller squared distances than MNIST's 784 pixels
#: (both normalised to unit variance), so its L_s grid is the MNIST grid × 10.
_W = (0.2, 0.4, 0.6, 0.8, 1.0)
GRIDS: dict[str, dict[str, Any]] = {
    "mnist": {"importance": _W, "beta_s": (1e-6, 1e-5), "beta_d": tuple(10.0**-i for i in range(1, 7))},
    "fmnist": {"importance": _W, "beta_s": (1e-7, 1e-6), "beta_d": tuple(10.0**-i for i in range(1, 8))},
    "cifar100": {
        "importance": _W,
        "beta_s": (1e-5, 1e-4, 1e-3),
        "beta_d": tuple(10.0**-i for i in range(1, 8)),
    },
    "digits": {"importance": _W, "beta_s": (1e-5, 1e-4), "beta_d": tuple(10.0**-i for i in range(0, 6))},
}
GRIDS["fmnist+mnist"] = GRIDS["mnist"]

#: per-dataset L_s defaults ``(β_s, β_d)``, each a point of the Krishnamurthy et al. (2023) Appendix C grid
#: (Table 6).  Fashion-MNIST: β_d = 1e-2.  The middle of its grid, β_d = 1e-4, leaves training where it is
#: without L_s (β_s ≤ 1e-6 makes the S term negligible for 784 unit-variance pixels, so L_s is the D term,
#: whose gradient at 1e-4 is about 1 % of the task loss's); on a 6,000-sample, 3-epoch probe (seed 0)
#: β_d ∈ {1e-4, 1e-3, 1e-2, 1e-1} gave training errors 0.525, 0.503, 0.429, 0.439 against 0.515 without
#: L_s, and H_u 1.53, 1.63, 2.27, 2.26 bits against 1.55: 1e-2 is the grid's lowest training error (the
#: paper's selection rule, Krishnamurthy et al. (2023) Appendix C) on that probe.
BETA_DEFAULTS: dict[str, tuple[float, float]] = {
    "digits": (1e-4, 1e-3),
    "mnist": (1e-5, 1e-4),
    "fmnist": (1e-6, 1e-2),
    "fmnist+mnist": (1e-5, 1e-4),
    "cifar100": (1e-3, 1e-4),
}

#: per-dataset training defaults (Krishnamurthy et al. (2023) §7; digits: moelab's choice for 1,437 samples)
DEFAULTS = {
    "digits": {"epochs": 40, "batch_size": 64},
    "mnist": {"epochs": 20, "batch_size": 512},
    "fmnist": {"epochs": 20, "batch_size": 512},
    "fmnist+mnist": {"epochs": 20, "batch_size": 512},
    "cifar100": {"epochs": 40, "batch_size": 512},
}

#: Krishnamurthy et al. (2023) §4.2: MNIST digit pairs; the combined set pairs consecutive classes (Fig. 3b)
PARTITIONS = {
    10: ((0, 7), (1, 9), (2, 4), (3, 8), (5, 6)),
    12: ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)),
}


@dataclass
class SpecConfig:
    """One training run.  ``None`` sizes take the dataset's :data:`DEFAULTS`."""

    data: str = "digits"
    gate: str = "original"
    reg: str = "none"
    w_importance: float = 0.2
    beta_s: float | None = None
    beta_d: float | None = None
    distill: bool = False
    experts: int | None = None
    epochs: int | None = None
    batch_size: int | None = None
    lr: float = 1e-3
    seed: int = 0
    top_k: int = 1
    train_samples: int | None = None
    test_samples: int | None = None
    batched: bool = True
    output_relu: bool = False

    def resolved(self) -> SpecConfig:
        d = DEFAULTS[self.data]
        beta_s, beta_d = BETA_DEFAULTS[self.data]
        return replace(
            self,
            experts=self.experts or vision_config(self.data).num_experts,
            epochs=self.epochs or d["epochs"],
            batch_size=self.batch_size or d["batch_size"],
            beta_s=beta_s if self.beta_s is None else self.beta_s,
            beta_d=beta_d if self.beta_d is None else self.beta_d,
        )

    def validate(self) -> None:
        """Refuse a bad setting in one line naming its flag, the value and what is allowed."""
        if self.data not in DATASETS:
            raise ValueError(f"--data={self.data!r} is not allowed; expected one of {list(DATASETS)}")
        if self.gate not in GATES:
            raise ValueError(f"--gate={self.gate!r} is not allowed; expected one of {list(GATES)}")
        if self.reg not in REGS:
            raise ValueError(f"--reg={self.reg!r} is not allowed; expected one of {list(REGS)}")
        if self.experts is not None and (
            isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 2
        ):
            raise ValueError(f"--experts={self.experts!r} is not allowed; expected an integer >= 2")
        if self.distill and self.gate != "attentive":
            raise ValueError(
                "--distill is not allowed with --gate original; distillation starts from an attentive gate"
            )
        for name in ("epochs", "batch_size", "train_samples", "test_samples"):
            if getattr(self, name) is not None:
                _validate.positive_int(f"--{name.replace('_', '-')}", getattr(self, name))
        _validate.positive("--lr", self.lr)
        for name in ("w_importance", "beta_s", "beta_d"):
            if getattr(self, name) is not None:
                _validate.non_negative(f"--{name.replace('_', '-')}", getattr(self, name))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed={self.seed!r} is not allowed; expected an integer >= 0")


# ---------------------------------------------------------------------- checkpoints and resume
class _Run(RunDir):
    """The run directory of ``moelab specialize``: a :class:`RunDir` whose CSV appends are skipped
    while a resume replays the work its checkpoints already hold (those rows are in the CSVs the
    checkpoint rebuilt)."""

    replaying = False

    def append_log(self, row: Mapping[str, Any], name: str = "log.csv") -> None:
        if not self.replaying:
            super().append_log(row, name)


class Progress:
    """Per-epoch checkpoints of a ``moelab specialize`` run, and its exact resume.

    Every call of :func:`fit` while a ``Progress`` is active (:func:`checkpointing`) is numbered
    ``k = 0, 1, ...`` in the order the run makes them (the same order on every run of the same
    settings), and after each of its epochs writes ``ckpt/fit-{k:05d}.pt`` (atomically): the
    weights of the model being trained, Adam's state (dropped once the fit is done), the fit's
    data-order generator, the global torch RNG, the wall time so far and the rows the run's CSVs
    (``log.csv``, ``runs.csv``) gained since the previous fit ended.

    A resume replays the run from the start: a fit with a finished checkpoint loads its final
    weights and RNG states instead of training, the fit of the newest checkpoint continues from
    the epoch after it, and everything between the fits (model construction, evaluation, the
    saved models and plots) runs again as it did, so the weights and metrics end bit-identical to
    an uninterrupted run's (CPU).  The CSVs are rebuilt from the checkpoints first and the appends
    made while replaying are skipped: rows after the newest checkpoint (or torn by a kill) go.
    ``--allow-changes``: the fits already finished are kept as they are and the fit in progress
    continues to the new ``--epochs``.

    Disk: the checkpoints keep every trained model's final weights until the run ends (then they are
    removed): about 0.05 MB per digits model, 0.14 MB per MNIST model, 89 MB per CIFAR-100 model.
    """

    FINISHED = ".ckpt-finished"

    def __init__(self, run: _Run, resume: bool) -> None:
        self.run = run
        self.root = run.file("ckpt")
        self.count = 0  # fits begun by this process
        self.latest = -1  # the newest checkpointed fit of the run being resumed
        self.base: dict[str, int] = {}  # the CSVs' lengths when the last finished fit ended
        self.offset = 0.0  # wall seconds of the processes before this one
        self.t0 = time.perf_counter()
        shutil.rmtree(run.file(self.FINISHED), ignore_errors=True)  # a kill while finishing
        for stray in run.path.rglob(".*.tmp"):  # temporary files of writes a kill cut short
            if stray.is_file():
                stray.unlink()
        if resume:
            self._restore()
        else:
            shutil.rmtree(self.root, ignore_errors=True)
        run.replaying = self.latest >= 0

    def _path(self, k: int) -> Path:
        return self.root / f"fit-{k:05d}.pt"

    def _load(self, k: int) -> dict[str, Any]:
        path = self._path(k)
        try:
            return torch.load(path, weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint file {path} is missing (the newest is fit-{self.latest:05d}.pt); the run cannot "
                "continue exactly; pass --force to start afresh"
            ) from None
        except Exception as exc:  # truncated, corrupted, not a torch file
            raise CheckpointError(
                f"checkpoint file {path} cannot be read ({type(exc).__name__}); pass --force to start afresh"
            ) from None

    def _csvs(self) -> dict[str, str]:
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(self.run.path.glob("*.csv"))}

    def _restore(self) -> None:
        """Find the newest checkpoint and rebuild the CSVs as they were when it was written."""
        numbers = sorted(int(p.stem[4:]) for p in self.root.glob("fit-*.pt") if p.stem[4:].isdigit())
        self.latest = numbers[-1] if numbers else -1
        logs: dict[str, str] = {}
        for k in range(self.latest + 1):
            state = self._load(k)
            if k == self.latest and state["epoch"] < state["epochs"]:
                self.base = {name: len(text) for name, text in logs.items()}
            for name, part in state["logs"].items():
                logs[name] = logs.get(name, "") + part
            if k == self.latest:
                self.offset = float(state["seconds"])
                if state["epoch"] >= state["epochs"]:
                    self.base = {name: len(text) for name, text in logs.items()}
        for name in set(self._csvs()) - set(logs):
            self.run.file(name).unlink()
        for name, text in logs.items():
            atomic_write_text(self.run.file(name), text)

    def seconds(self) -> float:
        """Wall seconds of the run: the processes before a resume and this one."""
        return self.offset + time.perf_counter() - self.t0

    def begin(
        self, model: nn.Module, opt: torch.optim.Optimizer, generator: torch.Generator, epochs: int
    ) -> int:
        """Number the fit that is starting; while replaying, load its checkpoint into ``model``,
        ``opt``, ``generator`` and the global RNG.  Returns the epoch to start from (``epochs``: done)."""
        k = self.count
        self.count += 1
        if k > self.latest:
            return 0
        state = self._load(k)
        try:
            model.load_state_dict(state["model"])
            if k == self.latest and state["optimizer"] is not None:
                opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"checkpoint file {self._path(k)} does not fit the model of these settings "
                f"({str(exc).splitlines()[0]}); pass --force to start afresh"
            ) from None
        generator.set_state(state["generator"])
        torch.set_rng_state(state["rng"])
        if k < self.latest:
            return epochs  # finished before the checkpoint being resumed: its final weights
        self.run.replaying = False  # the appends from here on are new rows
        return min(int(state["epoch"]), epochs) if state["optimizer"] is not None else epochs

    def save(
        self,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        generator: torch.Generator,
        epoch: int,
        epochs: int,
    ) -> None:
        """Checkpoint the fit in progress after its epoch ``epoch`` (1-based) of ``epochs``."""
        k = self.count - 1
        done = epoch >= epochs
        csvs = self._csvs()
        state = {
            "fit": k,
            "epoch": epoch,
            "epochs": epochs,
            "model": model.state_dict(),
            "optimizer": None if done else opt.state_dict(),
            "generator": generator.get_state(),
            "rng": torch.get_rng_state(),
            "seconds": self.seconds(),
            "logs": {name: text[self.base.get(name, 0) :] for name, text in csvs.items()},
        }
        atomic_write_torch(self._path(k), state)
        if done:
            self.base = {name: len(text) for name, text in csvs.items()}

    def finish(self) -> None:
        """The run is complete (its ``metrics.json`` written): drop the checkpoints."""
        if self.root.exists():
            gone = self.run.file(self.FINISHED)
            os.replace(self.root, gone)  # one step: never a partial ckpt/ folder
            shutil.rmtree(gone, ignore_errors=True)


_PROGRESS: ContextVar[Progress | None] = ContextVar("moelab_specialize_progress", default=None)


@contextlib.contextmanager
def checkpointing(progress: Progress) -> Iterator[Progress]:
    """Make :func:`fit` checkpoint into (and resume from) ``progress`` inside the ``with`` block."""
    token = _PROGRESS.set(progress)
    try:
        yield progress
    finally:
        _PROGRESS.reset(token)


# ---------------------------------------------------------------------- training
def regulariser(cfg: SpecConfig, gate_probs: Tensor, x: Tensor) -> Tensor:
    """The configured regulariser on the gate's ``p(e|x)`` (0 for ``none``)."""
    if cfg.reg == "importance":
        return cfg.w_importance * importance_loss(gate_probs)
    if cfg.reg == "ls":
        return sample_similarity_loss(gate_probs, x, cfg.beta_s, cfg.beta_d)
    return gate_probs.new_zeros(())


@torch.no_grad()
def evaluate(
    model: nn.Module, x: Tensor, y: Tensor, top_k: int | None = None, chunk: int = 2048
) -> dict[str, Any]:
    """Error, task NLL and gate probabilities of ``model`` on ``(x, y)`` (eval mode)."""
    was = model.training
    model.eval()
    errors, nll, probs, preds = 0, 0.0, [], []
    for xc, yc in zip(x.split(chunk), y.split(chunk)):
        out = model(xc, top_k=top_k)
        pred = out.probs.argmax(-1)
        errors += int((pred != yc).sum())
        nll += float(out.nll(yc)) * len(yc)
        probs.append(out.gate_probs)
        preds.append(pred)
    model.train(was)
    return {
        "error": errors / len(y),
        "loss": nll / len(y),
        "gate_probs": torch.cat(probs),
        "predictions": torch.cat(preds),
    }


def fit(
    model: nn.Module,
    data: ImageData,
    cfg: SpecConfig,
    params: list[nn.Parameter] | None = None,
    output_fn=None,
    frozen: tuple[nn.Module, ...] = (),
    log=None,
    desc: str = "train",
) -> None:
    """Adam on ``params`` (default: all trainable) for ``cfg.epochs`` epochs.

    ``output_fn(model, x, y) -> MoEOutput`` replaces ``model(x)`` (used by the partition
    experiment's expert pre-training); modules in ``frozen`` stay in eval mode (BatchNorm stats).
    With ``log``, each epoch's row carries the test error of the model at the end of the epoch.
    Inside :func:`checkpointing`, each epoch is checkpointed and a resume continues the fit
    (:class:`Progress`).
    """
    from tqdm.auto import tqdm

    params = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed)
    n = len(data.y_train)
    model.train()
    for m in frozen:
        m.eval()
    progress = _PROGRESS.get()
    start = 0 if progress is None else progress.begin(model, opt, g, cfg.epochs)
    epochs = range(start, cfg.epochs)
    for epoch in tqdm(epochs, desc=desc, leave=False, disable=log is None or not epochs):
        perm = torch.randperm(n, generator=g)
        total, reg_total, steps, t0 = 0.0, 0.0, 0, time.perf_counter()
        for idx in perm.split(cfg.batch_size):
            x, y = data.x_train[idx], data.y_train[idx]
            out: MoEOutput = output_fn(model, x, y) if output_fn else model(x)
            task = out.nll(y)
            reg = (
                regulariser(cfg, out.gate_probs, x)
                if isinstance(model, ImageMoE) and output_fn is None
                else task.new_zeros(())
            )
            loss = task + reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(task.detach())
            reg_total += float(reg.detach())
            steps += 1
        if log is not None:
            seconds = time.perf_counter() - t0
            test_error = evaluate(model, data.x_test, data.y_test)["error"]
            model.train()
            for m in frozen:
                m.eval()
            log(
                {
                    "phase": desc,
                    "epoch": epoch + 1,
                    "task_loss": total / steps,
                    "reg_loss": reg_total / steps,
                    "test_error": test_error,
                    "seconds": seconds,
                }
            )
        if progress is not None:
            progress.save(model, opt, g, epoch + 1, cfg.epochs)


def _metrics(model: nn.Module, data: ImageData, cfg: SpecConfig) -> tuple[dict[str, Any], Tensor | None]:
    test = evaluate(model, data.x_test, data.y_test)
    train = evaluate(model, data.x_train, data.y_train)
    out: dict[str, Any] = {
        "test_error": test["error"],
        "train_error": train["error"],
        "train_loss": train["loss"],
        "seed": cfg.seed,
    }
    if not isinstance(model, ImageMoE):
        out.update(
            {
                "H_s": None,
                "H_u": None,
                "I_EY": None,
                "I_EY_pred": None,
                "test_error_top1": None,
                "experts_used": None,
            }
        )
        return out, None
    out["test_error_top1"] = evaluate(model, data.x_test, data.y_test, top_k=1)["error"]
    if cfg.top_k != 1:
        out[f"test_error_top{cfg.top_k}"] = evaluate(model, data.x_test, data.y_test, top_k=cfg.top_k)[
            "error"
        ]
    p = test["gate_probs"]
    out.update(specialization(p, data.y_test, data.num_classes, predictions=test["predictions"]))
    table = selection_table(p.argmax(1), data.y_test, p.shape[1], data.num_classes)
    out["experts_used"] = int((table.sum(1) >= 0.01 * len(data.y_test)).sum())
    return out, table


class Trained(NamedTuple):
    """What :func:`train_once` returns; ``teacher_table`` only for ``--distill`` (the attentive teacher's
    expert × class table; ``table`` is then the distilled model's)."""

    model: nn.Module
    metrics: dict[str, Any]
    table: Tensor | None
    teacher_table: Tensor | None = None


def train_once(cfg: SpecConfig, data: ImageData, log=None) -> Trained:
    """Train one configuration."""
    cfg = cfg.resolved()
    torch.manual_seed(cfg.seed)
    vcfg = vision_config(cfg.data, cfg.experts, cfg.output_relu)
    if cfg.gate == "single":
        model: nn.Module = SingleModel(vcfg)
        fit(model, data, cfg, log=log, desc="single")
        metrics, table = _metrics(model, data, cfg)
        return Trained(model, metrics, table)
    model = ImageMoE(vcfg, cfg.gate, batched=cfg.batched)
    fit(model, data, cfg, log=log, desc=f"{cfg.gate}-{cfg.reg}")
    if not cfg.distill:
        metrics, table = _metrics(model, data, cfg)
        return Trained(model, metrics, table)
    teacher_metrics, teacher_table = _metrics(model, data, cfg)
    student = distill_gate(model)
    fit(
        student,
        data,
        replace(cfg, reg="none"),
        params=list(student.gate.parameters()),
        frozen=(student.experts,),
        log=log,
        desc="distill",
    )
    metrics, table = _metrics(student, data, cfg)
    metrics.update({f"teacher_{k}": v for k, v in teacher_metrics.items() if k != "seed"})
    return Trained(student, metrics, table, teacher_table)


# ---------------------------------------------------------------------- sweeps and named modes
def grid(cfg: SpecConfig) -> list[SpecConfig]:
    """The Krishnamurthy et al. (2023) Appendix C settings for ``cfg.reg`` (one setting for ``none``)."""
    g = GRIDS[cfg.data]
    if cfg.reg == "importance":
        return [replace(cfg, w_importance=w) for w in g["importance"]]
    if cfg.reg == "ls":
        return [replace(cfg, beta_s=bs, beta_d=bd) for bs in g["beta_s"] for bd in g["beta_d"]]
    return [cfg]


_SETTING_KEYS = ("w_importance", "beta_s", "beta_d")


def _setting(cfg: SpecConfig) -> dict[str, Any]:
    if cfg.reg == "importance":
        return {"w_importance": cfg.w_importance}
    if cfg.reg == "ls":
        return {"beta_s": cfg.beta_s, "beta_d": cfg.beta_d}
    return {}


#: columns of runs.csv (one row per trained model)
RUN_COLUMNS = (
    "row",
    "gate",
    "reg",
    "experts",
    "w_importance",
    "beta_s",
    "beta_d",
    "seed",
    "test_error",
    "train_error",
    "train_loss",
    "test_error_top1",
    "H_s",
    "H_u",
    "I_EY",
    "I_EY_pred",
    "experts_used",
)

#: the metrics summarised over seeds (mean, sd, 95 % CI) and compared between rows (Welch's t-test)
SUMMARY_METRICS = ("test_error", "H_s", "H_u", "I_EY", "I_EY_pred")


def _run_row(tag: str, cfg: SpecConfig, metrics: dict[str, Any]) -> dict[str, Any]:
    values = {
        "row": tag,
        "gate": cfg.gate,
        "reg": cfg.reg,
        "experts": cfg.experts,
        **_setting(cfg),
        **metrics,
    }
    return {k: values.get(k) for k in RUN_COLUMNS}


def sweep(
    cfg: SpecConfig, data: ImageData, runs: int, rundir: RunDir | None, use_grid: bool = True, tag: str = ""
):
    """Every setting × ``runs`` seeds; the run with the minimum training error is selected (Krishnamurthy et
    al. (2023) §7)."""
    cfg = cfg.resolved()
    settings = grid(cfg) if use_grid else [cfg]
    results = []
    best = None
    for s in settings:
        for r in range(runs):
            c = replace(s, seed=cfg.seed + r)
            log = None
            if rundir is not None:
                setting = _setting(c)
                log = lambda row, c=c, setting=setting: rundir.append_log(
                    {"row": tag, "seed": c.seed, **{k: setting.get(k) for k in _SETTING_KEYS}, **row}
                )
            trained = train_once(c, data, log=log)
            m = trained.metrics
            results.append((s, m))
            if rundir is not None:
                rundir.append_log(_run_row(tag, c, m), name="runs.csv")
            if best is None or m["train_error"] < best[1]["train_error"]:
                best = (c, m, trained)
    c, m, trained = best
    same = [r[1] for r in results if _setting(r[0]) == _setting(c)]
    summary = {
        **m,
        "test_error_std": sd([r["test_error"] for r in same]),
        "selected": {**_setting(c), "seed": c.seed},
        "num_runs": len(results),
        "seeds": {
            k: [r[k] for r in same] for k in SUMMARY_METRICS if all(r.get(k) is not None for r in same)
        },
    }
    summary["over_seeds"] = {k: seed_summary(v) for k, v in summary["seeds"].items()}
    return trained._replace(metrics=summary)


def _save(
    rundir: RunDir, name: str, trained: Trained, data: ImageData, title: str, teacher_title: str
) -> None:
    """The model and its expert × class table (``{name}_selection.png``); for a distilled model also the
    attentive teacher's table (``{name}_teacher_selection.png``)."""
    save(trained.model, rundir.file(name))  # config.json + model.safetensors: moelab.load(rundir / name)
    if trained.table is not None:
        plot_selection_table(trained.table, rundir.file(f"{name}_selection.png"), data.class_names, title)
    if trained.teacher_table is not None:
        plot_selection_table(
            trained.teacher_table,
            rundir.file(f"{name}_teacher_selection.png"),
            data.class_names,
            teacher_title,
        )


_REG_NAMES = {"none": "", "importance": " with L_importance", "ls": " with L_s"}


def titles(cfg: SpecConfig) -> tuple[str, str]:
    """The selection-table titles ``(model, teacher)`` of one configuration; ``teacher`` is ``""`` unless
    ``cfg.distill``.  A distilled model has a plain gate trained without a regulariser: its title names the
    teacher it came from, and the teacher's title its own gate and regulariser."""
    if cfg.gate == "single":
        return f"{cfg.data}: single model", ""
    gate = "attentive gate MoE" if cfg.gate == "attentive" else "vanilla MoE"
    own = f"{cfg.data}: {gate}{_REG_NAMES[cfg.reg]}"
    if not cfg.distill:
        return own, ""
    return f"{cfg.data}: distilled from {gate}{_REG_NAMES[cfg.reg]}", f"{own} (teacher)"


TABLE_ROWS = (
    ("single model", {"gate": "single"}),
    ("vanilla MoE", {"gate": "original", "reg": "none"}),
    ("vanilla MoE with L_importance", {"gate": "original", "reg": "importance"}),
    ("vanilla MoE with L_s", {"gate": "original", "reg": "ls"}),
    ("attentive gate MoE", {"gate": "attentive", "reg": "none"}),
    ("attentive gate MoE with L_importance", {"gate": "attentive", "reg": "importance"}),
    ("attentive gate MoE with L_s", {"gate": "attentive", "reg": "ls"}),
    (
        "distilled from attentive gate MoE with L_importance",
        {"gate": "attentive", "reg": "importance", "distill": True},
    ),
    ("distilled from attentive gate MoE with L_s", {"gate": "attentive", "reg": "ls", "distill": True}),
)


def _mean_sd(m: dict[str, Any], k: str) -> str:
    s = (m.get("over_seeds") or {}).get(k)
    if s is None:
        return "NA" if m.get(k) is None else f"{m[k]:.3f}"
    return f"{s['mean']:.3f}" if s["sd"] is None else format_mean_sd(s["mean"], s["sd"], 3)


def _ci(m: dict[str, Any], k: str) -> str:
    s = (m.get("over_seeds") or {}).get(k)
    interval = None if s is None or s["sd"] is None else (s["ci_low"], s["ci_high"])
    return format_interval(interval, 3, missing="NA")


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """The rows of a ``table`` run as a markdown table in the layout of Krishnamurthy et al. (2023) Table 2:
    mean ± sd over the seeds of each row's selected setting (95 % t-interval of the mean error), the
    paper's I(E;Y) with true labels and I(E;Ŷ) with predicted labels (what the authors' code computed),
    and the test error of the run with the minimum training error (the paper's selection rule)."""
    f = lambda m, k: "NA" if m.get(k) is None else f"{m[k]:.3f}"
    lines = [
        "| experiment | seeds | error | error 95 % CI | I(E;Y) | I(E;Ŷ) | H_s | H_u | "
        "min-train-error run: error | top-1 error | experts used | selected |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in rows.items():
        sel = ", ".join(f"{k}={v:g}" for k, v in (m.get("selected") or {}).items())
        used = "NA" if m.get("experts_used") is None else str(m["experts_used"])
        n = (m.get("over_seeds") or {}).get("test_error", {}).get("n", 1)
        lines.append(
            f"| {name} | {n} | {_mean_sd(m, 'test_error')} | {_ci(m, 'test_error')} | {_mean_sd(m, 'I_EY')} | "
            f"{_mean_sd(m, 'I_EY_pred')} | {_mean_sd(m, 'H_s')} | {_mean_sd(m, 'H_u')} | "
            f"{f(m, 'test_error')} | {f(m, 'test_error_top1')} | {used} | {sel} |"
        )
    return "\n".join(lines) + "\n"


def welch_tests(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Welch's t-test between every pair of rows for each of :data:`SUMMARY_METRICS` (over the seeds of
    each row's selected setting)."""
    names = list(rows)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for k in SUMMARY_METRICS:
                va, vb = rows[a].get("seeds", {}).get(k), rows[b].get("seeds", {}).get(k)
                if va and vb:
                    out.append({"row_a": a, "row_b": b, "metric": k, **asdict(welch(va, vb))})
    return out


def format_welch(tests: list[dict[str, Any]]) -> str:
    """Welch tests as a markdown table."""
    g = lambda v, fmt: "NA" if v is None else format(v, fmt)
    lines = [
        "| row a | row b | metric | mean a | mean b | a − b | t | df | p |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in tests:
        lines.append(
            f"| {t['row_a']} | {t['row_b']} | {t['metric']} | {t['mean_a']:.4f} | {t['mean_b']:.4f} | "
            f"{t['diff']:+.4f} | {g(t['t'], '.2f')} | {g(t['df'], '.1f')} | {g(t['p'], '.3g')} |"
        )
    return "\n".join(lines) + "\n"


def parse_rows(text: str | None) -> list[int]:
    """``--rows``: comma-separated 1-based row numbers of :data:`TABLE_ROWS` (the numbering of Krishnamurthy
    et al. (2023) §7); ``None`` = all nine."""
    if text is None:
        return list(range(1, len(TABLE_ROWS) + 1))
    bad = ValueError(
        f"--rows={text!r} is not allowed; expected distinct comma-separated row numbers in 1..{len(TABLE_ROWS)}"
    )
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise bad from None
    if not rows or len(set(rows)) != len(rows) or any(not 1 <= r <= len(TABLE_ROWS) for r in rows):
        raise bad
    return rows


def run_table(
    cfg: SpecConfig,
    data: ImageData,
    runs: int,
    use_grid: bool,
    rundir: RunDir,
    rows_wanted: list[int] | None = None,
) -> dict[str, Any]:
    """The rows ``rows_wanted`` (1-based; default all nine) of Krishnamurthy et al. (2023) Table 2 / 3 / 7,
    each summarised over its seeds, with Welch tests between the rows (``welch.md``, ``metrics.json``)."""
    rows: dict[str, dict[str, Any]] = {}
    tests: list[dict[str, Any]] = []
    for i in rows_wanted or range(1, len(TABLE_ROWS) + 1):
        name, change = TABLE_ROWS[i - 1]
        c = replace(cfg, **{"reg": "none", "distill": False, **change})
        trained = sweep(c, data, runs, rundir, use_grid=use_grid, tag=name)
        rows[name] = trained.metrics
        _, teacher_title = titles(c)
        _save(rundir, f"row{i}", trained, data, name, teacher_title)
        tests = welch_tests(rows)
        rundir.write_metrics({"rows": rows, "welch": tests, "data": cfg.data})
        atomic_write_text(rundir.file("table.md"), format_table(rows))
        atomic_write_text(rundir.file("welch.md"), format_welch(tests))
    return {"rows": rows, "welch": tests, "data": cfg.data}


def run_partition(cfg: SpecConfig, data: ImageData, runs: int, rundir: RunDir) -> dict[str, Any]:
    """Krishnamurthy et al. (2023) §4.2 (Fig. 4, Table 1).  (a) a gate trained end-to-end with untrained
    experts; (b) a gate trained against experts pre-trained on class pairs (each expert sees only its pair's
    samples). Each gate is then frozen and a new set of experts is trained with it; the table reports that
    second model's test error and training loss, averaged over ``runs`` seeds."""
    cfg = cfg.resolved()
    pairs = PARTITIONS.get(data.num_classes)
    vcfg = vision_config(cfg.data, len(pairs) if pairs else cfg.experts, cfg.output_relu)
    if pairs is None or vcfg.num_experts != len(pairs):
        raise ValueError(
            f"--mode partition needs 10 or 12 classes (5 or 6 experts); data={cfg.data!r} has {data.num_classes}"
        )
    owner = torch.empty(data.num_classes, dtype=torch.long)
    for e, pair in enumerate(pairs):
        owner[list(pair)] = e

    def pretrain_output(model: ImageMoE, x: Tensor, y: Tensor) -> MoEOutput:
        ys = model.experts.forward_all(x)[..., : data.num_classes]  # (B, N, K)
        onehot = torch.nn.functional.one_hot(owner[y], vcfg.num_experts).to(ys.dtype)
        return MoEOutput(ys.gather(1, owner[y][:, None, None].expand(-1, 1, ys.shape[-1]))[:, 0], onehot)

    results: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for r in range(runs):
        c = replace(cfg, seed=cfg.seed + r, reg="none")
        for arm in ("a", "b"):
            torch.manual_seed(c.seed)
            model = ImageMoE(vcfg, "original", batched=cfg.batched)
            if arm == "a":
                fit(model, data, c, desc="a: end-to-end")
            else:
                fit(
                    model,
                    data,
                    c,
                    params=list(model.experts.parameters()),
                    output_fn=pretrain_output,
                    desc="b: experts on pairs",
                )
                fit(
                    model,
                    data,
                    c,
                    params=list(model.gate.parameters()),
                    frozen=(model.experts,),
                    desc="b: gate",
                )
            gate_metrics, gate_table = _metrics(model, data, c)
            fresh = ImageMoE(vcfg, "original", batched=cfg.batched).experts
            model.experts = fresh
            fit(
                model,
                data,
                c,
                params=list(model.experts.parameters()),
                frozen=(model.gate,),
                desc=f"{arm}: new experts",
            )
            m, _ = _metrics(model, data, c)
            m["gate_I_EY"] = gate_metrics["I_EY"]
            results[arm].append(m)
            rundir.append_log(_run_row(f"partition ({arm})", c, m), name="runs.csv")
            if r == 0:
                plot_selection_table(
                    gate_table,
                    rundir.file(f"partition_{arm}_gate.png"),
                    data.class_names,
                    f"({arm}) gate selection",
                )
    summary = {}
    for arm, ms in results.items():
        te = [m["test_error"] for m in ms]
        summary[arm] = {
            "test_error": mean(te),
            "train_loss": mean([m["train_loss"] for m in ms]),
            "test_error_std": sd(te),
            "runs": len(ms),
        }
    return {"partition": summary, "pairs": [list(p) for p in pairs], "data": cfg.data}


def run_scaling(cfg: SpecConfig, data: ImageData, counts: list[int], rundir: RunDir) -> dict[str, Any]:
    """Krishnamurthy et al. (2023) §7, Fig. 6: train with N experts for each N and each of L_importance and
    L_s; report how many experts each actually uses (``experts_used``) and the selection tables."""
    out: dict[str, Any] = {}
    cfg = cfg.resolved()  # runs.csv records the β the models trained with
    for reg in ("importance", "ls"):
        for n in counts:
            c = replace(cfg, reg=reg, experts=n, distill=False)
            trained = train_once(c, data)
            out[f"{reg}_{n}"] = trained.metrics
            rundir.append_log(_run_row(f"scaling {reg} {n}", c, trained.metrics), name="runs.csv")
            _save(rundir, f"{reg}_{n}", trained, data, f"{reg}, {n} experts", "")
    return {"scaling": out, "data": cfg.data}


# ---------------------------------------------------------------------- CLI
def _int_flag(text: str) -> int | float | str:
    """An integer flag's value as written (an ``int``, else the ``float`` of ``inf`` / ``2.5``, else the
    text): the checks then refuse a bad one in one line naming the flag and the allowed range."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def _float_flag(text: str) -> float | str:
    """A number flag's value (``float``, ``inf`` and ``nan`` included, else the text) for the checks."""
    try:
        return float(text)
    except ValueError:
        return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="run", help="what to run (default: run)")
    parser.add_argument(
        "--data", choices=DATASETS, default="digits", help="dataset (default: digits, offline)"
    )
    parser.add_argument("--data-dir", default=None, help="local folder with the dataset's files")
    parser.add_argument(
        "--mnist-dir", default=None, help="fmnist+mnist: local folder with the MNIST IDX files"
    )
    parser.add_argument("--gate", choices=GATES, default="original")
    parser.add_argument("--reg", choices=REGS, default="none", help="gate regulariser")
    parser.add_argument(
        "--w-importance", type=_float_flag, default=0.2, help="weight of L_importance (a number >= 0)"
    )
    per_data = lambda i: ", ".join(f"{d} {b[i]:g}" for d, b in BETA_DEFAULTS.items())
    parser.add_argument(
        "--beta-s", type=_float_flag, default=None, help=f"L_s β_s (default per dataset: {per_data(0)})"
    )
    parser.add_argument(
        "--beta-d",
        type=_float_flag,
        default=None,
        help=f"L_s β_d (default per dataset: {per_data(1)}; each a point of the Krishnamurthy et al. (2023) "
        "Appendix C grid)",
    )
    parser.add_argument("--distill", action="store_true", help="distil the attentive model into a plain gate")
    parser.add_argument(
        "--experts", type=_int_flag, default=None, help="number of experts, >= 2 (default: per dataset)"
    )
    parser.add_argument(
        "--epochs", type=_int_flag, default=None, help="a positive integer (default: per dataset)"
    )
    parser.add_argument(
        "--batch-size", type=_int_flag, default=None, help="a positive integer (default: per dataset)"
    )
    parser.add_argument(
        "--lr", type=_float_flag, default=1e-3, help="Adam learning rate, a finite number > 0"
    )
    parser.add_argument("--seed", type=_int_flag, default=0, help="an integer >= 0")
    parser.add_argument(
        "--runs",
        type=_int_flag,
        default=1,
        help="seeds per setting (paper: 10 MNIST, 5 CIFAR-100); with N > 1 the metrics are also "
        "summarised over the seeds (mean ± sd, 95 %% CI) and table rows compared by Welch's t-test",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="sweep the Krishnamurthy et al. (2023) Appendix C grid"
    )
    parser.add_argument("--top-k", type=_int_flag, default=1, help="experts at sparse inference")
    parser.add_argument("--counts", default="5,10,15", help="scaling: expert counts")
    parser.add_argument(
        "--rows",
        default=None,
        help="table: comma-separated row numbers to run, 1..9 in the order of Krishnamurthy et al. (2023) "
        "Table 2 / 7 (1 single, 2 vanilla, 3 vanilla + L_importance, 4 vanilla + L_s, 5 attentive, "
        "6 attentive + L_importance, 7 attentive + L_s, 8 and 9 distilled from 6 and 7; default: all)",
    )
    parser.add_argument(
        "--train-samples",
        type=_int_flag,
        default=None,
        help="use a random subset of the train set (1 to the train set's size)",
    )
    parser.add_argument(
        "--test-samples",
        type=_int_flag,
        default=None,
        help="use a random subset of the test set (1 to the test set's size)",
    )
    parser.add_argument(
        "--output-relu",
        action="store_true",
        help="ReLU on the output logits (Krishnamurthy et al. (2023) App. B literal)",
    )
    parser.add_argument(
        "--loop-experts", action="store_true", help="run experts in a Python loop (benchmarks)"
    )
    parser.add_argument(
        "--threads", type=_int_flag, default=1, help="torch CPU threads (default 1: the models are tiny)"
    )
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last epoch checkpoint (bit-identical to an uninterrupted "
        "run); flags not given are the run's own",
    )
    parser.add_argument("--force", action="store_true", help="start afresh: empty the run in --out first")
    parser.add_argument(
        "--allow-changes",
        action="store_true",
        dest="allow_changes",
        help="with --resume: continue even though flags or the data differ from the run's config.yaml",
    )


add_image_arguments = add_arguments


def _config(args: argparse.Namespace) -> SpecConfig:
    cfg = SpecConfig(
        data=args.data,
        gate=args.gate,
        reg=args.reg,
        w_importance=args.w_importance,
        beta_s=args.beta_s,
        beta_d=args.beta_d,
        distill=args.distill,
        experts=args.experts,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        top_k=args.top_k,
        train_samples=args.train_samples,
        test_samples=args.test_samples,
        batched=not args.loop_experts,
        output_relu=args.output_relu,
    )
    cfg.validate()
    _validate.positive_int("--runs", args.runs)
    n = cfg.experts or vision_config(cfg.data).num_experts
    _validate.int_in_range("--top-k", cfg.top_k, 1, n)
    return cfg


def _subset(data: ImageData, cfg: SpecConfig) -> ImageData:
    """``--train-samples`` / ``--test-samples``: a seeded random subset; a count above the split's size
    is refused (a subset cannot be larger than the set)."""
    for flag, n, split in (
        ("--train-samples", cfg.train_samples, data.y_train),
        ("--test-samples", cfg.test_samples, data.y_test),
    ):
        if n is not None and n > len(split):
            raise ValueError(
                f"{flag}={n} is not allowed; expected an integer in [1, {len(split)}] "
                f"(the size of the {cfg.data} {flag[2:-8]} set)"
            )
    if cfg.train_samples or cfg.test_samples:
        data = data.subset(cfg.train_samples, cfg.test_samples, seed=0)
    return data


def data_digest(data: ImageData) -> str:
    """sha256 of the tensors a run trains and tests on (recorded as ``data_sha256`` in config.yaml;
    ``--resume`` refuses other data)."""
    h = hashlib.sha256()
    for t in (data.x_train, data.y_train, data.x_test, data.y_test):
        a = t.detach().cpu().contiguous().numpy()
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


#: config.yaml keys that are flags: key -> (argparse dest, stored value -> flag value)
_STORED_FLAGS: dict[str, tuple[str, Any]] = {
    **{
        k: (k, None)
        for k in (
            "mode", "runs", "sweep", "data", "gate", "reg", "w_importance", "beta_s", "beta_d", "distill",
            "experts", "epochs", "batch_size", "lr", "seed", "top_k", "train_samples", "test_samples",
            "output_relu", "data_dir", "mnist_dir",
        )
    },
    "batched": ("loop_experts", lambda v: not v),
    "counts": ("counts", lambda v: ",".join(str(c) for c in v) if v else None),
    "rows": ("rows", lambda v: ",".join(str(r) for r in v) if v else None),
}  # fmt: skip
#: flags that name where the data is, not what it is: the data's sha256 decides
_LOCATION_FLAGS = ("data_dir", "mnist_dir")


def _defaults() -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return {a.dest: a.default for a in p._actions if a.dest != "help"}


def _same(dest: str, given: Any, stored: Any) -> bool:
    if dest in ("counts", "rows"):
        parse = lambda v: None if v is None else [s.strip() for s in str(v).split(",")]
        return parse(given) == parse(stored)
    if isinstance(given, (int, float)) and isinstance(stored, (int, float)):
        return float(given) == float(stored) and isinstance(given, bool) == isinstance(stored, bool)
    return given == stored


def _read_stored(path: Path) -> dict[str, Any]:
    try:
        stored = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"--resume: {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(stored, dict) or stored.get("command") != "specialize":
        what = stored.get("command") if isinstance(stored, dict) else None
        raise ValueError(
            f"--resume: {path} is not the config of a specialize run (command={what!r}); "
            "choose another --out or pass --force to start afresh"
        )
    return stored


def apply_stored(args: argparse.Namespace, stored: dict[str, Any], path: Path) -> None:
    """``--resume``: the flags not given take the run's own values (``config.yaml``); a given flag that
    differs is refused in one line naming it, unless ``--allow-changes`` (then the given one wins)."""
    defaults = _defaults()
    for key, (dest, convert) in _STORED_FLAGS.items():
        if key not in stored or (key == "counts" and not stored[key]):  # counts: scaling runs only
            continue
        old = stored[key] if convert is None else convert(stored[key])
        new = getattr(args, dest)
        if new == defaults[dest]:
            setattr(args, dest, old)  # not given: the run's own
        elif not _same(dest, new, old) and dest not in _LOCATION_FLAGS and not args.allow_changes:
            raise ValueError(
                f"--resume: --{dest.replace('_', '-')}={new!r} differs from {old!r} recorded in {path}; "
                "the run cannot continue with other settings (pass --allow-changes to continue it with the "
                "new ones, or --force to start afresh)"
            )


#: what ``moelab specialize`` writes beside the run entries :class:`RunDir` knows (``--force`` removes them)
_OUTPUTS = (
    "model", "row[1-9]", "importance_[0-9]*", "ls_[0-9]*", "*_selection.png", "partition_*_gate.png",
    "table.md", "welch.md", Progress.FINISHED,
)  # fmt: skip


def _remove_outputs(path: Path) -> None:
    for pattern in _OUTPUTS:
        for old in path.glob(pattern):
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)


def _check_numbers(args: argparse.Namespace) -> None:
    """Each numeric flag on its own (before ``--resume`` compares them with the run's): one line naming
    the flag and the allowed range."""
    for dest in ("epochs", "batch_size", "train_samples", "test_samples", "runs", "threads", "top_k"):
        if getattr(args, dest) is not None:
            _validate.positive_int(f"--{dest.replace('_', '-')}", getattr(args, dest))
    _validate.positive("--lr", args.lr)
    for dest in ("w_importance", "beta_s", "beta_d"):
        if getattr(args, dest) is not None:
            _validate.non_negative(f"--{dest.replace('_', '-')}", getattr(args, dest))
    SpecConfig(experts=args.experts, seed=args.seed).validate()


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    if args.resume and args.force:
        raise ValueError(
            "--resume and --force are not allowed together; --resume continues the run in --out, "
            "--force starts it afresh"
        )
    if args.allow_changes and not args.resume:
        raise ValueError("--allow-changes is not allowed without --resume; it lets --resume continue a run")
    out = Path(args.out)
    if args.resume and not any((out / name).exists() for name in RUN_ENTRIES):
        print(f"--resume: {args.out} holds no run yet; starting one")
        args.resume = False
    stored = None
    if args.resume and (out / "config.yaml").is_file():
        stored = _read_stored(out / "config.yaml")
        apply_stored(args, stored, out / "config.yaml")
    cfg = _config(args)
    _validate.positive_int("--threads", args.threads)
    torch.set_num_threads(args.threads)
    counts = []
    if args.mode == "scaling":
        try:
            counts = [int(c) for c in args.counts.split(",")]
        except ValueError:
            raise ValueError(
                f"--counts={args.counts!r} is not allowed; expected comma-separated integers"
            ) from None
        if any(c < 2 for c in counts):
            raise ValueError(f"--counts={args.counts!r} is not allowed; every count must be >= 2")
    rows_wanted = parse_rows(args.rows)
    if args.rows is not None and args.mode != "table":
        raise ValueError(f"--rows is not allowed with --mode {args.mode}; it selects rows of --mode table")
    data = _subset(load_images(cfg.data, args.data_dir, args.mnist_dir), cfg)
    digest = data_digest(data)
    old_digest = (stored or {}).get("data_sha256")
    if old_digest is not None and old_digest != digest and not args.allow_changes:
        raise ValueError(
            f"--resume: --data {cfg.data!r} has sha256 {digest[:12]}…, but the run in {out} was trained on "
            f"{old_digest[:12]}…; the run cannot continue on other data (--allow-changes to continue anyway)"
        )
    rundir = _Run(out, resume=args.resume, force=args.force)
    try:
        if args.force:
            _remove_outputs(rundir.path)
        if stored is not None and rundir.file("metrics.json").exists() and not rundir.file("ckpt").exists():
            print(f"--resume: the run in {out} is finished; nothing to do (--force to run it again)")
            _print_summary(rundir.read_metrics())
            return 0
        if stored is None or args.allow_changes:
            rundir.write_config(
                {
                    "command": "specialize",
                    "mode": args.mode,
                    "runs": args.runs,
                    "sweep": args.sweep,
                    **asdict(cfg.resolved()),
                    "data_dir": args.data_dir,
                    "mnist_dir": args.mnist_dir,
                    "counts": counts,
                    "rows": rows_wanted if args.mode == "table" else None,
                    "train_size": len(data.y_train),
                    "test_size": len(data.y_test),
                    "data_sha256": digest,
                }
            )
        progress = Progress(rundir, resume=args.resume)
        with checkpointing(progress):
            metrics = _run_mode(args, cfg, data, rundir, counts, rows_wanted)
        metrics["seconds"] = progress.seconds()
        rundir.write_metrics(metrics)
        progress.finish()
    finally:
        rundir.close()
    _print_summary(metrics)
    return 0


def _run_mode(
    args: argparse.Namespace,
    cfg: SpecConfig,
    data: ImageData,
    rundir: RunDir,
    counts: list[int],
    rows_wanted: list[int],
) -> dict[str, Any]:
    if args.mode == "table":
        return run_table(cfg, data, args.runs, args.sweep, rundir, rows_wanted)
    if args.mode == "partition":
        return run_partition(cfg, data, args.runs, rundir)
    if args.mode == "scaling":
        return run_scaling(cfg, data, counts, rundir)
    if args.mode == "single":
        cfg = replace(cfg, gate="single", reg="none", distill=False)
    log = lambda row: rundir.append_log(row)
    if args.sweep or args.runs > 1:
        trained = sweep(cfg, data, args.runs, rundir, use_grid=args.sweep)
    else:
        trained = train_once(cfg, data, log=log)
    _save(rundir, "model", trained, data, *titles(cfg))
    return trained.metrics


def _print_summary(metrics: dict[str, Any]) -> None:
    def line(name: str, m: dict[str, Any]) -> str:
        if m.get("over_seeds", {}).get("test_error", {}).get("n", 1) > 1:
            e = m["over_seeds"]["test_error"]
            return (
                f"{name}: over {e['n']} seeds error {_mean_sd(m, 'test_error')} (95% CI {_ci(m, 'test_error')}) "
                f"I(E;Y) {_mean_sd(m, 'I_EY')} I(E;Y_pred) {_mean_sd(m, 'I_EY_pred')} H_s {_mean_sd(m, 'H_s')} "
                f"H_u {_mean_sd(m, 'H_u')}"
            )
        f = lambda k: "NA" if m.get(k) is None else f"{m[k]:.3f}"
        return (
            f"{name}: error {f('test_error')} I(E;Y) {f('I_EY')} I(E;Y_pred) {f('I_EY_pred')} "
            f"H_s {f('H_s')} H_u {f('H_u')}"
        )

    if "rows" in metrics:
        for name, m in metrics["rows"].items():
            print(line(name, m))
        for t in metrics.get("welch", []):
            if t["metric"] == "test_error" and t["p"] is not None:
                print(f"Welch test error: {t['row_a']} vs {t['row_b']}: diff {t['diff']:+.4f} p {t['p']:.3g}")
    elif "partition" in metrics:
        for arm, m in metrics["partition"].items():
            print(f"({arm}) test error {m['test_error']:.3f} train loss {m['train_loss']:.3f}")
    elif "scaling" in metrics:
        for name, m in metrics["scaling"].items():
            print(f"{name}: experts used {m['experts_used']} error {m['test_error']:.3f}")
    else:
        print(line("result", metrics))
    if not math.isnan(metrics.get("seconds", float("nan"))):
        print(f"time {metrics['seconds']:.1f}s")
