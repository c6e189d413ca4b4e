"""The comparisons the CompeteSMoE papers printed: their methods, loss settings and numbers, which
``moelab compare --paper 2024`` (CompeteSMoE (2024) Table 2, no balance or z loss for any method)
and ``--paper 2025`` (CompeteSMoE (2025) Table 2, balance 0.01 and z 0.001 for every learned
router) run and print beside ours.  docs/results.md ("Notes") says how the settings were read and
why only the order of the methods can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .summary import format_mean_sd

__all__ = ["PAPERS", "SAME_LOSSES", "Paper", "paper_table"]

#: the auxiliary losses every method gets in a comparison by default (CompeteSMoE (2025) Table 20)
SAME_LOSSES = {"balance_coef": 0.01, "z_coef": 0.001}


@dataclass(frozen=True)
class Paper:
    citation: str
    table: str
    metric: str
    lower_is_better: bool
    reference: str
    losses: dict[str, float]
    numbers: dict[str, float] = field(default_factory=dict)
    #: per method, the run settings of the paper's layout (``TrainRun`` fields; ``opts`` merged into
    #: the method options); a flag given on the command line wins.  A row that is a method with
    #: options (an ablation) names its method under ``method``; the row's key names its folder
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def methods(self) -> list[str]:
        return list(self.numbers)


PAPERS = {
    "2024": Paper(
        citation="CompeteSMoE (2024)",
        table="Table 2, Switch Transformer, small model, enwik8 test BPC (60,000 steps)",
        metric="BPC",
        lower_is_better=True,
        reference="competesmoe-v1",
        losses={"balance_coef": 0.0, "z_coef": 0.0},
        numbers={
            "smoe": 1.191,
            "smoe-fixed": 1.202,
            "xmoe": 1.198,
            "stablemoe": 1.194,
            "competesmoe-v1": 1.177,
        },
    ),
    "2025": Paper(
        citation="CompeteSMoE (2025)",
        table="Table 2, 1B-parameter language model, average zero-shot accuracy (%) of 8 benchmarks",
        metric="Avg. Acc",
        lower_is_better=False,
        reference="competesmoe",
        losses=dict(SAME_LOSSES),
        numbers={
            "smoe": 53.67,
            "xmoe": 53.24,
            "pcosine": 53.38,
            "sigma-moe": 53.69,
            "sharede-v2": 53.75,
            "sharede-v3": 53.77,
            "competesmoe": 54.04,
        },
    ),
    "ho2025": Paper(
        citation="Ho (2025)",
        table="Table 2 (Nguyen et al. on DeepSeekMoE), Switch Transformer 158M on SlimPajama, perplexity",
        metric="PPL",
        lower_is_better=True,
        reference="smoe",
        losses={},  # each method's own: balance + z for the softmax routers, none for the sigmoid ones
        numbers={"smoe": 13.63, "sharede-v3": 13.42, "sharede-v2": 13.49, "smoe-sg": 13.61},
        # the slides' 66 experts, top-8 vs top-6 of 64 + 2 shared, scaled to 18 small experts
        # (width d/4): top-4 of 18 vs top-2 of 16 + 2 shared, four active experts each
        layouts={
            "smoe": {"num_experts": 18, "top_k": 4, "d_hidden": 16},
            "smoe-sg": {"num_experts": 18, "top_k": 4, "d_hidden": 16},
            "sharede-v2": {"num_experts": 16, "top_k": 2, "d_hidden": 16, "opts": {"num_shared": 2}},
            "sharede-v3": {"num_experts": 16, "top_k": 2, "d_hidden": 16, "opts": {"num_shared": 2}},
        },
    ),
    # CompeteSMoE (2025) App. C: its ablations, each row a method and its options (the folder and
    # the row are named by the key); balance 0.01 and z 0.001 for every row, as its Table 2
    "2025-table10": Paper(
        citation="CompeteSMoE (2025)",
        table="Table 10, component ablation, average zero-shot accuracy (%) of 9 benchmarks",
        metric="Avg. Acc",
        lower_is_better=False,
        reference="competesmoe",
        losses=dict(SAME_LOSSES),
        numbers={
            "competesmoe": 53.21,
            "no-diversity": 52.90,
            "no-competition": 52.71,
            "densemoe": 52.70,
            "densemoe-diversity": 52.79,
            "smoe": 52.47,
        },
        layouts={
            "no-diversity": {"method": "competesmoe", "opts": {"diversity_coef": 0.0}},  # row (1)
            "no-competition": {"method": "competesmoe", "opts": {"mode": "router"}},  # row (2)
            "densemoe": {"method": "densemoe"},  # row (3)
            "densemoe-diversity": {"method": "densemoe", "opts": {"diversity_coef": 0.005}},  # row (4)
        },
    ),
    "2025-table11": Paper(
        citation="CompeteSMoE (2025)",
        table="Table 11, task loss and competition policy, average zero-shot accuracy (%) of 9 benchmarks",
        metric="Avg. Acc",
        lower_is_better=False,
        reference="competesmoe",
        losses=dict(SAME_LOSSES),
        numbers={"competesmoe": 53.21, "policy-only": 52.84, "smoe": 52.47},
        layouts={"policy-only": {"method": "competesmoe", "opts": {"task_gradient": False}}},
    ),
}


def _rank(values: dict[str, float], lower_is_better: bool) -> dict[str, int]:
    order = sorted(values, key=values.__getitem__, reverse=not lower_is_better)
    return {m: i + 1 for i, m in enumerate(order)}


def paper_table(paper: Paper, ours: dict[str, tuple[float, float | None, int]], metric: str) -> str:
    """Our ``mean ± sd (n)`` per method beside the paper's number and both ranks (the sd of one
    seed is undefined: ``—``)."""
    mine = {m: v[0] for m, v in ours.items() if m in paper.numbers}
    theirs = {m: paper.numbers[m] for m in mine}
    our_rank = _rank(mine, lower_is_better=True)
    their_rank = _rank(theirs, paper.lower_is_better)
    lines = [
        f"{paper.citation} {paper.table} — beside ours (test {metric}; the paper's models and budgets are far",
        "larger and its metric may differ: compare the ranks, not the values)",
        f"{'method':<16} {'ours':>20} {'rank':>5} {'paper':>10} {'rank':>5}",
    ]
    for m in sorted(mine, key=our_rank.__getitem__):
        mean, sd, n = ours[m]
        cell = f"{format_mean_sd(mean, sd, missing='—')} ({n})"
        lines.append(f"{m:<16} {cell:>20} {our_rank[m]:>5} {paper.numbers[m]:>10.3f} {their_rank[m]:>5}")
    return "\n".join(lines)
