"""One training epoch of N CNN experts of Krishnamurthy et al. (2023): batched (vmap over stacked weights) vs
a Python loop over expert modules vs N × one expert trained alone.

    PYTHONPATH=src python benchmarks/specialization_experts.py [--threads 1] [--repeats 3]

Prints the median epoch time of each and the ratios; docs/performance-spec.md records a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moelab.experts import Experts, ModuleExperts
from moelab.models.vision import BatchedExperts, Expert, vision_config


def epoch(bank, x, y, batch, num_classes):
    opt = torch.optim.Adam(bank.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for idx in torch.randperm(len(y)).split(batch):
        out = bank.forward_all(x[idx]) if isinstance(bank, Experts) else bank(x[idx])[:, None]
        probs = out[..., :num_classes]  # (B, N, K)
        loss = torch.nn.functional.nll_loss(torch.log(probs + 1e-7).mean(1), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--experts", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for data, n_samples, batch in (("digits", 1437, 64), ("mnist", 10000, 512), ("fmnist", 10000, 512)):
        cfg = vision_config(data, args.experts)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n_samples, 1, cfg.image_size, cfg.image_size, generator=g)
        y = torch.randint(0, cfg.num_classes, (n_samples,), generator=g)
        times = {"batched": [], "loop": [], "single": []}
        for _ in range(args.repeats):
            mods = [Expert(cfg) for _ in range(args.experts)]
            times["batched"].append(epoch(BatchedExperts(mods), x, y, batch, cfg.num_classes))
            times["loop"].append(epoch(ModuleExperts(mods), x, y, batch, cfg.num_classes))
            times["single"].append(epoch(Expert(cfg), x, y, batch, cfg.num_classes))
        med = {k: statistics.median(v) for k, v in times.items()}
        n = args.experts
        print(
            f"{data:7s} {n_samples} samples, batch {batch}, {n} experts, {args.threads} thread(s): "
            f"batched {med['batched']:.3f}s  loop {med['loop']:.3f}s  single {med['single']:.3f}s  "
            f"batched/(N x single) {med['batched'] / (n * med['single']):.2f}  "
            f"loop/(N x single) {med['loop'] / (n * med['single']):.2f}  loop/batched {med['loop'] / med['batched']:.2f}"
        )


if __name__ == "__main__":
    main()
