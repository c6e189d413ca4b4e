"""``moelab simulate``: one convergence-rate study of :mod:`moelab.stats.studies` run into a run
directory through the run lifecycle (:mod:`moelab.experiments.runner`): :class:`SimulateConfig`
holds the flags, a ``None`` left to the study's own value and recorded resolved in
``config.yaml``; the run writes ``losses.csv``, ``table.csv``, ``estimates.npz``, ``rates.png``
and ``metrics.json``.  docs/results.md ("What a simulate run writes") says what each file holds;
docs/stats.md has an example.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import config as vocab
from ..config import MAX_COUNT, Interval, Options, setting
from ..io.atomic import atomic_write_bytes, atomic_write_png, atomic_write_text
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
from . import runner

__all__ = ["SIMULATE", "SimulateConfig", "add_arguments", "format_table", "run", "study_of", "write_study"]

_POSITIVE = (Interval(int, 1), None)
#: iterations, restarts: more than MAX_COUNT cannot finish
_COUNT = (Interval(int, 1, MAX_COUNT), None)
#: the fewest bootstrap resamples whose 2.5% quantile (numpy's linear one, at 0.025·(B − 1)) lies
#: above the smallest resample: a percentile interval of fewer is the range of the resamples
MIN_BOOT = 41
_NON_NEGATIVE = (Interval(float, 0), None)
#: a ball's radius: a number > 0, or inf (unconstrained)
_RADIUS = (Interval(float, 0, closed="neither"), Options((math.inf,)), None)


@dataclass
class SimulateConfig:
    """The settings of ``moelab simulate``: a study and the constants its flags set.  A field left
    ``None`` takes the study's value (:func:`moelab.stats.studies.study_config`, after the
    ``--quick`` reductions); the run records the values decided."""

    study: str = setting(help="the study", allowed=Options(STUDIES))
    quick: bool = setting(
        False, help="small grid and few replicates, every fit to convergence as in the full study"
    )
    seed: int = setting(
        0, help="seed of the truth, the data and the fits", allowed=Interval(int, 0, 2**63 - 1)
    )
    replicates: int | None = setting(
        None,
        help="replicates per sample size (default 20; at least 2: one replicate has no spread, so no "
        "95% CI of the mean)",
        allowed=(Interval(int, 2, MAX_COUNT), None),
    )
    sample_sizes: tuple[int, ...] | None = setting(
        None, help="grid of n, e.g. 500,1000,2000", metavar="N1,N2,..."
    )
    # the model
    d: int | None = setting(
        None, help="input dimension d (default 4; 2 for softmax-vs-competition)", allowed=_POSITIVE
    )
    k_true: int | None = setting(None, help="k*, the number of true experts (default 2)", allowed=_POSITIVE)
    extra_experts: int | None = setting(
        None, help="over-specified fits use k = k* + this many experts (default 1)", allowed=_POSITIVE
    )
    noise_var: float | None = setting(
        None, help="noise variance ν of the regression studies (default 0.01)", allowed=_NON_NEGATIVE
    )
    tau: float | None = setting(
        None, help="perturbation τ₁ = τ₂ of the perturbed cosine router (default 1)", allowed=_NON_NEGATIVE
    )
    # the fit
    optimizer: str | None = setting(
        None, help="optimizer (default lbfgs)", allowed=(Options(OPTIMIZERS), None)
    )
    lr: float | None = setting(
        None,
        help="learning rate (default 1.0: lbfgs's first trial step)",
        allowed=(Interval(float, 0, closed="neither"), None),
    )
    steps: int | None = setting(
        None,
        aliases=("--max-iter",),
        help="iteration cap per fit and per restart of a fit at the cap (epochs for mini-batch sgd; default 500, 1000 in the paper studies)",
        allowed=_COUNT,
    )
    gtol: float | None = setting(
        None, help="lbfgs stops at a gradient max-norm <= this (default 1e-7)", allowed=_NON_NEGATIVE
    )
    ftol: float | None = setting(
        None,
        help="lbfgs stops when an iteration changes the loss by <= ftol·max(1,|loss|) (default 1e-10)",
        allowed=_NON_NEGATIVE,
    )
    init: str | None = setting(
        None,
        help="start near the truth + noise, or random (default near)",
        allowed=(Options(STUDY_INITS), None),
    )
    restarts: int | None = setting(
        None, help="starts per replicate; the lowest training loss is kept (default 1)", allowed=_COUNT
    )
    beta1_bound: float | None = setting(
        None,
        help="radius of the ball holding every ‖β₁ᵢ‖ (compact parameter space; default 10·√d; inf = unconstrained)",
        allowed=_RADIUS,
    )
    eta_bound: float | None = setting(
        None,
        help="radius of the ball holding every expert's ‖ηᵢ‖ (regression studies; default 10·√q; inf = unconstrained)",
        allowed=_RADIUS,
    )
    nu_min: float | None = setting(
        None,
        help="floor of the fitted variances ν (softmax-vs-competition; default 1/5 of the smallest true ν's range)",
        allowed=_NON_NEGATIVE,
    )
    reference_n: int | None = setting(
        None,
        help="sample size of the reference fit Ḡ of the misspecified studies (default 128000)",
        allowed=_POSITIVE,
    )
    reference_steps: int | None = setting(
        None, help="iteration cap of the reference fit Ḡ (default 200)", allowed=_COUNT
    )
    n_boot: int | None = setting(
        None,
        help=f"bootstrap resamples for the CIs (default 2000; at least {MIN_BOOT}: with fewer the 2.5% and "
        "97.5% quantiles are the smallest and the largest resample, no 95% interval)",
        allowed=(Interval(int, MIN_BOOT, MAX_COUNT), None),
    )


#: the settings a flag sets (every field but the study's name, ``--quick`` and the seed)
_STUDY_FIELDS = tuple(f.name for f in dataclasses.fields(SimulateConfig))[3:]


def _flag_error(exc: ValueError) -> ValueError:
    """A study's ``ValueError`` naming a setting (``d=0 is not allowed ...``) in the flag's words
    (``--d=0 is not allowed ...``); setting names are the config's field names."""
    msg = str(exc)
    for name in _STUDY_FIELDS:
        if msg.startswith((f"{name}=", f"{name}[")):
            return ValueError(vocab.flag_of(SimulateConfig, name) + msg[len(name) :])
    return exc


def study_of(config: SimulateConfig) -> StudyConfig:
    """The study ``config`` describes (every constant); a bad value raises a ``ValueError``
    naming its flag."""
    overrides = {name: getattr(config, name) for name in _STUDY_FIELDS}
    if overrides["sample_sizes"] is not None:
        overrides["sample_sizes"] = list(overrides["sample_sizes"])
    try:
        return study_config(config.study, quick=config.quick, seed=config.seed, **overrides)
    except ValueError as exc:
        raise _flag_error(exc) from None


def resolve(config: SimulateConfig) -> SimulateConfig:
    """``config`` with the study's values where it left ``None``."""
    study = study_of(config)
    values = {name: getattr(study, name) for name in _STUDY_FIELDS}
    values["sample_sizes"] = tuple(values["sample_sizes"])
    return dataclasses.replace(config, **values)


def _execute(config: SimulateConfig, run: runner.Run) -> dict[str, Any]:
    if run.resume and run.dir.file("metrics.json").is_file():  # a finished study: its seed fixes it
        print(f"{run.path} holds this study, finished")
        return run.dir.read_metrics()
    cfg = study_of(config)
    run.write_config()
    try:
        result = run_study(cfg)
    except ValueError as exc:  # e.g. a --beta1-bound below the drawn truth's ‖β₁ᵢ‖
        raise _flag_error(exc) from None
    write_study(run.dir, cfg, result)
    print(format_table(result.metrics))
    print(f"wrote {run.path} in {result.metrics['wall_seconds']:.1f} s")
    return result.metrics


def _memory_need(config: SimulateConfig) -> int:
    """A lower bound (bytes) of what the batched fits hold at once: every replicate and restart keeps
    the largest sample's inputs, responses and the k experts' responsibilities in float64."""
    n = max(config.sample_sizes or (1,))
    k = (config.k_true or 2) + (config.extra_experts or 1)
    width = (config.d or 4) + k + 1
    fits = 8 * (config.replicates or 1) * (config.restarts or 1) * n * width
    return max(fits, 8 * (config.reference_n or 1) * width)  # the misspecified studies' reference fit


def _prepare(config: SimulateConfig, world: int) -> None:
    """Sizes that cannot fit in memory are refused before anything is allocated, naming the flag."""
    runner.check_memory(
        config, _memory_need, {"replicates": 20, "restarts": 1, "reference_n": 128000}, "the batched fits"
    )


#: ``moelab simulate`` as the run lifecycle sees it
SIMULATE = runner.Command("simulate", SimulateConfig, _execute, resolve=resolve, prepare=_prepare)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    vocab.add_arguments(parser, SimulateConfig)
    parser.add_argument("--bench", action="store_true", help="benchmark batched vs looped fits and exit")


def run(args: argparse.Namespace) -> int:
    if args.bench:
        result = bench()
        for key, value in result.items():
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
        return 0
    runner.run_command(SIMULATE, args)
    return 0


def write_study(rundir: RunDir, cfg: StudyConfig, result: StudyResult) -> None:
    """Write a study's files into ``rundir`` (``metrics.json``, which marks the run finished, is
    the run lifecycle's)."""
    _write_csv(rundir.file("losses.csv"), result.losses)
    _write_csv(rundir.file("table.csv"), result.metrics["table"])
    _write_npz(rundir.file("estimates.npz"), result.estimates)
    _plot(rundir.file("rates.png"), cfg, result.metrics["means"], result.metrics["rates"])


def format_table(metrics: dict[str, Any]) -> str:
    """The per-n table, the slopes beside the stated rates (blank where the papers state none) and
    the slope differences of a study, as printed text; a row whose replicates did not all
    converge says why."""
    lines = [
        f"{'router':>20} {'setting':<15} {'loss':<9} {'n':>6} {'mean':>10} {'sd':>10} "
        f"{'95% CI of the mean':>23} {'MC se':>9} {'conv':>5} {'cap':>5} {'bound':>5}  why not converged"
    ]
    for t in metrics["table"]:
        se = t.get("mc_se", "")
        lines.append(
            f"{t['router']:>20} {t['setting']:<15} {t['loss']:<9} {t['n']:>6} {t['mean']:>10.4g} "
            f"{t['sd']:>10.3g} [{t['ci_low']:>10.4g}, {t['ci_high']:>10.4g}] "
            f"{(f'{se:9.2g}' if se != '' else ''):>9} {t['converged']:>5.2f} "
            f"{t['hit_cap']:>5.2f} {t['at_bound']:>5.2f}  {t.get('why_not', '')}".rstrip()
        )
    lines.append("")
    for r in metrics["rates"]:
        head = f"{r['router']:>20} {r['setting']:<15} {r['loss']:<9} "
        if r.get("not_measured"):  # no slope of unconverged fits, beside a stated rate or not
            stated = ", ".join(f"{t['slope']:+.3f}" for t in r["theory"])
            lines.append(
                head + f"slope not measured: {r['not_measured']}" + (f"  theory {stated}" if stated else "")
            )
            continue
        ref = ", ".join(f"{t['slope']:+.3f} ({t['verdict']})" if "verdict" in t else f"{t['slope']:+.3f}"
                        for t in r["theory"])  # fmt: skip
        lines.append(
            head
            + f"slope {r['slope']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]  theory {ref}".rstrip()
            + f"  (converged {r['converged']:.0%})"
        )
    brackets: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for t in metrics["table"]:
        if t.get("gap", "") != "":  # a loss bracketed by a certified lower bound (runs before: none)
            brackets.setdefault((t["router"], t["setting"], t["loss"]), []).append(t)
    for (router, kind, loss), rows in brackets.items():
        lows = " / ".join(f"{t['lower']:.4g}" for t in rows)
        lines.append(
            f"{router:>20} {kind:<15} {loss:<9} infimum over translations bracketed: mean lower bound {lows}"
            f" (means above are the upper bounds), largest gap {max(t['gap'] for t in rows):.1e}"
        )
    for d in metrics["differences"]:
        lines.append(
            f"{d['setting']:<15} {d['loss']:<9} slope({d['router_a']}) - slope({d['router_b']}) "
            f"{d['difference']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
        )
    lines.extend(f"note: {note}" for note in metrics.get("notes", []))  # runs before notes existed have none
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
    for ax, (panel, loss_name) in zip(axes[0], panels):
        for m, r in zip(means, rates):
            if (m["setting"], m["loss"]) != (panel, loss_name):
                continue
            n = np.array(m["n"], dtype=float)
            mean, std = np.array(m["mean"]), np.array(m["std"])
            lower = np.minimum(2 * std, mean * (1 - 1e-3))  # keep the bar on the log axis
            line = ax.errorbar(n, mean, yerr=[lower, 2 * std], fmt="o", capsize=3, label=None)
            color = line[0].get_color()
            ax.plot(n, np.exp(r["intercept"]) * n ** r["slope"], "-", color=color,
                    label=f"{r['router']}: n^{r['slope']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")  # fmt: skip
        firsts = [m["mean"][0] for m in means if (m["setting"], m["loss"]) == (panel, loss_name)]
        anchor = float(np.exp(np.mean(np.log(np.maximum(firsts, 1e-300)))))
        n = np.array(cfg.sample_sizes, dtype=float)
        for (slope, label), style in zip(theory_slopes(cfg.study, panel, loss_name), ("--", "-.", ":")):
            ax.plot(n, anchor * (n / n[0]) ** slope, style, color="black", alpha=0.6, label=f"theory {label}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sample size n")
        ax.set_ylabel(f"{loss_name} loss")
        ax.set_title(f"{cfg.study}: {panel}")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=120)
