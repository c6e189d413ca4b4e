"""``torch.distributed`` set-up for ``torchrun``: :func:`init_from_env`.  The parallel layouts
themselves (expert parallelism, FSDP2, DDP) are applied by :func:`moelab.train.parallelize.parallelize`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["init_from_env"]


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from the variables ``torchrun`` sets (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and return
    ``(rank, world_size)``; ``(0, 1)`` without initialising anything when ``WORLD_SIZE`` is unset
    (a plain ``python``/``moelab`` process) or the group is already initialised.

    ``backend`` defaults to ``nccl`` when CUDA is available (then ``cuda:LOCAL_RANK`` becomes the
    current device) and ``gloo`` otherwise.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(
                f"WORLD_SIZE is set but {name} is not; launch with torchrun (which sets RANK, WORLD_SIZE, "
                "LOCAL_RANK, MASTER_ADDR and MASTER_PORT) or unset WORLD_SIZE"
            )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()
