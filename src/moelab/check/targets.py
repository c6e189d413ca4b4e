"""What ``moelab check`` builds: a :class:`Target` is a factory of one MoE block (fresh, the same
weights on every call under the same seed), the expert kernels and capacities it exposes, and how
it is spread over processes (or why it cannot be without the user's help).

:func:`resolve` turns the command's ``--module`` text into one: ``moelab:<method>`` (a
:class:`moelab.MoE`), ``hf:<family>`` (a transformers MoE block from a tiny random config),
``titan`` (torchtitan's MoE with a moelab layer's weights) or ``package.module:factory`` (a user's
``nn.Module``).  docs/check.md lists what each exposes.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "HF_FAMILIES",
    "LAYOUTS",
    "Target",
    "callable_target",
    "hf_target",
    "import_object",
    "moelab_target",
    "resolve",
    "titan_target",
]

#: the layouts of the check: one process (every kernel, compile, checkpoint against the reference),
#: data parallel, FSDP2, expert parallel (experts split over every process, DDP for the rest) and
#: expert parallel × FSDP2 (experts split over 2 processes, FSDP2 over the rest and over the
#: processes holding the same experts)
LAYOUTS = ("single", "ddp", "fsdp2", "ep", "ep-fsdp2")

#: the transformers families built from tiny random configs: family → (modeling module, block class)
HF_FAMILIES: dict[str, tuple[str, str]] = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
}
#: transformers' expert implementations (``config._experts_implementation``) the check runs on
#: the CPU; "eager" is the per-expert loop of the modeling file
HF_KERNELS = ("eager", "batched_mm", "grouped_mm")

#: a parallelize function: ``fn(module, layout, world) -> module to call`` (``layout`` one of
#: :data:`LAYOUTS` but "single"); raising ``NotImplementedError(reason)`` marks the layout "not
#: applicable" with that reason
Parallelize = Callable[[nn.Module, str, int], nn.Module]


@dataclass
class Target:
    """One MoE block to check.

    Attributes:
        name: how the table names it.
        build: ``build(kernel, capacity) -> nn.Module``; called under a fixed seed, it must
            return the same weights every time.
        d_model: the block's input width (the batch's last dimension).
        kernels: the expert kernels it exposes (``(None,)``: one, unnamed); the first is the
            reference's.
        capacities: the capacity factors it accepts (``(None,)``: none).
        parallelize: how a layout is applied (``None``: :func:`generic_parallelize`, which has
            no expert parallelism).
        ep_reason: why expert parallelism is "not applicable" without a parallelize function.
        rounds_in: the dtype the module rounds to inside whatever its parameters' (torchtitan's
            experts compute in bfloat16): its tolerance is that dtype's.
    """

    name: str
    build: Callable[[str | None, float | None], nn.Module]
    d_model: int
    kernels: tuple[str | None, ...] = (None,)
    capacities: tuple[float | None, ...] = (None,)
    parallelize: Parallelize | None = None
    ep_reason: str = (
        "expert parallelism needs to know which parameters are experts and how tokens reach them; pass "
        "parallelize=fn (--parallelize package.module:fn) for this module"
    )
    rounds_in: torch.dtype | None = None


def moelab_target(
    method: str = "smoe",
    d_model: int = 8,
    num_experts: int = 4,
    top_k: int = 2,
    d_hidden: int = 8,
    **options: Any,
) -> Target:
    """A :class:`moelab.MoE` of ``method`` (with ``options``); its kernels are the
    :data:`moelab.experts.KERNELS` that run here and ``"padded"`` (``pad_to_capacity=True``: every
    expert on exactly C rows; with a capacity only), its capacities off and 1.25, and it is spread by
    :func:`moelab.train.parallelize.parallelize`."""
    from ..experts import KERNELS
    from ..layer import MoE

    for key in ("impl", "capacity_factor", "pad_to_capacity"):
        if key in options:
            raise ValueError(
                f"option {key}={options[key]!r} is not allowed; the check runs every kernel (kernels=) and "
                "capacity (capacities=) itself"
            )
    MoE(d_model, num_experts, top_k, d_hidden=d_hidden, method=method, **options)  # refuse early, in one line

    def build(kernel: str | None, capacity: float | None) -> nn.Module:
        extra = {} if capacity is None else {"capacity_factor": capacity}
        if kernel == "padded":  # every expert on exactly C rows, one bmm (moelab.experts.kernels.padded_rows)
            kernel, extra = "auto", {**extra, "pad_to_capacity": True}
        return MoE(
            d_model,
            num_experts,
            top_k,
            d_hidden=d_hidden,
            method=method,
            impl=kernel or "loop",
            **options,
            **extra,
        )

    kernels = tuple(k for k in KERNELS if k != "triton") + (("triton",) if torch.cuda.is_available() else ())
    kernels += ("padded",)
    return Target(
        name=f"moelab:{method}",
        build=build,
        d_model=d_model,
        kernels=kernels,
        capacities=(None, 1.25),
        parallelize=moelab_parallelize,
    )


def moelab_parallelize(module: nn.Module, layout: str, world: int) -> nn.Module:
    """A layout of :data:`LAYOUTS` through :func:`moelab.train.parallelize.parallelize`: ``ep`` is
    expert parallel over every process with DDP for the rest, ``ep-fsdp2`` expert parallel over 2
    processes with FSDP2 (on 2 processes: the experts whole on each, FSDP2 on the rest)."""
    from ..train.parallelize import parallelize

    dp, ep = {"ddp": ("ddp", 1), "fsdp2": ("fsdp", 1), "ep": ("ddp", world), "ep-fsdp2": ("fsdp", 2)}[layout]
    return parallelize(module, dp=dp, ep=ep)


def generic_parallelize(module: nn.Module, layout: str, world: int) -> nn.Module:
    """DDP and FSDP2 for any module; expert parallelism needs the module's structure."""
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, find_unused_parameters=True)
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module)
    raise NotImplementedError(layout)


def _tiny_hf_config(family: str, kernel: str | None):
    from transformers import AutoConfig

    sizes = {
        "hidden_size": 8,
        "intermediate_size": 8,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 8,
        "num_experts": 4,
        "num_local_experts": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "router_jitter_noise": 0.0,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
    }
    config = AutoConfig.for_model(family)
    for key, value in sizes.items():
        if hasattr(config, key):
            setattr(config, key, value)
    config._experts_implementation = kernel or "eager"
    return config


def hf_target(family: str) -> Target:
    """The MoE block of a transformers ``family`` (:data:`HF_FAMILIES`) from a tiny random config
    (width 8, 4 experts, top-2), each of :data:`HF_KERNELS`; DDP and FSDP2 generically."""
    if family not in HF_FAMILIES:
        raise ValueError(f"family={family!r} is not allowed; expected one of {sorted(HF_FAMILIES)}")
    from ..extras import require

    require("hf", f"moelab check --module hf:{family}")
    path, cls_name = HF_FAMILIES[family]
    cls = getattr(importlib.import_module(path), cls_name)

    def build(kernel: str | None, capacity: float | None) -> nn.Module:
        block = cls(_tiny_hf_config(family, kernel))
        # a block alone is not initialised (its PreTrainedModel's _init_weights would do it): every
        # floating tensor drawn, a selection bias (DeepSeek-V3's) included, so that it matters
        with torch.no_grad():
            for t in [*block.parameters(), *block.buffers()]:
                if t.is_floating_point():
                    t.normal_(0.0, 0.3)
        return block

    return Target(name=f"hf:{family}", build=build, d_model=8, kernels=HF_KERNELS)


def titan_target() -> Target:
    """torchtitan's MoE (``torchtitan.models.common.moe.MoE``) with a moelab SwiGLU layer's weights
    (:func:`moelab.train.titan.titan_moe`); DDP and FSDP2 generically."""
    from ..layer import MoE
    from ..train.titan import titan_moe

    try:
        importlib.import_module("torchtitan.models.common.moe")
    except ImportError as exc:
        raise ValueError(f"module='titan' needs torchtitan >= 0.3, which cannot be imported: {exc}") from None

    def build(kernel: str | None, capacity: float | None) -> nn.Module:
        layer = MoE(
            8, 4, 2, d_hidden=8, method="smoe", activation="swiglu", bias=False, balance_coef=0.0, z_coef=0.0
        )
        return titan_moe(layer)

    return Target(
        name="titan",
        build=build,
        d_model=8,
        rounds_in=torch.bfloat16,
        ep_reason="torchtitan applies its expert parallelism through its model's parallelize(parallel_dims), with "
        "an all-to-all token dispatcher chosen when the MoE is built; pass parallelize=fn (--parallelize "
        "package.module:fn) that does so",
    )


def import_object(spec: str, what: str) -> Any:
    """``package.module:name`` → the object (a one-line ``ValueError`` naming ``what`` otherwise)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what}={spec!r} is not allowed; expected package.module:name")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{what}={spec!r} cannot be imported: {exc}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}={spec!r}: module {module!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what}={spec!r} is not allowed; expected a callable, got {type(obj).__name__}")
    return obj


def callable_target(factory: Callable[..., nn.Module], d_model: int | None = None, name: str = "") -> Target:
    """A user's factory as a :class:`Target`.

    ``factory`` returns a fresh ``nn.Module`` taking ``(..., d_model)`` inputs.  It may declare
    ``factory.kernels`` (names; it is then called as ``factory(kernel=name)``), ``factory.d_model``
    (the input width) and ``factory.parallelize`` (a function ``fn(module, layout, world)``, see
    :data:`Parallelize`); a factory that returns a :class:`moelab.MoE` is spread by moelab's
    ``parallelize``."""
    kernels = tuple(getattr(factory, "kernels", None) or (None,))
    if kernels != (None,) and "kernel" not in inspect.signature(factory).parameters:
        raise ValueError(
            f"factory {name or factory!r} declares kernels={list(kernels)} but takes no kernel= argument"
        )

    def build(kernel: str | None, capacity: float | None) -> nn.Module:
        module = factory() if kernel is None else factory(kernel=kernel)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"factory {name or factory!r} returned {type(module).__name__}; expected an nn.Module"
            )
        return module

    torch.manual_seed(0)
    probe = build(kernels[0], None)
    from ..layer import moe_layers

    is_moelab = bool(moe_layers(probe))
    width = d_model or getattr(factory, "d_model", None) or getattr(probe, "d_model", None)
    width = width or getattr(getattr(probe, "config", None), "hidden_size", None)
    if not isinstance(width, int):
        raise ValueError(
            f"factory {name or factory!r}: the input width is unknown; pass d_model= (--d-model) or give the "
            "factory (or its module) a d_model attribute"
        )
    return Target(
        name=name or getattr(factory, "__name__", "module"),
        build=build,
        d_model=width,
        kernels=kernels,
        parallelize=getattr(factory, "parallelize", None) or (moelab_parallelize if is_moelab else None),
    )


def resolve(spec: str, options: dict[str, Any] | None = None, d_model: int | None = None) -> Target:
    """The ``--module`` text → a :class:`Target` (module docstring).  ``options`` go to a
    ``moelab:`` layer."""
    options = options or {}
    if options and not spec.startswith("moelab:"):
        raise ValueError(
            f"--option {sorted(options)} is not allowed with module={spec!r}; only moelab:<method> takes options"
        )
    if spec.startswith("moelab:"):
        from ..methods import methods

        method = spec.partition(":")[2]
        if method not in methods():
            raise ValueError(
                f"module={spec!r} is not allowed; expected moelab:<method>, a method of {methods()}"
            )
        return moelab_target(method, **({"d_model": d_model} if d_model else {}), **options)
    if spec.startswith("hf:"):
        return hf_target(spec.partition(":")[2])
    if spec == "titan":
        return titan_target()
    if ":" not in spec:
        raise ValueError(
            f"module={spec!r} is not allowed; expected moelab:<method>, hf:<family> ({', '.join(HF_FAMILIES)}), "
            "titan or package.module:factory"
        )
    return callable_target(import_object(spec, "module"), d_model, name=spec)


def layouts_of(text: Sequence[str] | str) -> tuple[str, ...]:
    """``"ddp,fsdp2"`` or a sequence → the layouts, each one of :data:`LAYOUTS` (a one-line refusal)."""
    items = [s.strip() for s in text.split(",")] if isinstance(text, str) else list(text)
    bad = [s for s in items if s not in LAYOUTS]
    if bad or not items:
        raise ValueError(f"layouts={items!r} is not allowed; expected some of {list(LAYOUTS)}")
    return tuple(dict.fromkeys(items))
