"""Where an MoE layer's training step goes, against the dense FFN of the same active width.

docs/performance-canonical.md quotes this: T=2048 tokens, 16 experts top-2 of
SwiGLU width 512, d 256 (method smoe), a dense SwiGLU FFN of width 1024 as the reference. One
process times, interleaved over rounds, forward + backward of

- ``dense``: the dense FFN;
- ``layer``: the whole MoE layer (router, top-k, dispatch, experts, combine);
- ``dispatch``: the expert bank with the routing held fixed (sort, gather, experts, combine);
- ``experts``: the experts alone on slots sorted beforehand (``moelab.experts.kernels.loop_rows``,
  or ``grouped_rows`` with ``--impl grouped``);
- ``router``: the router alone (its logits, softmax and top-k; backward through the weights),

and prints the medians and the ratios to dense: ``layer / dispatch`` is the routing's share,
``dispatch / experts`` the dispatch's.

``--impl`` (``loop`` or ``grouped``) is the kernel of ``layer``, ``dispatch`` and ``experts``.

    python examples/layer_time_split.py --threads 1
    OMP_WAIT_POLICY=PASSIVE python examples/layer_time_split.py --threads 2
    python examples/layer_time_split.py --threads 2 --impl grouped
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moelab import MoE, recording_routing
from moelab.experts import MLP
from moelab.experts.dispatch import sort_slots
from moelab.experts.kernels import grouped_rows, loop_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--impl", choices=["loop", "grouped"], default="loop")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    T, N, K, h, d = 2048, 16, 2, 512, 256
    torch.manual_seed(0)
    layer = MoE(d, N, K, d_hidden=h, method="smoe", activation="swiglu", impl=args.impl)
    dense = MLP(d, K * h, activation="swiglu")
    x, g = torch.randn(T, d), torch.randn(T, d)
    with torch.no_grad(), recording_routing(layer):  # an inference forward keeps its routing on request
        layer(x)
    routing = layer.last_routing
    indices, weights = routing.indices, routing.weights
    slots = sort_slots(indices, N)
    xs, counts, g_slots = x.index_select(0, slots.tokens), slots.counts.tolist(), torch.randn(T * K, d)
    bank = layer.experts

    def step(module, *inputs, grad=g):
        for q in [*layer.parameters(), *dense.parameters()]:
            q.grad = None
        inputs = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
        module(*inputs).backward(grad)

    def router():
        r = layer.router(x.detach().requires_grad_(), layer.experts, layer.ctx)
        r.weights.backward(torch.ones_like(r.weights))

    if args.impl == "loop":
        experts = lambda t: loop_rows(t, counts, bank.expert_weights)
    else:
        experts = lambda t: grouped_rows(t, slots.counts, slots.order, indices, bank.expert_weights)

    candidates = {
        "dense": lambda: step(dense, x),
        "layer": lambda: step(layer, x),
        "dispatch": lambda: step(bank, x, indices, weights),
        "experts": lambda: step(experts, xs, grad=g_slots),
        "router": router,
    }
    for f in candidates.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, f in candidates.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"T={T} N={N} K={K} h={h} d={d}, impl {args.impl}, torch threads {args.threads}, {args.rounds} rounds (medians)"
    )
    for name, value in ms.items():
        print(f"{name:9s} {value:8.2f} ms  {value / ms['dense']:5.3f} x dense")
    print(
        f"routing: layer/dispatch {ms['layer'] / ms['dispatch']:.3f}; dispatch/experts {ms['dispatch'] / ms['experts']:.3f}"
    )


if __name__ == "__main__":
    main()
