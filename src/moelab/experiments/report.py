"""``moelab report RUN_DIR...``: the comparison table and plots from finished runs, grouped by
method and by every ``--opt`` that differs between runs, each group's mean ± sd over seeds with the
Welch t-test against the reference group (CompeteSMoE (2024) Tables 2 and 9), the sensitivity
table of its Tables 4-5 when one option varies, and ``results.csv``, ``runs.csv`` and
``val_curves.png``.  docs/results.md ("Notes") describes the grouping and the files.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io.atomic import atomic_write_png, atomic_write_text, read_json, recording
from ..io.model import weights_digest
from ..io.rundir import read_yaml
from . import summary
from .html_report import escape, heat_map, line_chart, page, table

__all__ = [
    "COUNT_MODELS",
    "Group",
    "Run",
    "add_arguments",
    "collect_runs",
    "count_model_line",
    "group_runs",
    "read_count_models",
    "render",
    "run",
    "write_count_models",
    "write_html",
    "write_report",
]

#: the file ``moelab compare`` writes the corpus's n-gram count models into (order, k, val, test)
COUNT_MODELS = "count_models.csv"
_ORDERS = {1: "unigram", 2: "bigram", 3: "trigram"}


def count_model_line(tests: list[tuple[int, float]], metric: str) -> str:
    """The line under a comparison's table: each count model's ``(order, test figure)``."""
    figures = ", ".join(f"{_ORDERS.get(order, f'{order}-gram')} {value:.4f}" for order, value in tests)
    return f"count models of the training split (add-k, k chosen on validation), test {metric}: {figures}"


def write_count_models(folder: str | Path, models: list[Any], metric: str) -> str:
    """Write ``models`` (:class:`moelab.data.ngram.CountModel`) into ``folder``'s ``count_models.csv``
    (order, k, validation and test figure in ``metric`` units) and return :func:`count_model_line`."""
    rows = [f"order,k,val_{metric},test_{metric}"]
    rows += [
        f"{c.order},{c.k:g},{c.value(metric, 'valid'):.4f},{c.value(metric, 'test'):.4f}" for c in models
    ]
    atomic_write_text(Path(folder) / COUNT_MODELS, "\n".join(rows) + "\n")
    return count_model_line([(c.order, c.value(metric, "test")) for c in models], metric)


def read_count_models(folder: str | Path) -> str | None:
    """:func:`count_model_line` of ``folder``'s ``count_models.csv`` (``None`` where there is none)."""
    path = Path(folder) / COUNT_MODELS
    if not path.is_file():
        return None
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        metric = next(k for k in rows[0] if k.startswith("test_"))[len("test_") :]
        tests = [(int(r["order"]), float(r[f"test_{metric}"])) for r in rows]
    except (IndexError, KeyError, StopIteration, TypeError, ValueError):
        raise ValueError(
            f"{path} is not a count-model table of moelab compare; delete it or re-run compare"
        ) from None
    return count_model_line(tests, metric)


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    metrics: dict[str, Any]

    @property
    def metric(self) -> str:
        m = (self.config.get("recorded") or {}).get("metric")
        if m:
            return m
        for key in ("bpc", "ppl", "acc"):
            if f"test_{key}" in self.metrics:
                return key
        raise ValueError(f"run {self.path} has no test metric in metrics.json")

    @property
    def test(self) -> float:
        return float(self.metrics[f"test_{self.metric}"])

    def curve(self) -> tuple[list[int], list[float]]:
        """Validation metric against step from ``log.csv``."""
        path = self.path / "log.csv"
        steps, values = [], []
        if path.exists():
            with path.open(newline="") as f:
                for row in csv.DictReader(f):
                    v = row.get(f"val_{self.metric}")
                    if v:
                        steps.append(int(row["step"]))
                        values.append(float(v))
        return steps, values


@dataclass
class Group:
    label: str
    method: str
    settings: dict[str, Any]
    runs: list[Run] = field(default_factory=list)

    @property
    def values(self) -> list[float]:
        return [r.test for r in self.runs]

    @property
    def mean(self) -> float:
        return summary.mean(self.values)

    @property
    def std(self) -> float | None:
        """The sample standard deviation over the seeds; ``None`` for one run."""
        return summary.sd(self.values)


def collect_runs(paths: list[str | Path]) -> list[Run]:
    """Every finished run (a folder with ``config.yaml`` and ``metrics.json``) in or under ``paths``."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"run directory {str(p)!r} does not exist")
        if (p / "metrics.json").exists():
            found.append(p)
        else:
            found.extend(
                sorted(m.parent for m in p.glob("**/metrics.json") if (m.parent / "config.yaml").exists())
            )
    runs = []
    for p in dict.fromkeys(found):
        try:
            config = read_yaml(p / "config.yaml", repr(str(p / "config.yaml")), empty=True)
            metrics = read_json(p / "metrics.json")
        except (OSError, ValueError) as exc:  # one line: read_yaml's and read_json's sentences
            raise ValueError(f"run {p} cannot be read: {str(exc).splitlines()[0]}") from None
        runs.append(Run(p, config, metrics))
    if not runs:
        raise ValueError(f"no finished runs (metrics.json) found in {[str(p) for p in paths]}")
    return runs


#: run settings that do not change what a run measures (the seed is what a group is over)
_NOT_SETTINGS = {
    "command", "method", "seed", "opts", "recorded", "progress", "threads", "keep_ckpts", "ckpt_every",
}  # fmt: skip


def _settings(run: Run) -> dict[str, Any]:
    """The method options and every other run setting (budget, size, data, ...): runs that differ
    in one are never pooled into one row."""
    s = dict(run.config.get("opts") or {})
    s.update({k: v for k, v in run.config.items() if k not in _NOT_SETTINGS and k not in s})
    s.setdefault("arch", run.config.get("arch"))
    if "data_sha256" in (run.config.get("recorded") or {}):  # the same name, other bytes: other data
        s["data_sha256"] = run.config["recorded"]["data_sha256"][:12]
    return s


def group_runs(runs: list[Run]) -> list[Group]:
    """Group by method and by the options (and architecture) that vary between runs."""
    keys = sorted({k for r in runs for k in _settings(r)})
    varying = [k for k in keys if len({json.dumps(_settings(r).get(k), sort_keys=True) for r in runs}) > 1]
    groups: dict[str, Group] = {}
    for r in runs:
        method = str(r.metrics.get("method") or r.config.get("method"))
        settings = {k: _settings(r).get(k) for k in varying}
        label = method + "".join(f" {k}={v}" for k, v in settings.items() if v is not None)
        groups.setdefault(label, Group(label, method, settings)).runs.append(r)
    return list(groups.values())


#: what the tables print for a statistic the runs leave undefined (the sd of one run, a p-value
#: without two runs a side)
MISSING = "—"


def _fmt(x: float | None, digits: int = 4) -> str:
    return MISSING if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def render(groups: list[Group], reference: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The table (text) and its rows (for results.csv)."""
    metric = groups[0].runs[0].metric
    lower = metric != "acc"
    ref = next((g for g in groups if g.label == reference or g.method == reference), None)
    best = (min if lower else max)(groups, key=lambda g: g.mean)
    rows = []
    for g in groups:
        p = summary.welch(g.values, ref.values).p if ref is not None and g is not ref else None
        m = g.runs[0].metrics
        tps = [r.metrics.get("tokens_per_s") for r in g.runs if r.metrics.get("tokens_per_s")]
        rows.append(
            {
                "group": g.label,
                "method": g.method,
                **{k: v for k, v in g.settings.items()},
                "n": len(g.runs),
                f"test_{metric}_mean": g.mean,
                f"test_{metric}_std": g.std,
                f"val_{metric}_mean": _mean([r.metrics.get(f"val_{metric}") for r in g.runs]),
                "p_value": p,
                "params": m.get("params"),
                "active_params": m.get("active_params"),
                "tokens_per_s": sum(tps) / len(tps) if tps else None,
                "best": g is best,
                "competed": not _never_competed(g),
                "trained_share": _trained_share(g),
            }
        )
    trained = any(row["trained_share"] is not None for row in rows)
    direction = "lower" if lower else "higher"
    ref_name = ref.label if ref is not None else "none"
    header = f"{'method':<28} {'n':>2}  {'test ' + metric + ' (mean ± std)':<24} {'p vs ' + ref_name:>16}  {'params/active':>17}  {'tokens/s':>8}"
    if trained:  # fine-tuning runs: the share of the model's parameters trained (RepLoRA's "#Params (%)")
        header += f"  {'trained %':>9}"
    lines = [header, "-" * len(header)]
    for row, g in zip(rows, groups):
        cell = f"{_fmt(row[f'test_{metric}_mean'])} ± {_fmt(row[f'test_{metric}_std'])}"
        if row["best"]:
            cell += " *"
        pa = f"{_short(row['params'])}/{_short(row['active_params'])}"
        tps = f"{row['tokens_per_s']:.0f}" if row["tokens_per_s"] else "—"
        label = g.label + (" †" if _never_competed(g) else "")
        line = f"{label:<28} {row['n']:>2}  {cell:<24} {_fmt(row['p_value'], 3):>16}  {pa:>17}  {tps:>8}"
        if trained:
            share = row["trained_share"]
            line += f"  {'—' if share is None else f'{100 * share:.3g}':>9}"
        lines.append(line)
    uncompeted = [g.label for g in groups if _never_competed(g)]
    lines.append(f"* best ({direction} is better); p: two-sided Welch t-test against {ref_name} over seeds")
    if uncompeted:
        lines.append(
            f"† no competition step happened in {', '.join(uncompeted)}: the runs ended before the first "
            "step of their competition schedule, so they trained as plain top-K routing (train longer)"
        )
    reach = steps_to_reach_text(groups, ref) if ref is not None else ""
    for row, g in zip(rows, groups):
        row["steps_to_reference"] = steps_to_reach(g, ref) if ref is not None and g is not ref else None
    text = "\n".join(lines) + (f"\n\n{reach}" if reach else "")
    sweep = _sensitivity(groups, metric)
    if sweep:
        text += "\n\n" + sweep
    return text, rows


def steps_to_reach(group: Group, reference: Group) -> float | None:
    """Ho (2025)'s training-efficiency measure ("DeepSeek-V3 and DeepSeek-V2 consistently reach the
    final performance of Vanilla SMoE using only 70–80 % of the total training steps"): the first
    evaluation step at which ``group``'s validation curve (mean over its seeds) is at least as good
    as ``reference``'s final one (mean over its seeds, at its last evaluation), as a fraction of
    ``reference``'s last step.  ``None`` when either has no curve; ``inf`` when never reached."""
    ref_steps, ref_mean, _, _ = curve_stats(reference)
    steps, mean, _, _ = curve_stats(group)
    if not ref_steps or not steps:
        return None
    lower = group.runs[0].metric != "acc"
    target = ref_mean[-1]
    for step, value in zip(steps, mean):
        if (value <= target) if lower else (value >= target):
            return step / ref_steps[-1]
    return math.inf


def steps_to_reach_text(groups: list[Group], reference: Group) -> str:
    """The section of the report table: each group's :func:`steps_to_reach` of ``reference``."""
    ref_steps, ref_mean, _, _ = curve_stats(reference)
    others = [g for g in groups if g is not reference]
    if not ref_steps or not others:
        return ""
    metric = reference.runs[0].metric
    lines = [
        f"steps to reach {reference.label}'s final validation {metric} ({_fmt(ref_mean[-1])} at step "
        f"{ref_steps[-1]}), as a share of its steps (Ho (2025)); mean validation curves over seeds"
    ]
    for g in others:
        share = steps_to_reach(g, reference)
        if share is None:
            cell = "no validation curve"
        elif math.isinf(share):
            cell = f"not reached in {curve_stats(g)[0][-1]} steps"
        else:
            cell = f"{share:.0%} (step {round(share * ref_steps[-1])})"
        lines.append(f"  {g.label:<28} {cell}")
    return "\n".join(lines)


def _trained_share(group: Group) -> float | None:
    """The share of the model's parameters a fine-tuning trained (``trainable_params`` recorded by
    ``moelab finetune`` over the model's ``params``: RepLoRA's "#Params (%)" column), when every run
    of ``group`` records the same; ``None`` for runs that record none."""
    shares = set()
    for r in group.runs:
        trained, total = (r.config.get("recorded") or {}).get("trainable_params"), r.metrics.get("params")
        if not trained or not total:
            return None
        shares.add(trained / total)
    return shares.pop() if len(shares) == 1 else None


def _never_competed(group: Group) -> bool:
    """Every run of ``group`` has a competition schedule (``first_competition_step`` recorded) and
    none of them reached its first competition step."""
    return all(
        "first_competition_step" in r.metrics and r.metrics["first_competition_step"] is None
        for r in group.runs
    )


def _short(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "—"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return summary.mean(vals) if vals else None


def _sweep(groups: list[Group]) -> str | None:
    """The one option a comparison varies besides the architecture (``--sweep``), or ``None``."""
    keys = [k for k in groups[0].settings if k != "arch"]
    return keys[0] if len(keys) == 1 else None


def _value_order(text: str) -> tuple[int, float, str]:
    """Numbers in numeric order, then other values as written, ``null`` last."""
    value = json.loads(text)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (2 if value is None else 1, 0.0, text)


def _sensitivity_rows(groups: list[Group], key: str) -> tuple[list[str], dict[str, list[Group | None]]]:
    """The swept values in order and, per row (the method, and the architecture where it varies), the
    group of each value."""
    values = sorted({json.dumps(g.settings[key]) for g in groups}, key=_value_order)
    archs = sorted({str(g.runs[0].config.get("arch")) for g in groups})
    methods = list(dict.fromkeys(g.method for g in groups))
    rows: dict[str, list[Group | None]] = {}
    for method in methods:
        for arch in archs:
            cells = [
                next(
                    (
                        g
                        for g in groups
                        if g.method == method
                        and json.dumps(g.settings[key]) == v
                        and str(g.runs[0].config.get("arch")) == arch
                    ),
                    None,
                )
                for v in values
            ]
            if any(cells):
                label = arch if len(methods) == 1 else (method if len(archs) == 1 else f"{method} {arch}")
                rows[label] = cells
    return values, rows


def _sensitivity(groups: list[Group], metric: str) -> str:
    """CompeteSMoE (2024) Tables 4-5 (and Fig. 3 with ``--sweep top_k=...``): one varying option → a
    row per method (and architecture), a column per value."""
    key = _sweep(groups)
    if key is None:
        return ""
    values, rows = _sensitivity_rows(groups, key)
    head = f"{'sensitivity to ' + key:<24}" + "".join(f"{json.loads(v)!s:>10}" for v in values)
    lines = [head]
    for label, cells in rows.items():
        lines.append(f"{label:<24}" + "".join(f"{g.mean:>10.4f}" if g else f"{'—':>10}" for g in cells))
    return f"test {metric} by {key} (mean over seeds)\n" + "\n".join(lines)


def plot_sensitivity(groups: list[Group], path: Path) -> Path | None:
    """The test metric against the swept option's value, one line per method (mean over seeds, error
    bars ± one sd): CompeteSMoE (2024) Fig. 3 (BPC against the number of activated experts K) with
    ``--sweep top_k=1,2,4``.  ``None`` (nothing drawn) when no numeric option is swept."""
    key = _sweep(groups)
    if key is None:
        return None
    values, rows = _sensitivity_rows(groups, key)
    xs = [json.loads(v) for v in values]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = groups[0].runs[0].metric
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, cells in rows.items():
        points = [(x, g.mean, g.std or 0.0) for x, g in zip(xs, cells) if g is not None]
        ax.errorbar(
            [p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
            marker="o", capsize=3, label=label,
        )  # fmt: skip
    ax.set_xlabel(key)
    ax.set_ylabel(f"test {metric.upper()}")
    ax.set_title(f"Test {metric.upper()} against {key} (mean ± sd over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return atomic_write_png(path, fig, dpi=120)


def curve_stats(group: Group) -> tuple[list[int], list[float], list[float | None], int]:
    """The group's validation curve over its seeds: ``(steps, mean, sd, n_runs)`` at the steps every
    run with a curve has (sd is the sample standard deviation; ``None`` for one run)."""
    curves = [c for c in (r.curve() for r in group.runs) if c[0]]
    if not curves:
        return [], [], [], 0
    common = sorted(set.intersection(*(set(c[0]) for c in curves)))
    by_step = [dict(zip(*c)) for c in curves]
    means, sds = [], []
    for step in common:
        m, s = summary.mean_sd([c[step] for c in by_step])
        means.append(m)
        sds.append(s)
    return common, means, sds, len(curves)


def curve_table(groups: list[Group]) -> tuple[str, list[dict[str, Any]]]:
    """The per-step validation table: text (a row per step, a column per group, mean ± sd over
    seeds) and CSV rows (``group, step, n, mean, sd``)."""
    metric = groups[0].runs[0].metric
    stats = {g.label: curve_stats(g) for g in groups}
    rows = [
        {"group": label, "step": step, "n": n, f"val_{metric}_mean": m, f"val_{metric}_sd": sd}
        for label, (steps, mean, sds, n) in stats.items()
        for step, m, sd in zip(steps, mean, sds)
    ]
    all_steps = sorted({r["step"] for r in rows})
    labels = [g.label for g in groups if stats[g.label][0]]
    cells = {(r["group"], r["step"]): r for r in rows}

    def cell(label: str, step: int) -> str:
        r = cells.get((label, step))
        if r is None:
            return ""
        spread = r[f"val_{metric}_sd"]
        undefined = spread is None or math.isnan(spread)
        return _fmt(r[f"val_{metric}_mean"]) + ("" if undefined else f" ± {_fmt(spread)}")

    table = [["step", *labels]] + [[str(step), *(cell(lab, step) for lab in labels)] for step in all_steps]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    text = f"validation {metric} by step (mean ± sd over seeds)\n" + "\n".join(lines)
    return text, rows


def plot_curves(groups: list[Group], path: Path) -> Path:
    """Validation metric against step: each group's mean over its seeds, the band ± one sd shaded,
    one colour (and, past ten groups, line style) per group (CompeteSMoE (2024) Fig. 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = groups[0].runs[0].metric
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.get_cmap("tab10").colors
    styles = ["-", "--", ":", "-."]
    for i, g in enumerate(groups):
        steps, mean, sd, n = curve_stats(g)
        if not steps:
            continue
        colour = colours[i % len(colours)]
        ax.plot(
            steps, mean, color=colour, linestyle=styles[(i // len(colours)) % len(styles)],
            marker="o", markersize=3, label=f"{g.label} (n={n})",
        )  # fmt: skip
        if n > 1:
            low = [m - s for m, s in zip(mean, sd)]
            high = [m + s for m, s in zip(mean, sd)]
            ax.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"validation {metric.upper()}")
    ax.set_title(f"Validation {metric.upper()} during training (mean ± sd over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return atomic_write_png(path, fig, dpi=120)


def _csv_text(rows: list[dict[str, Any]]) -> str:
    import io

    fields: list[str] = []
    for r in rows:
        fields.extend(k for k in r if k not in fields)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
    return buf.getvalue()


def write_report(
    runs: list[Run], out: Path, reference: str | None = "competesmoe", header: str | None = None
) -> str:
    """Group ``runs``, write results.csv, runs.csv, val_curves.png and val_curves.csv (the per-step
    validation table) into ``out``; return the table (``header``, e.g. the loss settings, above it;
    the diagnostics and the per-step validation table below)."""
    groups = group_runs(runs)
    text, rows = render(groups, reference)
    if header:
        text = f"{header}\n{text}"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.csv", _csv_text(rows))
    run_rows = []
    for g in groups:
        for r in g.runs:
            metric = r.metric
            run_rows.append(
                {
                    "group": g.label,
                    "method": g.method,
                    "seed": r.metrics.get("seed"),
                    f"test_{metric}": r.test,
                    f"val_{metric}": r.metrics.get(f"val_{metric}"),
                    "train_loss": r.metrics.get("train_loss"),
                    "tokens_per_s": r.metrics.get("tokens_per_s"),
                    "path": str(r.path),
                }
            )
    atomic_write_text(out / "runs.csv", _csv_text(run_rows))
    plot_curves(groups, out / "val_curves.png")
    plot_sensitivity(groups, out / "sensitivity.png")
    curves_text, curve_rows = curve_table(groups)
    if curve_rows:
        atomic_write_text(out / "val_curves.csv", _csv_text(curve_rows))
    diagnostics = diagnostics_table(groups, reference)
    if diagnostics is not None:
        text += "\n\n" + diagnostics[0]
        atomic_write_text(out / "diagnostics.csv", _csv_text(diagnostics[1]))
        diagnostic_rows = plot_diagnostic_curves(groups, out / "diagnostics_curves.png")
        if diagnostic_rows:
            layer_curve_rows = plot_layer_curves(groups, out / "diagnostics_curves_layers.png")
            atomic_write_text(out / "diagnostics_curves.csv", _csv_text(diagnostic_rows + layer_curve_rows))
            text += (
                f"\nrouting curves over training ({tokens_note(groups)}): diagnostics_curves.png, "
                "diagnostics_curves.csv"
                + ("; per layer: diagnostics_curves_layers.png" if layer_curve_rows else "")
            )
        layer_rows = layer_diagnostics_rows(groups)
        if layer_rows:
            atomic_write_text(out / "diagnostics_layers.csv", _csv_text(layer_rows))
            plot_layer_diagnostics(groups, layer_rows, out / "diagnostics_layers.png")
            text += f"\nper-layer diagnostics ({tokens_note(groups)}): diagnostics_layers.png, diagnostics_layers.csv"
    if curve_rows:
        text += "\n\n" + curves_text
    atomic_write_text(out / "table.txt", text + "\n")
    return text


def run_diagnostics(run: Run) -> dict[str, Any] | None:
    """The run's ``diagnostics.json`` (``moelab diagnose``), or ``None`` where it has none."""
    f = run.path / "diagnostics.json"
    if not f.is_file():
        return None
    try:
        d = read_json(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{f} cannot be read ({exc}); run moelab diagnose {run.path} again") from None
    if isinstance(d, dict) and d.get("weights_sha256") and d["weights_sha256"] != weights_digest(run.path):
        raise ValueError(
            f"{f} describes other weights than the run holds now (it was trained on after moelab diagnose); "
            f"run moelab diagnose {run.path} again"
        )
    return d


def tokens_note(groups: list[Group]) -> str:
    """How many test tokens the diagnostics used: the first N of the test split, per run."""
    used = sorted(
        {d.get("tokens_used") for g in groups for r in g.runs if (d := run_diagnostics(r))} - {None}
    )
    if not used:
        return ""
    n = str(used[0]) if len(used) == 1 else f"{used[0]} to {used[-1]}"
    return f"on the first {n} test tokens"


def diagnostics_table(groups: list[Group], reference: str | None) -> tuple[str, list[dict[str, Any]]] | None:
    """The scalar routing diagnostics (``moelab diagnose``'s ``diagnostics.json`` in the runs):
    mean ± sd over each group's runs and the Welch p against the reference group (the reference's
    own line says ``reference``); a diagnostic no run has is named on one line, not given an empty
    heading.  ``None`` when no run has been diagnosed."""
    from .diagnose import SCALARS

    def values(g: Group, key: str) -> list[float]:
        out = []
        for r in g.runs:
            v = (run_diagnostics(r) or {}).get(key)
            if v is not None:
                out.append(float(v))
        return out

    if not any(run_diagnostics(r) is not None for g in groups for r in g.runs):
        return None
    ref = next((g for g in groups if g.label == reference or g.method == reference), None)
    lines = [f"routing diagnostics (moelab diagnose, {tokens_note(groups)}): mean ± sd over runs, Welch p "
             f"against {ref.label if ref else '—'}"]  # fmt: skip
    rows = []
    absent = []
    for key in SCALARS:
        if not any(values(g, key) for g in groups):
            absent.append(key)
            continue
        lines.append(f"  {key}")
        for g in groups:
            v = values(g, key)
            if not v:
                continue
            m, s = summary.mean_sd(v)
            if g is ref:
                p, p_text = None, "reference"
            else:
                p = summary.welch(v, values(ref, key)).p if ref is not None else None
                p_text = "p=" + (MISSING if p is None or math.isnan(p) else f"{p:.3g}")
            lines.append(f"    {g.label:<28} {_fmt(m):>10} ± {_fmt(s)} (n={len(v)})  {p_text}")
            rows.append({"diagnostic": key, "group": g.label, "mean": m, "sd": s, "n": len(v), "p": p})
    if absent:
        # null in a file: the run cannot have it; missing: the file predates the key
        why = {
            "expert_change_rate": "fewer than two kept checkpoints: train with --ckpt-every N --keep-ckpts all",
            "saturation_area": "fewer than two kept checkpoints",
            "swap_top1_delta": "top_k = num_experts",
            "swap_topk_delta": "top_k = num_experts",
            "router_entropy_mean": "no router distribution",
            "router_entropy_sd_mean": "no router distribution",
        }
        files = [d for g in groups for r in g.runs if (d := run_diagnostics(r)) is not None]
        named = [f"{k} ({why.get(k, 'null')})" for k in absent if any(k in d for d in files)]
        missing = [k for k in absent if not any(k in d for d in files)]
        if missing:
            named.append(f"{', '.join(missing)} (not in diagnostics.json: run moelab diagnose again)")
        lines.append("  not in any run: " + "; ".join(named))
    return "\n".join(lines), rows


#: the curves over training ``report`` draws with seed bands: diagnostics.json key and panel title
CURVES = (
    ("saturation_mean", "router saturation vs final checkpoint"),
    ("change_rate_mean", "change rate vs previous checkpoint"),
    ("jain_curve_mean", "Jain's index of the load"),
)


def diagnostic_curve_stats(group: Group, key: str) -> tuple[list[int], list[float], list[float | None], int]:
    """A diagnostics curve (``key`` of :data:`CURVES`, the mean over layers) over the group's diagnosed
    runs with curves: ``(steps, mean, sd, n_runs)`` at the steps every such run has a value at (sd: the
    sample standard deviation, ``None`` for one run)."""
    curves = []
    for r in group.runs:
        d = run_diagnostics(r) or {}
        if d.get(key) is not None and d.get("curve_steps"):
            curves.append({s: v for s, v in zip(d["curve_steps"], d[key]) if v is not None})
    if not curves:
        return [], [], [], 0
    common = sorted(set.intersection(*(set(c) for c in curves)))
    stats = [summary.mean_sd([c[step] for c in curves]) for step in common]
    return common, [m for m, _ in stats], [s for _, s in stats], len(curves)


def plot_diagnostic_curves(groups: list[Group], path: Path) -> list[dict[str, Any]]:
    """Ho (2025)'s curves over training per group (router saturation, change rate, Jain's index; each
    the mean over layers): the mean over the group's runs with a band ± one sd, a panel each; drawn
    only where some run has curves.  Returns the CSV rows (``curve, group, step, n, mean, sd``)."""
    rows = []
    for key, _ in CURVES:
        for g in groups:
            steps, mean, sd, n = diagnostic_curve_stats(g, key)
            rows += [
                {"curve": key, "layer": "mean", "group": g.label, "step": st, "n": n, "mean": m, "sd": s}
                for st, m, s in zip(steps, mean, sd)
            ]
    if not rows:
        return rows
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(13, 4))
    colours = plt.get_cmap("tab10").colors
    for ax, (key, title) in zip(axes, CURVES):
        for i, g in enumerate(groups):
            steps, mean, sd, n = diagnostic_curve_stats(g, key)
            if not steps:
                continue
            colour = colours[i % len(colours)]
            ax.plot(steps, mean, color=colour, marker="o", markersize=3, label=f"{g.label} (n={n})")
            if n > 1:
                low = [m - (s or 0.0) for m, s in zip(mean, sd)]
                high = [m + (s or 0.0) for m, s in zip(mean, sd)]
                ax.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"routing over training, mean over layers (mean ± sd over seeds), {tokens_note(groups)}", fontsize=10
    )
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=120)
    return rows


#: the per-layer diagnostics ``report`` draws against the layer (CompeteSMoE (2025) Figs. 9-10; Ho (2025))
LAYER_DIAGNOSTICS = (
    ("jain", "Jain's index"),
    ("selection_entropy", "selection-frequency entropy (nats)"),
    ("topk_weight_entropy", "top-K weight entropy (nats)"),
    ("router_entropy", "router entropy (nats)"),
)
#: the per-layer curves over training ``report`` draws, a row per curve and a column per layer
LAYER_CURVES = (
    ("saturation", "saturation vs final"),
    ("change_rate", "change rate vs previous"),
    ("jain_curve", "Jain's index"),
)


def _layer_values(group: Group, key: str) -> list[list[float]]:
    """Per diagnosed run of ``group`` with ``key``: its per-layer list (``null`` entries dropped runs)."""
    out = []
    for r in group.runs:
        v = (run_diagnostics(r) or {}).get(key)
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out.append([float(x) for x in v])
    return out


def layer_diagnostics_rows(groups: list[Group]) -> list[dict[str, Any]]:
    """Per group, diagnostic of :data:`LAYER_DIAGNOSTICS` and layer: mean and sample sd over the runs
    (``diagnostic, group, layer, n, mean, sd``); runs with another number of layers than the group's
    first are left out of that diagnostic."""
    rows = []
    for key, _ in LAYER_DIAGNOSTICS:
        for g in groups:
            runs = _layer_values(g, key)
            runs = [v for v in runs if len(v) == len(runs[0])] if runs else []
            for layer, values in enumerate(zip(*runs)):
                m, sd = summary.mean_sd(list(values))
                rows.append(
                    {
                        "diagnostic": key,
                        "group": g.label,
                        "layer": layer,
                        "n": len(values),
                        "mean": m,
                        "sd": sd,
                    }
                )
    return rows


def _layer_curve_stats(
    group: Group, key: str, layer: int
) -> tuple[list[int], list[float], list[float | None], int]:
    curves = []
    for r in group.runs:
        d = run_diagnostics(r) or {}
        if d.get(key) and d.get("curve_steps"):
            curves.append(
                {
                    s: row[layer]
                    for s, row in zip(d["curve_steps"], d[key])
                    if row is not None and layer < len(row)
                }
            )
    curves = [c for c in curves if c]
    if not curves:
        return [], [], [], 0
    common = sorted(set.intersection(*(set(c) for c in curves)))
    stats = [summary.mean_sd([c[step] for c in curves]) for step in common]
    return common, [m for m, _ in stats], [s for _, s in stats], len(curves)


def plot_layer_diagnostics(groups: list[Group], rows: list[dict[str, Any]], path: Path) -> None:
    """Each per-layer diagnostic against the layer, a line per group (mean over its runs, error bars ±
    one sd): the selection-frequency and top-K-weight entropies of CompeteSMoE (2025) Figs. 9-10, Jain's
    index (Ho (2025)) and the router entropy (CompeteSMoE (2024) Table 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(LAYER_DIAGNOSTICS), figsize=(4 * len(LAYER_DIAGNOSTICS), 3.8))
    for ax, (key, title) in zip(axes, LAYER_DIAGNOSTICS):
        for g in groups:
            mine = [r for r in rows if r["diagnostic"] == key and r["group"] == g.label]
            if mine:
                ax.errorbar(
                    [r["layer"] for r in mine], [r["mean"] for r in mine], yerr=[r["sd"] or 0.0 for r in mine],
                    marker="o", markersize=3, capsize=3, label=f"{g.label} (n={mine[0]['n']})",
                )  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("MoE layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"per-layer routing diagnostics (mean ± sd over seeds), {tokens_note(groups)}", fontsize=10)
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=120)


def plot_layer_curves(groups: list[Group], path: Path) -> list[dict[str, Any]]:
    """Ho (2025)'s curves per layer: a row per curve of :data:`LAYER_CURVES`, a column per MoE layer, a
    line per group (mean over its runs, band ± one sd).  Returns the CSV rows (``curve, layer, group,
    step, n, mean, sd``); none (nothing drawn) without curves."""
    layers = max(
        (
            len(row)
            for g in groups
            for r in g.runs
            for row in (run_diagnostics(r) or {}).get("saturation") or []
        ),
        default=0,
    )
    if layers == 0:
        return []
    rows = []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(
        len(LAYER_CURVES), layers, figsize=(3.2 * layers + 1, 2.6 * len(LAYER_CURVES)), squeeze=False
    )
    colours = plt.get_cmap("tab10").colors
    for row, (key, title) in enumerate(LAYER_CURVES):
        for layer in range(layers):
            ax = axes[row][layer]
            for i, g in enumerate(groups):
                steps, mean, sd, n = _layer_curve_stats(g, key, layer)
                if not steps:
                    continue
                rows += [
                    {"curve": key, "layer": layer, "group": g.label, "step": st, "n": n, "mean": m, "sd": v}
                    for st, m, v in zip(steps, mean, sd)
                ]
                colour = colours[i % len(colours)]
                ax.plot(steps, mean, color=colour, marker="o", markersize=2, label=f"{g.label} (n={n})")
                if n > 1:
                    low = [m - (s or 0.0) for m, s in zip(mean, sd)]
                    high = [m + (s or 0.0) for m, s in zip(mean, sd)]
                    ax.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
            ax.set_title(f"{title}, layer {layer}", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if row == len(LAYER_CURVES) - 1:
                ax.set_xlabel("step")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(
        f"routing over training per layer (mean ± sd over seeds), {tokens_note(groups)}", fontsize=10
    )
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=120)
    return rows


# ------------------------------------------------------------------ the HTML page (report --html)
#: the routing columns of ``log.csv`` the page draws over training: column and title
LOG_CURVES = (
    ("max_vio", "MaxVio of the step's load (mean over layers)"),
    ("load_cv", "load coefficient of variation (mean over layers)"),
    ("router_entropy", "router entropy, nats (mean over layers)"),
)


def _log_column(run: Run, column: str) -> dict[int, float]:
    path = run.path / "log.csv"
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        return {int(row["step"]): float(row[column]) for row in csv.DictReader(f) if row.get(column)}


def log_curve_stats(group: Group, column: str) -> tuple[list[int], list[float], list[float | None], int]:
    """The group's ``log.csv`` column over its seeds: ``(steps, mean, sd, n_runs)`` at the steps every
    run with the column has."""
    curves = [c for c in (_log_column(r, column) for r in group.runs) if c]
    if not curves:
        return [], [], [], 0
    common = sorted(set.intersection(*(set(c) for c in curves)))
    stats = [summary.mean_sd([c[s] for c in curves]) for s in common]
    return common, [m for m, _ in stats], [s for _, s in stats], len(curves)


def _series(groups: list[Group], stats) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        steps, mean, sd, n = stats(g)
        out.append({"label": f"{g.label} (n={n})", "x": steps, "y": mean, "sd": sd if n > 1 else None})
    return out


def _layer_heat_maps(groups: list[Group]) -> list[str]:
    """Per group, the per-layer Jain index of the load over the kept checkpoints (``moelab diagnose``'s
    ``jain_curve``), averaged over the group's diagnosed runs."""
    maps = []
    for g in groups:
        curves = []
        for r in g.runs:
            d = run_diagnostics(r) or {}
            if d.get("jain_curve") and d.get("curve_steps"):
                curves.append(dict(zip(d["curve_steps"], d["jain_curve"])))
        curves = [c for c in curves if c]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        layers = min(len(row) for c in curves for row in c.values() if row)
        values = []
        for layer in range(layers):
            row = []
            for s in steps:
                vs = [c[s][layer] for c in curves if c[s] and c[s][layer] is not None]
                row.append(sum(vs) / len(vs) if vs else None)
            values.append(row)
        maps.append(
            heat_map(
                f"{g.label}: Jain's index of the load per layer (n={len(curves)})",
                [f"layer {i}" for i in range(layers)],
                steps,
                values,
            )
        )
    return [m for m in maps if m]


def write_html(
    runs: list[Run], path: str | Path, reference: str | None = None, benchmark: str | None = None
) -> Path:
    """Write the report of ``runs`` (grouped as ``moelab report`` groups them; p-values against
    ``reference``) to ``path`` as one self-contained HTML page (:mod:`.html_report`): the comparison
    table, the validation curves with seed bands, the routing ``log.csv`` measured while training
    (MaxVio, load CV, router entropy), the curves over training of ``moelab diagnose`` and the
    per-layer Jain heat maps where the runs have them; ``benchmark``: the text of a
    ``benchmark.md`` to include.  Returns ``path``."""
    groups = group_runs(runs)
    metric = groups[0].runs[0].metric
    text, rows = render(groups, reference)
    sections = [
        "<h2>Comparison</h2>",
        table(rows, MISSING),
        f'<p class="note">test {escape(metric)} of each group: mean ± sd over seeds and Welch p against '
        f"{escape(reference or MISSING)}; as <code>moelab report</code> prints it:</p><pre>{escape(text)}</pre>",
        "<h2>Validation during training</h2>",
        line_chart(
            f"validation {metric} (mean ± sd over seeds)",
            "step",
            f"validation {metric}",
            _series(groups, curve_stats),
        ),
        "<h2>Routing while training (log.csv)</h2>",
    ]
    for column, title in LOG_CURVES:
        sections.append(
            line_chart(title, "step", column, _series(groups, lambda g, c=column: log_curve_stats(g, c)))
        )
    diagnosed = any(run_diagnostics(r) is not None for g in groups for r in g.runs)
    sections.append("<h2>Routing diagnostics over training (moelab diagnose)</h2>")
    if diagnosed:
        sections.append(f'<p class="note">{escape(tokens_note(groups))}</p>')
        for key, title in CURVES:
            stats = lambda g, k=key: diagnostic_curve_stats(g, k)
            sections.append(line_chart(title, "step", key, _series(groups, stats)))
        maps = _layer_heat_maps(groups)
        sections += maps or [
            '<p class="note">no per-layer curves: train with --keep-ckpts all, then diagnose</p>'
        ]
    else:
        sections.append('<p class="note">no run has been diagnosed: <code>moelab diagnose RUN_DIR</code></p>')
    if benchmark:
        sections += ["<h2>Benchmark</h2>", f"<pre>{escape(benchmark)}</pre>"]
    page_text = page(
        f"moelab report: {', '.join(g.label for g in groups)}",
        f"{len(runs)} runs in {len(groups)} groups",
        sections,
    )
    path = Path(path)
    atomic_write_text(path, page_text)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories or folders of runs")
    p.add_argument("--reference", default="competesmoe", help="group the p-values compare against")
    p.add_argument(
        "--out", help="where to write results.csv, runs.csv, val_curves.png (default: first RUN_DIR)"
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write the report as one self-contained HTML page (figures inline, no network to view it)",
    )


def run(args: argparse.Namespace) -> int:
    runs = collect_runs(args.runs)
    out = Path(args.out) if args.out else Path(args.runs[0])
    if not args.out and (out / "metrics.json").exists():
        out = out / "report"
    out.mkdir(parents=True, exist_ok=True)
    # listed in the manifests of out and of the run it lies in: --force removes the report too
    with recording(out, *([out.parent] if out.name == "report" and not args.out else [])):
        return _report(args, runs, out)


def _report(args: argparse.Namespace, runs: list[Run], out: Path) -> int:
    reference = args.reference
    if not any(str(r.metrics.get("method")) == reference for r in runs):
        first = str(runs[0].metrics.get("method"))
        print(f"reference {reference!r} has no runs here; p-values are against {first!r}")
        reference = first
    print(write_report(runs, out, reference))
    for line in filter(None, map(read_count_models, dict.fromkeys(args.runs))):
        print(line)
    print(f"wrote {out / 'results.csv'}, {out / 'runs.csv'}, {out / 'val_curves.png'}")
    if args.html:
        bench = Path(args.runs[0]) / "benchmark.md"
        print(
            f"wrote {write_html(runs, args.html, reference, bench.read_text() if bench.is_file() else None)}"
        )
    return 0
