"""``moelab finetune``: fine-tune a pre-trained MoE LM on text classification (CompeteSMoE (2024)
§6.3, Table 3): the LM of ``--from RUN_DIR`` loses its head, two new fully connected layers
classify its mean-pooled final states and the routers are frozen (:mod:`moelab.models.classifier`),
trained with the settings of CompeteSMoE (2024) App. C.3 through the run lifecycle of
:mod:`moelab.experiments.runner`.  docs/reproduce-lm-notes.md gives the settings and the
``metrics.json`` keys; docs/cli.md has an example.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import config as vocab
from ..adapters import ADAPTERS, TARGET_GROUPS, add_adapter
from ..config import MAX_COUNT, Interval, Options, setting
from ..data.classification import TASKS, ClassificationData, load_classification, subsample_train
from ..data.text import tokenizer_from_state
from ..io.atomic import read_json, sha256_file
from ..io.model import load, read_config
from ..io.model import resolve as resolve_model
from ..io.rundir import read_yaml
from ..layer import moe_layers
from ..models.classifier import LMClassifier, freeze_all_but_experts, freeze_routers
from ..models.lm import TransformerLM
from ..optim import OPTIMIZERS, check_optimizer
from ..routing import RoutingContext
from ..train.tasks import ClassificationTask, encode_texts
from ..train.trainer import TrainConfig, Trainer, TrainingError
from . import runner
from .lm import TrainRun, memory_needed

__all__ = [
    "FINETUNE",
    "ClassificationTask",
    "FinetuneConfig",
    "add_arguments",
    "encode_texts",
    "read_lm_run",
    "run",
]

_POSITIVE = (Interval(int, 1), None)

#: CompeteSMoE (2024) App. C.3 (Table 8)
EPOCHS = {"banking77": 50}
BATCH = {"imdb": 4}


def read_lm_run(run_dir: str | Path) -> tuple[TrainRun, Any]:
    """The configuration and tokenizer of a ``moelab train`` language-model run (its model:
    ``moelab.load(run_dir)``, the best-validation weights)."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.exists():
        raise FileNotFoundError(f"--from {str(run_dir)!r} holds no moelab run (no config.yaml)")
    command = read_yaml(config_path, repr(str(config_path))).get("command")
    if command in ("prune", "merge-experts"):  # the run it came from, with its experts now
        source = read_yaml(config_path, repr(str(config_path)))["source"]
        config, tokenizer = read_lm_run(source)
        layers = read_config(run_dir).get("moe_layers") or {}
        experts = {v["num_experts"] for v in layers.values()}
        return replace(
            config, num_experts=experts.pop() if len(experts) == 1 else config.num_experts
        ), tokenizer
    try:
        config, _ = runner.read_run_config(TrainRun, run_dir, "train")
    except ValueError as exc:
        raise ValueError(f"--from {str(run_dir)!r}: {exc}; expected a language-model run") from None
    tok_path = run_dir / "tokenizer.json"
    if not tok_path.exists():
        raise FileNotFoundError(f"--from {str(run_dir)!r} has no tokenizer.json")
    return config, tokenizer_from_state(read_json(tok_path))


@dataclass
class FinetuneConfig:
    """The settings of a ``moelab finetune`` run, as its ``config.yaml`` holds them; ``epochs`` and
    ``batch_size`` left ``None`` take CompeteSMoE (2024) App. C.3's value for the task (recorded
    resolved), ``steps`` left ``None`` follows from the epochs and the training set."""

    task: str = setting(
        help=f"one of {', '.join(TASKS)}, or a local CSV/TSV of (text, label)", fingerprint="data_sha256"
    )
    source: str = setting(
        flag="--from", metavar="RUN_DIR", help="a `moelab train` run", fingerprint="source_sha256"
    )
    epochs: float | None = setting(
        None,
        help="epochs (CompeteSMoE (2024): 5; BANKING77 50)",
        allowed=(Interval(float, 0, MAX_COUNT, closed="right"), None),
    )
    steps: int | None = setting(
        None, help="optimisation steps (overrides --epochs)", allowed=(Interval(int, 1, MAX_COUNT), None)
    )
    batch_size: int | None = setting(None, help="batch (CompeteSMoE (2024): 16; IMDB 4)", allowed=_POSITIVE)
    lr: float = setting(
        1e-4, help="learning rate (CompeteSMoE (2024))", allowed=Interval(float, 0, closed="neither")
    )
    optimizer: str = setting(
        "adamw",
        help="adamw (decoupled weight decay on the weight matrices only) or adam (no weight decay)",
        allowed=Options(OPTIMIZERS),
    )
    weight_decay: float = setting(
        0.0,
        help="AdamW's weight decay on the matrices (CompeteSMoE (2024) trains without)",
        allowed=Interval(float, 0),
    )
    eval_every: int | None = setting(
        None, help="validate every N steps (default: each epoch)", allowed=_POSITIVE
    )
    seed: int = setting(
        0, help="seed of the new head and the data order", allowed=Interval(int, 0, 2**63 - 1)
    )
    adapter: str = setting(
        "none",
        help="none: fine-tune the whole trunk (routers frozen); lora or replora (Ho (2025)): train only "
        "low-rank updates of Q and V and the new head (moelab.adapters)",
        allowed=Options(("none", *ADAPTERS)),
    )
    trainable: str = setting(
        "experts",
        help="experts: the MoE experts and the new head train, the rest of the LM is frozen (CompeteSMoE "
        "(2024) §6.3: 'only optimize the experts' parameters'); trunk: every LM parameter but the routers",
        allowed=Options(("experts", "trunk")),
    )
    rank: int = setting(8, help="the adapter's rank r (alpha = r: scale 1)", allowed=Interval(int, 1))
    targets: str = setting(
        "attention",
        help=f"what the adapter adapts, comma-separated: {', '.join(TARGET_GROUPS)} (attention: Q and V; "
        "experts: every expert's gate/up/down projection; router: the routers' weights)",
    )
    share_experts: bool = setting(
        False,
        help="one low-rank update shared by all experts of a projection instead of one per expert "
        "(RepLoRA per expert: each its own a, b and one shared phi)",
    )
    fraction: float = setting(
        1.0,
        help="the fraction of the training rows used (a seeded subset; validation and test untouched)",
        allowed=Interval(float, 0, 1, closed="right"),
    )
    progress: bool = setting(True, input=False, flag="--no-progress", help="no progress bar")

    def check(self) -> None:
        check_optimizer(self.optimizer, self.weight_decay)
        if self.adapter != "none" and self.trainable != "experts":
            raise ValueError(
                f"--trainable={self.trainable!r} is not allowed with --adapter {self.adapter}; an adapter "
                "trains its low-rank updates and the new head only"
            )
        if self.adapter == "none" and self.rank != 8:
            raise ValueError(
                f"--rank={self.rank} is not allowed with --adapter none; it is an adapter's rank"
            )
        groups = self.target_groups
        unknown = [g for g in groups if g not in TARGET_GROUPS]
        if unknown or not groups or len(set(groups)) != len(groups):
            raise ValueError(
                f"--targets={self.targets!r} is not allowed; expected distinct names of {', '.join(TARGET_GROUPS)}, "
                "comma-separated"
            )
        if self.adapter == "none" and (self.targets != "attention" or self.share_experts):
            what = f"--targets={self.targets!r}" if self.targets != "attention" else "--share-experts"
            raise ValueError(f"{what} is not allowed with --adapter none; it says what an adapter adapts")
        if self.share_experts and "experts" not in groups:
            raise ValueError(
                f"--share-experts is not allowed with --targets={self.targets!r}; it shares the experts' update "
                "(add experts to --targets)"
            )

    @property
    def target_groups(self) -> list[str]:
        """``--targets`` as a list of :data:`moelab.adapters.TARGET_GROUPS` names."""
        return [g.strip() for g in self.targets.split(",")]

    @property
    def task_name(self) -> str:
        """The named task, or ``local`` for a file."""
        return self.task if self.task in TASKS else "local"


def resolve(config: FinetuneConfig) -> FinetuneConfig:
    """``config`` with the task's epochs and batch where it left ``None``."""
    name = config.task_name
    return replace(
        config,
        epochs=config.epochs if config.epochs is not None else float(EPOCHS.get(name, 5)),
        batch_size=config.batch_size if config.batch_size is not None else BATCH.get(name, 16),
    )


def _execute(config: FinetuneConfig, run: runner.Run) -> dict[str, Any]:
    lm_config, tokenizer = read_lm_run(config.source)
    lm = load(config.source)  # the best-validation weights (moelab.io.model.resolve)
    if not isinstance(lm, TransformerLM):
        raise ValueError(f"--from {config.source!r} holds a {type(lm).__name__}; expected a TransformerLM")
    data = load_classification(config.task)
    if config.fraction < 1:  # the same rows for every adapter at one seed (paired comparisons)
        data = subsample_train(data, config.fraction, config.seed)
    per_epoch = math.ceil(len(data.labels["train"]) / config.batch_size)
    steps = config.steps if config.steps is not None else max(1, round(config.epochs * per_epoch))
    if steps > MAX_COUNT:
        raise ValueError(
            f"--epochs={config.epochs!r} is not allowed here: {per_epoch:,} steps an epoch make {steps:,} "
            f"steps, more than {MAX_COUNT:,}, which cannot finish; expected a smaller --epochs"
        )
    run.check_fingerprint("--task", config.task, data_fingerprint(data))
    run.check_fingerprint("--from", config.source, lm_fingerprint(config.source), key="source_sha256")
    routing = frozen_routing(lm)  # before the classifier's Trainer attaches it
    torch.manual_seed(config.seed)  # the new head (and an adapter) start from the seed: a run repeats
    model = LMClassifier(lm, data.num_classes)
    frozen = freeze_routers(model)
    if config.adapter != "none":  # the trunk frozen but for its updates; the new head trains
        targets = [pattern for group in config.target_groups for pattern in TARGET_GROUPS[group]]
        add_adapter(
            model.lm, config.adapter, rank=config.rank, targets=targets, share_experts=config.share_experts
        )
    elif config.trainable == "experts":
        frozen += freeze_all_but_experts(model.lm)
    train = TrainConfig(
        steps=steps,
        batch_size=config.batch_size,
        lr=config.lr,
        schedule="constant",
        warmup=0,
        eval_every=config.eval_every or min(per_epoch, steps),
        seed=config.seed,
        weight_decay=config.weight_decay,
        optimizer=config.optimizer,
    )
    run.record(
        steps=train.steps,
        eval_every=train.eval_every,
        num_classes=data.num_classes,
        labels=data.label_names,
        frozen_router_params=frozen,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        train_rows=len(data.labels["train"]),
        method=lm_config.method,
    )
    run.write_config()
    task = ClassificationTask(data, tokenizer, lm.cfg.block_size)
    trainer = Trainer(
        model,
        task,
        train,
        run.dir,
        ctx=routing,
        progress=config.progress,
        extra_metrics={"method": lm_config.method, "task": config.task_name, "num_classes": data.num_classes},
    )
    with warnings.catch_warnings():
        # the routers are frozen: their context stays put by design (FrozenRouting), not by a
        # forgotten ctx.advance()
        warnings.filterwarnings(
            "ignore", message=r"MoE layer of method=.* RoutingContext that does not advance"
        )
        metrics = trainer.fit(resume=run.resume)
    print(
        f"{metrics['method']} fine-tuned on {data.name}: test accuracy {metrics['test_acc']:.1f}% "
        f"(val {metrics['val_acc']:.1f}%, {data.num_classes} classes) -> {run.path}"
    )
    return metrics


class FrozenRouting(RoutingContext):
    """The routing context of a fine-tuning whose routers are frozen: the LM's at the end of its
    training, which :meth:`advance` never changes (no step hook runs, the step is not counted), so
    StableMoE stays in the stage, SMoE-Dropout at the K and sharede-v3 at the bias the LM was tested
    with.  No competition schedule: a frozen router routes as in evaluation."""

    frozen = True

    def advance(self, steps: int = 1) -> None:
        return None


def frozen_routing(lm: nn.Module) -> FrozenRouting:
    """:class:`FrozenRouting` at the step and planned steps of the context ``moelab.load`` attached
    to ``lm`` (step 0 of an unknown length without one)."""
    ctx = next((layer.ctx for layer in moe_layers(lm) if layer.ctx is not None), None)
    if ctx is None:
        return FrozenRouting()
    return FrozenRouting(step=ctx.step, total_steps=ctx.total_steps)


def data_fingerprint(data: ClassificationData) -> str:
    """The sha256 of a classification data set's texts, labels and label names, split by split:
    what the fine-tuning reads, whether a named task or a local file."""
    body = json.dumps([data.texts, data.labels, data.label_names], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def lm_fingerprint(source: str | Path) -> str:
    """The sha256 of the ``config.json`` of the weights ``moelab.load(source)`` reads (it holds the
    digest of every file of the folder)."""
    return sha256_file(resolve_model(source) / "config.json")


def _prepare(config: FinetuneConfig, world: int) -> None:
    """Before the run directory opens: ``--from`` must be a language-model run, and the batch must
    fit the machine's memory."""
    lm_run, _ = read_lm_run(config.source)
    d = lm_run.d_model  # recorded resolved: the LM's Q and V projections are d x d
    if config.adapter != "none" and d is not None:
        h, n = lm_run.d_hidden or d, lm_run.num_experts
        shapes = {"attention": (d, d, "Q and V projections"), "experts": (h, d, "expert projections")}
        if n is not None:
            shapes["router"] = (n, d, "router weights")
        for group in config.target_groups:
            if group in shapes and config.rank > min(shapes[group][:2]):
                m, k, what = shapes[group]
                bound = min(m, k)
                raise ValueError(
                    f"--rank={config.rank} is not allowed with --from {config.source!r}: an update of its {m}x{k} "
                    f"{what} has rank at most {bound}; expected --rank <= {bound}"
                )

    def need(c: FinetuneConfig) -> int:
        return memory_needed(replace(lm_run, batch_size=c.batch_size, steps=1, method="smoe"))

    runner.check_memory(config, need, {"batch_size": 16}, "the model, its training state and a batch")


#: ``moelab finetune`` as the run lifecycle sees it
FINETUNE = runner.Command("finetune", FinetuneConfig, _execute, resolve=resolve, prepare=_prepare)


def add_arguments(p: argparse.ArgumentParser) -> None:
    vocab.add_arguments(p, FinetuneConfig)


def run(args: argparse.Namespace) -> int:
    try:
        runner.run_command(FINETUNE, args)
    except TrainingError as exc:
        print(f"moelab finetune: {exc}")
        return 1
    return 0
