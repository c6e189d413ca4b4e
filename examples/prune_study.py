"""Test BPC of pruned and merged routing-benchmark models against the unpruned ones, with intervals
across calibration seeds and training seeds (docs/results.md, "Expert pruning and merging").

For every trained run under ``--runs`` (``METHOD/seedS``, as ``moelab compare --out`` writes them),
every kept fraction and every technique (REAP, frequency and random pruning; M-SMoE groups merged
by uniform and by frequency-weighted averages), and every calibration seed: the model is shrunk with
the calibration windows of that seed (drawn from the training split, as ``moelab prune --calib``
does) and tested on the first ``--test-tokens`` bytes of the test split; the unpruned model on the
same bytes.  Every cell is appended to ``OUT/cells.csv`` as it finishes, so a rerun continues where
an interrupted one stopped; ``OUT/table.md`` and the plot are written from it at the end.  Usage::

    python examples/prune_study.py --runs runs/prune-base --out runs/prune-study
    # or one process per router, then one table:
    python examples/prune_study.py --runs runs/by-router/smoe --out runs/prune-study/smoe
    python examples/prune_study.py --merge runs/prune-study/*/cells.csv --out runs/prune-study
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

import moelab
from moelab import prune
from moelab.data.text import load_text
from moelab.experiments.prune import calibration_batches
from moelab.experiments.summary import mean, sd, t_interval
from moelab.train.tasks import LMTask

TECHNIQUES = ("reap", "frequency", "random", "merge-average", "merge-frequency")
ORDER = ("none", *TECHNIQUES)
FIELDS = ("router", "seed", "technique", "keep", "calib_seed", "test_bpc", "seconds")


def shrink(model, technique: str, keep: float, batches, seed: int):
    if technique == "random":
        sizes = {p: m.config.num_experts for p, m in model.named_modules() if isinstance(m, moelab.MoE)}
        return prune.shrink(model, prune.choose_experts(None, "random", keep, num_experts=sizes, seed=seed))
    stats = prune.expert_statistics(model, batches)
    if technique.startswith("merge-"):
        groups = prune.merge_groups(stats, keep)
        how = technique.removeprefix("merge-")
        return prune.shrink(
            model,
            {p: d for p, (d, _) in groups.items()},
            {p: prune.merge_coefficients(g, stats[p].counts, how) for p, (_, g) in groups.items()},
        )
    return prune.shrink(model, prune.choose_experts(stats, technique, keep))


def measure(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = out / "cells.csv"
    done = set()
    if cells.exists():
        with cells.open() as f:
            done = {
                (r["router"], r["seed"], r["technique"], r["keep"], r["calib_seed"])
                for r in csv.DictReader(f)
            }
    else:
        with cells.open("w", newline="") as f:
            csv.writer(f).writerow(FIELDS)
    data = load_text(args.data, "byte")
    torch.set_num_threads(args.threads)
    runs = sorted(p for p in Path(args.runs).glob("*/seed*") if (p / "best").is_dir())
    for run in runs:
        router, seed = run.parent.name, run.name.removeprefix("seed")
        model = moelab.load(run)
        task = LMTask(data, model.cfg.block_size)
        todo = [("none", 1.0, 0)] + [
            (t, k, c) for k in args.keep for t in TECHNIQUES for c in range(args.calib_seeds)
        ]
        for technique, keep, calib in todo:
            key = (router, seed, technique, str(keep), str(calib))
            if key in done:
                continue
            start = time.perf_counter()
            if technique == "none":
                shrunk = model
            else:
                train = data.split("train")
                batches = calibration_batches(train, model.cfg.block_size, args.calib_tokens, calib, 16)
                shrunk = shrink(model, technique, keep, batches, calib)
            bpc = task.evaluate(shrunk.eval(), "test", args.test_tokens)["bpc"]
            row = (*key, f"{bpc:.6f}", f"{time.perf_counter() - start:.1f}")
            with cells.open("a", newline="") as f:
                csv.writer(f).writerow(row)
            print(" ".join(row), flush=True)
    return cells


def summarise(cells: Path, out: Path, plot: Path | None) -> None:
    with cells.open() as f:
        rows = list(csv.DictReader(f))
    by: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        by.setdefault((r["router"], r["technique"], float(r["keep"])), {}).setdefault(r["seed"], []).append(
            float(r["test_bpc"])
        )
    base = {(r["router"], r["seed"]): float(r["test_bpc"]) for r in rows if r["technique"] == "none"}
    lines = [
        "| router | technique | kept | test BPC mean ± sd (all cells) | 95 % CI (training seeds) | "
        "Δ vs unpruned [95 % CI] | sd across calibration seeds | cells |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    curves: dict[tuple[str, str], list[tuple[float, float, tuple[float, float] | None]]] = {}
    for (router, technique, keep), seeds in sorted(
        by.items(), key=lambda kv: (kv[0][0], ORDER.index(kv[0][1]), -kv[0][2])
    ):
        values = [v for vs in seeds.values() for v in vs]
        per_seed = {s: mean(vs) for s, vs in seeds.items()}
        ci = t_interval(list(per_seed.values()))
        deltas = [per_seed[s] - base[(router, s)] for s in per_seed if (router, s) in base]
        dci = t_interval(deltas)
        within = [sd(vs) for vs in seeds.values() if len(vs) > 1]
        within_sd = mean(within) if within else None
        ci_text = "n/a" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"
        d_text = (
            "—"
            if technique == "none"
            else (f"{mean(deltas):+.3f} " + ("[n/a]" if dci is None else f"[{dci[0]:+.3f}, {dci[1]:+.3f}]"))
        )
        sd_all = sd(values)
        lines.append(
            f"| {router} | {technique} | {keep:g} | {mean(values):.3f} ± {0.0 if sd_all is None else sd_all:.3f} | "
            f"{ci_text} | {d_text} | {'—' if within_sd is None else f'{within_sd:.3f}'} | "
            f"{len(seeds)} × {len(values) // max(1, len(seeds))} |"
        )
        if technique != "none":  # the plot: the paired difference to the unpruned model
            curves.setdefault((router, technique), []).append((keep, mean(deltas), dci))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if plot is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = sorted({r for r, _ in curves})
    fig, axes = plt.subplots(1, len(routers), figsize=(4.2 * len(routers), 3.6), sharey=True)
    axes = [axes] if len(routers) == 1 else list(axes)
    for ax, router in zip(axes, routers, strict=True):
        for i, technique in enumerate(TECHNIQUES):
            points = sorted([*curves.get((router, technique), []), (1.0, 0.0, None)])
            if len(points) < 2:
                continue
            xs = [p[0] + (i - 2) * 0.008 for p in points]  # side by side, so the intervals stay apart
            ys = [p[1] for p in points]
            err = [
                [p[1] - (p[2] or (p[1], p[1]))[0] for p in points],
                [(p[2] or (p[1], p[1]))[1] - p[1] for p in points],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=technique)
        ax.set_title(router)
        ax.set_xlabel("fraction of experts kept")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Δ test BPC vs unpruned\n(95 % CI over training seeds)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", help="a `moelab compare --out` folder of trained runs")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", default="stdlib")
    parser.add_argument("--keep", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    parser.add_argument("--calib-seeds", type=int, default=3)
    parser.add_argument("--calib-tokens", type=int, default=32768)
    parser.add_argument("--test-tokens", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", default=None, help="where to write the plot (PNG)")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="CELLS_CSV",
        help="only summarise these cells.csv files (of studies run in parallel) into --out",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.merge:
        out.mkdir(parents=True, exist_ok=True)
        rows = [line for f in args.merge for line in Path(f).read_text().splitlines()[1:]]
        (out / "cells.csv").write_text("\n".join([",".join(FIELDS), *rows]) + "\n")
        cells = out / "cells.csv"
    elif args.runs:
        cells = measure(args)
    else:
        parser.error("--runs (a folder of trained runs) or --merge (cells.csv files) is needed")
    summarise(cells, out, Path(args.plot) if args.plot else out / "prune_bpc.png")


if __name__ == "__main__":
    main()
