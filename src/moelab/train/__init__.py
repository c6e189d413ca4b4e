"""Training: the loop (:mod:`.trainer`) and atomic checkpoints (:mod:`.checkpoint`)."""

from ..layer import count_parameters
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .trainer import Task, TrainConfig, Trainer, TrainingError

__all__ = [
    "CheckpointError",
    "Task",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "count_parameters",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
