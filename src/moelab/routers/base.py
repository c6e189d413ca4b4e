"""What every router shares: the registry of router families (name → :class:`Router` subclass),
sizes, validation, the options several families share (declared once, as config mixins), the step
a context reports, and a default for every optional hook."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _validate
from ..config import Interval, Options, setting, validate
from ..functional import expert_counts
from ..routing import Routing, RoutingContext

__all__ = [
    "ROUTERS",
    "InitStdOptions",
    "RenormalizeOptions",
    "Router",
    "RouterConfig",
    "ScaleOptions",
    "SelectionBiasOptions",
    "build_router",
    "counts_this_forward",
    "mean_over_pieces",
    "option_default",
    "register",
    "router_options",
    "softmax_over_all",
]

#: router family name → class; filled by :func:`register` when ``moelab.routers`` is imported
ROUTERS: dict[str, type[Router]] = {}


def register(name: str):
    """Class decorator: make a router available to the presets under ``name``.

    Raises:
        ValueError: the class is not a :class:`Router` subclass (whose hooks callers rely on), or
            ``name`` is taken.
    """

    def deco(cls: type[Router]) -> type[Router]:
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise ValueError(
                f"router {name!r} of type {getattr(cls, '__name__', cls)!r} is not allowed; expected a "
                "subclass of moelab.routers.Router"
            )
        if name in ROUTERS:
            raise ValueError(f"router {name!r} is already registered")
        ROUTERS[name] = cls
        return cls

    return deco


# ------------------------------------------------------------------ router configs
# A family's options are one frozen dataclass, its ``config_class``, declared with
# :func:`moelab.config.setting` (type, default, constraint); the options several families share are
# declared once below, as mixins the families' configs inherit.  Values that depend on d_model,
# num_experts or top_k are checked in the router's ``__init__``, the rules between options in the
# config's ``check()``.
@dataclass(frozen=True)
class RouterConfig:
    """The options of a router that has none (:attr:`Router.config_class` by default)."""


@dataclass(frozen=True)
class SelectionBiasOptions:
    """The aux-loss-free selection bias of DeepSeek-V3 (:meth:`Router.init_selection_bias`)."""

    selection_bias: bool = setting(
        False,
        help="carry the aux-loss-free selection bias (added to the gating scores for the choice only, "
        "moved once per optimizer step towards the mean load)",
    )
    bias_update_rate: float = setting(
        1e-3, help="the bias's step γ per optimizer step", allowed=Interval(float, 0)
    )


@dataclass(frozen=True)
class RenormalizeOptions:
    """Whether the K chosen weights are renormalised to sum to 1
    (:func:`moelab.functional.resolve_renormalize`)."""

    renormalize: bool | None = setting(
        None,
        help="renormalise the chosen weights to sum to 1; None: when K > 1 (Switch's weighting at K = 1)",
        allowed=Options((True, False, None)),
    )


@dataclass(frozen=True)
class InitStdOptions:
    """The std of the N(0, σ²) init of a linear router's ``W (N, d)``."""

    init_std: float | None = setting(
        None,
        help="std of the N(0, σ²) init of the router's weight; None: d_model^-1/2",
        allowed=(Interval(float, 0, closed="neither"), None),
    )


@dataclass(frozen=True)
class ScaleOptions:
    """A factor on the final weights (DeepSeek-V2/V3's ``routed_scaling_factor``)."""

    scale: float = setting(
        1.0,
        help="multiplies the final weights (routed_scaling_factor)",
        allowed=Interval(float, 0, closed="neither"),
    )


def option_default(mixin: type, name: str, default: Any) -> Any:
    """The shared option ``name`` of ``mixin`` — its help and constraint — with another default,
    for a family whose default differs (``aoe``'s ``renormalize=False``)."""
    field = {f.name: f for f in dataclasses.fields(mixin)}[name]
    return dataclasses.field(default=default, metadata=field.metadata)


def router_options(cls: type[Router]) -> list[str]:
    """The keyword options a router class accepts (beyond d_model, num_experts, top_k): the fields
    of its :attr:`Router.config_class`."""
    return [f.name for f in dataclasses.fields(cls.config_class)]


def _name_of(cls: type[Router]) -> str:
    return next((name for name, c in ROUTERS.items() if c is cls), cls.__name__)


def build_router(name: str, d_model: int, num_experts: int, top_k: int, **options) -> Router:
    """Build the router family ``name`` (a key of :data:`ROUTERS`) with its own options."""
    if name not in ROUTERS:
        raise ValueError(f"router={name!r} is not registered; allowed: {sorted(ROUTERS)}")
    return ROUTERS[name](d_model, num_experts, top_k, **options)


class Router(nn.Module):
    """Base of every registered router: holds ``d_model``, ``num_experts``, ``top_k``,
    ``layer_index``, and gives every hook the layer, :func:`moelab.attach`, the diagnostics and
    conversion call a default, so a router overrides only what it has.

    A router's ``forward(x, experts, ctx)`` maps tokens ``x (T, d)`` to a :class:`moelab.Routing`
    whose chosen experts are sorted by decreasing score.
    """

    #: names of the method-specific losses this router may put in ``Routing.losses``
    loss_names: tuple[str, ...] = ()

    #: the activation of the gating scores its selection bias is added to (``softmax`` or
    #: ``sigmoid``): a bias learned on one kind means nothing on the other
    gate: str = "softmax"

    #: the dtype the router computes its scores, weights and top-K in, autocast off
    #: (``MoE(router_dtype="float32")``, Megatron-Core's ``--moe-router-dtype``); ``None``: the
    #: activations' dtype
    compute_dtype: torch.dtype | None = None

    #: whether the chosen experts' weights are renormalised to sum to 1 over the K chosen; the
    #: top-(K+1) swap evaluation (:func:`moelab.metrics.swap_top1`) renormalises after dropping the
    #: top-1 iff so
    weights_sum_to_one: bool = True

    #: whether the router routes a variable number of experts per token (``Routing.mask``; K is then
    #: the most a token may take): diagnostics that replace "the K-th expert" refuse such a router
    variable_k: bool = False

    #: whether a token's routing depends on the later tokens of its batch (expert-choice): a causal
    #: language model built with such a router sees the future, and warns
    leaks_future_tokens: bool = False

    #: whether the router takes the tokens' ids (``forward(..., token_ids=ids)``, DeepSeek-V4's hash
    #: layers): the layer passes them, from ``MoE.forward(x, token_ids=...)``
    takes_token_ids: bool = False

    #: whether the router takes each token's document (``forward(..., doc_ids=docs)``, EMO's document
    #: pools): the layer passes a dense index in ``[0, T)`` from ``MoE.forward(x, doc_ids=...)``
    takes_doc_ids: bool = False

    #: the paper whose experts' gate projections are low-rank factors ``W_g = B A`` the router reads
    #: (``A x``: the layer builds its bank with ``gate_rank``); ``None`` for a router of full-rank experts
    factorised_gates: ClassVar[str | None] = None

    #: whether a learnable parameter decides the choice of experts (the diagnostics count its
    #: routing parameters); ``False`` for a layer whose choice is fixed: DeepSeek-V4's hash layers
    #: route by a token id table, their gate learning the weights only
    learns_choice: bool = True

    #: the family's options: a frozen dataclass of :mod:`moelab.config` fields (the shared ones from
    #: the mixins above); :func:`router_options` lists its fields
    config_class: ClassVar[type] = RouterConfig

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__()
        self.d_model = _validate.positive_int("d_model", d_model)
        self.num_experts = _validate.positive_int("num_experts", num_experts)
        self.top_k = _validate.int_in_range("top_k", top_k, 1, num_experts)
        #: the options as given, validated (:meth:`configure`); what the router derives from them
        #: (``renormalize`` resolved for K, ``k_max`` for N, ...) are its own attributes
        self.options = self.configure(options)
        self.layer_index = 0
        self.bias_update_rate = 0.0
        #: the aux-loss-free selection bias ``b (N,)`` (DeepSeek-V3), or ``None``
        #: (:meth:`init_selection_bias`)
        self.register_buffer("selection_bias", None)
        #: expert counts of the training forwards since the last step hook (not saved: a
        #: checkpoint is written after the hook has consumed them)
        self.register_buffer("pending_load", None, persistent=False)

    @classmethod
    def configure(cls, options: dict[str, Any]) -> Any:
        """``options`` as the family's :attr:`config_class`, each checked against its declared type
        and constraint and the config's ``check()`` (:func:`moelab.config.validate`); an option the
        family does not have is refused in one line with the allowed list."""
        names = router_options(cls)
        for key in options:
            if key not in names:
                raise ValueError(
                    f"option {key!r} is not accepted by router={_name_of(cls)!r}; allowed: {sorted(names)}"
                )
        return validate(cls.config_class(**options), names="arguments")

    # ------------------------------------------------------------ the aux-loss-free selection bias
    def init_selection_bias(self, enabled: bool, rate: float = 1e-3) -> None:
        """The aux-loss-free balancing of DeepSeek-V3 (its technical report; Wang et al. 2024,
        "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"), one mechanism for
        every router that calls :meth:`biased` on its selection scores and :meth:`count_load` on
        its choice: a per-expert offset ``b`` added to the scores *for the selection only* (the
        weights never see it), moved once per optimizer step by ``γ·sign(mean load − load_i)``
        (γ = ``rate``) in the step hook :meth:`on_step`, from the load of the step's training
        forwards summed over the ranks.  Each training forward only adds its counts to a pending
        load, so gradient accumulation updates ``b`` once with every micro-batch's load, an
        activation-checkpointing recomputation (run by the backward) is not counted twice, and a
        loop of forwards without ``ctx.advance()`` never changes ``b``.  Composes with any balance
        loss."""
        self.bias_update_rate = _validate.non_negative("bias_update_rate", rate)
        if enabled:
            self.selection_bias = torch.zeros(self.num_experts)
            self.pending_load = torch.zeros(self.num_experts)
        else:
            self.selection_bias = self.pending_load = None

    def biased(self, select: Tensor) -> Tensor:
        """``select + b``: the scores the choice is made on (``select`` itself without a bias)."""
        return select if self.selection_bias is None else select + self.selection_bias

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor | None:
        """The weights this router gives the experts ``indices (T, K)`` of the tokens it routed in
        ``routing`` (its own decision of this forward), by the rule it weighs its own choice with:
        routing replay (:mod:`moelab.routes`) weighs recorded choices by it from the live scores, so
        the router keeps its gradient.  ``None``: the router cannot weigh another choice (its
        weights depend on more than its scores of the chosen experts)."""
        return None

    def count_replayed(self, own: Tensor, replayed: Tensor) -> None:
        """Routing replay: the pending load of the selection bias counts the experts the tokens went
        to (``replayed``; ``-1``: an empty slot), not the router's ``own`` choice that
        :meth:`count_load` counted."""
        if self.training and self.selection_bias is not None and counts_this_forward():
            taken = (replayed >= 0).reshape(-1).to(torch.int64)
            went = taken.new_zeros(self.num_experts).scatter_add_(0, replayed.clamp(min=0).reshape(-1), taken)
            delta = went - expert_counts(own, self.num_experts)
            self.pending_load.add_(delta.to(self.pending_load.dtype))

    def count_load(self, indices: Tensor) -> None:
        """Add a training forward's choice to the pending load of the selection bias (nothing
        without one, in evaluation, or in an activation-checkpointing recomputation)."""
        if self.training and self.selection_bias is not None and counts_this_forward():
            # in place, not `+=`: that stores the buffer attribute again, a side effect compile refuses
            # under activation checkpointing
            self.pending_load.add_(expert_counts(indices, self.num_experts).to(self.pending_load.dtype))

    def reset_selection_bias(self) -> None:
        """The selection bias and the pending load back to zero."""
        with torch.no_grad():
            for b in (self.selection_bias, self.pending_load):
                if b is not None:
                    b.zero_()

    #: buffers a step hook moves by small steps, kept in at least float32 when the model is cast to
    #: bf16 / fp16 (a family adds its own: quantile balancing's β, expert-threshold's τ)
    float32_buffers: ClassVar[tuple[str, ...]] = ("selection_bias", "pending_load")

    def _apply(self, fn, *args, **kwargs):
        """Keep :attr:`float32_buffers` in at least float32 when the model is cast to bf16 / fp16:
        steps of γ = 1e-3 vanish in bfloat16 once ``|b| ≥ 0.5`` (DeepSeek-V3 keeps its bias in
        float32, Megatron-LM its quantile-balancing β)."""
        super()._apply(fn, *args, **kwargs)
        for name in self.float32_buffers:
            b = self._buffers.get(name)
            if b is not None and b.dtype in (torch.float16, torch.bfloat16):
                self._buffers[name] = b.float()
        return self

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        dtype = self.compute_dtype
        if dtype is None:
            return super().__call__(x, *args, **kwargs)
        with torch.autocast(x.device.type, enabled=False):
            return super().__call__(x.to(dtype), *args, **kwargs)

    def reset_parameters(self) -> None:
        """Initialise the router's parameters and state as at construction (e.g. after
        ``to_empty`` from the meta device).  A router without parameters has nothing to do."""

    @torch.no_grad()
    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """The step hook, run by :meth:`moelab.RoutingContext.advance` (:func:`moelab.attach`
        registers it) once per optimizer step, on every rank: the selection bias moves by
        ``γ·sign(mean load − load)`` with the load of the step's training forwards (summed over
        the ranks), then the load is cleared.  A router without a bias has nothing to do; a router
        with other per-step state extends it."""
        if self.selection_bias is None:
            return
        load = self.pending_load.float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load)
        if self.bias_update_rate > 0:  # an empty load (no training forward) moves nothing
            self.selection_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.pending_load.zero_()

    def on_step_change(self, ctx: RoutingContext) -> None:
        """The step watcher (:meth:`moelab.RoutingContext.add_step_watcher`, registered by
        :func:`moelab.attach`): run whenever the context's step or planned steps are set, outside
        any forward.  A router whose routing is a function of the step (SMoE-Dropout's K,
        StableMoE's stage) derives its value here and keeps it with the context it came from
        (:meth:`step_value`), so its ``forward`` reads one Python value that changes at a few
        steps: under ``torch.compile`` that is a guard on that value, which recompiles once per
        distinct value, not a guard on the step, which would recompile every step.  A router
        without such values has nothing to do."""

    def step_value(self, ctx: RoutingContext | None, name: str, compute: Callable[[], Any]) -> Any:
        """The step-derived value ``name`` kept by :meth:`on_step_change` for ``ctx``, else
        ``compute()`` (a context this router is not watching: correct, but a compiled forward then
        guards on what ``compute`` reads)."""
        kept = getattr(self, "_step_values", None)
        if kept is not None and ctx is not None and kept[0] is ctx:
            return kept[1][name]
        return compute()

    def keep_step_values(self, ctx: RoutingContext, **values: Any) -> None:
        """Keep the values :meth:`on_step_change` derived from ``ctx`` (a plain attribute, set
        outside any forward: not state, not saved)."""
        self._step_values = (ctx, values)

    #: what a family's :meth:`on_step` moves that its routing reads (quantile balancing's β,
    #: expert-threshold's τ, ...), said when it trains without a context that drives it; declaring it
    #: makes the hook one that must be registered (:meth:`step_hook_moves_state`)
    step_state: ClassVar[str | None] = None

    def step_dependence(self) -> str | None:
        """What of this router's training routing changes with the context's step (said when it
        trains without a context that drives it, :func:`moelab.layer.check_context`), or ``None``
        for a router whose routing does not depend on the step.  Here: the family's
        :attr:`step_state` and the selection bias; a router with other per-step behaviour adds its
        own (:func:`join_dependences`)."""
        bias = None
        if self.selection_bias is not None and self.bias_update_rate != 0:
            bias = (
                "its selection bias moves only in the step hook ctx.advance() runs (aux-loss-free balancing); "
                "without it the bias stays where it is and nothing balances the experts"
            )
        return join_dependences(self.step_state, bias)

    def context_problem(self, ctx: RoutingContext | None) -> str | None:
        """Why ``ctx`` does not drive this router's step-dependent routing, or ``None`` (also for
        a router without any).  Read in training forwards; it changes nothing."""
        if self.step_dependence() is None:
            return None
        if ctx is None:
            return "no RoutingContext is attached"
        if self.step_hook_moves_state() and self.on_step not in ctx.hooks:
            return "its step hook is not registered with the RoutingContext (moelab.attach registers it)"
        return None

    def step_hook_moves_state(self) -> bool:
        """Whether :meth:`on_step` moves state the routing reads (the selection bias, or the
        family's :attr:`step_state`), so the hook must be registered."""
        return self.step_state is not None or (self.selection_bias is not None and self.bias_update_rate > 0)

    def check_context(self, ctx: RoutingContext | None, method: str) -> None:
        """Warn when a layer of ``method`` trains this router, whose routing depends on the step
        (sharede-v3's selection bias, StableMoE's stage, SMoE-Dropout's K, the competition
        schedules), without a context that drives it: none, or one without what it needs
        (:meth:`context_problem`) — a warning Python's filters show once per process — or one whose
        step stays put while an optimizer steps (told by the context, once per method:
        :meth:`moelab.RoutingContext.check_advancing`).  Called by training forwards, not while
        compiling (a warning would break the graph); it changes nothing of the router."""
        what = self.step_dependence()
        if what is None or (ctx is not None and ctx.frozen):  # a frozen context: no step moves it, on purpose
            return
        problem = self.context_problem(ctx)
        if problem is not None:
            warnings.warn(
                f"MoE layer of method={method!r} trains without a RoutingContext that drives its "
                f"routing: {problem}; {what}. moelab.routing_context(model, total_steps) attaches one; "
                "then call ctx.advance() once after every optimizer step",
                stacklevel=2,
            )
            return
        ctx.check_advancing(method, what)

    def check_compute_dtype(self) -> None:
        """With a :attr:`compute_dtype` (``MoE(router_dtype=...)``), the parameters must be in it:
        refused in one line otherwise."""
        want = self.compute_dtype
        name = str(want).removeprefix("torch.")
        for key, p in self.named_parameters():
            if p.dtype != want:
                raise ValueError(
                    f"router_dtype={name!r} needs the router's parameters in {name}; {key} is {p.dtype} (keep "
                    "the router in float32, layer.router.float(), and run the rest under torch.autocast or in "
                    "bf16; under FSDP2 mixed precision use parallelize(..., mp_policy=...), which keeps it float32)"
                )

    # ------------------------------------------------------------ removing experts (moelab.prune)
    #: the parameters and buffers whose first dimension indexes this router's experts (a family
    #: lists its own; the selection bias is every router's): what removing experts slices
    expert_tensors: ClassVar[tuple[str, ...]] = ()

    def expert_rows(self, keep: Tensor) -> Tensor:
        """The rows of :attr:`expert_tensors` and of the selection bias that the experts ``keep``
        own (the same indices, unless the router scores more than its bank's experts: MoE++)."""
        return keep

    def removal_problem(self, kept: int) -> str | None:
        """Why this router cannot route among ``kept`` of its experts as it routes among them now
        (a token whose chosen experts are all kept must get the same experts and weights), or
        ``None``.  Here: none; a family whose rule reads every expert says why."""
        return None

    def kept_options(self) -> dict[str, Any]:
        """The options whose default depends on the number of experts, at this router's values: a
        router rebuilt with fewer experts is given them, so that only its experts change."""
        return {}

    def kept_state(self, state: dict[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
        """This router's ``state_dict`` (keys relative to it) with the experts ``keep`` only: the
        rows :meth:`expert_rows` names of :attr:`expert_tensors` and of the selection bias."""
        rows = self.expert_rows(keep)
        out = dict(state)
        for name in (*self.expert_tensors, "selection_bias"):
            if name in out:
                out[name] = out[name].index_select(0, rows.to(out[name].device))
        return out

    @property
    def base_router(self) -> Router:
        """The router whose scores and rule this one routes with: itself, or the base of a router
        composed around another (competesmoe's)."""
        return self

    def rule_options(self) -> dict[str, Any]:
        """The options that say how this router turns scores into weights — normalisation,
        ``scale``, group limits, the selection bias (its tensor, or ``None``), expert dropout, a
        schedule of K — by their constructor names: what conversion to and from transformers
        compares and carries over (:mod:`moelab.hf`).  None for a router without such options."""
        return {}

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}"


def softmax_over_all(renormalize: bool) -> str | None:
    """The removal problem of a router whose chosen weights are the softmax over all N experts
    (``renormalize=False``): the removed experts' logits are in every token's denominator."""
    if renormalize:
        return None
    return (
        "its weights are the softmax over all N experts (renormalize=False), whose denominator the removed "
        "experts are part of, so every kept expert's weight would change"
    )


def join_dependences(*parts: str | None) -> str | None:
    """The step dependences of a router's parts (:meth:`Router.step_dependence`), joined."""
    given = [p for p in parts if p]
    return "; ".join(given) if given else None


def counts_this_forward() -> bool:
    """False while the autograd engine recomputes a forward (activation checkpointing runs the
    forward again inside the backward pass): its tokens were counted by the first forward."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._current_graph_task_id() == -1


def mean_over_pieces(pending: Tensor) -> Tensor | None:
    """The mean of a step's per-piece statistics (a piece: one training forward, a micro-batch on one
    rank) from ``pending = [Σ_pieces value (n), pieces]`` summed in place by the forwards: the mean over
    this rank's pieces, then over the data-parallel ranks (one all-reduce of ``n + 1`` numbers, in a
    step hook; a rank without a piece counts for nothing), as Megatron-LM averages quantile balancing's
    quantiles; ``None`` when no rank had one.  One process with the ranks' batches as micro-batches
    gets the same mean.  In the pending sum's dtype, at least float32 (a float64 model's β and τ keep
    float64: a float32 mean would round the ranks' sum and one process's sum differently)."""
    pending = pending.to(torch.promote_types(pending.dtype, torch.float32))
    count = pending[-1]
    piece = torch.cat([pending[:-1] / count.clamp(min=1), (count > 0).float().reshape(1)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(piece)
    ranks = float(piece[-1])
    return None if ranks == 0 else piece[:-1] / ranks
