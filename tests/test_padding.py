"""moelab.padding: a padding mask scoped over a forward reaches the MoE layers that take no argument."""

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import moelab
from moelab.padding import current_mask, masked_tokens, scope_padding


def _layer(**options):
    torch.manual_seed(0)
    return moelab.MoE(8, 4, 2, 16, method="smoe", activation="swiglu", **options).double().train()


def test_a_scoped_mask_routes_the_real_tokens_as_the_layers_token_mask_does():
    layer = _layer(z_coef=0.01, capacity_factor=1.0)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.4
    want = layer(x, token_mask=mask)
    want_aux = layer.aux_loss.detach().clone()
    with masked_tokens(mask.long()):
        got = layer(x)
    assert torch.equal(got, want) and torch.equal(layer.aux_loss.detach(), want_aux)
    assert current_mask(15) is None  # closed


def test_a_scope_applies_to_inputs_of_its_token_count_only_and_an_all_real_mask_masks_nothing():
    layer = _layer()
    x = torch.randn(4, 8, dtype=torch.float64)
    with masked_tokens(torch.tensor([True, False, True])):  # 3 tokens: not this input's
        assert torch.equal(layer(x), layer(x, token_mask=None))
    with masked_tokens(torch.ones(4, dtype=torch.bool)):
        assert current_mask(4) is None


def test_the_scope_of_a_hooked_module_closes_when_its_forward_raises():
    class Boom(nn.Module):
        def forward(self, x, attention_mask):
            assert current_mask(attention_mask.numel()) is not None
            raise RuntimeError("boom")

    module = Boom()
    scope_padding(module, lambda m, args, kwargs: kwargs["attention_mask"])
    with pytest.raises(RuntimeError, match="boom"):
        module(torch.zeros(2), attention_mask=torch.tensor([1, 0]))
    assert current_mask(2) is None


def test_a_compiled_layer_reads_the_scope_without_a_graph_break():
    layer = _layer().float()  # float32: impl="auto" picks a kernel that traces
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    x = torch.randn(2, 6, 8)
    # other padding, as many real tokens (the kernels do not trace a varying token count fullgraph)
    for seed in range(3):
        mask = torch.zeros(12, dtype=torch.bool)
        mask[torch.randperm(12, generator=torch.Generator().manual_seed(seed))[:7]] = True
        mask = mask.view(2, 6)
        with masked_tokens(mask):
            got = compiled(x)
        torch.testing.assert_close(got, layer(x, token_mask=mask), rtol=0, atol=0)
    got = compiled(x)  # no scope: another graph, not a stale mask
    torch.testing.assert_close(got, layer(x), rtol=0, atol=0)
    assert counter.frame_count == 2


def test_a_bad_padding_mask_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"padding mask 3 is not allowed; expected a tensor"):
        with masked_tokens(3):
            pass


def test_the_diagnostics_see_the_real_tokens_of_a_masked_forward():
    from moelab.metrics import competition_overlap, router_entropy
    from moelab.models.lm import LMConfig, TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(
        LMConfig(vocab_size=20, block_size=8, n_layer=1, d_model=16, n_head=2, num_experts=4)
    )
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 3:] = False
    alone = [ids[:1], ids[1:, :3]]  # the real tokens, a forward each
    overlap = competition_overlap(model, [(ids, mask)])
    want = competition_overlap(model, alone)
    assert overlap == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(router_entropy(model, [(ids, mask)]), router_entropy(model, alone))
