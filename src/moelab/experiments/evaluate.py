"""``moelab eval``: zero-shot evaluation of a trained moelab language model through
lm-evaluation-harness (``lm-eval``), the multiple-choice and cloze tasks CompeteSMoE (2024, 2025) and
Ho (2025) report (LAMBADA, BLiMP, CBT, HellaSwag, PIQA, ARC, RACE, SIQA, CommonsenseQA), chosen by
name, or a task of the user's own (a YAML file or a folder of them, ``--include``).  The model
scores log-likelihoods only (no generation tasks).  docs/evaluation.md says what runs offline.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import config as vocab
from ..config import Interval, setting
from ..io.atomic import atomic_write_text
from ..layer import moe_layers
from . import runner

__all__ = ["PAPER_TASKS", "EvalConfig", "add_arguments", "harness_model", "run"]

#: the zero-shot tasks of CompeteSMoE (2024, 2025) and Ho (2025), by their lm-evaluation-harness names
PAPER_TASKS = (
    "lambada_openai", "blimp", "cbt", "hellaswag", "piqa", "arc_easy", "arc_challenge", "race", "siqa",
    "commonsense_qa",
)  # fmt: skip


def _require_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise ValueError(
            "moelab eval needs lm-evaluation-harness: pip install 'moelab[eval]' (lm-eval)"
        ) from None
    return lm_eval


class _Encoder:
    """A moelab tokenizer as the harness needs it: text → ids without an end-of-line token the text
    does not hold (the word tokenizer ends every line with ``<eos>``), and the id that stands for an
    empty context."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        level = getattr(tokenizer, "level", None)
        if level == "word":
            self.separator = tokenizer.index[tokenizer.EOS]
        elif level == "char":  # text8: lower-case letters and space; the rest reads as a space
            self.separator = tokenizer.alphabet.index(" ") if " " in tokenizer.alphabet else 0
        else:
            self.separator = ord("\n")

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if tok.level == "char":
            text = "".join(c if c in tok.alphabet else " " for c in text.lower())
        ids = tok.encode(text).tolist()
        if tok.level == "word" and ids and not text.endswith("\n") and ids[-1] == self.separator:
            ids = ids[:-1]
        return ids


@torch.no_grad()
def continuation_logprobs(
    model: nn.Module, pairs: list[tuple[list[int], list[int]]], block_size: int, batch_size: int
) -> list[tuple[float, bool]]:
    """``(log p(continuation | context), whether every continuation token is the model's argmax)``
    for each ``(context ids, continuation ids)``: the sequence is cut to its last ``block_size + 1``
    tokens (the continuation must fit), right-padded, and scored in batches of ``batch_size``.

    A score never depends on the batch it is scored in: padding is masked out of the MoE layers,
    and a model whose layers share something between the tokens of a batch (an expert capacity,
    expert-choice routing) is scored one sequence at a time whatever ``batch_size``."""
    if couples_tokens(model):
        batch_size = 1
    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        rows, spans = [], []
        for i in chunk:
            context, continuation = pairs[i]
            if not continuation:
                raise ValueError("a request has an empty continuation: nothing to score")
            if len(continuation) > block_size:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens does not fit the model's context of "
                    f"{block_size} tokens"
                )
            seq = (context + continuation)[-(block_size + 1) :]
            rows.append(seq[:-1])
            spans.append((len(seq) - 1 - len(continuation), seq[-len(continuation) :]))
        width = max(len(r) for r in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        for r, ids in enumerate(rows):
            batch[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[r, : len(ids)] = True
        # causal attention never sees the right padding; the mask keeps it out of the experts'
        # routing and capacity, so a score does not depend on the batch it is scored in
        logp = F.log_softmax(model(batch, mask).float(), dim=-1)
        for r, (offset, target) in enumerate(spans):
            part = logp[r, offset : offset + len(target)]  # (n, vocab)
            target_t = torch.tensor(target, dtype=torch.long, device=device)
            score = float(part.gather(1, target_t[:, None]).sum())
            greedy = bool((part.argmax(dim=-1) == target_t).all())
            results[chunk[r]] = (score, greedy)
    return [r for r in results if r is not None]


def couples_tokens(model: nn.Module) -> bool:
    """Whether an MoE layer of ``model`` lets a token's output depend on the other tokens of its
    forward: an expert capacity (the tokens compete for it) or a router that picks tokens per
    expert (expert-choice)."""
    return any(
        layer.capacity_factor is not None or type(layer.router.base_router).leaks_future_tokens
        for layer in moe_layers(model)
    )


def harness_model(model: nn.Module, tokenizer: Any, block_size: int, batch_size: int = 16) -> Any:
    """A moelab language model (``forward(ids (B, L)) → logits (B, L, vocab)``) and its tokenizer as
    an lm-evaluation-harness ``LM``: ``loglikelihood`` (multiple choice, cloze) and
    ``loglikelihood_rolling`` (perplexity tasks); generation tasks are refused."""
    lm_eval = _require_lm_eval()
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    encoder = _Encoder(tokenizer)

    class MoelabLM(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.model = model.eval()

        @property
        def eot_token_id(self) -> int:
            return encoder.separator

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return encoder.encode(string)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
            pairs = [(list(context), list(continuation)) for _, context, continuation in requests]
            return continuation_logprobs(self.model, pairs, block_size, batch_size)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            out = []
            for request in requests:
                ids = encoder.encode(request.args[0])
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=ids, prefix_token=encoder.separator, max_seq_len=block_size, context_len=1
                    )
                ]
                scores = continuation_logprobs(
                    self.model, [(list(c), list(t)) for c, t in windows], block_size, 1
                )
                out.append(sum(s for s, _ in scores))
            return out

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            raise ValueError(
                "moelab eval scores log-likelihoods (multiple-choice, cloze and perplexity tasks); "
                "generation tasks are not supported"
            )

    del lm_eval
    return MoelabLM()


@dataclass
class EvalConfig:
    """The settings of ``moelab eval``, as its ``config.yaml`` holds them."""

    source: str = setting(
        flag="--from",
        help="a `moelab train` run directory (its best weights and tokenizer.json)",
        path=True,
    )
    tasks: str = setting(
        ",".join(PAPER_TASKS[:1]),
        help="comma-separated lm-evaluation-harness task names (the papers': " + ",".join(PAPER_TASKS) + ")",
    )
    include: str | None = setting(
        None,
        help="a task YAML file or a folder of them (a task of your own, e.g. on local data)",
        path=True,
    )
    limit: int | None = setting(
        None, help="at most N examples per task (default: all)", allowed=(Interval(int, 1), None)
    )
    num_fewshot: int = setting(
        0, help="examples in the prompt (0: zero-shot, as the papers)", allowed=Interval(int, 0)
    )
    batch_size: int = setting(
        16,
        help="sequences scored at once (1 for a model with an expert capacity or expert-choice routing, "
        "whose scores would depend on the batch)",
        allowed=Interval(int, 1),
    )
    seed: int = setting(
        0, help="seed of the harness's sampling (few-shot examples)", allowed=Interval(int, 0, 2**31 - 1)
    )


def _task_list(config: EvalConfig) -> list[str]:
    names = [t.strip() for t in config.tasks.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--tasks {config.tasks!r} names no task")
    return names


def _prepare(config: EvalConfig, folder: Path) -> dict[str, Any]:
    """Everything an evaluation needs, read and checked before the run directory opens (a refused
    evaluation leaves no folder behind): the model, its tokenizer and the task index."""
    # no hub here: datasets must be local or cached (set before datasets is imported, which reads it
    # once: a task that is neither fails at once, not after the hub client's retries)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    from ..io.model import load
    from .finetune import read_lm_run

    lm_config, tokenizer = read_lm_run(config.source)
    names = _task_list(config)
    manager = _task_manager(TaskManager, config.include, names, folder)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"--tasks: {unknown} are not lm-evaluation-harness tasks"
            + ("" if config.include else " (a task of your own: --include FILE.yaml)")
        )
    model = load(config.source)
    block = int(getattr(getattr(model, "cfg", None), "block_size", 0) or lm_config.block_size)
    return {"names": names, "manager": manager, "model": model, "tokenizer": tokenizer, "block": block}


def _task_manager(cls: Any, include: str | None, names: list[str], folder: Path) -> Any:
    """The harness's task index: the ``--include`` tasks alone when they are all that is asked
    (indexing the harness's own ~15k tasks takes half a minute), else both.  A single YAML file is
    read from a folder of its own (the harness indexes folders)."""
    if include is None:
        return cls()
    path = Path(include)
    if not path.exists():
        raise FileNotFoundError(f"--include {include!r} does not exist")
    if path.is_file():
        shutil.copy(path, folder / path.name)
        path = folder
    own = cls(include_path=str(path), include_defaults=False)
    if all(n in own.all_tasks for n in names):
        return own
    return cls(include_path=str(path))


def _offline(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the network or the hub cannot be reached."""
    names = ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "MaxRetryError",
             "ConnectTimeout", "NameResolutionError", "gaierror")  # fmt: skip
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, (ConnectionError, TimeoutError)) or any(
            c.__name__ in names for c in type(exc).__mro__
        ):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _evaluate(lm_eval: Any, config: EvalConfig, prepared: dict[str, Any]) -> dict[str, Any]:
    return lm_eval.simple_evaluate(
        model=harness_model(prepared["model"], prepared["tokenizer"], prepared["block"], config.batch_size),
        tasks=prepared["names"],
        num_fewshot=config.num_fewshot,
        limit=config.limit,
        task_manager=prepared["manager"],
        random_seed=config.seed,
        numpy_random_seed=config.seed,
        torch_random_seed=config.seed,
        fewshot_random_seed=config.seed,
        bootstrap_iters=1000,
        log_samples=False,
    )


def _execute(config: EvalConfig, run: runner.Run, prepared: dict[str, Any]) -> dict[str, Any]:
    import lm_eval

    try:
        results = _evaluate(lm_eval, config, prepared)
    except Exception as exc:
        if not _offline(exc):
            raise
        raise ValueError(
            f"--tasks {config.tasks!r}: the task's data cannot be fetched ({type(exc).__name__}); without "
            "network only tasks whose datasets are cached or local run (a task of your own: --include "
            "FILE.yaml)"
        ) from None
    # written once the evaluation is done: a failed one leaves nothing that blocks the retry
    run.write_config()
    scores: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        row = {}
        for key, value in values.items():
            if key == "alias" or not isinstance(value, (int, float)):
                continue
            metric = key.split(",")[0]  # "acc,none" → "acc"
            metric = "n" if metric == "sample_len" else metric
            row[metric] = float(value) if math.isfinite(float(value)) else None
        scores[task] = row
    lines = [f"{'task':<24} {'metric':<16} {'value':>10}"]
    for task, row in scores.items():
        for metric, value in row.items():
            if metric.endswith("_stderr") or metric == "n":
                continue
            stderr = row.get(f"{metric}_stderr")
            cell = "—" if value is None else f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")
            lines.append(f"{task:<24} {metric:<16} {cell:>10}")
    table = "\n".join(lines)
    atomic_write_text(run.path / "results.txt", table + "\n")
    print(table)
    return {"tasks": scores, "num_fewshot": config.num_fewshot, "limit": config.limit}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    vocab.add_arguments(parser, EvalConfig)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as folder:
        prepared: dict[str, Any] = {}

        def prepare(config: EvalConfig, world: int) -> None:
            prepared.update(_prepare(config, Path(folder)))

        command = runner.Command(
            "eval", EvalConfig, lambda config, run: _execute(config, run, prepared), prepare=prepare
        )
        runner.run_command(command, args)
    return 0
