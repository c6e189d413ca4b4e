"""LoRA and RepLoRA: the update's formula, RepLoRA's shared reparameterisation, exact merging, the
adapter saved alone, moelab LMs and a transformers model, and every refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moelab.adapters import (
    DEFAULT_TARGETS,
    TARGET_GROUPS,
    AdaptedLinear,
    AdaptedWeight,
    RepLoRAFactors,
    adapter_parameters,
    add_adapter,
    load_adapter,
    merge_adapter,
    save_adapter,
)
from moelab.experts import ExpertBank
from moelab.models.lm import LMConfig, TransformerLM

TINY = dict(block_size=16, n_layer=2, d_model=32, n_head=2, num_experts=4, top_k=2, dropout=0.0)


def lm(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(LMConfig(vocab_size=13, **TINY)).double().eval()


def randomize_adapter(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


IDX = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("kind", ["lora", "replora"])
def test_a_new_adapter_leaves_the_model_unchanged_and_only_it_trains(kind):
    model = lm()
    with torch.no_grad():
        before = model(IDX)
    names = add_adapter(model, kind, rank=4)
    assert names == [f"blocks.{i}.attn.qkv.{p}" for i in range(2) for p in "qv"]
    with torch.no_grad():
        assert torch.equal(model(IDX), before)  # B = 0 / φ₂ = 0 at start
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".factors." in n for n in trainable)
    model(IDX).sum().backward()
    assert all(p.grad is not None for p in adapter_parameters(model).values())
    assert model.blocks[0].attn.qkv.base.weight.grad is None


def test_lora_update_is_scale_b_a_x_on_the_q_and_v_thirds_only():
    model = lm()
    add_adapter(model, "lora", rank=3, alpha=6.0)
    randomize_adapter(model)
    layer = model.blocks[0].attn.qkv
    assert isinstance(layer, AdaptedLinear) and layer.scale == 2.0
    x = torch.randn(4, 32, dtype=torch.float64)
    (Aq, Bq), (Av, Bv) = (f.factors() for f in layer.factors)
    with torch.no_grad():
        expected = layer.base(x)
        expected[:, :32] += 2.0 * x @ Aq.T @ Bq.T
        expected[:, 64:] += 2.0 * x @ Av.T @ Bv.T
        torch.testing.assert_close(layer(x), expected)
        assert not torch.equal(Aq, Av)  # LoRA estimates Q's and V's factors separately


def test_replora_shares_one_reparameterisation_between_q_and_v():
    model = lm()
    add_adapter(model, "replora", rank=4, hidden=16)
    randomize_adapter(model)
    layer = model.blocks[0].attn.qkv
    fq, fv = layer.factors
    assert fq is fv and isinstance(fq, RepLoRAFactors)  # A_Q = A_V = φ₁(A), B_Q = B_V = φ₂(B)
    assert model.blocks[1].attn.qkv.factors[0] is not fq  # one per attention layer
    with torch.no_grad():
        A, B = fq.factors()
        # the diagonal shared matrices through the two-layer MLPs, written out
        a, b = fq.a, fq.b
        w1, c1, w2, c2 = fq.phi1[0].weight, fq.phi1[0].bias, fq.phi1[2].weight, fq.phi1[2].bias
        torch.testing.assert_close(A, torch.nn.functional.gelu(torch.diag(a) @ w1.T + c1) @ w2.T + c2)
        v1, d1, v2, d2 = fq.phi2[0].weight, fq.phi2[0].bias, fq.phi2[2].weight, fq.phi2[2].bias
        torch.testing.assert_close(B, (torch.nn.functional.gelu(torch.diag(b) @ v1.T + d1) @ v2.T + d2).T)
        delta = layer.delta_weight()
        torch.testing.assert_close(delta[:32], delta[64:])
        assert delta[32:64].abs().max() == 0 and delta[:32].abs().max() > 0
    n = sum(p.numel() for p in adapter_parameters(model).values())
    per_layer = 4 + 4 + (4 * 16 + 16 + 16 * 32 + 32) * 2
    assert n == 2 * per_layer


@pytest.mark.parametrize("kind", ["lora", "replora"])
def test_merge_gives_plain_linear_layers_with_the_same_function(kind):
    model = lm()
    add_adapter(model, kind, rank=4, dropout=0.2)
    randomize_adapter(model)
    with torch.no_grad():
        adapted = model(IDX)  # eval: no dropout
    assert merge_adapter(model) is model
    assert type(model.blocks[0].attn.qkv) is nn.Linear
    assert not any(isinstance(m, AdaptedLinear) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(IDX), adapted, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"holds no adapter; nothing to merge"):
        merge_adapter(model)


@pytest.mark.parametrize("kind", ["lora", "replora"])
def test_the_adapter_alone_saves_to_safetensors_and_loads_on_a_fresh_model(kind, tmp_path):
    from safetensors import safe_open

    model = lm()
    add_adapter(model, kind, rank=4, alpha=8.0)
    randomize_adapter(model)
    with torch.no_grad():
        expected = model(IDX)
    path = save_adapter(model, tmp_path / "a.safetensors")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert keys == set(adapter_parameters(model))  # the adapter only, a shared module once
    assert not any("base" in k or "tok_emb" in k for k in keys)
    fresh = lm()
    assert load_adapter(fresh, path) == add_adapter(lm(), kind, rank=4)
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDX), expected, rtol=0, atol=0)
    other = TransformerLM(LMConfig(vocab_size=13, **{**TINY, "d_model": 16})).double()
    with pytest.raises(ValueError, match=r"a.safetensors.*shape"):
        load_adapter(other, path)


def test_adapter_refusals_are_one_line(tmp_path):
    untouched = lm()
    with pytest.raises(
        ValueError, match=r"kind='dora' is not allowed; expected one of \['lora', 'replora'\]"
    ):
        add_adapter(lm(), "dora")
    with pytest.raises(ValueError, match=r"rank=0 is not allowed"):
        add_adapter(lm(), rank=0)
    with pytest.raises(ValueError, match=r"dropout=1 is not allowed; expected a number in \[0, 1\)"):
        add_adapter(lm(), dropout=1)
    with pytest.raises(ValueError, match=r"hidden=7 is not allowed with kind='lora'"):
        add_adapter(lm(), "lora", hidden=7)
    with pytest.raises(
        ValueError,
        match=r"targets=\['\*nothing'\] match no nn.Linear, expert projection or router of TransformerLM",
    ):
        add_adapter(lm(), targets=["*nothing"])
    with pytest.raises(ValueError, match=r"match both 'blocks.0.attn.qkv' and parts of it"):
        add_adapter(lm(), targets=["blocks.0.attn.qkv", "blocks.0.attn.qkv.q"])
    with pytest.raises(ValueError, match=r"target 'blocks.0.attn.proj' \(32x32\) cannot share RepLoRA's"):
        add_adapter(untouched, "replora", targets=["blocks.0.attn.qkv", "blocks.0.attn.proj"])
    assert all(p.requires_grad for p in untouched.parameters())  # a refusal changes nothing
    assert type(untouched.blocks[0].attn.qkv) is nn.Linear
    model = lm()
    add_adapter(model)
    with pytest.raises(ValueError, match=r"model already holds an adapter"):
        add_adapter(model)
    with pytest.raises(ValueError, match=r"holds no adapter \(add_adapter first\)"):
        save_adapter(lm(), tmp_path / "x.safetensors")
    with pytest.raises(FileNotFoundError, match=r"adapter file .* does not exist"):
        load_adapter(lm(), tmp_path / "missing.safetensors")
    (tmp_path / "bad").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"is not a safetensors file"):
        load_adapter(lm(), tmp_path / "bad")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match=r"holds no moelab adapter"):
        load_adapter(lm(), tmp_path / "plain.safetensors")


@pytest.mark.slow  # ~6 s of compilation
def test_an_adapted_model_compiles_without_graph_breaks():
    model = lm().float()  # float32: the experts' float64 path is not fullgraph-ready
    add_adapter(model, "replora", rank=2)
    randomize_adapter(model)
    with torch.no_grad():
        eager = model(IDX)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(IDX)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~25 s of compilation
def test_an_expert_adapter_compiles_without_graph_breaks():
    model = lm().float()
    add_adapter(model, "replora", rank=2, targets=[*TARGET_GROUPS["experts"], *TARGET_GROUPS["router"]])
    randomize_adapter(model)
    with torch.no_grad():
        eager = model(IDX)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(IDX)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_replora_on_a_transformers_model_trains_q_and_v_and_merges_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    names = add_adapter(model, "replora", rank=2)
    assert names == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qv"]
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.factors[0] is attn.v_proj.factors[0]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    frozen = model.lm_head.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    assert torch.equal(model.lm_head.weight, frozen)
    with torch.no_grad():
        tuned = model(ids).logits
    save_adapter(model, tmp_path / "llama.safetensors")
    merge_adapter(model)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tuned, rtol=1e-12, atol=1e-12)
    torch.manual_seed(0)
    fresh = transformers.LlamaForCausalLM(cfg).double().eval()
    load_adapter(fresh, tmp_path / "llama.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, tuned, rtol=0, atol=0)


def test_an_adapter_onto_a_base_of_another_structure_is_refused_naming_what_differs(tmp_path):
    model = lm()
    add_adapter(model, "lora", rank=4)
    path = save_adapter(model, tmp_path / "a.safetensors")
    deeper = TransformerLM(LMConfig(vocab_size=13, **{**TINY, "n_layer": 3})).double()
    with pytest.raises(ValueError) as err:
        load_adapter(deeper, path)
    msg = str(err.value)
    assert "\n" not in msg
    assert "a.safetensors' was trained on a base of another structure: this model has " in msg
    assert (
        "parameters its base had not (blocks.2.ln1.weight, blocks.2.ln1.bias, blocks.2.attn.qkv.weight and "
        in msg
    )
    assert msg.endswith("; expected the model it was trained on")
    assert adapter_parameters(deeper) == {} and all(p.requires_grad for p in deeper.parameters())  # untouched
    wider = TransformerLM(LMConfig(vocab_size=20, **TINY)).double()
    with pytest.raises(
        ValueError, match=r"shapes differ: tok_emb.weight \(20, 32\) \(the base's \(13, 32\)\)"
    ):
        load_adapter(wider, path)
    assert load_adapter(lm(), path) == [f"blocks.{i}.attn.qkv.{p}" for i in range(2) for p in "qv"]


@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_a_loaded_adapted_model_merged_saves_and_loads_back(kind, tmp_path):
    import moelab
    from moelab.models.classifier import LMClassifier

    model = lm()
    trunk = model
    if kind == "classifier":
        model = LMClassifier(model, 3).double().eval()
    add_adapter(trunk, "replora", rank=4)
    randomize_adapter(trunk)
    args = (IDX,) if kind == "lm" else (IDX, torch.ones_like(IDX, dtype=torch.bool))
    with torch.no_grad():
        expected = model(*args)
    moelab.save(model, tmp_path / "adapted")
    loaded = moelab.load(tmp_path / "adapted").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), expected, rtol=0, atol=0)  # the adapter came back
    merge_adapter(loaded)
    with torch.no_grad():
        merged = loaded(*args)
    torch.testing.assert_close(merged, expected, rtol=1e-12, atol=1e-12)  # W + (α/r) B A, rounded once
    moelab.save(loaded, tmp_path / "merged")
    again = moelab.load(tmp_path / "merged").eval()
    assert not any(isinstance(m, AdaptedLinear) for m in again.modules())
    with torch.no_grad():
        torch.testing.assert_close(again(*args), merged, rtol=0, atol=0)


# ---------------------------------------------------------------- expert banks and routers

EXPERT_TARGETS = [*TARGET_GROUPS["experts"], *TARGET_GROUPS["router"]]


def swiglu_layer(d: int = 8, h: int = 4, n: int = 4, seed: int = 0):
    """A SwiGLU MoE layer in float64 (``h`` = d/2 by default: 2·I = H)."""
    import moelab

    torch.manual_seed(seed)
    return moelab.MoE(d, n, 2, d_hidden=h, activation="swiglu").double().eval()


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("kind", ["lora", "replora"])
def test_an_expert_adapter_adds_scale_b_a_to_every_experts_gate_up_down_and_the_router(kind, share):
    layer = swiglu_layer()
    w_in, w_out, router = (
        t.detach().clone() for t in (layer.experts.w_in, layer.experts.w_out, layer.router.weight)
    )
    x = torch.randn(7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = layer(x)
    names = add_adapter(layer, kind, rank=2, alpha=3.0, targets=EXPERT_TARGETS, share_experts=share)
    assert names == ["router", "experts.gate", "experts.up", "experts.down"]
    with torch.no_grad():
        assert torch.equal(layer(x), before)  # B = 0 / φ₂ = 0 at start
    randomize_adapter(layer)
    params = adapter_parameters(layer)
    lead = () if share else (4,)
    if kind == "lora":
        assert params["experts.parametrizations.w_in.0.factors.0.A"].shape == (*lead, 2, 8)
        assert params["experts.parametrizations.w_out.0.factors.0.B"].shape == (*lead, 8, 2)
    else:
        assert params["experts.parametrizations.w_in.0.factors.1.a"].shape == (*lead, 2)
    bank = layer.experts.parametrizations
    gate_a, gate_b = bank.w_in[0].factors[0].factors()
    up_a, up_b = bank.w_in[0].factors[1].factors()
    down_a, down_b = bank.w_out[0].factors[0].factors()
    r_a, r_b = layer.router.parametrizations.weight[0].factors[0].factors()
    s = 3.0 / 2
    with torch.no_grad():  # the literal update, expert by expert: W_e + s B_e A_e on its own rows
        want_in = w_in + s * torch.cat([(gate_b @ gate_a).expand(4, 4, 8), (up_b @ up_a).expand(4, 4, 8)], 1)
        want_out = w_out + s * (down_b @ down_a).expand(4, 8, 4)
        torch.testing.assert_close(layer.experts.w_in, want_in, rtol=0, atol=1e-15)
        torch.testing.assert_close(layer.experts.w_out, want_out, rtol=0, atol=1e-15)
        torch.testing.assert_close(layer.router.weight, router + s * r_b @ r_a, rtol=0, atol=1e-15)
        if not share:  # every expert its own update
            assert not torch.equal(want_in[0] - w_in[0], want_in[1] - w_in[1])
        assert not torch.equal(layer(x), before)
    layer(x).sum().backward()
    assert all(p.grad is not None for p in params.values())
    assert layer.experts.parametrizations.w_in.original.grad is None


def test_per_expert_replora_shares_phi_across_the_experts_of_a_projection():
    layer = swiglu_layer()
    add_adapter(layer, "replora", rank=2, targets=["experts.gate", "experts.down"])
    gate, down = (
        layer.experts.parametrizations.w_in[0].factors[0],
        layer.experts.parametrizations.w_out[0].factors[0],
    )
    assert (
        isinstance(gate, RepLoRAFactors) and gate.a.shape == (4, 2) and gate.phi1[0].weight.shape == (32, 2)
    )
    assert gate is not down
    randomize_adapter(layer)
    A, B = gate.factors()
    for e in range(
        4
    ):  # expert e: φ₁(diag(a_e)), φ₂(diag(b_e)) with the one φ₁, φ₂ (the formula of RepLoRAFactors)
        torch.testing.assert_close(A[e], gate.phi1(torch.diag(gate.a[e])), rtol=0, atol=1e-15)
        torch.testing.assert_close(B[e], gate.phi2(torch.diag(gate.b[e])).T, rtol=0, atol=1e-15)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("kind", ["lora", "replora"])
def test_merging_an_expert_adapter_is_exact_in_float64(kind, share):
    model = lm()  # relu experts with d_hidden = d_model (I = H)
    add_adapter(model, kind, rank=3, targets=[*EXPERT_TARGETS, *DEFAULT_TARGETS], share_experts=share)
    randomize_adapter(model)
    with torch.no_grad():
        adapted = model(IDX)
        w_in = model.blocks[0].ffn.experts.w_in.clone()
    original = model.blocks[0].ffn.experts.parametrizations.w_in.original
    merge_adapter(model)
    assert type(model.blocks[0].ffn.experts) is ExpertBank and model.blocks[0].ffn.experts.w_in is original
    assert not any(".parametrizations." in n or ".factors." in n for n, _ in model.named_parameters())
    assert torch.equal(model.blocks[0].ffn.experts.w_in, w_in)  # the forward's W + ΔW, bit for bit
    with torch.no_grad():
        assert (model(IDX) - adapted).abs().max().item() <= 1e-12


@pytest.mark.parametrize("kind", ["lora", "replora"])
def test_an_expert_adapter_alone_saves_to_safetensors_and_loads_on_a_fresh_model(kind, tmp_path):
    import json

    from safetensors import safe_open

    model = lm()
    names = add_adapter(model, kind, rank=2, targets=EXPERT_TARGETS, share_experts=kind == "replora")
    randomize_adapter(model)
    with torch.no_grad():
        tuned = model(IDX)
    path = save_adapter(model, tmp_path / "experts.safetensors")
    with safe_open(str(path), framework="pt") as f:  # tensors + a JSON header: nothing to unpickle
        header = json.loads(f.metadata()["moelab_adapter"])
        assert set(f.keys()) == set(adapter_parameters(model))
    assert header["targets"] == names and header.get("share_experts", False) == (kind == "replora")
    fresh = lm()
    assert load_adapter(fresh, path) == names
    with torch.no_grad():
        assert torch.equal(fresh(IDX), tuned)
    more_experts = TransformerLM(LMConfig(vocab_size=13, **{**TINY, "num_experts": 8})).double()
    with pytest.raises(ValueError) as err:
        load_adapter(more_experts, path)
    msg = str(err.value)
    assert "\n" not in msg and "was trained on a base of another structure: shapes differ: " in msg
    assert "blocks.0.ffn.router.weight (8, 32) (the base's (4, 32))" in msg
    assert adapter_parameters(more_experts) == {}


def test_expert_adapter_refusals_are_one_line():
    import moelab

    with pytest.raises(
        ValueError, match=r"^dropout=0.1 is not allowed with targets \['blocks.0.ffn.experts.down'"
    ):
        add_adapter(lm(), "lora", dropout=0.1, targets=["*.experts.down"])
    with pytest.raises(ValueError, match=r"^share_experts='yes' is not allowed; expected True or False$"):
        add_adapter(lm(), "lora", targets=["*.experts.down"], share_experts="yes")
    torch.manual_seed(0)
    aoe = moelab.MoE(8, 4, 2, d_hidden=4, method="aoe", activation="swiglu")
    with pytest.raises(
        ValueError,
        match=r"^target 'experts.up' is not allowed: its bank's gate projections are Autonomy-of-Experts'",
    ):
        add_adapter(aoe, "lora", targets=["experts.up"])
    assert not any(isinstance(m, AdaptedWeight) for m in aoe.modules())  # a refusal changes nothing
    with pytest.raises(ValueError, match=r"match no nn.Linear, expert projection or router of MoE"):
        add_adapter(swiglu_layer(), "lora", targets=["experts.w_in"])
    outer = nn.Sequential(swiglu_layer())  # an adapter on a part: the whole refuses a second one
    add_adapter(outer[0], "lora", targets=["experts.down"])
    with pytest.raises(
        ValueError, match=r"^model already holds adapted layers; merge_adapter\(model\) first$"
    ):
        add_adapter(outer, "lora", targets=["0.router"])
    other = swiglu_layer()
    torch.nn.utils.parametrize.register_parametrization(other.experts, "w_out", nn.Identity())
    with pytest.raises(
        ValueError, match=r"^target 'experts.down' is not allowed: its w_out is already parametrized$"
    ):
        add_adapter(other, "lora", targets=["experts.down"])


def test_an_expert_update_is_composed_once_per_forward(monkeypatch):
    calls = []
    compose = AdaptedWeight.forward
    monkeypatch.setattr(AdaptedWeight, "forward", lambda self, w: calls.append(w.shape) or compose(self, w))
    layer = swiglu_layer()
    add_adapter(layer, "lora", rank=2, targets=TARGET_GROUPS["experts"])
    x = torch.randn(5, 8, dtype=torch.float64)
    calls.clear()
    layer.train()(x).sum().backward()  # impl="auto": the kernel is chosen on the weights the kernel runs
    assert sorted(calls) == [(4, 8, 4), (4, 8, 8)]  # w_out and w_in, once each
