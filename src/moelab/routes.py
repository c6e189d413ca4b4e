"""Route traces: record which experts every MoE layer chose, replay them with the right gradient,
and say where two routings differ.

Reinforcement learning on MoE models generates with one engine (another precision, another kernel)
and trains with another; the two route some tokens to other experts, and the policy gradient is then
taken through a model that did not produce the samples.  Rollout Routing Replay (Ma et al. 2025,
"Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers") replays the
inference engine's routes in training.  The weights must then come from the training forward's own
scores at the replayed experts — the softmax over the live logits gathered at the recorded ids and
renormalised as the method does — or the router gets no gradient (weights gathered from the
post-top-K, zero-filled probabilities are 0 wherever the two choices differ).

* :func:`record` runs a forward and returns its :class:`RouteTrace` (per MoE layer the ``(T, K)``
  expert ids, the tokens' shape and a digest of the router's logits);
* :meth:`RouteTrace.save` / :meth:`RouteTrace.load`: a safetensors file, its format in
  docs/routes.md, verified on reading;
* :func:`replaying`: within it, every MoE layer routes each token to the trace's experts, weighed by
  :meth:`moelab.routers.Router.weights_at` from the live scores;
* :func:`diff`: per layer the share of tokens whose expert set differs, the share differing in at
  least one layer, and where (layer × position).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .functional import taken_weights
from .layer import moe_layers, recording_routing
from .padding import current_mask
from .routers.base import Router
from .routing import Routing

__all__ = ["FORMAT", "RouteTrace", "RoutesDiff", "diff", "record", "replay_methods", "replaying"]

#: the ``format`` of a trace file's header and the version this code writes and reads
FORMAT = "moelab-routes"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class RouteTrace:
    """The routing of one forward of a model.

    Attributes:
        indices: per MoE layer, ``(T, K)`` int64: each routed token's experts, in the layer's order;
            for a layer that routes a variable number of experts per token (expert-threshold, token
            rounding: ``Routing.mask``) ``K`` is the most a token may take and a slot it did not
            take holds ``-1``.
        shapes: per MoE layer, the tokens' shape (the input's shape without ``d``, e.g. ``(B, L)``).
        tokens: per MoE layer, ``(T,)`` int64: the flat position in that shape of each routed token
            when a ``token_mask`` left some out; ``None``: every token, in order.
        logits_sha256: per MoE layer, the sha256 of the router's logits in float32 (``None`` for a
            router without logits): two traces with equal digests saw the same scores.
        methods: per MoE layer, the layer's method.
    """

    indices: list[Tensor]
    shapes: list[tuple[int, ...]]
    tokens: list[Tensor | None]
    logits_sha256: list[str | None]
    methods: list[str]

    @property
    def num_layers(self) -> int:
        return len(self.indices)

    def save(self, path: str | Path) -> Path:
        """Write the trace as safetensors (``layer<i>.indices`` int32, ``layer<i>.tokens``) with the
        JSON header of docs/routes.md, atomically."""
        from safetensors.torch import save as save_bytes

        from .io.atomic import atomic_write_bytes

        tensors = {}
        for i, (idx, tok) in enumerate(zip(self.indices, self.tokens)):
            tensors[f"layer{i}.indices"] = idx.to(torch.int32).contiguous().cpu()
            if tok is not None:
                tensors[f"layer{i}.tokens"] = tok.to(torch.int64).contiguous().cpu()
        header = {
            "format": FORMAT,
            "version": VERSION,
            "layers": [
                {"shape": list(shape), "logits_sha256": digest, "method": method, "masked": tok is not None}
                for shape, digest, method, tok in zip(
                    self.shapes, self.logits_sha256, self.methods, self.tokens
                )
            ],
            "sha256": _tensors_digest(tensors),
        }
        return atomic_write_bytes(path, save_bytes(tensors, metadata={"moelab": json.dumps(header)}))

    @classmethod
    def load(cls, path: str | Path) -> RouteTrace:
        """Read a trace written by :meth:`save`; a file that is not one, of another version, or
        whose tensors do not match its header's digest is refused in one line."""
        from safetensors import SafetensorError
        from safetensors.torch import load as load_bytes

        path = Path(path)
        data = path.read_bytes()
        try:
            tensors = load_bytes(data)
            metadata = json.loads(_metadata(data).get("moelab", "null"))
        except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a route trace ({str(exc).splitlines()[0]})") from None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a route trace (no {FORMAT!r} header)")
        if metadata.get("version") != VERSION:
            raise ValueError(
                f"{path} is a route trace of version {metadata.get('version')!r}; this moelab reads version {VERSION}"
            )
        if metadata.get("sha256") != _tensors_digest(tensors):
            raise ValueError(f"{path} does not verify: its tensors differ from the digest in its header")
        layers = metadata["layers"]
        return cls(
            indices=[tensors[f"layer{i}.indices"].long() for i in range(len(layers))],
            shapes=[tuple(layer["shape"]) for layer in layers],
            tokens=[tensors.get(f"layer{i}.tokens") for i in range(len(layers))],
            logits_sha256=[layer["logits_sha256"] for layer in layers],
            methods=[layer["method"] for layer in layers],
        )


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's JSON header."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


def _tensors_digest(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _logits_digest(logits: Tensor | None) -> str | None:
    if logits is None:
        return None
    return hashlib.sha256(logits.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()


def record(model: nn.Module, forward: Callable[[], Any]) -> tuple[RouteTrace, Any]:
    """Run ``forward()`` (one forward of ``model``) with every MoE layer keeping its routing and
    return ``(its trace, what forward returned)``."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model has no moelab MoE layer: nothing to record")
    seen: dict[int, tuple[tuple[int, ...], Tensor | None]] = {}

    def before(layer, args, kwargs):
        x = args[0]
        mask = kwargs.get("token_mask", args[1] if len(args) > 1 else None)
        if mask is not None:
            tokens = mask.reshape(-1).nonzero().squeeze(1).cpu()
        else:  # the padding mask a converted model's forward scoped (moelab.padding), if any
            scope = current_mask(x.numel() // x.shape[-1]) if x.shape[-1] else None
            tokens = None if scope is None or scope.real is None else scope.real.cpu()
        seen[id(layer)] = (tuple(x.shape[:-1]), tokens)

    handles = [layer.register_forward_pre_hook(before, with_kwargs=True) for layer in layers]
    try:
        with recording_routing(model):
            out = forward()
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, layer in enumerate(layers) if id(layer) not in seen or layer.recorded_routing is None]
    if missing:
        raise ValueError(
            f"MoE layers {missing} did not run in forward(): a trace holds every layer's routing"
        )
    routings = [layer.recorded_routing for layer in layers]
    trace = RouteTrace(
        indices=[_taken(r).cpu() for r in routings],
        shapes=[seen[id(layer)][0] for layer in layers],
        tokens=[seen[id(layer)][1] for layer in layers],
        logits_sha256=[_logits_digest(r.logits) for r in routings],
        methods=[layer.method for layer in layers],
    )
    return trace, out


def _taken(routing: Routing) -> Tensor:
    """The experts each token went to: ``Routing.indices`` with ``-1`` in the slots its mask left
    empty (a variable number of experts per token)."""
    return routing.indices if routing.mask is None else routing.indices.masked_fill(~routing.mask, -1)


def taken_order(recorded: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """A recorded variable choice ``recorded (T, W)`` (``-1``: an empty slot) as the layout of a
    variable router's own routing: ``(order (T, N), mask (T, N))``, each token's recorded experts in
    their recorded order, then the others by increasing id (the order expert-threshold and token
    rounding give their own untaken experts), ``mask`` the recorded ones.  No loop, no host sync."""
    t, w = recorded.shape
    n = num_experts
    taken = recorded >= 0
    # a sort key per (token, expert): the recorded slot for a taken expert, w + id for the others;
    # the empty slots write to a spare column n
    key = (torch.arange(n + 1, device=recorded.device) + w).expand(t, n + 1).clone()
    slots = torch.arange(w, device=recorded.device).expand(t, w)
    key.scatter_(1, torch.where(taken, recorded, n), torch.where(taken, slots, w + n))
    order = key[:, :n].argsort(dim=1)
    mask = torch.arange(n, device=recorded.device) < taken.sum(dim=1, keepdim=True)
    return order, mask


def replay_methods() -> list[str]:
    """The methods whose router can weigh a recorded choice (:meth:`Router.weights_at`)."""
    from .methods import build_method_router, methods

    names = []
    for name in methods():
        try:
            router = build_method_router(name, 8, 4, 2)
        except (ValueError, TypeError):
            continue
        if _weighs_replays(router):
            names.append(name)
    return names


def _weighs_replays(router: nn.Module) -> bool:
    return isinstance(router, Router) and type(router).weights_at is not Router.weights_at


class _Replay:
    """One layer's recorded choice, applied by the layer to each forward's routing."""

    def __init__(self, index: int, indices: Tensor) -> None:
        self.index = index
        self.indices = indices
        #: whether the trace holds a variable number of experts per token (slots of -1); read once
        #: here, on the host, so a forward does not sync to learn it
        self.variable = bool((indices < 0).any()) if indices.numel() else False

    def apply(self, layer: nn.Module, routing: Routing, rounds: bool) -> tuple[Routing, bool]:
        """The routing of the recorded choice weighed from this forward's scores, and whether it is
        already a token-rounded assignment (then the layer does not round it again).

        * a fixed-K router, a trace of its width without empty slots: the recorded experts weighed by
          :meth:`Router.weights_at`; token rounding (in training) applies after, to this choice;
        * a fixed-K router in a token-rounded training forward, a trace of width N (a rounded
          assignment): the assignment itself, each taken pair weighed by the live probability
          (:func:`moelab.functional.taken_weights`, the rounding's rule), not rounded again;
        * a variable router (expert-threshold): the recorded sets, weighed by
          :meth:`Router.weights_at` with ``-1`` in the empty slots;
        * a hash-routed layer (DeepSeek-V4): its fixed table, which must be the trace's choice.
        """
        router = layer.router
        want, own = self.indices.shape, routing.indices.shape
        assignment = rounds and not router.variable_k and want[1] == layer.num_experts and want[1] != own[1]
        if want[0] != own[0] or (want[1] != own[1] and not assignment):
            if want[0] == own[0] and self.variable and not router.variable_k:
                raise ValueError(
                    f"the route trace holds a variable number of experts per token for MoE layer {self.index}, "
                    f"whose forward routes a fixed K={own[1]} (token rounding applies in training only): "
                    "replay a trace of a forward like this one"
                )
            raise ValueError(
                f"the route trace holds {tuple(want)} choices (tokens, K) for MoE layer "
                f"{self.index}, whose forward routes {tuple(own)}: replay a trace on the batch it was recorded from"
            )
        indices = self.indices.to(routing.indices.device)
        if getattr(router, "hashed", False):
            if not torch.compiler.is_compiling() and not torch.equal(indices, routing.indices):
                moved = int((indices != routing.indices).any(dim=1).sum())
                raise ValueError(
                    f"the route trace sends {moved} of {own[0]} tokens of MoE layer {self.index}, hash-routed, to "
                    "other experts than its token id → experts table: replay a trace of this model on the token "
                    "ids it was recorded from"
                )
            return routing, False
        if assignment or router.variable_k:
            order, mask = taken_order(indices, layer.num_experts)
            slots = order.masked_fill(~mask, -1)
            if assignment:
                weights = taken_weights(routing.probs, slots)
            else:
                weights = router.weights_at(routing, slots)
            router.count_replayed(routing.indices, slots)
            replayed = dataclasses.replace(
                routing, indices=order, weights=weights.to(routing.weights.dtype), mask=mask
            )
            return replayed, assignment
        if self.variable:
            raise ValueError(
                f"the route trace holds a variable number of experts per token for MoE layer {self.index}, "
                f"whose forward routes a fixed K={own[1]} (token rounding applies in training only): "
                "replay a trace of a forward like this one"
            )
        weights = router.weights_at(routing, indices)
        router.count_replayed(routing.indices, indices)
        return dataclasses.replace(routing, indices=indices, weights=weights.to(routing.weights.dtype)), False


@contextlib.contextmanager
def replaying(model: nn.Module, trace: RouteTrace) -> Iterator[None]:
    """Within the block every MoE layer of ``model`` routes each token to the experts ``trace``
    recorded for it, weighed from the live scores (the router keeps its gradient); every forward in
    the block replays the same trace (an activation-checkpointing recomputation included).  A trace
    of another layer count, out-of-range experts, or a method whose router cannot weigh a recorded
    choice are refused here, a batch of another size at the forward."""
    layers = moe_layers(model)
    if len(layers) != trace.num_layers:
        raise ValueError(
            f"the route trace holds {trace.num_layers} MoE layers; the model has {len(layers)}: "
            "replay a trace of this model"
        )
    for i, (layer, indices) in enumerate(zip(layers, trace.indices)):
        if not _weighs_replays(layer.router):
            raise ValueError(
                f"routing replay is not available for method={layer.method!r} (MoE layer {i}): its weights "
                f"depend on more than its scores of the chosen experts; replay works for {', '.join(replay_methods())}"
            )
        if indices.numel() and not (-1 <= int(indices.min()) and int(indices.max()) < layer.num_experts):
            bad = int(indices.max()) if int(indices.max()) >= layer.num_experts else int(indices.min())
            raise ValueError(
                f"the route trace names expert {bad} in MoE layer {i}, which has "
                f"{layer.num_experts} experts: replay a trace of this model"
            )
        if layer.route_replay is not None:
            raise ValueError(
                f"MoE layer {i} is already replaying a trace: leave the first replaying() block first"
            )
    try:
        for i, (layer, indices) in enumerate(zip(layers, trace.indices)):
            layer.route_replay = _Replay(i, indices)
        yield
    finally:
        for layer in layers:
            layer.route_replay = None


@dataclasses.dataclass(frozen=True)
class RoutesDiff:
    """Where two traces of the same tokens route differently.

    Attributes:
        per_layer: per MoE layer, the share of tokens whose set of experts differs.
        any_layer: the share of tokens whose set differs in at least one layer (``None`` when the
            layers routed different tokens, a token mask differing per layer).
        by_position: ``(layers, L)`` the share of tokens at each position of the last dimension of
            the tokens' shape whose set differs (``None`` without a shape of 2 or more dimensions).
        tokens: per layer, the number of tokens compared.
    """

    per_layer: list[float]
    any_layer: float | None
    by_position: Tensor | None
    tokens: list[int]


def diff(a: RouteTrace, b: RouteTrace) -> RoutesDiff:
    """Compare two traces of the same tokens (same layers, shapes and masks), token by token: a token
    differs in a layer when its *set* of experts differs (the order of the K is not compared)."""
    if a.num_layers != b.num_layers:
        raise ValueError(
            f"the traces hold {a.num_layers} and {b.num_layers} MoE layers: compare traces of one model"
        )
    changed = []
    for i, (ia, ib, sa, sb, ta, tb) in enumerate(
        zip(a.indices, b.indices, a.shapes, b.shapes, a.tokens, b.tokens)
    ):
        same_tokens = (ta is None) == (tb is None) and (ta is None or torch.equal(ta, tb))
        if ia.shape != ib.shape or sa != sb or not same_tokens:
            raise ValueError(
                f"MoE layer {i} routed other tokens in the two traces ({tuple(ia.shape)} of {sa} and "
                f"{tuple(ib.shape)} of {sb}): compare traces of the same batch"
            )
        changed.append((ia.sort(dim=1).values != ib.sort(dim=1).values).any(dim=1))
    tokens = [c.numel() for c in changed]
    per_layer = [float(c.double().mean()) if c.numel() else 0.0 for c in changed]
    unmasked = all(t is None for t in a.tokens) and len(set(a.shapes)) == 1
    any_layer = (
        float(torch.stack(changed).any(dim=0).double().mean()) if unmasked and changed[0].numel() else None
    )
    by_position = None
    if unmasked and len(a.shapes[0]) >= 2:
        length = a.shapes[0][-1]
        by_position = torch.stack([c.view(-1, length).double().mean(dim=0) for c in changed])
    return RoutesDiff(per_layer, any_layer, by_position, tokens)
