"""moelab.metrics.specialization against literal formulas on hand-made tables (002 §3, App. A)."""

import math

import pytest
import torch

from moelab.metrics import plot_selection_table, selection_table, specialization


def literal_mi(table: list[list[int]]) -> float:
    """I(E;Y) = H(E) + H(Y) − H(E,Y) from counts, written out (002 eq. 3, 11–16)."""
    n = sum(sum(r) for r in table)
    pe = [sum(r) / n for r in table]
    py = [sum(r[j] for r in table) / n for j in range(len(table[0]))]
    h = lambda ps: -sum(p * math.log2(p) for p in ps if p > 0)
    return h(pe) + h(py) - h([c / n for r in table for c in r])


def one_hot(experts: list[int], n: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(experts), n).double()


def test_uniform_gate_has_entropy_log2_n():
    p = torch.full((12, 5), 0.2)
    m = specialization(p, torch.arange(12) % 3, 3)
    assert m["H_s"] == pytest.approx(math.log2(5))
    assert m["H_u"] == pytest.approx(math.log2(5))


def test_collapse_onto_one_expert_gives_zero_usage_entropy_and_information():
    labels = torch.arange(40) % 10
    m = specialization(one_hot([2] * 40, 5), labels, 10)
    assert m["H_u"] == pytest.approx(0.0, abs=1e-12)
    assert m["H_s"] == pytest.approx(0.0, abs=1e-12)
    assert m["I_EY"] == pytest.approx(0.0, abs=1e-12)


def test_one_class_per_expert_gives_information_log2_classes():
    labels = torch.arange(60) % 6
    m = specialization(one_hot(labels.tolist(), 6), labels, 6)
    assert m["I_EY"] == pytest.approx(math.log2(6))
    assert m["H_u"] == pytest.approx(math.log2(6))


def test_information_matches_the_literal_formula_on_a_hand_made_table():
    # expert of each sample and its class, chosen by hand: 3 experts, 4 classes
    experts = [0, 0, 0, 1, 1, 2, 2, 2, 2, 0, 1, 1]
    labels = [0, 0, 1, 1, 2, 3, 3, 2, 3, 0, 2, 2]
    table = selection_table(torch.tensor(experts), torch.tensor(labels), 3, 4)
    assert table.tolist() == [[3, 1, 0, 0], [0, 1, 3, 0], [0, 0, 1, 3]]
    assert table.tolist() == [
        [sum(1 for e, y in zip(experts, labels) if e == i and y == j) for j in range(4)] for i in range(3)
    ]
    p = one_hot(experts, 3) * 0.7 + 0.1  # argmax unchanged, not one-hot
    m = specialization(p, torch.tensor(labels), 4)
    assert m["I_EY"] == pytest.approx(literal_mi(table.tolist()))
    h = lambda ps: -sum(q * math.log2(q) for q in ps if q > 0)
    assert m["H_s"] == pytest.approx(h([0.8, 0.1, 0.1]))
    assert m["H_u"] == pytest.approx(h(p.mean(0).tolist()))


def test_information_uses_the_true_labels_not_the_gate():
    # the gate splits classes {0,1} vs {2,3}: I = 1 bit with the true labels
    labels = torch.arange(40) % 4
    m = specialization(one_hot((labels // 2).tolist(), 2), labels, 4)
    assert m["I_EY"] == pytest.approx(1.0)
    # the same gate against labels independent of it: 0 bits
    m0 = specialization(one_hot((torch.arange(40) % 2).tolist(), 2), (torch.arange(40) // 2) % 2 * 2, 4)
    assert m0["I_EY"] == pytest.approx(0.0, abs=1e-12)


def test_bad_shapes_and_labels_are_rejected():
    with pytest.raises(ValueError, match="gate_probs of shape"):
        specialization(torch.ones(3, 2) / 2, torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="labels must lie"):
        specialization(torch.ones(3, 2) / 2, torch.tensor([0, 1, 5]), 2)
    with pytest.raises(ValueError, match="num_classes=0"):
        specialization(torch.ones(3, 2) / 2, torch.tensor([0, 1, 0]), 0)


def test_selection_table_plot_writes_a_png(tmp_path):
    table = torch.tensor([[5, 0], [1, 7]])
    plot_selection_table(table, tmp_path / "t.png", ["a", "b"], "title")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_information_with_predicted_labels_is_reported_beside_the_true_label_one():
    # experts split the true classes perfectly, but the model predicts one class for everything
    p = torch.eye(2, dtype=torch.float64).repeat_interleave(3, 0)  # samples 0-2 -> E0, 3-5 -> E1
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    assert "I_EY_pred" not in specialization(p, labels, 2)
    m = specialization(p, labels, 2, predictions=labels)
    assert m["I_EY_pred"] == pytest.approx(m["I_EY"]) == pytest.approx(1.0)
    assert specialization(p, labels, 2, predictions=torch.zeros(6, dtype=torch.long))["I_EY_pred"] == 0.0
    with pytest.raises(ValueError, match="predictions of shape"):
        specialization(p, labels, 2, predictions=labels[:3])
