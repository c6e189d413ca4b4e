"""``latent-prototype`` (Latent Prototype Routing, arXiv 2506.21328): the routing, the weights, the
regularisers and the gradients against the authors' router written out, evaluation, the
orthogonality loss's O(T D²) form, 2 ranks = one process, the layer grid."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import moelab
from moelab.losses import orthogonality_loss
from router_grid import IMPLS_WITH_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load

METHOD = "latent-prototype"


def authors_router(x, router, top_k, kl_weight=0.01, align_weight=0.05, div_weight=1.0, outer=0.01):
    """The authors' ``TokenDistributionRouter.forward`` (``VectorSimilarity``, ``Cosine``,
    ``diversity_type='orthogonal'``, ``diversity_lambda=1``) written out with this router's tensors,
    the model's ``router_kl_loss_coef`` (``outer``) on its regularisation, and ``z_decoded``, which
    their MoE blocks add to the experts' input (``hidden_states + z_decoed``)."""
    h = F.silu(F.layer_norm(x, (x.shape[-1],), router.norm.weight, router.norm.bias, router.norm.eps))
    mu, logvar = (h @ router.encoder.weight.T + router.encoder.bias).chunk(2, dim=-1)
    std = torch.exp(0.5 * logvar)
    z = mu + torch.randn_like(std) * std
    keys = router.prototypes
    scores = F.cosine_similarity(mu.unsqueeze(1), keys.unsqueeze(0), dim=-1)
    topk_vals, topk_idx = torch.topk(scores, top_k, dim=-1)

    def orthogonal(v):
        n = F.normalize(v, p=2, dim=-1)
        return F.mse_loss(n @ n.T, torch.eye(v.shape[0], dtype=v.dtype))

    div_loss = orthogonal(mu) + orthogonal(keys)
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=-1).mean()
    routing_weights = F.softmax(topk_vals, dim=-1)
    routing_scores = torch.zeros_like(scores).scatter(1, topk_idx, topk_vals)
    last_routing = F.softmax(routing_scores, dim=-1).detach()
    weighted_keys_target = last_routing.T @ z
    sim_loss = torch.abs(keys - weighted_keys_target.detach()).mean()
    reg = div_weight * div_loss + kl_weight * kl + align_weight * sim_loss
    # the aligner: CosineSimilarity's softmax(similarity) @ expert_keys, through out_proj
    z_decoded = router.out_proj(torch.softmax(scores, dim=-1) @ keys)
    return routing_weights, topk_idx, scores, outer * reg, z_decoded


def test_latent_prototype_routes_weighs_and_regularises_as_the_authors_router():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 5, 2, d_hidden=7, method=METHOD, latent_dim=4).double()
    with torch.no_grad():  # a LayerNorm and a bias that are not the identity and zero
        layer.router.norm.weight.normal_()
        layer.router.norm.bias.normal_()
        layer.router.encoder.bias.normal_()
    twin = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(9, 6, dtype=torch.float64, generator=gen)
        g = torch.randn(9, 6, dtype=torch.float64, generator=gen)
        twin.zero_grad()
        torch.manual_seed(7)
        w, idx, scores, reg, z_decoded = authors_router(x, twin.router, 2)
        h = x + z_decoded
        want = torch.stack(
            [
                sum(w[t, k] * twin.experts.expert_forward(h[t : t + 1], int(idx[t, k]))[0] for k in range(2))
                for t in range(9)
            ]
        )
        ((want * g).sum() + reg).backward()

        layer.zero_grad()
        torch.manual_seed(7)
        y = layer(x)
        ((y * g).sum() + layer.aux_loss).backward()
        r = layer.last_routing
        assert torch.equal(r.indices, idx)
        torch.testing.assert_close(r.weights, w, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(r.logits, scores, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.aux_loss, reg, rtol=1e-10, atol=1e-14)
        got = dict(layer.named_parameters())
        for name, p in twin.named_parameters():
            torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_orthogonality_loss_equals_the_mean_square_distance_of_the_gram_matrix_to_identity():
    gen = torch.Generator().manual_seed(0)
    for rows in (
        torch.randn(50, 4, generator=gen, dtype=torch.float64),
        torch.randn(3, 8, generator=gen).double(),
    ):
        n = F.normalize(rows, dim=-1)
        want = F.mse_loss(n @ n.T, torch.eye(rows.shape[0], dtype=rows.dtype))
        torch.testing.assert_close(orthogonality_loss(rows), want, rtol=1e-12, atol=1e-15)
    assert float(orthogonality_loss(torch.eye(5))) == 0.0


def test_latent_prototype_preset_defaults_and_parameters():
    layer = moelab.MoE(16, 4, 2, method=METHOD)
    r = layer.router
    assert layer.coefs == {"latent_kl": 1e-4, "prototype_diversity": 0.01, "prototype_alignment": 5e-4}
    assert r.latent_dim == 16 and r.prototypes.shape == (4, 16) and r.encoder.weight.shape == (32, 16)
    assert {n for n, _ in r.named_parameters()} == {
        "norm.weight",
        "norm.bias",
        "encoder.weight",
        "encoder.bias",
        "prototypes",
        "out_proj.weight",
        "out_proj.bias",
    }
    assert r.out_proj.weight.shape == (16, 16)
    plain = moelab.MoE(16, 4, 2, method=METHOD, aligner=False)
    assert plain.router.out_proj is None and plain.router(torch.randn(3, 16)).inputs is None
    assert r.weights_sum_to_one and not r.variable_k
    with pytest.raises(ValueError, match=r"^latent_dim=0 is not allowed") as e:
        moelab.MoE(16, 4, 2, method=METHOD, latent_dim=0)
    assert "\n" not in str(e.value)


def test_latent_prototype_evaluation_routes_by_the_mean_latent_without_sampling():
    """Evaluation: the same rule, deterministic (no sample is drawn), so the layer's output does not
    depend on the random state; training draws the sample for the alignment target only."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD).eval()
    x = torch.randn(12, 8)
    state = torch.random.get_rng_state()
    first = layer(x)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(123)
    assert torch.equal(layer(x), first)
    layer.train()
    torch.manual_seed(5)
    train = layer(x)
    torch.testing.assert_close(train, first)  # the routing and weights do not read the sample


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_latent_prototype_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel(METHOD, impl)


def test_latent_prototype_compiles_as_one_graph_and_equals_eager():
    check_compile(METHOD, steps=2)


def test_latent_prototype_survives_save_and_load(tmp_path):
    check_save_load(METHOD, tmp_path)


def test_latent_prototype_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal(METHOD)


# ------------------------------------------------------------------ one process = 2 ranks
def _two_ranks(rank: int, world: int, state: dict, xs: list, ep: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from moelab.train.parallelize import parallelize

    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, latent_dim=3).double()
    layer.load_state_dict(state)
    model = parallelize(layer, dp="ddp", ep=2) if ep else DistributedDataParallel(layer)
    for x in xs:
        torch.manual_seed(11)  # every rank draws the sample of its piece as the one process does
        model(x[rank]).square().sum().backward()
    from torch.distributed.tensor import DTensor

    grads = {n: p.grad for n, p in layer.named_parameters()}
    grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
    return {
        "sharded": isinstance(layer.experts.w_in, DTensor),
        "grads": {n: g.clone() for n, g in grads.items()},
    }


@pytest.mark.parametrize("ep", [False, True], ids=["ddp", "expert-parallel"])
def test_latent_prototype_two_ranks_equal_one_process_with_their_batches_as_micro_batches(tmp_path, ep):
    """The regularisers are each piece's (micro-batch or rank); the gradients DDP's mean of the
    ranks' (expert parallelism: the experts' all-to-all, the router replicated and averaged)."""
    from test_parallelize import spawn

    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, latent_dim=3).double()
    state = copy.deepcopy(layer.state_dict())
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 12, 8, dtype=torch.float64, generator=gen) for _ in range(2)]
    moelab.set_aux_scale(layer, 0.5)  # the mean of the two pieces' aux losses, as the ranks' average
    for x in xs:
        for part in x:
            torch.manual_seed(11)
            (layer(part).square().sum() / 2).backward()
    for r in spawn(_two_ranks, 2, tmp_path, state, xs, ep):
        assert r["sharded"] == ep  # expert parallelism: each rank holds half of the experts
        for name, p in layer.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_latent_prototype_at_k1_weighs_by_the_softmax_over_all_experts_and_renormalize_true_is_the_authors():
    """At K = 1 the authors' softmax over the one chosen similarity is the constant 1 (no task
    gradient to the router): moelab's default weighs the chosen expert by the softmax over all N
    (Switch); ``renormalize=True`` gives the authors' rule."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 1, method=METHOD).eval()
    x = torch.randn(6, 8)
    r = layer.router(x)
    assert torch.equal(r.indices, r.logits.argmax(-1, keepdim=True))
    torch.testing.assert_close(r.weights, r.logits.softmax(-1).gather(1, r.indices))
    layer = moelab.MoE(8, 4, 1, method=METHOD, renormalize=True).eval()
    assert torch.equal(layer.router(x).weights, torch.ones(6, 1))
