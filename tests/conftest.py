"""Shared fixtures: deterministic seeds, single-threaded torch (the machine is shared)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread in every test, restored after tests (the CLI's --threads) that change it."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same seed, so it is deterministic on CPU."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Point the download cache at a temporary folder: no test touches ~/.cache/moelab."""
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path / "cache"))
    yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny text file: 600 lines of eight words from a ten-word vocabulary (LM and DDP tests)."""
    path = tmp_path_factory.mktemp("data") / "tiny.txt"
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(10, (8,), generator=g).tolist()) for i in range(600)]
    path.write_text("\n".join(lines) + "\n")
    return path
