"""The transformers ``Trainer`` with moelab's layers: a callback that keeps a
:class:`moelab.RoutingContext` at the Trainer's step, and a ``Trainer`` whose training loss adds
``moelab.aux_loss(model)``.  Both are created on first access so ``import moelab`` does not import
transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layer import attach, aux_loss, moe_layers
from ..routing import RoutingContext

__all__ = ["MoETrainer", "MoETrainerCallback"]  # noqa: F822  (created lazily by __getattr__)

# ---------------------------------------------------------------------------------- transformers Trainer

_TRAINER_CLASSES: dict[str, type] = {}


def _trainer_classes() -> dict[str, type]:
    if _TRAINER_CLASSES:
        return _TRAINER_CLASSES
    from transformers import Trainer, TrainerCallback

    class MoETrainerCallback(TrainerCallback):
        """Attach a :class:`moelab.RoutingContext` at train begin and keep ``ctx.step`` equal to
        the Trainer's ``global_step`` (so a resumed run resumes its schedules too).

        Args:
            ctx: the context to attach; default the one already attached to the model, else a
                new one with ``total_steps`` = the Trainer's ``max_steps``.
        """

        def __init__(self, ctx: RoutingContext | None = None) -> None:
            self.ctx = ctx

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is None:
                return
            layers = moe_layers(model)
            ctx = self.ctx or next((m.ctx for m in layers if m.ctx is not None), None) or RoutingContext()
            if ctx.total_steps is None and state.max_steps and state.max_steps > 0:
                ctx.total_steps = int(state.max_steps)
            ctx.step = int(state.global_step)
            attach(model, ctx)
            self.ctx = ctx

        def on_step_end(self, args, state, control, **kwargs):
            if self.ctx is not None:  # after the optimizer step: the step hooks, then the step
                self.ctx.advance(max(0, int(state.global_step) - self.ctx.step))

    class MoETrainer(Trainer):
        """``transformers.Trainer`` whose training loss is ``task + moelab.aux_loss(model)``.

        Installs a :class:`MoETrainerCallback` unless one is given.  The aux loss follows the
        Trainer's gradient-accumulation scaling of the task loss; evaluation losses stay the
        task loss alone.
        """

        def __init__(self, *args: Any, callbacks: list | None = None, **kwargs: Any) -> None:
            callbacks = list(callbacks or [])
            if not any(isinstance(c, MoETrainerCallback) for c in callbacks):
                callbacks.append(MoETrainerCallback())
            super().__init__(*args, callbacks=callbacks, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch, **kwargs
            )
            if model.training:
                extra = aux_loss(model).to(loss.device)
                scaled = getattr(self, "loss_is_scaled_for_ga", None)
                if scaled is None:
                    scaled = (
                        getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
                    ) or getattr(self, "compute_loss_func", None) is not None
                if scaled:  # the Trainer will not divide this loss by the accumulation steps
                    extra = extra / getattr(self, "current_gradient_accumulation_steps", 1)
                loss = loss + extra
            return (loss, outputs) if return_outputs else loss

        def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
            """A model holding moelab layers is saved as its state dict (what the Trainer's resume
            reads) plus a ``moelab/`` folder (``moelab.load`` rebuilds it offline), never with
            ``save_pretrained``: transformers would re-initialise the MoE layers on load.  Call
            ``moelab.to_hf(model)`` after training for a plain transformers checkpoint."""
            from ..layer import moe_layers

            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            if not moe_layers(model):
                return super()._save(output_dir, state_dict)
            import os

            import safetensors.torch

            from ..io.model import save

            output_dir = output_dir if output_dir is not None else self.args.output_dir
            if not self.args.should_save:
                return None
            os.makedirs(output_dir, exist_ok=True)
            state = model.state_dict() if state_dict is None else state_dict
            state = {k: v.contiguous() for k, v in state.items()}
            data_ptrs: dict[int, str] = {}
            unique = {}
            for k, v in state.items():  # tied weights once (safetensors refuses shared storage)
                if v.data_ptr() in data_ptrs:
                    continue
                data_ptrs[v.data_ptr()] = k
                unique[k] = v
            safetensors.torch.save_file(
                unique, os.path.join(output_dir, "model.safetensors"), {"format": "pt"}
            )
            save(model, os.path.join(output_dir, "moelab"))
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
            return None

    _TRAINER_CLASSES.update(MoETrainerCallback=MoETrainerCallback, MoETrainer=MoETrainer)
    return _TRAINER_CLASSES


def __getattr__(name: str):
    if name in ("MoETrainer", "MoETrainerCallback"):
        return _trainer_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
