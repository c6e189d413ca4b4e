"""The Voronoi loss's infimum over a softmax gate's translations on random fits: the bracket's gap,
its time, and — with ``--against REV`` — how far above it the local search of an earlier revision
stopped (its ``translation_inf`` read from git, run on the same fits).

Fits are the truth's atoms, split over k > k* fitted atoms, moved by a common shift and per-atom
noise of scale ``spread`` (β₀, β₁; 0.3 × spread on η), losses D₁ (exponents 1 | 2) and D₂ (r̄).

    PYTHONPATH=src python benchmarks/translation_inf.py --against a45c3d9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from moelab.stats.measures import voronoi_d
from moelab.stats.translation import translation_inf

D = torch.float64
RBAR = {1: 1.0, 2: 4.0, 3: 6.0}
CASES = [  # (k, k*, d, spread, loss)
    (3, 2, 2, 0.3, "D1"), (3, 2, 2, 1.0, "D1"), (3, 2, 2, 2.0, "D1"), (3, 2, 4, 1.0, "D1"),
    (3, 2, 2, 0.3, "D2"), (3, 2, 2, 1.0, "D2"), (4, 3, 2, 1.0, "D2"), (3, 2, 4, 1.5, "D2"),
]  # fmt: skip


def fits(R: int, k: int, k_true: int, d: int, spread: float, loss: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    b0t, b1t = (
        torch.randn(R, k_true, generator=gen, dtype=D),
        torch.randn(R, k_true, d, generator=gen, dtype=D),
    )
    eta_t = torch.randn(R, k_true, 3, generator=gen, dtype=D)
    idx = [i % k_true for i in range(k)]
    b0 = b0t[:, idx] + spread * torch.randn(R, k, generator=gen, dtype=D)
    b1 = b1t[:, idx] + spread * torch.randn(R, 1, d, generator=gen, dtype=D)
    b1 = b1 + 0.3 * spread * torch.randn(R, k, d, generator=gen, dtype=D)
    eta = eta_t[:, idx] + 0.3 * spread * torch.randn(R, k, 3, generator=gen, dtype=D)
    if loss == "D1":
        ex = [(1.0, lambda m: 2.0)] * 2
    else:
        ex = [(1.0, lambda m: RBAR.get(m, 2.0 * m)), (1.0, lambda m: RBAR.get(m, 2.0 * m) / 2)]
    return b0, b0t, b1, b1t, eta, eta_t, ex


def old_search(rev: str):
    """``translation_inf`` of revision ``rev`` (a loss callable, β₀, β₁ and their truths)."""
    src = subprocess.run(
        ["git", "show", f"{rev}:src/moelab/stats/measures.py"], capture_output=True, text=True, check=True
    ).stdout
    src = src.replace("from .._validate", "from moelab._validate").replace(
        "from .voronoi", "from moelab.stats.voronoi"
    )
    namespace: dict = {}
    exec(compile(src, f"{rev}:measures.py", "exec"), namespace)
    return namespace["translation_inf"]


def timed(repeats: int, call, *args):
    """``call(*args)``'s result and the median of ``repeats`` wall times."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call(*args)
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicates", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--against", default="", help="a git revision whose translation_inf to compare")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (the median is printed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    old = old_search(args.against) if args.against else None
    head = f"{'k':>2} {'k*':>2} {'d':>2} {'spread':>6} {'loss':>4} {'largest gap':>12} {'time s':>7}"
    print(
        head + ("  old time s  old above: mean  max  share > 1e-6" if old else ""),
        f"(median of {args.repeats} calls)",
    )
    for k, k_true, d, spread, loss in CASES:
        b0, b0t, b1, b1t, eta, eta_t, ex = fits(args.replicates, k, k_true, d, spread, loss, args.seed)
        blocks = [(b1, b1t, *ex[0]), (eta, eta_t, *ex[1])]
        got, seconds = timed(args.repeats, translation_inf, b0, b0t, blocks)
        line = (
            f"{k:>2} {k_true:>2} {d:>2} {spread:>6} {loss:>4} {got.gap.max().item():>12.1e} {seconds:>7.2f}"
        )
        if old:

            def loss_of(beta0, beta1, ex=ex, eta=eta, eta_t=eta_t, b1t=b1t, b0t=b0t):
                return voronoi_d(beta0.exp(), [(beta1, b1t, *ex[0]), (eta, eta_t, *ex[1])], b0t.exp())

            before, old_seconds = timed(args.repeats, old, loss_of, b0, b1, b0t, b1t)
            above = ((before - got.value) / got.value).tolist()
            share = sum(a > 1e-6 for a in above) / len(above)
            line += f"  {old_seconds:>10.2f}  {statistics.mean(above):>15.2%}  {max(above):.2%}  {share:.0%}"
        print(line)


if __name__ == "__main__":
    main()
