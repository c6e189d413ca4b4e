"""``moelab upcycle``: turn a local transformers model's MLPs into MoE layers
(:func:`moelab.upcycle`) and write it with :func:`moelab.save`, so ``moelab.load(out)`` rebuilds it
offline, through the run lifecycle of :mod:`moelab.experiments.runner` (flags, ``--config``,
``--force``, ``config.yaml``, ``metrics.json``).  docs/scaling-hf.md ("``moelab upcycle``").
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import config as vocab
from ..config import Interval, setting
from ..hf.upcycle import find_mlps, load_hf_model, upcycle
from ..io.atomic import sha256_file
from ..io.model import save
from . import runner

__all__ = ["UPCYCLE", "UpcycleConfig", "add_arguments", "run"]


@dataclass
class UpcycleConfig:
    """The settings of ``moelab upcycle``, as its ``config.yaml`` holds them."""

    model: str = setting(
        help="a local transformers model directory (save_pretrained: config.json + weights) or a "
        "config.json (random init under --seed); no hub access",
        fingerprint="model_sha256",
    )
    num_experts: int = setting(help="experts per MoE layer", allowed=Interval(int, 1))
    top_k: int = setting(help="experts per token", allowed=Interval(int, 1))
    method: str = setting("smoe", help="a moelab method")
    layers: tuple[int, ...] | None = setting(None, help="MLP indices to upcycle (default: all)")
    options: dict[str, Any] = setting(
        default_factory=dict,
        flag="--option",
        help="a method option, repeatable, e.g. balance_coef=0.02 (VALUE: true/false, none, a number or text)",
    )
    seed: int = setting(0, help="seed of the router init", allowed=Interval(int, 0, 2**63 - 1))


def _upcycled(config: UpcycleConfig) -> tuple[nn.Module, dict[str, Any]]:
    """The upcycled model and its counts."""
    torch.manual_seed(config.seed)
    model = load_hf_model(config.model).eval()
    num_dense = sum(p.numel() for p in model.parameters())
    names = find_mlps(model)
    layers = None if config.layers is None else list(config.layers)
    chosen = [name for i, name in enumerate(names) if layers is None or i in layers]
    per_copy = sum(
        p.numel() * p.element_size() for name in chosen for m in _modules(model, name) for p in m.parameters()
    )
    runner.check_memory(
        config,
        lambda c: num_dense * 4 + c.num_experts * per_copy,  # every expert a copy of its MLP
        {"num_experts": 1},
        "the upcycled model",
    )
    upcycle(model, config.num_experts, config.top_k, config.method, layers, **config.options)
    return model, {
        "num_mlps": len(names),
        "num_moe_layers": len(layers) if layers is not None else len(names),
        "num_parameters_dense": num_dense,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def model_fingerprint(source: str | Path) -> str:
    """The sha256 of what ``--model`` is read from: its ``config.json`` and the safetensors weights
    beside it (by name and content)."""
    source = Path(source)
    files = (
        [source]
        if source.is_file()
        else sorted(
            p for p in source.iterdir() if p.name == "config.json" or p.name.startswith("model.safetensors")
        )
    )
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode() + b"\0" + sha256_file(file).encode())
    return h.hexdigest()


def _modules(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules of an MLP that :func:`moelab.hf.upcycle.find_mlps` names (``"<layer>.fc1+fc2"``:
    the pair)."""
    prefix, _, last = name.rpartition(".")
    return [model.get_submodule(f"{prefix}.{part}" if prefix else part) for part in last.split("+")]


def _execute(
    config: UpcycleConfig, run: runner.Run, built: tuple[nn.Module, dict[str, Any]] | None = None
) -> dict[str, Any]:
    model, metrics = built or _upcycled(config)
    run.check_fingerprint("--model", config.model, model_fingerprint(config.model))
    run.record(model_class=type(model).__name__)
    run.write_config()
    info = {**vocab.plain(config), "model_class": type(model).__name__}
    save(model, run.path, metadata={"upcycle": info})  # moelab.load(out) rebuilds it offline
    print(
        f"upcycled {metrics['num_moe_layers']} of {metrics['num_mlps']} MLPs of {type(model).__name__} to "
        f"{config.num_experts} experts (top-{config.top_k}, {config.method}): "
        f"{metrics['num_parameters_dense']:,} → {metrics['num_parameters']:,} parameters; "
        f"wrote {run.path / 'model.safetensors'}"
    )
    return metrics


#: ``moelab upcycle`` as the run lifecycle sees it
UPCYCLE = runner.Command("upcycle", UpcycleConfig, _execute)


def _command() -> runner.Command:
    """:data:`UPCYCLE` with the model built in ``prepare``, before the run directory opens, so
    that a refused model leaves no folder behind."""
    built: dict[str, Any] = {}

    def prepare(config: UpcycleConfig, world: int) -> None:
        built["result"] = _upcycled(config)

    return dataclasses.replace(
        UPCYCLE, execute=lambda config, run: _execute(config, run, built.get("result")), prepare=prepare
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    vocab.add_arguments(parser, UpcycleConfig)


def run(args: argparse.Namespace) -> int:
    runner.run_command(_command(), args)
    return 0
