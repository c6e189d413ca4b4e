"""n-gram count models: the same figures as counting by hand, k chosen on validation, clear errors."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from moelab.data.ngram import SMOOTHING, count_models
from moelab.data.text import CharTokenizer, TextData


def _data(train, valid, test, alphabet="abcde") -> TextData:
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)
    return TextData("toy", t(train), t(valid), t(test), CharTokenizer(alphabet), "bpc")


def _by_hand(train, split, order, k, vocab):
    """Bits per token of the add-k model, counted with a loop over the tokens."""
    grams, contexts = Counter(), Counter()
    for i in range(order - 1, len(train)):
        grams[tuple(train[i - order + 1 : i + 1])] += 1
        contexts[tuple(train[i - order + 1 : i])] += 1
    bits = [
        -math.log2(
            (grams[tuple(split[i - order + 1 : i + 1])] + k)
            / (contexts[tuple(split[i - order + 1 : i])] + k * vocab)
        )
        for i in range(order - 1, len(split))
    ]
    return sum(bits) / len(bits)


@pytest.mark.parametrize("order", [1, 2, 3])
def test_count_models_give_the_hand_counted_bits_with_k_chosen_on_validation(order):
    g = torch.Generator().manual_seed(order)
    skewed = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    train, valid, test = (torch.multinomial(skewed, n, True, generator=g).tolist() for n in (600, 150, 120))
    [model] = count_models(_data(train, valid, test), (order,))
    k = min(SMOOTHING, key=lambda k: _by_hand(train, valid, order, k, 5))
    assert model.order == order and model.k == k
    assert model.valid_bits == pytest.approx(_by_hand(train, valid, order, k, 5), rel=1e-12)
    assert model.test_bits == pytest.approx(_by_hand(train, test, order, k, 5), rel=1e-12)


def test_a_higher_order_finds_the_structure_of_a_periodic_text():
    cycle = [0, 1, 2, 0, 3]  # after "0" comes 1 or 3, after "2 0" always 3, after "3 0" always 1
    unigram, bigram, trigram = count_models(_data(cycle * 100, cycle * 20, cycle * 20))
    assert trigram.test_bits < 0.01 < bigram.test_bits < unigram.test_bits
    assert bigram.test_bits == pytest.approx(0.4, abs=0.01)  # 2 of 5 tokens follow a 0: 1 or 3 alike
    assert trigram.k == SMOOTHING[0]


def test_perplexity_is_two_to_the_bits():
    model = count_models(_data([0, 1] * 50, [0, 1] * 10, [1, 0] * 10), (1,))[0]
    assert model.value("ppl", "test") == pytest.approx(2.0**model.test_bits)
    assert model.value("bpc", "valid") == model.valid_bits


@pytest.mark.parametrize(
    "order,message",
    [(0, "order=0 is not allowed; expected a positive integer"),
     (9, r"order=9 is not allowed; expected at most 8 \(the shortest split\)")],
)  # fmt: skip
def test_count_models_refuse_an_order_they_cannot_count(order, message):
    with pytest.raises(ValueError, match=message):
        count_models(_data([0, 1] * 20, [0] * 8, [1] * 8), (order,))


def test_count_models_refuse_ids_that_overflow_int64():
    zeros = lambda n: torch.zeros(n, dtype=torch.int64)
    data = TextData("huge", zeros(20), zeros(8), zeros(8), SimpleNamespace(vocab_size=1 << 16), "ppl")
    message = r"order=4 is not allowed for a vocabulary of 65536; expected vocab\*\*order < 2\*\*63"
    with pytest.raises(ValueError, match=message):
        count_models(data, (4,))
