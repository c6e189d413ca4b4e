"""``moelab prune`` and ``moelab merge-experts``: a trained model with fewer experts per MoE layer
(:mod:`moelab.prune`), scored on calibration tokens, written with :func:`moelab.save` into a run
directory that ``moelab.load``, ``moelab eval`` and ``moelab finetune`` open like the run it came
from; and :func:`evaluate_shrunk`, the test figure of a pruned or merged model the study in
docs/results.md ("Expert pruning and merging") measures.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import config as vocab
from .. import prune as surgery
from ..config import Interval, Options, setting
from ..data.text import load_text
from ..io.atomic import atomic_write_bytes
from ..io.model import load, read_config, save
from ..layer import moe_layers
from . import runner
from .finetune import read_lm_run

__all__ = [
    "MergeConfig",
    "PruneConfig",
    "add_arguments",
    "calibration_batches",
    "load_source",
    "run",
    "shrunk_model",
]

_FRACTION = Interval(float, 0, 1, closed="right")
_POSITIVE = Interval(int, 1)


@dataclass
class PruneConfig:
    """The settings of ``moelab prune``, as its ``config.yaml`` holds them."""

    source: str = setting(
        flag="--from",
        metavar="RUN_OR_HF",
        help="a moelab run or save folder, or a local transformers model folder (converted with from_hf)",
        path=True,
    )
    keep: float = setting(help="fraction of each layer's experts kept, in (0, 1]", allowed=_FRACTION)
    method: str = setting("reap", help="how experts are ranked", allowed=Options(surgery.PRUNE_METHODS))
    calib: str | None = setting(
        None,
        help="calibration tokens: a dataset as --data takes it (enwik8, text8, stdlib, default, a text file) "
        "or a .safetensors token file holding 'tokens' (needed except for --method random)",
    )
    calib_split: str = setting(
        "train", help="the split of --calib drawn from", allowed=Options(("train", "val", "test"))
    )
    calib_tokens: int = setting(65536, help="calibration tokens drawn", allowed=_POSITIVE)
    calib_seed: int = setting(
        0,
        help="seed of the calibration windows (and of --method random)",
        allowed=Interval(int, 0, 2**31 - 1),
    )
    batch_size: int = setting(16, help="calibration windows per forward", allowed=_POSITIVE)
    block_size: int | None = setting(
        None, help="tokens per calibration window (default: the model's context)", allowed=(_POSITIVE, None)
    )


@dataclass
class MergeConfig:
    """The settings of ``moelab merge-experts``, as its ``config.yaml`` holds them."""

    source: str = setting(
        flag="--from",
        metavar="RUN_OR_HF",
        help="a moelab run or save folder, or a local transformers model folder (converted with from_hf)",
        path=True,
    )
    keep: float = setting(
        help="fraction of each layer's experts kept (the groups), in (0, 1]", allowed=_FRACTION
    )
    calib: str = setting(
        help="calibration tokens: a dataset as --data takes it or a .safetensors token file holding 'tokens'"
    )
    method: str = setting(
        "frequency", help="how a group's experts are weighed", allowed=Options(surgery.MERGE_METHODS)
    )
    calib_split: str = setting(
        "train", help="the split of --calib drawn from", allowed=Options(("train", "val", "test"))
    )
    calib_tokens: int = setting(65536, help="calibration tokens drawn", allowed=_POSITIVE)
    calib_seed: int = setting(0, help="seed of the calibration windows", allowed=Interval(int, 0, 2**31 - 1))
    batch_size: int = setting(16, help="calibration windows per forward", allowed=_POSITIVE)
    block_size: int | None = setting(
        None, help="tokens per calibration window (default: the model's context)", allowed=(_POSITIVE, None)
    )


def _is_moelab(path: Path) -> bool:
    if (path / "config.yaml").is_file():
        return True
    try:
        read_config(path)
    except (ValueError, OSError):  # not a moelab folder: a transformers one, tried next
        return False
    return True


def load_source(source: str | Path) -> nn.Module:
    """The model ``--from`` names: a moelab run or save folder (:func:`moelab.load`), else a local
    transformers model folder, converted with :func:`moelab.from_hf`."""
    path = Path(source)
    if not path.is_dir():
        raise FileNotFoundError(
            f"--from {str(source)!r} is not a folder; expected a moelab run or a transformers model"
        )
    if _is_moelab(path):
        return load(path)
    from ..hf.convert import from_hf
    from ..hf.upcycle import load_hf_model

    return from_hf(load_hf_model(str(path)).eval())


def _tokens(calib: str, split: str, level: str) -> Tensor:
    if calib.endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(calib)
        if "tokens" not in tensors or tensors["tokens"].is_floating_point():
            raise ValueError(
                f"--calib {calib!r} holds no integer tensor 'tokens'; expected token ids under 'tokens'"
            )
        return tensors["tokens"].reshape(-1).long()
    return load_text(calib, level).split(split)


def calibration_batches(
    tokens: Tensor, block_size: int, num_tokens: int, seed: int, batch_size: int
) -> list[Tensor]:
    """``ceil(num_tokens / block_size)`` windows of ``block_size`` tokens at offsets drawn uniformly
    from ``seed`` (as training draws its batches), in batches of ``batch_size``."""
    if tokens.numel() <= block_size:
        raise ValueError(
            f"--calib holds {tokens.numel()} tokens; expected more than the window of {block_size} tokens"
        )
    windows = math.ceil(num_tokens / block_size)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(tokens.numel() - block_size, (windows,), generator=gen)
    rows = tokens[starts[:, None] + torch.arange(block_size)]  # (windows, block_size)
    return list(rows.split(batch_size))


def _level_and_block(source: str | Path, model: nn.Module, calib: str | None) -> tuple[str, int | None]:
    """The tokenizer level of a moelab LM run (``byte`` otherwise) and the model's context."""
    path = Path(source)
    level = "byte"
    if (path / "config.yaml").is_file():
        lm_config, _ = read_lm_run(path)
        level = lm_config.level
    elif calib is not None and not calib.endswith(".safetensors") and not hasattr(model, "cfg"):
        raise ValueError(
            f"--calib {calib!r} is a text dataset, which moelab cannot tokenize for a transformers model; "
            "expected a .safetensors token file holding 'tokens' (ids of the model's tokenizer)"
        )
    block = getattr(getattr(model, "cfg", None), "block_size", None)
    return level, block


def shrunk_model(config: PruneConfig | MergeConfig, merge: bool) -> tuple[nn.Module, dict[str, Any]]:
    """The pruned (or merged) model of ``config`` and what was measured and chosen, per layer."""
    model = load_source(config.source)
    calib = config.calib
    if calib is None and (merge or config.method != "random"):
        raise ValueError(f"--method {config.method!r} needs --calib (the calibration tokens)")
    stats = None
    if calib is not None:
        level, block = _level_and_block(config.source, model, calib)
        block = config.block_size or block
        if block is None:
            raise ValueError("--block-size is needed: the model records no context length")
        tokens = _tokens(calib, config.calib_split, level)
        batches = calibration_batches(
            tokens, block, config.calib_tokens, config.calib_seed, config.batch_size
        )
        stats = surgery.expert_statistics(model, batches)
    paths = {p: m.config.num_experts for p, m in model.named_modules() if m in set(moe_layers(model))}
    coefficients = None
    if merge:
        groups = surgery.merge_groups(stats, config.keep)
        keep = {p: d for p, (d, _) in groups.items()}
        coefficients = {
            p: surgery.merge_coefficients(g, stats[p].counts, config.method) for p, (_, g) in groups.items()
        }
    else:
        keep = surgery.choose_experts(
            stats, config.method, config.keep, num_experts=paths, seed=config.calib_seed
        )
    shrunk = surgery.shrink(model, keep, coefficients)
    info: dict[str, Any] = {
        "kept": {p: k.tolist() for p, k in keep.items()},
        "num_parameters_before": sum(p.numel() for p in model.parameters()),
        "num_parameters": sum(p.numel() for p in shrunk.parameters()),
    }
    if stats is not None:
        info["counts"] = {p: s.counts.tolist() for p, s in stats.items()}
        info["reap"] = {p: s.reap.tolist() for p, s in stats.items()}
    if merge:
        info["groups"] = {p: g.tolist() for p, (_, g) in groups.items()}
    return shrunk, info


def _execute(
    config: PruneConfig | MergeConfig,
    run: runner.Run,
    merge: bool,
    built: tuple[nn.Module, dict[str, Any]] | None,
) -> dict[str, Any]:
    shrunk, info = built or shrunk_model(config, merge)
    run.record(model_class=type(shrunk).__name__)
    run.write_config()
    source = Path(config.source)
    if (source / "tokenizer.json").is_file():  # `moelab eval` / `finetune` read it beside the weights
        atomic_write_bytes(run.path / "tokenizer.json", (source / "tokenizer.json").read_bytes())
    save(shrunk, run.path, metadata={run.command.name: vocab.plain(config)})
    n = next(iter(info["kept"].values()))
    print(
        f"{run.command.name} ({config.method}, keep {config.keep}): {len(n)} experts per layer kept; "
        f"{info['num_parameters_before']:,} → {info['num_parameters']:,} parameters; wrote {run.path}"
    )
    return info


def _command(name: str, cls: type, merge: bool) -> runner.Command:
    built: dict[str, Any] = {}

    def prepare(config: Any, world: int) -> None:  # refused before the run directory opens
        built["result"] = shrunk_model(config, merge)

    return runner.Command(
        name, cls, lambda config, run: _execute(config, run, merge, built.get("result")), prepare=prepare
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    vocab.add_arguments(parser, PruneConfig)


def run(args: argparse.Namespace) -> int:
    runner.run_command(_command("prune", PruneConfig, False), args)
    return 0


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    vocab.add_arguments(parser, MergeConfig)


def run_merge(args: argparse.Namespace) -> int:
    runner.run_command(_command("merge-experts", MergeConfig, True), args)
    return 0
