"""The one constraint vocabulary (:mod:`moelab.config`): a field declared once with its type and
constraint gives its flag, its ``--help`` and its validation; and every command of the CLI refuses
a value its declaration does not allow, in one line naming the flag, before doing any work; and the
one ``KEY=VALUE`` rule shared by ``--opt``, ``--option`` and ``--sweep``."""

from __future__ import annotations

import argparse
import math
import time
import types
import typing
from dataclasses import MISSING, dataclass

import pytest

from config_helpers import Toy
from moelab import cli
from moelab.config import (
    Interval,
    Options,
    Sweep,
    add_arguments,
    build,
    flag_of,
    given_values,
    leaf_fields,
    parse_key_values,
    parse_sweep,
    parse_value,
    plain,
    setting,
    setting_of,
    validate,
    values,
)
from moelab.experiments import compare, lm


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p, Toy)
    return p.parse_args(list(argv))


# ------------------------------------------------------------------------------ the vocabulary
def test_flags_come_from_the_fields_and_only_given_flags_are_set():
    args = _parse("--depth", "3", "--opt", "k=1", "--sizes", "4,5", "--steps", "7", "--quiet")
    given = given_values(args, Toy)
    assert given == {"layers": 3, "opts": {"k": 1}, "sizes": [4, 5], "inner.steps": 7, "quiet": True}
    config = validate(build(Toy, given))
    assert (config.layers, config.sizes, config.inner.steps, config.inner.lr) == (3, (4, 5), 7, 0.1)
    assert values(config)["inner.steps"] == 7 and plain(config)["inner"] == {"steps": 7, "lr": 0.1}
    assert flag_of(Toy, "layers") == "--depth" and flag_of(Toy, "inner.steps") == "--steps"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--name", "c"], "--name='c' is not allowed; expected one of ['a', 'b']"),
        (["--depth", "0"], "--depth=0 is not allowed; expected a positive integer"),
        (["--lr", "0"], "--lr=0.0 is not allowed; expected a number > 0"),
        (["--lr", "inf"], "--lr=inf is not allowed; expected a number > 0"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag_the_value_and_what_is_allowed(argv, message):
    with pytest.raises(ValueError) as info:
        validate(build(Toy, given_values(_parse(*argv), Toy)))
    assert str(info.value) == message


@dataclass
class LayerLike:
    """A plain dataclass, not a command (as the layer's ``MoEConfig`` will be), with a rule tying
    two fields together beside them."""

    num_experts: int = setting(8, help="experts", allowed=Interval(int, 1))
    top_k: int = setting(2, help="experts per token", allowed=Interval(int, 1))
    activation: str = setting("relu", help="expert activation", allowed=Options(("relu", "gelu")))
    jitter: float | None = setting(None, help="noise", allowed=(Interval(float, 0, 1), None))

    def check(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} is not allowed; expected at most num_experts={self.num_experts}"
            )


def test_a_plain_dataclass_validates_and_refuses_naming_the_field_the_value_and_what_is_allowed():
    assert validate(LayerLike(), names="arguments") == LayerLike()
    assert validate(LayerLike(jitter=1), names="arguments").jitter == 1.0  # an int given to a float field
    cases = [
        (LayerLike(top_k=0), "top_k=0 is not allowed; expected a positive integer"),
        (LayerLike(activation="tanh"), "activation='tanh' is not allowed; expected one of ['relu', 'gelu']"),
        (LayerLike(top_k="2"), "top_k='2' is not allowed; expected a positive integer"),
        (LayerLike(jitter=2.0), "jitter=2.0 is not allowed; expected a number in [0, 1]"),
        (LayerLike(top_k=9), "top_k=9 is not allowed; expected at most num_experts=8"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError) as info:
            validate(config, names="arguments")
        assert str(info.value) == message
    with pytest.raises(ValueError, match=r"^--top-k=0 is not allowed"):  # a command's spelling
        validate(LayerLike(top_k=0))


def test_interval_and_options_say_what_they_allow():
    assert str(Interval(int, 1)) == "a positive integer"
    assert str(Interval(float, 0, 1, closed="left")) == "a number in [0, 1)"
    assert str(Interval(float, 0, closed="neither")) == "a number > 0"
    assert not Interval(float, 0).allows(math.nan) and not Interval(int, 0).allows(True)
    assert not Interval(int, 0).allows(1.0) and Interval(float, 0).allows(1)
    assert Options(("a", 1)).allows(1) and not Options((1,)).allows(True)


# ------------------------------------------------------------------------------ every command
def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(argv prefix, parser, config class)`` of every (sub)command whose flags a config declares."""
    cls = parser.get_default("_config_class")
    if cls is not None:
        yield path, parser, cls
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _base(hint):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _read(base, text: str):
    """``text`` as the command line reads it for a field of type ``base`` (``None``: argparse refuses it)."""
    try:
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if set(typing.get_args(base)) == {int, str}:
            return int(text) if text.lstrip("-").isdigit() else text
    except ValueError:
        return None
    return text


def _allowed(constraint, value) -> bool:
    return isinstance(value, constraint) if isinstance(constraint, type) else constraint.allows(value)


def _invalid(hint, allowed: tuple) -> list[str]:
    """The command-line values the field's declaration refuses, derived from it: below an
    Interval's low bound, above its high one, a word outside Options, a wrong type.  Empty when
    every value the command line can give is allowed (a bool flag, a free string, a ``KEY=VALUE``
    mapping): such a field is skipped by this rule, not by a list."""
    base = _base(hint)
    origin = typing.get_origin(base) or base
    constraints = [c for c in allowed if c is not None]
    if base is bool or origin is dict or any(c in (str, dict, bool) for c in constraints):
        return []
    if origin in (tuple, list):
        item = (typing.get_args(base) or (str,))[0]
        return ["x"] if item in (int, float) else []
    candidates = []
    for c in constraints:
        if isinstance(c, Interval):
            left, right = c.closed in ("both", "left"), c.closed in ("both", "right")
            step = 1 if c.kind is int else 0.5
            if c.low is not None:
                candidates.append(c.low - step if left else c.low)
            if c.high is not None:
                candidates.append(c.high + step if right else c.high)
        elif isinstance(c, Options):
            words = [v for v in c.values if isinstance(v, str)]
            numbers = [v for v in c.values if isinstance(v, int) and not isinstance(v, bool)]
            candidates += ["no-such-" + "-".join(words)] if words else []
            candidates += [max(numbers) + 1] if numbers else []
    if base in (int, float) or set(typing.get_args(base)) == {int, str}:
        candidates.append("x")  # not a number: argparse's own refusal, or no constraint allows it
    if base is int or set(typing.get_args(base)) == {int, str}:
        candidates += ["1e20", "2.5"]  # beyond 64 bits (or the field's bound); not a whole number
    refused = []
    for candidate in candidates:
        text = str(int(candidate)) if isinstance(candidate, float) and base is int else str(candidate)
        value = _read(base, text)
        if value is None or not any(_allowed(c, value) for c in constraints or [base]):
            refused.append(text)
    return list(dict.fromkeys(refused))


def _valid(hint, allowed: tuple) -> str:
    """A value the declaration of a required field allows (the bad one is then the only one)."""
    for c in allowed:
        if isinstance(c, Options):
            return str(c.values[0])
        if isinstance(c, Interval):
            low = 1 if c.low is None else c.low
            return str(int(low) + (c.closed not in ("both", "left")) if c.kind is int else low + 0.5)
    return "1" if _base(hint) in (int, float) else "x"


def _cases():
    out = []
    for path, parser, cls in _commands(cli.build_parser()):
        dests = {a.dest: a for a in parser._actions}
        required = [
            (p, f, h) for p, f, h in leaf_fields(cls) if f.default is MISSING and f.default_factory is MISSING
        ]
        for p, f, hint in leaf_fields(cls):
            if p not in dests:  # set by the command itself: no flag
                continue
            others = [
                f"{flag_of(cls, q)}={_valid(h, setting_of(g).allowed)}" for q, g, h in required if q != p
            ]
            for bad in _invalid(hint, setting_of(f).allowed):
                flag = flag_of(cls, p)
                out.append(pytest.param(path, flag, bad, others, id=f"{' '.join(path)} {flag}={bad[:20]}"))
    return out


CASES = _cases()


#: the fields that count steps, epochs, iterations, rounds or runs: each must be able to finish
_COUNTS = {"steps", "epochs", "seeds", "runs", "replicates", "restarts", "reference_steps", "n_boot",
           "repeat_steps", "timing_rounds", "repeats"}  # fmt: skip


def test_every_count_a_command_takes_is_bounded_so_that_the_command_can_finish():
    from moelab.config import MAX_COUNT

    counted = []
    for path, parser, cls in _commands(cli.build_parser()):
        dests = {a.dest for a in parser._actions}
        for p, f, _ in leaf_fields(cls):
            if p.rsplit(".", 1)[-1] in _COUNTS and p in dests:
                bounds = [c.high for c in setting_of(f).allowed if isinstance(c, Interval)]
                assert bounds and all(b is not None and b <= MAX_COUNT for b in bounds), (path, p)
                counted.append((" ".join(path), p))
    assert ("train", "steps") in counted and ("specialize", "runs") in counted and len(counted) >= 12


def test_every_command_with_a_config_is_checked():
    commands = {" ".join(c.values[0]) for c in CASES}
    assert {
        "train",
        "compare",
        "benchmark",
        "finetune",
        "eval",
        "upcycle",
        "simulate",
        "specialize",
    } <= commands
    assert "bench suite" in commands and len(CASES) > 200


@pytest.mark.parametrize("command,flag,bad,others", CASES)
def test_every_command_refuses_a_value_its_declaration_does_not_allow_in_one_line(
    command, flag, bad, others, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # whatever a command would write lands here
    start = time.perf_counter()
    argv = [*command, f"{flag}={bad}", *others, "--out", str(tmp_path / "out")]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own refusal (a value that is not a number)
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and flag in err, (argv, err)
    assert not (tmp_path / "out").exists(), f"{argv}: refused after creating --out"
    assert time.perf_counter() - start < 5, f"{argv}: refused only after working"


# ------------------------------------------------------------------------------ KEY=VALUE


@pytest.mark.parametrize(
    "text,expected",
    [
        ("true", True),
        ("False", False),
        ("none", None),
        ("null", None),
        ("3", 3),
        ("-2", -2),
        ("+7", 7),
        ("0.1", 0.1),
        ("1e-3", 1e-3),
        (".5", 0.5),
        ("2.", 2.0),
        ("-1.5E2", -150.0),
        ("all", "all"),
        ("norm", "norm"),
        ('"1"', "1"),
        ("'true'", "true"),
        ('""', ""),
        ("a b", "a b"),
        ("inf", "inf"),
        ("[1,2]", "[1,2]"),
        ("  0.25  ", 0.25),
    ],
)
def test_parse_value_reads_bool_none_int_float_quoted_or_plain_text(text, expected):
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_parse_key_values_reads_each_item_and_the_last_key_wins():
    items = ["balance_coef=0", " omega = 0.5 ", "frozen=true", "k_max=all", "omega=0.25"]
    assert parse_key_values(items, "--opt") == {
        "balance_coef": 0,
        "omega": 0.25,
        "frozen": True,
        "k_max": "all",
    }
    assert parse_key_values(None, "--opt") == {} == parse_key_values([], "--option")


def test_parse_key_values_keeps_everything_after_the_first_equals_sign():
    assert parse_key_values(["mode=a=b"], "--opt") == {"mode": "a=b"}


@pytest.mark.parametrize(
    "item,message",
    [
        ("nonsense", "--opt 'nonsense' is not allowed; expected KEY=VALUE, e.g. --opt balance_coef=0"),
        ("=3", "--opt '=3' is not allowed; KEY '' must be a name of letters, digits and _"),
        ("1x=3", "--opt '1x=3' is not allowed; KEY '1x' must be a name of letters, digits and _"),
        ("a-b=3", "--opt 'a-b=3' is not allowed; KEY 'a-b' must be a name"),
        ("omega=", "--opt 'omega=' is not allowed; VALUE is empty (expected KEY=VALUE"),
        ("omega=  ", 'omega="" is the empty string'),
    ],
)
def test_parse_key_values_names_the_flag_the_item_and_the_form(item, message):
    with pytest.raises(ValueError) as info:
        parse_key_values([item], "--opt")
    assert message in str(info.value)


def test_parse_key_values_names_the_flag_it_is_given():
    with pytest.raises(ValueError, match=r"^--option 'x' is not allowed; expected KEY=VALUE, e.g. --option "):
        parse_key_values(["x"], "--option")


def test_parse_sweep_gives_typed_values_and_the_labels_as_written():
    assert parse_sweep("omega=0.01, 0.05,1e-3") == Sweep(
        "omega", [0.01, 0.05, 1e-3], ["0.01", "0.05", "1e-3"]
    )
    assert parse_sweep("mode=norm,'1'") == Sweep("mode", ["norm", "1"], ["norm", "'1'"])
    assert parse_sweep(None) is None and parse_sweep("") is None
    assert compare.parse_sweep is parse_sweep


@pytest.mark.parametrize(
    "text,message",
    [
        ("omega", "--sweep 'omega' is not allowed; expected KEY=V1,V2,..., e.g. --sweep omega=0.03,0.05"),
        ("omega=", "--sweep 'omega=' is not allowed; VALUE is empty (expected KEY=V1,V2,..."),
        ("omega=0.1,,0.3", "--sweep 'omega=0.1,,0.3' is not allowed; value 2 of the list is empty"),
        ("omega=0.1,", "value 2 of the list is empty"),
        ("2x=1,2", "KEY '2x' must be a name"),
        ("omega=0.1,0.10", "--sweep 'omega=0.1,0.10' is not allowed; value '0.10' is given twice"),
    ],
)
def test_parse_sweep_errors_name_the_flag_the_item_and_the_form(text, message):
    with pytest.raises(ValueError) as info:
        parse_sweep(text)
    assert message in str(info.value)


@pytest.mark.parametrize("value", ["../../escape", "a/b", "/tmp/x", "a\\b", "..", "x..y", "a\nb"])
def test_parse_sweep_refuses_values_that_would_leave_the_out_folder(value):
    with pytest.raises(ValueError) as info:
        parse_sweep(f"mode=norm,{value}")
    assert f"value {value!r} names a folder under --out, so it may not hold '/', '\\', '..'" in str(
        info.value
    )


def test_compare_sweep_with_a_path_writes_nothing_outside_out(tmp_path, capsys):
    out = tmp_path / "deep" / "out"
    argv = ["compare", "--methods", "smoe", "--out", str(out), "--sweep", "mode=../../escaped"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab compare: error: --sweep 'mode=../../escaped' is not allowed; value")
    assert err.count("\n") == 1
    assert list(tmp_path.rglob("*")) == []


def test_opt_values_reach_the_config_by_the_shared_rule():
    parser = cli.build_parser()
    args = parser.parse_args(
        ["train", "--out", "x", "--opt", "balance_coef=0", "--opt", "omega=1e-3", "--opt", "frozen=true"]
    )
    from moelab.experiments import runner

    given = runner.given_by_args(lm.TRAIN, args)
    assert given["opts"] == {"balance_coef": 0, "omega": 1e-3, "frozen": True}


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["train", "--opt", "nonsense"],
            "moelab train: error: --opt 'nonsense' is not allowed; expected KEY=VALUE",
        ),
        (
            ["compare", "--methods", "smoe", "--opt", "x"],
            "moelab compare: error: --opt 'x' is not allowed; expected KEY=VALUE",
        ),
        (
            ["compare", "--methods", "smoe", "--sweep", "omega"],
            "moelab compare: error: --sweep 'omega' is not allowed; expected KEY=V1,V2,...",
        ),
        (
            ["upcycle", "--model", "m", "--num-experts", "4", "--top-k", "2", "--option", "=1"],
            "moelab upcycle: error: --option '=1' is not allowed; KEY '' must be a name",
        ),
    ],
)
def test_each_key_value_flag_exits_2_with_one_line(tmp_path, capsys, argv, message):
    assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()
