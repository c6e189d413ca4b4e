"""``moelab merge-experts``: the merging half of :mod:`moelab.experiments.prune` (M-SMoE's groups,
averaged uniformly or by routed-token frequency), as its own subcommand."""

from __future__ import annotations

from .prune import add_merge_arguments as add_arguments
from .prune import run_merge as run

__all__ = ["add_arguments", "run"]
