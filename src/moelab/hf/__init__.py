"""Hugging Face transformers in and out: :mod:`.convert` turns transformers MoE blocks into
moelab layers, :mod:`.upcycle` turns a dense model's MLPs into MoE layers, :mod:`.trainer` runs
moelab's layers under the transformers ``Trainer``.  transformers is imported only when used."""

from .convert import from_hf
from .upcycle import upcycle

__all__ = ["from_hf", "upcycle"]
