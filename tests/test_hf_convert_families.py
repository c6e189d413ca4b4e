"""Every MoE family of the installed transformers: converted exactly (block outputs in float64,
round trip through moelab.to_hf) or refused in one line naming the block, its class and why."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moelab  # noqa: E402
from hf_families import MODELS, VOCAB, D, families, tiny_block, tiny_model  # noqa: E402

FAMILIES = families()

# float32 routers (most of them compute the router in float32 whatever the model dtype) round
# the weights to float32: |Δ| ≲ 1e-6 on outputs of size ~1; everything else is float64
TOL = 1e-6
#: LFM2's router normalises by (Σ w + 1e-6): a 1e-6 relative difference moelab does not copy
TOL_FOR = {"Lfm2MoeSparseMoeBlock": 2e-5}

CONVERTS = {  # block class -> moelab method
    "AXK2MoE": "sharede-v3",
    "AfmoeSparseMoeBlock": "sharede-v3",
    "BailingHybridMoE": "sharede-v3",
    "BeamMoE": "sharede-v3",
    "DeepseekOcr2TextMoe": "sharede-v2",
    "DeepseekV2Moe": "sharede-v2",
    "DeepseekV32MoE": "sharede-v3",
    "DeepseekV3MoE": "sharede-v3",
    "DeepseekV4SparseMoeBlock": "deepseek-v4",
    "Dots1MoE": "sharede-v3",
    "Dots3NoteTextMoE": "sharede-v3",
    "Dots3NoteVisionMoE": "sharede-v3",
    "ExaoneMoeSparseMoEBlock": "sharede-v3",
    "FlexOlmoSparseMoeBlock": "smoe",
    "FlintSparseMoeBlock": "sharede-v3",
    "Glm4MoeLiteMoE": "sharede-v3",
    "Glm4MoeMoE": "sharede-v3",
    "Glm4vMoeTextMoE": "sharede-v3",
    "Glm5NextTextMoE": "sharede-v3",  # DeepSeek-V4's clamped SwiGLU (swiglu_clamp)
    "GlmMoeDsaMoE": "sharede-v3",
    "GraniteMoeHybridMoE": "smoe",
    "GraniteMoeMoE": "smoe",
    "GraniteMoeSWAMoE": "smoe",
    "GraniteMoeSharedMoE": "smoe",
    "HYV4MoE": "sharede-v3",  # DeepSeek-V4's clamped SwiGLU (swiglu_clamp)
    "HunYuanMoEV1Moe": "sharede-v2",
    "JambaSparseMoeBlock": "smoe",
    "KimiLinearMoE": "sharede-v3",
    "LagunaSparseMoeBlock": "sharede-v3",
    "Lfm2MoeSparseMoeBlock": "sharede-v3",
    "MellumSparseMoeBlock": "smoe",
    "MiMoV2FlashMoE": "sharede-v3",
    "MiniMaxM2SparseMoeBlock": "sharede-v3",
    "MiniMaxSparseMoeBlock": "smoe",
    "MixtralSparseMoeBlock": "smoe",
    "OlmoeSparseMoeBlock": "smoe",
    "Qwen2MoeSparseMoeBlock": "sharede-v2",
    "Qwen3MoeSparseMoeBlock": "smoe",
    "Qwen3NextSparseMoeBlock": "sharede-v2",
    "Qwen3OmniMoeTalkerTextSparseMoeBlock": "sharede-v2",
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": "smoe",
    "Qwen3VLMoeTextSparseMoeBlock": "smoe",
    "Qwen3_5MoeSparseMoeBlock": "sharede-v2",
    "Qwen4ExpTextSparseMoeBlock": "sharede-v2",
    "SolarOpenMoE": "sharede-v3",
    "UnlimitedOcrTextMoe": "sharede-v2",
}

REFUSED = {  # block class -> the start of the reason
    "AXK1MoE": "parts moelab does not reproduce:",
    "AriaTextMoELayer": "experts AriaExperts with transposed expert",
    "Cohere2MoeSparseMoeBlock": "shared experts combined by 'average' (moelab",
    "DbrxFFN": "experts DbrxExperts store their weights in",
    "DiffusionGemmaDecoderTextLayer": "experts DiffusionGemmaTextExperts with",
    "DiffusionGemmaEncoderTextLayer": "experts DiffusionGemmaTextExperts with",
    "Ernie4_5_MoeSparseMoeBlock": "router Ernie4_5_MoeTopKRouter has parameters",
    "Ernie4_5_VLMoeSparseMoeBlock": "router Ernie4_5_VLMoeMoeTopKRouter has",
    "Gemma4TextDecoderLayer": "experts Gemma4TextExperts with activation",
    "GptOssMLP": "experts GptOssExperts with expert biases,",
    "HYV3MoE": "router HYV3TopKRouter picks or weighs experts",
    "Inkling2SparseMoeBlock": "router Inkling2TopKRouter picks or weighs",
    "InklingMoE": "shared expert InklingSharedExperts is not a",
    "JetMoeAttention": "it has experts but no router child",
    "Kolibri1SparseMoeBlock": "router Kolibri1TopKRouter picks or weighs",
    "Llama4TextMoe": "experts Llama4TextExperts with gate_up_proj (8,",
    "LongcatFlashMoE": "experts LongcatFlashExperts with gate_up_proj",
    "MiniMaxM3VLSparseMoeBlock": "experts MiniMaxM3VLExperts with a clamped",
    "Mistral4MoE": "router Mistral4TopkRouter picks or weighs",
    "MistralLarge4TextMoE": "router MistralLarge4TextTopkRouter picks or",
    "MuseSparkMoE": "experts MuseSparkExperts with expert parameters",
    "NemotronHMoE": "experts NemotronHExperts store their weights in",
    "NllbMoeSparseMLP": "experts NllbMoeExperts store their weights in",
    "OpenAIPrivacyFilterMLP": "experts OpenAIPrivacyFilterExperts with expert",
    "PhimoeSparseMoeBlock": "router PhimoeTopKRouter picks or weighs experts",
    "Step3p7SparseMoeBlock": "experts Step3p7Experts with a clamped SwiGLU",
    "SwitchTransformersSparseMLP": "experts SwitchTransformersExperts store their",
    "VitPoseBackboneMoeMLP": "it has experts but no router child",
    "ZayaSparseMoeBlock": "router ZayaRouter has parameters moelab's",
}


def _out(block, x, ids=None):
    y = block(x.clone()) if ids is None else block(x.clone(), input_ids=ids)
    return y[0] if isinstance(y, tuple) else y


def _ids(item):
    return item[1].__name__


def test_every_moe_family_of_transformers_is_in_the_table():
    names = {cls.__name__ for _, cls in FAMILIES}
    assert len(names) >= 60  # the enumeration finds the families
    assert names <= set(CONVERTS) | set(REFUSED), sorted(names - set(CONVERTS) - set(REFUSED))


@pytest.mark.parametrize("family", FAMILIES, ids=_ids)
def test_each_family_converts_exactly_and_goes_back_or_is_refused_naming_block_and_why(family):
    fam, cls = family
    block = tiny_block(fam, cls)
    name = cls.__name__
    if name in REFUSED:
        with pytest.raises(ValueError) as err:
            moelab.from_hf(block)
        msg = str(err.value)
        assert "\n" not in msg and f"({name}) cannot be converted" in msg
        assert REFUSED[name] in msg
        return
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids = None  # the token ids, for a block that takes them (DeepSeek-V4's hash layers); its layer too
    if "input_ids" in inspect.signature(block.forward).parameters:
        ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = _out(block, x, ids)
    layer = moelab.from_hf(block)
    assert layer.method == CONVERTS[name]
    with torch.no_grad():
        got = _out(layer, x, ids)
    assert (got - expected).abs().max().item() <= TOL_FOR.get(name, TOL)
    back = moelab.to_hf(layer)
    assert type(back) is cls
    with torch.no_grad():
        assert torch.equal(_out(back, x, ids), expected)  # the same weights back: bit for bit


def _masked_step(model, ids, mask, rows):
    """Logits of ``rows``' real tokens, the aux loss, and every gradient of (task + aux) over them."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask).logits[rows]
    real = mask[rows].bool()
    g = torch.Generator().manual_seed(5)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    aux = moelab.aux_loss(model)
    ((out * weights)[real].sum() + aux).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out[real].detach(), aux.detach(), grads


@pytest.mark.parametrize("name", MODELS)
def test_converted_models_route_and_balance_only_the_real_tokens_of_the_attention_mask(name):
    model = tiny_model(name)
    moelab.from_hf(model)
    method = moelab.layer.moe_layers(model)[0].method
    moelab.set_method(model, method, balance_coef=0.01, z_coef=0.001)  # aux losses to compare
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0  # right padding
    mask[2, 2:] = 0
    want = _masked_step(model, ids, mask, slice(None))
    # the same batch with other ids at the padded positions: nothing changes
    other = ids.masked_fill(mask == 0, 5)
    got = _masked_step(model, other, mask, slice(None))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    # a batch with a row of padding only appended: the real rows' outputs, aux and gradients stay
    full = torch.ones(2, 7, dtype=torch.long)
    base = _masked_step(model, ids[:2], full, slice(None))
    padded = _masked_step(
        model,
        torch.cat([ids[:2], ids[2:]]),
        torch.cat([full, torch.zeros(1, 7, dtype=torch.long)]),
        slice(0, 2),
    )
    torch.testing.assert_close(padded[0], base[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(padded[1], base[1], rtol=0, atol=1e-12)
    for n in base[2]:
        torch.testing.assert_close(padded[2][n], base[2][n], rtol=0, atol=1e-12, msg=n)
