"""The patch transformer of models/vit.py: standard and Active-Attention (Ho (2025)) against a
written-out computation, refusals, save/load."""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.models.vit import PatchTransformer, ViTConfig

SMALL = {"image_size": 4, "patch_size": 2, "d_model": 8, "n_layer": 1, "n_head": 2}
SIGMAS = {"gelu": torch.nn.functional.gelu, "tanh": torch.tanh, "relu": torch.relu,
          "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu}  # fmt: skip


def _literal_attention(attn, x: torch.Tensor, sigma) -> torch.Tensor:
    """softmax(QKᵀ/√d_h) σ(V) per head, no mask, written out (no fused kernel)."""
    B, L, d = x.shape
    H = attn.n_head
    q, k, v = attn.qkv(x).split(d, dim=2)
    v = sigma(v) if sigma is not None else v
    q, k, v = (t.view(B, L, H, d // H).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / (d // H) ** 0.5
    return attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, d))


@pytest.mark.parametrize("act", [None, *SIGMAS])
def test_patch_attention_is_softmax_of_qk_times_sigma_of_v_without_mask(act):
    torch.manual_seed(0)
    extra = {} if act is None else {"attention": "active", "attention_activation": act}
    attn = PatchTransformer(ViTConfig(**SMALL, **extra)).blocks[0].attn.double().eval()
    with torch.no_grad():
        attn.qkv.bias.normal_()
        x = torch.randn(3, 4, 8, dtype=torch.float64)
        got = attn(x)
        torch.testing.assert_close(got, _literal_attention(attn, x, SIGMAS.get(act)))
        if act is not None:
            assert (got - _literal_attention(attn, x, None)).abs().max() > 1e-3
        # bidirectional: the first patch sees the last one
        x2 = x.clone()
        x2[:, -1] += 1.0
        assert (attn(x2)[:, 0] - got[:, 0]).abs().max() > 1e-6


def test_patches_are_row_major_squares():
    model = PatchTransformer(ViTConfig(**SMALL))
    x = torch.arange(16.0).view(1, 1, 4, 4)
    p = model.patches(x)
    assert p.shape == (1, 4, 4)
    assert p[0, 0].tolist() == [0, 1, 4, 5] and p[0, 3].tolist() == [10, 11, 14, 15]


def test_patch_transformer_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"attention='linear' is not allowed; expected one of"):
        ViTConfig(attention="linear")
    with pytest.raises(ValueError, match=r"attention_activation='softplus' is not allowed; expected one of"):
        ViTConfig(attention="active", attention_activation="softplus")
    with pytest.raises(
        ValueError, match=r"attention_activation='tanh' is not allowed with attention='standard'"
    ):
        ViTConfig(attention_activation="tanh")
    with pytest.raises(ValueError, match=r"patch_size=3 is not allowed with image_size=8; it must divide"):
        ViTConfig(patch_size=3)
    with pytest.raises(ValueError, match=r"n_head=3 is not allowed with d_model=64; it must divide d_model"):
        ViTConfig(n_head=3)
    with pytest.raises(
        ValueError, match=r"x of shape \(2, 1, 8, 8\) is not allowed; expected \(B, 1, 4, 4\)"
    ):
        PatchTransformer(ViTConfig(**SMALL))(torch.zeros(2, 1, 8, 8))


def test_active_patch_transformer_saves_loads_and_compiles(tmp_path):
    torch.manual_seed(0)
    model = PatchTransformer(ViTConfig(**SMALL, attention="active", attention_activation="silu")).eval()
    assert model.cfg.attention_activation == "silu"
    x = torch.randn(5, 1, 4, 4)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert eager.shape == (5, 10)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    moelab.save(model, tmp_path / "m")
    back = moelab.load(tmp_path / "m")
    assert isinstance(back, PatchTransformer) and back.cfg.attention_activation == "silu"
    with torch.no_grad():
        assert torch.equal(back.eval()(x), eager)
