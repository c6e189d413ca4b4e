"""The examples a newcomer copies: every ``python`` code block of README.md and of the Quickstart
page (docs/quickstart.md) runs as written."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/quickstart.md")
BLOCKS = [
    (page, index, block)
    for page in PAGES
    for index, block in enumerate(
        re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(encoding="utf-8"), flags=re.M | re.S)
    )
]


def test_the_readme_and_the_quickstart_have_their_python_examples():
    assert [i for page, i, _ in BLOCKS if page == "README.md"] == [0]  # the layer
    assert len([page for page, _, _ in BLOCKS if page != "README.md"]) >= 3  # the layer, a loop, the schedule


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS, ids=[f"{p}-{i + 1}" for p, i, _ in BLOCKS])
def test_every_python_block_of_the_readme_and_the_quickstart_runs_as_written(page, index, block):
    code = compile(block, f"{page} python block {index + 1}", "exec")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(code, {"__name__": f"example_block_{index + 1}"})  # a fresh namespace: nothing undefined
    told = [str(w.message) for w in caught if "RoutingContext" in str(w.message)]
    assert told == []  # the loop it shows drives the routing as it should
