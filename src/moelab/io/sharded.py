"""Reading a sharded (``torch.distributed.checkpoint``) folder without unpickling anything
user-supplied: the weights of a training checkpoint that each rank wrote shard by shard
(:func:`moelab.train.checkpoint.save_checkpoint` under FSDP2 / expert parallelism).

DCP keeps its index in ``.metadata``, a pickle, and reads non-tensor entries with
``torch.load(weights_only=False)``.  Here neither is trusted: the folder's ``config.json`` lists the
sha256 of ``.metadata`` and of every ``*.distcp`` shard, verified by :func:`moelab.io.read_config`
before anything is opened; ``.metadata`` is then read by an unpickler that builds only DCP's own
metadata classes (any other name in it is refused), every shard it points to must be a file the
manifest lists, and a checkpoint holds tensors only (a non-tensor entry is refused, never
``torch.load``-ed); the shards themselves are read by DCP with ``torch.load(weights_only=True)``.
docs/scaling-checkpoints.md describes the folder.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import CheckpointError

__all__ = [
    "METADATA_NAME",
    "SHARDED",
    "entry_keys",
    "load",
    "planner",
    "read_metadata",
    "read_tensors",
    "reader",
]

#: ``config.json``'s ``"weights"`` value of a folder whose weights are DCP shards
SHARDED = "dcp"
#: DCP's index file
METADATA_NAME = ".metadata"

#: the only names ``.metadata`` may build (what torch's ``FileSystemWriter`` pickles)
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{str(self.path)!r} names {module}.{name}; a sharded checkpoint's index builds only "
            "torch.distributed.checkpoint's metadata classes (refused, nothing was run)"
        )


def read_metadata(directory: str | os.PathLike, files: dict[str, str]) -> Any:
    """DCP's ``Metadata`` of the verified folder ``directory`` whose manifest lists ``files``:
    the index read with the restricted unpickler, every shard it names one of ``files``."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = Path(directory) / METADATA_NAME
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or foreign pickle: the digest matched a crafted file
        raise CheckpointError(f"{str(path)!r} cannot be read ({describe(exc)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{str(path)!r} is not a torch.distributed.checkpoint index")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):  # bytes would be torch.load-ed unrestricted
            raise CheckpointError(
                f"{str(path)!r} holds a non-tensor entry {key!r}; a sharded checkpoint holds tensors only"
            )
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name not in files or name in (METADATA_NAME, "config.json"):
            raise CheckpointError(
                f"{str(path)!r} points to the file {name!r}, which the manifest does not list as a shard"
            )
    return metadata


def reader(directory: str | os.PathLike, files: dict[str, str]) -> Any:
    """A DCP ``FileSystemReader`` of the verified ``directory`` with the restricted index reader."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(directory, files)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(os.fspath(directory))


def planner() -> Any:
    """DCP's default load planner, refusing non-tensor entries (DCP would ``torch.load`` them
    without ``weights_only``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise CheckpointError(
                f"sharded checkpoint entry {read_item.dest_index.fqn!r} is not a tensor; a sharded "
                "checkpoint holds tensors only"
            )

    return _TensorsOnly()


def load(state: dict[str, Any], directory: str | os.PathLike, files: dict[str, str], no_dist: bool) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (tensors or DTensors, filled in place,
    re-sharded to their layout) from the verified ``directory``; ``no_dist``: this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(directory, files)  # its refusals here, not wrapped in DCP's collective error
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": meant, with no_dist
            if no_dist:
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader(directory, files), planner=planner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        cause = reason(exc)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"sharded checkpoint {directory} does not fit: {describe(cause)}") from None


def reason(exc: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (the first failing rank's), else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
    return exc


def describe(exc: BaseException) -> str:
    """``{type}: {first line}`` of an error, for a one-line message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {(lines or [''])[0][:200]}"


def read_tensors(directory: str | os.PathLike, files: dict[str, str], prefix: str) -> dict[str, Tensor]:
    """Every tensor saved under ``prefix`` (the key without it -> the full tensor, shape and dtype
    as saved, gathered from every rank's shards) on this process alone, without a process group."""
    metadata = read_metadata(directory, files)
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    load(state, directory, files, no_dist=True)
    return {key[len(prefix) :]: value for key, value in state.items()}


def entry_keys(directory: str | os.PathLike, files: dict[str, str]) -> dict[str, Any]:
    """Every entry of the verified folder's index: flattened key -> ``TensorStorageMetadata``."""
    return dict(read_metadata(directory, files).state_dict_metadata)
