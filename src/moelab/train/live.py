"""Live view of a training run: TensorBoard event files written while :class:`moelab.train.Trainer`
trains, beside the ``log.csv`` every run keeps (the record a resume restores and the plots read).

``log="tensorboard"`` writes, under ``<out>/tensorboard/``, every step's scalars (``train/loss``,
``train/aux_loss``, each weighted aux term ``train/aux_<name>``, ``train/grad_norm``, ``train/lr``,
the layer-mean routing diagnostics ``routing/<name>`` and the validation columns when a step
validated) and, every ``every`` steps and at the last one, per MoE layer ``layer<i>/max_vio``,
``layer<i>/jain``, ``layer<i>/router_entropy``, the layer's per-expert load as a histogram
``load/layer<i>`` (one bucket per expert, its count of token slots over the ranks) and the
layer × expert load image ``load/layers`` (a row per layer; white = an expert receives its even
share, blue less, red more, full colour = no slot or twice the even share and above).

Everything is computed from what the step already measured (the layers' recorded routings and the
step's expert counts); nothing runs on the device that the step did not already run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..io.atomic import record_write
from ..metrics import jain_index, layers_of, max_violation, routing_entropy

#: ``log=``: ``auto`` = ``tensorboard`` when the ``tensorboard`` package is installed, else ``csv``;
#: ``csv`` = ``log.csv`` only (every run writes it)
LIVE_LOGS = ("auto", "tensorboard", "csv")
#: the folder of the event files inside the run directory
TENSORBOARD_DIR = "tensorboard"
#: pixels per cell of the layer × expert load image
_CELL = 12


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def resolve_log(log: str) -> str:
    """``log`` as the run will write it: ``auto`` resolved; ``tensorboard`` without the package is
    refused in one line naming the extra that installs it."""
    if log not in LIVE_LOGS:
        raise ValueError(f"log={log!r} is not allowed; expected one of {', '.join(LIVE_LOGS)}")
    if log == "auto":
        return "tensorboard" if tensorboard_available() else "csv"
    if log == "tensorboard" and not tensorboard_available():
        raise ValueError(
            "log='tensorboard' needs the tensorboard package; install it (pip install 'moelab[hf]' or "
            "pip install tensorboard) or use log='csv'"
        )
    return log


def load_image(loads: list[Tensor]) -> Tensor:
    """The ``(3, H, W)`` RGB image (values in [0, 1]) of per-layer expert loads: one row of cells per
    layer, one cell per expert, coloured by the expert's share relative to the even share
    (white = even, blue = less, red = more; saturated at 0 and at twice the even share).  Layers with
    fewer experts than the widest leave their extra cells grey."""
    width = max(load.numel() for load in loads)
    rel = torch.full((len(loads), width), float("nan"), dtype=torch.float64)
    for i, load in enumerate(loads):
        total = float(load.sum())
        rel[i, : load.numel()] = load.double() * load.numel() / total if total > 0 else 1.0
    t = (rel - 1).clamp(-1, 1)  # -1: no slot, 0: even share, 1: twice the even share or more
    below, above = (-t).clamp(min=0), t.clamp(min=0)
    rgb = torch.stack([1 - below, 1 - below - above, 1 - above]).clamp(0, 1)  # white -> blue / red
    rgb[:, torch.isnan(rel)] = 0.5
    return rgb.repeat_interleave(_CELL, dim=1).repeat_interleave(_CELL, dim=2).float()


class TensorBoardLog:
    """The event files of one run (rank 0 writes them).  ``start``: the step training starts from;
    events a killed run wrote after it are dropped (TensorBoard's ``purge_step``), so a resumed run
    shows one curve, as its ``log.csv`` does."""

    def __init__(self, folder: str | Path, start: int, every: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.every = every
        record_write(folder, folder=True)  # the run's own (--force removes it), listed before it is written
        self.writer = SummaryWriter(str(folder), purge_step=start + 1 if start else None)

    def scalars(self, row: dict[str, Any]) -> None:
        """Step ``row["step"]``'s numbers of its ``log.csv`` row, as one event."""
        values = {}
        for key, value in row.items():
            if key in ("step", "tokens", "time_s") or value == "" or value is None:
                continue
            tag = f"routing/{key}" if key in _ROUTING_COLUMNS else f"train/{key}"
            values[f"valid/{key[4:]}" if key.startswith("val_") else tag] = float(value)
        self._scalars(values, int(row["step"]))

    def _scalars(self, values: dict[str, float], step: int) -> None:
        """One event holding every scalar of ``values``: one ``add_scalar`` call a value writes an
        event each, five times the cost (docs/performance.md, the live TensorBoard view)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self.writer.file_writer.add_summary(summary, step)

    def layers(self, step: int, model: nn.Module, loads: list[Tensor] | None, last: bool = False) -> None:
        """On the layer steps (every :attr:`every` and the ``last``): the per-layer diagnostics of
        ``model``'s routings recorded by training step ``step`` (called before anything else runs the
        model) with the step's ``loads`` (per MoE layer, the expert counts summed over the ranks;
        ``None``: a layer did not run)."""
        if loads is None or not (last or step % self.every == 0):
            return
        values = {}
        for i, (layer, load) in enumerate(zip(layers_of(model), loads)):
            values[f"layer{i}/max_vio"] = max_violation(load)
            values[f"layer{i}/jain"] = jain_index(load)
            routing = layer.recorded_routing
            if routing is not None and routing.probs is not None:  # this rank's tokens
                values[f"layer{i}/router_entropy"] = float(routing_entropy(routing.probs))
            self._histogram(f"load/layer{i}", load, step)
        self._scalars(values, step)
        self.writer.add_image("load/layers", load_image(loads), step)

    def _histogram(self, tag: str, load: Tensor, step: int) -> None:
        """One bucket per expert (``[e - 0.5, e + 0.5)``), its height the expert's count."""
        experts = torch.arange(load.numel(), dtype=torch.float64)
        total = float(load.sum())
        if total <= 0:
            return
        self.writer.add_histogram_raw(
            tag,
            min=0.0,
            max=float(load.numel() - 1),
            num=total,
            sum=float((experts * load).sum()),
            sum_squares=float((experts * experts * load).sum()),
            bucket_limits=[e + 0.5 for e in range(load.numel())],
            bucket_counts=[float(c) for c in load.tolist()],
            global_step=step,
        )

    def close(self) -> None:
        self.writer.close()


#: the ``log.csv`` columns of :func:`moelab.metrics.routing_summary`
_ROUTING_COLUMNS = frozenset({"router_entropy", "load_cv", "max_vio", "competition_overlap", "dropped"})


def check_every(every: int) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every < 1 << 40:
        raise ValueError(f"log_every={every!r} is not allowed; expected an integer >= 1")
    return every
