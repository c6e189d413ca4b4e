"""Workloads shared by the ``moelab bench suite`` grids (CPU: :mod:`moelab.bench.suite`; GPU:
:mod:`moelab.bench.gpu`): list parsing of the grid flags, the routings (``balanced``, ``zipf``)
imposed through the inputs, and the realised load.  See :mod:`moelab.bench.suite` for what each
means."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validate
from ..functional import expert_counts

__all__ = [
    "ROUTINGS",
    "ZIPF_EXPONENT",
    "ZIPF_MARGIN",
    "favourite_experts",
    "int_list",
    "load_stats",
    "name_list",
    "routed_inputs",
]

ROUTINGS = ("balanced", "zipf")
ZIPF_EXPONENT = 1.0
ZIPF_MARGIN = 0.5


def int_list(flag: str, text: str) -> list[int]:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    try:
        values = [int(s) for s in items]
    except ValueError:
        values = []
    if not values:
        raise ValueError(
            f"{flag}={text!r} is not allowed; expected a comma-separated list of positive integers"
        )
    for v in values:
        _validate.positive_int(flag, v)
    return list(dict.fromkeys(values))


def name_list(flag: str, text: str, allowed: tuple[str, ...], empty_ok: bool = False) -> list[str]:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if items == ["none"] and empty_ok:
        return []
    if not items:
        raise ValueError(
            f"{flag}={text!r} is not allowed; expected a comma-separated list from {list(allowed)}"
        )
    for item in items:
        _validate.one_of(flag, item, allowed)
    return list(dict.fromkeys(items))


def favourite_experts(tokens: int, num_experts: int, routing: str, gen: torch.Generator) -> Tensor:
    """Each token's favourite expert ``(T,)``: in turn (``balanced``) or Zipf(s=1) (``zipf``)."""
    if routing == "balanced":
        offset = int(torch.randint(num_experts, (1,), generator=gen))
        return (torch.randperm(tokens, generator=gen) + offset) % num_experts
    if routing == "zipf":
        p = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-ZIPF_EXPONENT)
        return torch.multinomial(p / p.sum(), tokens, replacement=True, generator=gen)
    raise ValueError(f"--routing={routing!r} is not allowed; expected one of {list(ROUTINGS)}")


def routed_inputs(
    router_weight: Tensor, favourites: Tensor, gen: torch.Generator, margin: float = ZIPF_MARGIN
) -> Tensor:
    """Tokens ``z_t + c_t W_{f_t}`` whose top-1 logit under ``router_weight (N, d)`` is ``f_t``
    by ``margin`` (the smallest such ``c_t ≥ 0``; see the module docstring)."""
    W = router_weight.detach().float().cpu()
    z = torch.randn(favourites.numel(), W.shape[1], generator=gen)
    logits = z @ W.t()  # (T, N)
    gram = W @ W.t()  # (N, N)
    f = favourites.long()
    gap = margin - (logits.gather(1, f[:, None]) - logits)  # the rise each rival needs
    denom = gram[f, f][:, None] - gram[f]  # ‖W_f‖² − W_e·W_f
    need = torch.where(denom > 0, gap / denom.clamp_min(1e-12), torch.zeros_like(gap))
    c = need.clamp_min(0).amax(dim=1)
    return z + c[:, None] * W[f]


def load_stats(indices: Tensor, num_experts: int, favourites: Tensor | None = None) -> dict:
    """Realised load of a routing ``indices (T, K)``."""
    counts = expert_counts(indices, num_experts).double()
    slots = indices.numel()
    out = {
        "top_share": float(counts.max() / slots),
        "max_over_mean": float(counts.max() * num_experts / slots),
        "favourite_hit": None,
        "experts_touched": int((counts > 0).sum()),
    }
    if favourites is not None:
        out["favourite_hit"] = float((indices[:, 0].cpu() == favourites).double().mean())
    return out


def check_fits(
    flags: dict[str, int], tokens: int, d_model: int, d_hidden: int, num_experts: int, top_k: int
) -> None:
    """Refuse, before anything is allocated, a benchmark case whose layer, dense twin, gradients and one
    batch cannot fit in this machine's memory (a lower bound in float32 bytes), naming the flag of
    ``flags`` (flag → value) with the largest value."""
    from ..experiments.runner import machine_memory

    weights = 2 * num_experts * d_model * 2 * d_hidden  # the experts' SwiGLU in/out matrices and their grads
    dense = 2 * d_model * 2 * top_k * d_hidden  # the dense FFN of equal active width
    batch = tokens * (4 * d_model + top_k * (2 * d_hidden + d_model))  # inputs, outputs, grads, expert rows
    need, total = 4 * (weights + dense + batch), machine_memory()
    if total and need > total:
        flag = max(flags, key=flags.get)
        raise ValueError(
            f"{flag}={flags[flag]!r} is not allowed here: the layer, its dense twin and one batch would need "
            f"at least {need / 2**30:,.3g} GiB, more than this machine's {total / 2**30:.3g} GiB of memory; "
            f"expected a smaller {flag}"
        )
