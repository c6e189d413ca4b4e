"""``moelab diagnose RUN...``: the routing diagnostics of trained language-model runs (router
entropy, the swap tests, router/competition overlap, load, expert output norms, expert change
rate), computed with the weights and routing context ``moelab.load(run)`` returns on the first
``--tokens`` tokens of the test split and written to ``RUN/diagnostics.json``, which ``moelab
report`` tabulates over seeds.  docs/methods.md ("Diagnostics") lists every key of that file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from .. import _validate, metrics
from ..data.text import load_text
from ..io.atomic import atomic_write_text
from ..io.model import list_checkpoints, load
from ..io.rundir import read_yaml
from ..train.tasks import LMTask
from . import runner
from .lm import TrainRun

__all__ = ["SCALARS", "add_arguments", "diagnose_run", "run"]

#: the scalar keys of diagnostics.json that ``moelab report`` tabulates
SCALARS = (
    "router_entropy_mean",
    "swap_top1_delta",
    "swap_topk_delta",
    "competition_overlap_mean",
    "load_cv_mean",
    "max_vio_mean",
    "expert_change_rate",
)


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _batches(task: LMTask, tokens: int) -> list[torch.Tensor]:
    data = task.data.split("test")
    n = min(tokens, data.numel() - 1) // task.block_size
    if n < 1:
        raise ValueError(
            f"--tokens={tokens} is not allowed; expected at least one block ({task.block_size} tokens)"
        )
    blocks = data[: n * task.block_size].view(n, task.block_size)
    return [blocks[i : i + 16] for i in range(0, n, 16)]


def _run_kind(config_file: Path) -> str:
    """The command that wrote the run's ``config.yaml`` (a damaged file is refused naming it)."""
    data = read_yaml(config_file, repr(str(config_file)))
    command = data.get("command", "train")  # runs of moelab < 0.3 recorded no command
    return command if isinstance(command, str) else repr(command)


def diagnose_run(path: str | Path, tokens: int = 16384) -> dict[str, Any]:
    """The diagnostics of one run directory (see the module docstring); written to
    ``diagnostics.json`` there and returned."""
    path = Path(path)
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a moelab train run (no config.yaml)")
    kind = _run_kind(config_file)
    if kind != "train":
        raise ValueError(
            f"{path} is a moelab {kind} run; diagnose takes language-model runs of moelab train or compare"
        )
    config, recorded = runner.read_run_config(TrainRun, path, "train")
    if config.arch == "dense":
        raise ValueError(f"{path} is a dense model: it has no MoE layer to diagnose")
    data = load_text(config.data, level=config.level)
    old, new = recorded.get("data_sha256"), (data.info or {}).get("sha256")
    if old and new and old != new:
        raise ValueError(
            f"{path}: --data {config.data!r} now has sha256 {new[:12]}…, but the run was trained on "
            f"{old[:12]}…; its diagnostics would describe other data (restore the file or train again)"
        )
    target = path / "diagnostics.json"
    if target.exists() and not target.is_file():
        raise ValueError(f"{str(target)!r} exists and is not a file; remove it to write the diagnostics")
    model = load(path)
    task = LMTask(data, model.cfg.block_size)
    batches = _batches(task, tokens)
    layers = metrics._layers(model)
    k = layers[0].top_k
    # the swaps replace the K-th expert: none with all N chosen, or with a variable number (remoe)
    spare = all(layer.top_k < layer.num_experts and not layer.router.variable_k for layer in layers)

    def bpc() -> float:
        return task.evaluate(model, "test", len(batches) * 16 * task.block_size)[data.metric]

    with torch.no_grad():
        model.eval()
        out: dict[str, Any] = {"run": str(path), "method": config.method, "tokens": tokens, "top_k": k}
        out["bpc"] = bpc()
        if spare:
            with metrics.swap_top1(model, 0):
                out["swap_top1_bpc"] = bpc()
            with metrics.swap_top1(model, k - 1):
                out["swap_topk_bpc"] = bpc()
            out["swap_top1_delta"] = out["swap_top1_bpc"] - out["bpc"]
            out["swap_topk_delta"] = out["swap_topk_bpc"] - out["bpc"]
        entropy = metrics.router_entropy(model, batches)
        out["router_entropy"], out["router_entropy_mean"] = entropy, _mean(entropy)
        overlap = metrics.competition_overlap(model, batches)
        out["competition_overlap"], out["competition_overlap_mean"] = overlap, _mean(overlap)
        loads = metrics.load_cv(model, batches)
        out["load"] = [x["load"] for x in loads]
        out["load_cv"] = [x["cv"] for x in loads]
        out["load_cv_mean"] = _mean(out["load_cv"])
        out["max_vio"] = [x["max_vio"] for x in loads]  # MaxVio of the load over all the tokens
        out["max_vio_mean"] = _mean(out["max_vio"])
        if any("dropped" in x for x in loads):  # layers with an expert capacity: slots dropped
            out["dropped"] = [x.get("dropped") for x in loads]
        out["expert_output_norms"] = metrics.expert_output_norms(model, batches).tolist()
        ckpts = list_checkpoints(path / "ckpt")
        out["expert_change_rate"] = None
        if len(ckpts) >= 2:
            older, newer = load(ckpts[-2]), load(ckpts[-1])
            out["expert_change_rate"] = metrics.expert_change_rate(older, newer, batches)
            out["expert_change_between"] = [ckpts[-2].name, ckpts[-1].name]
    atomic_write_text(path / "diagnostics.json", json.dumps(out, indent=2) + "\n")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories of moelab train / compare")
    p.add_argument("--tokens", type=int, default=16384, help="test tokens to diagnose on (default 16384)")


def run(args: argparse.Namespace) -> int:
    _validate.positive_int("--tokens", args.tokens)
    rows = [diagnose_run(r, args.tokens) for r in args.runs]
    header = (
        f"{'run':<40} {'bpc':>7} {'swap1 Δ':>8} {'swapK Δ':>8} {'entropy':>8} {'overlap':>8} {'load CV':>8} "
        f"{'MaxVio':>7} {'change':>7}"
    )
    print(header)

    def fmt(v: Any, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    for r in rows:
        print(
            f"{r['run'][-40:]:<40} {r['bpc']:>7.4f} {fmt(r.get('swap_top1_delta'), '+.4f'):>8} "
            f"{fmt(r.get('swap_topk_delta'), '+.4f'):>8} {fmt(r['router_entropy_mean'], '.4f'):>8} "
            f"{fmt(r['competition_overlap_mean'], '.3f'):>8} {fmt(r['load_cv_mean'], '.3f'):>8} "
            f"{fmt(r['max_vio_mean'], '.3f'):>7} {fmt(r['expert_change_rate'], '.3f'):>7}"
        )
    print(f"\nwrote diagnostics.json in {len(rows)} run(s)")
    return 0
