"""L-BFGS for R independent problems at once: each replicate has its own line search, its own
curvature history and its own stopping decision, so a batched fit equals R separate fits.

``torch.optim.LBFGS`` on the sum of the replicates' losses couples them: one line search and one
curvature memory for the concatenated parameters, so every estimate depends on the others and
on R.  Here the parameters are viewed as ``(B, P)`` (a leading replicate dimension on every
leaf); the two-loop recursion, the backtracking (Armijo) line search and the convergence test
run per row, vectorised over the rows — no Python loop over replicates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["REASONS", "STALL_RESTARTS", "LBFGSResult", "batched_lbfgs"]

#: why a replicate stopped (``LBFGSResult.reason`` indexes this tuple).  The first three are
#: convergence; a replicate where no step was ever accepted (its loss not finite, or no step
#: length lowering it from the start) has not converged, whatever its iteration count says.
REASONS = (
    "gradient",  # max-norm of the gradient <= gtol
    "loss change",  # the loss changed by <= ftol·max(1, |loss|) in an iteration
    "stalled after progress",  # no step length lowers the loss any more, after accepted steps
    "iteration cap",  # max_iter iterations without meeting a stopping test
    "no step accepted",  # no step length ever lowered the loss from the start
    "loss not finite",  # the loss (or its gradient) is inf or nan where the fit stopped
    "not tested",  # sgd/adam: a fixed number of steps, no convergence test
)
CONVERGED_REASONS = (0, 1, 2)
#: restarts from the perturbed best point of a fit at its iteration cap, in the studies' fits
STALL_RESTARTS = 2


@dataclass
class LBFGSResult:
    """Per replicate: ``n_iter`` the iterations taken, ``grad_norm`` the final max-norm of the
    gradient, ``converged`` whether the stopping criterion held before the cap ``max_iter``,
    ``reason`` why it stopped (an index into :data:`REASONS`; ``None`` = not recorded)."""

    n_iter: Tensor
    grad_norm: Tensor
    converged: Tensor
    reason: Tensor | None = None


def _flat(tensors: list[Tensor], B: int) -> Tensor:
    return torch.cat([t.reshape(B, -1) for t in tensors], dim=1)


def batched_lbfgs(
    loss_fn: Callable[[], Tensor],
    leaves: list[Tensor],
    *,
    max_iter: int = 500,
    history: int = 10,
    gtol: float = 1e-7,
    ftol: float = 1e-12,
    lr: float = 1.0,
    c1: float = 1e-4,
    max_backtracks: int = 40,
    stall_restarts: int = 0,
) -> LBFGSResult:
    """Minimise every replicate's loss ``loss_fn() -> (B,)`` over ``leaves`` (tensors whose first
    dimension is the replicate, ``requires_grad``), in place.

    A replicate stops when its gradient's max-norm is ≤ ``gtol`` or its loss changes by at most
    ``ftol · max(1, |loss|)`` in an iteration (or no step length lowers it), else after
    ``max_iter`` iterations.  ``lr`` is the first trial step of each line search.

    A replicate that reaches ``max_iter`` without meeting a test is restarted, up to ``stall_restarts``
    times, from its best point perturbed by 1e-6 of each coordinate's size (a fixed pattern over
    the coordinates, the same whatever the batch) with its curvature memory cleared: a stale
    memory is what keeps L-BFGS creeping along the flat directions of an over-specified mixture.
    Each round has ``max_iter`` iterations (``n_iter`` counts them all); the round's end point is
    kept only where it is no worse than the best before it (by ``ftol``), else the replicate keeps
    its best point and stays at the cap.
    """
    B = leaves[0].shape[0]
    shapes = [t.shape for t in leaves]
    sizes = [t[0].numel() for t in leaves]

    def set_x(x: Tensor) -> None:
        with torch.no_grad():
            for leaf, chunk, shape in zip(leaves, x.split(sizes, dim=1), shapes):
                leaf.copy_(chunk.reshape(shape))

    def evaluate(x: Tensor) -> tuple[Tensor, Tensor]:
        set_x(x)
        for leaf in leaves:
            leaf.grad = None
        f = loss_fn()
        f.sum().backward()  # the replicates are separate: d(sum)/d(row r) = d(loss_r)/d(row r)
        g = _flat([leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves], B)
        return f.detach(), g

    x = _flat([t.detach() for t in leaves], B).clone()
    f, g = evaluate(x)
    dtype = x.dtype
    S = torch.zeros(history, B, x.shape[1], dtype=dtype)
    Y = torch.zeros_like(S)
    rho = torch.zeros(history, B, dtype=dtype)
    gamma = torch.ones(B, dtype=dtype)
    n_iter = torch.zeros(B, dtype=torch.long)
    done = g.abs().amax(dim=1) <= gtol
    # per replicate: 0 gradient, 1 loss change, 2 stalled (indices into REASONS); -1 still running
    why = torch.where(done, torch.zeros(B, dtype=torch.long), torch.full((B,), -1, dtype=torch.long))
    slot = 0
    starting = torch.ones(B, dtype=torch.bool)  # the first iteration of a (re)start: a cautious step
    saved: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # best (x, f, g) of restarted rows
    for round_ in range(stall_restarts + 1):
        if round_ > 0:
            again = (why < 0) & torch.isfinite(f)
            if not bool(again.any()):
                break
            if saved is None:
                saved = (again.clone(), x.clone(), f.clone(), g.clone())
            else:  # keep the better of this round's end and the best so far
                keep_new = f <= saved[2]
                saved = (
                    saved[0] | again,
                    torch.where(keep_new[:, None], x, saved[1]),
                    torch.minimum(f, saved[2]),
                    torch.where(keep_new[:, None], g, saved[3]),
                )
            pattern = torch.sin(torch.arange(x.shape[1], dtype=dtype) * 2.399963 + round_)
            x = torch.where(again[:, None], x + 1e-6 * pattern * (x.abs() + 1e-3), x)
            f_p, g_p = evaluate(x)
            f, g = torch.where(again, f_p, f), torch.where(again[:, None], g_p, g)
            S[:, again], Y[:, again], rho[:, again] = 0.0, 0.0, 0.0
            gamma = torch.where(again, torch.ones_like(gamma), gamma)
            starting = again
            done = ~again
        for _ in range(max_iter):
            if bool(done.all()):
                break
            # two-loop recursion per replicate (pairs with rho = 0 contribute nothing)
            q = g.clone()
            alpha = torch.zeros(history, B, dtype=dtype)
            for j in [(slot - 1 - i) % history for i in range(history)]:
                alpha[j] = rho[j] * (S[j] * q).sum(1)
                q -= alpha[j, :, None] * Y[j]
            r = gamma[:, None] * q
            for j in [(slot + i) % history for i in range(history)]:
                beta = rho[j] * (Y[j] * r).sum(1)
                r += (alpha[j] - beta)[:, None] * S[j]
            d = -r
            slope = (g * d).sum(1)
            bad = slope >= 0  # not a descent direction (numerical trouble): steepest descent instead
            d = torch.where(bad[:, None], -g, d)
            slope = torch.where(bad, -(g * g).sum(1), slope)
            first = starting
            t = torch.where(
                first, torch.clamp(lr / g.abs().sum(1).clamp_min(1e-300), max=lr), torch.full_like(f, lr)
            )
            t = torch.where(done, torch.zeros_like(t), t)
            accepted = done.clone()
            f_new, g_new, x_new = f.clone(), g.clone(), x.clone()
            for _ in range(max_backtracks):
                trial = x + t[:, None] * d
                f_t, g_t = evaluate(trial)
                ok = ~accepted & torch.isfinite(f_t) & (f_t <= f + c1 * t * slope)
                f_new = torch.where(ok, f_t, f_new)
                g_new = torch.where(ok[:, None], g_t, g_new)
                x_new = torch.where(ok[:, None], trial, x_new)
                accepted |= ok
                if bool(accepted.all()):
                    break
                t = torch.where(accepted, t, t * 0.5)
            stalled = ~accepted  # no step length lowered the loss: at the numerical minimum
            moved = accepted & ~done
            s, y = x_new - x, g_new - g
            sy = (s * y).sum(1)
            keep = moved & (sy > 1e-12 * (s * s).sum(1).sqrt() * (y * y).sum(1).sqrt())
            S[slot] = torch.where(keep[:, None], s, torch.zeros_like(s))
            Y[slot] = torch.where(keep[:, None], y, torch.zeros_like(y))
            rho[slot] = torch.where(keep, 1.0 / sy.clamp_min(1e-300), torch.zeros_like(sy))
            gamma = torch.where(keep, sy / (y * y).sum(1).clamp_min(1e-300), gamma)
            slot = (slot + 1) % history
            n_iter += moved.long()
            starting = starting & ~moved
            small_change = (f - f_new).abs() <= ftol * torch.maximum(f.abs(), torch.ones_like(f))
            x, f, g = (
                torch.where(moved[:, None], x_new, x),
                torch.where(moved, f_new, f),
                torch.where(moved[:, None], g_new, g),
            )
            grad_ok = moved & (g.abs().amax(dim=1) <= gtol)
            change_ok = moved & small_change & ~grad_ok
            fresh = why < 0
            why = torch.where(fresh & grad_ok, torch.zeros_like(why), why)
            why = torch.where(fresh & change_ok, torch.ones_like(why), why)
            why = torch.where(fresh & stalled & ~done, torch.full_like(why, 2), why)
            done = done | stalled | (moved & (small_change | (g.abs().amax(dim=1) <= gtol)))
    if saved is not None:  # a restarted row ends at its best point; worse than before: the cap
        rows, x_b, f_b, g_b = saved
        worse = rows & ~(f <= f_b + ftol * torch.maximum(f_b.abs(), torch.ones_like(f_b)))
        x = torch.where(worse[:, None], x_b, x)
        f, g = torch.where(worse, f_b, f), torch.where(worse[:, None], g_b, g)
        why = torch.where(worse, torch.full_like(why, -1), why)
    set_x(x)
    grad_norm = g.abs().amax(dim=1)
    finite = torch.isfinite(f) & torch.isfinite(g).all(dim=1)
    reason = torch.where(why < 0, torch.full_like(why, 3), why)  # still running: the cap
    never = (why == 2) & (n_iter == 0)  # stalled before any accepted step: nothing was fitted
    reason = torch.where(never, torch.full_like(reason, 4), reason)
    reason = torch.where(finite & (grad_norm <= gtol), torch.zeros_like(reason), reason)
    reason = torch.where(finite, reason, torch.full_like(reason, 5))
    converged = (reason == 0) | (reason == 1) | (reason == 2)
    return LBFGSResult(n_iter=n_iter, grad_norm=grad_norm, converged=converged, reason=reason)
