"""Time the masked dispatch of a variable number of experts per token (docs/performance.md, "A variable
number of experts per token"): only the active slots run, against every slot with the inactive
weights at 0.  ``PYTHONPATH=src python examples/masked_dispatch_timing.py``."""

from __future__ import annotations

import time

import torch

import moelab
from moelab.experts.dispatch import dispatch_masked


def best_ms(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokens, d, h, n = 2048, 128, 256, 16
    bank = moelab.ExpertBank(n, d, h, activation="swiglu", impl="loop")
    x = torch.randn(tokens, d)
    indices = torch.rand(tokens, n).argsort(-1)
    weights = torch.rand(tokens, n)
    for active in (2, 4, 16):
        mask = torch.zeros(tokens, n, dtype=torch.bool)
        mask[:, :active] = True
        w = weights * mask
        masked = best_ms(lambda w=w, mask=mask: dispatch_masked(bank, x, indices, w, mask))
        every = best_ms(lambda w=w: bank.mix(x, indices, w))
        print(
            f"active {active}/{n}: masked {masked:.1f} ms, all {n} slots with inactive weights 0 {every:.1f} ms"
        )


if __name__ == "__main__":
    main()
