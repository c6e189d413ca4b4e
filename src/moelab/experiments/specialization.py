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
``H_s``, ``H_u``, ``I_EY`` (bits, test set, :func:`moelab.metrics.specialization`),
``experts_used`` (experts that are the argmax for ≥ 1% of the test samples), ``seed``, and for
sweeps ``test_error_std`` (over the seeds of the selected setting), ``selected`` and ``num_runs``.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..data.images import DATASETS, ImageData, load_images
from ..io.atomic import atomic_write_text
from ..io.model import save
from ..io.rundir import RunDir
from ..losses import importance_loss, sample_similarity_loss
from ..metrics import plot_selection_table, selection_table, specialization
from ..models.vision import ImageMoE, MoEOutput, SingleModel, distill_gate, vision_config

__all__ = [
    "GRIDS",
    "SpecConfig",
    "add_arguments",
    "add_image_arguments",
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
        grid = GRIDS[self.data]
        return replace(
            self,
            epochs=self.epochs or d["epochs"],
            batch_size=self.batch_size or d["batch_size"],
            beta_s=grid["beta_s"][-1] if self.beta_s is None else self.beta_s,
            beta_d=grid["beta_d"][len(grid["beta_d"]) // 2] if self.beta_d is None else self.beta_d,
        )

    def validate(self) -> None:
        if self.data not in DATASETS:
            raise ValueError(f"--data={self.data!r} is not allowed; expected one of {list(DATASETS)}")
        if self.gate not in GATES:
            raise ValueError(f"--gate={self.gate!r} is not allowed; expected one of {list(GATES)}")
        if self.reg not in REGS:
            raise ValueError(f"--reg={self.reg!r} is not allowed; expected one of {list(REGS)}")
        if self.experts is not None and self.experts < 2:
            raise ValueError(f"--experts={self.experts} is not allowed; expected an integer >= 2")
        if self.distill and self.gate != "attentive":
            raise ValueError(
                "--distill is not allowed with --gate original; distillation starts from an attentive gate"
            )
        for name in ("epochs", "batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')}={v} is not allowed; expected a positive integer"
                )
        for name in ("w_importance", "beta_s", "beta_d"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"--{name.replace('_', '-')}={v} is not allowed; expected a number >= 0")


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
    errors, nll, probs = 0, 0.0, []
    for xc, yc in zip(x.split(chunk), y.split(chunk)):
        out = model(xc, top_k=top_k)
        errors += int((out.probs.argmax(-1) != yc).sum())
        nll += float(out.nll(yc)) * len(yc)
        probs.append(out.gate_probs)
    model.train(was)
    return {"error": errors / len(y), "loss": nll / len(y), "gate_probs": torch.cat(probs)}


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
    """
    from tqdm.auto import tqdm

    params = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed)
    n = len(data.y_train)
    model.train()
    for m in frozen:
        m.eval()
    for epoch in tqdm(range(cfg.epochs), desc=desc, leave=False, disable=log is None):
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
            log(
                {
                    "phase": desc,
                    "epoch": epoch + 1,
                    "task_loss": total / steps,
                    "reg_loss": reg_total / steps,
                    "seconds": time.perf_counter() - t0,
                }
            )


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
        out.update({"H_s": None, "H_u": None, "I_EY": None, "test_error_top1": None, "experts_used": None})
        return out, None
    out["test_error_top1"] = evaluate(model, data.x_test, data.y_test, top_k=1)["error"]
    if cfg.top_k != 1:
        out[f"test_error_top{cfg.top_k}"] = evaluate(model, data.x_test, data.y_test, top_k=cfg.top_k)[
            "error"
        ]
    p = test["gate_probs"]
    out.update(specialization(p, data.y_test, data.num_classes))
    table = selection_table(p.argmax(1), data.y_test, p.shape[1], data.num_classes)
    out["experts_used"] = int((table.sum(1) >= 0.01 * len(data.y_test)).sum())
    return out, table


def train_once(cfg: SpecConfig, data: ImageData, log=None) -> tuple[nn.Module, dict[str, Any], Tensor | None]:
    """Train one configuration; returns ``(model, metrics, selection table or None)``."""
    cfg = cfg.resolved()
    torch.manual_seed(cfg.seed)
    vcfg = vision_config(cfg.data, cfg.experts, cfg.output_relu)
    if cfg.gate == "single":
        model: nn.Module = SingleModel(vcfg)
        fit(model, data, cfg, log=log, desc="single")
        metrics, table = _metrics(model, data, cfg)
        return model, metrics, table
    model = ImageMoE(vcfg, cfg.gate, batched=cfg.batched)
    fit(model, data, cfg, log=log, desc=f"{cfg.gate}-{cfg.reg}")
    if not cfg.distill:
        metrics, table = _metrics(model, data, cfg)
        return model, metrics, table
    teacher_metrics, _ = _metrics(model, data, cfg)
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
    return student, metrics, table


# ---------------------------------------------------------------------- sweeps and named modes
def grid(cfg: SpecConfig) -> list[SpecConfig]:
    """The Krishnamurthy et al. (2023) Appendix C settings for ``cfg.reg`` (one setting for ``none``)."""
    g = GRIDS[cfg.data]
    if cfg.reg == "importance":
        return [replace(cfg, w_importance=w) for w in g["importance"]]
    if cfg.reg == "ls":
        return [replace(cfg, beta_s=bs, beta_d=bd) for bs in g["beta_s"] for bd in g["beta_d"]]
    return [cfg]


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
    "experts_used",
)


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
            model, m, table = train_once(c, data)
            results.append((s, m))
            if rundir is not None:
                rundir.append_log(_run_row(tag, c, m), name="runs.csv")
            if best is None or m["train_error"] < best[1]["train_error"]:
                best = (c, m, table, model)
    c, m, table, model = best
    same = [r[1]["test_error"] for r in results if _setting(r[0]) == _setting(c)]
    std = float(torch.tensor(same, dtype=torch.float64).std()) if len(same) > 1 else 0.0
    summary = {
        **m,
        "test_error_std": std,
        "selected": {**_setting(c), "seed": c.seed},
        "num_runs": len(results),
    }
    return model, summary, table


def _save(
    rundir: RunDir, name: str, model: nn.Module, table: Tensor | None, data: ImageData, title: str
) -> None:
    save(model, rundir.file(name))  # config.json + model.safetensors: moelab.load(rundir / name)
    if table is not None:
        plot_selection_table(table, rundir.file(f"{name}_selection.png"), data.class_names, title)


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


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """The rows of a ``table`` run as a markdown table in the layout of Krishnamurthy et al. (2023) Table
    2."""
    f = lambda m, k: "NA" if m.get(k) is None else f"{m[k]:.3f}"
    lines = [
        "| experiment | error | ± std | I(E;Y) | H_s | H_u | top-1 error | experts used | selected |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in rows.items():
        sel = ", ".join(f"{k}={v:g}" for k, v in (m.get("selected") or {}).items())
        used = "NA" if m.get("experts_used") is None else str(m["experts_used"])
        lines.append(
            f"| {name} | {f(m, 'test_error')} | {f(m, 'test_error_std')} | {f(m, 'I_EY')} | {f(m, 'H_s')} | "
            f"{f(m, 'H_u')} | {f(m, 'test_error_top1')} | {used} | {sel} |"
        )
    return "\n".join(lines) + "\n"


def run_table(cfg: SpecConfig, data: ImageData, runs: int, use_grid: bool, rundir: RunDir) -> dict[str, Any]:
    """All nine rows of Krishnamurthy et al. (2023) Table 2 / 3 / 7."""
    rows = {}
    for i, (name, change) in enumerate(TABLE_ROWS):
        c = replace(cfg, **{"reg": "none", "distill": False, **change})
        model, m, table = sweep(c, data, runs, rundir, use_grid=use_grid, tag=name)
        rows[name] = m
        _save(rundir, f"row{i}", model, table, data, name)
        rundir.write_metrics({"rows": rows, "data": cfg.data})
        atomic_write_text(rundir.file("table.md"), format_table(rows))
    return {"rows": rows, "data": cfg.data}


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
        te = torch.tensor([m["test_error"] for m in ms], dtype=torch.float64)
        tl = torch.tensor([m["train_loss"] for m in ms], dtype=torch.float64)
        summary[arm] = {
            "test_error": float(te.mean()),
            "train_loss": float(tl.mean()),
            "test_error_std": float(te.std()) if len(ms) > 1 else 0.0,
            "runs": len(ms),
        }
    return {"partition": summary, "pairs": [list(p) for p in pairs], "data": cfg.data}


def run_scaling(cfg: SpecConfig, data: ImageData, counts: list[int], rundir: RunDir) -> dict[str, Any]:
    """Krishnamurthy et al. (2023) §7, Fig. 6: train with N experts for each N and each of L_importance and
    L_s; report how many experts each actually uses (``experts_used``) and the selection tables."""
    out: dict[str, Any] = {}
    for reg in ("importance", "ls"):
        for n in counts:
            c = replace(cfg, reg=reg, experts=n, distill=False)
            model, m, table = train_once(c, data)
            out[f"{reg}_{n}"] = m
            rundir.append_log(_run_row(f"scaling {reg} {n}", c, m), name="runs.csv")
            _save(rundir, f"{reg}_{n}", model, table, data, f"{reg}, {n} experts")
    return {"scaling": out, "data": cfg.data}


# ---------------------------------------------------------------------- CLI
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
    parser.add_argument("--w-importance", type=float, default=0.2, help="weight of L_importance")
    parser.add_argument("--beta-s", type=float, default=None, help="L_s β_s (default: per dataset)")
    parser.add_argument("--beta-d", type=float, default=None, help="L_s β_d (default: per dataset)")
    parser.add_argument("--distill", action="store_true", help="distil the attentive model into a plain gate")
    parser.add_argument("--experts", type=int, default=None, help="number of experts (default: per dataset)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--runs", type=int, default=1, help="seeds per setting (paper: 10 MNIST, 5 CIFAR-100)"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="sweep the Krishnamurthy et al. (2023) Appendix C grid"
    )
    parser.add_argument("--top-k", type=int, default=1, help="experts at sparse inference")
    parser.add_argument("--counts", default="5,10,15", help="scaling: expert counts")
    parser.add_argument(
        "--train-samples", type=int, default=None, help="use a random subset of the train set"
    )
    parser.add_argument("--test-samples", type=int, default=None, help="use a random subset of the test set")
    parser.add_argument(
        "--output-relu",
        action="store_true",
        help="ReLU on the output logits (Krishnamurthy et al. (2023) App. B literal)",
    )
    parser.add_argument(
        "--loop-experts", action="store_true", help="run experts in a Python loop (benchmarks)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: the models are tiny)"
    )
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument("--force", action="store_true", help="overwrite a finished run in --out")


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
    if args.runs < 1:
        raise ValueError(f"--runs={args.runs} is not allowed; expected a positive integer")
    n = cfg.experts or vision_config(cfg.data).num_experts
    if not 1 <= cfg.top_k <= n:
        raise ValueError(f"--top-k={cfg.top_k} is not allowed; expected an integer in [1, {n}]")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.threads < 1:
        raise ValueError(f"--threads={args.threads} is not allowed; expected a positive integer")
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
    data = load_images(cfg.data, args.data_dir, args.mnist_dir)
    if cfg.train_samples or cfg.test_samples:
        data = data.subset(cfg.train_samples, cfg.test_samples, seed=0)
    rundir = RunDir(args.out, force=args.force)
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
            "train_size": len(data.y_train),
            "test_size": len(data.y_test),
        }
    )
    t0 = time.perf_counter()
    if args.mode == "table":
        metrics = run_table(cfg, data, args.runs, args.sweep, rundir)
    elif args.mode == "partition":
        metrics = run_partition(cfg, data, args.runs, rundir)
    elif args.mode == "scaling":
        metrics = run_scaling(cfg, data, counts, rundir)
    else:
        if args.mode == "single":
            cfg = replace(cfg, gate="single", reg="none", distill=False)
        log = lambda row: rundir.append_log(row)
        if args.sweep or args.runs > 1:
            model, metrics, table = sweep(cfg, data, args.runs, rundir, use_grid=args.sweep)
        else:
            model, metrics, table = train_once(cfg, data, log=log)
        _save(rundir, "model", model, table, data, f"{cfg.data}: {cfg.gate} gate, reg {cfg.reg}")
    metrics["seconds"] = time.perf_counter() - t0
    rundir.write_metrics(metrics)
    _print_summary(metrics)
    return 0


def _print_summary(metrics: dict[str, Any]) -> None:
    def line(name: str, m: dict[str, Any]) -> str:
        f = lambda k: "NA" if m.get(k) is None else f"{m[k]:.3f}"
        return f"{name}: error {f('test_error')} I(E;Y) {f('I_EY')} H_s {f('H_s')} H_u {f('H_u')}"

    if "rows" in metrics:
        for name, m in metrics["rows"].items():
            print(line(name, m))
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
