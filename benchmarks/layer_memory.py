"""What a stack of MoE layers keeps alive after one inference forward under ``torch.no_grad``: the
bytes of the tensors its layers reference beyond their parameters and buffers (12 layers,
T = 8192 tokens, d = 512, N = 64, K = 2).

    PYTHONPATH=src python benchmarks/layer_memory.py            # the default (record_routing=None)
    PYTHONPATH=src python benchmarks/layer_memory.py --record   # record_routing=True
"""

from __future__ import annotations

import argparse

import torch

import moelab


def _bytes(obj, seen: set[int], depth: int = 0) -> int:
    if torch.is_tensor(obj):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if depth > 4:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(o, seen, depth + 1) for o in obj)
    if isinstance(obj, dict):
        return sum(_bytes(o, seen, depth + 1) for o in obj.values())
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_bytes(getattr(obj, f), seen, depth + 1) for f in obj.__dataclass_fields__)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", action="store_true", help="record_routing=True")
    args = p.parse_args()
    torch.manual_seed(0)
    kw = {"record_routing": True} if args.record else {}
    layers = torch.nn.Sequential(*[moelab.MoE(512, 64, 2, 512, **kw) for _ in range(12)])
    with torch.no_grad():
        layers(torch.randn(8192, 512))
    seen = {t.untyped_storage().data_ptr() for t in [*layers.parameters(), *layers.buffers()]}
    skip = ("_parameters", "_buffers", "_modules")
    kept = sum(_bytes(v, seen) for m in layers for k, v in vars(m).items() if k not in skip)
    print(f"kept after a no_grad forward: {kept / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
