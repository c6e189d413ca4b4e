"""``moelab specialize``: the expert-specialization lab of Krishnamurthy et al. (2023) — one model, the
single-model baseline, the rows of Table 2 / 3 / 7, the intuitive-partition experiment or the
expert-count scaling (``--mode``).  Every model is trained by :class:`moelab.train.Trainer` on
:class:`moelab.train.images.ImageTask` as a run of its own under ``OUT/fits/<name>/`` (its
checkpoints, ``log.csv`` and ``metrics.json``; :func:`moelab.load` opens it), which resumes itself; the
run lifecycle (flags, ``--config``, ``--resume``, ``--force``) is :mod:`moelab.experiments.runner`'s.
Methods, modes, the ``metrics.json`` keys and the measurements behind the defaults:
docs/specialization.md.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import config as vocab
from ..config import MAX_COUNT, Interval, Options, setting
from ..data.images import DATASETS, ImageData, load_images
from ..io.atomic import atomic_write_text
from ..io.model import save
from ..io.rundir import RunDir
from ..metrics import plot_selection_table, selection_table, specialization
from ..models.vision import ImageMoE, MoEOutput, SingleModel, build_experts, distill_gate, vision_config
from ..train.images import REGULARISERS, ImageTask, evaluate, image_digest
from ..train.trainer import TrainConfig, Trainer, TrainingError
from . import runner
from .summary import format_interval, format_mean_sd, mean, sd, seed_summary, welch

__all__ = ["GRIDS", "SPECIALIZE", "SpecConfig", "add_arguments", "run", "sweep", "train_once"]

GATES = ("original", "attentive")
MODES = ("run", "single", "table", "partition", "scaling")

#: Krishnamurthy et al. (2023) Appendix C: w_importance for every dataset; (β_s, β_d) per dataset (Table 6).
#: digits is not in the paper: its grid is MNIST's × 10 (docs/specialization.md).
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

#: per-dataset L_s defaults ``(β_s, β_d)``, each a point of the Appendix C grid (how they were chosen:
#: docs/specialization.md)
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

_COUNT = (Interval(int, 1), None)
#: float32's largest number: a loss weight above it is infinite in the model's dtype, and so is the loss
_FLOAT32_MAX = 3.4028234663852886e38
_WEIGHT = (Interval(float, 0, _FLOAT32_MAX), None)
_per_data = lambda i: ", ".join(f"{d} {b[i]:g}" for d, b in BETA_DEFAULTS.items())


@dataclass
class SpecConfig:
    """The settings of a ``moelab specialize`` run, as its ``config.yaml`` holds them; sizes left
    ``None`` take the dataset's :data:`DEFAULTS` and :data:`BETA_DEFAULTS` (recorded resolved)."""

    mode: str = setting("run", help="what to run", allowed=Options(MODES))
    data: str = setting("digits", help="dataset (digits: offline)", allowed=Options(tuple(DATASETS)))
    data_dir: str | None = setting(None, input=False, path=True, help="local folder with the dataset's files")
    mnist_dir: str | None = setting(
        None, input=False, path=True, help="fmnist+mnist: local folder with the MNIST IDX files"
    )
    gate: str = setting("original", help="gate", allowed=Options(GATES))
    reg: str = setting("none", help="gate regulariser", allowed=Options(REGULARISERS))
    w_importance: float = setting(
        0.2, help="weight of L_importance", allowed=Interval(float, 0, _FLOAT32_MAX)
    )
    beta_s: float | None = setting(
        None, help=f"L_s β_s (default per dataset: {_per_data(0)})", allowed=_WEIGHT
    )
    beta_d: float | None = setting(
        None,
        help=f"L_s β_d (default per dataset: {_per_data(1)}; each a point of the Krishnamurthy et al. "
        "(2023) Appendix C grid)",
        allowed=_WEIGHT,
    )
    distill: bool = setting(False, help="distil the attentive model into a plain gate")
    experts: int | None = setting(
        None, help="number of experts (default: per dataset)", allowed=(Interval(int, 2), None)
    )
    epochs: int | None = setting(
        None, help="epochs (default: per dataset)", allowed=(Interval(int, 1, MAX_COUNT), None)
    )
    batch_size: int | None = setting(None, help="samples a step (default: per dataset)", allowed=_COUNT)
    lr: float = setting(1e-3, help="Adam learning rate", allowed=Interval(float, 0, closed="neither"))
    seed: int = setting(0, help="seed of the first run", allowed=Interval(int, 0, 2**63 - 1))
    runs: int = setting(
        1,
        help="seeds per setting (paper: 10 MNIST, 5 CIFAR-100); with N > 1 the metrics are also summarised "
        "over the seeds (mean ± sd, 95% CI) and table rows compared by Welch's t-test",
        allowed=Interval(int, 1, MAX_COUNT),
    )
    sweep: bool = setting(False, help="sweep the Krishnamurthy et al. (2023) Appendix C grid")
    top_k: int = setting(1, help="experts at sparse inference", allowed=Interval(int, 1))
    counts: tuple[int, ...] = setting((5, 10, 15), help="scaling: expert counts")
    rows: tuple[int, ...] | None = setting(
        None,
        help="table: the row numbers to run, 1..9 in the order of Krishnamurthy et al. (2023) Table 2 / 7 "
        "(1 single, 2 vanilla, 3 vanilla + L_importance, 4 vanilla + L_s, 5 attentive, 6 attentive + "
        "L_importance, 7 attentive + L_s, 8 and 9 distilled from 6 and 7; default: all)",
    )
    train_samples: int | None = setting(None, help="a random subset of the train set", allowed=_COUNT)
    test_samples: int | None = setting(None, help="a random subset of the test set", allowed=_COUNT)
    output_relu: bool = setting(
        False, help="ReLU on the output logits (Krishnamurthy et al. (2023) App. B literal)"
    )
    loop_experts: bool = setting(False, help="run experts in a Python loop (benchmarks)")
    threads: int = setting(
        1, input=False, help="torch CPU threads (1: the models are tiny)", allowed=Interval(int, 1)
    )
    progress: bool = setting(True, input=False, flag="--no-progress", help="no progress bars")

    def check(self) -> None:
        if self.distill and self.gate != "attentive":
            raise ValueError(
                f"--distill is not allowed with --gate {self.gate}; distillation starts from an attentive gate"
            )
        if self.rows is not None:
            text = ",".join(map(str, self.rows))
            if self.mode != "table":
                raise ValueError(
                    f"--rows is not allowed with --mode {self.mode}; it selects rows of --mode table"
                )
            n = len(TABLE_ROWS)
            if (
                not self.rows
                or len(set(self.rows)) != len(self.rows)
                or not all(1 <= r <= n for r in self.rows)
            ):
                raise ValueError(
                    f"--rows={text!r} is not allowed; expected distinct comma-separated row numbers in 1..{n}"
                )
        if not self.counts or any(c < 2 for c in self.counts):
            raise ValueError(
                f"--counts={','.join(map(str, self.counts))!r} is not allowed; expected integers >= 2"
            )
        experts = self.experts or vision_config(self.data).num_experts
        if self.top_k > experts:
            raise ValueError(f"--top-k={self.top_k} is not allowed; expected an integer in [1, {experts}]")


def resolve(config: SpecConfig) -> SpecConfig:
    """``config`` with the dataset's sizes and L_s weights where it left ``None``."""
    d = DEFAULTS[config.data]
    beta_s, beta_d = BETA_DEFAULTS[config.data]
    return replace(
        config,
        experts=config.experts or vision_config(config.data).num_experts,
        epochs=config.epochs or d["epochs"],
        batch_size=config.batch_size or d["batch_size"],
        beta_s=beta_s if config.beta_s is None else config.beta_s,
        beta_d=beta_d if config.beta_d is None else config.beta_d,
    )


# ---------------------------------------------------------------------- training
class Lab:
    """The data of a run and where its models train: each under ``root/<name>/``, a Trainer run
    that continues from its newest checkpoint (a finished one only loads its final weights)."""

    def __init__(self, data: ImageData, root: Path | None, progress: bool = True) -> None:
        self.data, self.root, self.progress = data, root, progress
        self.runs: list[dict[str, Any]] = []  # runs.csv: one row per trained model
        self.seconds = 0.0

    def task(self, c: SpecConfig, **options: Any) -> ImageTask:
        return ImageTask(
            self.data, c.batch_size, c.seed, reg=c.reg, w_importance=c.w_importance,
            beta_s=c.beta_s, beta_d=c.beta_d, **options,
        )  # fmt: skip

    def fit(self, name: str, model: nn.Module, c: SpecConfig, task: ImageTask) -> nn.Module:
        """Adam at ``c.lr`` for ``c.epochs`` epochs; evaluated and checkpointed after every epoch."""
        epoch = task.steps_per_epoch
        config = TrainConfig(
            steps=epoch * c.epochs, batch_size=c.batch_size, lr=c.lr, schedule="constant", warmup=0,
            grad_clip=0.0, eval_every=epoch, ckpt_every=epoch, keep_ckpts=1, seed=c.seed,
            optimizer="adam", keep_best=False,
        )  # fmt: skip
        rundir = None if self.root is None else RunDir(self.root / name, resume=True, lock=False)
        try:
            if rundir is not None:
                rundir.write_config({"command": "specialize fit", "name": name, **asdict(c)})
            trainer = Trainer(
                model, task, config, rundir, progress=self.progress, extra_metrics={"method": name}
            )
            self.seconds += trainer.fit(resume=rundir is not None)["train_time_s"]
        finally:
            if rundir is not None:
                rundir.close()
        return model


def _only(model: nn.Module, trained: nn.Module) -> None:
    """Train ``trained`` alone: the rest of ``model`` is frozen."""
    model.requires_grad_(False)
    trained.requires_grad_(True)


def fit_name(c: SpecConfig) -> str:
    """The folder of one trained model: its gate, regulariser, setting, expert count and seed."""
    setting = {"importance": f"-w{c.w_importance:g}", "ls": f"-bs{c.beta_s:g}-bd{c.beta_d:g}"}.get(c.reg, "")
    if c.gate == "single":
        return f"single-s{c.seed}"
    return f"{c.gate}-{c.reg}{setting}-e{c.experts}-s{c.seed}"


def measure(model: nn.Module, data: ImageData, c: SpecConfig) -> tuple[dict[str, Any], Tensor | None]:
    """The metrics of a trained model and its expert × class selection table (``None``: single model)."""
    test = evaluate(model, data.x_test, data.y_test)
    train = evaluate(model, data.x_train, data.y_train)
    out: dict[str, Any] = {
        "test_error": test["error"],
        "train_error": train["error"],
        "train_loss": train["loss"],
        "seed": c.seed,
    }
    if not isinstance(model, ImageMoE):
        keys = ("H_s", "H_u", "I_EY", "I_EY_pred", "test_error_top1", "experts_used")
        return {**out, **dict.fromkeys(keys)}, None
    for k in dict.fromkeys((1, c.top_k)):
        out[f"test_error_top{k}"] = evaluate(model, data.x_test, data.y_test, top_k=k)["error"]
    p = test["gate_probs"]
    out.update(specialization(p, data.y_test, data.num_classes, predictions=test["predictions"]))
    table = selection_table(p.argmax(1), data.y_test, p.shape[1], data.num_classes)
    out["experts_used"] = int((table.sum(1) >= 0.01 * len(data.y_test)).sum())
    return out, table


class Trained(NamedTuple):
    """A trained model, its metrics and selection table; ``teacher_table`` only for ``--distill`` (the
    attentive teacher's; ``table`` is then the distilled model's)."""

    model: nn.Module
    metrics: dict[str, Any]
    table: Tensor | None
    teacher_table: Tensor | None = None


def train_once(lab: Lab, c: SpecConfig) -> Trained:
    """Train one configuration (with ``distill``: the attentive teacher, then its distilled gate)."""
    torch.manual_seed(c.seed)
    vcfg = vision_config(c.data, c.experts, c.output_relu)
    name = fit_name(c)
    if c.gate == "single":
        model = lab.fit(name, SingleModel(vcfg), c, lab.task(c))
        return Trained(model, *measure(model, lab.data, c))
    model = lab.fit(name, ImageMoE(vcfg, c.gate, batched=not c.loop_experts), c, lab.task(c))
    metrics, table = measure(model, lab.data, c)
    if not c.distill:
        return Trained(model, metrics, table)
    torch.manual_seed(c.seed)
    student = distill_gate(model)  # the experts frozen
    plain = replace(c, reg="none")
    lab.fit(f"{name}-distilled", student, plain, lab.task(plain, frozen=(student.experts,)))
    student_metrics, student_table = measure(student, lab.data, c)
    student_metrics.update({f"teacher_{k}": v for k, v in metrics.items() if k != "seed"})
    return Trained(student, student_metrics, student_table, table)


# ---------------------------------------------------------------------- sweeps and modes
def grid(c: SpecConfig) -> list[SpecConfig]:
    """The Krishnamurthy et al. (2023) Appendix C settings for ``c.reg`` (one setting for ``none``)."""
    g = GRIDS[c.data]
    if c.reg == "importance":
        return [replace(c, w_importance=w) for w in g["importance"]]
    if c.reg == "ls":
        return [replace(c, beta_s=bs, beta_d=bd) for bs in g["beta_s"] for bd in g["beta_d"]]
    return [c]


def _setting(c: SpecConfig) -> dict[str, Any]:
    return {
        "importance": {"w_importance": c.w_importance},
        "ls": {"beta_s": c.beta_s, "beta_d": c.beta_d},
    }.get(c.reg, {})


#: columns of runs.csv (one row per trained model)
RUN_COLUMNS = (
    "row", "gate", "reg", "experts", "w_importance", "beta_s", "beta_d", "seed", "test_error", "train_error",
    "train_loss", "test_error_top1", "H_s", "H_u", "I_EY", "I_EY_pred", "experts_used",
)  # fmt: skip

#: the metrics summarised over seeds (mean, sd, 95 % CI) and compared between rows (Welch's t-test)
SUMMARY_METRICS = ("test_error", "H_s", "H_u", "I_EY", "I_EY_pred")


def _record(lab: Lab | None, tag: str, c: SpecConfig, metrics: dict[str, Any]) -> None:
    if lab is not None:
        row = {"row": tag, "gate": c.gate, "reg": c.reg, "experts": c.experts, **_setting(c), **metrics}
        lab.runs.append({k: row.get(k) for k in RUN_COLUMNS})


def sweep(lab: Lab | None, cfg: SpecConfig, use_grid: bool = True, tag: str = "") -> Trained:
    """Every setting × ``cfg.runs`` seeds; the run with the minimum training error is selected
    (Krishnamurthy et al. (2023) §7) and summarised over the seeds of its setting."""
    results, best = [], None
    for s in grid(cfg) if use_grid else [cfg]:
        for r in range(cfg.runs):
            c = replace(s, seed=cfg.seed + r)
            trained = train_once(lab, c)
            m = trained.metrics
            results.append((s, m))
            _record(lab, tag, c, m)
            if best is None or m["train_error"] < best[1]["train_error"]:
                best = (c, m, trained)
    c, m, trained = best
    same = [r for s, r in results if _setting(s) == _setting(c)]
    seeds = {k: [r[k] for r in same] for k in SUMMARY_METRICS if all(r.get(k) is not None for r in same)}
    summary = {
        **m,
        "test_error_std": sd([r["test_error"] for r in same]),
        "selected": {**_setting(c), "seed": c.seed},
        "num_runs": len(results),
        "seeds": seeds,
        "over_seeds": {k: seed_summary(v) for k, v in seeds.items()},
    }
    return trained._replace(metrics=summary)


_REG_NAMES = {"none": "", "importance": " with L_importance", "ls": " with L_s"}


def titles(c: SpecConfig) -> tuple[str, str]:
    """The selection-table titles ``(model, teacher)``; ``teacher`` is ``""`` unless ``c.distill``.  A
    distilled model's title names the teacher it came from (its own gate is plain, unregularised)."""
    if c.gate == "single":
        return f"{c.data}: single model", ""
    gate = "attentive gate MoE" if c.gate == "attentive" else "vanilla MoE"
    own = f"{c.data}: {gate}{_REG_NAMES[c.reg]}"
    if not c.distill:
        return own, ""
    return f"{c.data}: distilled from {gate}{_REG_NAMES[c.reg]}", f"{own} (teacher)"


def _save(out: Path, name: str, trained: Trained, data: ImageData, title: str, teacher_title: str) -> None:
    """The model (``moelab.load(out / name)``) and its selection table(s) ``{name}_selection.png``."""
    save(trained.model, out / name)
    for table, suffix, t in ((trained.table, "", title), (trained.teacher_table, "_teacher", teacher_title)):
        if table is not None:
            plot_selection_table(table, out / f"{name}{suffix}_selection.png", data.class_names, t)


def _mean_sd(m: dict[str, Any], k: str) -> str:
    s = (m.get("over_seeds") or {}).get(k)
    if s is None:
        return "NA" if m.get(k) is None else f"{m[k]:.3f}"
    return f"{s['mean']:.3f}" if s["sd"] is None else format_mean_sd(s["mean"], s["sd"], 3)


def _ci(m: dict[str, Any], k: str) -> str:
    s = (m.get("over_seeds") or {}).get(k)
    return format_interval(None if s is None or s["sd"] is None else (s["ci_low"], s["ci_high"]), 3, "NA")


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """The rows of a ``table`` run in the layout of Krishnamurthy et al. (2023) Table 2 (columns:
    docs/specialization.md)."""
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
    """Welch's t-test between every pair of rows for each of :data:`SUMMARY_METRICS`."""
    names, out = list(rows), []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for k in SUMMARY_METRICS:
                va, vb = rows[a].get("seeds", {}).get(k), rows[b].get("seeds", {}).get(k)
                if va and vb:
                    out.append({"row_a": a, "row_b": b, "metric": k, **asdict(welch(va, vb))})
    return out


def format_welch(tests: list[dict[str, Any]]) -> str:
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


def run_table(lab: Lab, cfg: SpecConfig, out: Path) -> dict[str, Any]:
    """The rows ``cfg.rows`` (default all nine) of Krishnamurthy et al. (2023) Table 2 / 3 / 7, each
    summarised over its seeds, with Welch tests between the rows (``table.md``, ``welch.md``)."""
    rows: dict[str, dict[str, Any]] = {}
    for i in cfg.rows or range(1, len(TABLE_ROWS) + 1):
        name, change = TABLE_ROWS[i - 1]
        c = replace(cfg, **{"reg": "none", "distill": False, **change})
        trained = sweep(lab, c, use_grid=cfg.sweep, tag=name)
        rows[name] = trained.metrics
        _save(out, f"row{i}", trained, lab.data, name, titles(c)[1])
    tests = welch_tests(rows)
    atomic_write_text(out / "table.md", format_table(rows))
    atomic_write_text(out / "welch.md", format_welch(tests))
    return {"rows": rows, "welch": tests, "data": cfg.data}


def run_partition(lab: Lab, cfg: SpecConfig, out: Path) -> dict[str, Any]:
    """Krishnamurthy et al. (2023) §4.2 (Fig. 4, Table 1): (a) a gate trained end-to-end; (b) a gate
    trained against experts pre-trained on class pairs.  Each gate is then frozen and new experts
    trained with it; reported: that second model's test error and training loss over ``runs`` seeds."""
    data = lab.data
    pairs = PARTITIONS.get(data.num_classes)
    if pairs is None:
        raise ValueError(
            f"--mode partition needs 10 or 12 classes (5 or 6 experts); data={cfg.data!r} has {data.num_classes}"
        )
    vcfg = vision_config(cfg.data, len(pairs), cfg.output_relu)
    owner = torch.empty(data.num_classes, dtype=torch.long)
    for e, pair in enumerate(pairs):
        owner[list(pair)] = e

    def on_pairs(model: ImageMoE, x: Tensor, y: Tensor) -> MoEOutput:
        ys = model.experts.forward_all(x)[..., : data.num_classes]  # (B, N, K): each sample's pair expert
        chosen = ys.gather(1, owner[y][:, None, None].expand(-1, 1, ys.shape[-1]))[:, 0]
        return MoEOutput(chosen, torch.nn.functional.one_hot(owner[y], vcfg.num_experts).to(ys.dtype))

    results: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for r in range(cfg.runs):
        c = replace(cfg, seed=cfg.seed + r, reg="none", gate="original", distill=False, experts=len(pairs))
        for arm in ("a", "b"):
            torch.manual_seed(c.seed)
            model = ImageMoE(vcfg, "original", batched=not c.loop_experts)
            fresh = build_experts(vcfg, batched=not c.loop_experts)
            name = f"partition-{arm}-s{c.seed}"
            if arm == "a":
                lab.fit(f"{name}-end-to-end", model, c, lab.task(c))
            else:
                _only(model, model.experts)
                lab.fit(f"{name}-experts-on-pairs", model, c, lab.task(c, output=on_pairs))
                _only(model, model.gate)
                lab.fit(f"{name}-gate", model, c, lab.task(c, frozen=(model.experts,)))
            gate_metrics, gate_table = measure(model, data, c)
            model.experts = fresh
            _only(model, model.experts)
            lab.fit(f"{name}-new-experts", model, c, lab.task(c, frozen=(model.gate,)))
            m, _ = measure(model, data, c)
            m["gate_I_EY"] = gate_metrics["I_EY"]
            results[arm].append(m)
            _record(lab, f"partition ({arm})", c, m)
            if r == 0:
                plot_selection_table(
                    gate_table, out / f"partition_{arm}_gate.png", data.class_names, f"({arm}) gate selection"
                )
    summary = {
        arm: {
            "test_error": mean([m["test_error"] for m in ms]),
            "train_loss": mean([m["train_loss"] for m in ms]),
            "test_error_std": sd([m["test_error"] for m in ms]),
            "runs": len(ms),
        }
        for arm, ms in results.items()
    }
    return {"partition": summary, "pairs": [list(p) for p in pairs], "data": cfg.data}


def run_scaling(lab: Lab, cfg: SpecConfig, out: Path) -> dict[str, Any]:
    """Krishnamurthy et al. (2023) §7, Fig. 6: N experts for each N and each of L_importance and L_s;
    how many each actually uses (``experts_used``) and the selection tables."""
    scaling: dict[str, Any] = {}
    for reg in ("importance", "ls"):
        for n in cfg.counts:
            c = replace(cfg, reg=reg, experts=n, distill=False)
            trained = train_once(lab, c)
            scaling[f"{reg}_{n}"] = trained.metrics
            _record(lab, f"scaling {reg} {n}", c, trained.metrics)
            _save(out, f"{reg}_{n}", trained, lab.data, f"{reg}, {n} experts", "")
    return {"scaling": scaling, "data": cfg.data}


def run_model(lab: Lab, cfg: SpecConfig, out: Path) -> dict[str, Any]:
    """``--mode run`` / ``single``: one model, or with ``--sweep`` / ``--runs`` the selected one."""
    c = replace(cfg, gate="single", reg="none", distill=False) if cfg.mode == "single" else cfg
    trained = sweep(lab, c, use_grid=cfg.sweep) if cfg.sweep or cfg.runs > 1 else train_once(lab, c)
    if not (cfg.sweep or cfg.runs > 1):
        _record(lab, "", c, trained.metrics)
    _save(out, "model", trained, lab.data, *titles(c))
    return trained.metrics


_MODES = {
    "run": run_model,
    "single": run_model,
    "table": run_table,
    "partition": run_partition,
    "scaling": run_scaling,
}


# ---------------------------------------------------------------------- the command
def _subset(data: ImageData, c: SpecConfig) -> ImageData:
    """``--train-samples`` / ``--test-samples``: a seeded random subset, never larger than the set."""
    for flag, n, split in (
        ("--train-samples", c.train_samples, data.y_train),
        ("--test-samples", c.test_samples, data.y_test),
    ):
        if n is not None and n > len(split):
            raise ValueError(
                f"{flag}={n} is not allowed; expected an integer in [1, {len(split)}] "
                f"(the size of the {c.data} {flag[2:-8]} set)"
            )
    return data.subset(c.train_samples, c.test_samples, seed=0) if c.train_samples or c.test_samples else data


#: what a run writes beside its run entries (a new run in the folder removes them)
_OUTPUTS = (
    "model", "row[1-9]", "importance_[0-9]*", "ls_[0-9]*", "*_selection.png", "*_gate.png", "table.md", "welch.md",
)  # fmt: skip


def _execute(config: SpecConfig, run: runner.Run) -> dict[str, Any]:
    data = _subset(load_images(config.data, config.data_dir, config.mnist_dir), config)
    run.check_fingerprint("--data", config.data, image_digest(data))
    run.record(train_size=len(data.y_train), test_size=len(data.y_test))
    if not run.resume:  # what an earlier run of moelab wrote here (never a user's file of that name)
        run.dir.remove_written(_OUTPUTS)
    run.write_config()
    lab = Lab(data, run.path / "fits", progress=config.progress)
    metrics = _MODES[config.mode](lab, config, run.path)
    if lab.runs:
        text = io.StringIO()
        writer = csv.DictWriter(text, RUN_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(lab.runs)
        atomic_write_text(run.path / "runs.csv", text.getvalue())
    return {**metrics, "seconds": lab.seconds}


def _prepare(config: SpecConfig, world: int) -> None:
    torch.set_num_threads(config.threads)
    # the parameters grow linearly with the experts: measured on models of 2 and 3 experts
    sizes = [
        sum(
            p.numel()
            for p in ImageMoE(vision_config(config.data, n, config.output_relu), "attentive").parameters()
        )
        for n in (2, 3)
    ]
    per_expert, base = sizes[1] - sizes[0], sizes[0] - 2 * (sizes[1] - sizes[0])

    def need(c: SpecConfig) -> int:  # weights, gradients and Adam's two moments of the largest model
        largest = max([c.experts or 2, *(c.counts if c.mode == "scaling" else ())])
        return 16 * (base + per_expert * largest)

    ordinary = {"experts": vision_config(config.data).num_experts, "counts": (5, 10, 15)}
    runner.check_memory(config, need, ordinary, "the model and its training state")


#: ``moelab specialize`` as the run lifecycle sees it
SPECIALIZE = runner.Command("specialize", SpecConfig, _execute, resolve=resolve, prepare=_prepare)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    vocab.add_arguments(parser, SpecConfig)


def run(args: argparse.Namespace) -> int:
    try:
        metrics = runner.run_command(SPECIALIZE, args)
    except TrainingError as exc:
        print(f"moelab specialize: {exc}")
        return 1
    _print_summary(metrics)
    return 0


def _print_summary(metrics: dict[str, Any]) -> None:
    def line(name: str, m: dict[str, Any]) -> str:
        keys = ("test_error", "I_EY", "I_EY_pred", "H_s", "H_u")
        labels = ("error", "I(E;Y)", "I(E;Y_pred)", "H_s", "H_u")
        n = m.get("over_seeds", {}).get("test_error", {}).get("n", 1)
        text = " ".join(f"{label} {_mean_sd(m, k)}" for label, k in zip(labels, keys))
        return (
            f"{name}: over {n} seeds {text} (error 95% CI {_ci(m, 'test_error')})"
            if n > 1
            else f"{name}: {text}"
        )

    for name, m in metrics.get("rows", {}).items():
        print(line(name, m))
    for t in metrics.get("welch", []):
        if t["metric"] == "test_error" and t["p"] is not None:
            print(f"Welch test error: {t['row_a']} vs {t['row_b']}: diff {t['diff']:+.4f} p {t['p']:.3g}")
    for arm, m in metrics.get("partition", {}).items():
        print(f"({arm}) test error {m['test_error']:.3f} train loss {m['train_loss']:.3f}")
    for name, m in metrics.get("scaling", {}).items():
        print(f"{name}: experts used {m['experts_used']} error {m['test_error']:.3f}")
    if "test_error" in metrics:
        print(line("result", metrics))
    if not math.isnan(metrics.get("seconds", math.nan)):
        print(f"time {metrics['seconds']:.1f}s")
