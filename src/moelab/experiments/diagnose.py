"""``moelab diagnose RUN...``: the routing diagnostics of trained language-model runs (router
entropy with its spread, the swap tests, router/competition overlap, load, MaxVio, Jain's index, the
selection-frequency and top-K-weight entropies, expert output norms), computed with the weights and
routing context ``moelab.load(run)`` returns on the first ``--tokens`` tokens of the test split; the
curves over training (router saturation against the final checkpoint, the change rate between
consecutive checkpoints, Jain's index) from every checkpoint the run kept (``--keep-ckpts all``); all
written to ``RUN/diagnostics.json``, which ``moelab report`` tabulates over seeds, with the curves and a
sample's router distributions drawn into the run (:data:`FIGURES`).  docs/methods.md ("Diagnostics")
lists every key of that file.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch

from .. import _validate, metrics
from ..data.text import load_text
from ..io.atomic import atomic_write_checked, atomic_write_png, recording
from ..io.model import list_checkpoints, load, weights_digest
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
    "jain_mean",
    "selection_entropy_mean",
    "topk_weight_entropy_mean",
    "router_entropy_sd_mean",
    "saturation_area",
    "expert_change_rate",
)

#: the figures ``diagnose`` draws into each run: the curves over training and the first test
#: sequence's router distribution per layer (CompeteSMoE (2024) Figs. 4-6)
FIGURES = ("diagnostics_curves.png", "router_distributions.png")
#: tokens of the first test sequence drawn in router_distributions.png (at most)
SAMPLE_TOKENS = 64


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _step(ckpt: Path) -> int:
    return int(ckpt.name.rsplit("-", 1)[-1])


def routing_curves(ckpts: list[Path], batches: list[torch.Tensor]) -> dict[str, Any]:
    """The curves over training from the checkpoints ``ckpts`` (oldest first, at least two), each run
    once over ``batches``: per checkpoint and layer, router saturation against the last checkpoint
    (Ho (2025): mean ``|TopK_t(x) ∩ TopK_final(x)| / K``, which is ``1 −`` the change rate between the
    two), the change rate against the checkpoint before (CompeteSMoE (2025) Fig. 3, Ho (2025);
    ``None`` at the first) and Jain's index of the load (Ho (2025)); the ``_mean`` keys average over the
    layers (the change rate's: over every slot of every layer, :func:`moelab.metrics.expert_change_rate`
    of the pair).  Slots are compared by :func:`moelab.metrics.slot_agreement` (a router with a variable
    number of experts per token: an empty slot in both counts as the same choice)."""
    choices = []  # per checkpoint: per layer, the (T, K) choices of every token (-1: an inactive slot)
    for ckpt in ckpts:
        model = load(ckpt)
        per_batch = [metrics.active_choices(model, b) for b in batches]
        choices.append([torch.cat(layer) for layer in zip(*per_batch)])
        num_experts = [m.num_experts for m in metrics.layers_of(model)]

    # a router whose K changes over training (SMoE-Dropout): the narrower routings padded with
    # empty slots, so a checkpoint's share of the final choices is |A ∩ B| / K_final
    widths = [max(c[i].shape[1] for c in choices) for i in range(len(choices[0]))]
    choices = [
        [torch.nn.functional.pad(x, (0, w - x.shape[1]), value=-1) for x, w in zip(c, widths)]
        for c in choices
    ]

    def agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
        return [float(metrics.slot_agreement(x, y).double().sum()) / x.numel() for x, y in zip(a, b)]

    def overall(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        same = sum(float(metrics.slot_agreement(x, y).double().sum()) for x, y in zip(a, b))
        return 1 - same / sum(x.numel() for x in a)

    final = choices[-1]
    saturation = [agreement(c, final) for c in choices]
    change: list[list[float] | None] = [None]
    change += [[1 - v for v in agreement(prev, cur)] for prev, cur in itertools.pairwise(choices)]
    jain = [
        [metrics.jain_index(torch.bincount(a[a >= 0], minlength=n).double()) for a, n in zip(c, num_experts)]
        for c in choices
    ]
    return {
        "curve_checkpoints": [c.name for c in ckpts],
        "curve_steps": [_step(c) for c in ckpts],
        "saturation": saturation,
        "saturation_mean": [_mean(row) for row in saturation],
        "change_rate": change,
        "change_rate_mean": [None] + [overall(p, c) for p, c in itertools.pairwise(choices)],
        "jain_curve": jain,
        "jain_curve_mean": [_mean(row) for row in jain],
    }


def plot_curves(out: dict[str, Any], path: Path) -> None:
    """Router saturation, change rate and Jain's index per layer against the step (Ho (2025)'s curves;
    CompeteSMoE (2025) Fig. 3 for the change rate), on the tokens ``out["tokens_used"]`` says."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = out["curve_steps"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("saturation", "router saturation vs final checkpoint", steps),
        ("change_rate", "change rate vs previous checkpoint", steps[1:]),
        ("jain_curve", "Jain's index of the load", steps),
    )
    for ax, (key, title, xs) in zip(axes, panels):
        rows = [r for r in out[key] if r is not None]
        for layer in range(len(rows[0])):
            ax.plot(xs, [r[layer] for r in rows], marker="o", markersize=3, label=f"layer {layer}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{out['method']}: routing over training, first {out['tokens_used']} test tokens", fontsize=10
    )
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=110)


def plot_router_distributions(probs: list[torch.Tensor | None], method: str, path: Path) -> int:
    """The router distribution (softmax over the experts) of each token of one test sequence, a
    heatmap per MoE layer (CompeteSMoE (2024) Figs. 4-6); returns the tokens drawn (0: no layer has a
    router distribution, nothing drawn)."""
    drawn = [(i, p) for i, p in enumerate(probs) if p is not None]
    if not drawn:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tokens = drawn[0][1].shape[0]
    cols = min(len(drawn), 4)
    rows = -(-len(drawn) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.4 * cols + 1.2, 2.9 * rows + 0.6), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[len(drawn) :]:
        ax.axis("off")
    for ax, (i, p) in zip(axes.flat, drawn):
        im = ax.imshow(p.T.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"layer {i}", fontsize=9)
        ax.set_xlabel("token")
        ax.set_ylabel("expert")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(im, ax=axes, shrink=0.8, label="router probability")
    fig.suptitle(
        f"{method}: router distribution of the first {tokens} tokens of the first test sequence", fontsize=10
    )
    atomic_write_png(path, fig, dpi=110)
    return tokens


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
    ``diagnostics.json`` there (listed in the run's manifest: ``--force`` removes it) and returned."""
    path = Path(path)
    with recording(path):
        return _diagnose_run(path, tokens)


def _diagnose_run(path: Path, tokens: int) -> dict[str, Any]:
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
    digest = weights_digest(path)  # of the weights diagnosed: report finds the file stale once they change
    model = load(path)
    task = LMTask(data, model.cfg.block_size)
    batches = _batches(task, tokens)
    layers = metrics.layers_of(model)
    k = layers[0].top_k
    # the swaps replace the K-th expert: none with all N chosen, or with a variable number (remoe)
    spare = all(layer.top_k < layer.num_experts and not layer.router.variable_k for layer in layers)

    used = sum(b.numel() for b in batches)  # whole blocks: the first ``used`` test tokens

    def bpc() -> float:
        return task.evaluate(model, "test", used)[data.metric]

    with torch.no_grad():
        model.eval()
        out: dict[str, Any] = {
            "run": str(path),
            "method": config.method,
            "tokens": tokens,
            "tokens_used": used,
            "top_k": k,
        }
        out["bpc"] = bpc()
        # a router whose choice is fixed (DeepSeek-V4's hash layers) is a router with none
        out["routing_parameters"] = metrics.routing_parameters(model)
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
        balance = metrics.routing_balance(model, batches)
        for key in ("jain", "selection_entropy", "topk_weight_entropy", "router_entropy_sd"):
            out[key] = [row[key] for row in balance]
            out[f"{key}_mean"] = _mean(out[key])
        if any("dropped" in x for x in loads):  # layers with an expert capacity: slots dropped
            out["dropped"] = [x.get("dropped") for x in loads]
        # expert FFNs each token runs at inference (a variable-K router's empty slots and MoE++'s
        # null experts are not counted)
        chosen = [metrics.active_choices(model, b) for b in batches]
        out["active_experts"] = [
            sum(int((c[i] >= 0).sum()) for c in chosen) / sum(c[i].shape[0] for c in chosen)
            for i in range(len(layers))
        ]
        out["active_experts_mean"] = _mean(out["active_experts"])
        out["expert_output_norms"] = metrics.expert_output_norms(model, batches).tolist()
        ckpts = list_checkpoints(path / "ckpt")
        out["expert_change_rate"] = None
        out["saturation_area"] = None
        if len(ckpts) >= 2:
            out.update(routing_curves(ckpts, batches))
            out["expert_change_rate"] = out["change_rate_mean"][-1]
            out["expert_change_between"] = [ckpts[-2].name, ckpts[-1].name]
            out["saturation_area"] = _mean(out["saturation_mean"][:-1])
        sample = batches[0][:1, :SAMPLE_TOKENS]
        probs = metrics.router_distributions(model, sample)
    figures: dict[str, int] = {}
    if len(ckpts) >= 2:
        plot_curves(out, path / FIGURES[0])
        figures[FIGURES[0]] = used
    drawn = plot_router_distributions(probs, config.method, path / FIGURES[1])
    if drawn:
        figures[FIGURES[1]] = drawn
    for name in FIGURES:  # a figure of an earlier diagnose that this one does not draw would mislead
        if name not in figures and (path / name).is_file():
            (path / name).unlink()
    out["figures"] = figures  # each figure's file and the test tokens it used (the first ones)
    out["weights_sha256"] = digest
    atomic_write_checked(path / "diagnostics.json", (json.dumps(out, indent=2) + "\n").encode("utf-8"))
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
    for r in rows:
        curves = (
            ""
            if r["expert_change_rate"] is not None
            else "; no curves over training (fewer than two "
            "checkpoints: train with --ckpt-every N --keep-ckpts all)"
        )
        print(f"{r['run']}: everything on the first {r['tokens_used']} test tokens{curves}")
        for name, n in r["figures"].items():
            print(f"  {name}: first {n} test tokens")
        if FIGURES[1] not in r["figures"]:
            print(f"  {FIGURES[1]}: not drawn (no MoE layer has a router distribution)")
    print(f"\nwrote diagnostics.json in {len(rows)} run(s)")
    return 0
