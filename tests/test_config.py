"""The one ``KEY=VALUE`` rule shared by ``--opt``, ``--option`` and ``--sweep``
(:mod:`moelab.config`), and each flag's one-line error."""

from __future__ import annotations

import pytest

from moelab import cli
from moelab.config import Sweep, parse_key_values, parse_sweep, parse_value
from moelab.experiments import compare, lm


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
