"""The tasks the :class:`moelab.train.Trainer` trains: next-token prediction on a text corpus
(:class:`LMTask`) and text classification with a pre-trained LM (:class:`ClassificationTask`);
each samples a global batch, shards it over data-parallel ranks, computes the loss of a batch and
evaluates a split (the :class:`moelab.train.Task` protocol).  docs/architecture-flows.md ("The training
loop").
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from ..data.classification import ClassificationData
from ..data.text import TextData

__all__ = ["ClassificationTask", "LMTask", "encode_texts"]


class LMTask:
    """Next-token prediction on a :class:`moelab.data.text.TextData`.

    Training batches are ``batch_size`` windows of ``block_size + 1`` tokens at uniformly random
    offsets of the training split (the data-order generator is part of the checkpoint).
    Evaluation runs over consecutive non-overlapping blocks from the start of the split (at most
    ``max_tokens`` predicted tokens), each block with no context from the previous one, and
    reports the mean token loss, ``bpc = loss / ln 2`` or ``ppl = exp(loss)``
    (docs/references.md).  ``eval_batch`` blocks go through the model at once (default: 16, or
    for short blocks as many as make 4,096 tokens while their logits stay within 2**22 numbers: a
    forward of a few hundred tokens is mostly overhead); the figures do not depend on it.
    """

    def __init__(self, data: TextData, block_size: int, eval_batch: int | None = None) -> None:
        _validate.positive_int("block_size", block_size)
        if eval_batch is None:
            eval_batch = max(16, min(4096 // block_size, (1 << 22) // (block_size * data.vocab_size)))
        _validate.positive_int("eval_batch", eval_batch)
        data.check_block(block_size)
        self.data = data
        self.block_size = block_size
        self.eval_batch = eval_batch
        self.metric = data.metric
        self.lower_is_better = True

    def sample(self, generator: torch.Generator, batch_size: int, step: int = 0) -> tuple[Tensor, Tensor]:
        train, L = self.data.train, self.block_size
        ix = torch.randint(train.numel() - L, (batch_size,), generator=generator)
        windows = torch.stack([train[i : i + L + 1] for i in ix.tolist()])  # (B, L+1)
        return windows[:, :-1], windows[:, 1:]

    @staticmethod
    def shard(batch: tuple[Tensor, Tensor], rank: int, world: int) -> tuple[Tensor, Tensor]:
        x, y = batch
        return x[rank::world], y[rank::world]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        x, y = batch
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        logits = model(x)  # (B, L, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), y.numel()

    def evaluate(self, model: nn.Module, split: str, max_tokens: int | None) -> dict[str, float]:
        tokens = self.data.split(split)
        n = tokens.numel() - 1  # predicted tokens
        if max_tokens is not None:
            n = min(n, max_tokens)
        L = self.block_size
        device = next(model.parameters()).device
        total, count = 0.0, 0
        full = n // L
        inputs, targets = tokens[: full * L].view(full, L), tokens[1 : full * L + 1].view(full, L)
        for i in range(0, full, self.eval_batch):
            x, y = inputs[i : i + self.eval_batch].to(device), targets[i : i + self.eval_batch].to(device)
            logits = model(x)
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
        if n % L:  # the remainder as one shorter sequence
            x, y = (
                tokens[full * L : n].view(1, -1).to(device),
                tokens[full * L + 1 : n + 1].view(1, -1).to(device),
            )
            logits = model(x)
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
        loss = total / count
        value = loss / math.log(2) if self.metric == "bpc" else math.exp(min(loss, 700.0))
        return {"loss": loss, self.metric: value}


def encode_texts(tokenizer: Any, texts: list[str], block_size: int) -> tuple[Tensor, Tensor]:
    """Token ids ``(n, block_size)`` right-padded with 0 and the mask of real tokens."""
    ids = torch.zeros(len(texts), block_size, dtype=torch.int64)
    mask = torch.zeros(len(texts), block_size, dtype=torch.bool)
    for i, text in enumerate(texts):
        if tokenizer.level == "char":  # text8's alphabet: lower case, other characters → space
            text = "".join(c if c in tokenizer.alphabet else " " for c in text.lower())
        tokens = tokenizer.encode(text)
        if tokenizer.level == "word" and tokens.numel() and tokens[-1] == tokenizer.index[tokenizer.EOS]:
            tokens = tokens[:-1]
        tokens = tokens[:block_size]
        if tokens.numel() == 0:
            tokens = torch.zeros(1, dtype=torch.int64)
        ids[i, : tokens.numel()] = tokens
        mask[i, : tokens.numel()] = True
    return ids, mask


class ClassificationTask:
    """The :class:`moelab.train.Task` of fine-tuning: cross-entropy, accuracy (higher is better)."""

    metric = "acc"
    lower_is_better = False

    def __init__(
        self, data: ClassificationData, tokenizer: Any, block_size: int, eval_batch: int = 32
    ) -> None:
        _validate.positive_int("block_size", block_size)
        self.data = data
        self.eval_batch = _validate.positive_int("eval_batch", eval_batch)
        self.encoded = {
            s: (*encode_texts(tokenizer, data.texts[s], block_size), torch.tensor(data.labels[s]))
            for s in ("train", "valid", "test")
        }

    def sample(
        self, generator: torch.Generator, batch_size: int, step: int = 0
    ) -> tuple[Tensor, Tensor, Tensor]:
        ids, mask, labels = self.encoded["train"]
        ix = torch.randint(ids.shape[0], (batch_size,), generator=generator)
        return ids[ix], mask[ix], labels[ix]

    @staticmethod
    def shard(batch: tuple[Tensor, ...], rank: int, world: int) -> tuple[Tensor, ...]:
        return tuple(t[rank::world] for t in batch)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, int]:
        ids, mask, labels = batch
        return F.cross_entropy(model(ids, mask), labels), int(mask.sum())

    def evaluate(self, model: nn.Module, split: str, max_tokens: int | None) -> dict[str, float]:
        ids, mask, labels = self.encoded["valid" if split == "valid" else split]
        total, correct = 0.0, 0
        for i in range(0, ids.shape[0], self.eval_batch):
            logits = model(ids[i : i + self.eval_batch], mask[i : i + self.eval_batch])
            y = labels[i : i + self.eval_batch]
            total += F.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum())
        n = ids.shape[0]
        return {"loss": total / n, "acc": 100.0 * correct / n}
