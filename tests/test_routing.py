"""Routing and RoutingContext."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moelab
from moelab.layer import moe_layers
from moelab.routing import Routing, RoutingContext


def test_routing_detach_drops_graph_and_outputs():
    w = torch.rand(3, 2, requires_grad=True)
    logits = torch.randn(3, 4, requires_grad=True)
    r = Routing(
        indices=torch.tensor([[0, 1], [2, 3], [1, 0]]),
        weights=w * 2,
        probs=logits.softmax(-1),
        logits=logits * 1,
        losses={"balance": logits.sum()},
        outputs=torch.randn(3, 2, 5, requires_grad=True),
    )
    d = r.detach()
    assert d.outputs is None
    for t in (d.weights, d.probs, d.logits, d.losses["balance"]):
        assert not t.requires_grad
    torch.testing.assert_close(d.weights, r.weights.detach())
    assert d.top_k == 2 and r.top_k == 2


def test_routing_optional_fields_default_to_none_and_empty():
    r = Routing(indices=torch.zeros(2, 1, dtype=torch.long), weights=torch.ones(2, 1))
    assert r.probs is None and r.logits is None and r.outputs is None and r.losses == {}
    d = r.detach()
    assert d.probs is None and d.logits is None


def test_context_progress_is_step_over_total_clipped():
    assert RoutingContext(step=3).progress is None
    assert RoutingContext(step=3, total_steps=12).progress == pytest.approx(0.25)
    assert RoutingContext(step=20, total_steps=10).progress == 1.0


def test_context_advance_and_state_dict_round_trip():
    ctx = RoutingContext(total_steps=100)
    ctx.advance()
    ctx.advance(4)
    assert ctx.step == 5
    other = RoutingContext()
    other.load_state_dict(ctx.state_dict())
    assert (other.step, other.total_steps) == (5, 100)
    moved = ctx.replace(step=9)
    assert moved.step == 9 and ctx.step == 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": -1}, r"step=-1 is not allowed; expected an integer >= 0"),
        ({"step": 1.5}, r"step=1.5 is not allowed; expected an integer >= 0"),
        ({"total_steps": 0}, r"total_steps=0 is not allowed; expected a positive integer"),
    ],
)
def test_context_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingContext(**kwargs)


def test_moe_layers_finds_layers_in_module_order_including_the_root():
    layer = moelab.MoE(4, 2, 1)
    assert moe_layers(layer) == [layer]
    model = nn.Sequential(nn.Linear(4, 4), moelab.MoE(4, 2, 1), nn.Sequential(moelab.MoE(4, 2, 1)))
    assert moe_layers(model) == [model[1], model[2][0]]
    assert moe_layers(nn.Linear(2, 2)) == []


def test_attached_context_reaches_the_router():
    layer = moelab.MoE(4, 4, 1, method="smoe-dropout")
    ctx = RoutingContext(step=0, total_steps=4)
    moelab.attach(layer, ctx)
    layer(torch.randn(3, 4))
    assert layer.last_routing.top_k == 1
    ctx.advance(4)  # the layer sees the shared object, not a copy
    layer(torch.randn(3, 4))
    assert layer.last_routing.top_k == 4


def test_active_indices_are_the_experts_of_the_active_slots_only():
    indices = torch.tensor([[2, 0, 1], [1, 3, 0]])
    weights = torch.tensor([[0.5, 0.0, 0.0], [0.2, 0.3, 0.0]])
    assert Routing(indices, weights).active_indices.tolist() == [2, 0, 1, 1, 3, 0]
    masked = Routing(indices, weights, mask=weights > 0)
    assert masked.active_indices.tolist() == [2, 1, 3]
    assert torch.equal(masked.detach().mask, weights > 0)
