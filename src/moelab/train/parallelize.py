"""Parallelism applied from outside, on torch's own machinery (torchtitan's shape).

:func:`full_state_dict` gathers the full weights of a model whose parameters are sharded
(``DTensor``: FSDP2's ``fully_shard`` or expert parallelism) through
``torch.distributed.checkpoint.state_dict``, for :func:`moelab.save`.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["full_state_dict"]


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of ``model`` with every sharded (``DTensor``) entry gathered to its full
    tensor, on every rank (a collective: every rank calls it); plain tensors as they are.  Save
    it from rank 0 with ``moelab.save(state, directory)``; it loads into the unsharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
