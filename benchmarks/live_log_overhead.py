"""What the TensorBoard live view costs a training run: ``moelab train --size cpu`` (the default
``--log-every 10``) with ``--log tensorboard`` against ``--log csv``, in one process, alternating
in pairs whose order alternates (A B, B A, ...) so the machine's drift and the order fall on both; the process CPU time (every thread, the event writer's
included) and the wall time of :meth:`Trainer.fit` only (the imports, the data and the model are
built before the clocks start).  On a shared machine the CPU time is the figure to quote: other
processes stretch the wall time, not the CPU time this process spends.

    PYTHONPATH=src python benchmarks/live_log_overhead.py --steps 100 --pairs 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moelab.data.text import load_text
from moelab.experiments.lm import TrainRun, build_model, resolve
from moelab.io.rundir import RunDir
from moelab.train import Trainer
from moelab.train.tasks import LMTask


def fit_seconds(data, log: str, steps: int, out: Path) -> tuple[float, float]:
    config = resolve(TrainRun(size="cpu", steps=steps, eval_every=steps, ckpt_every=0, log=log))
    torch.manual_seed(0)
    model = build_model(config, data.vocab_size)
    run = RunDir(out)
    run.write_config({"benchmark": True})
    trainer = Trainer(
        model, LMTask(data, model.cfg.block_size), config.train_config(), run, progress=False, log=log
    )
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.fit()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as --size cpu
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text(Path(argparse.__file__).read_text() * 4)  # the standard library's source
        data = load_text(str(text))
        fit_seconds(data, "tensorboard", 5, Path(tmp) / "warm")  # imports and first-call costs
        seconds: dict[str, list[tuple[float, float]]] = {"tensorboard": [], "csv": []}
        for i in range(args.pairs):
            for log in (
                ("tensorboard", "csv") if i % 2 == 0 else ("csv", "tensorboard")
            ):  # ABBA: no order bias
                seconds[log].append(fit_seconds(data, log, args.steps, Path(tmp) / f"{log}{i}"))
    for clock, k in (("cpu", 0), ("wall", 1)):
        for log, pairs in seconds.items():
            v = [pair[k] for pair in pairs]
            print(
                f"{clock:>4} {log:>11}: median {statistics.median(v):.3f} s (min {min(v):.3f}, max {max(v):.3f})"
            )
        ratios = [a[k] / b[k] for a, b in zip(seconds["tensorboard"], seconds["csv"])]
        print(
            f"{clock:>4} tensorboard / csv: median {statistics.median(ratios):.4f} "
            f"(min {min(ratios):.4f}, max {max(ratios):.4f})"
        )


if __name__ == "__main__":
    main()
