"""``moelab eval``: a moelab LM scored by lm-evaluation-harness, offline, on a task file the test
writes (the hub is unreachable here: this proves the harness path, not the benchmark numbers)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import moelab
from moelab.cli import main
from moelab.data.text import ByteTokenizer
from moelab.experiments.evaluate import _task_manager, continuation_logprobs

pytest.importorskip("lm_eval")

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " banana"], "label": 0},
    {"question": "One, two,", "choices": [" three", " xyz!"], "label": 0},
    {"question": "def f(x):\n    return", "choices": [" x", " qqqq"], "label": 1},
    {"question": "abc", "choices": ["d", "e", "f"], "label": 2},
]


class Bigram(torch.nn.Module):
    """A model whose log-probabilities are easy to compute by hand."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(256, 256))

    def forward(self, idx, mask=None):
        return self.table[idx]


def test_continuation_logprobs_are_the_sum_over_the_continuations_tokens():
    model = Bigram()
    pairs = [([1, 2, 3], [4, 5]), ([7], [8]), ([9, 10, 11, 12, 13], [14, 15, 16])]
    got = continuation_logprobs(model, pairs, block_size=4, batch_size=2)
    logp = F.log_softmax(model.table, dim=-1)
    for (context, continuation), (score, greedy) in zip(pairs, got):
        seq = context + continuation
        want = sum(float(logp[seq[i - 1], seq[i]]) for i in range(len(context), len(seq)))
        assert score == pytest.approx(want, abs=1e-5)
        argmax = all(int(logp[seq[i - 1]].argmax()) == seq[i] for i in range(len(context), len(seq)))
        assert greedy == argmax


def test_a_continuation_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="a continuation of 5 tokens does not fit the model's context of 4"):
        continuation_logprobs(Bigram(), [([1], [2, 3, 4, 5, 6])], block_size=4, batch_size=1)


def _task_file(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    task = tmp_path / "local_mc.yaml"
    task.write_text(
        "task: local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\noutput_type: multiple_choice\ntest_split: test\ntarget_delimiter: ''\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: label\ndoc_to_choice: "{{choices}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return task


def test_eval_scores_a_trained_lm_on_a_local_task_as_a_direct_computation(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the capital of France is Paris. one, two, three. " * 200)
    run = tmp_path / "run"
    train = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "40", "--batch-size", "4",
             "--num-experts", "4", "--steps", "3", "--eval-every", "3", "--eval-tokens", "64",
             "--test-tokens", "64", "--no-progress", "--out", str(run)]  # fmt: skip
    assert main(train) == 0
    out = tmp_path / "eval"
    args = ["eval", "--from", str(run), "--tasks", "local_mc", "--include", str(_task_file(tmp_path))]
    assert main([*args, "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    # the accuracy by hand: the choice of highest log-likelihood given the question, per document
    model = moelab.load(run / "best").eval()
    tok = ByteTokenizer()
    correct = 0
    with torch.no_grad():
        for doc in DOCS:
            scores = []
            for choice in doc["choices"]:
                ctx, cont = tok.encode(doc["question"]).tolist(), tok.encode(choice).tolist()
                logp = F.log_softmax(model(torch.tensor([ctx + cont])[:, :-1]).float(), dim=-1)[0]
                scores.append(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
            correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    assert metrics["tasks"]["local_mc"]["acc"] == pytest.approx(correct / len(DOCS))
    assert metrics["tasks"]["local_mc"]["n"] == len(DOCS)
    assert "local_mc" in (out / "results.txt").read_text()


def test_eval_refusals_are_one_line(tmp_path, capsys):
    assert main(["eval", "--from", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "holds no moelab run (no config.yaml)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_task_index_holds_only_the_included_tasks_when_they_are_all_asked(tmp_path):
    class Index:
        def __init__(self, include_path=None, include_defaults=True):
            self.all_tasks = ["mine"] + (["piqa"] if include_defaults else [])

    folder = tmp_path / "tmp"
    folder.mkdir()
    task = tmp_path / "mine.yaml"
    task.write_text("task: mine\n")
    assert _task_manager(Index, str(task), ["mine"], folder).all_tasks == ["mine"]
    assert (folder / "mine.yaml").exists()  # a single file is indexed from a folder of its own
    assert _task_manager(Index, str(task), ["mine", "piqa"], folder).all_tasks == ["mine", "piqa"]
    with pytest.raises(FileNotFoundError, match=r"--include 'nope\.yaml' does not exist"):
        _task_manager(Index, "nope.yaml", ["mine"], folder)


def test_eval_offline_is_one_line_and_leaves_nothing_that_blocks_the_retry(tmp_path, capsys, monkeypatch):
    import lm_eval

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the capital of France is Paris. one, two, three. " * 200)
    run = tmp_path / "run"
    train = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "40", "--batch-size", "4",
             "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64",
             "--test-tokens", "64", "--no-progress", "--out", str(run)]  # fmt: skip
    assert main(train) == 0

    def offline(**kwargs):
        try:
            raise OSError("[Errno -3] Temporary failure in name resolution")
        except OSError as exc:  # as the hub client chains it
            raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (LocalEntryNotFoundError)") from exc

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    out = tmp_path / "eval"
    args = ["eval", "--from", str(run), "--tasks", "local_mc", "--include", str(_task_file(tmp_path)),
            "--out", str(out)]  # fmt: skip
    capsys.readouterr()
    for _ in range(2):  # the retry meets the same sentence, not "already holds a run"
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err == (
            "moelab eval: error: --tasks 'local_mc': the task's data cannot be fetched (ConnectionError); "
            "without network only tasks whose datasets are cached or local run (a task of your own: "
            "--include FILE.yaml)\n"
        )
        assert not (out / "config.yaml").exists()


@pytest.mark.parametrize("options", [{"capacity_factor": 1.0}, {}])
def test_scores_do_not_depend_on_the_batch_size(options):
    from moelab.models.lm import LMConfig, TransformerLM

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=40, block_size=16, n_layer=2, d_model=32, n_head=2, num_experts=4, dropout=0.0,
                   method_options=options)  # fmt: skip
    model = TransformerLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    pairs = [
        (torch.randint(0, 40, (n,), generator=g).tolist(), torch.randint(0, 40, (m,), generator=g).tolist())
        for n, m in [(3, 2), (9, 4), (5, 1), (12, 3), (1, 1)]
    ]
    one = continuation_logprobs(model, pairs, block_size=16, batch_size=1)
    for batch_size in (2, 5):  # to float32 rounding (other batch shapes, other summation orders)
        got = continuation_logprobs(model, pairs, block_size=16, batch_size=batch_size)
        assert [s for s, _ in got] == pytest.approx([s for s, _ in one], rel=1e-6, abs=1e-6)
        assert [g for _, g in got] == [g for _, g in one]
