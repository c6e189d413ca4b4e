"""``moelab simulate``: run one convergence-rate study of :mod:`moelab.stats.studies` into a run
directory.

``moelab simulate --study NAME [--quick] --seed S --out DIR`` runs one study and writes into DIR:

* ``config.yaml`` — every constant (d, k*, noise, τ, sample-size grid, optimiser settings, seed);
* ``losses.csv`` — one row per (router, setting, loss, n, replicate): ``loss`` names the loss (expert
  or voronoi), ``value`` is its value, ``train`` the training MSE/NLL, and the fit's diagnostics
  ``n_iter``, ``grad_norm``, ``converged``, ``hit_cap`` and ``beta1_max_norm`` (largest ‖β₁ᵢ‖);
* ``table.csv`` — one row per (router, setting, loss, n): mean loss, sd over replicates, 95 %
  bootstrap CI of the mean, and the fraction of replicates that converged, hit the iteration cap
  or ended on the bound ‖β₁ᵢ‖ = B (also printed by the command);
* ``estimates.npz`` — every replicate's estimates (NumPy arrays, no pickle): for each series
  ``{router}__{setting}__{param}`` of shape ``(S, R, k, ...)`` (S sample sizes, R replicates), the
  target it is measured against ``{router}__{setting}__target_{param}``, and ``sample_sizes``;
* ``metrics.json`` — ``rates``: a list of ``{router, setting, loss, slope, ci_low, ci_high,
  intercept, theory}`` (``log mean loss = intercept + slope · log n``, 95 % bootstrap CI;
  ``theory`` the reference slopes of :data:`moelab.stats.studies.THEORY`), ``differences``: the slope differences
  between the routers of each (setting, loss) with their bootstrap CI, ``table`` (as table.csv),
  ``means``, ``config`` (the constants again), ``wall_seconds``;
* ``rates.png`` — log-log mean loss against n with two-standard-deviation bars and the fitted
  lines (solid), the theory's reference slopes dashed, one panel per setting (as perturbed cosine
  router (2024) Fig. 1 / Fig. 2).

The studies, their constants and the estimators' settings: :mod:`moelab.stats.studies`.
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path
from typing import Any

import numpy as np

from ..io.atomic import atomic_write_bytes, atomic_write_text
from ..io.rundir import RunDir
from ..stats.fit import OPTIMIZERS
from ..stats.studies import (
    STUDIES,
    STUDY_INITS,
    StudyConfig,
    StudyResult,
    bench,
    run_study,
    study_config,
    theory_slopes,
)

__all__ = ["FLAGS", "add_arguments", "config_from_args", "format_table", "run", "write_study"]


#: study setting → its ``moelab simulate`` flag (errors in a setting name the flag)
FLAGS: dict[str, str] = {
    "replicates": "--replicates",
    "optimizer": "--optimizer",
    "lr": "--lr",
    "steps": "--steps",
    "tau": "--tau",
    "d": "--d",
    "k_true": "--k-true",
    "extra_experts": "--extra-experts",
    "noise_var": "--noise-var",
    "init": "--init",
    "restarts": "--restarts",
    "gtol": "--gtol",
    "ftol": "--ftol",
    "beta1_bound": "--beta1-bound",
    "eta_bound": "--eta-bound",
    "nu_min": "--nu-min",
    "sample_sizes": "--sample-sizes",
    "n_boot": "--n-boot",
    "reference_n": "--reference-n",
    "reference_steps": "--reference-steps",
}


def _sizes(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed; expected comma-separated integers, e.g. 500,1000,2000"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", help=f"one of {list(STUDIES)}")
    parser.add_argument("--quick", action="store_true", help="small grid and few replicates (< 1 minute)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the truth, the data and the fits")
    parser.add_argument("--out", help="run directory")
    parser.add_argument("--force", action="store_true", help="overwrite a finished run in --out")
    parser.add_argument("--replicates", type=int, help="replicates per sample size (default 20)")
    parser.add_argument("--sample-sizes", type=_sizes, help="comma-separated grid of n")
    model = parser.add_argument_group("model")
    model.add_argument("--d", type=int, help="input dimension d (default 4; 2 for softmax-vs-competition)")
    model.add_argument("--k-true", type=int, help="k*, the number of true experts (default 2)")
    model.add_argument(
        "--extra-experts", type=int, help="over-specified fits use k = k* + this many experts (default 1)"
    )
    model.add_argument(
        "--noise-var", type=float, help="noise variance ν of the regression studies (default 0.01)"
    )
    model.add_argument(
        "--tau", type=float, help="perturbation τ₁ = τ₂ of the perturbed cosine router (default 1)"
    )
    fit = parser.add_argument_group("fit")
    fit.add_argument("--optimizer", help=f"one of {list(OPTIMIZERS)} (default lbfgs)")
    fit.add_argument("--lr", type=float, help="learning rate (default 1.0: lbfgs's first trial step)")
    fit.add_argument(
        "--steps", "--max-iter", dest="steps", type=int,
        help="iteration cap per fit (epochs for mini-batch sgd; default 500)",
    )  # fmt: skip
    fit.add_argument("--gtol", type=float, help="lbfgs stops at a gradient max-norm <= this (default 1e-7)")
    fit.add_argument(
        "--ftol", type=float,
        help="lbfgs stops when an iteration changes the loss by <= ftol·max(1,|loss|) (default 1e-12)",
    )  # fmt: skip
    fit.add_argument(
        "--init", help=f"start {list(STUDY_INITS)}: near the truth + noise, or random (default near)"
    )
    fit.add_argument(
        "--restarts", type=int, help="starts per replicate; the lowest training loss is kept (default 1)"
    )
    fit.add_argument(
        "--beta1-bound", type=float,
        help="radius of the ball holding every ‖β₁ᵢ‖ (compact parameter space; default 10·√d; inf = unconstrained)",
    )  # fmt: skip
    fit.add_argument(
        "--eta-bound", type=float,
        help="radius of the ball holding every expert's ‖ηᵢ‖ (regression studies; default 10·√q; inf = unconstrained)",
    )  # fmt: skip
    fit.add_argument(
        "--nu-min", type=float,
        help="floor of the fitted variances ν (softmax-vs-competition; default 1/5 of the smallest true ν's range)",
    )  # fmt: skip
    fit.add_argument(
        "--reference-n",
        type=int,
        help="sample size of the reference fit Ḡ of the misspecified studies (default 128000)",
    )
    fit.add_argument("--reference-steps", type=int, help="iteration cap of the reference fit Ḡ (default 200)")
    fit.add_argument("--n-boot", type=int, help="bootstrap resamples for the CIs (default 2000)")
    parser.add_argument("--bench", action="store_true", help="benchmark batched vs looped fits and exit")


def _flag_error(exc: ValueError) -> ValueError:
    """``exc`` with the flag of the setting it names in front, e.g. ``--d: d=0 is not allowed ...``."""
    msg = str(exc)
    for name, flag in FLAGS.items():
        if msg.startswith((f"{name}=", f"{name}[")):
            return ValueError(f"{flag}: {msg}")
    return exc


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """The study configuration of parsed ``moelab simulate`` flags; a bad value raises a
    ``ValueError`` that names its flag."""
    try:
        return study_config(
            args.study, quick=args.quick, seed=args.seed, **{name: getattr(args, name) for name in FLAGS}
        )
    except ValueError as exc:
        raise _flag_error(exc) from None


def run(args: argparse.Namespace) -> int:
    if args.bench:
        result = bench()
        for key, value in result.items():
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
        return 0
    if args.study is None:
        raise ValueError(f"--study is required; choose one of {list(STUDIES)}")
    if args.study not in STUDIES:
        raise ValueError(f"--study {args.study!r} is not a study; choose one of {list(STUDIES)}")
    if args.out is None:
        raise ValueError("--out is required: the run directory to write")
    cfg = config_from_args(args)
    rundir = RunDir(args.out, force=args.force)
    try:
        result = run_study(cfg)
    except ValueError as exc:  # e.g. a --beta1-bound below the drawn truth's ‖β₁ᵢ‖
        raise _flag_error(exc) from None
    write_study(rundir, cfg, result)
    print(format_table(result.metrics))
    print(f"wrote {rundir.path} in {result.metrics['wall_seconds']:.1f} s")
    return 0


def write_study(rundir: RunDir, cfg: StudyConfig, result: StudyResult) -> None:
    """Write a study's files into ``rundir``; ``metrics.json``, last, marks the run finished."""
    rundir.write_config(result.metrics["config"])
    _write_csv(rundir.file("losses.csv"), result.losses)
    _write_csv(rundir.file("table.csv"), result.metrics["table"])
    _write_npz(rundir.file("estimates.npz"), result.estimates)
    _plot(rundir.file("rates.png"), cfg, result.metrics["means"], result.metrics["rates"])
    rundir.write_metrics(result.metrics)


def format_table(metrics: dict[str, Any]) -> str:
    """The per-n table, the slopes and the slope differences of a study, as printed text."""
    lines = [
        f"{'router':>16} {'setting':<16} {'loss':<8} {'n':>6} {'mean':>10} {'sd':>10} "
        f"{'95% CI of the mean':>23} {'conv':>5} {'cap':>5} {'bound':>5}"
    ]
    for t in metrics["table"]:
        lines.append(
            f"{t['router']:>16} {t['setting']:<16} {t['loss']:<8} {t['n']:>6} {t['mean']:>10.4g} "
            f"{t['sd']:>10.3g} [{t['ci_low']:>10.4g}, {t['ci_high']:>10.4g}] {t['converged']:>5.2f} "
            f"{t['hit_cap']:>5.2f} {t['at_bound']:>5.2f}"
        )
    lines.append("")
    for r in metrics["rates"]:
        ref = ", ".join(f"{t['slope']:+.3f}" for t in r["theory"]) or "none"
        lines.append(
            f"{r['router']:>16} {r['setting']:<16} {r['loss']:<8} slope {r['slope']:+.3f} "
            f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]  theory {ref}"
        )
    for d in metrics["differences"]:
        lines.append(
            f"{d['setting']:<16} {d['loss']:<8} slope({d['router_a']}) - slope({d['router_b']}) "
            f"{d['difference']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
        )
    return "\n".join(lines)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Plain NumPy arrays (``np.load(path)`` reads them with ``allow_pickle=False``), written
    atomically."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def _plot(path: Path, cfg: StudyConfig, means: list[dict], rates: list[dict]) -> None:
    """Log-log mean loss ± 2 sd with fitted lines (solid) and the reference slopes of
    :data:`moelab.stats.studies.THEORY` (dashed, through the panel's first mean), one panel per (setting, loss) — as the
    perturbed cosine router (2024), Fig. 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((m["setting"], m["loss"]) for m in means))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (setting, loss_name) in zip(axes[0], panels):
        for m, r in zip(means, rates):
            if (m["setting"], m["loss"]) != (setting, loss_name):
                continue
            n = np.array(m["n"], dtype=float)
            mean, std = np.array(m["mean"]), np.array(m["std"])
            lower = np.minimum(2 * std, mean * (1 - 1e-3))  # keep the bar on the log axis
            line = ax.errorbar(n, mean, yerr=[lower, 2 * std], fmt="o", capsize=3, label=None)
            color = line[0].get_color()
            ax.plot(n, np.exp(r["intercept"]) * n ** r["slope"], "-", color=color,
                    label=f"{r['router']}: n^{r['slope']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")  # fmt: skip
        firsts = [m["mean"][0] for m in means if (m["setting"], m["loss"]) == (setting, loss_name)]
        anchor = float(np.exp(np.mean(np.log(np.maximum(firsts, 1e-300)))))
        n = np.array(cfg.sample_sizes, dtype=float)
        for (slope, label), style in zip(theory_slopes(cfg.study, setting, loss_name), ("--", "-.", ":")):
            ax.plot(n, anchor * (n / n[0]) ** slope, style, color="black", alpha=0.6, label=f"theory {label}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sample size n")
        ax.set_ylabel(f"{loss_name} loss")
        ax.set_title(f"{cfg.study}: {setting}")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
