"""Hugging Face transformers in and out: :mod:`.convert` turns transformers MoE blocks into
moelab layers (:mod:`.export` back), :mod:`.upcycle` turns a dense model's MLPs into MoE layers, :mod:`.lora` writes a moelab adapter of a converted
model for PEFT or vLLM, :mod:`.trainer` runs
moelab's layers under the transformers ``Trainer``; :mod:`.kind` registers transformers models as a
kind that :func:`moelab.save` / :func:`moelab.load` rebuild.  transformers is imported only when used."""

from . import kind  # noqa: F401  (registers the "transformers" kind with moelab.io)
from .convert import from_hf, set_method
from .export import to_hf
from .upcycle import upcycle

__all__ = ["from_hf", "set_method", "to_hf", "upcycle"]
