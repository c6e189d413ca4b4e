"""``MoE``: router + experts (+ shared experts) → output, aux loss, last routing."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

try:  # sharded weights (FSDP2, expert parallelism); a torch without torch.distributed has none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()

from .aux_grad import AuxLossInjection, readout
from .balance import StepStatistics
from .errors import NonFiniteError
from .experts import MLP, ExpertBank, check_bank
from .experts.capacity import limit
from .experts.rounding import round_tokens
from .functional import document_index
from .layer_aux import aux_terms_of, check_erc, check_finite_scores, erc_of
from .layer_config import LAYER_LOSSES, MoEConfig
from .losses import LOSS_NAMES
from .methods import build_method_router
from .padding import current_mask
from .routers import Router
from .routing import Routing, RoutingContext

__all__ = [
    "MoE",
    "NonFiniteError",
    "attach",
    "aux_loss",
    "aux_terms",
    "count_parameters",
    "moe_layers",
    "recording_routing",
    "set_aux_scale",
]

#: the most aux-loss terms a layer records by name (the standard losses and a router's own)
_MAX_TERMS = 12


class MoE(nn.Module):
    """A sparse mixture-of-experts layer: ``x (..., d) → (..., d)``.

    Flow: flatten to ``(T, d)`` → ``router(x, experts, ctx)`` → :class:`moelab.Routing` (with its
    capacity and layout) → ``experts(x, routing)`` (+ the router's own experts, + shared experts of
    weight 1) → aux loss → reshape.

    Args:
        d_model: token width d.
        num_experts: routed experts N.
        top_k: experts per token K, in ``[1, N]``.
        d_hidden: hidden width of each expert (default ``d_model``, the CompeteSMoE (2024) setting).
        method: a name from :func:`moelab.methods` (the presets of :mod:`moelab.methods`).
        activation: expert activation ``relu``, ``gelu``, ``silu`` or ``swiglu``.
        bias: expert biases.
        impl: the experts' kernel, ``"auto"`` or a name of :data:`moelab.experts.KERNELS`.
        experts: an expert bank (a :class:`moelab.experts.SparseExperts`, e.g. a
            :class:`moelab.ModuleExperts` of CNN experts) instead of an :class:`ExpertBank`, with
            ``num_experts`` == N.
        check_finite: raise :class:`moelab.NonFiniteError` when router logits are NaN/inf (one
            host sync per forward; under ``torch.compile`` an asserting op).
        record_routing: keep ``last_routing``: ``None`` (default) after a forward with gradients,
            not compiled; ``True`` always; ``False`` never (:func:`recording_routing`).
        **options: the fields of :class:`moelab.layer_config.MoEConfig` (``num_shared``,
            ``balance_scope``, ``densemixer``, ``router_dtype``, ``capacity_factor``,
            ``token_drop_policy``, ``pad_to_capacity``, ``erc_alpha``), loss coefficients
            ``<loss>_coef`` and the method's router options, overriding the preset; docs/methods.md
            says what each does.

    After each forward: ``aux_loss`` (0-dim, the weighted sum of the aux losses) and, when
    recorded, ``last_routing`` (detached :class:`moelab.Routing`).

    The aux loss trains without being added to a loss: a training forward (training mode,
    gradients enabled) attaches its gradient to the output's autograd graph, whose backward adds
    ``scale · ∂aux_loss`` to the gradients (``scale`` 1, or what :func:`set_aux_scale` sets for a
    loss divided over accumulation steps or multiplied by a gradient scaler).  ``aux_loss`` is
    its value, a tensor with no graph to the parameters: ``loss = task + moelab.aux_loss(model)``
    stays right (the value is added, the gradient is not counted twice) and is refused in one line
    when the loss weighs it otherwise than ``scale``; ``torch.autograd.grad(layer.aux_loss,
    params)`` finds no path to ``params`` (torch raises).  Other forwards (evaluation,
    ``torch.no_grad``) compute no aux loss: ``aux_loss`` reads 0 after them.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        d_hidden: int | None = None,
        method: str = "smoe",
        activation: str = "relu",
        *,
        bias: bool = False,
        impl: str = "auto",
        experts: nn.Module | None = None,
        check_finite: bool = True,
        record_routing: bool | None = None,
        **options,
    ) -> None:
        super().__init__()
        if record_routing not in (None, True, False):
            raise ValueError(
                f"record_routing={record_routing!r} is not allowed; expected None, True or False"
            )
        #: every option of the layer, typed and checked (:class:`moelab.layer_config.MoEConfig`)
        named = dict(d_model=d_model, num_experts=num_experts, top_k=top_k, d_hidden=d_hidden, method=method,
                     activation=activation, bias=bias, impl=impl, check_finite=check_finite)  # fmt: skip
        self.config = cfg = MoEConfig.from_arguments(named, options)
        self.record_routing = record_routing
        #: an ``experts`` module was given, which a config cannot rebuild
        self.custom_experts = experts is not None
        self.router = build_method_router(method, d_model, num_experts, top_k, **cfg.router_options)
        if cfg.router_dtype is not None:  # the scores of the base router (a composed router runs experts)
            self.router.base_router.compute_dtype = getattr(torch, cfg.router_dtype)
        self.experts = self._expert_bank(experts)
        if cfg.coefs.get("erc", 0.0) > 0:
            check_erc(self.router, self.experts, cfg)
        hidden = cfg.num_shared * cfg.d_hidden
        self.shared = MLP(d_model, hidden, activation=activation, bias=bias) if cfg.num_shared else None
        self.ctx: RoutingContext | None = None
        # the aux values of the last training forward, ``[total, *terms by aux_names()]``, written in
        # place (a buffer, as BatchNorm's statistics: compile- and checkpoint-clean), and the weight
        # of the injected aux gradient (set_aux_scale); neither is saved with the model
        self.register_buffer("_aux_values", torch.zeros(1 + _MAX_TERMS), persistent=False)
        self.register_buffer("aux_scale", torch.ones(()), persistent=False)
        # the fraction of token slots the capacity dropped in the last forward (0 without capacity)
        self.register_buffer("_dropped", torch.zeros(()), persistent=False)
        #: the global scope's statistics of each training forward (moelab.balance), for a layer with a
        #: load-based loss over the step; ``None`` otherwise
        load = cfg.load_coefs
        global_scope = cfg.balance_scope == "global" and load
        self.step_statistics = StepStatistics(num_experts, load) if global_scope else None
        self._last_routing: Routing | None = None
        #: routing replay (:func:`moelab.routes.replaying`): while set, every forward routes each token
        #: to the experts it names, weighed from the live scores; ``None``: the router's own choice
        self.route_replay = None

    def _expert_bank(self, experts: nn.Module | None) -> nn.Module:
        """The layer's bank: an :class:`ExpertBank` of the config, or ``experts`` checked."""
        cfg = self.config
        gate_rank = getattr(self.router, "expert_gate_rank", None)  # Autonomy-of-Experts' factorised gates
        if experts is None:
            experts = ExpertBank(
                cfg.num_experts, cfg.d_model, cfg.d_hidden,
                activation=cfg.activation, bias=cfg.bias, impl=cfg.impl, gate_rank=gate_rank,
            )  # fmt: skip
        elif gate_rank is not None and getattr(experts, "gate_rank", None) != gate_rank:
            raise ValueError(
                f"experts of type {type(experts).__name__} are not allowed with method={cfg.method!r}; expected "
                f"an ExpertBank with gate_rank={gate_rank} (leave experts=None and the layer builds it)"
            )
        check_bank(experts, cfg.num_experts)
        if cfg.pad_to_capacity and isinstance(experts, ExpertBank) and experts.impl != "auto":
            raise ValueError(
                f"pad_to_capacity=True is not allowed with impl={experts.impl!r}: the padded experts run as one "
                "batched matmul (torch.bmm) of fixed shape (N, C, d); expected impl='auto'"
            )
        return experts

    # the config's fields, read where the layer's users have always read them
    d_model = property(lambda self: self.config.d_model)
    num_experts = property(lambda self: self.config.num_experts)
    top_k = property(lambda self: self.config.top_k)
    method = property(lambda self: self.config.method)
    check_finite = property(lambda self: self.config.check_finite)
    num_shared = property(lambda self: self.config.num_shared)
    coefs = property(lambda self: self.config.coefs)
    balance_scope = property(lambda self: self.config.balance_scope)
    densemixer = property(lambda self: self.config.densemixer)
    router_dtype = property(lambda self: self.config.router_dtype)
    capacity_factor = property(lambda self: self.config.capacity_factor)
    token_drop_policy = property(lambda self: self.config.token_drop_policy)
    pad_to_capacity = property(lambda self: self.config.pad_to_capacity)
    erc_alpha = property(lambda self: self.config.erc_alpha)

    @property
    def last_routing(self) -> Routing:
        """The routing of the last forward, detached, when it was recorded (``record_routing``)."""
        if self._last_routing is None:
            raise RuntimeError(
                f"MoE layer {self.layer_index} kept no routing of its last forward (a forward without "
                "gradients, or record_routing=False, records none); expected record_routing=True or the "
                "forward inside moelab.recording_routing(model)"
            )
        return self._last_routing

    @property
    def recorded_routing(self) -> Routing | None:
        """:attr:`last_routing`, or ``None`` when the last forward recorded none (or none ran)."""
        return self._last_routing

    @property
    def aux_loss(self) -> Tensor:
        """The weighted sum of the aux losses of the last training forward (0-dim).

        Its gradient already reaches the parameters through the layer's output (class
        docstring); the tensor returned may be added to a loss (it checks in backward that the
        loss weighs it by the layer's ``scale``, :func:`set_aux_scale`).  0 after a forward that
        computed none (evaluation, ``torch.no_grad``).
        """
        return readout(self._aux_values[0], self.aux_scale)

    def aux_names(self) -> tuple[str, ...]:
        """The names of the aux terms this layer may compute, in the order :meth:`aux_values` uses."""
        names = dict.fromkeys((*LOSS_NAMES, *type(self.router).loss_names, *LAYER_LOSSES))
        return tuple(names)[:_MAX_TERMS]

    def aux_values(self) -> dict[str, Tensor]:
        """The weighted aux terms ``coef · loss`` of the last training forward by name (detached;
        their sum is ``aux_loss``); the terms with a zero coefficient are left out."""
        values = self._aux_values.detach().clone()
        return {n: values[1 + i] for i, n in enumerate(self.aux_names()) if n in self.coefs}

    @property
    def layer_index(self) -> int:
        return self.router.layer_index

    @layer_index.setter
    def layer_index(self, value: int) -> None:
        self.router.layer_index = value

    def reset_parameters(self) -> None:
        """Initialise router, experts and shared experts as at construction: after
        ``to_empty`` from the meta device a layer is usable again (``MoE(..., device="meta")``
        style initialisation)."""
        for part in (self.router, self.experts, self.shared or nn.Identity()):
            for m in part.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        with torch.no_grad():
            self._aux_values.zero_()
            self.aux_scale.fill_(1.0)
            self._dropped.zero_()

    def _apply(self, fn, recurse: bool = True):
        """``to`` / ``half`` / ``bfloat16`` cast the layer; its aux bookkeeping stays at least float32
        (a bf16 aux scale of 1/3 would be 0.334, refused against the loss's exact 1/3), and a float64
        layer keeps its aux values in float64."""
        super()._apply(fn, recurse)
        for name in ("_aux_values", "aux_scale", "_dropped"):
            buffer = self._buffers[name]
            if buffer.dtype in (torch.float16, torch.bfloat16):
                self._buffers[name] = buffer.float()
        return self

    @property
    def dropped_fraction(self) -> float:
        """The fraction of the last forward's token slots (T·K) its expert capacity dropped
        (``capacity_factor``); 0 without a capacity."""
        return float(self._dropped)

    def extra_repr(self) -> str:
        return (
            f"method={self.method!r}, d_model={self.d_model}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, num_shared={self.num_shared}, coefs={self.coefs}"
        )

    def forward(
        self,
        x: Tensor,
        token_mask: Tensor | None = None,
        token_ids: Tensor | None = None,
        doc_ids: Tensor | None = None,
    ) -> Tensor:
        """``x (..., d) → (..., d)``.

        ``token_mask`` (``x.shape[:-1]``, bool, True for a real token), e.g. a padding mask: only
        the real tokens are routed, so padding counts in no routing statistic, aux loss, expert
        load, selection-bias update or capacity, as transformers' balance loss with its
        ``attention_mask``; masked tokens get output 0.  It costs one host sync (how many tokens
        are real) and routes the real tokens in their order: ``last_routing`` has one row each.
        Without ``token_mask``, the mask of an enclosing :func:`moelab.padding.masked_tokens`
        scope applies when it has as many tokens as ``x`` (a model's padding mask, found once a forward).

        ``token_ids`` (``x.shape[:-1]``, integer): the ids of the tokens ``x`` holds, for a router
        that routes by them (DeepSeek-V4's hash layers, ``Router.takes_token_ids``); other routers
        ignore them.

        ``doc_ids`` (``x.shape[:-1]``, integer): each token's document, for a router that routes by
        document (EMO's document pools, ``Router.takes_doc_ids``; refused without them).  A document
        is the tokens of one sequence (one row of ``x (..., S, d)``; all of a 2-D ``x``) that share
        an id: any integers, restarting in each row or not; two rows never share a document.  Other
        routers ignore them.
        """
        # the input's dtype is the router's parameters', or the experts' where router_dtype keeps the
        # router in float32 (FSDP2 mixed precision); weights sharded at rest (a DTensor) say nothing
        owner = self.router if self.router_dtype is None else self.experts
        weight = next((p for p in owner.parameters() if not isinstance(p, DTensor)), None)
        real = None
        if token_mask is None and isinstance(x, Tensor) and x.dim() >= 1 and x.shape[-1]:
            scope = current_mask(x.numel() // x.shape[-1])  # a padding mask the model's forward scoped
            if scope is not None:
                token_mask, real = scope.mask.view(x.shape[:-1]), scope.real
        self.config.check_input(x, token_mask, None if weight is None else weight.dtype)
        if self.training and not torch.compiler.is_compiling():  # a warning would break the graph
            self.router.check_context(self.ctx, self.method)
        shape = x.shape
        seq_len = shape[-2] if x.dim() >= 3 else None
        flat = x.reshape(-1, self.d_model)  # (T, d)
        ids = None
        if token_ids is not None:
            if tuple(token_ids.shape) != tuple(shape[:-1]) or token_ids.dtype not in (
                torch.int64,
                torch.int32,
            ):
                raise ValueError(
                    f"token_ids of shape {tuple(token_ids.shape)} and dtype {token_ids.dtype} is not allowed; "
                    f"expected integer token ids of the input's shape without its last dimension, {tuple(shape[:-1])}"
                )
            ids = token_ids.reshape(-1)
        docs = self._documents(doc_ids, shape) if self.router.takes_doc_ids else None
        if token_mask is not None:  # the real tokens alone, in their order
            if real is None:
                real = token_mask.reshape(-1).nonzero().squeeze(1)
            flat = flat.index_select(0, real)  # (T_real, d)
            ids = None if ids is None else ids.index_select(0, real)
            docs = None if docs is None else tuple(d.index_select(0, real) for d in docs)
        routing = self._route(flat, ids, None if docs is None else document_index(*docs))
        # (T, d); the routed experts on the router's inputs where it changes them (latent-prototype's aligner)
        y = self.experts(flat if routing.inputs is None else routing.inputs.to(flat.dtype), routing)
        if routing.direct is not None:  # experts the router ran itself (MoE++'s copy and constant experts)
            y = y + routing.direct.to(y.dtype)
        if self.shared is not None:
            y = y + self.shared(flat)
        routed = y
        y = self._attach_aux(y, routing, flat, seq_len)
        self._record(routing)
        if real is not None:  # the real tokens' outputs in their places, 0 for the masked ones
            y = y.new_zeros(shape.numel() // self.d_model, self.d_model).index_copy(0, real, y)
            routed = y
        if x.dim() == 2 and y is routed:
            return y  # a new tensor already
        y = y.reshape(shape)
        # A training output is a new tensor, not a view (of the aux-gradient injections' identity,
        # or of the flat tokens): torch.compile replays a view of a graph's input outside the graph
        # (the input after a graph break, such as expert parallelism's all-to-all), which would lose
        # the gradient injected on it; FSDP2 warns of a view, and an in-place change of the view
        # of a custom function is refused.  One copy; none in inference.
        return y.clone() if torch.is_grad_enabled() else y

    def _documents(self, doc_ids: Tensor | None, shape: torch.Size) -> tuple[Tensor, Tensor] | None:
        """``(ids (T,), rows (T,))`` of ``doc_ids`` for an input of ``shape``, checked; ``None``
        without ids (the router refuses)."""
        if doc_ids is None:
            return None
        if (
            not isinstance(doc_ids, Tensor)
            or tuple(doc_ids.shape) != tuple(shape[:-1])
            or doc_ids.dtype not in (torch.int64, torch.int32)
        ):
            got = (
                f"of shape {tuple(doc_ids.shape)} and dtype {doc_ids.dtype}"
                if isinstance(doc_ids, Tensor)
                else (f"of type {type(doc_ids).__name__}")
            )
            raise ValueError(
                f"doc_ids {got} is not allowed; expected integer document ids of the input's shape without its "
                f"last dimension, {tuple(shape[:-1])}"
            )
        ids = doc_ids.reshape(-1).long()
        per_row = shape[-2] if len(shape) >= 3 else max(ids.numel(), 1)  # a 2-D input is one sequence
        rows = torch.arange(ids.numel(), device=ids.device) // per_row
        return ids, rows

    def _route(self, x: Tensor, token_ids: Tensor | None = None, docs: Tensor | None = None) -> Routing:
        """The router's decision for ``x (T, d)`` (with the tokens' ids ``(T,)`` for a router that
        takes them, and their documents ``(T,)`` in ``[0, T)`` for one that routes by document),
        checked finite, with the layout the experts run it in: the slots within capacity, padding,
        DenseMixer's dense gradient."""
        if self.router_dtype is not None:
            self.router.base_router.check_compute_dtype()
        ids = {"token_ids": token_ids} if self.router.takes_token_ids else {}
        if self.router.takes_doc_ids:
            ids["doc_ids"] = docs
        routing = self.router(x, self.experts, self.ctx, **ids)
        rounds = self.config.token_rounding is not None and self.training  # SonicMoE's, in training
        if self.route_replay is not None:  # the recorded experts, weighed from this forward's scores
            routing, rounded = self.route_replay.apply(self, routing, rounds)
            rounds = rounds and not rounded  # a recorded rounded assignment is not rounded again
        if self.check_finite:
            check_finite_scores(routing, self.layer_index, self.method)
        if rounds:
            routing = round_tokens(
                routing, self.num_experts, self.config.rounding_tile, self.config.token_rounding
            )
        if self.capacity_factor is not None:
            routing, dropped = limit(routing, self.config)
            if dropped is None:
                self._dropped.zero_()
            else:
                self._dropped.copy_(dropped)
        if self.densemixer and self.training and torch.is_grad_enabled():
            routing = dataclasses.replace(routing, dense_gradient=True)
        return routing

    def _attach_aux(self, y: Tensor, routing: Routing, x: Tensor, seq_len: int | None) -> Tensor:
        """Compute the aux loss of a training forward, record its values in place and attach its
        gradient to ``y`` (and the step's global-scope statistics, :class:`moelab.balance.StepStatistics`);
        any other forward records zeros and computes nothing."""
        training = self.training and torch.is_grad_enabled()
        terms = (
            aux_terms_of(
                self.config, routing, x, seq_len, self._step_balanced(), self.layer_index, self.erc_loss
            )
            if training
            else {}
        )
        if not terms:
            self._aux_values.zero_()
        else:
            names = self.aux_names()
            dtype = self._aux_values.dtype
            total = sum(terms.values(), y.new_zeros((), dtype=torch.promote_types(dtype, torch.float32)))
            values = [total.detach().to(dtype)]
            values += [terms[n].detach().to(dtype) if n in terms else values[0].new_zeros(()) for n in names]
            values += [values[0].new_zeros(())] * (1 + _MAX_TERMS - len(values))
            self._aux_values.copy_(torch.stack(values))
            y = AuxLossInjection.apply(y, total, self.aux_scale)
        if training and self._step_balanced():
            y = self.step_statistics(y, routing, self.aux_scale)
        return y

    def _step_balanced(self) -> bool:
        """Whether a :class:`moelab.balance.StepBalance` forms this layer's global-scope losses."""
        return self.step_statistics is not None and self.step_statistics.balance is not None

    def _record(self, routing: Routing) -> None:
        record = self.record_routing
        if not torch.compiler.is_compiling():
            if record is None:  # a forward with gradients: its routing is held by the graph anyway
                record = torch.is_grad_enabled()
            self._last_routing = routing.detach() if record else None
        elif record:  # asked for under compile: a side effect dynamo replays (not under checkpointing)
            self._last_routing = routing.detach()

    def erc_loss(self, noise: Tensor | bool | None = True) -> Tensor:
        """The ERC loss of the router rows and the experts' gate projections (:func:`moelab.layer_aux.erc_of`)."""
        return erc_of(self.router, self.experts, self.config, noise)


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """Weigh the aux-loss gradient the MoE layers of ``model`` attach in training forwards by
    ``scale`` (default 1): the weight the task loss gets in ``backward`` — ``1 / accumulation
    steps`` for a loss divided over gradient accumulation, times a gradient scaler's scale (fp16).
    Megatron-Core's ``MoEAuxLossAutoScaler.set_loss_scale``; :class:`moelab.hf.MoETrainer` sets it."""
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float, Tensor))
        or not math.isfinite(float(scale))
    ):
        raise ValueError(f"scale={scale!r} is not allowed; expected a finite number")
    for layer in moe_layers(model):
        layer.aux_scale.fill_(float(scale))


@contextlib.contextmanager
def recording_routing(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Within the block every MoE layer of ``model`` keeps ``last_routing`` after each forward,
    also without gradients (the diagnostics run their forwards in it); restored after."""
    layers = moe_layers(model)
    saved = [layer.record_routing for layer in layers]
    for layer in layers:
        layer.record_routing = True
    try:
        yield layers
    finally:
        for layer, value in zip(layers, saved, strict=True):
            layer.record_routing = value


def aux_terms(model: nn.Module) -> dict[str, Tensor]:
    """The weighted aux terms ``coef · loss`` of ``model``'s last training forward by name, summed
    over its MoE layers (detached, sorted by name; their sum is :func:`aux_loss`)."""
    terms: dict[str, Tensor] = {}
    for layer in moe_layers(model):
        for name, value in layer.aux_values().items():
            terms[name] = terms[name] + value if name in terms else value
    return dict(sorted(terms.items()))


def aux_loss(model: nn.Module) -> Tensor:
    """The sum of ``aux_loss`` over every MoE layer of ``model`` (their last training forward)."""
    layers = moe_layers(model)
    if not layers:  # a dense model: a zero on the model's device, so ``task_loss + aux`` works anywhere
        p = next(model.parameters(), None)
        return torch.zeros(()) if p is None else p.new_zeros(())
    total = layers[0].aux_loss
    for layer in layers[1:]:
        total = total + layer.aux_loss
    return total


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(total, active)`` parameter counts (tied weights once); *active*: what one token uses,
    ``total − Σ_layers (N − K)/N · expert parameters``."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    inactive = 0
    for layer in moe_layers(model):
        n = layer.num_experts
        inactive += sum(p.numel() for p in layer.experts.parameters()) * (n - layer.top_k) // n
    return total, total - inactive


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers of ``model`` in module order (``model`` itself included if it is one)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; expected a torch.nn.Module")
    return [m for m in model.modules() if isinstance(m, MoE)]


def attach(model: nn.Module, ctx: RoutingContext) -> list[nn.Module]:
    """Give every MoE layer of ``model`` the shared context and its index (module order).

    Returns the layers, numbered ``0 .. L-1`` in their ``layer_index`` attribute.  Every router's
    ``on_step(ctx)`` (state updated once per optimizer step, e.g. sharede-v3's selection bias; a
    composed router's base too) is registered as a step hook of ``ctx``
    (:meth:`RoutingContext.advance`), and a router's ``on_step_change(ctx)`` (SMoE-Dropout's K,
    StableMoE's stage, derived outside the forward) as a step watcher. If the context
    holds a schedule with a ``num_layers`` attribute it must match the model's MoE layer count.
    """
    if not isinstance(ctx, RoutingContext):
        raise ValueError(f"ctx={ctx!r} is not allowed; expected a moelab.RoutingContext")
    layers = moe_layers(model)
    num_layers = getattr(ctx.schedule, "num_layers", None)
    if num_layers is not None and num_layers != len(layers):
        raise ValueError(
            f"schedule.num_layers={num_layers} does not match the model, which has {len(layers)} MoE layers"
        )
    for layer in layers:  # its step hook would never run: the steps of the new context would drop its losses
        balance = None if layer.step_statistics is None else layer.step_statistics.balance
        if balance is not None and balance.ctx is not None and balance.ctx is not ctx:
            raise ValueError(
                f"MoE layer {layer.layer_index} is attached to a StepBalance whose step hook runs on another "
                "routing context (a training loop left it attached), which is not allowed with a new context; "
                "expected close() it first (moelab.balance.attached_step_balance(model).close())"
            )
    for i, layer in enumerate(layers):
        layer.ctx = ctx
        layer.layer_index = i
        if layer.router.step_dependence() is not None:  # tell a context that does not advance
            ctx.watch_optimizers()
        for module in layer.router.modules():  # a composed router's base router too
            if isinstance(module, Router):
                ctx.add_step_hook(module.on_step)
                if type(module).on_step_change is not Router.on_step_change:  # a step-derived value
                    ctx.add_step_watcher(module.on_step_change)
    return layers
