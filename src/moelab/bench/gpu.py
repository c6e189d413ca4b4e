"""``moelab bench suite --device cuda``: the GPU grid — production MoE shapes at training batch sizes.

**Cases** (:func:`build_gpu_cases`): the shapes of four released models (:data:`MODELS`; "-like":
their expert widths, counts and top-K, not their routers) × tokens ``T`` (default 4096, 8192,
16384, 32768) × dtype (bfloat16 and float32; float32 only up to ``--fp32-max-tokens``, default
4096: without TF32 it runs at a fifteenth of the bfloat16 rate) × routing (``balanced`` and the
skewed ``zipf`` of :mod:`moelab.bench.suite`: the same inputs steer every candidate's router).
Where the weights, their gradients and a step's activations (:func:`memory_estimate`) would not
fit in 80 % of the device's memory, ``d_model`` is halved until they do (:func:`fit_d_model`;
the DeepSeek-V3-like shape on an 80 GB device), once per model and dtype, and recorded.

**Candidates**, each in both phases (``fwd``: forward under ``torch.inference_mode``;
``fwd+bwd``: forward and backward of a fixed random output gradient):

* ``dense``: :class:`moelab.experts.MLP`, SwiGLU of width ``(K + shared)·h`` — the same active
  expert FLOPs without routing, the limit every ratio is taken to;
* ``moelab grouped`` / ``moelab triton``: one :class:`moelab.MoE` (``smoe``, SwiGLU,
  ``check_finite=False``) run with ``impl="grouped"`` (``torch._grouped_mm``) and ``impl="triton"``
  (:mod:`moelab.experts.triton_kernels`; when triton is installed);
* ``transformers grouped_mm``: transformers' ``MixtralSparseMoeBlock`` with its ``grouped_mm``
  experts, holding the very parameters of the moelab layer (no copy; it has no shared expert, so
  its FLOPs differ where the model has one, and the row says so);
* peers, when installed (import-guarded; each checked against moelab's output before timing, a
  difference is reported in the row's note): megablocks' ``dMoE`` (dropless, grouped GLU),
  torchtitan's ``MoE`` (grouped experts), sonic-moe's ``MoE``.  Their versions are recorded.

**Timing**: one process; per case every candidate runs ``--warmup`` untimed rounds, then up to
``--repeats`` rounds interleaved (round-robin, the order rotating each round), cut short after
``--budget`` seconds (never fewer than 3 rounds); each call is timed by CUDA events around it;
medians; ``ratio_to_dense`` = the median over rounds of ``t / t_dense`` within the round.  The
expert FLOPs per token (2 per multiply-add, router excluded; backward counted as twice the
forward) give ``tflops`` and ``peak_fraction``: the share of the device's dense peak for the
dtype (:data:`PEAKS`, vendor datasheets, without sparsity; float32: the TF32 tensor-core peak
when ``torch.backends.cuda.matmul.allow_tf32`` is on, else the FP32 peak).  ``peak_mib``: the
growth of ``torch.cuda.max_memory_allocated`` over one untimed call, gradients freed before it.

A candidate that fails (out of memory, a peer's error) is dropped from its case with a note; the
run goes on.  ``--out FILE`` writes the JSON document after every case and the markdown table
(:func:`markdown_table`) beside it (``FILE`` with ``.md``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .. import _validate
from ..experts import MLP
from ..io.atomic import atomic_write_text
from ..layer import MoE
from .harness import machine_info
from .workload import ROUTINGS, favourite_experts, load_stats, name_list, peak_memory_bytes, routed_inputs
from .workload import int_list as _ints

__all__ = [
    "GPU_TOKENS",
    "MODELS",
    "PEAKS",
    "GpuCase",
    "build_gpu_cases",
    "device_peak_tflops",
    "fit_d_model",
    "markdown_table",
    "memory_estimate",
    "parse_gpu_grid",
    "run_case",
    "run_gpu",
    "time_rounds",
]


@dataclass(frozen=True)
class ModelShape:
    title: str
    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    shared: int = 0  # shared experts of width d_hidden


#: the shapes of the GPU grid
MODELS: dict[str, ModelShape] = {
    "mixtral": ModelShape("Mixtral-8x7B-like", 4096, 14336, 8, 2),
    "olmoe": ModelShape("OLMoE-1B-7B-like", 2048, 1024, 64, 8),
    "qwen3": ModelShape("Qwen3-30B-A3B-like", 2048, 768, 128, 8),
    "deepseek-v3": ModelShape("DeepSeek-V3-like", 7168, 2048, 256, 8, shared=1),
}
GPU_TOKENS = (4096, 8192, 16384, 32768)
GPU_DTYPES = ("bfloat16", "float32")
GPU_PEERS = ("transformers", "megablocks", "torchtitan", "sonic-moe")
#: share of the device memory the estimate may fill before d_model is halved
MEMORY_FRACTION = 0.8

#: dense (no sparsity) tensor-core peaks in TFLOP/s from the vendor datasheets, by a substring of
#: ``torch.cuda.get_device_name()`` (first match): ``(name, bf16, tf32, fp32)``.  "H100 80GB HBM3"
#: is the H100 SXM.
PEAKS: list[tuple[str, str, float, float, float]] = [
    ("H100 PCIe", "H100 PCIe", 756.0, 378.0, 51.2),
    ("H100 NVL", "H100 NVL", 835.0, 417.5, 60.0),
    ("H100", "H100 SXM", 989.4, 494.7, 66.9),
    ("GH200", "GH200", 989.4, 494.7, 66.9),
    ("H200", "H200 SXM", 989.4, 494.7, 66.9),
    ("A100", "A100", 312.0, 156.0, 19.5),
    ("L40S", "L40S", 362.1, 183.0, 91.6),
    ("L4", "L4", 121.0, 60.0, 30.3),
]


def device_peak_tflops(name: str, dtype: str, tf32: bool) -> tuple[str | None, float | None]:
    """``(datasheet name, peak TFLOP/s)`` of the device called ``name`` for ``dtype``, or ``(None, None)``."""
    for key, label, bf16, tf32_peak, fp32 in PEAKS:
        if key in name:
            if dtype in ("bfloat16", "float16"):
                return label, bf16
            return label, tf32_peak if tf32 else fp32
    return None, None


# ---------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class GpuCase:
    model: str
    tokens: int
    dtype: str
    routing: str
    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    shared: int
    d_model_preset: int

    @property
    def key(self) -> str:
        scaled = f" (scaled from {self.d_model_preset})" if self.d_model != self.d_model_preset else ""
        return (
            f"{self.model} T={self.tokens} {self.dtype} {self.routing}: d={self.d_model}{scaled} "
            f"h={self.d_hidden} N={self.num_experts} K={self.top_k}"
            + (f" +{self.shared} shared" if self.shared else "")
        )


def memory_estimate(shape: ModelShape, d_model: int, tokens: int, dtype: str) -> int:
    """Bytes one case needs at most, roughly: the experts' (and the dense FFN's) weights and
    their gradients, and per token slot the gathered input, the pre-activations, activations and
    outputs kept for backward and the backward's temporaries (``4d + 5h`` elements)."""
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    d, h, k = d_model, shape.d_hidden, shape.top_k
    weights = (
        (shape.num_experts + shape.shared) * 3 * d * h
        + shape.num_experts * d
        + (k + shape.shared) * 3 * d * h
    )
    slots = tokens * k
    return size * (2 * weights + slots * (4 * d + 5 * h) + tokens * (3 * shape.shared * h + 8 * d))


def fit_d_model(shape: ModelShape, tokens: int, dtype: str, memory: int | None) -> int:
    """``d_model`` of ``shape``, halved (to multiples of 128) until :func:`memory_estimate` at
    ``tokens`` fits in :data:`MEMORY_FRACTION` of ``memory`` bytes (``None``: unscaled)."""
    d = shape.d_model
    if memory is None:
        return d
    while d > 256 and memory_estimate(shape, d, tokens, dtype) > MEMORY_FRACTION * memory:
        d = max(256, (d // 2) // 128 * 128)
    return d


def build_gpu_cases(
    models: list[str],
    tokens: list[int],
    dtypes: list[str],
    routings: list[str],
    fp32_max_tokens: int,
    memory: int | None = None,
) -> list[GpuCase]:
    """The cases in run order (model, dtype, T, routing): float32 only up to ``fp32_max_tokens``;
    one ``d_model`` per model and dtype (:func:`fit_d_model` at the largest T of that dtype)."""
    cases = []
    for name in models:
        shape = MODELS[name]
        for dtype in dtypes:
            ts = [t for t in tokens if dtype != "float32" or t <= fp32_max_tokens]
            if not ts:
                continue
            d = fit_d_model(shape, max(ts), dtype, memory)
            for t in ts:
                for r in routings:
                    cases.append(
                        GpuCase(
                            name,
                            t,
                            dtype,
                            r,
                            d,
                            shape.d_hidden,
                            shape.num_experts,
                            shape.top_k,
                            shape.shared,
                            shape.d_model,
                        )
                    )
    return cases


def parse_gpu_grid(args: argparse.Namespace, memory: int | None = None) -> list[GpuCase]:
    """Validate the GPU options (before any CUDA check, so that a CPU machine can test them) and
    return the cases; ``memory``: the device's bytes (``None``: no d_model scaling)."""

    models = name_list("--models", args.models or ",".join(MODELS), tuple(MODELS))
    tokens = _ints("--tokens", args.tokens or ",".join(map(str, GPU_TOKENS)))
    dtypes = name_list("--dtype", args.dtype or ",".join(GPU_DTYPES), GPU_DTYPES)
    routings = name_list("--routing", args.routing, ROUTINGS)
    peers = name_list("--gpu-peers", args.gpu_peers or ",".join(GPU_PEERS), GPU_PEERS, empty_ok=True)
    fp32_max = _validate.positive_int("--fp32-max-tokens", args.fp32_max_tokens)
    if "float32" in dtypes and "bfloat16" not in dtypes and all(t > fp32_max for t in tokens):
        raise ValueError(
            f"--fp32-max-tokens={fp32_max} leaves no case: every --tokens value is larger; raise it or add bfloat16"
        )
    args.repeats = 7 if args.repeats is None else _validate.positive_int("--repeats", args.repeats)
    args.budget = 15.0 if args.budget is None else _validate.positive("--budget", args.budget)
    _validate.int_in_range("--warmup", args.warmup, 0, 1 << 20)
    args.gpu_grid = {
        "models": models,
        "tokens": tokens,
        "dtypes": dtypes,
        "routing": routings,
        "peers": peers,
        "fp32_max_tokens": fp32_max,
    }
    return build_gpu_cases(models, tokens, dtypes, routings, fp32_max, memory)


# ---------------------------------------------------------------------------------- candidates
@dataclass
class GpuCandidate:
    name: str
    phase: str  # "fwd" or "fwd+bwd"
    fn: Callable[[], None]
    reset: Callable[[], None]
    flops_per_token: int  # forward expert FLOPs
    note: str = ""
    times: list[float] = field(default_factory=list)
    peak_mib: float | None = None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _swiglu_flops(d: int, h: int) -> int:
    return 2 * 3 * d * h


def _mixtral_sharing(layer: MoE) -> nn.Module:
    """transformers' ``MixtralSparseMoeBlock`` (``grouped_mm`` experts) holding ``layer``'s parameters."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    bank = layer.experts
    config = MixtralConfig(
        hidden_size=bank.d_model,
        intermediate_size=bank.d_hidden,
        num_local_experts=bank.num_experts,
        num_experts_per_tok=layer.top_k,
        hidden_act="silu",
        router_jitter_noise=0.0,
    )
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(config)
    block.gate.weight = layer.router.weight
    block.experts.gate_up_proj = bank.w_in
    block.experts.down_proj = bank.w_out
    left = [n for n, p in block.named_parameters() if p.is_meta] + [
        n for n, b in block.named_buffers() if b.is_meta
    ]
    if left:
        raise RuntimeError(f"parameters not shared with moelab: {left}")
    return block


def _megablocks(layer: MoE, dtype: torch.dtype) -> nn.Module:
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE

    bank, d, h, n = layer.experts, layer.d_model, layer.experts.d_hidden, layer.num_experts
    device = bank.w_in.device
    margs = Arguments(
        hidden_size=d,
        ffn_hidden_size=h,
        moe_num_experts=n,
        moe_top_k=layer.top_k,
        mlp_type="glu",
        mlp_impl="grouped",
        activation_fn=torch.nn.functional.silu,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        device=device,
        moe_normalize_expert_weights=1.0,
        return_bias=False,
    )
    moe = dMoE(margs)
    with torch.no_grad():
        moe.router.layer.weight.copy_(layer.router.weight)
        moe.experts.mlp.w1.copy_(bank.w_in[:, :h].reshape(n * h, d))
        moe.experts.mlp.v1.copy_(bank.w_in[:, h:].reshape(n * h, d))
        moe.experts.mlp.w2.copy_(bank.w_out.transpose(1, 2).reshape(n * h, d))
    return _SeqFirst(moe.to(dtype))


def _torchtitan(layer: MoE, dtype: torch.dtype) -> nn.Module:
    try:
        from torchtitan.models.moe import MoE as TitanMoE
        from torchtitan.models.moe import MoEArgs
    except ImportError:
        from torchtitan.models.moe.moe import MoE as TitanMoE
        from torchtitan.models.moe.moe import MoEArgs
    bank, h = layer.experts, layer.experts.d_hidden
    margs = MoEArgs(
        num_experts=layer.num_experts,
        num_shared_experts=layer.num_shared,
        top_k=layer.top_k,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        use_grouped_mm=True,
        load_balance_coeff=None,
    )
    with torch.device(bank.w_in.device):
        moe = TitanMoE(margs, dim=layer.d_model, hidden_dim=h)
    with torch.no_grad():
        moe.router.gate.weight.copy_(layer.router.weight)
        moe.experts.w1.copy_(bank.w_in[:, :h])
        moe.experts.w3.copy_(bank.w_in[:, h:])
        moe.experts.w2.copy_(bank.w_out)
        if layer.shared is not None:
            sh = layer.num_shared * h
            moe.shared_experts.w1.weight.copy_(layer.shared.fc_in.weight[:sh])
            moe.shared_experts.w3.weight.copy_(layer.shared.fc_in.weight[sh:])
            moe.shared_experts.w2.weight.copy_(layer.shared.fc_out.weight)
    return _Batched(moe.to(dtype))


def _sonic(layer: MoE, dtype: torch.dtype) -> nn.Module:
    from sonicmoe import MoE as SonicMoE
    from sonicmoe.enums import ActivationType

    bank = layer.experts
    moe = SonicMoE(
        num_experts=layer.num_experts,
        num_experts_per_tok=layer.top_k,
        hidden_size=layer.d_model,
        intermediate_size=bank.d_hidden,
        activation_function=ActivationType.SWIGLU,
        add_bias=False,
        std=0.02,
    ).to(device=bank.w_in.device, dtype=dtype)
    with torch.no_grad():
        moe.router.weight.copy_(layer.router.weight)
    return _Batched(moe)


#: what a peer's row must say whatever its output: its expert weights are its own
PEER_NOTES = {"sonic-moe": "expert weights its own (layout not mapped from moelab's); router weight shared"}


class _Batched(nn.Module):
    """``(T, d)`` → ``peer(x.view(1, T, d))`` (its first output if a tuple) → ``(T, d)``."""

    def __init__(self, peer: nn.Module) -> None:
        super().__init__()
        self.peer = peer

    def forward(self, x: Tensor) -> Tensor:
        out = self.peer(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


class _SeqFirst(_Batched):
    """``(T, d)`` → ``peer(x.view(T, 1, d))`` (megablocks: sequence first)."""

    def forward(self, x: Tensor) -> Tensor:
        out = self.peer(x.unsqueeze(1))
        return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


#: peer name → (distribution whose version is recorded, adapter)
PEER_ADAPTERS: dict[str, tuple[str, Callable[[MoE, torch.dtype], nn.Module]]] = {
    "megablocks": ("megablocks", _megablocks),
    "torchtitan": ("torchtitan", _torchtitan),
    "sonic-moe": ("sonic-moe", _sonic),
}


class _Group:
    """The modules of one (model, dtype, d_model): built once, reused for every T and routing."""

    def __init__(self, case: GpuCase, peers: list[str], device: torch.device, seed: int) -> None:
        dtype = getattr(torch, case.dtype)
        self.notes: list[str] = []
        self.versions: dict[str, str | None] = {}
        torch.manual_seed(seed)
        d, h, n, k, s = case.d_model, case.d_hidden, case.num_experts, case.top_k, case.shared
        saved = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)  # build in place: no float32 copy of 10+ GB of weights
            with torch.device(device):
                self.layer = MoE(
                    d, n, k, d_hidden=h, method="smoe", activation="swiglu", check_finite=False, num_shared=s
                )
                self.dense = MLP(d, (k + s) * h, activation="swiglu")
        finally:
            torch.set_default_dtype(saved)
        moe_flops = (k + s) * _swiglu_flops(d, h)
        #: name → (module, moelab impl or None, forward FLOPs per token, note)
        self.modules: dict[str, tuple[nn.Module, str | None, int, str]] = {
            "dense": (self.dense, None, moe_flops, ""),
            "moelab grouped": (self.layer, "grouped", moe_flops, ""),
        }
        from ..experts.triton_kernels import unavailable_reason

        reason = unavailable_reason(device, dtype)
        if reason is None:
            self.modules["moelab triton"] = (self.layer, "triton", moe_flops, "")
        else:
            self.notes.append(f"moelab triton skipped: {reason}")
        self.versions["triton"] = _version("triton")
        if "transformers" in peers:
            self.versions["transformers"] = _version("transformers")
            try:
                block = _Batched(_mixtral_sharing(self.layer))
                note = "no shared expert: FLOPs differ from dense" if s else ""
                self.modules["transformers grouped_mm"] = (block, None, k * _swiglu_flops(d, h), note)
            except Exception as exc:  # an API change, a missing kernel: noted, not fatal
                self.notes.append(f"transformers grouped_mm skipped: {type(exc).__name__}: {exc}"[:300])
        for name in peers:
            if name not in PEER_ADAPTERS:
                continue
            dist, adapter = PEER_ADAPTERS[name]
            self.versions[name] = _version(dist)
            if self.versions[name] is None:
                self.notes.append(f"{name} skipped: not installed")
                continue
            flops = (k + (s if name == "torchtitan" else 0)) * _swiglu_flops(d, h)
            try:
                notes = [PEER_NOTES.get(name, "")]
                if s and name != "torchtitan":
                    notes.append("no shared expert: FLOPs differ from dense")
                self.modules[name] = (
                    adapter(self.layer, dtype),
                    None,
                    flops,
                    "; ".join(n for n in notes if n),
                )
            except Exception as exc:
                self.notes.append(f"{name} skipped: {type(exc).__name__}: {exc}"[:300])

    def close(self) -> None:
        self.modules.clear()
        del self.layer, self.dense
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _impl_call(module: nn.Module, impl: str | None, layer: MoE) -> Callable[[Tensor], Tensor]:
    if impl not in ("grouped", "triton"):
        return module

    def call(x: Tensor) -> Tensor:
        layer.experts.impl = impl
        return module(x)

    return call


def _case_candidates(group: _Group, x: Tensor, grad: Tensor) -> tuple[list[GpuCandidate], list[str]]:
    """Both phases of every module of ``group``, after a parity check against moelab grouped."""
    notes = []
    tol = 1e-3 if x.dtype == torch.float32 else 3e-2
    calls = {}
    with torch.inference_mode():
        ref = None
        for name, (module, impl, _, _) in group.modules.items():
            call = _impl_call(module, impl, group.layer)
            try:
                module.eval()
                y = call(x)
            except Exception as exc:
                notes.append(f"{name} dropped: {type(exc).__name__}: {exc}"[:300])
                continue
            calls[name] = call
            if name == "moelab grouped":
                ref = y
            elif ref is not None and name != "dense" and group.modules[name][2] != group.modules["dense"][2]:
                notes.append(f"{name}: output not compared (other FLOPs: no shared expert)")
            elif ref is not None and name != "dense":
                diff = float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
                if diff > tol:
                    notes.append(f"{name}: output differs from moelab grouped by {diff:.1e} (relative)")
    cands = []
    for phase in ("fwd", "fwd+bwd"):
        for name, call in calls.items():
            module, _, flops, note = group.modules[name]
            xin = x.detach().clone().requires_grad_(phase == "fwd+bwd")
            params = list(module.parameters())

            def reset(params=params, xin=xin) -> None:
                xin.grad = None
                for p in params:
                    p.grad = None

            if phase == "fwd":

                def fn(call=call, module=module, xin=xin) -> None:
                    module.eval()
                    with torch.inference_mode():
                        call(xin)

            else:

                def fn(call=call, module=module, xin=xin) -> None:
                    module.train()
                    call(xin).backward(grad)

            cands.append(GpuCandidate(name, phase, fn, reset, flops, note))
    return cands, notes


class _Clock:
    """Times one call: CUDA events around it on a CUDA device, ``perf_counter`` elsewhere (tests)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.ev0, self.ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.ev0.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.ev1.record()
            self.ev1.synchronize()
            return self.ev0.elapsed_time(self.ev1) / 1e3
        return time.perf_counter() - self.t0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def time_rounds(
    cands: list[GpuCandidate], repeats: int, warmup: int, budget: float, device: torch.device
) -> tuple[int, list[str]]:
    """Interleaved rounds, each call timed by CUDA events (module docstring); drops a candidate
    that raises.  Returns the rounds timed and notes."""
    notes = []
    clock = _Clock(device)

    def guarded(c: GpuCandidate) -> bool:
        try:
            c.fn()
            return True
        except Exception as exc:  # out of memory above all
            notes.append(f"{c.name} {c.phase} dropped: {type(exc).__name__}: {exc}"[:300])
            c.reset()
            clock.empty_cache()
            return False

    for _ in range(warmup):
        for c in list(cands):
            c.reset()
            if not guarded(c):
                cands.remove(c)
    clock.sync()
    start_t = time.perf_counter()
    rounds = 0
    for r in range(repeats):
        n = len(cands)
        for i in range(n):
            c = cands[(r + i) % n]
            c.reset()
            clock.start()
            ok = guarded(c)
            seconds = clock.stop()
            if ok:
                c.times.append(seconds)
        cands[:] = [c for c in cands if len(c.times) == r + 1]
        rounds += 1
        if rounds >= min(3, repeats) and time.perf_counter() - start_t > budget:
            break
    return rounds, notes


def _rows(cands: list[GpuCandidate], tokens: int, peak: float | None) -> list[dict]:
    dense = {c.phase: c for c in cands if c.name == "dense"}
    rows = []
    for c in cands:
        med = statistics.median(c.times)
        b = dense.get(c.phase)
        ratios = sorted(t / tb for t, tb in zip(c.times, b.times)) if b is not None else []
        flops = c.flops_per_token * tokens * (3 if c.phase == "fwd+bwd" else 1)
        tflops = flops / med / 1e12
        rows.append(
            {
                "name": c.name,
                "phase": c.phase,
                "median_ms": 1e3 * med,
                "min_ms": 1e3 * min(c.times),
                "max_ms": 1e3 * max(c.times),
                "rounds": len(c.times),
                "ratio_to_dense": statistics.median(ratios) if ratios else None,
                "flops_per_token": c.flops_per_token,
                "tflops": tflops,
                "peak_fraction": tflops / peak if peak else None,
                "peak_mib": c.peak_mib,
                "note": c.note,
            }
        )
    return rows


def run_case(
    case: GpuCase, group: _Group, args: argparse.Namespace, peak: float | None, device: torch.device
) -> dict:
    """Inputs, candidates, parity notes, timing and peak memory of one case: its JSON record."""
    dtype = getattr(torch, case.dtype)
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed + 1)
    favourites = favourite_experts(case.tokens, case.num_experts, case.routing, gen)
    x = routed_inputs(group.layer.router.weight, favourites, gen).to(device, dtype)
    grad = torch.randn(case.tokens, case.d_model, generator=gen).to(device, dtype)
    cands, notes = _case_candidates(group, x, grad)
    load = load_stats(group.layer.last_routing.indices, case.num_experts, favourites)
    rounds, more = time_rounds(cands, args.repeats, args.warmup, args.budget, device)
    notes += more
    if args.memory:
        for c in cands:
            c.reset()
            try:
                c.peak_mib = peak_memory_bytes(c.fn, device) / 2**20
            except Exception as exc:
                notes.append(f"{c.name} {c.phase} peak memory not measured: {type(exc).__name__}"[:300])
            c.reset()
    return {
        **asdict(case),
        "key": case.key,
        "load": load,
        "rounds": rounds,
        "seconds": time.perf_counter() - start,
        "notes": notes,
        "rows": _rows(cands, case.tokens, peak),
    }


# ---------------------------------------------------------------------------------- output
def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(doc: dict) -> str:
    """The GPU suite document as markdown: the machine, then one row per case × candidate × phase."""
    m, cfg = doc["machine"], doc["config"]
    lines = [
        f"Device: {m.get('gpu')} ({m.get('peak_name') or 'peak unknown'}: bf16 {_fmt(m.get('peak_bf16_tflops'), '.0f')} "
        f"TFLOP/s dense), torch {m['torch']}, CUDA {m.get('cuda')}; versions {m.get('versions')}; "
        f"{cfg['repeats']} rounds at most after {cfg['warmup']} warm-up, {cfg['budget']:g} s budget per case, CUDA events, medians.",
        "",
        "| model | T | dtype | routing | d | candidate | phase | median ms | × dense | TFLOP/s | % peak | peak MiB | note |",
        "|---|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for case in doc["cases"]:
        for r in case["rows"]:
            frac = None if r["peak_fraction"] is None else 100 * r["peak_fraction"]
            lines.append(
                f"| {case['model']} | {case['tokens']} | {case['dtype']} | {case['routing']} | {case['d_model']} "
                f"| {r['name']} | {r['phase']} | {r['median_ms']:.2f} | {_fmt(r['ratio_to_dense'])} "
                f"| {r['tflops']:.0f} | {_fmt(frac, '.0f')} | {_fmt(r['peak_mib'], '.0f')} | {r['note']} |"
            )
        for note in case["notes"]:
            lines.append(f"|  |  |  |  |  | note: {note} |  |  |  |  |  |  |  |")
    return "\n".join(lines)


def _write(doc: dict, out: Path | None) -> None:
    if out is None:
        return
    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")
    atomic_write_text(out.with_suffix(".md"), markdown_table(doc) + "\n")


def run_gpu(args: argparse.Namespace) -> int:
    """``moelab bench suite --device cuda`` (module docstring)."""
    parse_gpu_grid(args)  # validate everything before looking for a device
    if args.out is not None and args.out.exists() and not args.force:
        raise ValueError(f"--out={str(args.out)!r} exists; pass --force to overwrite it")
    if not torch.cuda.is_available():
        raise ValueError("--device='cuda' is not allowed here: torch sees no CUDA device; use --device cpu")
    props = torch.cuda.get_device_properties(0)
    cases = parse_gpu_grid(args, memory=props.total_memory)
    gpu = torch.cuda.get_device_name(0)
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    peak_name, bf16_peak = device_peak_tflops(gpu, "bfloat16", tf32)
    machine = {
        **machine_info(),
        "gpu": gpu,
        "gpu_memory_gib": props.total_memory / 2**30,
        "cuda": torch.version.cuda,
        "peak_name": peak_name,
        "peak_bf16_tflops": bf16_peak,
        "peak_fp32_tflops": device_peak_tflops(gpu, "float32", tf32)[1],
        "allow_tf32": tf32,
        "versions": {},
    }
    doc = {
        "bench": "suite-gpu",
        "schema": 1,
        "config": {
            **args.gpu_grid,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "budget": args.budget,
            "seed": args.seed,
            "memory": args.memory,
            "memory_fraction": MEMORY_FRACTION,
        },
        "machine": machine,
        "cases": [],
    }
    print(
        f"moelab bench suite --device cuda: {len(cases)} cases on {gpu} ({props.total_memory / 2**30:.0f} GiB), "
        f"torch {torch.__version__}, peak bf16 {_fmt(bf16_peak, '.0f')} TFLOP/s",
        flush=True,
    )
    group, group_key = None, None
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        key = (case.model, case.dtype, case.d_model)
        if key != group_key:
            if group is not None:
                group.close()
                group = None
            group = _Group(case, args.gpu_grid["peers"], torch.device("cuda"), args.seed)
            machine["versions"].update(group.versions)
            group_key = key
            group_notes = list(group.notes)
        else:
            group_notes = []
        peak = device_peak_tflops(gpu, case.dtype, tf32)[1]
        record = run_case(case, group, args, peak, torch.device("cuda"))
        record["notes"] = group_notes + record["notes"]
        doc["cases"].append(record)
        _write(doc, args.out)
        best = {r["name"]: r for r in record["rows"] if r["phase"] == "fwd+bwd"}
        summary = ", ".join(f"{n} {_fmt(r['ratio_to_dense'])}x" for n, r in best.items())
        print(
            f"[{i + 1}/{len(cases)} {time.perf_counter() - t0:.0f} s] {case.key}: fwd+bwd vs dense: {summary}",
            flush=True,
        )
    if group is not None:
        group.close()
    if args.json:
        print(json.dumps(doc))
    else:
        print(markdown_table(doc))
    sys.stdout.flush()
    return 0
