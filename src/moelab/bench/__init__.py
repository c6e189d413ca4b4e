"""``moelab bench``: benchmarks that print medians and ratios (never timed tests).

``layer`` (:mod:`moelab.bench.layer`) times one layer against a dense FFN and transformers'
Mixtral block; ``compete`` (:mod:`moelab.bench.compete`) the competition's cost; ``suite``
(:mod:`moelab.bench.suite`; ``--device cuda``: :mod:`moelab.bench.gpu`) the whole grid against
every peer (:mod:`moelab.bench.peers`); ``lm`` (:mod:`moelab.bench.lm`) a language model's
training throughput.  The ``moelab benchmark`` command (:mod:`moelab.bench.routers`)
puts every router through one protocol: quality, balance, stability and cost.  The timing method is :mod:`moelab.bench.harness`.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["BENCHES", "add_arguments", "run"]

# ---------------------------------------------------------------------------------- registry
#: bench kind -> module providing ``add_arguments(parser)`` and ``run(args) -> int``, and a one-line
#: help.  A new kind adds one line here; a module that is not installed (a kind whose branch is
#: not merged yet) is left out of the CLI instead of breaking it.
BENCHES: dict[str, tuple[str, str]] = {
    "layer": ("moelab.bench.layer", "MoE layer vs dense FFN of equal active width and transformers' Mixtral"),
    "compete": ("moelab.bench.compete", "CompeteSMoE's competition cost over plain smoe"),
    "suite": (
        "moelab.bench.suite",
        "the grid: moelab, dense and peers over T, shapes, routing, threads",
    ),
    "lm": ("moelab.bench.lm", "LM training tokens/s per method vs the dense model of equal active width"),
}


def _kind_functions(module: str):
    mod = importlib.import_module(module)
    return mod.add_arguments, mod.run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="KIND", required=True)
    for name, (module, help_text) in BENCHES.items():
        add, run_fn = _kind_functions(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(_bench_run=run_fn)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
