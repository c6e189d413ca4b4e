"""``moelab train``: a Switch / GLaM decoder LM with any MoE method (CompeteSMoE (2024) §6.1-6.2,
Table 2; perturbed cosine router (2024) §5.2, Table 2), declared as :class:`TrainRun` and run
through the lifecycle of :mod:`moelab.experiments.runner` into ``--out``: ``config.yaml``,
``log.csv``, ``metrics.json`` (:data:`METRIC_KEYS`), ``best/`` (the best-validation weights, used
for the test as CompeteSMoE (2024) does) and ``ckpt/``.  docs/reproduce-lm-notes.md says what each
file holds; docs/cli.md has example commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .. import config as vocab
from ..config import MAX_COUNT, Interval, Options, setting
from ..data.text import TextData, load_text
from ..errors import UsageError
from ..io.rundir import atomic_write_text
from ..layer import count_parameters
from ..methods import get_method
from ..models.lm import (
    ARCHS,
    ATTENTION_ACTIVATIONS,
    ATTENTIONS,
    PRESETS,
    TRAINING,
    TransformerLM,
    lm_config,
)
from ..optim import OPTIMIZERS, check_optimizer
from ..schedules import LR_SCHEDULES, split_schedule_options
from ..train.live import LIVE_LOGS
from ..train.parallel import Parallel, choose
from ..train.tasks import LMTask
from ..train.trainer import TrainConfig, Trainer, TrainingError
from . import runner

__all__ = [
    "METRIC_KEYS",
    "TRAIN",
    "LMTask",
    "TrainRun",
    "add_arguments",
    "build_model",
    "check_finished",
    "resolve",
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

_POSITIVE = (Interval(int, 1), None)
#: a count of steps, epochs or runs: more than MAX_COUNT cannot finish
_STEPS = (Interval(int, 1, MAX_COUNT), None)
#: float32's largest number: Adam casts its step size to the parameters' dtype
_MAX_LR = float(torch.finfo(torch.float32).max)


@dataclass
class TrainRun:
    """The settings of a ``moelab train`` run, as its ``config.yaml`` holds them.

    A model or training field left ``None`` takes the value of the ``size`` preset
    (:data:`moelab.models.lm.PRESETS`, :data:`moelab.models.lm.TRAINING`); the run records the
    value decided, so a later change of a preset cannot change a resumed run.
    """

    task: str = setting(
        "lm",
        help="lm, the only train task (image models: use `moelab specialize`)",
        allowed=Options(("lm", "image")),
    )
    data: str = setting(
        "default",
        help="enwik8, text8, wikitext103, default or stdlib (offline: Python's own sources) or a text file",
        fingerprint="data_sha256",
    )
    level: str = setting("byte", help="tokens of a local --data file", allowed=Options(("byte", "word")))
    arch: str = setting("switch", help="model architecture", allowed=Options(ARCHS))
    size: str = setting("cpu", help="model and training preset", allowed=Options(tuple(PRESETS)))
    method: str = setting("smoe", help="MoE method (moelab.methods())")
    seed: int = setting(
        0, help="seed of the weights, the data order and the schedules", allowed=Interval(int, 0, 2**63 - 1)
    )
    # the model (None: the size preset's)
    block_size: int | None = setting(None, help="context length (preset default)", allowed=_POSITIVE)
    d_model: int | None = setting(None, help="model width (preset default)", allowed=_POSITIVE)
    n_layer: int | None = setting(
        None, flag="--layers", help="Transformer blocks (preset default)", allowed=_POSITIVE
    )
    n_head: int | None = setting(
        None, flag="--heads", help="attention heads (preset default)", allowed=_POSITIVE
    )
    d_hidden: int | None = setting(
        None, help="expert hidden width (default: --d-model, as CompeteSMoE (2024))", allowed=_POSITIVE
    )
    num_experts: int | None = setting(None, help="experts per MoE layer (16)", allowed=_POSITIVE)
    top_k: int | None = setting(None, help="experts per token (2)", allowed=_POSITIVE)
    dropout: float | None = setting(
        None, help="dropout (preset default)", allowed=(Interval(float, 0, 1, closed="left"), None)
    )
    attention: str = setting(
        "standard",
        help="standard, or active: Active-Attention of Ho (2025), softmax(QK^T/sqrt(d)) act(V)",
        allowed=Options(ATTENTIONS),
    )
    attention_activation: str | None = setting(
        None,
        help="the act of --attention active (default gelu)",
        allowed=(Options(tuple(ATTENTION_ACTIVATIONS)), None),
    )
    # the training (None: the size preset's)
    steps: int | None = setting(None, help="optimisation steps (preset default)", allowed=_STEPS)
    batch_size: int | None = setting(None, help="sequences per step (preset default)", allowed=_POSITIVE)
    lr: float | None = setting(
        None,
        help="Adam learning rate (preset default: 7e-4 as CompeteSMoE (2024); cpu, demo and mini 2e-3)",
        allowed=(Interval(float, 0, closed="neither"), None),
    )
    schedule: str | None = setting(
        None,
        help="LR schedule (preset default: inverse_sqrt as CompeteSMoE (2024); demo constant)",
        allowed=(Options(tuple(LR_SCHEDULES)), None),
    )
    warmup: int | None = setting(
        None,
        help="warm-up steps (preset default: 5% of --steps for the paper sizes)",
        allowed=(Interval(int, 0, 1 << 40), None),
    )
    optimizer: str = setting(
        "adamw",
        help="adamw (decoupled weight decay on matrices only) or adam (no weight decay)",
        allowed=Options(OPTIMIZERS),
    )
    weight_decay: float = setting(
        0.0, help="AdamW weight decay of the matrices (0 as CompeteSMoE (2024))", allowed=Interval(float, 0)
    )
    grad_clip: float = setting(1.0, help="max gradient norm (0: off)", allowed=Interval(float, 0))
    eval_every: int | None = setting(None, help="validate every N steps", allowed=_POSITIVE)
    eval_tokens: int | None = setting(None, help="validation tokens per evaluation", allowed=_POSITIVE)
    test_tokens: int | None = setting(None, help="cap on test tokens (default: all)", allowed=_POSITIVE)
    ckpt_every: int | None = setting(
        None, help="checkpoint every N steps", allowed=(Interval(int, 0, 1 << 40), None)
    )
    keep_ckpts: int | str = setting(
        2,
        input=False,
        metavar="N|all",
        help="checkpoints kept, the newest (all: every one, for the curves over training of moelab diagnose)",
        allowed=(Interval(int, 1), Options(("all",))),
    )
    opts: dict[str, Any] = setting(
        default_factory=dict,
        flag="--opt",
        help="a method option, repeatable, e.g. balance_coef=0 (VALUE: true/false, none, a number or text)",
    )
    # how the run is executed, not what it computes
    threads: int | None = setting(
        None,
        input=False,
        help="torch CPU threads (default: 1 for --size cpu, demo and mini, else torch's choice)",
        allowed=_POSITIVE,
    )
    progress: bool = setting(True, input=False, flag="--no-progress", help="no progress bar")
    autotune: bool = setting(
        False,
        input=False,
        help="before the first step, time impl=auto's candidate kernels on one batch and train with the "
        "fastest of those that round as the rule's (prints its picks; the weights are those of a run "
        "without it; docs/kernels.md)",
    )
    log: str = setting(
        "auto",
        input=False,
        help="the live view beside log.csv: tensorboard (event files in OUT/tensorboard/), csv (log.csv "
        "only), auto (tensorboard when installed)",
        allowed=Options(LIVE_LOGS),
    )
    log_every: int = setting(
        10,
        input=False,
        help="with tensorboard: per-layer load histograms, load image and diagnostics every N steps",
        allowed=Interval(int, 1, 1 << 40),
    )
    expert_parallel: bool = setting(
        False,
        input=False,
        help="under torchrun: each rank holds num_experts / world_size experts (docs/scaling.md)",
    )
    fsdp: bool = setting(
        False,
        input=False,
        help="under torchrun: FSDP2 shards every parameter over the ranks (with --expert-parallel: "
        "the experts over the ranks holding the same ones; docs/scaling.md)",
    )

    def check(self) -> None:
        check_optimizer(self.optimizer, self.weight_decay)
        if self.lr is not None and self.lr > _MAX_LR:
            raise ValueError(
                f"--lr={self.lr!r} is not allowed; expected a number > 0 and <= {_MAX_LR:.3g} (float32's largest)"
            )
        if self.task == "image":
            raise UsageError(
                "--task image is not a train task; run the expert-specialization lab with "
                "`moelab specialize` (see `moelab specialize --help`)"
            )
        if self.arch != "dense":
            get_method(self.method)  # a clear error for an unknown method
        for key, value in self.opts.items():
            if key in _LAYER_FLAGS:
                raise ValueError(
                    f"--opt {key}={value!r} is not allowed; the layer's {key} is set by {_LAYER_FLAGS[key]}"
                )
            if key == "warmup":  # two warm-ups: the learning rate's (a flag) and the competition's
                raise ValueError(
                    f"--opt warmup={value!r} is not allowed; it names two things: the learning-rate warm-up "
                    "is --warmup STEPS, the competition schedule's warm-up fraction --opt competition_warmup=F"
                )
            if key in _RUN_SETTINGS:
                raise ValueError(
                    f"--opt {key}={value!r} is not allowed; {key} is a setting of the run, set by "
                    f"{vocab.flag_of(TrainRun, key)}"
                )

    def model_fields(self) -> dict[str, Any]:
        """The :func:`moelab.models.lm.lm_config` fields the run sets (the rest: the preset's): the
        model flags, the layer arguments ``--top-k``, ``--num-experts`` and ``--d-hidden`` among them
        (what ``compare --sweep top_k=1,2`` varies), and the experts' ``activation``, which has no
        flag of its own and is given as ``--opt activation=...``."""
        fields = {name: getattr(self, name) for name in _MODEL_FIELDS if getattr(self, name) is not None}
        fields.update({key: value for key, value in self.opts.items() if key in _OPT_FIELDS})
        return fields

    def method_options(self) -> dict[str, Any]:
        """The ``--opt`` options passed to every :class:`moelab.MoE` (schedule options excluded)."""
        options = {k: v for k, v in self.opts.items() if k not in _OPT_FIELDS}
        return split_schedule_options(options)[0]

    def train_config(self) -> TrainConfig:
        keep = 0 if self.keep_ckpts == "all" else self.keep_ckpts  # TrainConfig: 0 keeps every one
        return TrainConfig(**{name: getattr(self, name) for name in _TRAIN_FIELDS}, keep_ckpts=keep)


#: the run's own settings (``--steps``, ``--lr``, ...): an ``--opt`` of one of these names is refused
_RUN_SETTINGS = frozenset(
    f.name for f in dataclasses.fields(TrainRun) if f.name not in ("opts", "method", "d_model", "top_k")
)
_MODEL_FIELDS = (
    "block_size", "d_model", "n_layer", "n_head", "d_hidden", "num_experts", "top_k", "dropout",
    "attention", "attention_activation",
)  # fmt: skip
#: arguments of :class:`moelab.MoE` that a flag of its own sets: a value reaches the command line one
#: way, so ``--opt`` refuses them, naming the flag
_LAYER_FLAGS = {
    "d_model": "--d-model",
    "method": "--method",
    "experts": "the expert bank of the LM",
    "top_k": "--top-k",
    "num_experts": "--num-experts",
    "d_hidden": "--d-hidden",
}
#: arguments of :class:`moelab.MoE` without a flag of their own: ``--opt`` gives them to the LM's
#: config, which passes them to every layer (a flag would change what old runs recorded)
_OPT_FIELDS = ("activation",)
_TRAIN_FIELDS = (
    "steps", "batch_size", "lr", "schedule", "warmup", "optimizer", "weight_decay", "grad_clip",
    "eval_every", "eval_tokens", "test_tokens", "ckpt_every", "seed",
)  # fmt: skip


def resolve(config: TrainRun) -> TrainRun:
    """``config`` with the size preset's values where it left ``None``; the model it describes is
    checked before any data is read."""
    preset = {**PRESETS[config.size], **TRAINING[config.size]}
    filled = {
        name: preset[name]
        for name in (*_MODEL_FIELDS, *_TRAIN_FIELDS)
        if getattr(config, name) is None and name in preset and preset[name] is not None
    }
    config = replace(config, **filled, method="dense" if config.arch == "dense" else config.method)
    lm_config(config.size, 1, **config.model_fields(), arch=config.arch)
    ordinary = {name: preset.get(name) for name in _SIZE_FIELDS}
    ordinary.update(num_experts=16, top_k=2, d_hidden=ordinary["d_model"])
    runner.check_memory(config, memory_needed, ordinary, "the model, its training state and a batch")
    return config


#: the settings that decide how much memory a run takes (see :func:`memory_needed`)
_SIZE_FIELDS = ("d_model", "d_hidden", "num_experts", "top_k", "n_layer", "block_size", "batch_size", "steps")


def memory_needed(config: TrainRun, vocab_size: int = 256) -> int:
    """A lower bound of the bytes a run of ``config`` (resolved) holds at once, in float32: the
    weights with their gradients and Adam's two moments (16 bytes a parameter), one batch's
    activations kept for the backward pass, and a competition schedule's per-step table.
    Counted in Python integers: it never allocates, however large the sizes."""
    cfg = lm_config(config.size, vocab_size, **config.model_fields(), arch=config.arch)
    d, n, layers = cfg.d_model, cfg.num_experts, cfg.n_layer
    h = cfg.d_hidden or d
    moe_layers = layers if config.arch != "dense" else 0
    moe_layers = layers // 2 if config.arch == "glam" else moe_layers
    params = (cfg.vocab_size + cfg.block_size) * d + layers * (4 * d * d + 2 * d * h)
    params += moe_layers * ((n - 1) * 2 * d * h + n * d)
    tokens = config.batch_size * cfg.block_size
    activations = tokens * layers * (8 * d + 2 * cfg.top_k * h) + tokens * cfg.vocab_size
    schedule = 0
    if config.arch != "dense" and get_method(config.method).schedule is not None:
        schedule = config.steps * (moe_layers + 17)  # a bool per layer, a count and a draw per step
    return 16 * params + 4 * activations + schedule


def build_model(config: TrainRun, vocab_size: int) -> TransformerLM:
    method = config.method if config.arch != "dense" else "smoe"
    cfg = lm_config(
        config.size,
        vocab_size,
        **{
            **config.model_fields(),
            "arch": config.arch,
            "method": method,
            "method_options": config.method_options(),
        },
    )
    return TransformerLM(cfg)


def set_threads(config: TrainRun) -> None:
    """``--threads``; the CPU presets (``cpu``, ``demo``, ``mini``) default to one thread: their small
    matrices are overhead-bound, and extra OpenMP threads on a busy machine slow them down
    (docs/performance-lm.md)."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    elif config.size in ("cpu", "demo", "mini"):
        torch.set_num_threads(1)


def _prepare(config: TrainRun, world: int) -> None:
    """Before the run directory opens: the batch and the experts must split over the ranks."""
    set_threads(config)
    if config.batch_size % world:
        raise ValueError(
            f"--batch-size={config.batch_size} is not allowed with {world} processes (torchrun "
            f"--nproc_per_node x --nnodes); the global batch is split evenly over the ranks: use a multiple "
            f"of {world}"
        )
    if config.expert_parallel and config.arch != "dense":
        experts = lm_config(config.size, 2, **config.model_fields()).num_experts
        if experts % world:  # the plan itself checks it again
            raise ValueError(
                f"--expert-parallel: world size {world} does not divide num_experts={experts}; "
                f"allowed world sizes: {[w for w in range(1, experts + 1) if experts % w == 0]}"
            )


def _execute(config: TrainRun, run: runner.Run, data: TextData | None = None) -> dict[str, Any]:
    parallel = _layout(config, run.resume)  # first: a layout that cannot run refuses before any file
    if data is None:  # rank 0 fetches a corpus once; the other ranks read its cache
        data = runner.rank_zero_first(lambda: load_text(config.data, level=config.level))
    run.check_fingerprint("--data", config.data, (data.info or {}).get("sha256"))
    torch.manual_seed(config.seed)  # the initial weights depend on the seed only
    model = build_model(config, data.vocab_size)
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        model = model.to(torch.device("cuda", torch.cuda.current_device()))  # torchrun on GPUs
    task = LMTask(data, model.cfg.block_size)
    total, active = count_parameters(model)
    run.record(
        vocab_size=data.vocab_size,
        metric=data.metric,
        data_info=data.info,
        params=total,
        active_params=active,
    )
    if run.writes_config:
        # the tokenizer (so that `moelab finetune` encodes text as the LM was trained) before
        # config.yaml, the file that makes the folder a run: a run with a config always has its
        # tokenizer, and a kill between the two leaves a folder that --resume (or --force) starts
        atomic_write_text(run.dir.file("tokenizer.json"), json.dumps(data.tokenizer.state()))
    run.write_config()
    trainer = Trainer(
        model,
        task,
        config.train_config(),
        run.dir,
        schedule_options=split_schedule_options(dict(config.opts))[1],
        progress=config.progress,
        extra_metrics={
            "method": config.method,
            "arch": config.arch,
            "size": config.size,
            "data": config.data,
        },
        parallel=parallel,
        autotune=config.autotune,
        log=config.log,
        log_every=config.log_every,
    )
    return trainer.fit(resume=run.resume)


def _layout(config: TrainRun, resume: bool) -> Parallel:
    """The parallel layout of this process: ``--expert-parallel`` / ``--fsdp`` under torchrun.
    Resumed on one process (no torchrun), a run recorded with them continues as one process, the
    Python API's way: its checkpoint's shards are gathered here (``moelab.train.checkpoint``), said
    once on stderr; a new run with them on one process is refused in one line naming the flags to
    drop (before anything is written: the retry without them finds no run in ``--out``)."""
    sharded = [
        flag for flag, on in (("--fsdp", config.fsdp), ("--expert-parallel", config.expert_parallel)) if on
    ]
    if sharded and not torch.distributed.is_initialized() and not resume:
        flags = " ".join(sharded)
        raise UsageError(
            f"{flags} {'is' if len(sharded) == 1 else 'are'} not allowed on one process (no torchrun): "
            f"{'it splits' if len(sharded) == 1 else 'they split'} the model over the ranks torchrun launches; "
            f"launch with torchrun --nproc_per_node=N (docs/scaling.md), or drop {flags} to train on one process"
        )
    if resume and sharded and not torch.distributed.is_initialized():
        print(
            f"moelab train: --resume of a {' '.join(sharded)} run on one process (no torchrun): its sharded "
            "checkpoint is gathered here and the run continues on one process (the batch is no longer split "
            "over ranks: per-rank terms such as the balance loss are taken over the whole batch)",
            file=sys.stderr,
        )
        return choose()
    return choose(expert_parallel=config.expert_parallel, fsdp=config.fsdp)


def _command(data: TextData | None = None) -> runner.Command:
    return runner.Command(
        "train",
        TrainRun,
        lambda config, run: _execute(config, run, data),
        resolve=resolve,
        prepare=_prepare,
    )


#: ``moelab train`` as the run lifecycle sees it
TRAIN = _command()


def train_lm(
    config: TrainRun,
    out: str | Path | None,
    *,
    resume: bool = False,
    force: bool = False,
    allow_changes: bool = False,
    data: TextData | None = None,
) -> dict[str, Any]:
    """Train one LM run described by ``config`` into ``out`` through the run lifecycle (every
    field of ``config`` counts as given: ``resume`` of a run made with other settings or other
    data is refused in one line unless ``allow_changes``).  ``data``: the corpus, already loaded."""
    return runner.execute(
        _command(data), config, out=out, resume=resume, force=force, allow_changes=allow_changes
    )


def check_finished(config: TrainRun, out: str | Path, data: TextData, *, allow_changes: bool = False) -> None:
    """Refuse, in the one sentence of ``--resume``, to reuse the finished run in ``out`` unless it
    was made with ``config``'s settings on ``data`` (``allow_changes``: reuse it anyway)."""
    runner.resolve_config(TRAIN, vocab.values(config), out=out, resume=True, allow_changes=allow_changes)
    _, recorded = runner.read_run_config(TrainRun, out, "train")
    old, new = recorded.get("data_sha256"), (data.info or {}).get("sha256")
    if not allow_changes and old and new and old != new:
        raise runner.refuse_other_data("--data", config.data, new, old, out)


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    vocab.add_arguments(p, TrainRun)


def run(args: argparse.Namespace) -> int:
    try:
        metrics = runner.run_command(TRAIN, args)
    except TrainingError as exc:
        print(f"moelab train: {exc}")
        return 1
    if not metrics:  # a rank > 0 of a torchrun job: rank 0 reports
        return 0
    key = "test_bpc" if "test_bpc" in metrics else "test_ppl"
    print(
        f"{metrics['method']}: {key} {metrics[key]:.4f} (best val at step {metrics['best_step']}), "
        f"{metrics['tokens_per_s']:.0f} tokens/s, {metrics['params']:,} params "
        f"({metrics['active_params']:,} active) -> {args.out}"
    )
    return 0
