"""Does a top-1 router learn from the task?  Switch Transformer's weighting against a renormalised one.

Data: a mixture of N linear maps, the map of each input chosen by a linear top-1 gate
(``y = A_e x``, ``e = argmax_i w_iᵀ x``).  A ``moelab.MoE`` with K = 1 learns it twice: with the
default weighting at K = 1 (``renormalize=None``: the chosen expert's probability over all N, as
Switch Transformer, so the task loss reaches the router) and with ``renormalize=True`` (the weight is
the constant 1, the router learns from its balance and z losses alone).  Prints the test MSE, mean
over seeds.  Usage::

    python examples/top1_switch_weighting.py --methods smoe xmoe --seeds 3 --steps 1500
"""

from __future__ import annotations

import argparse

import torch

import moelab


def mixture(
    n: int, w: torch.Tensor, a: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, w.shape[1], generator=gen)
    chosen = (x @ w.T).argmax(-1)
    return x, torch.einsum("nij,nj->ni", a[chosen], x)


def run(method: str, renormalize: bool | None, seed: int, args: argparse.Namespace) -> float:
    d, n = args.d_model, args.num_experts
    g = torch.Generator().manual_seed(0)  # the same task for every run
    w, a = torch.randn(n, d, generator=g), torch.randn(n, d, d, generator=g) / d**0.5
    x_test, y_test = mixture(4096, w, a, torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    layer = moelab.MoE(d, n, 1, d_hidden=32, method=method, renormalize=renormalize)
    opt = torch.optim.Adam(layer.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(args.steps):
        x, y = mixture(args.batch_size, w, a, gen)
        loss = (layer(x) - y).pow(2).mean() + layer.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    layer.eval()
    with torch.no_grad():
        return float((layer(x_test) - y_test).pow(2).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["smoe", "xmoe"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    for method in args.methods:
        for renormalize in (None, True):
            errors = [run(method, renormalize, seed, args) for seed in range(args.seeds)]
            mean = sum(errors) / len(errors)
            print(
                f"{method:8s} renormalize={renormalize!s:5s} test MSE {mean:.4f}  seeds {[round(e, 4) for e in errors]}"
            )


if __name__ == "__main__":
    main()
