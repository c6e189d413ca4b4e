"""``moelab routes diff A B``: where two route traces (:mod:`moelab.routes`) of the same batch route
tokens to other experts: per MoE layer the share of tokens whose set of experts differs, the share
that differs in at least one layer, and with ``--png`` the layer × position heat map."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..io.atomic import atomic_write_png
from ..routes import RoutesDiff, RouteTrace, diff

__all__ = ["add_arguments", "plot_diff", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="routes", metavar="ACTION", required=True)
    p = sub.add_parser("diff", help="where two route traces of one batch differ", description=__doc__)
    p.add_argument("a", metavar="A", help="a route trace (moelab.routes.RouteTrace.save)")
    p.add_argument("b", metavar="B", help="a route trace of the same batch")
    p.add_argument("--png", metavar="FILE", help="draw the layer x position share of differing tokens")


def plot_diff(result: RoutesDiff, path: str | Path, title: str = "") -> Path:
    """The ``(layers, L)`` share of tokens whose experts differ, as a heat map PNG."""
    from matplotlib.figure import Figure

    fig = Figure(
        figsize=(min(14, 3 + 0.12 * result.by_position.shape[1]), 1.5 + 0.35 * result.by_position.shape[0])
    )
    ax = fig.subplots()
    image = ax.imshow(result.by_position.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xlabel("position")
    ax.set_ylabel("MoE layer")
    ax.set_title(title or "share of tokens whose experts differ", fontsize=10)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return atomic_write_png(path, fig, dpi=100)


def run(args: argparse.Namespace) -> int:
    a, b = RouteTrace.load(args.a), RouteTrace.load(args.b)
    result = diff(a, b)
    for i, (share, n) in enumerate(zip(result.per_layer, result.tokens)):
        print(f"MoE layer {i}: {share:.2%} of {n} tokens route to another set of experts")
    if result.any_layer is not None:
        print(f"any layer: {result.any_layer:.2%} of the tokens")
    if args.png:
        if result.by_position is None:
            raise ValueError(
                "--png needs traces of batches with a position (inputs of shape (B, L, d), no token mask)"
            )
        print(f"wrote {plot_diff(result, args.png, f'{Path(args.a).name} vs {Path(args.b).name}')}")
    return 0
