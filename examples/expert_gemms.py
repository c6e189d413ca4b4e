"""The six GEMMs of an MoE training step, per expert against one dense GEMM of the same FLOPs.

docs/performance-canonical.md quotes this: T=2048 tokens, 16 experts top-2 of
SwiGLU width 512, d 256, every expert given T·K/N rows; a dense SwiGLU FFN of width 1024 is the
reference. For each GEMM it times, interleaved over rounds, the dense GEMM, the experts' GEMMs in a
loop (each split over the torch threads), the same through ``torch._grouped_mm`` and, with several
threads, the loop spread over the threads one expert at a time (``moelab.experts.threads``), and
prints the median ratio to dense.

    python examples/expert_gemms.py --threads 1
    OMP_WAIT_POLICY=PASSIVE python examples/expert_gemms.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moelab.experts.threads import over_experts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=25)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    T, d, h, N, K = 2048, 256, 512, 16, 2
    c = T * K // N
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)
    X, GH, GY, A = r(T * K, d), r(T * K, 2 * h), r(T * K, d), r(T * K, h)  # expert-sorted slots
    w_in, w_out = r(N, 2 * h, d), r(N, d, h)
    Xd, GHd, GYd, Ad = X[:T], r(T, 4 * h), GY[:T], r(T, 2 * h)  # the dense FFN's rows
    w_in_d, w_out_d = r(4 * h, d), r(d, 2 * h)
    rows = [slice(e * c, (e + 1) * c) for e in range(N)]
    offs = torch.arange(1, N + 1, dtype=torch.int32) * c
    gmm = torch._grouped_mm
    gemms = {  # name: (dense, one expert e, grouped_mm)
        "forward x W_in^T": (lambda: Xd @ w_in_d.t(), lambda e: X[rows[e]] @ w_in[e].t(),
                             lambda: gmm(X, w_in.transpose(1, 2), offs=offs)),
        "forward a W_out^T": (lambda: Ad @ w_out_d.t(), lambda e: A[rows[e]] @ w_out[e].t(),
                              lambda: gmm(A, w_out.transpose(1, 2), offs=offs)),
        "backward g W_out": (lambda: GYd @ w_out_d, lambda e: GY[rows[e]] @ w_out[e],
                             lambda: gmm(GY, w_out, offs=offs)),
        "backward g W_in": (lambda: GHd @ w_in_d, lambda e: GH[rows[e]] @ w_in[e],
                            lambda: gmm(GH, w_in, offs=offs)),
        "weight grad g^T a": (lambda: GYd.t() @ Ad, lambda e: GY[rows[e]].t() @ A[rows[e]],
                              lambda: gmm(GY.t(), A, offs=offs)),
        "weight grad g^T x": (lambda: GHd.t() @ Xd, lambda e: GH[rows[e]].t() @ X[rows[e]],
                              lambda: gmm(GH.t(), X, offs=offs)),
    }  # fmt: skip
    print(
        f"T={T} N={N} K={K} h={h} d={d}, {c} rows per expert, torch threads {args.threads}, {args.rounds} rounds"
    )
    print(f"{'GEMM':22s} {'loop':>8s} {'grouped_mm':>11s} {'per thread':>11s}   (x dense, medians)")
    for name, (dense, expert, grouped) in gemms.items():
        candidates = [
            dense,
            lambda expert=expert: [expert(e) for e in range(N)],
            grouped,
            lambda expert=expert: over_experts(list(range(N)), [c] * N, expert, X.device),
        ]
        for f in candidates:
            f()
        ratios: list[list[float]] = [[] for _ in candidates[1:]]
        for _ in range(args.rounds):
            times = []
            for f in candidates:
                start = time.perf_counter()
                f()
                times.append(time.perf_counter() - start)
            for i, t in enumerate(times[1:]):
                ratios[i].append(t / times[0])
        loop, grouped_x, threaded = (statistics.median(x) for x in ratios)
        print(f"{name:22s} {loop:8.3f} {grouped_x:11.3f} {threaded:11.3f}")


if __name__ == "__main__":
    main()
