"""The exceptions moelab raises on purpose.  Library code raises these; the CLI reports a
:class:`UsageError` (and ``ValueError``) as one line and exit code 2.  Nothing here imports the
rest of moelab, so any module may import it.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "DataError", "NonFiniteError", "TrainingError", "UsageError"]


class UsageError(Exception):
    """A problem with the user's input: reported as one line, exit code 2."""


class NonFiniteError(RuntimeError):
    """Router logits are NaN/inf (``check_finite``); the trainer turns it into a clean stop."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss); the message says where and what was kept."""


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or corrupted; the message names the file."""


class DataError(ValueError):
    """A dataset cannot be obtained or fails verification; the message says how to fix it."""
