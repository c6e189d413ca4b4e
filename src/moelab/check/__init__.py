"""``moelab check``: gradient parity of an MoE block under data, fully sharded and expert
parallelism, every expert kernel, capacity, ``torch.compile`` and activation checkpointing, against
one eager process (docs/check.md).

- :mod:`~moelab.check.targets`: what is checked (a moelab layer, a transformers block, torchtitan's
  MoE, a user's factory) and how each layout is applied to it.
- :mod:`~moelab.check.grid`: :func:`parity`, the grid of variants, their runs on gloo processes and the table.
"""

from .grid import TOLERANCES, ParityTable, Row, Variant, parity
from .targets import (
    HF_FAMILIES,
    LAYOUTS,
    Target,
    callable_target,
    hf_target,
    moelab_target,
    resolve,
    titan_target,
)

__all__ = [
    "HF_FAMILIES",
    "LAYOUTS",
    "TOLERANCES",
    "ParityTable",
    "Row",
    "Target",
    "Variant",
    "callable_target",
    "hf_target",
    "moelab_target",
    "parity",
    "resolve",
    "titan_target",
]
