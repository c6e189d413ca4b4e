"""``moelab train --task lm``: a Switch / GLaM decoder LM with any MoE method (CompeteSMoE (2024) §6.1-6.2,
Table 2; perturbed cosine router (2024) §5.2, Table 2).

One run writes into ``--out``: ``config.yaml`` (everything needed to re-run, ``--resume`` reads it
back), ``log.csv`` (one row per step; validation columns on evaluation steps), ``metrics.json``
(:data:`METRIC_KEYS`), ``best/`` (the best-validation weights, used for the test as
CompeteSMoE (2024) does) and ``ckpt/`` (atomic checkpoints).

Example::

    moelab train --task lm --data default --size cpu --method smoe --steps 300 --out runs/smoe
    moelab train --task lm --data enwik8 --size small --arch glam --method xmoe --out runs/x
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from .. import _validate
from ..data.text import TextData, load_text
from ..io.rundir import RUN_ENTRIES, RunDir, atomic_write_text
from ..methods import get_method
from ..models.lm import ARCHS, PRESETS, TransformerLM, count_parameters, lm_config
from ..optim import OPTIMIZERS
from ..schedules import LR_SCHEDULES, build_competition_schedule, split_schedule_options
from ..train.parallel import process_group
from ..train.trainer import TrainConfig, Trainer, TrainingError
from .args import format_value, parse_key_values

__all__ = [
    "METRIC_KEYS",
    "SIZE_DEFAULTS",
    "LMTask",
    "RunConfig",
    "add_arguments",
    "build_config",
    "run",
    "train_lm",
]

#: keys of metrics.json (``<m>`` is ``bpc`` for character/byte corpora, ``ppl`` for word level)
METRIC_KEYS = (
    "train_loss",
    "val_<m>",
    "test_<m>",
    "test_loss",
    "best_step",
    "steps",
    "tokens_per_s",
    "train_time_s",
    "params",
    "active_params",
    "world_size",
    "seed",
    "method",
    "arch",
    "size",
    "data",
)

#: training defaults per preset: CompeteSMoE (2024) App. C.2 (Adam 7e-4, batch 48, sequence 512, 60k / 80k
#: steps) for the paper sizes, and a CPU setting (a few hundred steps in well under a minute on an idle core)
_PAPER = dict(
    lr=7e-4,
    schedule="inverse_sqrt",
    warmup=None,
    batch_size=48,
    eval_every=1000,
    eval_tokens=500_000,
    ckpt_every=1000,
)
SIZE_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {**_PAPER, "steps": 60000},
    "small": {**_PAPER, "steps": 60000},
    "medium": {**_PAPER, "steps": 80000},
    "wt103-small": {**_PAPER, "steps": 60000},
    # cpu: the paper's schedule, but a larger step and warm-up for a run this short (our choice:
    # 300 steps with lr 2e-3 / warm-up 30 reach a clearly lower BPC than 7e-4 / 15)
    "cpu": dict(
        lr=2e-3,
        schedule="inverse_sqrt",
        warmup=30,
        steps=300,
        batch_size=16,
        eval_every=50,
        eval_tokens=16384,
        ckpt_every=100,
    ),
    # demo: the main job, 15 runs in 75-100 s on 2 cores (our choice, docs/performance.md): 400
    # steps of 32 × 32 bytes at a constant 2e-3 after an 80-step warm-up; the 1/√t decay halves the
    # step size while the model is still learning fast and ends ~0.1-0.2 BPC higher at this budget
    "demo": dict(
        lr=2e-3,
        schedule="constant",
        warmup=80,
        steps=400,
        batch_size=32,
        eval_every=100,
        eval_tokens=16384,
        ckpt_every=200,
    ),
    # mini: the cpu setting for runs of thousands of steps (docs/results.md's decisive comparison)
    "mini": dict(
        lr=2e-3,
        schedule="inverse_sqrt",
        warmup=100,
        steps=4000,
        batch_size=16,
        eval_every=250,
        eval_tokens=65536,
        ckpt_every=500,
    ),
}


class LMTask:
    """Next-token prediction on a :class:`moelab.data.text.TextData`.

    Training batches are ``batch_size`` windows of ``block_size + 1`` tokens at uniformly random
    offsets of the training split (the data-order generator is part of the checkpoint).
    Evaluation runs over consecutive non-overlapping blocks from the start of the split (at most
    ``max_tokens`` predicted tokens), each block with no context from the previous one, and
    reports the mean token loss, ``bpc = loss / ln 2`` or ``ppl = exp(loss)``
    (shared/REFERENCES.md).  ``eval_batch`` blocks go through the model at once (default: 16, or
    for short blocks as many as make 4,096 tokens while their logits stay within 2**22 numbers: a
    forward of a few hundred tokens is mostly overhead); the figures do not depend on it.
    """

    def __init__(self, data: TextData, block_size: int, eval_batch: int | None = None) -> None:
        _validate.positive_int("block_size", block_size)
        if eval_batch is None:
            eval_batch = max(16, min(4096 // block_size, (1 << 22) // (block_size * data.vocab_size)))
        _validate.positive_int("eval_batch", eval_batch)
        data.check_block(block_size)
        self.data = data
        self.block_size = block_size
        self.eval_batch = eval_batch
        self.metric = data.metric
        self.lower_is_better = True

    def sample(self, generator: torch.Generator, batch_size: int) -> tuple[Tensor, Tensor]:
        train, L = self.data.train, self.block_size
        ix = torch.randint(train.numel() - L, (batch_size,), generator=generator)
        windows = torch.stack([train[i : i + L + 1] for i in ix.tolist()])  # (B, L+1)
        return windows[:, :-1], windows[:, 1:]

    @staticmethod
    def shard(batch: tuple[Tensor, Tensor], rank: int, world: int) -> tuple[Tensor, Tensor]:
        x, y = batch
        return x[rank::world], y[rank::world]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        x, y = batch
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        logits = model(x)  # (B, L, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), y.numel()

    def evaluate(self, model: nn.Module, split: str, max_tokens: int | None) -> dict[str, float]:
        tokens = self.data.split(split)
        n = tokens.numel() - 1  # predicted tokens
        if max_tokens is not None:
            n = min(n, max_tokens)
        L = self.block_size
        device = next(model.parameters()).device
        total, count = 0.0, 0
        full = n // L
        inputs, targets = tokens[: full * L].view(full, L), tokens[1 : full * L + 1].view(full, L)
        for i in range(0, full, self.eval_batch):
            x, y = inputs[i : i + self.eval_batch].to(device), targets[i : i + self.eval_batch].to(device)
            logits = model(x)
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
        if n % L:  # the remainder as one shorter sequence
            x, y = (
                tokens[full * L : n].view(1, -1).to(device),
                tokens[full * L + 1 : n + 1].view(1, -1).to(device),
            )
            logits = model(x)
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
        loss = total / count
        value = loss / math.log(2) if self.metric == "bpc" else math.exp(min(loss, 700.0))
        return {"loss": loss, self.metric: value}


# ------------------------------------------------------------------------------ config
@dataclass
class RunConfig:
    """Everything a ``moelab train`` run needs, as written to its ``config.yaml`` and accepted back
    by ``--config``.

    The inputs: ``task``, ``data``, ``level``, ``size``, ``arch``, ``method``, ``opts`` (method
    options), ``model`` (the :func:`moelab.models.lm.lm_config` fields: the size preset with the
    flag overrides) and ``train`` (:class:`moelab.train.TrainConfig`).  What the run measured
    when it began (``vocab_size``, ``metric``, ``data_info``, ``params``, ``active_params``) is
    recorded beside them and ignored as input.
    """

    data: str
    level: str
    size: str
    arch: str
    method: str
    opts: dict[str, Any]
    model: dict[str, Any]
    train: TrainConfig
    task: str = "lm"
    vocab_size: int | None = None
    metric: str | None = None
    data_info: dict[str, Any] | None = None
    params: int | None = None
    active_params: int | None = None

    #: the keys of a run's config.yaml that are inputs (the rest the run recorded)
    INPUTS: ClassVar[tuple[str, ...]] = (
        "task",
        "data",
        "level",
        "size",
        "arch",
        "method",
        "opts",
        "model",
        "train",
    )

    def to_dict(self) -> dict[str, Any]:
        """The YAML-ready mapping (``train`` as a mapping; unset recorded fields left out)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["train"] = asdict(self.train)
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        """A run's ``config.yaml`` mapping back; a missing or unknown key is a one-line error
        naming ``source``."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of run settings, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(map(str, data)) - set(names))
        missing = [k for k in cls.INPUTS if k not in data and k != "task"]
        if unknown or missing:
            raise ValueError(
                f"{source}: "
                + (f"unknown keys {unknown}" if unknown else f"missing keys {missing}")
                + f"; a run config holds {names}"
            )
        train = data["train"]
        if (
            not isinstance(train, dict)
            or not isinstance(data["model"], dict)
            or not isinstance(data["opts"], dict)
        ):
            raise ValueError(f"{source}: train, model and opts must be mappings")
        known = {f.name for f in fields(TrainConfig)}
        if set(train) - known:
            raise ValueError(
                f"{source}: unknown train keys {sorted(set(train) - known)}; allowed: {sorted(known)}"
            )
        try:
            return cls(**{**data, "train": TrainConfig(**train)})
        except (TypeError, ValueError) as exc:  # a value of the wrong type or range: name the file
            raise ValueError(f"{source}: {exc}") from None


def parse_opts(items: list[str] | None) -> dict[str, Any]:
    """``--opt`` items ``["key=value", ...]`` → dict, by the one ``KEY=VALUE`` rule of
    :mod:`moelab.experiments.args` (``0.1`` → float, ``true`` → bool, ``none`` → None)."""
    return parse_key_values(items, "--opt")


def build_config(args: argparse.Namespace) -> RunConfig:
    """The run's full configuration (what ``config.yaml`` holds) from parsed CLI arguments."""
    _validate.one_of("--size", args.size, list(PRESETS))
    _validate.one_of("--arch", args.arch, list(ARCHS))
    if args.arch != "dense":
        get_method(args.method)  # a clear error for an unknown method
    defaults = SIZE_DEFAULTS[args.size]
    pick = lambda name: defaults[name] if getattr(args, name, None) is None else getattr(args, name)
    for name in ("steps", "batch_size", "eval_every"):
        value = pick(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"--{name.replace('_', '-')}={value!r} is not allowed; expected a positive integer"
            )
    model = {**PRESETS[args.size]}
    for name in ("d_model", "n_layer", "n_head", "d_hidden"):  # named by their flags here
        if getattr(args, name, None) is not None:
            _validate.positive_int(_flag(name), getattr(args, name))
    for name in _MODEL_FLAGS:
        if getattr(args, name, None) is not None:
            model[name] = getattr(args, name)
    lm_config(args.size, 1, **model, arch=args.arch)  # the model flags fail here, before any data is read
    train = TrainConfig(
        steps=pick("steps"),
        batch_size=pick("batch_size"),
        lr=pick("lr"),
        schedule=pick("schedule"),
        warmup=pick("warmup"),
        grad_clip=args.grad_clip,
        eval_every=pick("eval_every"),
        eval_tokens=pick("eval_tokens"),
        test_tokens=getattr(args, "test_tokens", None),
        ckpt_every=pick("ckpt_every"),
        seed=args.seed,
        weight_decay=args.weight_decay,
        optimizer=args.optimizer,
    )
    return RunConfig(
        data=args.data,
        level=args.level,
        size=args.size,
        arch=args.arch,
        method="dense" if args.arch == "dense" else args.method,
        opts=parse_opts(args.opt),
        model=model,
        train=train,
    )


def build_model(config: RunConfig, vocab_size: int) -> TransformerLM:
    method = config.method if config.arch != "dense" else "smoe"
    cfg = lm_config(
        config.size,
        vocab_size,
        **{
            **config.model,
            "arch": config.arch,
            "method": method,
            "method_options": split_schedule_options(dict(config.opts))[0],
        },
    )
    return TransformerLM(cfg)


def _changed_input(new: RunConfig, old: RunConfig) -> tuple[str, Any, Any] | None:
    """The first input of ``new`` that differs from ``old``, as ``(flag, new value, old value)``."""
    for name in RunConfig.INPUTS:
        a, b = getattr(new, name), getattr(old, name)
        if name == "train":
            a, b = asdict(a), asdict(b)
        if name in ("train", "model"):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    return _flag(key), a.get(key), b.get(key)
        elif a != b:
            return f"--{name}", a, b
    return None


def _check_same_data(stored: RunConfig, data: TextData, out: Any) -> None:
    """Refuse to resume on data whose sha256 differs from the one the run recorded."""
    old = (stored.data_info or {}).get("sha256")
    new = (data.info or {}).get("sha256")
    if old is not None and new is not None and old != new:
        raise ValueError(
            f"--resume: --data {stored.data!r} has sha256 {new[:12]}…, but the run in {out} was trained on "
            f"{old[:12]}…; the run cannot continue on other data (--allow-changes to continue anyway)"
        )


def train_lm(
    config: RunConfig,
    out: str | Path | None,
    *,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    data: TextData | None = None,
    expert_parallel: bool = False,
    allow_changes: bool = False,
) -> dict[str, Any]:
    """Train one LM run described by ``config`` (:func:`build_config`) into ``out``
    (``expert_parallel``: under torchrun, spread each MoE layer's experts over the ranks).

    ``resume`` continues the run in ``out`` only if ``config``'s inputs and the data's sha256 are
    those recorded in its ``config.yaml``; a difference is refused in one line naming it, unless
    ``allow_changes``, which continues with ``config`` and records it."""
    rank, world = process_group()
    run = stored = None
    # rank 0 first: it refuses (or clears, with force) an existing run and downloads the data once;
    # the other ranks then read the same folder and the cached data.  Only rank 0 writes.
    for turn in (0, 1) if world > 1 else (0,):
        if (rank == 0) == (turn == 0):
            run = (
                RunDir(out, resume=resume or rank > 0, force=force and rank == 0, lock=rank == 0)
                if out is not None
                else None
            )
            if run is not None and resume and run.file("config.yaml").exists():
                stored = RunConfig.from_dict(run.read_config(), str(run.file("config.yaml")))
                changed = _changed_input(config, stored)
                if changed is not None and not allow_changes:
                    flag, new, old = changed
                    raise ValueError(
                        f"--resume: {flag}={new!r} differs from {old!r} recorded in {run.file('config.yaml')}; "
                        "the run cannot continue with other settings (pass --allow-changes to continue it "
                        "with the new ones, or --force to start afresh)"
                    )
                if changed is None:
                    config = replace(stored)  # the stored configuration: the same curve
            if data is None:
                data = load_text(config.data, level=config.level)
            if stored is not None and not allow_changes:
                _check_same_data(stored, data, out)
        if world > 1 and turn == 0:
            torch.distributed.barrier()
    torch.manual_seed(config.train.seed)  # the initial weights depend on the seed only
    model = build_model(config, data.vocab_size)
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        model = model.to(torch.device("cuda", torch.cuda.current_device()))  # torchrun on GPUs
    task = LMTask(data, model.cfg.block_size)
    total, active = count_parameters(model)
    config = replace(
        config,
        vocab_size=data.vocab_size,
        metric=data.metric,
        data_info=data.info,
        params=total,
        active_params=active,
    )
    if run is not None and rank == 0 and (stored is None or allow_changes):
        # the tokenizer (so that `moelab finetune` encodes text as the LM was trained) before
        # config.yaml, the file that makes the folder a run: a run with a config always has its
        # tokenizer, and a kill between the two leaves a folder that --resume (or --force) starts
        atomic_write_text(run.file("tokenizer.json"), json.dumps(data.tokenizer.state()))
        run.write_config(config.to_dict())
    trainer = Trainer(
        model,
        task,
        config.train,
        run,
        method=None if config.arch == "dense" else config.method,
        method_options=config.opts,
        progress=progress,
        extra_metrics={
            "method": config.method,
            "arch": config.arch,
            "size": config.size,
            "data": config.data,
        },
        expert_parallel=expert_parallel,
    )
    try:
        return trainer.fit(resume=resume)
    finally:
        if run is not None:
            run.close()


# ------------------------------------------------------------------------------ CLI
def add_lm_arguments(p: argparse.ArgumentParser) -> None:
    """The LM flags (shared by ``train`` and ``compare``)."""
    p.add_argument(
        "--data",
        default="default",
        help="enwik8, text8, wikitext103, default or stdlib (offline: Python's own sources) or a text file",
    )
    p.add_argument("--level", default="byte", choices=["byte", "word"], help="tokens of a local --data file")
    p.add_argument("--arch", default="switch", help=f"one of {', '.join(ARCHS)}")
    p.add_argument("--size", default="cpu", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--steps", type=int, help="optimisation steps (preset default)")
    p.add_argument("--batch-size", type=int, dest="batch_size", help="sequences per step (preset default)")
    p.add_argument("--block-size", type=int, dest="block_size", help="context length (preset default)")
    p.add_argument("--d-model", type=int, dest="d_model", help="model width (preset default)")
    p.add_argument("--layers", type=int, dest="n_layer", help="Transformer blocks (preset default)")
    p.add_argument("--heads", type=int, dest="n_head", help="attention heads (preset default)")
    p.add_argument(
        "--d-hidden",
        type=int,
        dest="d_hidden",
        help="expert hidden width (default: --d-model, as CompeteSMoE (2024))",
    )
    p.add_argument("--num-experts", type=int, dest="num_experts", help="experts per MoE layer (16)")
    p.add_argument("--top-k", type=int, dest="top_k", help="experts per token (2)")
    p.add_argument("--dropout", type=float, help="dropout (preset default)")
    p.add_argument(
        "--lr",
        type=float,
        help="learning rate (preset default: 7e-4 as CompeteSMoE (2024); cpu, demo and mini 2e-3)",
    )
    p.add_argument(
        "--schedule",
        choices=list(LR_SCHEDULES),
        help="LR schedule (preset default: inverse_sqrt as CompeteSMoE (2024); demo constant)",
    )
    p.add_argument(
        "--warmup", type=int, help="warm-up steps (preset default: 5%% of --steps for the paper sizes)"
    )
    p.add_argument(
        "--grad-clip", type=float, default=1.0, dest="grad_clip", help="max gradient norm (0: off)"
    )
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
    p.add_argument("--eval-every", type=int, dest="eval_every", help="validate every N steps")
    p.add_argument("--eval-tokens", type=int, dest="eval_tokens", help="validation tokens per evaluation")
    p.add_argument("--test-tokens", type=int, dest="test_tokens", help="cap on test tokens (default: all)")
    p.add_argument("--ckpt-every", type=int, dest="ckpt_every", help="checkpoint every N steps")
    p.add_argument(
        "--opt",
        action="append",
        metavar="KEY=VALUE",
        help="a method option, repeatable, e.g. balance_coef=0 (VALUE: true/false, none, a number or text)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: 1 for --size cpu, demo and mini, else torch's choice)",
    )
    p.add_argument("--no-progress", action="store_true", dest="no_progress", help="no progress bar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task",
        default="lm",
        choices=["lm", "image"],
        help="lm, the only train task (image models: use `moelab specialize`)",
    )
    p.add_argument("--config", help="YAML file of flag defaults (configs/lm/*.yaml)")
    p.add_argument("--method", default="smoe", help="MoE method (moelab.methods())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--force", action="store_true", help="start afresh: empty the run in --out first")
    p.add_argument(
        "--allow-changes",
        action="store_true",
        dest="allow_changes",
        help="with --resume: continue even though flags or the data differ from the run's config.yaml",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        dest="expert_parallel",
        help="under torchrun: each rank holds num_experts / world_size experts (docs/scaling.md)",
    )
    add_lm_arguments(p)


def apply_config_file(
    args: argparse.Namespace, parser_defaults: dict[str, Any], path: str | None = None, flag: str = "--config"
) -> None:
    """Fill flags left at their defaults from a YAML file (``--config``, or with ``path`` a run's
    own ``config.yaml``): keys are flag names (``-`` or ``_``), or a run's configuration."""
    path = str(args.config if path is None else path)
    source = f"{flag} {path!r}"
    if not Path(path).is_file():
        raise FileNotFoundError(f"{source} does not exist")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ValueError(f"{source} is not UTF-8 text (a damaged or binary file)") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{source} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a mapping of flag names to values")
    if isinstance(data.get("train"), dict):  # a run's own config.yaml
        data = _flags_of(RunConfig.from_dict(data, source), path)
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in parser_defaults:
            raise ValueError(f"{source}: unknown key {key!r}; allowed: {sorted(parser_defaults)}")
        if getattr(args, name) == parser_defaults[name]:
            setattr(args, name, _config_value(path, key, value))


#: the model fields a flag sets (the others come from the --size preset)
_MODEL_FLAGS = ("block_size", "dropout", "num_experts", "top_k", "d_model", "n_layer", "n_head", "d_hidden")
#: the flag of a model or training field whose flag is not ``--field-name``
_FLAG_NAMES = {"n_layer": "--layers", "n_head": "--heads"}


def _flag(field_name: str) -> str:
    return _FLAG_NAMES.get(field_name, f"--{field_name.replace('_', '-')}")


def _flags_of(config: RunConfig, path: str) -> dict[str, Any]:
    """The flag values that rebuild ``config`` (a run's ``config.yaml``) with :func:`build_config`."""
    preset = PRESETS.get(config.size)
    if preset is None:
        raise ValueError(
            f"--config {path!r}: size={config.size!r} is not allowed; expected one of {list(PRESETS)}"
        )
    fixed = {k: v for k, v in config.model.items() if k not in _MODEL_FLAGS}
    if fixed != {k: v for k, v in preset.items() if k not in _MODEL_FLAGS}:
        raise ValueError(
            f"--config {path!r}: model {fixed} differs from the {config.size!r} preset in fields no flag sets"
        )
    train = asdict(config.train)
    flags = {name: train[name] for name in _TRAIN_FLAGS}
    flags.update({name: config.model[name] for name in _MODEL_FLAGS if name in config.model})
    flags.update(
        task=config.task,
        data=config.data,
        level=config.level,
        size=config.size,
        arch=config.arch,
        opt=[f"{k}={format_value(v)}" for k, v in config.opts.items()] or None,
    )
    if config.arch != "dense":
        flags["method"] = config.method
    return flags


#: the TrainConfig fields a flag sets
_TRAIN_FLAGS = (
    "steps", "batch_size", "lr", "schedule", "warmup", "grad_clip", "eval_every", "eval_tokens",
    "test_tokens", "ckpt_every", "seed", "weight_decay", "optimizer",
)  # fmt: skip


def _config_value(path: str, key: object, value: Any) -> Any:
    """``value`` of ``--config`` key ``key`` checked (and converted) as its flag would be."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    action = next(a for a in p._actions if a.dest == str(key).replace("-", "_"))
    problem = f"--config {path!r}: {key}={value!r} is not allowed; expected "
    if value is None:
        if action.default is None:
            return None
        raise ValueError(problem + f"a value (the default is {action.default!r})")
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(problem + "true or false")
        return value
    if isinstance(action, argparse._AppendAction):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ValueError(problem + "a list of strings")
        return items
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(problem + "an integer")
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(problem + "a number")
        value = float(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # e.g. out: 2024
    elif not isinstance(value, str):
        raise ValueError(problem + "a string")
    if action.choices is not None and value not in action.choices:
        raise ValueError(problem + f"one of {list(action.choices)}")
    return value


def _defaults() -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return {a.dest: a.default for a in p._actions if a.dest != "help"}


def set_threads(args: argparse.Namespace) -> None:
    """``--threads``; the CPU presets (``cpu``, ``demo``, ``mini``) default to one thread: their small
    matrices are overhead-bound, and on a busy machine extra OpenMP threads spin and slow them down
    many times (docs/performance-lm.md)."""
    if args.threads is not None:
        torch.set_num_threads(_validate.positive_int("--threads", args.threads))
    elif args.size in ("cpu", "demo", "mini"):
        torch.set_num_threads(1)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    if args.config:
        apply_config_file(args, _defaults())
    if args.task == "image":
        raise UsageError(
            "--task image is not a train task; run the expert-specialization lab with "
            "`moelab specialize` (see `moelab specialize --help`)"
        )
    if not args.out:
        raise UsageError("--out is required (the run directory)")
    stored = Path(args.out, "config.yaml")
    if args.resume and not args.force and stored.is_file():
        # the flags not given are the run's own; a given one that differs is refused by train_lm
        apply_config_file(args, _defaults(), stored, flag="--resume: the run's")
    set_threads(args)
    config = build_config(args)
    from ..train.distributed import init_from_env

    started = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    rank, world = init_from_env()  # under torchrun: one process of a data-parallel group
    started = started and torch.distributed.is_initialized()
    try:
        return _train_and_report(args, config, rank, world)
    finally:
        if started:
            torch.distributed.destroy_process_group()


def _train_and_report(args: argparse.Namespace, config: RunConfig, rank: int, world: int) -> int:
    batch = config.train.batch_size
    if batch % world:
        raise ValueError(
            f"--batch-size={batch} is not allowed with {world} processes (torchrun --nproc_per_node x "
            f"--nnodes); the global batch is split evenly over the ranks: use a multiple of {world}"
        )
    if getattr(args, "expert_parallel", False) and config.arch != "dense":
        experts = lm_config(config.size, 2, **config.model).num_experts
        if experts % world:  # before anything is written (the plan itself checks it again)
            raise ValueError(
                f"--expert-parallel: world size {world} does not divide num_experts={experts}; "
                f"allowed world sizes: {[w for w in range(1, experts + 1) if experts % w == 0]}"
            )
    if args.resume and not any(Path(args.out, name).exists() for name in RUN_ENTRIES):
        if rank == 0:
            print(f"--resume: {args.out} holds no run yet; starting one")
        args.resume = False
    try:
        metrics = train_lm(
            config,
            args.out,
            resume=args.resume,
            force=args.force,
            progress=not args.no_progress,
            expert_parallel=bool(getattr(args, "expert_parallel", False)),
            allow_changes=args.allow_changes,
        )
    except TrainingError as exc:
        print(f"moelab train: {exc}")
        return 1
    if rank > 0:
        return 0
    m = metrics.get("test_bpc", metrics.get("test_ppl"))
    key = "test_bpc" if "test_bpc" in metrics else "test_ppl"
    print(
        f"{metrics['method']}: {key} {m:.4f} (best val at step {metrics['best_step']}), "
        f"{metrics['tokens_per_s']:.0f} tokens/s, {metrics['params']:,} params "
        f"({metrics['active_params']:,} active) -> {args.out}"
    )
    return 0


# ------------------------------------------------------------------------------ benchmark
def benchmark_throughput(
    size: str = "cpu", methods: tuple[str, ...] = ("smoe", "competesmoe"), rounds: int = 5, steps: int = 20
) -> list[tuple[str, float]]:
    """Training tokens/s (forward + backward + Adam step) of ``size`` with each method and with the
    dense FFN of equal active width (``arch="dense"``); the median over ``rounds`` rounds of
    ``steps`` steps, the models interleaved round by round so that load drift hits them alike."""
    import statistics
    import time

    from ..layer import attach, aux_loss
    from ..methods import methods as registered
    from ..routing import RoutingContext

    names = [m for m in methods if m in registered()] + ["dense"]
    cfg = lm_config(size, 256)
    B = SIZE_DEFAULTS.get(size, {}).get("batch_size", 16)
    x = torch.randint(256, (B, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name in names:
        torch.manual_seed(0)
        arch, method = ("dense", "smoe") if name == "dense" else ("switch", name)
        model = TransformerLM(lm_config(size, 256, arch=arch, method=method))
        total = (rounds + 1) * steps
        ctx = RoutingContext(total_steps=total)
        attach(model, ctx)
        if arch != "dense":  # CompeteSMoE's schedule, as in training (~ω of the steps compete)
            ctx.schedule = build_competition_schedule(model, method, total, 0)
        runs[name] = (model, ctx, torch.optim.Adam(model.parameters(), lr=7e-4))

    def step(model, ctx, opt):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)) + aux_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ctx.advance()

    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in names:
            t0 = time.perf_counter()
            for _ in range(steps):
                step(*runs[name])
            if r > 0:  # round 0 warms up
                times[name].append(B * cfg.block_size * steps / (time.perf_counter() - t0))
    return [(n, statistics.median(times[n])) for n in names]


if __name__ == "__main__":  # python -m moelab.experiments.lm [size] [threads]
    import sys

    size = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    results = benchmark_throughput(size)
    dense = dict(results)["dense"]
    print(
        f"{size} preset, batch {SIZE_DEFAULTS[size]['batch_size']} x block {PRESETS[size]['block_size']}, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}"
    )
    for name, tps in results:
        print(f"{name:<14} {tps:>10.0f} tokens/s   ratio to dense {tps / dense:.2f}")
