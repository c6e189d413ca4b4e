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
