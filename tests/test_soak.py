"""Soak test (slow, not in CI): a long training run — logging every step,
validating, writing the best weights and atomic checkpoints with last-K pruning — with the
process's resident memory sampled over time; it must not grow.

    PYTHONPATH=src python -m pytest -m slow tests/test_soak.py -s               # 60 s
    MOELAB_SOAK_SECONDS=1800 PYTHONPATH=src python -m pytest -m slow tests/test_soak.py -s   # 30 min

See docs/performance-soak.md.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from moelab.data.text import load_text
from moelab.io.rundir import RunDir
from moelab.models.lm import LMConfig, TransformerLM
from moelab.train import TrainConfig, Trainer
from moelab.train.tasks import LMTask


def rss_mib() -> float:
    """Resident set size of this process (Linux ``/proc/self/statm``), MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Done(Exception):
    pass


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_long_run_does_not_grow_in_memory(tmp_path):
    seconds = float(os.environ.get("MOELAB_SOAK_SECONDS", "60"))
    torch.set_num_threads(1)
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"soak line {i} holds {i % 29} words of text.\n" for i in range(4000)))
    data = load_text(str(corpus))
    torch.manual_seed(0)
    model = TransformerLM(
        LMConfig(vocab_size=256, block_size=32, n_layer=2, d_model=64, n_head=4, num_experts=8, top_k=2,
                 method="competesmoe", dropout=0.0)
    )  # fmt: skip
    task = LMTask(data, 32)
    start = time.monotonic()
    samples: list[tuple[float, int, float]] = []  # (seconds, step, RSS MiB)
    sample = task.sample

    def timed_sample(generator, batch_size, step):
        if time.monotonic() - start > seconds:
            raise _Done
        return sample(generator, batch_size, step)

    def on_eval(step, val):
        samples.append((time.monotonic() - start, step, rss_mib()))

    task.sample = timed_sample
    cfg = TrainConfig(
        steps=int(200 * seconds) + 100,  # more than fit in the time (the schedule is (L, steps))
        batch_size=8, lr=1e-3, schedule="constant", warmup=10, eval_every=25,
        eval_tokens=512, ckpt_every=100, keep_ckpts=2,
    )  # fmt: skip
    run = RunDir(tmp_path / "run")
    run.write_config({"soak": True})
    trainer = Trainer(model, task, cfg, run, progress=False, on_eval=on_eval)
    with pytest.raises(_Done):
        trainer.fit()
    assert len(samples) >= 8, f"only {len(samples)} samples in {seconds:.0f} s: the machine is too slow"
    quarter = len(samples) // 4
    early = statistics.median(r for _, _, r in samples[quarter : 2 * quarter])  # after the warm-up
    late = statistics.median(r for _, _, r in samples[-quarter:])
    steps = samples[-1][1]
    print(
        f"\nsoak: {seconds:.0f} s, {steps} steps, {len(samples)} RSS samples; RSS median "
        f"{early:.1f} MiB (2nd quarter) -> {late:.1f} MiB (last quarter), max {max(r for *_, r in samples):.1f} MiB"
    )
    assert len(list((tmp_path / "run" / "ckpt").glob("step-*"))) <= 2
    assert late - early < max(16.0, 0.05 * early), f"RSS grew from {early:.1f} to {late:.1f} MiB"
