"""The layer's numbers, pinned: every method of ``moelab.methods()`` at K = 1 and 2, two layer
shapes, in training (two steps, the context advancing between them) and evaluation, with and
without capacity (both drop policies, padding), the sequence and global balance scopes, a
selection bias, DenseMixer, a shared expert, a token mask and the ERC loss: outputs, aux losses,
routings and every gradient in float64, by digest (``tests/golden/layer.json``).

Recorded before the layer was redesigned; ``test_layer_golden.py`` recomputes every case and
expects each tensor equal bit for bit.  ``python tests/layer_golden.py --write`` records anew
(only when a change of numbers is intended and explained).
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch

import moelab
from moelab.balance import StepBalance, step_balance_loss

GOLDEN = Path(__file__).parent / "golden" / "layer.json"

SHAPES = {
    "a": dict(d_model=6, num_experts=4, d_hidden=10, x=(2, 5, 6)),
    "b": dict(d_model=8, num_experts=6, d_hidden=8, activation="swiglu", bias=True, x=(3, 4, 8)),
}
VARIANTS = {
    "base": {},
    "capacity": {"capacity_factor": 1.0},
    "capacity-position": {"capacity_factor": 0.75, "token_drop_policy": "position"},
    "capacity-padded": {"capacity_factor": 1.25, "pad_to_capacity": True},
    "sequence": {"balance_scope": "sequence"},
    "global": {"balance_scope": "global"},
    "selection-bias": {"selection_bias": True},
    "densemixer": {"densemixer": True},
    "shared": {"num_shared": 1},
    "mask": {},
    "erc": {"erc_coef": 0.5},
}


def case_names() -> list[str]:
    return [f"{m}/k{k}/{s}/{v}" for m in moelab.methods() for k in (1, 2) for s in SHAPES for v in VARIANTS]


def _digest(t: torch.Tensor) -> list:
    t = t.detach().contiguous().cpu()
    raw = t.numpy().tobytes() if t.numel() else b""
    f = t.double()
    return [
        list(t.shape),
        str(t.dtype).removeprefix("torch."),
        hashlib.sha256(raw).hexdigest()[:24],
        float(f.sum()) if t.numel() else 0.0,
    ]


def _routing(prefix: str, layer: torch.nn.Module, out: dict) -> None:
    r = layer.last_routing
    if r is None:
        return
    out[f"{prefix}.indices"] = _digest(r.indices)
    out[f"{prefix}.weights"] = _digest(r.weights)
    if r.probs is not None:
        out[f"{prefix}.probs"] = _digest(r.probs)
    if r.mask is not None:
        out[f"{prefix}.mask"] = _digest(r.mask)


def compute(name: str) -> dict:
    """The digests of one case, or ``{"refused": message}`` when the layer refuses it."""
    method, k, shape, variant = name.split("/")
    spec = dict(SHAPES[shape])
    xshape = spec.pop("x")
    options = dict(VARIANTS[variant])
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer = moelab.MoE(top_k=int(k[1:]), method=method, **spec, **options).double()
    except ValueError as e:
        return {"refused": str(e).split(";")[0]}
    ctx = moelab.routing_context(layer, total_steps=4, seed=0)
    balance = StepBalance(layer, ctx) if options.get("balance_scope") == "global" else None
    gen = torch.Generator().manual_seed(1)
    out: dict = {}
    mask = None
    if variant == "mask":
        mask = torch.rand(xshape[:-1], generator=gen) > 0.3
    # a router that routes by document (EMO): two documents a sequence
    docs = {"doc_ids": (torch.arange(xshape[-2]) >= xshape[-2] // 2).long().expand(xshape[:-1])}
    docs = docs if layer.router.takes_doc_ids else {}
    layer.train()
    for step in (1, 2):
        x = torch.randn(xshape, generator=gen, dtype=torch.float64).requires_grad_()
        r = torch.randn(xshape, generator=gen, dtype=torch.float64)
        torch.manual_seed(10 + step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = layer(x, **docs) if mask is None else layer(x, token_mask=mask, **docs)
        loss = (y * r).sum() + moelab.aux_loss(layer)
        extra = step_balance_loss(layer)
        if extra is not None:
            loss = loss + extra
        loss.backward()
        p = f"train{step}"
        out[f"{p}.y"] = _digest(y)
        out[f"{p}.aux"] = _digest(layer.aux_loss.detach())
        out[f"{p}.x.grad"] = _digest(x.grad)
        for n, param in layer.named_parameters():
            if param.grad is not None:
                out[f"{p}.grad.{n}"] = _digest(param.grad)
        _routing(p, layer, out)
        layer.zero_grad()
        ctx.advance()
    layer.eval()
    x = torch.randn(xshape, generator=gen, dtype=torch.float64)
    torch.manual_seed(20)
    with torch.no_grad(), moelab.recording_routing(layer), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = layer(x, **docs) if mask is None else layer(x, token_mask=mask, **docs)
        out["eval.y"] = _digest(y)
        _routing("eval", layer, out)
    if balance is not None:
        balance.close()
    return out


def record() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: compute(name) for name in case_names()}
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python tests/layer_golden.py --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    data = record()
    GOLDEN.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
    refused = sum("refused" in v for v in data.values())
    print(f"{len(data)} cases, {refused} refused, {GOLDEN}")
