"""DeepSeek-V4 through moelab.from_hf / moelab.to_hf: the clamped SwiGLU of its experts and shared
expert (``swiglu_clamp``, pinned to a literal formula), its top-K sqrt-softplus and hash-routed
layers, the model's ``input_ids`` reaching the hash layers, exact both ways; and what is refused."""

from __future__ import annotations

import math

import pytest
import torch

import moelab
from moelab.functional import activation
from moelab.routers.deepseek import hash_table

V4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

D, H, N, K, VOCAB = 16, 8, 8, 2, 32


def literal_swiglu_clamp(h: torch.Tensor) -> torch.Tensor:
    """Element by element: ``g' = min(g, 10)``, ``u' = min(max(u, -10), 10)``, ``g' / (1 + e^-g') · u'``."""
    rows = []
    for row in h.tolist():
        gate, up = row[: len(row) // 2], row[len(row) // 2 :]
        out = []
        for g, u in zip(gate, up):
            g, u = min(g, 10.0), min(max(u, -10.0), 10.0)
            out.append(g / (1.0 + math.exp(-g)) * u)
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float64)


def _config(**kw) -> DeepseekV4Config:
    base = dict(hidden_size=D, num_local_experts=N, num_experts_per_tok=K, vocab_size=VOCAB,
                moe_intermediate_size=H, intermediate_size=H, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, num_hidden_layers=3,
                mlp_layer_types=["hash_moe", "hash_moe", "moe"])  # fmt: skip
    return DeepseekV4Config(**{**base, **kw})


def _fill(module: torch.nn.Module, std: float, seed: int = 0) -> None:
    """Random weights of size ``std``, a hash table, a non-trivial selection bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
        for name, b in module.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(hash_table(b.shape[0], N, K, seed + 1))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.2, 0.2, b.numel(), dtype=b.dtype))


def _block(layer_idx: int, **kw) -> torch.nn.Module:
    block = V4.DeepseekV4SparseMoeBlock(_config(**kw), layer_idx).double()
    _fill(block, 1.5)  # pre-activations of tens: the clamp bites
    return block.eval()


def test_swiglu_clamp_is_deepseek_v4s_literal_clamped_swiglu_and_transformers_gate():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 2 * H, generator=g, dtype=torch.float64) * 15  # many beyond ±10
    assert (h[:, :H] > 10).any() and (h[:, H:] < -10).any() and (h[:, H:] > 10).any()
    got = activation("swiglu_clamp")(h)
    torch.testing.assert_close(got, literal_swiglu_clamp(h), rtol=1e-15, atol=1e-13)
    experts = V4.DeepseekV4Experts(_config()).double()
    assert torch.equal(got, experts._apply_gate(h))
    # the plain swiglu is unchanged: where nothing is clamped both agree, beyond it they differ
    small = h / 100
    torch.testing.assert_close(
        activation("swiglu_clamp")(small), activation("swiglu")(small), rtol=1e-15, atol=0
    )
    assert not torch.equal(activation("swiglu")(h), got)


@pytest.mark.parametrize("impl", ["loop", "grouped", "stream"])
def test_swiglu_clamp_experts_give_the_literal_output_and_gradients_on_every_kernel(impl):
    torch.manual_seed(0)
    layer = moelab.MoE(
        D, N, K, d_hidden=H, method="smoe", activation="swiglu_clamp", impl=impl, record_routing=True
    )
    layer.float()
    with torch.no_grad():
        layer.experts.w_in.mul_(40)  # pre-activations past ±10
    x = torch.randn(2, 12, D, requires_grad=True)
    if impl == "stream":
        layer.eval()
        with torch.no_grad():
            y = layer(x)
    else:
        y = layer(x)
    r = layer.last_routing
    flat = x.detach().reshape(-1, D).double()
    w_in, w_out = layer.experts.w_in.detach().double(), layer.experts.w_out.detach().double()
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(K):
            e = int(r.indices[t, j])
            h = (w_in[e] @ flat[t]).unsqueeze(0)
            want[t] += float(r.weights[t, j]) * (w_out[e] @ literal_swiglu_clamp(h)[0])
    torch.testing.assert_close(y.detach().reshape(-1, D).double(), want, rtol=1e-4, atol=1e-4)
    if impl != "stream":  # the gradients as autograd through the formula
        gy = torch.randn_like(y)
        (y * gy).sum().backward()
        got = (x.grad.clone(), layer.experts.w_in.grad.clone(), layer.experts.w_out.grad.clone())
        ref = moelab.MoE(D, N, K, d_hidden=H, method="smoe", activation="swiglu_clamp", impl="loop")
        ref.load_state_dict(layer.state_dict())
        x2 = x.detach().clone().requires_grad_()
        (ref(x2) * gy).sum().backward()
        for a, b in zip(got, (x2.grad, ref.experts.w_in.grad, ref.experts.w_out.grad)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_swiglu_clamp_on_triton_is_refused_in_one_line_never_computed_unclamped():
    layer = moelab.MoE(D, N, K, d_hidden=H, method="smoe", activation="swiglu_clamp", impl="triton")
    with pytest.raises(ValueError, match=r"^impl='triton' is not available for ") as e:
        layer(torch.randn(4, D))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layer_idx", [0, 2], ids=["hash", "topk"])
def test_a_deepseek_v4_block_converts_exactly_with_its_clamp_gradients_included_and_goes_back_bit_for_bit(
    layer_idx,
):
    block = _block(layer_idx)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = block(x, input_ids=ids)
        h = block.shared_experts.gate_proj(x)
        assert h.max() > 10  # the shared expert's clamp bites
    layer = moelab.from_hf(block)
    assert layer.method == "deepseek-v4" and layer.experts.activation == "swiglu_clamp"
    assert layer.router.hashed == (layer_idx == 0) and layer.router.scale == 1.5
    with torch.no_grad():
        got = layer(x, input_ids=ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-10)
    # the gradients too: of the input, the router, the experts and the shared expert
    gy = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (block(x1, input_ids=ids) * gy).sum().backward()
    (layer(x2, input_ids=ids) * gy).sum().backward()
    pairs = [
        (x1.grad, x2.grad),
        (block.gate.weight.grad, layer.router.weight.grad),
        (block.experts.gate_up_proj.grad, layer.experts.w_in.grad),
        (block.experts.down_proj.grad, layer.experts.w_out.grad),
        (block.shared_experts.down_proj.weight.grad, layer.shared.fc_out.weight.grad),
        (
            torch.cat([block.shared_experts.gate_proj.weight.grad, block.shared_experts.up_proj.weight.grad]),
            layer.shared.fc_in.weight.grad,
        ),
    ]
    for a, b in pairs:
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-10)
    back = moelab.to_hf(layer)
    assert type(back) is V4.DeepseekV4SparseMoeBlock
    with torch.no_grad():
        assert torch.equal(back(x, input_ids=ids), want)
    if layer_idx == 0:
        assert torch.equal(back.gate.tid2eid, block.gate.tid2eid)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    model = V4.DeepseekV4ForCausalLM(_config()).to(dtype)
    _fill(model, 0.3)
    return model.eval()


def test_a_tiny_deepseek_v4_model_converted_gives_transformers_logits_and_to_hf_restores_them_exactly():
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    moelab.from_hf(model)
    layers = moelab.layer.moe_layers(model)
    assert [lay.router.hashed for lay in layers] == [True, True, False]  # mlp_layer_types
    assert [lay.router.hash_layers for lay in layers][:2] == [2, 2]
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # float32 rounding
    moelab.to_hf(model)
    assert not moelab.layer.moe_layers(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_a_converted_deepseek_v4_model_without_input_ids_is_refused_in_one_line_by_its_hash_layer():
    model = _model()
    moelab.from_hf(model)
    embeds = model.model.embed_tokens(torch.randint(0, VOCAB, (1, 4)))
    with pytest.raises(ValueError, match=r"^token_ids=None is not allowed for MoE layer 0, hash-routed") as e:
        model(inputs_embeds=embeds)
    assert "\n" not in str(e.value)


def test_deepseek_v4_hash_blocks_after_a_top_k_block_are_refused_by_from_hf_in_one_line():
    torch.manual_seed(0)
    model = V4.DeepseekV4ForCausalLM(_config(mlp_layer_types=["moe", "hash_moe", "moe"]))
    with pytest.raises(
        ValueError, match=r"^hash-routed blocks at \['model\.layers\.1\.mlp'\] are not allowed"
    ) as e:
        moelab.from_hf(model)
    assert "\n" not in str(e.value)


def test_a_deepseek_v4_block_with_another_swiglu_limit_is_refused_naming_the_clamp():
    block = _block(2, swiglu_limit=5.0)
    with pytest.raises(
        ValueError, match=r"DeepseekV4SparseMoeBlock\) cannot be converted by moelab\.from_hf: "
    ) as e:
        moelab.from_hf(block)
    msg = str(e.value)
    assert "\n" not in msg and "clamped SwiGLU (limit=5.0) other than DeepSeek-V4's" in msg


def test_to_hf_refuses_a_converted_hash_layer_renumbered_out_of_its_hash_layers():
    layer = moelab.from_hf(_block(0))
    layer.layer_index = 3  # past hash_layers=1: it would route by top-K, the block by its table
    with pytest.raises(
        ValueError, match=r"^the layer \(method='deepseek-v4'\) cannot go back to transformers: "
    ) as e:
        moelab.to_hf(layer)
    assert "\n" not in str(e.value) and "by top-K now" in str(e.value)


def test_a_converted_deepseek_v4_model_survives_moelab_save_and_load_with_its_tables(tmp_path):
    model = _model()
    moelab.from_hf(model)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    moelab.save(model, tmp_path / "m")
    back = moelab.load(tmp_path / "m").eval()
    assert [lay.router.hashed for lay in moelab.layer.moe_layers(back)] == [True, True, False]
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, want)


def test_a_converted_deepseek_v4_hash_block_compiles_as_one_graph_with_its_input_ids_and_equals_eager():
    torch._dynamo.reset()
    layer = moelab.from_hf(_block(0).float())  # float32: the traced kernel is grouped_mm's
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # the input_ids hook traced too
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(x, input_ids=ids), layer(x, input_ids=ids), rtol=1e-12, atol=1e-10
        )
