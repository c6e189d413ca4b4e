"""``deepseek-v4``: ``sqrt(softplus(h))`` scores with the aux-loss-free bias and the hash-routed
first layers, against transformers' own DeepSeek-V4 routers and a literal computation; the token
ids the hash layers need (the layer's argument, the LM's input ids) and their refusal; the grid."""

from __future__ import annotations

import copy

import pytest
import torch

import moelab
from moelab.models.lm import LMConfig, TransformerLM
from moelab.routers.deepseek import hash_table
from router_grid import IMPLS_WITH_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load

METHOD = "deepseek-v4"


def literal_sqrtsoftplus(x, weight, bias, k, table=None, ids=None):
    """Per token: ``s_e = sqrt(log(1 + exp(<w_e, x>)))``; the chosen: the K largest ``s_e + b_e``
    (or the table's row of the token id); weights ``s / (Σ_chosen s + 1e-20)``."""
    indices, weights = [], []
    for t, xt in enumerate(x):
        s = [torch.sqrt(torch.log1p(torch.exp(xt @ we))) for we in weight]
        if table is None:
            chosen = sorted(range(len(s)), key=lambda e: -(float(s[e]) + float(bias[e])))[:k]
        else:
            chosen = table[int(ids[t])].tolist()
        total = sum(s[e] for e in chosen)
        indices.append(chosen)
        weights.append(torch.stack([s[e] / (total + 1e-20) for e in chosen]))
    return torch.tensor(indices), torch.stack(weights)


def _hf(kind: str, layer: moelab.MoE):
    pytest.importorskip("transformers.models.deepseek_v4")  # transformers >= the one with DeepSeek-V4
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    r = layer.router
    cfg = DeepseekV4Config(hidden_size=r.d_model, num_local_experts=r.num_experts,
                           num_experts_per_tok=r.top_k, vocab_size=r.vocab_size or 8,
                           num_hidden_layers=2, routed_scaling_factor=r.scale)  # fmt: skip
    ref = (m.DeepseekV4HashRouter if kind == "hash" else m.DeepseekV4TopKRouter)(cfg).double()
    with torch.no_grad():
        ref.weight.copy_(r.weight)
        if kind == "hash":
            ref.tid2eid.copy_(r.tid2eid)
        else:
            ref.e_score_correction_bias.copy_(r.selection_bias)
    return ref


def test_deepseek_v4_routes_weights_and_gradient_as_transformers_and_the_literal_formula():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 8, 3, method=METHOD, scale=1.5).double()
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.randn(8) * 0.3)
    ref = _hf("topk", layer)
    x = torch.randn(10, 6, dtype=torch.float64)
    g = torch.randn(10, 3, dtype=torch.float64)
    r = layer.router(x)
    (r.weights * g).sum().backward()
    _, w_ref, i_ref = ref(x)
    # transformers takes an unsorted top-K: the same experts, put in this router's order
    perm = torch.tensor(
        [[row.tolist().index(e) for e in mine] for row, mine in zip(i_ref, r.indices.tolist())]
    )
    i_ref, w_ref = i_ref.gather(1, perm), w_ref.gather(1, perm)
    assert torch.equal(r.indices, i_ref)
    torch.testing.assert_close(r.weights, w_ref, rtol=1e-12, atol=0)
    (w_ref * g).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, ref.weight.grad, rtol=1e-12, atol=0)
    idx, w = literal_sqrtsoftplus(x, layer.router.weight.detach(), layer.router.selection_bias, 3)
    assert torch.equal(r.indices, idx)
    torch.testing.assert_close(r.weights, 1.5 * w, rtol=1e-12, atol=0)
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(10, dtype=torch.float64))


def test_deepseek_v4_hash_layer_routes_by_the_table_as_transformers_and_learns_the_weights_only():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 8, 2, method=METHOD, hash_layers=1, vocab_size=11).double()
    ref = _hf("hash", layer)
    x = torch.randn(9, 6, dtype=torch.float64)
    ids = torch.randint(0, 11, (9,))
    g = torch.randn(9, 2, dtype=torch.float64)
    r = layer.router(x, token_ids=ids)
    (r.weights * g).sum().backward()
    _, w_ref, i_ref = ref(x, ids)
    assert torch.equal(r.indices, i_ref) and torch.equal(r.indices, layer.router.tid2eid[ids])
    torch.testing.assert_close(r.weights, w_ref, rtol=1e-12, atol=0)
    (w_ref * g).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, ref.weight.grad, rtol=1e-12, atol=0)
    idx, w = literal_sqrtsoftplus(x, layer.router.weight.detach(), None, 2, layer.router.tid2eid, ids)
    assert torch.equal(r.indices, idx)
    torch.testing.assert_close(r.weights, w, rtol=1e-12, atol=0)


def test_deepseek_v4_hash_table_gives_each_token_distinct_experts_from_its_seed():
    table = hash_table(50, 6, 3, seed=4)
    assert table.shape == (50, 3) and table.dtype == torch.int64
    assert (table.sort(-1).values.diff(dim=-1) != 0).all() and table.min() >= 0 and table.max() < 6
    assert torch.equal(table, hash_table(50, 6, 3, seed=4)) and not torch.equal(
        table, hash_table(50, 6, 3, seed=5)
    )
    a = moelab.MoE(8, 6, 3, method=METHOD, hash_layers=1, vocab_size=50, hash_seed=4)
    assert torch.equal(a.router.tid2eid, table)


def test_deepseek_v4_only_the_first_hash_layers_of_a_model_route_by_token_id_and_the_lm_passes_its_ids():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=30, block_size=8, n_layer=3, d_model=16, n_head=2, method=METHOD,
                   num_experts=4, method_options={"hash_layers": 2})  # fmt: skip
    model = TransformerLM(cfg)
    ctx = moelab.routing_context(model, total_steps=4)
    idx = torch.randint(0, 30, (2, 8))
    model(idx).sum().backward()
    layers = model.moe_layers
    assert [layer.router.hashed for layer in layers] == [True, True, False]
    for layer in layers[:2]:  # by the table, whatever the hidden states
        assert torch.equal(layer.last_routing.indices, layer.router.tid2eid[idx.reshape(-1)])
    ctx.advance()  # the hash layers have no load of their own: their bias stays put
    assert not layers[0].router.selection_bias.any() and layers[2].router.selection_bias.any()


def test_deepseek_v4_a_language_model_hashes_only_its_first_hash_layers_before_any_context():
    """The LM numbers its MoE layers when it is built, so a model used without moelab.attach (inference
    of a fresh or hand-loaded model) does not take every layer for layer 0, a hash layer."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=30, block_size=8, n_layer=3, d_model=16, n_head=2, method=METHOD,
                   num_experts=4, method_options={"hash_layers": 1})  # fmt: skip
    model = TransformerLM(cfg)
    assert [layer.layer_index for layer in model.moe_layers] == [0, 1, 2]
    assert [layer.router.hashed for layer in model.moe_layers] == [True, False, False]


def test_deepseek_v4_bias_moves_by_the_sign_rule_once_per_step():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 1, method=METHOD, bias_update_rate=0.01)
    ctx = moelab.routing_context(layer, total_steps=4)
    load = torch.zeros(4)
    for _ in range(2):
        layer(torch.randn(12, 6)).sum().backward()
        load += torch.bincount(layer.last_routing.indices.flatten(), minlength=4).float()
    assert not layer.router.selection_bias.any()
    ctx.advance()
    torch.testing.assert_close(layer.router.selection_bias, 0.01 * torch.sign(load.mean() - load))


def test_deepseek_v4_evaluation_routes_as_training_with_the_bias_it_reached():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 2, method=METHOD)
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.tensor([0.5, -0.5, 0.0, 0.1]))
    x = torch.randn(10, 6)
    train = layer.router(x)
    layer.eval()
    evaluated = layer.router(x)
    assert torch.equal(train.indices, evaluated.indices)
    torch.testing.assert_close(train.weights, evaluated.weights)


def test_deepseek_v4_hash_layers_refuse_in_one_line_without_token_ids_or_vocab_size():
    layer = moelab.MoE(6, 4, 2, method=METHOD, hash_layers=1, vocab_size=10)
    with pytest.raises(
        ValueError, match=r"^token_ids=None is not allowed for MoE layer 0, hash-routed \(hash_layers=1"
    ) as e:
        layer(torch.randn(3, 6))
    assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError, match=r"^hash_layers=2 is not allowed without vocab_size; expected vocab_size="
    ):
        moelab.MoE(6, 4, 2, method=METHOD, hash_layers=2)
    with pytest.raises(
        ValueError, match=r"^token_ids of shape \(3, 2\) and dtype torch.int64 is not allowed; expected"
    ):
        layer(torch.randn(2, 3, 6), token_ids=torch.zeros(3, 2, dtype=torch.long))
    smoe = moelab.MoE(6, 4, 2)  # a router that does not route by id ignores them
    x = torch.randn(2, 3, 6)
    assert torch.equal(smoe(x, token_ids=torch.zeros(2, 3, dtype=torch.long)), smoe(x))


def test_deepseek_v4_hash_layer_with_a_token_mask_routes_the_real_tokens_by_their_ids():
    layer = moelab.MoE(6, 4, 2, method=METHOD, hash_layers=1, vocab_size=10, record_routing=True)
    ids = torch.randint(0, 10, (2, 5))
    mask = torch.rand(2, 5) > 0.4
    layer(torch.randn(2, 5, 6), token_mask=mask, token_ids=ids)
    assert torch.equal(layer.last_routing.indices, layer.router.tid2eid[ids[mask]])


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_deepseek_v4_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel(METHOD, impl, num_shared=0)  # the literal sum is of the routed experts


def test_deepseek_v4_compiles_as_one_graph_and_equals_eager():
    check_compile(METHOD, steps=3)


def test_deepseek_v4_hash_layer_compiles_as_one_graph_and_equals_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = moelab.MoE(8, 4, 2, method=METHOD, hash_layers=1, vocab_size=16)
    owner = copy.deepcopy(eager)
    compiled = torch.compile(owner, backend="aot_eager", fullgraph=True)
    x, ids = torch.randn(2, 6, 8), torch.randint(0, 16, (2, 6))
    try:
        for module in (eager, compiled):
            module(x, token_ids=ids).square().sum().backward()
        torch.testing.assert_close(compiled(x, token_ids=ids), eager(x, token_ids=ids))
        torch.testing.assert_close(owner.router.weight.grad, eager.router.weight.grad)
    finally:
        torch._dynamo.reset()


def test_deepseek_v4_survives_save_and_load_with_its_bias(tmp_path):
    back = check_save_load(METHOD, tmp_path)
    assert back.router.selection_bias.abs().sum() > 0


def test_deepseek_v4_hash_table_survives_save_and_load(tmp_path):
    layer = moelab.MoE(6, 4, 2, method=METHOD, hash_layers=1, vocab_size=10, hash_seed=3)
    with torch.no_grad():
        layer.router.tid2eid[0] = torch.tensor([3, 1])  # a table from a checkpoint, not the seed's
    moelab.save(layer, tmp_path / "m")
    back = moelab.load(tmp_path / "m")
    assert torch.equal(back.router.tid2eid, layer.router.tid2eid)


def test_a_mixtral_block_switched_to_deepseek_v4_runs_and_to_hf_refuses_in_one_line():
    """Mixtral has no sqrt-softplus router; a transformers DeepSeek-V4 block converts and goes back
    exactly (tests/test_hf_convert_deepseek_v4.py)."""
    check_hf_refusal(METHOD)
