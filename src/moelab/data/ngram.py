"""n-gram count models of a corpus: the floor a trained language model should clear.

An order-``n`` model predicts a token from the ``n - 1`` before it by add-``k`` smoothed counts over
the training split, ``p(t | c) = (count(c, t) + k) / (count(c) + k·V)``; ``k`` is chosen on the
validation split from :data:`SMOOTHING`, and the test figure uses that ``k``.  Counting is one
``torch.unique`` over the n-gram ids of the training split and one ``searchsorted`` per evaluated
split: no Python loop over tokens, and any vocabulary whose ``V**n`` fits in int64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _validate
from .text import TextData

__all__ = ["SMOOTHING", "CountModel", "count_models"]

#: the add-k values tried on the validation split
SMOOTHING = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


@dataclass(frozen=True)
class CountModel:
    """An order-``order`` count model's cross-entropy (bits per token) on validation and test."""

    order: int
    k: float
    valid_bits: float
    test_bits: float

    def value(self, metric: str, split: str) -> float:
        """The ``split`` figure in ``metric`` units: ``bpc`` (bits per token) or ``ppl`` (``2**bits``)."""
        bits = self.valid_bits if split == "valid" else self.test_bits
        return bits if metric == "bpc" else 2.0**bits


def _ids(tokens: Tensor, order: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(context id, n-gram id) of every position with ``order - 1`` tokens before it."""
    n = tokens.numel() - order + 1
    context = torch.zeros(n, dtype=torch.int64)
    for j in range(order - 1):  # a loop over the order, not the tokens
        context = context * vocab + tokens[j : j + n]
    return context, context * vocab + tokens[order - 1 : order - 1 + n]


def _lookup(table: tuple[Tensor, Tensor], ids: Tensor) -> Tensor:
    """Training counts of ``ids`` (0 for ids never seen)."""
    keys, counts = table
    pos = torch.searchsorted(keys, ids).clamp_max(keys.numel() - 1)
    return torch.where(keys[pos] == ids, counts[pos], 0)


def _bits(full: Tensor, context: Tensor, k: float, vocab: int) -> float:
    p = (full.double() + k) / (context.double() + k * vocab)
    return float(-torch.log2(p).mean())


def count_models(data: TextData, orders: tuple[int, ...] = (1, 2, 3)) -> list[CountModel]:
    """The count model of each order in ``orders`` fitted on ``data.train``.

    Raises:
        ValueError: an order below 1, one whose ``V**order`` n-gram ids overflow int64, or one longer
            than a split.
    """
    vocab = data.vocab_size
    results = []
    for order in orders:
        _validate.positive_int("order", order)
        if order * math.log2(vocab) >= 63:
            raise ValueError(
                f"order={order} is not allowed for a vocabulary of {vocab}; expected vocab**order < 2**63"
            )
        shortest = min(data.split(name).numel() for name in ("train", "valid", "test"))
        if order > shortest:
            raise ValueError(
                f"order={order} is not allowed; expected at most {shortest} (the shortest split)"
            )
        context, full = _ids(data.train, order, vocab)
        tables = [torch.unique(ids, return_counts=True) for ids in (full, context)]
        splits = {}
        for name in ("valid", "test"):
            ctx_ids, full_ids = _ids(data.split(name), order, vocab)
            splits[name] = (_lookup(tables[0], full_ids), _lookup(tables[1], ctx_ids))
        k = min(SMOOTHING, key=lambda k: _bits(*splits["valid"], k, vocab))
        results.append(
            CountModel(order, k, _bits(*splits["valid"], k, vocab), _bits(*splits["test"], k, vocab))
        )
    return results
