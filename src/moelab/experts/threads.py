"""Independent per-expert work spread over the CPU's torch threads, one expert per thread at a time:
:func:`over_experts` cuts the items into contiguous groups of about equal rows, runs one group per
thread with one torch thread each (the process-wide setting given back on return), and falls back
to the plain loop where threads cannot help or would not share state.  docs/kernels.md ("The loop
on several CPU threads") gives the rules and docs/performance.md the timings that motivate it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext
from itertools import accumulate
from typing import TypeVar

import torch

__all__ = ["over_experts", "split_rows"]

T = TypeVar("T")

_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _forget_pools() -> None:
    """In a forked child the pools' threads do not exist: start afresh (a task queued there would
    wait forever)."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _pool(workers: int) -> ThreadPoolExecutor:
    with _lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="moelab-experts")
        return _pools[workers]


def split_rows(rows: Sequence[int], parts: int) -> list[range]:
    """Cut items of ``rows`` rows into ``min(parts, len(rows))`` contiguous, non-empty groups: the
    ``k``-th cut where the rows before it come closest to ``k/parts`` of all."""
    n = len(rows)
    parts = min(parts, n)
    prefix = list(accumulate(rows))  # prefix[j - 1]: the rows before a cut at j
    total, cuts, lo = prefix[-1] if n else 0, [0], 1
    for k in range(1, parts):
        target = total * k / parts
        cut = min(range(lo, n - (parts - k) + 1), key=lambda j: abs(prefix[j - 1] - target))
        cuts.append(cut)
        lo = cut + 1
    return [range(a, b) for a, b in zip(cuts, [*cuts[1:], n])] if n else []


def _parallel() -> bool:
    return (
        not torch.compiler.is_compiling()  # first: reading the thread count breaks a traced graph
        and not torch.is_autocast_enabled("cpu")
        and torch.get_num_threads() > 1
    )


def over_experts(
    items: Sequence[T], rows: Sequence[int], fn: Callable[[T], object], device: torch.device
) -> list:
    """``[fn(item) for item in items]``, on the torch threads' cores when there are several and the
    work is on the CPU (see the module docstring; a GPU's work stays on the caller's thread, whose
    current stream other threads do not share); ``rows[i]`` is item ``i``'s row count."""
    if len(items) < 2 or device.type != "cpu" or not _parallel():
        return [fn(item) for item in items]
    threads = torch.get_num_threads()
    groups = split_rows(rows, threads)
    mode = torch.inference_mode if torch.is_inference_mode_enabled() else None
    grad = torch.is_grad_enabled()

    def run(group: range) -> list:
        torch.set_num_threads(1)  # this thread's GEMMs (and the process-wide setting) on one thread
        with mode() if mode else nullcontext(), torch.set_grad_enabled(grad):
            return [fn(items[i]) for i in group]

    futures = [_pool(threads - 1).submit(run, g) for g in groups[1:]]
    try:
        out = run(groups[0])
    finally:
        wait(futures)  # every thread is done before the setting is given back
        torch.set_num_threads(threads)
    for f in futures:
        out.extend(f.result())
    return out
