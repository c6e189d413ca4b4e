"""What every router shares: sizes, validation, and the step a context reports."""

from __future__ import annotations

from torch import nn

from .. import _validate
from ..routing import RoutingContext


class Router(nn.Module):
    """Base of the built-in routers: holds ``d_model``, ``num_experts``, ``top_k``, ``layer_index``."""

    #: names of the method-specific losses this router may put in ``Routing.losses``
    loss_names: tuple[str, ...] = ()

    #: whether the chosen experts' weights are renormalised to sum to 1 over the K chosen; the
    #: top-(K+1) swap evaluation (``MoE.swap_top1``) renormalises after dropping the top-1 iff so
    weights_sum_to_one: bool = True

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.d_model = _validate.positive_int("d_model", d_model)
        self.num_experts = _validate.positive_int("num_experts", num_experts)
        self.top_k = _validate.int_in_range("top_k", top_k, 1, num_experts)
        self.layer_index = 0

    @staticmethod
    def step_of(ctx: RoutingContext | None) -> int | None:
        return None if ctx is None else ctx.step

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}"
