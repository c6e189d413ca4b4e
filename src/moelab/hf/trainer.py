"""The transformers ``Trainer`` with moelab's layers: :class:`MoETrainer` attaches a
:class:`moelab.RoutingContext` that follows the Trainer's optimizer steps and holds the schedule
the layers' method declares (:class:`MoETrainerCallback`), adds ``moelab.aux_loss(model)`` inside
the model's forward so that DDP sees every parameter it uses (with the losses of
``balance_scope="global"`` layers formed by a :class:`moelab.balance.StepBalance` from the step's
running statistics over the ranks and the accumulated micro-batches), logs each aux loss through
``Trainer.log``, decays only matrices, saves the routing state in every checkpoint and refuses
transformers' own load-balancing loss; both classes are created on first access so that ``import
moelab`` does not import transformers.  docs/scaling-hf.md ("``MoETrainer``") describes each of these.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from ..balance import StepBalance, attached_step_balance
from ..layer import attach, moe_layers, set_aux_scale
from ..metrics import jain_index, max_violation
from ..optim import decayed_parameter_names
from ..routing import RoutingContext
from ..schedules import default_a_max, model_schedule
from .convert import check_router_logits

__all__ = ["ROUTING_FILE", "MoETrainer", "MoETrainerCallback", "check_router_logits"]  # noqa: F822

#: the file of a Trainer checkpoint folder holding the routing context and the schedule
ROUTING_FILE = "moelab_routing.pt"

#: the output key of the aux loss when the task loss is computed outside the model
AUX_OUTPUT_KEY = "moelab_aux_loss"


def _collect_aux(layers: list[nn.Module]) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The value of the aux loss of the training forward that just ran (summed over the layers;
    the layers attached its gradient to their outputs) and its weighted terms by name (summed over
    the layers); ``None`` without layers."""
    total: Tensor | None = None
    terms: dict[str, Tensor] = {}
    for layer in layers:
        for name, value in layer.aux_values().items():
            terms[name] = terms[name] + value if name in terms else value
        value = layer._aux_values[0].detach().float().clone()
        total = value if total is None else total + value
    return total, terms


def _schedule_options(schedule: Any) -> dict[str, Any]:
    """The schedule options (:data:`moelab.schedules.SCHEDULE_OPTIONS`) that rebuild ``schedule``
    for another number of steps: ω, A_max and the warm-up fraction, or λ."""
    if schedule is None or not callable(getattr(schedule, "state_dict", None)):
        return {}
    try:
        state = schedule.state_dict()
    except ValueError:  # a coin flip with a callable rate: the default
        return {}
    names = {"omega": "omega", "a_max": "a_max", "warmup": "competition_warmup", "rate": "rate"}
    if state.get("a_max") == default_a_max(state.get("num_layers", 1)):
        state = {k: v for k, v in state.items() if k != "a_max"}  # the default, as a fresh run has it
    return {names[k]: v for k, v in state.items() if k in names}


# ---------------------------------------------------------------------------------- transformers Trainer

_TRAINER_CLASSES: dict[str, type] = {}
#: the aux hooks on a model: (the trainer owning them, their handles); one trainer at a time
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trainer_classes() -> dict[str, type]:
    if _TRAINER_CLASSES:
        return _TRAINER_CLASSES
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    class MoETrainerCallback(TrainerCallback):
        """Attach a :class:`moelab.RoutingContext` at train begin, holding the schedule the
        layers' method declares, and keep ``ctx.step`` equal to the Trainer's ``global_step``
        (the step hooks run once per optimizer step); save it into each checkpoint and restore
        it on resume.

        Args:
            ctx: the context to attach; default the one already attached to the model, else a
                new one with ``total_steps`` = the Trainer's ``max_steps``.  A context that
                already holds a schedule keeps it.  The model's own context planned for another
                number of steps (a model from :func:`moelab.load`, trained for 6 steps, now
                trained for 20) is rebuilt for ``max_steps`` — its schedule drawn again with the
                same options, StableMoE's switch and SMoE-Dropout's K following the new horizon —
                and a warning names both numbers; a ``ctx`` given here that planned another
                number of steps is refused, naming both.
            schedule_options: options of the schedule (:func:`model_schedule`).
        """

        def __init__(self, ctx: RoutingContext | None = None, schedule_options: dict | None = None) -> None:
            self.ctx = ctx
            self._given = ctx is not None
            self.schedule_options = dict(schedule_options or {})
            #: the checkpoint folder a resumed run starts from (set by MoETrainer.train)
            self.resume_from: str | None = None
            #: the statistics of the global-scope losses, from train begin to train end
            self.step_balance: StepBalance | None = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is None:
                return
            layers = moe_layers(model)
            planned = int(state.max_steps) if state.max_steps and state.max_steps > 0 else None
            ctx = self.ctx if self._given else next((m.ctx for m in layers if m.ctx is not None), None)
            ctx = (
                self._for_horizon(ctx, planned, model, int(args.seed))
                if ctx is not None
                else RoutingContext()
            )
            if ctx.total_steps is None and planned is not None:
                ctx.total_steps = planned
            if ctx.schedule is None:
                ctx.schedule = model_schedule(model, ctx.total_steps, int(args.seed), self.schedule_options)
            ctx.step = int(state.global_step)
            saved = os.path.join(self.resume_from, ROUTING_FILE) if self.resume_from else None
            if saved is not None and os.path.isfile(saved):
                self._restore(ctx, saved, int(state.global_step))
            stale = attached_step_balance(model)  # a StepBalance of the user's loop left attached
            if stale is not None:  # this run forms the global-scope losses from now on
                stale.close()
            attach(model, ctx)
            self.ctx = ctx
            # balance_scope="global" layers: the statistics of each optimizer step over the ranks and
            # the accumulated micro-batches (moelab.balance), cleared by the step hooks
            self.step_balance = StepBalance(model, ctx)

        def on_train_end(self, args, state, control, **kwargs):
            if self.step_balance is not None:
                self.step_balance.close()
                self.step_balance = None

        def _for_horizon(
            self, ctx: RoutingContext, planned: int | None, model: nn.Module, seed: int
        ) -> RoutingContext:
            """``ctx``, or a context rebuilt for ``planned`` steps when ``ctx`` planned others."""
            if planned is None or ctx.total_steps in (None, planned):
                return ctx
            if self._given:
                raise ValueError(
                    f"ctx.total_steps={ctx.total_steps} is not allowed: the Trainer plans max_steps={planned}; "
                    "expected a routing context planned for the steps it trains (or none: MoETrainer builds it)"
                )
            options = self.schedule_options or _schedule_options(ctx.schedule)
            new = RoutingContext(total_steps=planned, schedule=model_schedule(model, planned, seed, options))
            warnings.warn(
                f"MoETrainer: the model's routing context planned {ctx.total_steps} steps (it is at step "
                f"{ctx.step}); this training plans max_steps={planned}: the routing context is rebuilt for "
                f"{planned} steps (the competition schedule drawn again, StableMoE's stage switch and "
                "SMoE-Dropout's K follow the new horizon)",
                stacklevel=2,
            )
            return new

        @staticmethod
        def _restore(ctx: RoutingContext, path: str, global_step: int) -> None:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if int(state["ctx"]["step"]) != global_step:
                raise ValueError(
                    f"{path!r} holds the routing state of step {state['ctx']['step']} but the Trainer resumes "
                    f"at step {global_step}; the checkpoint is inconsistent"
                )
            ctx.load_state_dict(state["ctx"])

        def on_step_end(self, args, state, control, **kwargs):
            if self.ctx is not None:  # after the optimizer step: the step hooks, then the step
                self.ctx.advance(max(0, int(state.global_step) - self.ctx.step))

        def on_save(self, args, state, control, **kwargs):
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if self.ctx is None or not state.is_world_process_zero or not os.path.isdir(folder):
                return
            torch.save(
                {"ctx": self.ctx.state_dict()},
                os.path.join(folder, ROUTING_FILE),
            )

    class MoETrainer(Trainer):
        """``transformers.Trainer`` whose training loss is ``task + moelab.aux_loss(model)``,
        computed inside the model's forward (see :mod:`moelab.hf.trainer`).

        Installs a :class:`MoETrainerCallback` unless one is given.

        Args:
            *args, **kwargs: those of ``transformers.Trainer``.
            callbacks: as ``transformers.Trainer``.
            schedule_options: options of the schedule the layers' method declares
                (``omega``, ``a_max``, ``competition_warmup``, ``rate``).

        Raises:
            ValueError: ``output_router_logits=True`` on a model with moelab layers, or bad
                schedule options.
        """

        def __init__(
            self,
            *args: Any,
            callbacks: list | None = None,
            schedule_options: dict[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            callbacks = list(callbacks or [])
            callback = next((c for c in callbacks if isinstance(c, MoETrainerCallback)), None)
            if callback is None:
                callback = MoETrainerCallback()
                callbacks.append(callback)
            if schedule_options is not None:
                model_schedule(nn.Module(), None, 0, schedule_options)  # checks the keys
                callback.schedule_options = dict(schedule_options)
            super().__init__(*args, callbacks=callbacks, **kwargs)
            self._moe_callback = callback
            if self.model is not None:
                check_router_logits(self.model)
            self._aux_scale: float | None = None  # set while compute_loss runs the training forward
            self._aux_outside: Tensor | None = None  # the aux loss left for compute_loss to add
            self._aux_sums: dict[str, Tensor] = {}
            self._aux_count = 0
            self._loads: dict[int, Tensor] = {}  # per MoE layer: expert counts since the last log
            if self.model is not None:
                self._install_aux_hooks(self.model)

        def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
            """transformers' choice (no biases, no LayerNorm or ``*norm*`` weights) less what moelab's
            rule leaves undecayed (:func:`moelab.optim.decayed_parameter_names`): the learned
            temperatures, router biases and expert-bank bias stacks whose names transformers does
            not recognise."""
            matrices = set(decayed_parameter_names(model))
            return [name for name in super().get_decay_parameter_names(model) if name in matrices]

        # -------------------------------------------------------------- the aux loss in forward
        def _install_aux_hooks(self, model: nn.Module) -> None:
            _, handles = _HOOKS.pop(model, (None, []))
            for handle in handles:  # a model trains under one MoETrainer at a time
                handle.remove()
            ref = weakref.ref(self)

            def before(module, args, kwargs):
                check_router_logits(module, kwargs.get("output_router_logits"))

            def after(module, args, kwargs, output):
                trainer = ref()
                if trainer is None or trainer._aux_scale is None or not module.training:
                    return None
                return trainer._add_aux(module, kwargs, output)

            model._moelab_aux_by_trainer = (
                True  # this trainer adds the aux loss (not the converted model's hook)
            )
            _HOOKS[model] = (
                ref,
                [
                    model.register_forward_pre_hook(before, with_kwargs=True),
                    model.register_forward_hook(after, with_kwargs=True),
                ],
            )

        def _add_aux(self, model: nn.Module, kwargs: dict, output: Any) -> Any:
            balance = attached_step_balance(model)
            if balance is not None:  # before the layers' aux losses are read: it reads their forward
                balance.record()  # one all-reduce; micro-batch m sees the counts of 1..m of the step
                global_loss = balance.loss()
            total, terms = _collect_aux(moe_layers(model))
            if total is None:
                return None
            if balance is not None:
                total = total + global_loss.to(total.device)
                for name, value in balance.last_terms.items():
                    value = value.float().to(total.device)
                    terms[name] = terms[name] + value if name in terms else value
            for name, value in terms.items():
                self._aux_sums[name] = self._aux_sums[name] + value if name in self._aux_sums else value
            self._add_loads(model)
            detached = total.detach().float()
            self._aux_sums[""] = self._aux_sums[""] + detached if "" in self._aux_sums else detached
            self._aux_count += 1
            # the layers' aux losses are values here (their gradient is attached to the layers'
            # outputs, weighted by set_aux_scale in compute_loss): the loss the Trainer logs is task +
            # aux, as before; a global-scope balance loss (the StepBalance's) carries its gradient
            outside = self.label_smoother is not None or self.compute_loss_func is not None
            if isinstance(output, dict):
                if output.get("loss") is not None and not outside:
                    output["loss"] = output["loss"] + total.to(output["loss"].device) * self._aux_scale
                else:
                    output[AUX_OUTPUT_KEY] = self._aux_outside = total
                return output
            if isinstance(output, tuple):
                first = output[0] if output else None
                if (
                    kwargs.get("labels") is not None
                    and torch.is_tensor(first)
                    and first.dim() == 0
                    and not outside
                ):
                    return (first + total.to(first.device) * self._aux_scale, *output[1:])
                self._aux_outside = total
                return (*output, total)
            raise ValueError(
                f"a model output of type {type(output).__name__} is not allowed under MoETrainer; expected a "
                "ModelOutput, a dict or a tuple (to carry the aux loss out of the forward)"
            )

        def _aux_weight(self) -> float:
            """The weight of the aux gradient in the backward to come: the mean over the
            accumulated micro-batches, as the task loss, times the gradient scaler's scale (fp16)."""
            weight = 1.0 / float(getattr(self, "current_gradient_accumulation_steps", 1) or 1)
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None and scaler.is_enabled():
                weight *= float(scaler.get_scale())
            return weight

        def _aux_divisors(self, num_items_in_batch: Any) -> tuple[float, float]:
            """``(gradient accumulation, world)``: what the Trainer will not divide the returned
            loss by, and what compute_loss multiplies the model's loss by."""
            scaled = getattr(self, "loss_is_scaled_for_ga", None)
            if scaled is None:
                scaled = (
                    getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
                ) or self.compute_loss_func is not None
            accumulation = float(getattr(self, "current_gradient_accumulation_steps", 1)) if scaled else 1.0
            world = 1.0
            if (
                getattr(self.args, "average_tokens_across_devices", False)
                and (getattr(self, "model_accepts_loss_kwargs", False) or self.compute_loss_func)
                and num_items_in_batch is not None
            ):
                tp = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
                world = float(
                    self.accelerator.num_processes // tp if self.args.n_gpu <= 1 else self.args.n_gpu
                )
            return accumulation, world

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
            if not model.training:
                return super().compute_loss(
                    model,
                    inputs,
                    return_outputs=return_outputs,
                    num_items_in_batch=num_items_in_batch,
                    **kwargs,
                )
            owner = _HOOKS.get(self.model, (None, []))[0]
            if owner is None or owner() is not self:  # a model from model_init, or hooked by another trainer
                self._install_aux_hooks(self.model)
            accumulation, world = self._aux_divisors(num_items_in_batch)
            self._aux_scale, self._aux_outside = 1.0 / (accumulation * world), None
            layers = moe_layers(self.model)
            for layer in layers:  # a layer that does not run in this forward adds nothing
                layer._aux_values.zero_()
            set_aux_scale(self.model, self._aux_weight())
            try:
                loss, outputs = super().compute_loss(
                    model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch, **kwargs
                )
            finally:
                self._aux_scale = None
            if self._aux_outside is not None:  # the task loss came from outside the model
                loss = loss + self._aux_outside.to(loss.device) / accumulation
                self._aux_outside = None
            return (loss, outputs) if return_outputs else loss

        def _add_loads(self, model: nn.Module) -> None:
            """Add each layer's expert counts of this forward to the logging interval's (on the
            device, no host sync: :meth:`log` reads them)."""
            for i, layer in enumerate(moe_layers(model)):
                routing = layer.recorded_routing
                if routing is not None:
                    count = torch.bincount(routing.active_indices, minlength=layer.num_experts).double()
                    self._loads[i] = self._loads[i] + count if i in self._loads else count

        # -------------------------------------------------------------- logging, resuming
        def _load_logs(self) -> dict[str, float]:
            """Per MoE layer, ``max_vio/layer<i>`` and ``jain/layer<i>`` of the expert counts of
            every training forward since the last log, summed over the processes."""
            if not self._loads:
                return {}
            layers = sorted(self._loads)
            flat = torch.cat([self._loads[i] for i in layers])
            if self.accelerator.num_processes > 1:
                flat = self.accelerator.reduce(flat, reduction="sum")
            flat = flat.cpu()
            logs = {}
            for i, load in zip(layers, flat.split([self._loads[i].numel() for i in layers])):
                logs[f"max_vio/layer{i}"] = max_violation(load)
                logs[f"jain/layer{i}"] = jain_index(load)
            self._loads = {}
            return logs

        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            if "loss" in logs and self._aux_count:  # a training log, on every rank
                logs.update(self._load_logs())
                names = sorted({n for m in moe_layers(self.model) for n in m.coefs} | {""})
                device = next(iter(self._aux_sums.values())).device
                zero = torch.zeros((), device=device)
                values = torch.stack([self._aux_sums.get(n, zero) for n in names]) / self._aux_count
                if self.accelerator.num_processes > 1:
                    values = self.accelerator.reduce(values, reduction="mean")
                for name, value in zip(names, values.tolist()):
                    logs["aux_loss" if name == "" else f"aux_{name}"] = value
                self._aux_sums, self._aux_count = {}, 0
            super().log(logs, *args, **kwargs)

        def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
            path = resume_from_checkpoint
            if isinstance(path, bool):
                path = get_last_checkpoint(self.args.output_dir) if path else None
            self._moe_callback.resume_from = None if path is None else str(path)
            self._aux_sums, self._aux_count, self._loads = {}, 0, {}
            try:
                return super().train(resume_from_checkpoint, *args, **kwargs)
            finally:  # an interrupted run (no on_train_end) leaves no StepBalance attached to drop losses
                self._moe_callback.on_train_end(self.args, self.state, self.control)

        def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
            """A model holding moelab layers is saved as its state dict (what the Trainer's resume
            reads) plus a ``moelab/`` folder (``moelab.load`` rebuilds it offline), never with
            ``save_pretrained``: transformers would re-initialise the MoE layers on load.  Call
            ``moelab.to_hf(model)`` after training for a plain transformers checkpoint."""
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            if not moe_layers(model):
                return super()._save(output_dir, state_dict)
            import safetensors.torch

            from ..io.model import save

            output_dir = output_dir if output_dir is not None else self.args.output_dir
            if not self.args.should_save:
                return None
            os.makedirs(output_dir, exist_ok=True)
            state = model.state_dict() if state_dict is None else state_dict
            unique: dict[str, Tensor] = {}
            seen: set[int] = set()
            for key, value in state.items():  # tied weights once (safetensors refuses shared storage)
                if value.data_ptr() not in seen:
                    seen.add(value.data_ptr())
                    unique[key] = value.contiguous()
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
