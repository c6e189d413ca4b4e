"""moelab adapters of from_hf models written for transformers: PEFT's fused-expert layout (loaded by
PEFT into the original model, the same logits), the layout read from the module (2·I = H, I = H),
vLLM's per-expert [out, in] layout, and the refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import moelab
from moelab.adapters import TARGET_GROUPS, adapter_parameters, add_adapter
from moelab.hf.lora import export_peft, export_vllm

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
ALL = [*TARGET_GROUPS["experts"], *TARGET_GROUPS["router"], *TARGET_GROUPS["attention"]]


def hf_model(family: str, d: int = 16, i: int = 8):
    """A tiny transformers MoE LM in float64 (eager experts: the grouped kernels take no float64)."""
    common = dict(
        vocab_size=40,
        hidden_size=d,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
    )
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=i, num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            moe_intermediate_size=i, intermediate_size=i, num_experts=4, decoder_sparse_step=1, **common
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.OlmoeConfig(intermediate_size=i, num_experts=4, eos_token_id=None, **common)
        cls = transformers.OlmoeForCausalLM
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg).double().eval()


def adapted(hf, kind: str = "lora", targets=ALL, share: bool = False):
    model = moelab.from_hf(copy.deepcopy(hf))
    add_adapter(model, kind, rank=2, alpha=3.0, targets=targets, share_experts=share)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def peft_logits(hf, folder):
    peft = pytest.importorskip("peft")
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(folder)).eval()(IDS).logits


# 2·I = H: gate_up_proj (E, 2I, H) is square; I = H: down_proj (E, H, I) is square
@pytest.mark.parametrize("d,i", [(16, 8), (16, 16)], ids=["2I=H", "I=H"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_an_exported_expert_adapter_loads_into_peft_with_the_logits_of_the_adapted_moelab_model(
    family, d, i, tmp_path
):
    hf = hf_model(family, d, i)
    model = adapted(hf)
    with torch.no_grad():
        want = model(IDS).logits
        base = hf(IDS).logits
    export_peft(model, tmp_path / "peft")
    got = peft_logits(hf, tmp_path / "peft")
    assert (want - base).abs().max().item() > 0.1  # the adapter changes the model
    # the routers' softmax is float32 in transformers, float64 here: float32 rounding
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,share", [("lora", True), ("replora", False), ("replora", True)])
def test_replora_and_shared_expert_updates_export_to_peft_exactly_as_well(kind, share, tmp_path):
    hf = hf_model("mixtral")
    model = adapted(hf, kind, [*TARGET_GROUPS["experts"], *TARGET_GROUPS["router"], "*q_proj"], share)
    with torch.no_grad():
        want = model(IDS).logits
    export_peft(model, tmp_path / "peft")
    torch.testing.assert_close(peft_logits(hf, tmp_path / "peft"), want, rtol=0, atol=1e-6)


def test_the_peft_layout_follows_the_module_gate_and_up_as_one_rank_2r_update(tmp_path):
    from safetensors.torch import load_file

    hf = hf_model("mixtral", 16, 8)
    model = adapted(hf, targets=["*.experts.gate", "*.experts.up", "*.experts.down"])
    export_peft(model, tmp_path / "peft")
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 6  # gate and up side by side: R = 2r, α/R = 3/2
    assert cfg["target_parameters"] == [
        f"model.layers.{n}.mlp.experts.{p}" for n in range(2) for p in ("gate_up_proj", "down_proj")
    ]
    t = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    pre = "base_model.model.model.layers.0.mlp.experts."
    # gate_up_proj is registered first: PEFT wraps it innermost (base_layer); A (E·R, d), B (2I, R·E)
    assert t[pre + "base_layer.lora_A.weight"].shape == (4 * 4, 16)
    assert t[pre + "base_layer.lora_B.weight"].shape == (16, 4 * 4)
    assert t[pre + "lora_A.weight"].shape == (4 * 4, 8)  # down_proj maps I to H
    bank = model.model.layers[0].mlp.experts.parametrizations
    gate_a, gate_b = bank.w_in[0].factors[0].factors()
    A = t[pre + "base_layer.lora_A.weight"].reshape(4, 4, 16)
    B = t[pre + "base_layer.lora_B.weight"].reshape(16, 4, 4).permute(2, 0, 1)
    assert torch.equal(A[2, :2], gate_a[2]) and torch.equal(B[2, :8, :2], gate_b[2])
    assert not B[2, :8, 2:].any() and not B[2, 8:, :2].any()  # block-diagonal: gate and up apart
    down = bank.w_out[0].factors[0].factors()[0]
    assert torch.equal(t[pre + "lora_A.weight"].reshape(4, 4, 8)[1, :2], down[1])
    assert not t[pre + "lora_A.weight"].reshape(4, 4, 8)[:, 2:].any()  # padded to R with zeros


def test_the_vllm_layout_is_each_experts_update_in_out_in_order(tmp_path):
    from safetensors.torch import load_file

    hf = hf_model("qwen3_moe", 16, 8)
    model = adapted(hf, targets=[*TARGET_GROUPS["experts"], "*q_proj"], share=False)
    layer = model.model.layers[1].mlp
    bank = layer.experts
    w_in, w_out = bank.parametrizations.w_in.original.clone(), bank.parametrizations.w_out.original.clone()
    with torch.no_grad():
        adapted_in, adapted_out = bank.w_in.clone(), bank.w_out.clone()
    export_vllm(model, tmp_path / "vllm")
    cfg = json.loads((tmp_path / "vllm" / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and cfg["lora_alpha"] == 3 and cfg["target_parameters"] is None
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj"]
    t = load_file(str(tmp_path / "vllm" / "adapter_model.safetensors"))
    s = 3.0 / 2
    for e in range(4):  # ΔW_e = s B_e A_e with A (r, in), B (out, r): nn.Linear's [out, in]
        pre = f"base_model.model.model.layers.1.mlp.experts.{e}."
        gate = w_in[e, :8] + s * t[pre + "gate_proj.lora_B.weight"] @ t[pre + "gate_proj.lora_A.weight"]
        up = w_in[e, 8:] + s * t[pre + "up_proj.lora_B.weight"] @ t[pre + "up_proj.lora_A.weight"]
        down = w_out[e] + s * t[pre + "down_proj.lora_B.weight"] @ t[pre + "down_proj.lora_A.weight"]
        assert t[pre + "down_proj.lora_A.weight"].shape == (2, 8)  # in = I
        torch.testing.assert_close(torch.cat([gate, up]), adapted_in[e], rtol=0, atol=1e-15)
        torch.testing.assert_close(down, adapted_out[e], rtol=0, atol=1e-15)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in t


def test_export_refusals_are_one_line(tmp_path):
    from moelab.models.lm import LMConfig, TransformerLM

    hf = hf_model("mixtral")
    with pytest.raises(
        ValueError,
        match=r"^model of type MixtralForCausalLM holds no adapter \(moelab.adapters.add_adapter first\)$",
    ):
        export_peft(moelab.from_hf(copy.deepcopy(hf)), tmp_path / "a")
    with pytest.raises(
        ValueError,
        match=r"^model.layers.0.mlp.gate.weight cannot be exported: vLLM's expert LoRA has no place for a router's update$",
    ):
        export_vllm(adapted(hf, targets=TARGET_GROUPS["router"]), tmp_path / "b")
    torch.manual_seed(0)
    lm = TransformerLM(
        LMConfig(vocab_size=13, block_size=8, n_layer=1, d_model=16, n_head=2, num_experts=4, top_k=2)
    )
    add_adapter(lm, "lora", rank=2, targets=TARGET_GROUPS["experts"])
    with pytest.raises(
        ValueError,
        match=r"^blocks.0.ffn.experts.w_in cannot be exported: it is not part of a layer converted by moelab.from_hf",
    ):
        export_peft(lm, tmp_path / "c")
    switched = adapted(hf, targets=TARGET_GROUPS["experts"])
    with pytest.warns(UserWarning):
        moelab.set_method(switched, "xmoe")
    with pytest.raises(
        ValueError, match=r"^model.layers.0.mlp \(method='xmoe'\) cannot go back to transformers"
    ):
        export_peft(switched, tmp_path / "d")
    qkv = TransformerLM(
        LMConfig(vocab_size=13, block_size=8, n_layer=1, d_model=16, n_head=2, num_experts=4, top_k=2)
    )
    add_adapter(qkv, "lora", rank=2)
    with pytest.raises(
        ValueError,
        match=r"^blocks.0.attn.qkv cannot be exported: its update covers rows \[\(0, 16\), \(32, 48\)\] only \(a fused moelab qkv projection\)$",
    ):
        export_peft(qkv, tmp_path / "e")
    from torch import nn
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    class ListedExpert(nn.Module):  # a block of per-expert modules, as from_hf converts them too
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
            self.down_proj, self.act_fn = nn.Linear(8, 16, bias=False), nn.SiLU()

    block = MixtralSparseMoeBlock(
        transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    )
    with torch.no_grad():
        block.gate.weight.normal_()
    block.experts = nn.ModuleList([ListedExpert() for _ in range(4)])
    listed = moelab.from_hf(block)
    add_adapter(listed, "lora", rank=2, targets=["experts.down"])
    with pytest.raises(
        ValueError,
        match=r"^experts.w_out cannot be exported: its transformers block lists its experts as modules \(per-expert",
    ):
        export_peft(listed, tmp_path / "f")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    qwen2 = transformers.Qwen2MoeConfig(
        hidden_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=12, num_experts=4
    )
    shared = moelab.from_hf(Qwen2MoeSparseMoeBlock(qwen2))
    add_adapter(shared, "lora", rank=2, targets=["shared.mlp.fc_in"])
    with pytest.raises(
        ValueError,
        match=r"^shared.mlp.fc_in cannot be exported: it is an nn.Linear inside a moelab layer \(its shared experts\)",
    ):
        export_peft(shared, tmp_path / "g")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^path='.*file' is not allowed: it is a file; expected a folder"):
        export_peft(adapted(hf), tmp_path / "file")
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()


def test_to_hf_refuses_a_layer_that_carries_an_adapter_update_until_it_is_merged():
    from moelab.adapters import merge_adapter

    hf = hf_model("olmoe")
    model = adapted(hf, targets=TARGET_GROUPS["experts"])
    with torch.no_grad():
        want = model(IDS).logits
    with pytest.raises(
        ValueError,
        match=r"^model.layers.0.mlp \(method='smoe'\) cannot go back to transformers: its weights carry an adapter's "
        r"update \(moelab.adapters\); merge_adapter\(model\) first",
    ):
        moelab.to_hf(model)
    merge_adapter(model)
    moelab.to_hf(model)
    with torch.no_grad():  # transformers' router softmax is float32
        torch.testing.assert_close(model(IDS).logits, want, rtol=0, atol=1e-6)
        assert (model(IDS).logits - hf(IDS).logits).abs().max().item() > 0.1  # the update went back too
