"""``moelab finetune``: fine-tune a pre-trained MoE LM on text classification (CompeteSMoE (2024) §6.3, Table
3).

The LM of ``--from RUN_DIR`` (its best-validation weights, else its newest checkpoint) loses its
head; two new fully connected layers classify the mean-pooled final states; the routers are
frozen (:mod:`moelab.models.classifier`).  CompeteSMoE (2024) App. C.3: Adam, lr 1e-4, batch 16 (IMDB 4),
5 epochs (BANKING77 50); inputs truncated to the LM's block size.  The best-validation weights
give the test accuracy; ``metrics.json`` holds ``val_acc``, ``test_acc`` and the trainer's keys.

Example::

    moelab train --task lm --size cpu --steps 300 --out runs/lm
    moelab finetune --task my_reviews.csv --from runs/lm --out runs/ft
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from .. import _validate
from ..data.classification import TASKS, load_classification
from ..data.text import tokenizer_from_state
from ..io.atomic import read_json
from ..io.model import load
from ..io.rundir import RunDir
from ..models.classifier import LMClassifier, freeze_routers
from ..models.lm import TransformerLM
from ..optim import OPTIMIZERS
from ..routing import RoutingContext
from ..train.tasks import ClassificationTask, encode_texts
from ..train.trainer import TrainConfig, Trainer, TrainingError
from . import runner
from .lm import TrainRun

__all__ = ["ClassificationTask", "add_arguments", "encode_texts", "read_lm_run", "run"]

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
    try:
        config, _ = runner.read_run_config(TrainRun, run_dir, "train")
    except ValueError as exc:
        raise ValueError(f"--from {str(run_dir)!r}: {exc}; expected a language-model run") from None
    tok_path = run_dir / "tokenizer.json"
    if not tok_path.exists():
        raise FileNotFoundError(f"--from {str(run_dir)!r} has no tokenizer.json")
    return config, tokenizer_from_state(read_json(tok_path))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task", required=True, help=f"one of {', '.join(TASKS)}, or a local CSV/TSV of (text, label)"
    )
    p.add_argument("--from", dest="source", required=True, metavar="RUN_DIR", help="a `moelab train` run")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--epochs", type=float, help="epochs (CompeteSMoE (2024): 5; BANKING77 50)")
    p.add_argument("--steps", type=int, help="optimisation steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, dest="batch_size", help="batch (CompeteSMoE (2024): 16; IMDB 4)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (1e-4, CompeteSMoE (2024))")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=list(OPTIMIZERS),
        help="adamw (decoupled weight decay on the weight matrices only) or adam (no weight decay)",
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        dest="weight_decay",
        help="AdamW's weight decay on the matrices (default 0: CompeteSMoE (2024) trains without)",
    )
    p.add_argument(
        "--eval-every", type=int, dest="eval_every", help="validate every N steps (default: each epoch)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--force", action="store_true")
    p.add_argument("--no-progress", action="store_true", dest="no_progress")


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    lm_config, tokenizer = read_lm_run(args.source)
    lm = load(args.source)  # the best-validation weights (moelab.io.model.resolve)
    if not isinstance(lm, TransformerLM):
        raise ValueError(f"--from {str(args.source)!r} holds a {type(lm).__name__}; expected a TransformerLM")
    data = load_classification(args.task)
    name = args.task if args.task in TASKS else "local"
    batch = args.batch_size if args.batch_size is not None else BATCH.get(name, 16)
    _validate.positive_int("--batch-size", batch)
    epochs = args.epochs if args.epochs is not None else EPOCHS.get(name, 5)
    if not (isinstance(epochs, (int, float)) and 0 < epochs < math.inf):  # NaN fails too
        raise UsageError(f"--epochs={epochs!r} is not allowed; expected a finite number > 0")
    per_epoch = math.ceil(len(data.labels["train"]) / batch)
    steps = args.steps if args.steps is not None else max(1, round(epochs * per_epoch))
    _validate.positive_int("--steps", steps)
    model = LMClassifier(lm, data.num_classes)
    frozen = freeze_routers(model)
    config = TrainConfig(
        steps=steps,
        batch_size=batch,
        lr=args.lr,
        schedule="constant",
        warmup=0,
        eval_every=args.eval_every or min(per_epoch, steps),
        seed=args.seed,
        weight_decay=args.weight_decay,
        optimizer=args.optimizer,
    )
    run_dir = RunDir(args.out, resume=args.resume, force=args.force)
    run_dir.write_config(
        {
            "task": "finetune",
            "data": args.task,
            "from": str(args.source),
            "num_classes": data.num_classes,
            "labels": data.label_names,
            "frozen_router_params": frozen,
            "method": lm_config.method,
            "train": vars(config),
        }
    )
    task = ClassificationTask(data, tokenizer, lm.cfg.block_size)
    trainer = Trainer(
        model,
        task,
        config,
        run_dir,
        ctx=RoutingContext(total_steps=steps),  # no schedule: the routers are frozen, nothing competes
        progress=not args.no_progress,
        extra_metrics={"method": lm_config.method, "task": name, "num_classes": data.num_classes},
    )
    try:
        metrics = trainer.fit(resume=args.resume)
    except TrainingError as exc:
        print(f"moelab finetune: {exc}")
        return 1
    print(
        f"{metrics['method']} fine-tuned on {data.name}: test accuracy {metrics['test_acc']:.1f}% "
        f"(val {metrics['val_acc']:.1f}%, {data.num_classes} classes) -> {args.out}"
    )
    return 0
