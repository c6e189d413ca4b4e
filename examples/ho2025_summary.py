"""Summarise the Ho (2025) experiments of docs/results.md from their run folders: mean ± sd over seeds,
the 95 % Student-t interval of the mean and Welch's t-test against the baseline
(:mod:`moelab.experiments.summary`).

    python examples/ho2025_summary.py aa runs/h29/aa          # Active-Attention: test BPC per σ
    python examples/ho2025_summary.py vit runs/h29/vit        # Active-Attention: digits test accuracy per σ
    python examples/ho2025_summary.py rep runs/h29/rep        # RepLoRA vs LoRA: test accuracy per fraction
    python examples/ho2025_summary.py table runs/h29/ho2025   # the LM table: test BPC per method
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moelab.experiments.summary import format_interval, format_mean_sd, seed_summary, t_interval, welch


def _values(folder: Path, key: str) -> dict[int, float]:
    out = {}
    for run in sorted(folder.glob("seed*")):
        m = run / "metrics.json"
        if m.exists():
            out[int(run.name[4:])] = json.loads(m.read_text())[key]
    return out


def _row(name: str, values: list[float], base: list[float] | None, digits: int) -> str:
    s = seed_summary(values)
    cell = format_mean_sd(s["mean"], s["sd"], digits=digits)
    ci = _ci(values, digits)
    p = ""
    if base is not None and values is not base:
        w = welch(values, base)
        p = "n/a" if w.p is None else f"{w.p:.3g} (Δ {w.diff:+.{digits}f})"
    return f"| {name} | {len(values)} | {cell} | {ci} | {p} |"


def _ci(values: list[float], digits: int) -> str:
    return format_interval(t_interval(values), digits=digits)


def main(kind: str, root: str) -> None:
    root_path = Path(root)
    if kind == "aa":
        names = ["standard", "gelu", "tanh", "relu", "sigmoid", "silu"]
        key, digits, base_name, lower = "test_bpc", 4, "standard", "lower"
        groups = {n: _values(root_path / n, key) for n in names}
    elif kind == "vit":
        names = ["standard", "gelu", "tanh", "relu", "sigmoid", "silu"]
        key, digits, base_name, lower = "test_acc", 2, "standard", "higher"
        groups = {n: _values(root_path / n, key) for n in names}
    elif kind == "table":
        names = ["smoe", "sharede-v2", "sharede-v3", "smoe-sg"]
        key, digits, base_name, lower = "test_bpc", 4, "smoe", "lower"
        groups = {n: _values(root_path / n, key) for n in names}
    elif kind == "rep":
        names = [f"{a}-f{f}" for f in ("0.1", "0.3", "1.0") for a in ("lora", "replora")]
        key, digits, base_name, lower = "test_acc", 2, None, "higher"
        groups = {n: _values(root_path / n, key) for n in names}
    else:
        raise SystemExit(f"kind={kind!r}: expected aa, vit, table or rep")
    print(
        f"{key} ({lower} is better); p: Welch's two-sided t-test against the baseline (paired seeds not used)"
    )
    print("| run | n | mean ± sd | 95 % CI of the mean | Welch p (Δ) |")
    print("| --- | --- | --- | --- | --- |")
    for n in names:
        vals = [groups[n][s] for s in sorted(groups[n])]
        if not vals:
            print(f"| {n} | 0 | not run | | |")
            continue
        if kind == "rep":
            base_key = n.replace("replora", "lora")
            base = [groups[base_key][s] for s in sorted(groups[base_key])] if n != base_key else None
        else:
            base = [groups[base_name][s] for s in sorted(groups[base_name])] if n != base_name else None
        print(_row(n, vals, base if base else None, digits))


if __name__ == "__main__":
    main(*sys.argv[1:3])
