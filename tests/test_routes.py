"""Route traces: record, save/load, replay with the live scores' gradient, diff."""

from __future__ import annotations

import copy

import pytest
import torch

import moelab
from moelab import routes
from moelab.cli import main
from moelab.layer import moe_layers
from moelab.routing import Routing

D, N, K = 16, 8, 2


def model(method="smoe", layers=2, seed=0, **options):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[moelab.MoE(D, N, K, method=method, **options) for _ in range(layers)])


def batch(seed=1):
    return torch.randn(4, 6, D, generator=torch.Generator().manual_seed(seed))


def grads(m):
    return {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", routes.replay_methods())
def test_replaying_a_models_own_trace_reproduces_its_output_and_every_gradient_bit_for_bit(method):
    m, x = model(method), batch()
    moelab.routing_context(m, total_steps=10, seed=0)
    m.train()
    x1 = x.clone().requires_grad_()
    torch.manual_seed(7)  # the same draws in both forwards (ERC's perturbations, sigma-moe's expert dropout)
    trace, y = routes.record(m, lambda: m(x1))
    (y.square().mean() + moelab.aux_loss(m)).backward()
    expected, expected_x = grads(m), x1.grad.clone()
    m.zero_grad()
    x2 = x.clone().requires_grad_()
    torch.manual_seed(7)
    with routes.replaying(m, trace):
        y2 = m(x2)
        (y2.square().mean() + moelab.aux_loss(m)).backward()
    assert torch.equal(y, y2) and torch.equal(expected_x, x2.grad)
    assert grads(m).keys() == expected.keys()
    assert all(torch.equal(grads(m)[name], g) for name, g in expected.items()), method


def other_trace(m, x):
    """The trace of ``m``'s layers with perturbed routers: other experts for some tokens."""
    other = copy.deepcopy(m).eval()
    with torch.no_grad():
        for layer in moe_layers(other):
            layer.router.weight.add_(torch.randn_like(layer.router.weight))
    return routes.record(other, lambda: other(x))[0]


def test_the_router_gradient_under_replay_is_that_of_the_live_softmax_at_the_recorded_experts():
    m, x = model(layers=1, balance_coef=0.0, z_coef=0.0), batch()
    trace = other_trace(m, x)
    layer = moe_layers(m)[0]
    own = routes.record(m, lambda: m(x))[0]
    assert 0 < routes.diff(own, trace).per_layer[0] < 1  # some tokens go elsewhere under replay
    with routes.replaying(m, trace):
        m(x).square().sum().backward()
    replayed = layer.router.weight.grad.clone()
    # the literal formula: w = softmax over the recorded experts of the live logits x Wᵀ
    m.zero_grad()
    flat = x.reshape(-1, D)
    logits = flat @ layer.router.weight.T
    idx = trace.indices[0]
    weights = logits.gather(1, idx).softmax(dim=-1)
    layer.experts(flat, Routing(indices=idx, weights=weights)).square().sum().backward()
    torch.testing.assert_close(replayed, layer.router.weight.grad, rtol=1e-6, atol=1e-7)
    assert replayed.abs().sum() > 0


def test_a_replay_that_gathers_from_the_zero_filled_top_k_probabilities_is_shown_to_lose_the_gradient():
    """The known bug: weights gathered from the router's own top-K probabilities, zero elsewhere."""
    m, x = model(layers=1, balance_coef=0.0, z_coef=0.0), batch()
    trace = other_trace(m, x)
    layer = moe_layers(m)[0]
    flat, idx = x.reshape(-1, D), trace.indices[0]
    logits = flat @ layer.router.weight.T
    own = logits.topk(K, dim=-1).indices
    zero_filled = torch.zeros_like(logits).scatter(1, own, logits.gather(1, own).softmax(-1))
    buggy = zero_filled.gather(1, idx)
    right = logits.gather(1, idx).softmax(dim=-1)
    moved = (idx.sort(1).values != own.sort(1).values).any(1)
    assert moved.any() and (buggy[moved] == 0).any() and (right[moved] > 0).all()
    with routes.replaying(m, trace):
        m(x).square().sum().backward()
    replayed = layer.router.weight.grad.clone()
    m.zero_grad()
    layer.experts(flat, Routing(indices=idx, weights=buggy)).square().sum().backward()
    assert not torch.allclose(replayed, layer.router.weight.grad, rtol=1e-3)


def test_a_trace_round_trips_through_its_file_and_a_token_mask_keeps_its_positions(tmp_path):
    m, x = model(), batch()
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 4:] = False
    trace, y = routes.record(m, lambda: [layer(x, token_mask=mask) for layer in moe_layers(m)])
    loaded = routes.RouteTrace.load(trace.save(tmp_path / "a.routes"))
    assert loaded.shapes == [(4, 6), (4, 6)] and loaded.methods == ["smoe", "smoe"]
    assert all(torch.equal(a, b) for a, b in zip(loaded.indices, trace.indices))
    assert torch.equal(loaded.tokens[0], mask.reshape(-1).nonzero().squeeze(1))
    assert loaded.logits_sha256 == trace.logits_sha256 and len(trace.logits_sha256[0]) == 64
    with routes.replaying(m, loaded):
        again = [layer(x, token_mask=mask) for layer in moe_layers(m)]
    assert all(torch.equal(a, b) for a, b in zip(y, again))


def test_a_damaged_a_foreign_or_a_newer_trace_file_is_refused_in_one_line(tmp_path):
    m, x = model(), batch()
    path = routes.record(m, lambda: m(x))[0].save(tmp_path / "a.routes")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    (tmp_path / "bad.routes").write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=r"bad.routes does not verify: its tensors differ from the digest in its header$"
    ):
        routes.RouteTrace.load(tmp_path / "bad.routes")
    (tmp_path / "text.routes").write_text("hello")
    with pytest.raises(ValueError, match=r"text.routes is not a route trace \("):
        routes.RouteTrace.load(tmp_path / "text.routes")
    moelab.save(m[0], tmp_path / "saved")
    with pytest.raises(
        ValueError, match=r"model.safetensors is not a route trace \(no 'moelab-routes' header\)$"
    ):
        routes.RouteTrace.load(tmp_path / "saved" / "model.safetensors")
    newer = data[:]
    text = bytes(newer).replace(b'\\"version\\": 1', b'\\"version\\": 2')
    assert text != bytes(path.read_bytes())
    (tmp_path / "v2.routes").write_bytes(text)
    with pytest.raises(
        ValueError, match=r"v2.routes is a route trace of version 2; this moelab reads version 1$"
    ):
        routes.RouteTrace.load(tmp_path / "v2.routes")


def test_replay_refuses_another_model_another_batch_and_a_router_that_cannot_weigh_a_choice():
    m, x = model(), batch()
    trace = routes.record(m, lambda: m(x))[0]
    with pytest.raises(
        ValueError,
        match=r"^the route trace holds 2 MoE layers; the model has 3: replay a trace of this model$",
    ):
        with routes.replaying(model(layers=3), trace):
            pass
    with pytest.raises(
        ValueError,
        match=r"^the route trace holds \(24, 2\) choices \(tokens, K\) for MoE layer 0, whose forward routes \(12, 2\): replay a trace on the batch it was recorded from$",
    ):
        with routes.replaying(m, trace):
            m(x[:2])
    assert all(layer.route_replay is None for layer in moe_layers(m))  # the block left cleans up
    with pytest.raises(
        ValueError,
        match=r"^routing replay is not available for method='competesmoe' \(MoE layer 0\): its weights depend on more than its scores of the chosen experts; replay works for smoe, ",
    ):
        with routes.replaying(model("competesmoe"), trace):
            pass
    small = torch.nn.Sequential(*[moelab.MoE(D, 4, K) for _ in range(2)])
    with pytest.raises(
        ValueError, match=r"^the route trace names expert [4-7] in MoE layer 0, which has 4 experts"
    ):
        with routes.replaying(small, trace):
            pass
    with routes.replaying(m, trace):
        with pytest.raises(ValueError, match=r"^MoE layer 0 is already replaying a trace"):
            with routes.replaying(m, trace):
                pass


def test_the_selection_bias_counts_the_experts_the_replayed_tokens_went_to():
    m, x = model("sharede-v3", layers=1), batch()
    ctx = moelab.routing_context(m, total_steps=10, seed=0)
    trace = other_trace(model("sharede-v3", layers=1), x)
    router = moe_layers(m)[0].router
    m.train()
    with routes.replaying(m, trace):
        m(x).sum().backward()
    expected = torch.bincount(trace.indices[0].flatten(), minlength=N).to(router.pending_load.dtype)
    assert torch.equal(router.pending_load, expected)
    ctx.advance()


def test_diff_gives_per_layer_any_layer_and_per_position_shares():
    m, x = model(), batch()
    a = routes.record(m, lambda: m(x))[0]
    b_indices = [i.clone() for i in a.indices]
    b_indices[1][5] = b_indices[1][5].flip(0)  # the same set in another order: not a difference
    b_indices[1][7, 0] = (set(range(N)) - set(b_indices[1][7].tolist())).pop()  # token 7 (row 1, pos 1)
    b_indices[0][13, 1] = (set(range(N)) - set(b_indices[0][13].tolist())).pop()  # token 13 (row 2, pos 1)
    b = routes.RouteTrace(b_indices, a.shapes, a.tokens, a.logits_sha256, a.methods)
    result = routes.diff(a, b)
    assert result.per_layer == [1 / 24, 1 / 24] and result.any_layer == 2 / 24 and result.tokens == [24, 24]
    assert (
        result.by_position.shape == (2, 6)
        and result.by_position[0, 1] == 0.25
        and result.by_position.sum() == 0.5
    )
    with pytest.raises(ValueError, match=r"^the traces hold 2 and 1 MoE layers"):
        routes.diff(
            a,
            routes.RouteTrace(a.indices[:1], a.shapes[:1], a.tokens[:1], a.logits_sha256[:1], a.methods[:1]),
        )


def test_routes_diff_prints_the_shares_and_draws_the_heat_map(tmp_path, capsys):
    m, x = model(), batch()
    a = routes.record(m, lambda: m(x))[0].save(tmp_path / "a.routes")
    b = other_trace(m, x).save(tmp_path / "b.routes")
    assert main(["routes", "diff", str(a), str(b), "--png", str(tmp_path / "d.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("MoE layer 0: ") and out[0].endswith(
        "of 24 tokens route to another set of experts"
    )
    assert out[2].startswith("any layer: ") and (tmp_path / "d.png").read_bytes().startswith(b"\x89PNG")
    one = model(layers=1)
    c = routes.record(one, lambda: one(x))[0].save(tmp_path / "c.routes")
    assert main(["routes", "diff", str(a), str(c)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "moelab routes: error: the traces hold 2 and 1 MoE layers: compare traces of one model"
    ]


def test_a_converted_transformers_model_records_and_replays_its_routes(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=D, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=N, num_experts_per_tok=K,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = moelab.from_hf(transformers.MixtralForCausalLM(cfg)).eval()
    ids = torch.randint(0, 32, (2, 5))
    trace, out = routes.record(hf, lambda: hf(ids).logits)
    assert trace.num_layers == 2 and trace.shapes == [(2, 5), (2, 5)]
    with routes.replaying(hf, routes.RouteTrace.load(trace.save(tmp_path / "hf.routes"))):
        assert torch.equal(hf(ids).logits, out)
    padded = torch.ones(2, 5, dtype=torch.long)
    padded[1, 3:] = 0  # the attention mask reaches the layers: the trace keeps the real tokens' places
    trace, out = routes.record(hf, lambda: hf(ids, attention_mask=padded).logits)
    assert [t.tolist() for t in trace.tokens] == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert trace.indices[0].shape == (8, K)
    with routes.replaying(hf, trace):
        assert torch.equal(hf(ids, attention_mask=padded).logits, out)


# ------------------------------------------------------------------ the routers of 2026 under replay
def literal_router_grad(layer, x, indices, weights_of, token_ids=None):
    """The router's weight gradient of ``sum(y²)`` with ``y = Σ_{slots} w · E(x) + shared(x)``, the
    weights ``weights_of(logits)`` at ``indices`` (every expert, ``(T, N)``, for a weight of 0 where
    a token took none), computed with the layer's experts."""
    flat = x.reshape(-1, D)
    layer.zero_grad()
    logits = flat @ layer.router.weight.T
    y = layer.experts(flat, Routing(indices=indices, weights=weights_of(logits)))
    if layer.shared is not None:
        y = y + layer.shared(flat)
    y.square().sum().backward()
    grad = layer.router.weight.grad.clone()
    layer.zero_grad()
    return grad


def replayed_router_grad(m, layer, x, trace, **kwargs):
    m.zero_grad()
    with routes.replaying(m, trace):
        m(x, **kwargs).square().sum().backward()
    grad = layer.router.weight.grad.clone()
    m.zero_grad()
    return grad


def test_quantile_balancing_replays_with_the_gradient_of_the_softmax_over_the_recorded_experts():
    m, x = model("quantile-balancing", layers=1), batch()
    ctx = moelab.routing_context(m, total_steps=10, seed=0)
    layer = moe_layers(m)[0]
    with torch.no_grad():
        layer.router.qb_beta.copy_(torch.linspace(-0.5, 0.5, N))  # a bias the choice sees, the weights not
    trace = other_trace(m, x)
    m.train()
    replayed = replayed_router_grad(m, layer, x, trace)
    idx = trace.indices[0]
    expected = literal_router_grad(layer, x, idx, lambda h: h.gather(1, idx).softmax(dim=-1))
    torch.testing.assert_close(replayed, expected, rtol=1e-6, atol=1e-7)
    assert replayed.abs().sum() > 0
    ctx.advance()


def test_sqrt_softplus_replays_with_the_gradient_of_the_normalised_scores_at_the_recorded_experts():
    m, x = model("deepseek-v4", layers=1, bias_update_rate=0.0), batch()
    layer = moe_layers(m)[0]
    trace = other_trace(m, x)
    replayed = replayed_router_grad(m, layer, x, trace)
    idx = trace.indices[0]

    def weights(h):
        s = torch.nn.functional.softplus(h).sqrt().gather(1, idx)
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)

    torch.testing.assert_close(replayed, literal_router_grad(layer, x, idx, weights), rtol=1e-6, atol=1e-7)
    assert replayed.abs().sum() > 0


def hash_layer(seed=0):
    torch.manual_seed(seed)
    layer = moelab.MoE(
        D, N, K, method="deepseek-v4", hash_layers=1, vocab_size=11, hash_seed=seed, bias_update_rate=0.0
    )
    return layer, torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(2))


def test_a_hash_layer_replays_its_fixed_table_and_refuses_a_trace_of_another_table():
    layer, ids = hash_layer()
    x = batch()
    layer.train()
    trace, y = routes.record(layer, lambda: layer(x, token_ids=ids))
    assert torch.equal(trace.indices[0], layer.router.tid2eid[ids.reshape(-1)])
    (y.square().sum()).backward()
    own = layer.router.weight.grad.clone()
    replayed = replayed_router_grad(layer, layer, x, trace, token_ids=ids)
    assert torch.equal(own, replayed)  # the table's choice, weighed by the live s / Σ s

    idx = trace.indices[0]

    def weights(h):
        s = torch.nn.functional.softplus(h).sqrt().gather(1, idx)
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)

    torch.testing.assert_close(replayed, literal_router_grad(layer, x, idx, weights), rtol=1e-6, atol=1e-7)
    other, _ = hash_layer(seed=1)  # another table
    foreign = routes.record(other, lambda: other(x, token_ids=ids))[0]
    with pytest.raises(
        ValueError,
        match=r"^the route trace sends \d+ of 24 tokens of MoE layer 0, hash-routed, to other experts than its "
        r"token id → experts table: replay a trace of this model on the token ids it was recorded from$",
    ):
        with routes.replaying(layer, foreign):
            layer(x, token_ids=ids)


def et_model(seed=0):
    m = model("expert-threshold", layers=1, seed=seed)
    return m, moelab.routing_context(m, total_steps=10, seed=0)


def test_an_expert_threshold_trace_records_each_tokens_variable_set_with_empty_slots(tmp_path):
    m, _ = et_model()
    x = batch()
    m.eval()
    trace, _ = routes.record(m, lambda: m(x))
    routing = moe_layers(m)[0].last_routing
    assert trace.indices[0].shape == (24, N)
    taken = (trace.indices[0] >= 0).sum(dim=1)
    assert torch.equal(taken, routing.mask.sum(dim=1)) and taken.min() < taken.max()
    assert torch.equal(trace.indices[0], routing.indices.masked_fill(~routing.mask, -1))
    loaded = routes.RouteTrace.load(trace.save(tmp_path / "et.routes"))
    assert torch.equal(loaded.indices[0], trace.indices[0])
    # the same permutation with another set taken: diff compares the sets, not the permutations
    fewer = trace.indices[0].clone()
    row = int(taken.argmax())
    fewer[row, int(taken[row]) - 1] = -1
    b = routes.RouteTrace([fewer], trace.shapes, trace.tokens, trace.logits_sha256, trace.methods)
    assert routes.diff(trace, b).per_layer == [1 / 24]


def test_expert_threshold_replays_the_recorded_sets_with_the_gradient_of_their_live_scores():
    m, ctx = et_model()
    x = batch()
    m.train()
    trace, y = routes.record(m, lambda: m(x))  # its own trace: replay gives every gradient bit for bit
    y.square().sum().backward()
    own = grads(m)
    replayed = replayed_router_grad(m, moe_layers(m)[0], x, trace)
    assert torch.equal(own["0.router.weight"], replayed)

    other, _ = et_model(seed=3)
    trace = routes.record(other.eval(), lambda: other(x))[0]
    layer = moe_layers(m)[0]
    replayed = replayed_router_grad(m, layer, x, trace)
    taken = taken_of(trace.indices[0])
    every = torch.arange(N).expand(24, N)
    expected = literal_router_grad(layer, x, every, lambda h: h.softmax(dim=-1) * taken)
    torch.testing.assert_close(replayed, expected, rtol=1e-6, atol=1e-7)
    assert replayed.abs().sum() > 0
    ctx.advance()


def taken_of(indices):
    """``(T, N)`` bool: the experts a recorded variable choice took (``-1``: an empty slot)."""
    spare = torch.where(indices >= 0, indices, N)  # the empty slots mark a spare column
    return torch.zeros(indices.shape[0], N + 1, dtype=torch.bool).scatter(1, spare, True)[:, :N]


def rounding_model(seed=0):
    return model(layers=1, seed=seed, balance_coef=0.0, z_coef=0.0, token_rounding="up", rounding_tile=4)


def test_a_token_rounded_forward_replays_its_own_trace_bit_for_bit():
    m, x = rounding_model(), batch()
    m.train()
    trace, y = routes.record(m, lambda: m(x))
    assert trace.indices[0].shape == (24, N) and (trace.indices[0] < 0).any()  # the rounded assignment
    y.square().sum().backward()
    expected = grads(m)
    m.zero_grad()
    with routes.replaying(m, trace):
        y2 = m(x)
        y2.square().sum().backward()
    assert torch.equal(y, y2)
    assert all(torch.equal(grads(m)[name], g) for name, g in expected.items())


def test_a_rounded_trace_replays_its_assignment_with_the_gradient_of_the_live_probabilities():
    m, x = rounding_model(), batch()
    other = rounding_model(seed=5)
    other.train()
    trace = routes.record(other, lambda: other(x))[0]
    layer = moe_layers(m)[0]
    m.train()
    replayed = replayed_router_grad(m, layer, x, trace)
    taken = taken_of(trace.indices[0])
    every = torch.arange(N).expand(24, N)
    expected = literal_router_grad(layer, x, every, lambda h: h.softmax(dim=-1) * taken)
    torch.testing.assert_close(replayed, expected, rtol=1e-6, atol=1e-7)
    with routes.replaying(m.eval(), trace):
        with pytest.raises(
            ValueError,
            match=r"^the route trace holds a variable number of experts per token for MoE layer 0, whose "
            r"forward routes a fixed K=2 \(token rounding applies in training only\): replay a trace of a "
            r"forward like this one$",
        ):
            m(x)


def test_a_top_k_trace_is_rounded_after_replay_in_a_token_rounded_training_forward():
    m, x = rounding_model(), batch()
    trace = routes.record(m.eval(), lambda: m(x))[0]  # evaluation: no rounding, the top-K
    assert trace.indices[0].shape == (24, K)
    m.train()
    with routes.replaying(m, trace):
        m(x)
    routing = moe_layers(m)[0].last_routing
    from moelab.experts.rounding import round_tokens

    layer = moe_layers(m)[0]
    logits = x.reshape(-1, D) @ layer.router.weight.T
    own = Routing(
        indices=trace.indices[0],
        weights=logits.gather(1, trace.indices[0]).softmax(-1),
        probs=logits.softmax(-1),
        logits=logits,
    )
    rounded = round_tokens(own, N, 4, "up")
    assert torch.equal(routing.indices, rounded.indices) and torch.equal(routing.mask, rounded.mask)
