"""A tiny MoE classifier on scikit-learn's digits (ships with scikit-learn: runs offline).

Trains the same small network with three routing methods and several seeds, and prints a
comparison table (test accuracy, mean ± std over seeds).  Usage::

    python examples/digits_demo.py --methods smoe xmoe pcosine --seeds 3 --out runs/demo
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn

import moelab
from moelab.io.rundir import RunDir
from moelab.schedules import build_schedule


class DigitsMoE(nn.Module):
    """8×8 digits → linear embedding → 2 residual MoE blocks → 10 classes."""

    def __init__(self, method: str, d_model: int = 64, num_experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(64, d_model)
        self.blocks = nn.ModuleList(
            [
                moelab.MoE(d_model, num_experts, top_k, d_hidden=64, method=method, activation="gelu")
                for _ in range(2)
            ]
        )
        self.norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(2)])
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for norm, moe in zip(self.norms, self.blocks):
            h = h + moe(norm(h))
        return self.head(h)


def load(seed: int = 0) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))  # fixed split
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def train_one(method: str, seed: int, epochs: int, data: tuple[torch.Tensor, ...]) -> float:
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model = DigitsMoE(method)
    steps_per_epoch = (len(x_tr) + 63) // 64
    total = epochs * steps_per_epoch
    # the competition schedule of competesmoe / densemoe (None for the other methods)
    schedule = build_schedule(method, num_layers=len(model.blocks), total_steps=total, seed=seed)
    ctx = moelab.RoutingContext(total_steps=total, schedule=schedule)
    moelab.attach(model, ctx)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x_tr), generator=gen).split(64):
            loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]) + moelab.aux_loss(model)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.advance()
    model.eval()
    with torch.no_grad():
        return (model(x_te).argmax(-1) == y_te).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["smoe", "xmoe", "pcosine"], choices=moelab.methods())
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument(
        "--out", type=Path, default=None, help="write config.yaml, results.csv, metrics.json here"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out run")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.epochs < 1:
        parser.error("--seeds and --epochs must be >= 1")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        run = RunDir(args.out, force=args.force) if args.out else None
    except (FileExistsError, NotADirectoryError) as exc:
        print(f"digits_demo: error: {exc}", file=sys.stderr)
        return 2
    if run:
        run.write_config(vars(args) | {"out": str(args.out)})
    data = load()
    results: dict[str, list[float]] = {}
    for method in args.methods:
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            acc = train_one(method, seed, args.epochs, data)
            results.setdefault(method, []).append(acc)
            print(f"  {method:<12} seed {seed}: test accuracy {acc:.4f}  ({time.perf_counter() - t0:.1f} s)")
            if run:
                run.append_log({"method": method, "seed": seed, "test_acc": acc}, name="results.csv")
    best = max(results, key=lambda m: statistics.mean(results[m]))
    print(f"\n{'method':<12} {'test accuracy (mean ± std over ' + str(args.seeds) + ' seeds)':<45}")
    for method, accs in results.items():
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        mark = "  *best" if method == best else ""
        print(f"{method:<12} {100 * statistics.mean(accs):6.2f} ± {100 * std:4.2f} %{mark}")
    if run:
        run.write_metrics(
            {m: {"test_acc_mean": statistics.mean(a), "test_acc": a} for m, a in results.items()}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
