"""The layer computes the numbers recorded before its redesign, bit for bit (``layer_golden.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from layer_golden import GOLDEN, case_names, compute

_GOLDEN = json.loads(GOLDEN.read_text())


def test_golden_file_covers_every_case():
    assert sorted(_GOLDEN) == sorted(case_names())
    assert sum("refused" not in v for v in _GOLDEN.values()) > 700


@pytest.mark.parametrize("method", sorted({n.split("/")[0] for n in case_names()}))
def test_every_preset_computes_the_recorded_numbers(method):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in case_names():
            if not name.startswith(method + "/"):
                continue
            want, got = _GOLDEN[name], compute(name)
            if "refused" in want:
                assert "refused" in got, f"{name} is no longer refused: {want}"
                continue
            assert sorted(got) == sorted(want), name
            diff = [k for k in want if got[k] != want[k]]
            assert not diff, f"{name}: {[(k, want[k], got[k]) for k in diff[:4]]}"
    finally:
        torch.set_num_threads(threads)
