"""Sparse upcycling: replace the dense MLPs of a model by MoE layers whose experts copy them.

Komatsuzaki et al. 2023 ("Sparse Upcycling"), the VIT setting of CompeteSMoE (2025): every expert
copies its pretrained MLP and the top-K router is learned from scratch (N(0, 0.02)), so the
upcycled model computes what the dense one did while the routing weights sum to 1.  A module is
upcycled only if it is an MLP, which is checked numerically, as :func:`moelab.from_hf` checks a
router: the module and the MLP rebuilt from its weights must agree on random inputs; anything
else is refused with a ``ValueError`` before the model changes.  docs/scaling-hf.md ("What upcycling
replaces") lists the recognised MLPs, the shared-expert split, the activations and the dropouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from ..functional import activation as activation_fn
from ..layer import MoE
from ..methods import get_method
from ..routers import ROUTERS, router_options

__all__ = ["SUPPORTED_MLPS", "find_mlps", "upcycle"]

SUPPORTED_MLPS = (
    "GPT-2 Conv1D MLP (c_fc, c_proj, act)",
    "LLaMA-style SwiGLU MLP (gate_proj, up_proj, down_proj, act_fn=silu)",
    "ViT/SigLIP/CLIP/timm MLP (fc1, fc2, activation_fn|act|act_fn)",
    "GPT-J / moelab.experts.MLP (fc_in, fc_out)",
    "nn.Sequential(Linear, activation, Linear)",
    "OPT/BART/Whisper layer's fc1, fc2, activation_fn (the MLP only)",
)

#: std of the upcycled router's N(0, 0.02²) init (CompeteSMoE (2025) App. H, VIT stage hyper-parameters)
ROUTER_INIT_STD = 0.02


class _Dense:
    """The weights of one recognised dense MLP, in ``nn.Linear`` layout."""

    def __init__(self, w_in: Tensor, b_in, w_out: Tensor, b_out, activation: str, dropout: float) -> None:
        self.w_in, self.b_in, self.w_out, self.b_out = w_in, b_in, w_out, b_out
        self.activation, self.dropout = activation, dropout

    @property
    def d_model(self) -> int:
        return self.w_in.shape[1]

    @property
    def d_hidden(self) -> int:
        return self.w_out.shape[1]


def _activation_name(act: Any) -> str | None:
    """moelab's name for a dense MLP's activation (module or function), else ``None``."""
    from ..functional import ACTIVATIONS

    for name, fn in ACTIVATIONS.items():
        if act is fn:
            return name
    if act in (F.relu, torch.relu):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if act is F.silu:
        return "silu"
    cls = type(act).__name__
    if cls == "GELU":  # torch.nn.GELU
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    if cls == "GELUActivation":  # transformers "gelu" (exact; gelu_python is the same function)
        return "gelu"
    return {
        "ReLU": "relu",
        "NewGELUActivation": "gelu_tanh",
        "GELUTanh": "gelu_tanh",
        "PytorchGELUTanh": "gelu_tanh",
        "SiLU": "silu",
        "SiLUActivation": "silu",
        "QuickGELUActivation": "quick_gelu",
    }.get(cls)


def _bias(layer: nn.Module) -> Tensor | None:
    return getattr(layer, "bias", None)


def _dropout_p(module: nn.Module | None) -> float:
    return float(module.p) if isinstance(module, nn.Dropout) else 0.0


def _refuse_activation(module: nn.Module, act: Any) -> None:
    raise ValueError(
        f"{type(module).__name__} uses activation {act!r}, which moelab experts do not have; "
        "supported: ReLU, GELU (exact or tanh), quick GELU, SiLU (SwiGLU for gate/up/down MLPs)"
    )


# ------------------------------------------------------------------------------------ recognition
#: the projection layouts of a dense MLP: (input projections, output projection, activation names)
_LAYOUTS = (
    (("c_fc",), "c_proj", ("act",)),  # GPT-2 (Conv1D)
    (("gate_proj", "up_proj"), "down_proj", ("act_fn", "act", "activation_fn")),  # LLaMA (SwiGLU)
    (("fc1",), "fc2", ("activation_fn", "act", "act_fn")),  # OPT/BART/ViT/CLIP/SigLIP/timm
    (("fc_in",), "fc_out", ("act", "activation_fn", "act_fn")),  # GPT-J, moelab.experts.MLP
)


def _is_projection(module: Any) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _layout(module: nn.Module) -> tuple[tuple[str, ...], str, str | None] | None:
    """``(input projections, output projection, activation attribute)`` if ``module`` holds the
    projections of a known MLP layout (the activation attribute ``None`` when it has none)."""
    for ins, out, acts in _LAYOUTS:
        if all(_is_projection(getattr(module, n, None)) for n in (*ins, out)):
            return ins, out, next((a for a in acts if hasattr(module, a)), None)
    return None


def _extras(module: nn.Module, parts: Iterable[str]) -> list[str]:
    """What ``module`` holds besides ``parts`` and parameter-free dropouts / identities: its
    other child modules and its own parameters (an MLP holds nothing else)."""
    parts = set(parts)
    extra = [
        n
        for n, child in module.named_children()
        if n not in parts and not isinstance(child, (nn.Dropout, nn.Identity))
    ]
    return extra + [n for n, _ in module.named_parameters(recurse=False)]


# ---------------------------------------------------------------------------- the numeric check
# Whether a module computes the MLP rebuilt from its weights is checked as moelab.from_hf checks a
# router: by running both on random inputs and comparing.  The inputs span four orders of
# magnitude, so that a clamp, a norm or a scale between the projections shows; the comparison
# allows the rounding of the weights' dtype, relative to each row's largest output.  Nothing of the
# model changes: modes, buffers and the random number generators are restored afterwards.

#: the largest difference allowed, relative to a row's largest output, by dtype (else 3e-2)
_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


@contextlib.contextmanager
def _probing(module: nn.Module, weight: Tensor) -> Iterator[None]:
    """Run probes of ``module`` without gradients and leave it as it was: its and its
    submodules' train/eval modes, its buffers, and the random number generators."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.clone()) for b in module.buffers()]
    cuda = [weight.device.index or 0] if weight.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            yield
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _probe_inputs(dense: _Dense) -> Tensor:
    """``(1, 16, d)`` random inputs in the weights' dtype and device, four rows per scale."""
    w = dense.w_in
    scales = (0.1, 1.0, 10.0) if w.dtype == torch.float16 else (0.1, 1.0, 10.0, 100.0)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4, dense.d_model, generator=g, dtype=torch.float64) * s for s in scales])
    return x.to(device=w.device, dtype=w.dtype).unsqueeze(0)


def _mismatch(got: Any, want: Tensor) -> str | None:
    """Why ``got`` is not ``want`` up to the rounding of its dtype, or ``None`` when it is."""
    if not isinstance(got, Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        return f"an output of shape {shape} where {tuple(want.shape)} was expected"
    diff = (got - want).abs().amax(-1).double()
    scale = want.abs().amax(-1).double()
    slack = _RTOL.get(want.dtype, 3e-2) * (scale + 1e-6 * scale.max())
    if not bool(torch.isfinite(got).all()) or bool((diff > slack).any()):
        worst = (diff / scale.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        return f"on random inputs they differ by up to {worst:.2g} times the output's largest entry"
    return None


class _Candidate(nn.Module):
    """The MLP rebuilt from a dense MLP's weights, as the upcycled experts compute it."""

    def __init__(self, dense: _Dense) -> None:
        super().__init__()
        self.dense = dense
        self.act = activation_fn(dense.activation)

    def forward(self, x: Tensor) -> Tensor:
        d = self.dense
        return F.linear(self.act(F.linear(x, d.w_in, d.b_in)), d.w_out, d.b_out)


def _refuse_meta(module: nn.Module, want: str) -> None:
    raise ValueError(
        f"{type(module).__name__} has its weights on the meta device; moelab checks by running it that it "
        f"computes {want} before upcycling it: load or initialise the weights first"
    )


def _check_mlp(module: nn.Module, dense: _Dense, out: str, want: str) -> float:
    """Check numerically that ``module`` computes ``want`` (the MLP of ``dense``); return the
    dropout probability of the dropout module it applies after ``out`` (kept after the MoE layer;
    dropout modules before it, inside the MLP, are dropped: the same in evaluation mode).

    Raises:
        ValueError: it computes something else in evaluation mode, or in training mode something
            else than its dropout modules change, or it applies more than one dropout after ``out``.
    """
    name = type(module).__name__
    if dense.w_in.is_meta:
        _refuse_meta(module, want)
    x = _probe_inputs(dense)
    with _probing(module, dense.w_in):
        order: list[str] = []
        hooks = [
            c.register_forward_hook(lambda m, a, o, n=n: order.append(n)) for n, c in module.named_children()
        ]
        try:
            got = module.eval()(x)
        finally:
            for h in hooks:
                h.remove()
        why = _mismatch(got, _Candidate(dense)(x))
        if why is not None:
            raise ValueError(f"{name}.forward does not compute {want} ({why}); moelab upcycles only that MLP")
        last = max((i for i, n in enumerate(order) if n == out), default=len(order))
        after = [n for n in order[last + 1 :] if isinstance(module.get_submodule(n), nn.Dropout)]
        after = [n for n in after if module.get_submodule(n).p > 0]
        if len(after) > 1:
            raise ValueError(f"{name}.forward applies the dropouts {after} after {out}; expected at most one")
        dropouts = [c for c in module.children() if isinstance(c, nn.Dropout)]
        hooks = [c.register_forward_hook(lambda m, a, o: a[0]) for c in dropouts]  # identities
        try:
            trained = module.train()(x)
        finally:
            for h in hooks:
                h.remove()
        if not (isinstance(trained, Tensor) and torch.equal(trained, got)):
            raise ValueError(
                f"{name}.forward computes something else in training mode, besides its dropout modules (a "
                "functional dropout?), which upcycling cannot keep; not upcycled"
            )
    return module.get_submodule(after[0]).p if after else 0.0


def _check_pair(layer: nn.Module, dense: _Dense) -> list[str]:
    """Check numerically that ``layer`` (an OPT/BART/Whisper-style layer) computes
    ``fc2(activation_fn(fc1(h)))`` between ``fc1`` and ``fc2``: its output on random hidden states
    is the same with the three replaced by the MLP rebuilt from their weights.  Return the dropout
    attributes to switch off between the two (``activation_dropout``).

    Raises:
        ValueError: the layer cannot be run on hidden states alone, calls ``fc1``, ``fc2`` or
            ``activation_fn`` other than once, computes something else between them, or applies
            a dropout between them in training mode other than ``activation_dropout``.
    """
    name, want = type(layer).__name__, "fc2(activation_fn(fc1(h)))"
    if dense.w_in.is_meta:
        _refuse_meta(layer, want)
    x = _probe_inputs(dense)
    params = list(inspect.signature(layer.forward).parameters.values())[1:]
    others = {
        p.name: None
        for p in params
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }  # the layer's other required inputs (attention masks): None

    def run() -> Any:
        out = layer(x, **others)
        return out if isinstance(out, Tensor) else out[0]  # the hidden states of a tuple or model output

    parts = {n: layer.get_submodule(n) for n in ("fc1", "activation_fn", "fc2")}
    seen: dict[str, list[tuple[Tensor, Tensor]]] = {n: [] for n in parts}

    def traced() -> Any:
        for calls in seen.values():
            calls.clear()
        hooks = [
            m.register_forward_hook(lambda m, a, o, n=n: seen[n].append((a[0], o))) for n, m in parts.items()
        ]
        try:
            return run()
        finally:
            for h in hooks:
                h.remove()

    def between_is_plain() -> bool:  # what enters fc2 is what activation_fn returned
        traced()
        return torch.equal(seen["fc2"][0][0], seen["activation_fn"][0][1])

    with _probing(layer, dense.w_in):
        layer.eval()
        try:
            reference = traced()
        except Exception as exc:  # a layer that needs inputs random hidden states do not give
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"{name}.forward cannot be run on random hidden states ({first}), so moelab cannot check that it "
                f"computes {want} between fc1 and fc2; not upcycled"
            ) from None
        counts = {n: len(calls) for n, calls in seen.items()}
        if counts != {"fc1": 1, "activation_fn": 1, "fc2": 1}:
            raise ValueError(
                f"{name}.forward calls fc1, activation_fn, fc2 {counts} times; expected once each"
            )
        layer.fc1, layer.activation_fn, layer.fc2 = _Candidate(dense), nn.Identity(), nn.Identity()
        try:
            candidate = run()
            why = _mismatch(candidate, reference)
        except Exception as exc:
            why = f"with that MLP in their place it raises {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        finally:
            layer.fc1, layer.activation_fn, layer.fc2 = parts["fc1"], parts["activation_fn"], parts["fc2"]
        if why is not None:
            raise ValueError(
                f"{name}.forward does not compute {want} between fc1 and fc2 ({why}); not upcycled"
            )
        layer.train()
        if between_is_plain():
            return []
        rate = getattr(layer, "activation_dropout", None)
        if isinstance(rate, float) and rate > 0:  # the dropout inside the MLP: switched off
            layer.activation_dropout = 0.0
            try:
                if between_is_plain():
                    return ["activation_dropout"]
            finally:
                layer.activation_dropout = rate
    raise ValueError(
        f"{name}.forward applies a dropout between fc1 and fc2 in training mode other than activation_dropout, "
        "which upcycling cannot keep or drop safely; set it to 0"
    )


class _Found:
    """A recognised dense MLP: a module (``kind="mlp"``) or a layer's fc1/fc2 pair (``"pair"``)."""

    def __init__(self, path: str, kind: str, dense: _Dense, switch_off: list[str] | None = None) -> None:
        self.path, self.kind, self.dense, self.switch_off = path, kind, dense, switch_off or []

    @property
    def name(self) -> str:
        return (
            f"{self.path}.fc1+fc2"
            if self.path and self.kind == "pair"
            else self.path or ("fc1+fc2" if self.kind == "pair" else "")
        )


def _dense_of(module: nn.Module, ins: tuple[str, ...], out: str, act_attr: str, dropout: float) -> _Dense:
    name, act = _activation_name(getattr(module, act_attr)), getattr(module, act_attr)
    proj = [getattr(module, n) for n in (*ins, out)]
    if len(ins) == 2:  # SwiGLU
        if name != "silu":
            _refuse_activation(module, act)
        g, u, d = proj
        if (_bias(g) is None) != (_bias(u) is None):
            raise ValueError(
                f"{type(module).__name__} with a bias on only one of gate_proj/up_proj is not supported"
            )
        if g.out_features != u.out_features or g.out_features != d.in_features:
            raise ValueError(
                f"{type(module).__name__} has gate/up/down widths {g.out_features}/{u.out_features}/"
                f"{d.in_features}; expected equal"
            )
        b_in = None if _bias(g) is None else torch.cat([g.bias, u.bias])
        return _Dense(torch.cat([g.weight, u.weight]), b_in, d.weight, d.bias, "swiglu", dropout)
    if name is None:
        _refuse_activation(module, act)
    f1, f2 = proj
    if type(f1).__name__ == "Conv1D":  # y = x @ W + b, W (in, out)
        w_in, w_out = f1.weight.T, f2.weight.T
    else:
        w_in, w_out = f1.weight, f2.weight
    swiglu_in = name == "swiglu" and w_in.shape[0] == 2 * w_out.shape[1]
    if (w_in.shape[0] != w_out.shape[1] and not swiglu_in) or w_in.shape[1] != w_out.shape[0]:
        raise ValueError(
            f"{type(module).__name__}: {ins[0]} {tuple(w_in.shape[::-1])} and {out} {tuple(w_out.shape[::-1])} "
            "(in, out) do not chain as d → h → d"
        )
    return _Dense(w_in, _bias(f1), w_out, _bias(f2), name, dropout)


def _classify(module: nn.Module, path: str) -> _Found | None:
    """``module`` as a recognised MLP or fc1/fc2 layer; ``None`` if it looks like neither;
    ``ValueError`` (naming the module's path) if it holds an MLP's projections but is neither,
    computes something else, or has an unsupported activation (never silently changed)."""
    try:
        return _recognise(module, path)
    except ValueError as exc:
        if not path:
            raise
        raise ValueError(f"{path!r}: {exc}") from None


def _recognise(module: nn.Module, path: str) -> _Found | None:
    if isinstance(module, nn.Sequential):
        if len(module) == 3:
            f1, act, f2 = module
            if isinstance(f1, nn.Linear) and isinstance(f2, nn.Linear) and f1.out_features == f2.in_features:
                name = _activation_name(act)
                if name is None and (
                    any(True for _ in act.parameters()) or isinstance(act, (nn.Identity, nn.Dropout))
                ):
                    return None  # e.g. Linear, LayerNorm, Linear: not an MLP
                if name is None:
                    _refuse_activation(module, act)
                dense = _Dense(f1.weight, f1.bias, f2.weight, f2.bias, name, 0.0)
                dense.dropout = _check_mlp(module, dense, "2", "Sequential(Linear, activation, Linear)")
                return _Found(path, "mlp", dense)
        return None
    layout = _layout(module)
    if layout is None:
        return None
    ins, out, act_attr = layout
    extras = _extras(module, (*ins, out, act_attr or ""))
    if act_attr is not None and not extras:  # a plain MLP: projections, an activation, nothing else
        dense = _dense_of(module, ins, out, act_attr, 0.0)
        want = (
            f"{out}({act_attr}({ins[0]}(x)) * {ins[1]}(x))"
            if len(ins) == 2
            else f"{out}({act_attr}({ins[0]}(x)))"
        )
        dense.dropout = _check_mlp(module, dense, out, want)
        return _Found(path, "mlp", dense)
    if (ins, out, act_attr) == (("fc1",), "fc2", "activation_fn") and all(
        isinstance(getattr(module, n), nn.Linear) for n in ("fc1", "fc2")
    ):  # OPT / BART / Whisper: the MLP's parts sit on the decoder layer itself
        dense = _dense_of(module, ins, out, act_attr, 0.0)
        return _Found(path, "pair", dense, _check_pair(module, dense))
    held = ", ".join((*ins, out))
    if act_attr is None:
        reason = "no activation (activation_fn, act or act_fn)"
    else:
        reason = f"{', '.join(repr(e) for e in extras)} besides them"
    raise ValueError(
        f"{type(module).__name__} holds {held} but {reason}: not a plain MLP (2 or 3 Linear "
        "projections and an activation, nothing else) nor an OPT/BART-style layer (fc1, fc2, activation_fn); "
        "not upcycled"
    )


def _find(model: nn.Module) -> list[_Found]:
    found: list[_Found] = []

    def visit(module: nn.Module, path: str) -> None:
        if isinstance(module, MoE):
            return  # already sparse (its shared experts are not dense MLPs to upcycle)
        hit = _classify(module, path)
        if hit is not None:
            found.append(hit)
            if hit.kind == "mlp":
                return
        for child_name, child in module.named_children():
            visit(child, f"{path}.{child_name}" if path else child_name)

    visit(model, "")
    return found


def find_mlps(model: nn.Module) -> list[str]:
    """The qualified names of the recognised dense MLPs of ``model``, in module order.

    A recognised MLP's own submodules are not searched again; ``""`` is ``model`` itself.  The
    fc1/fc2 pair of an OPT/BART/Whisper-style layer is named ``"<layer>.fc1+fc2"``.

    Raises:
        ValueError: a module holds an MLP's projections but is neither a plain MLP nor an
            fc1/fc2 layer, computes something else from them, or has an unsupported activation.
    """
    return [f.name for f in _find(model)]


def _router_kwargs(method: str, options: dict[str, Any], top_k: int = 2) -> dict[str, Any]:
    preset = get_method(method)
    out: dict[str, Any] = {}
    if "init_std" in router_options(ROUTERS[preset.router]) and "init_std" not in options:
        out["init_std"] = ROUTER_INIT_STD
    if top_k == 1:  # the weights sum to 1 at K = 1 too, so the upcycled model is the dense one
        if "base" in router_options(ROUTERS[preset.router]):  # competesmoe: its base router's option
            base = options.get("base", "smoe")
            renorm = _weights_sum_to_one(base, options.get("base_options") or {})
            if renorm and "base_options" not in options:
                out["base_options"] = renorm
        else:
            out.update(_weights_sum_to_one(method, options))
    return out


def _weights_sum_to_one(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The option that makes ``method``'s K = 1 weight the constant 1, where its default at K = 1 is
    Switch Transformer's weighting (the chosen expert's probability) and ``options`` leave it open."""
    preset = get_method(method)
    defaults = {f.name: f.default for f in dataclasses.fields(ROUTERS[preset.router].config_class)}
    for name in ("renormalize", "normalize"):
        if name in defaults and name not in options:
            if preset.options.get(name, defaults[name]) is None:  # decided by K
                return {name: True}
    return {}


def _build_moe(
    dense: _Dense, num_experts: int, top_k: int, method: str, options: dict[str, Any]
) -> nn.Module:
    w = dense.w_in
    layer = MoE(
        dense.d_model,
        num_experts,
        top_k,
        d_hidden=dense.d_hidden,
        method=method,
        activation=dense.activation,
        bias=dense.b_in is not None or dense.b_out is not None,
        **_router_kwargs(method, options, top_k),
        **options,
    )
    layer.to(device=w.device, dtype=w.dtype)
    share = 1.0 / (1 + layer.num_shared)  # the routed experts and each shared expert carry W_out/(S+1)
    with torch.no_grad():
        bank = layer.experts
        bank.w_in.copy_(dense.w_in.expand_as(bank.w_in))
        bank.w_out.copy_(dense.w_out.expand_as(bank.w_out) * share)
        if bank.b_in is not None:
            bank.b_in.copy_(
                torch.zeros_like(bank.b_in) if dense.b_in is None else dense.b_in.expand_as(bank.b_in)
            )
            bank.b_out.copy_(
                torch.zeros_like(bank.b_out)
                if dense.b_out is None
                else dense.b_out.expand_as(bank.b_out) * share
            )
        if layer.shared is not None:
            S = layer.num_shared
            fc_in, fc_out = layer.shared.fc_in, layer.shared.fc_out
            if dense.activation == "swiglu":  # [gate_1..gate_S | up_1..up_S]
                gate, up = dense.w_in.chunk(2)
                fc_in.weight.copy_(torch.cat([gate.repeat(S, 1), up.repeat(S, 1)]))
            else:
                fc_in.weight.copy_(dense.w_in.repeat(S, 1))
            fc_out.weight.copy_(dense.w_out.repeat(1, S) * share)
            if fc_in.bias is not None:
                if dense.b_in is None:
                    fc_in.bias.zero_()
                elif dense.activation == "swiglu":
                    bg, bu = dense.b_in.chunk(2)
                    fc_in.bias.copy_(torch.cat([bg.repeat(S), bu.repeat(S)]))
                else:
                    fc_in.bias.copy_(dense.b_in.repeat(S))
                fc_out.bias.copy_(
                    torch.zeros_like(fc_out.bias) if dense.b_out is None else dense.b_out * share
                )
    if dense.dropout > 0:
        return nn.Sequential(layer, nn.Dropout(dense.dropout))
    return layer


def upcycle(
    model: nn.Module,
    num_experts: int,
    top_k: int,
    method: str = "smoe",
    layers: Iterable[int] | None = None,
    **options: Any,
) -> nn.Module:
    """Replace the dense MLPs of ``model`` (in place) by :class:`moelab.MoE` layers.

    Args:
        model: a torch or transformers model, or a single recognised MLP.
        num_experts: experts per MoE layer, N.
        top_k: experts per token, K.
        method: a name from :func:`moelab.methods`.
        layers: indices into the model's recognised MLPs (:func:`find_mlps`, module order) to
            upcycle, e.g. ``range(1, L, 2)`` for every other block (GLaM); ``None``: all.
        **options: method options passed to every :class:`moelab.MoE` (the router's
            ``init_std`` defaults to 0.02 when the router has one).  At ``top_k=1`` the weight of
            the chosen expert is the constant 1 (``renormalize=True``, or ``normalize=True`` for
            the sigmoid routers), so the upcycled model is the dense one; the router then learns
            from its aux losses only.  ``renormalize=False`` gives Switch Transformer's weighting
            instead (the task loss reaches the router; the output starts scaled by the router's
            probability of the chosen expert, about 1/N at the 0.02 init).

    Returns:
        ``model`` with its MLPs replaced; for a single MLP, the new layer.  The new layers keep
        the dense weights' dtype and device, and the model's train/eval mode.

    Raises:
        ValueError: no recognised MLP, a module holding an MLP's projections that is not one of
            the recognised forms (see the module docstring), an unsupported activation, or bad
            sizes / indices; the model is then unchanged.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
    _validate.positive_int("num_experts", num_experts)
    _validate.int_in_range("top_k", top_k, 1, num_experts)
    get_method(method)
    from .convert import refuse_factorised_gates

    refuse_factorised_gates(method, "upcycle")
    found = _find(model)  # refuses anything it cannot upcycle exactly, before any change
    if not found:
        raise ValueError(
            f"model of type {type(model).__name__} has no recognisable dense MLP; supported: {list(SUPPORTED_MLPS)}"
        )
    if layers is not None:
        layers = list(layers)
        for i in layers:
            _validate.int_in_range("layers", i, 0, len(found) - 1)
        found = [found[i] for i in sorted(set(layers))]
    built = []  # every new layer first: a bad option changes nothing
    for hit in found:
        owner = model.get_submodule(hit.path) if hit.path else model
        new = _build_moe(hit.dense, num_experts, top_k, method, options)
        built.append((hit, owner, new.train(owner.training)))
    if len(built) == 1 and built[0][0].path == "" and built[0][0].kind == "mlp":
        return built[0][2]  # a single MLP: the new layer
    for hit, owner, new in built:
        if hit.kind == "pair":  # the layer's fc1 → act → fc2 becomes MoE → identity → identity
            owner.fc1, owner.activation_fn, owner.fc2 = new, nn.Identity(), nn.Identity()
            for attr in hit.switch_off:  # dropout between fc1 and fc2 (inside the MLP): dropped
                setattr(owner, attr, 0.0)
            continue
        parent_name, _, attr = hit.path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.Sequential) or attr.isdigit():
            parent[int(attr)] = new
        else:
            setattr(parent, attr, new)
    # what moelab.save records to rebuild the model offline (transformers config + these steps)
    recipe = list(getattr(model, "_moelab_recipe", []))
    recipe.append({"op": "upcycle", "num_experts": num_experts, "top_k": top_k, "method": method,
                   "layers": layers, "options": dict(options)})  # fmt: skip
    model._moelab_recipe = recipe
    if hasattr(type(model), "save_pretrained"):  # a transformers model: it cannot read the layers back
        from .convert import add_aux_to_output_loss, guard_save_pretrained, wire_padding

        guard_save_pretrained(model)
        add_aux_to_output_loss(model)
        wire_padding(model)  # its attention_mask reaches the new layers
    return model


# ---------------------------------------------------------------------------------------- CLI + reload


def load_hf_model(source: str | Path) -> nn.Module:
    """A transformers model from a local ``save_pretrained`` directory (weights loaded) or a
    config JSON file / directory holding only ``config.json`` (random init under the seed)."""
    import transformers

    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(
            f"--model {str(source)!r} does not exist (expected a local directory or a config JSON)"
        )
    config_file = source / "config.json" if source.is_dir() else source
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(config_file)!r} is missing; --model needs a transformers config.json")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {str(config_file)!r} is not valid JSON ({exc})") from None
    if "model_type" not in raw:
        raise ValueError(
            f"--model {str(config_file)!r} has no 'model_type'; expected a transformers config.json"
        )
    model_type = raw.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **raw)
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if arch is not None and not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(
            f"--model {str(config_file)!r} has architectures[0]={arch!r}, which is not a transformers "
            "model class; expected e.g. 'LlamaForCausalLM'"
        )
    # the weights transformers reads: model.safetensors or its shard index, never a pickle
    has_weights = source.is_dir() and any(
        (source / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
    )
    if source.is_dir() and not has_weights:
        if any(source.glob("*.bin")):
            raise ValueError(
                f"--model {str(source)!r} holds .bin weights (a pickle, which moelab does not read); "
                "save the model with safetensors (save_pretrained's default) and run again"
            )
        others = sorted(p.name for p in source.glob("*.safetensors"))
        if others:
            raise ValueError(
                f"--model {str(source)!r} holds {others[:3]} but no model.safetensors (or its index), the "
                "weights transformers reads; rename the file, or pass the config.json alone for a random init"
            )
    if cls is None:
        cls = transformers.AutoModel
    if not has_weights:
        return cls.from_config(config) if cls is transformers.AutoModel else cls(config)
    try:
        return cls.from_pretrained(source, local_files_only=True, use_safetensors=True)
    except Exception as exc:  # a damaged or foreign weights file: transformers' own error, in one line
        first = (str(exc).splitlines() or [""])[0][:200]
        raise ValueError(
            f"--model {str(source)!r}: transformers cannot load its weights ({type(exc).__name__}: {first})"
        ) from None
