"""Whether ``moelab.experts.autotune``'s one-time measurement picks the fastest kernel in this process.

docs/performance-auto.md ("auto measures where its rule cannot know") quotes this.  At the canonical
CPU shape (T=2048, 16 experts top-2, SwiGLU 512, d 256) it calls ``autotune`` on a bank with a
random routing in training and in inference (whatever the thread count and wait policy), then
times every candidate kernel for ``--rounds`` more interleaved rounds in the same process and
prints each median, auto's rule and the pick's time over the fastest's.  ``autotune`` picks only
among the kernels that round as the rule's by construction (docs/kernels.md), so the pick may be
slower than a kernel that rounds otherwise: ``impl=`` fixes that one, reproducibly.

    env -u OMP_WAIT_POLICY python examples/auto_pick_check.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moelab
from moelab.experts import ExpertBank, autotune
from moelab.experts import kernels as K


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=25)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    T, N, top_k, h, d = 2048, 16, 2, 512, 256
    torch.manual_seed(0)
    bank = ExpertBank(N, d, h, activation="swiglu")
    x = torch.randn(T, d)
    g = torch.Generator().manual_seed(1)
    indices = torch.rand(T, N, generator=g).topk(top_k, dim=1).indices
    weights = torch.rand(T, top_k, generator=g).softmax(dim=1)
    rules = {grad: K.rule_kernel(x, top_k, bank.expert_weights, grad) for grad in (True, False)}
    picks = {
        grad: autotune(bank, (x, moelab.Routing(indices, weights)), training=grad).classes[0].pick
        for grad in (True, False)
    }
    for grad in (True, False):
        times: dict[str, list[float]] = {name: [] for name in K.candidates(x, bank.expert_weights, grad)}
        for _ in range(args.rounds):
            for name in times:
                inp = x.clone().requires_grad_(grad)
                with torch.set_grad_enabled(grad):
                    start = time.perf_counter()
                    y = K.KERNELS[name](inp, indices, weights, bank.expert_weights)
                    if grad:
                        y.sum().backward()
                    times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        fastest = min(ms, key=ms.__getitem__)
        pick = picks[grad]
        print(
            f"{'train' if grad else 'infer'}: pick {pick} (rule {rules[grad]}), fastest {fastest}, pick/fastest "
            f"{ms[pick] / ms[fastest]:.3f}; " + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items())
        )


if __name__ == "__main__":
    main()
