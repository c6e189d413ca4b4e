"""``emo`` (EMO's document-pool routing, arXiv 2605.06663; allenai/EMO, OLMo-core): the pool per
document, the routing, weights and router gradient against a literal per-document computation, the
pool sizes drawn in training and fixed at inference, the document ids (any integers, per sequence)
and their refusals, 2 ranks = one process under DDP and expert parallelism, the grid."""

from __future__ import annotations

import copy

import pytest
import torch

import moelab
from moelab.functional import document_index
from router_grid import (
    IMPLS_WITH_SLOW_TRITON,
    check_checkpointed_compile,
    check_compile,
    check_hf_refusal,
    check_kernel,
    check_save_load,
)

METHOD = "emo"


def literal_routing(x, weight, docs, pools, k):
    """Per document (a (row, id) pair; the d-th pair in sorted order takes ``pools[d]``): the sum of
    ``softmax(W x)`` over its tokens, its experts by decreasing sum (ties: the lower index); the first
    ``pools[d]`` are its pool.  Per token: the K experts of largest logit inside the pool, weights the
    softmax over the pool's logits."""
    logits = x @ weight.T
    probs = logits.detach().softmax(-1)
    pairs = sorted(set(docs))
    chosen, weights = [], []
    for t, pair in enumerate(docs):
        d = pairs.index(pair)
        total = sum(probs[s] for s, other in enumerate(docs) if other == pair)
        order = sorted(range(len(total)), key=lambda e: (-float(total[e]), e))
        pool = order[: int(pools[d])]
        q = logits[t, pool].softmax(-1)
        mine = sorted(pool, key=lambda e: -float(logits[t, e].detach()))[:k]
        chosen.append(mine)
        weights.append(torch.stack([q[pool.index(e)] for e in mine]))
    return chosen, weights


@pytest.mark.parametrize("train", [True, False])
def test_emo_routes_each_document_inside_its_pool_as_the_literal_rule(train):
    torch.manual_seed(0)
    layer = moelab.MoE(6, 8, 2, d_hidden=5, method=METHOD, min_pool=2, max_pool=6).double().train(train)
    router = layer.router
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 6, dtype=torch.float64, generator=gen)
    ids = torch.tensor([[5, 5, 5, 9, 9, 9, 9], [5, 5, 2, 2, 2, 2, 2]])  # 4 documents; 5 in both rows
    g = torch.randn(14, 8, dtype=torch.float64, generator=gen)
    docs = [(t // 7, int(ids.reshape(-1)[t])) for t in range(14)]
    torch.manual_seed(3)
    pools = torch.randint(2, 7, (14,)) if train else torch.full((14,), 2)  # eval: max(K, N // 4) = 2
    w = router.weight.detach().clone().requires_grad_()
    chosen, weights = literal_routing(x.reshape(14, 6), w, docs, pools, 2)
    sum(weights[t][j] * g[t, chosen[t][j]] for t in range(14) for j in range(2)).backward()

    dense = document_index(ids.reshape(-1), torch.arange(14) // 7)
    assert dense.tolist() == [
        0,
        0,
        0,
        1,
        1,
        1,
        1,
        3,
        3,
        2,
        2,
        2,
        2,
        2,
    ]  # by (row, id): (0,5) (0,9) (1,2) (1,5)
    torch.manual_seed(3)
    r = router(x.reshape(14, 6), layer.experts, None, doc_ids=dense)
    assert r.indices.tolist() == chosen
    torch.testing.assert_close(r.weights, torch.stack(weights), rtol=1e-12, atol=0)
    (r.weights * g.gather(1, r.indices)).sum().backward()
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-10, atol=1e-14)


def test_emo_draws_each_documents_pool_size_uniformly_from_min_to_max_pool_in_training():
    torch.manual_seed(0)
    layer = moelab.MoE(4, 16, 2, method=METHOD, min_pool=3, max_pool=9)
    sizes = torch.cat([layer.router.pool_sizes(1000, torch.device("cpu")) for _ in range(10)])
    counts = torch.bincount(sizes, minlength=10)
    assert counts[:3].sum() == 0 and counts[10:].sum() == 0
    assert (counts[3:10] - 10000 / 7).abs().max() < 150  # uniform on {3..9}
    layer.eval()
    assert layer.router.pool_sizes(5, torch.device("cpu")).tolist() == [4] * 5  # max(K, N // 4)


def test_emo_in_evaluation_routes_every_document_inside_a_pool_of_eval_pool_experts():
    """Inference as the paper: a fixed pool per document (the released EMO: 32 of 128 experts), each
    token's K inside it; the routing is deterministic."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 16, 2, method=METHOD).eval()
    assert layer.router.eval_pool == 4
    x = torch.randn(3, 40, 8)
    ids = (torch.arange(40) // 10).expand(3, 40)  # 4 documents a sequence
    with moelab.recording_routing(layer):
        y = layer(x, doc_ids=ids)
        first = layer.last_routing.indices.clone()
        assert torch.equal(layer(x, doc_ids=ids), y) and torch.equal(layer.last_routing.indices, first)
    per_doc = first.view(12, 10, 2)
    probs = (x.reshape(-1, 8) @ layer.router.weight.detach().T).softmax(-1).view(12, 10, 16)
    for d in range(12):
        pool = set(probs[d].sum(0).topk(4).indices.tolist())
        assert set(per_doc[d].unique().tolist()) <= pool
    eight = moelab.MoE(8, 16, 2, method=METHOD, eval_pool=8).eval()
    assert eight.router.eval_pool == 8


def test_emo_documents_are_per_sequence_and_any_integers():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 8, 2, method=METHOD).eval()
    x = torch.randn(2, 6, 8)
    with moelab.recording_routing(layer):
        a = layer(x, doc_ids=torch.tensor([[4, 4, 4, -1, -1, -1], [4, 4, 4, 4, 4, 4]]))
        b = layer(x, doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.int32))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the same routing token by token when each sequence is routed alone
    alone = torch.cat(
        [layer(x[i : i + 1], doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1], [0] * 6])[i : i + 1]) for i in (0, 1)]
    )
    torch.testing.assert_close(alone, a, rtol=0, atol=0)


def test_emo_refuses_a_batch_without_document_ids_and_bad_ids_and_pools_in_one_line():
    layer = moelab.MoE(8, 8, 2, method=METHOD)
    with pytest.raises(
        ValueError, match=r"^doc_ids=None is not allowed with EMO's document pools; expected"
    ) as e:
        layer(torch.randn(2, 5, 8))
    assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError, match=r"^doc_ids of shape \(2, 4\) and dtype torch.int64 is not allowed; expected"
    ):
        layer(torch.randn(2, 5, 8), doc_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"^doc_ids of shape \(2, 5\) and dtype torch.float32 is not allowed"
    ):
        layer(torch.randn(2, 5, 8), doc_ids=torch.zeros(2, 5))
    with pytest.raises(
        ValueError,
        match=r"^min_pool=1 is not allowed with top_k=2, num_experts=8; expected an integer in \[2, 8\]",
    ):
        moelab.MoE(8, 8, 2, method=METHOD, min_pool=1)
    with pytest.raises(ValueError, match=r"^eval_pool=9 is not allowed with top_k=2, num_experts=8"):
        moelab.MoE(8, 8, 2, method=METHOD, eval_pool=9)
    with pytest.raises(
        ValueError, match=r"^min_pool=6 is not allowed with max_pool=4; expected min_pool <= max_pool$"
    ):
        moelab.MoE(8, 8, 2, method=METHOD, min_pool=6, max_pool=4)
    with pytest.raises(
        ValueError, match=r"^option 'selection_bias' is not accepted by method='emo'; allowed: "
    ):
        moelab.MoE(8, 8, 2, method=METHOD, selection_bias=True)  # the global-batch balance loss balances it
    # a router that does not route by document ignores the ids
    smoe = moelab.MoE(8, 8, 2)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(smoe(x, doc_ids=torch.zeros(2, 5, dtype=torch.long)), smoe(x), rtol=0, atol=0)


def test_emo_keeps_the_real_tokens_documents_under_a_token_mask():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 8, 2, method=METHOD).eval()
    x = torch.randn(2, 6, 8)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2, 2]])
    mask = torch.tensor([[True, True, False, True, True, False], [True] * 6])
    y = layer(x, token_mask=mask, doc_ids=ids)
    assert (y[~mask] == 0).all()
    real = layer(
        x[mask],
        doc_ids=torch.tensor([0, 0, 1, 1, 2, 2, 2, 2, 2, 2]) * 0
        + torch.tensor([0, 0, 1, 1, 5, 5, 5, 5, 5, 5]),
    )
    torch.testing.assert_close(y[mask], real, rtol=1e-6, atol=1e-7)


def test_the_lm_routes_each_sequence_as_one_document_unless_given_documents():
    from moelab.models.lm import LMConfig, TransformerLM

    torch.manual_seed(0)
    cfg = LMConfig(
        vocab_size=20, d_model=8, n_layer=1, n_head=2, block_size=8, num_experts=4, top_k=2, method=METHOD
    )
    model = TransformerLM(cfg).eval()
    idx = torch.randint(0, 20, (2, 8))
    torch.testing.assert_close(
        model(idx), model(idx, doc_ids=torch.zeros(2, 8, dtype=torch.long)), rtol=0, atol=0
    )
    assert not torch.equal(model(idx), model(idx, doc_ids=torch.arange(8).expand(2, 8)))


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_SLOW_TRITON)
@pytest.mark.parametrize("train", [False, True])
def test_emo_every_kernel_gives_the_literal_output_and_gradients(impl, train):
    check_kernel(METHOD, impl, train=train, balance_coef=0.0, z_coef=0.0)


@pytest.mark.slow
def test_emo_compiles_per_block_under_activation_checkpointing_and_equals_eager():
    check_checkpointed_compile(METHOD)


def test_emo_compiles_as_one_graph_and_equals_eager():
    check_compile(METHOD, steps=2)


def test_emo_survives_save_and_load(tmp_path):
    back = check_save_load(METHOD, tmp_path, eval_pool=3)
    assert back.router.eval_pool == 3


def test_emo_from_hf_runs_with_document_ids_and_to_hf_refuses_in_one_line():
    check_hf_refusal(METHOD)


# ------------------------------------------------------------------ one process = 2 ranks
def _batches():
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 6, 8, dtype=torch.float64, generator=gen) for _ in range(2)]
    ids = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]])
    return xs, ids


def _emo_layer(state=None):
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, min_pool=2, max_pool=4, z_coef=0.0).double()
    if state is not None:
        layer.load_state_dict(state)
    return layer


def _two_ranks(rank: int, world: int, state: dict, ep: int) -> dict:
    from moelab.balance import StepBalance, step_balance_loss
    from moelab.train.parallelize import parallelize

    layer = _emo_layer(state)
    ctx = moelab.routing_context(layer, total_steps=10)
    StepBalance(layer, ctx)
    model = (
        parallelize(layer, dp="ddp", ep=ep) if ep > 1 else torch.nn.parallel.DistributedDataParallel(layer)
    )
    xs, ids = _batches()
    grads = []
    for step, x in enumerate(xs):
        torch.manual_seed(100 * step + rank)  # each rank draws its documents' pool sizes
        y = model(x[rank : rank + 1], doc_ids=ids[rank : rank + 1])
        (y.square().sum() + step_balance_loss(layer)).backward()
        grads.append(layer.router.weight.grad.clone())
        layer.zero_grad()
        ctx.advance()
    return {"grads": grads}


@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_emo_two_ranks_equal_one_process_with_their_batches_as_micro_batches(ep, tmp_path):
    """The global-batch balance over both ranks' tokens, each rank's documents their own pools (no z
    loss: a per-token mean over each micro-batch, which one process would weigh by micro-batch)."""
    from moelab.balance import StepBalance
    from test_parallelize import spawn

    layer = _emo_layer()
    state = copy.deepcopy(layer.state_dict())
    ctx = moelab.routing_context(layer, total_steps=10)
    balance = StepBalance(layer, ctx)
    xs, ids = _batches()
    want = []
    for step, x in enumerate(xs):
        total = 0
        for rank in (0, 1):
            torch.manual_seed(100 * step + rank)
            total = total + layer(x[rank : rank + 1], doc_ids=ids[rank : rank + 1]).square().sum() / 2
            balance.record()
        (total + balance.loss()).backward()
        want.append(layer.router.weight.grad.clone())
        layer.zero_grad()
        ctx.advance()
    for r in spawn(_two_ranks, 2, tmp_path, state, ep):
        for got, ref in zip(r["grads"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
