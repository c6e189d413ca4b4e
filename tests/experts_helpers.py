"""Shared by the expert-bank tests: the literal per-token sum, random routings, the kernels to run."""

from __future__ import annotations

import torch

from moelab.experts import grouped_mm_available

ACTS = ["relu", "gelu", "silu", "swiglu", "swiglu_clamp"]  # swiglu_clamp: DeepSeek-V4's
GROUPED = grouped_mm_available(torch.device("cpu"), torch.float32)
#: every implementation that runs on the CPU here
IMPLS = ["loop", "stream", "auto"] + (["grouped"] if GROUPED else [])


def reference(bank, x, indices, weights):
    """``Σ_k w_k · expert_forward(x_t, i_k)``, one token at a time."""
    rows = []
    for t in range(x.shape[0]):
        terms = [
            weights[t, k] * bank.expert_forward(x[t : t + 1], int(indices[t, k]))[0]
            for k in range(indices.shape[1])
        ]
        rows.append(torch.stack(terms).sum(0))
    return torch.stack(rows)


def random_routing(t, n, k, generator, experts=None):
    """``(T, K)`` distinct experts per token drawn from ``experts`` (default all N)."""
    pool = torch.arange(n) if experts is None else torch.as_tensor(experts)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=generator)[:k]] for _ in range(t)])
    w = torch.rand(t, k, generator=generator)
    return idx, w
