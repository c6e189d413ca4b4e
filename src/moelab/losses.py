"""Auxiliary losses of the routers, one function per formula.

Each returns an unweighted 0-dim tensor; a layer multiplies it by its coefficient
(``balance_coef``, ``z_coef``, ...).  Formulas: docs/methods.md, "Losses".
"""

from __future__ import annotations

import torch
from torch import Tensor

from .functional import expert_counts

__all__ = [
    "LOAD_LOSSES",
    "LOSS_NAMES",
    "balance_from_load",
    "competition_router_loss",
    "distillation_loss",
    "diversity_loss",
    "entropy_from_mean",
    "erc_loss",
    "erc_noise",
    "gaussian_kl_loss",
    "heterogeneous_balance_loss",
    "importance_from_sums",
    "importance_loss",
    "mean_entropy_loss",
    "orthogonality_loss",
    "prototype_alignment_loss",
    "relu_l1_balance_loss",
    "routing_free_balance_loss",
    "sample_similarity_loss",
    "sequence_balance_loss",
    "switch_balance_loss",
    "token_entropy_loss",
    "topk_softmax_dense",
    "z_loss",
]

#: the aux losses a layer computes from a Routing, each with its ``<name>_coef`` option
LOSS_NAMES = ("balance", "z", "importance", "entropy")
#: the losses of the load or of the batch-mean distribution: the ones ``balance_scope`` applies to
LOAD_LOSSES = ("balance", "importance", "entropy")


def balance_from_load(load: Tensor, mean_probs: Tensor, num_experts: int) -> Tensor:
    """``N · Σ_i f_i P_i`` from the load fractions ``f (…, N)`` and the mean probabilities
    ``P (…, N)``; leading dimensions (one per sequence) are averaged.  The one formula of the Switch
    balance at every scope (:func:`switch_balance_loss`, :func:`sequence_balance_loss` and the global
    balance of :mod:`moelab.balance`)."""
    loss = num_experts * (load * mean_probs).sum(dim=-1)
    return loss if loss.dim() == 0 else loss.mean()


def switch_balance_loss(
    probs: Tensor, indices: Tensor, num_experts: int, mask: Tensor | None = None
) -> Tensor:
    """Switch Transformer load-balancing loss ``N · Σ_i f_i P_i``.

    ``f_i`` is the fraction of the ``T·K`` token slots routed to expert ``i``; ``P_i`` the mean
    router probability of ``i`` (Fedus et al. 2022, eq. 4; used by CompeteSMoE (2025) §4 with coefficient
    0.01). Equals 1 under perfect balance.

    Args:
        probs: ``(T, N)`` router distribution.
        indices: ``(T, K)`` chosen experts.
        mask: ``(T, K)`` the active slots of a router that routes a variable number of experts per
            token (``top-p``): ``f_i`` is then the fraction of the active slots routed to ``i``.
    """
    compute = torch.promote_types(probs.dtype, torch.float32)  # counts above 256 are not exact in bf16
    if mask is None:
        f = expert_counts(indices, num_experts).to(compute) / indices.numel()
    else:  # a scatter of the mask, not a boolean index: no data-dependent shape under torch.compile
        active = mask.reshape(-1).to(compute)
        counts = active.new_zeros(num_experts).scatter_add(0, indices.reshape(-1), active)
        f = counts / active.sum().clamp_min(1)
    return balance_from_load(f, probs.to(compute).mean(dim=0), num_experts).to(probs.dtype)


def sequence_balance_loss(probs: Tensor, indices: Tensor, num_experts: int, seq_len: int) -> Tensor:
    """The Switch balance per sequence, averaged over the sequences: DeepSeek-V3's sequence-wise
    balance loss (its technical report, "complementary sequence-wise auxiliary loss",
    ``α Σ_i f_i P_i`` with ``f_i = N/(K·S) Σ_t 1(t chose i)`` — the same ``N · Σ f_i P_i``).

    Args:
        probs: ``(B·S, N)`` router distribution, sequence by sequence.
        indices: ``(B·S, K)`` chosen experts.
        seq_len: ``S``; ``B·S`` tokens make ``B`` sequences.
    """
    compute = torch.promote_types(probs.dtype, torch.float32)
    k = indices.shape[-1]
    seqs = indices.reshape(-1, seq_len * k)  # (B, S·K)
    counts = seqs.new_zeros(seqs.shape[0], num_experts, dtype=torch.int64)
    counts.scatter_add_(1, seqs.long(), torch.ones_like(seqs, dtype=torch.int64))
    f = counts.to(compute) / (seq_len * k)
    p = probs.to(compute).reshape(-1, seq_len, num_experts).mean(dim=1)  # (B, N)
    return balance_from_load(f, p, num_experts).to(probs.dtype)


def heterogeneous_balance_loss(probs: Tensor, indices: Tensor, eta: Tensor) -> Tensor:
    """MoE++'s heterogeneous load-balance loss: ``M · Σ_i η_i f_i P_i`` over the ``M = N + Z`` FFN and
    zero-computation experts, ``f_i`` the fraction of the ``T·K`` slots routed to ``i``, ``P_i`` its
    mean router probability, ``η_i = 1`` for an FFN expert and ``τ`` for a zero-computation one
    (MoE++, Jin et al. 2025, §3): with ``τ < 1`` the zero-computation experts may take more than
    their share.  ``η ≡ 1`` is :func:`switch_balance_loss` over the ``M`` experts.

    Args:
        probs: ``(T, M)`` the router's distribution over every expert.
        indices: ``(T, K)`` the chosen experts, in ``[0, M)``.
        eta: ``(M,)`` the weights ``η``.
    """
    compute = torch.promote_types(probs.dtype, torch.float32)
    num = probs.shape[-1]
    f = expert_counts(indices, num).to(compute) / indices.numel()
    return (num * (eta.to(compute) * f * probs.to(compute).mean(dim=0)).sum()).to(probs.dtype)


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss ``mean_x (logsumexp_i h_i(x))²`` (ST-MoE, Zoph et al. 2022, eq. 5; CompeteSMoE (2025)
    Table 20 uses 0.001)."""
    compute = torch.promote_types(logits.dtype, torch.float32)  # fp16/bf16 → fp32; float64 stays
    return logits.to(compute).logsumexp(dim=-1).square().mean().to(logits.dtype)


def importance_loss(probs: Tensor, seq_len: int | None = None) -> Tensor:
    """Importance loss ``CV(Σ_x p(·|x))`` with ``CV = std / mean``, as Krishnamurthy et al. (2023)
    eq. 7 writes it (``L = w · CV(Importance)``; Shazeer et al. 2017 square it — not here, so the
    paper's grid of ``w`` means what it meant there); the paper's weight ``w`` is the coefficient.
    ``seq_len``: the CV of each sequence's importance, averaged over the sequences."""
    if seq_len is not None:
        probs = probs.reshape(-1, seq_len, probs.shape[-1])
    return importance_from_sums(probs.sum(dim=-2))


def importance_from_sums(importance: Tensor) -> Tensor:
    """``CV = std / mean`` of the importance ``Σ_x p(·|x)`` ``(…, N)``, averaged over leading dimensions."""
    cv = importance.std(dim=-1, unbiased=False) / importance.mean(dim=-1)
    return cv if cv.dim() == 0 else cv.mean()


def mean_entropy_loss(probs: Tensor, eps: float = 1e-9, seq_len: int | None = None) -> Tensor:
    """σ-MoE regulariser: the negative entropy of the batch-mean router distribution,
    ``−H(mean_x softmax(W x))`` (Csordás et al. 2023, §4 "entropy regularisation"; CompeteSMoE (2025) σ-MoE
    baseline, coefficient ≈ 1e-3).  Minimising it spreads the load.  ``seq_len``: of each
    sequence's mean distribution, averaged over the sequences."""
    if seq_len is not None:
        probs = probs.reshape(-1, seq_len, probs.shape[-1])
    return entropy_from_mean(probs.mean(dim=-2), eps)


def entropy_from_mean(mean: Tensor, eps: float = 1e-9) -> Tensor:
    """``Σ_i m_i log m_i`` of a mean distribution ``m (…, N)``, averaged over leading dimensions."""
    neg = (mean * (mean + eps).log()).sum(dim=-1)
    return neg if neg.dim() == 0 else neg.mean()


def relu_l1_balance_loss(gates: Tensor, top_k: int) -> Tensor:
    """ReMoE's L1 regulariser with load balancing (ReMoE (Wang et al. 2025) §3):
    ``N · Σ_e f_e · mean_t R(x_t)_e`` with ``f_e = |{t : R(x_t)_e > 0}| / (T·K)``, the share of
    the ``T·K`` target slots that expert ``e`` takes; ``R = relu(W x)``.  The Switch balance loss
    with the ReLU gates as probabilities and the active gates as the routed slots (the authors'
    Megatron-LM code computes it with ``switch_load_balancing_loss_func``); the counts carry no
    gradient.  The adaptive coefficient ``λ`` multiplies it in the router.

    Args:
        gates: ``(T, N)`` the ReLU gates ``R(x)``.
        top_k: K, the target number of active experts per token.
    """
    compute = torch.promote_types(gates.dtype, torch.float32)
    g = gates.to(compute)
    num_tokens, num_experts = g.shape
    f = (g > 0).sum(dim=0).to(compute) / (num_tokens * top_k)
    return (num_experts * (f * g.mean(dim=0)).sum()).to(gates.dtype)


def token_entropy_loss(probs: Tensor, eps: float = 1e-9) -> Tensor:
    """The dynamic loss of top-p routing, ``mean_t H(P(x_t)) = −mean_t Σ_i P_i log P_i``: the
    entropy of each token's router distribution, averaged over tokens (Huang et al. 2024,
    "Harder Tasks Need More Experts", §3).  Minimising it sharpens each distribution, so that
    top-p routing does not take many experts of near-equal probability.  (Not
    :func:`mean_entropy_loss`, the entropy of the batch-mean distribution.)"""
    compute = torch.promote_types(probs.dtype, torch.float32)
    p = probs.to(compute)
    return -(p * (p + eps).log()).sum(dim=-1).mean().to(probs.dtype)


# ---------------------------------------------------------------- CompeteSMoE (2024, 2025)
def affinity_distillation_loss(router_scores: Tensor, affinities: Tensor) -> Tensor:
    """The distillation of the CompeteSMoE (2025) authors' public code
    (``moe_model/model/moe/competesmoe.py`` of Fsoft-AIC/CompeteSMoE): the mean squared error
    between the router's softmax over all N experts and the softmax of the competition's
    affinities ``s`` over all N (a target, detached) — instead of the paper's L_D with its winner
    term (:func:`distillation_loss`).

    Args:
        router_scores: ``(T, N)`` ``s_R``, the router's softmax over all experts.
        affinities: ``(T, N)`` the competition's affinities ``s``.
    """
    target = affinities.detach().to(torch.promote_types(affinities.dtype, torch.float32)).softmax(dim=-1)
    return (router_scores - target.to(router_scores.dtype)).square().mean()


def distillation_loss(
    router_scores: Tensor, competition_scores: Tensor, winners: Tensor, alpha: float
) -> Tensor:
    """CompeteSMoE distillation loss (CompeteSMoE (2025) eq. 1):
    ``L_D = MSE(s_R, s_C) + (α/K) · Σ_{j∈I_C} (s_C^j − s_R^j)²``.

    The MSE is the mean over the ``T·N`` entries; the winner term is summed over the K winners of
    each token and averaged over tokens.  ``s_C`` is a target: it is detached here, so the loss
    trains the router only.

    Args:
        router_scores: ``(T, N)`` ``s_R``, the router's softmax over all experts.
        competition_scores: ``(T, N)`` ``s_C = TopK_0(s) / Σ TopK_0(s)`` (zero off the winners).
        winners: ``(T, K)`` ``I_C``, the competition winners.
        alpha: α (0.1, CompeteSMoE (2025) Table 20).
    """
    target = competition_scores.detach().to(router_scores.dtype)
    mse = (router_scores - target).square().mean()
    k = winners.shape[-1]
    diff = target.gather(1, winners) - router_scores.gather(1, winners)  # (T, K)
    return mse + (alpha / k) * diff.square().sum(dim=-1).mean()


def diversity_loss(outputs: Tensor, normalize: str = "frobenius", eps: float = 1e-12) -> Tensor:
    """CompeteSMoE diversity loss on the winners' outputs (CompeteSMoE (2025) eq. 2):
    ``L_div(O) = 1/(K(K−1)) Σ_{i≠j} C_ij`` with ``C = O Oᵀ / ‖O‖²₂``, per token, averaged over tokens.

    Args:
        outputs: ``(T, K, d)``, the K winners' outputs ``O`` of each token.
        normalize: ``"frobenius"`` (the paper's formula: one scalar ‖O‖²₂, the squared Frobenius
            norm of O) or ``"cosine"`` (rows normalised: the cosine-similarity matrix, what the
            public code computes).

    With K = 1 there is no pair: the loss is 0.
    """
    K = outputs.shape[1]
    if K < 2:
        return outputs.new_zeros(())
    o = outputs.float()
    if normalize == "frobenius":
        gram = o @ o.transpose(1, 2)  # (T, K, K)
        c = gram / o.square().sum(dim=(1, 2)).clamp_min(eps)[:, None, None]
    elif normalize == "cosine":
        u = o / o.norm(dim=-1, keepdim=True).clamp_min(eps)
        c = u @ u.transpose(1, 2)
    else:
        raise ValueError(f"normalize={normalize!r} is not supported; allowed: ['frobenius', 'cosine']")
    off = c.sum(dim=(1, 2)) - c.diagonal(dim1=1, dim2=2).sum(dim=-1)  # (T,)
    return (off / (K * (K - 1))).mean().to(outputs.dtype)


def topk_softmax_dense(scores: Tensor, k: int) -> Tensor:
    """``softmax(TopK_-inf(v))`` as an ``(T, N)`` distribution: the softmax over each row's K
    largest entries, zero elsewhere (CompeteSMoE (2024) eq. 1-2)."""
    top, idx = scores.topk(k, dim=-1)
    return torch.zeros_like(scores).scatter(-1, idx, top.softmax(dim=-1))


def competition_router_loss(router_logits: Tensor, competition_scores: Tensor, k: int) -> Tensor:
    """CompeteSMoE v1 router loss (CompeteSMoE (2024) eq. 3):
    ``L_R = MSE(softmax(TopK(s_R, K)), softmax(TopK(s_C, K)))``, both over N experts (zero off each
    one's top K), mean over the ``T·N`` entries; ``s_C`` (the experts' output norms) is detached.

    Args:
        router_logits: ``(T, N)`` the router's scores ``s_R``.
        competition_scores: ``(T, N)`` the competition affinities ``s_C = ‖g_i(x)‖₂``.
        k: K.
    """
    target = topk_softmax_dense(competition_scores.detach().to(router_logits.dtype), k)
    return (topk_softmax_dense(router_logits, k) - target).square().mean()


def sample_similarity_loss(probs: Tensor, x: Tensor, beta_s: float, beta_d: float) -> Tensor:
    """Sample-similarity regulariser ``L_s`` of Krishnamurthy et al. (2023) eq. 8–10, as the paper writes it.

    ``L_s = 1/(N²−N) Σ_{x,x'} [S(x,x') − D(x,x')]`` over the ``N`` samples of the batch, with
    ``S = β_s/M Σ_e p(e|x) p(e|x') ‖x−x'‖²`` (similar samples to the same expert) and
    ``D = β_d/(M²−M) Σ_{e≠e'} p(e|x) p(e'|x') ‖x−x'‖²`` (dissimilar samples to different ones).
    Pairs ``x = x'`` contribute 0 (zero distance).  The authors' code divides the distances by
    their maximum and, by an operator-precedence slip, divides only the D term by B² (a defect,
    docs/methods.md): not copied here; distances are raw squared Euclidean distances.

    Args:
        probs: ``(N, M)`` gate distribution.
        x: ``(N, ...)`` the samples (flattened to vectors).
        beta_s, beta_d: the paper's weights (Krishnamurthy et al. (2023) Appendix C, Table 6).
    """
    n, m = probs.shape
    if n < 2 or m < 2:
        raise ValueError(
            f"probs of shape {tuple(probs.shape)} is not allowed; expected N >= 2 samples and M >= 2 experts"
        )
    flat = x.reshape(n, -1).to(probs.dtype)
    sq = flat.square().sum(1)
    dist = (sq[:, None] + sq[None, :] - 2 * flat @ flat.T).clamp_min(0)  # (N, N) ‖x − x'‖²
    same = probs @ probs.T  # Σ_e p(e|x) p(e|x')
    mass = probs.sum(1)
    different = mass[:, None] * mass[None, :] - same  # Σ_{e≠e'} p(e|x) p(e'|x')
    s = beta_s / m * same * dist
    d = beta_d / (m * m - m) * different * dist
    return (s - d).sum() / (n * n - n)


def erc_noise(router_weight: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """The multiplicative noise ``δ (N, d)`` of the ERC loss's proxy tokens ``R̃_i = R_i ⊙ δ_i``:
    ``δ_ik ~ U(1 − ε_i, 1 + ε_i)`` with ``ε_i = ‖R_i − R_j‖ / (2‖R_i‖)``, ``R_j`` the router row
    nearest to ``R_i`` (Lv et al. 2025, "Coupling Experts and Routers in Mixture-of-Experts via an
    Auxiliary Loss", arXiv 2512.23447: the bound that keeps ``R̃_i`` in its own cluster; as we read it, ``ε_i``
    is the bound itself).  Drawn without autograd."""
    with torch.no_grad():
        r = router_weight.detach().float()
        dist = torch.cdist(r, r)
        dist.fill_diagonal_(float("inf"))
        eps = dist.min(dim=1).values / (2 * r.norm(dim=1).clamp_min(1e-12))
        eps = torch.where(torch.isfinite(eps), eps, torch.zeros_like(eps))  # one expert: no noise
        u = torch.rand(r.shape, generator=generator, device=r.device)
        return (1 - eps[:, None] + 2 * eps[:, None] * u).to(router_weight.dtype)


def erc_loss(
    router_weight: Tensor, gate_weight: Tensor, alpha: float = 1.0, noise: Tensor | None = None
) -> Tensor:
    """The expert–router coupling (ERC) loss (Lv et al. 2025, "Coupling Experts and Routers in
    Mixture-of-Experts via an Auxiliary Loss", arXiv 2512.23447), as we read it:

    ``M[i, j] = ‖W_g^j R̃_i‖`` — the norm of expert ``j``'s gate pre-activation on the proxy token
    ``R̃_i = R_i ⊙ δ_i`` of router row ``i`` (:func:`erc_noise`); then
    ``L = (1/N²) Σ_i Σ_{j≠i} [relu(M[i,j] − α M[i,i]) + relu(M[j,i] − α M[i,i])]``: each expert
    reacts more to its own proxy token than to any other's, and each proxy token excites its own
    expert more than any other, by the margin ``α ≤ 1``.  Cost ``N²`` gate products, independent of
    the tokens.

    Args:
        router_weight: ``R (N, d)``, the router rows.
        gate_weight: ``W_g (N, h, d)``, each expert's gate projection (``nn.Linear`` layout).
        alpha: ``α``.
        noise: ``δ (N, d)``; ``None``: no perturbation (``R̃ = R``).
    """
    proxy = router_weight if noise is None else router_weight * noise
    m = torch.einsum("id,jhd->ijh", proxy, gate_weight.to(proxy.dtype)).norm(dim=-1)  # (N, N)
    diag = m.diagonal()
    off = ~torch.eye(m.shape[0], dtype=torch.bool, device=m.device)
    rows = torch.relu(m - alpha * diag[:, None])  # M[i, j] vs M[i, i]
    cols = torch.relu(m.T - alpha * diag[:, None])  # M[j, i] vs M[i, i]
    return ((rows + cols) * off).sum() / m.shape[0] ** 2


# ------------------------------------------------------------------ routing-free MoE
def routing_free_balance_loss(gates: Tensor, active: Tensor, token_balance: float) -> Tensor:
    """The balancing objective of Routing-Free MoE (Liu, Han, Yan, Tresp, Ma, arXiv 2604.00801;
    the authors' ``balancing_loss_func``): with ``a = active (T, N)`` (no gradient) and the gates
    ``g (T, N)`` (0 where inactive),

    ``(1 − μ) · mean_e(mean_t a · mean_t g) + μ · mean_t(mean_e a · mean_e g)``,

    the expert-balance term (each expert's activation rate times its mean gate) and the
    token-balance term (each token's) interpolated by ``μ = token_balance``.  Both terms are
    smallest when the activations spread evenly over experts, respectively tokens.  The adaptive
    coefficient ``λ`` multiplies it in the router."""
    compute = torch.promote_types(gates.dtype, torch.float32)
    g, a = gates.to(compute), active.to(compute)
    expert = (a.mean(dim=0) * g.mean(dim=0)).mean()
    token = (a.mean(dim=1) * g.mean(dim=1)).mean()
    return ((1.0 - token_balance) * expert + token_balance * token).to(gates.dtype)


# ------------------------------------------------------------------ latent prototype routing
def orthogonality_loss(rows: Tensor, eps: float = 1e-12) -> Tensor:
    """``mean_{i,j} (n_i·n_j − δ_ij)²`` over the ``M × M`` pairs of the L2-normalised rows ``n`` of
    ``rows (M, D)``: how far they are from orthonormal (Latent Prototype Routing's ``orthogonal``
    diversity regulariser, the authors' ``DiversityRegularizer``: ``mse_loss(n nᵀ, I)``).

    Computed without the ``M × M`` matrix, as ``(‖nᵀn‖²_F − 2 Σ_i ‖n_i‖² + M) / M²`` (``‖n nᵀ‖_F =
    ‖nᵀ n‖_F``): ``O(M D²)`` instead of ``O(M² D)``, for ``M`` = the tokens of a batch."""
    compute = torch.promote_types(rows.dtype, torch.float32)
    n = torch.nn.functional.normalize(rows.to(compute), dim=-1, eps=eps)
    m = n.shape[0]
    gram = n.transpose(0, 1) @ n  # (D, D)
    return ((gram.square().sum() - 2 * n.square().sum() + m) / (m * m)).to(rows.dtype)


def gaussian_kl_loss(mu: Tensor, logvar: Tensor) -> Tensor:
    """``mean_t KL(N(μ_t, σ_t²) ‖ N(0, I)) = mean_t −½ Σ_j (1 + log σ²_tj − μ²_tj − σ²_tj)``: the
    variational encoder's prior term of Latent Prototype Routing (the authors' ``compute_kl``)."""
    compute = torch.promote_types(mu.dtype, torch.float32)
    mu, logvar = mu.to(compute), logvar.to(compute)
    return (-0.5 * (1 + logvar - mu.square() - logvar.exp()).sum(dim=-1)).mean()


def prototype_alignment_loss(prototypes: Tensor, assignment: Tensor, latents: Tensor) -> Tensor:
    """``mean |P − (Aᵀ z)|`` with the target ``Aᵀ z`` detached: each prototype ``P_e (D,)`` pulled
    towards the assignment-weighted sum of the batch's latents ``z (T, D)`` (``A (T, N)`` the
    assignment); the gradient reaches the prototypes only (Latent Prototype Routing, the authors'
    ``sim_loss``)."""
    compute = torch.promote_types(prototypes.dtype, torch.float32)
    target = (assignment.to(compute).transpose(0, 1) @ latents.to(compute)).detach()
    return (prototypes.to(compute) - target).abs().mean()
