"""The README's own examples: every ``python`` code block of README.md runs as written."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.M | re.S)


def test_the_readme_has_its_python_examples():
    assert len(BLOCKS) >= 3  # the layer, a training loop, the competition schedule


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_python_block_of_the_readme_runs_as_written(index):
    code = compile(BLOCKS[index], f"README.md python block {index + 1}", "exec")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(code, {"__name__": f"readme_block_{index + 1}"})  # a fresh namespace: nothing undefined
    told = [str(w.message) for w in caught if "RoutingContext" in str(w.message)]
    assert told == []  # the loop it shows drives the routing as it should
