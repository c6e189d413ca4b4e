"""The image-classification task of the expert-specialization lab (Krishnamurthy et al. (2023)): the
:class:`moelab.train.Task` that trains an output-mixture :class:`moelab.models.vision.ImageMoE` (or
the single model) on the mixture NLL plus the gate regulariser, in epochs of shuffled mini-batches
whose order is a pure function of the seed and the step.  See docs/specialization.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .. import _validate
from ..data.images import ImageData
from ..losses import importance_loss, sample_similarity_loss

__all__ = ["REGULARISERS", "ImageTask", "MixtureOutput", "evaluate", "image_digest"]

#: the gate regularisers: none, ``w · CV(Σ_x p)`` (Krishnamurthy et al. (2023) eq. 7), ``L_s`` (eq. 8-10)
REGULARISERS = ("none", "importance", "ls")


class MixtureOutput(Protocol):
    """What the task reads of an output-mixture model's output (:class:`moelab.models.vision.MoEOutput`
    is one): the class distribution ``probs (B, K)``, the gate's ``gate_probs (B, N)`` and the
    mixture NLL of the labels.  Training knows the output by what it offers, not by the model
    package that makes it (moelab.train imports nothing of moelab.models)."""

    probs: Tensor
    gate_probs: Tensor

    def nll(self, labels: Tensor) -> Tensor: ...


@torch.no_grad()
def evaluate(
    model: nn.Module, x: Tensor, y: Tensor, top_k: int | None = None, chunk: int = 2048
) -> dict[str, Any]:
    """Error, mixture NLL, gate probabilities and predictions of ``model`` on ``(x, y)`` (eval mode)."""
    was = model.training
    model.eval()
    errors, nll, probs, preds = 0, 0.0, [], []
    for xc, yc in zip(x.split(chunk), y.split(chunk)):
        out = model(xc, top_k=top_k)
        pred = out.probs.argmax(-1)
        errors += int((pred != yc).sum())
        nll += float(out.nll(yc)) * len(yc)
        probs.append(out.gate_probs)
        preds.append(pred)
    model.train(was)
    return {
        "error": errors / len(y),
        "loss": nll / len(y),
        "gate_probs": torch.cat(probs),
        "predictions": torch.cat(preds),
    }


def image_digest(data: ImageData) -> str:
    """sha256 of the tensors a run trains and tests on (the run's recorded data fingerprint)."""
    h = hashlib.sha256()
    for t in (data.x_train, data.y_train, data.x_test, data.y_test):
        a = t.detach().cpu().contiguous().numpy()
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


class ImageTask:
    """Image classification with an output-mixture model (:class:`moelab.models.vision.MoEOutput`).

    Training runs in epochs: the batches of epoch ``e`` are consecutive slices of ``batch_size``
    samples (the last one shorter) of a permutation drawn from ``(seed, e)`` alone, so the batch of
    a step depends on nothing a checkpoint would have to hold.  The loss is the NLL of
    ``log(Σ_e p(e|x) y_e(x) + 1e-7)`` plus the regulariser on the gate's ``p(e|x)``: ``reg="importance"``
    ``w_importance · CV(Σ_x p)`` (:func:`moelab.losses.importance_loss`), ``reg="ls"``
    :func:`moelab.losses.sample_similarity_loss` on the normalised pixels.  Evaluation reports the
    error and the NLL on the test set (the lab has no validation split: ``valid`` is the test set,
    logged once an epoch as the paper's curves are).

    Args:
        data: the train and test tensors.
        batch_size: samples a step.
        seed: the seed of the epochs' permutations.
        reg, w_importance, beta_s, beta_d: the regulariser and its weights.
        output: ``output(model, x, y) -> MixtureOutput`` in place of ``model(x)`` (training experts on
            a fixed assignment); no regulariser then applies.
        frozen: modules kept in eval mode while training (their BatchNorm statistics stay).
    """

    metric = "error"
    lower_is_better = True

    def __init__(
        self,
        data: ImageData,
        batch_size: int,
        seed: int = 0,
        *,
        reg: str = "none",
        w_importance: float = 0.0,
        beta_s: float = 0.0,
        beta_d: float = 0.0,
        output: Callable[[nn.Module, Tensor, Tensor], MixtureOutput] | None = None,
        frozen: tuple[nn.Module, ...] = (),
    ) -> None:
        self.data = data
        self.batch_size = _validate.positive_int("batch_size", batch_size)
        self.seed = seed
        self.reg = _validate.one_of("reg", reg, REGULARISERS)
        self.w_importance, self.beta_s, self.beta_d = w_importance, beta_s, beta_d
        self.output = output
        self.frozen = frozen
        n = len(data.y_train)
        self.steps_per_epoch = -(-n // batch_size)
        self._order: tuple[int, Tensor] | None = None  # a cache of the last epoch's permutation

    def permutation(self, epoch: int) -> Tensor:
        """The order of the training samples in ``epoch`` (a pure function of the seed and ``epoch``)."""
        if self._order is None or self._order[0] != epoch:
            key = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
            self._order = (epoch, torch.randperm(len(self.data.y_train), generator=g))
        return self._order[1]

    def sample(self, generator: torch.Generator, batch_size: int, step: int) -> tuple[Tensor, Tensor]:
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = self.permutation(epoch)[i * self.batch_size : (i + 1) * self.batch_size]
        return self.data.x_train[idx], self.data.y_train[idx]

    @staticmethod
    def shard(batch: tuple[Tensor, Tensor], rank: int, world: int) -> tuple[Tensor, Tensor]:
        x, y = batch
        return x[rank::world], y[rank::world]

    def regulariser(self, gate_probs: Tensor, x: Tensor) -> Tensor:
        """The configured regulariser on the gate's ``p(e|x)`` (0 for ``none``)."""
        if self.reg == "importance":
            return self.w_importance * importance_loss(gate_probs)
        if self.reg == "ls":
            return sample_similarity_loss(gate_probs, x, self.beta_s, self.beta_d)
        return gate_probs.new_zeros(())

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        x, y = batch
        for m in self.frozen:
            m.eval()
        if self.output is not None:
            return self.output(model, x, y).nll(y), len(y)
        out = model(x)
        return out.nll(y) + self.regulariser(out.gate_probs, x), len(y)

    def evaluate(self, model: nn.Module, split: str, max_tokens: int | None) -> dict[str, float]:
        result = evaluate(model, self.data.x_test, self.data.y_test)
        return {"loss": result["loss"], "error": result["error"]}
