"""A toy command config for the tests of the configuration vocabulary and the run lifecycle."""

from __future__ import annotations

from dataclasses import dataclass, field

from moelab.config import Interval, Options, setting


@dataclass
class Inner:
    steps: int = setting(10, help="steps", allowed=Interval(int, 1))
    lr: float = setting(0.1, help="rate", allowed=Interval(float, 0, closed="neither"))


@dataclass
class Toy:
    name: str = setting("a", help="a name", allowed=Options(("a", "b")))
    layers: int | None = setting(None, flag="--depth", help="depth", allowed=(Interval(int, 1), None))
    opts: dict = setting(default_factory=dict, flag="--opt", help="options")
    sizes: tuple[int, ...] = setting((1, 2), help="sizes")
    quiet: bool = setting(False, help="quiet", input=False)
    inner: Inner = field(default_factory=Inner)
