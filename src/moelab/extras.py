"""Optional dependencies.  The layer, the routers, the models and the training loop need only the
core dependencies (torch, numpy, pyyaml, tqdm, safetensors); the lab's commands draw PNG plots and
compute statistics, and ask for the ``lab`` extra in one line before they start.  Nothing here
imports the rest of moelab.
"""

from __future__ import annotations

import importlib.util

from .errors import UsageError

__all__ = ["EXTRAS", "MissingExtraError", "missing", "require"]

#: extra -> the import names it installs (pyproject.toml's ``[project.optional-dependencies]``)
EXTRAS: dict[str, tuple[str, ...]] = {
    "lab": ("matplotlib", "scipy"),
    "plot": ("matplotlib",),
    "hf": ("transformers", "accelerate", "tensorboard"),
    "eval": ("lm_eval",),
}


class MissingExtraError(UsageError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def missing(extra: str) -> list[str]:
    """The import names of ``extra`` that are not installed."""
    if extra not in EXTRAS:
        raise ValueError(f"extra={extra!r} is not allowed; expected one of {', '.join(EXTRAS)}")
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Refuse, in one line, ``what`` (a command, a function) when ``extra`` is not installed."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(
            f"{what} needs {' and '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not installed: "
            f"pip install 'moelab[{extra}]'"
        )
