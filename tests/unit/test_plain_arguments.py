"""Tool arguments against a plain schema are checked without jsonschema: that check may
only ever accept what jsonschema accepts (anything else goes to jsonschema, which also
words the error), and it must accept the ordinary valid call, or it saves nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from turnkeeper.config import build_config
from turnkeeper.tools.arguments import parse_arguments
from turnkeeper.tools.registry import ToolBox, plain_check

ECHO = {"type": "object", "properties": {"text": {"type": "string"}}}

# -- schemas of the plain keywords, and of some others --------------------------------

_types = st.sampled_from(["string", "integer", "number", "boolean", "object", "array",
                          "null"])


def _extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("array")}, optional={"items": inner}),
        st.fixed_dictionaries(
            {"type": st.just("object")},
            optional={"properties": st.dictionaries(st.sampled_from("abcd"), inner,
                                                    max_size=3),
                      "required": st.lists(st.sampled_from("abcd"), unique=True,
                                           max_size=3),
                      "additionalProperties": st.booleans(),
                      "description": st.text(max_size=5)}),
    )


_leaf_schema = st.one_of(
    st.fixed_dictionaries({}, optional={
        "type": st.one_of(_types, st.lists(_types, min_size=1, max_size=3, unique=True)),
        "minLength": st.integers(0, 3), "maxLength": st.integers(0, 3),
        "minimum": st.one_of(st.integers(-3, 3), st.floats(-3, 3)),
        "maximum": st.one_of(st.integers(-3, 3), st.floats(-3, 3)),
        "title": st.text(max_size=3), "format": st.just("uri")}),
    st.fixed_dictionaries({"enum": st.lists(st.sampled_from(["x", "y", "1"]), min_size=1,
                                            unique=True)}),
    st.just({"enum": [1, True]}),  # not plain: 1 == True in Python, not in JSON Schema
    st.just({"pattern": "^a"}),  # not plain
    st.just({"anyOf": [{"type": "string"}, {"type": "integer"}]}),  # not plain
    st.booleans(),
)
schemas = st.recursive(_leaf_schema, _extend, max_leaves=6)

values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-5, 5),
              st.sampled_from([2.0, 1.0, 0.0, float("nan")]), st.text(max_size=4),
              st.sampled_from(["x", "y", "1"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from("abcde"), inner, max_size=4)),
    max_leaves=8)


@settings(max_examples=400, deadline=None)
@given(schema=schemas, value=values)
def test_the_plain_check_accepts_only_what_jsonschema_accepts(schema: Any,
                                                              value: Any) -> None:
    check = plain_check(schema)
    if check is not None and check(value):
        assert Draft202012Validator(schema).is_valid(value), (schema, value)


LEAF_VALUES: list[Any] = [None, True, False, 0, 1, -1, 3, 2.0, 2.5, -0.5, float("nan"), "",
                         "x", "abcd", "1", [], [1], ["x"], {}, {"a": 1}]
LEAF_SCHEMAS: list[Any] = [
    *({"type": t} for t in ("string", "integer", "number", "boolean", "object", "array",
                            "null")),
    {"type": ["integer", "string"]}, {"type": ["number", "null"]},
    {"minLength": 1}, {"maxLength": 2}, {"type": "string", "minLength": 2, "maxLength": 3},
    {"minimum": 0}, {"maximum": 2}, {"minimum": 0.5, "maximum": 2.5},
    {"type": "integer", "minimum": 1}, {"enum": ["x", "1"]}, {"type": "string", "enum": ["x"]},
    {"items": {"type": "integer"}}, {"type": "array", "items": {"type": "string"}},
    {"type": "object", "required": ["a"]}, {"properties": {"a": {"type": "string"}}},
    {"type": "object", "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}},
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "boolean"},
                                      "c": {"type": "array"}, "d": {"type": "object"}}},
    {"properties": {"a": {"type": "boolean"}}, "required": ["a"]},
]


@pytest.mark.parametrize("schema", LEAF_SCHEMAS)
def test_each_plain_keyword_agrees_with_jsonschema(schema: Any) -> None:
    check = plain_check(schema)
    assert check is not None
    validator = Draft202012Validator(schema)
    wrong = [v for v in LEAF_VALUES if check(v) and not validator.is_valid(v)]
    assert wrong == []
    # And it is of use: it accepts most of what is valid (2.0 as an integer, NaN against
    # a bound go to jsonschema).
    valid = [v for v in LEAF_VALUES if validator.is_valid(v)]
    missed = [v for v in valid if not check(v)]
    assert len(missed) <= 2, missed


@pytest.mark.parametrize(("schema", "value"), [
    (ECHO, {"text": "step 1"}),
    ({"type": "object", "properties": {"q": {"type": "string", "minLength": 1},
                                       "n": {"type": "integer", "minimum": 1,
                                             "maximum": 50},
                                       "tags": {"type": "array",
                                                "items": {"type": "string"}},
                                       "mode": {"enum": ["fast", "full"]}},
      "required": ["q"], "additionalProperties": False},
     {"q": "weather", "n": 5, "tags": ["a"], "mode": "fast"}),
    ({"type": "object"}, {"anything": [1, {"x": None}]}),
])
def test_the_ordinary_valid_call_is_accepted_without_jsonschema(schema: dict[str, Any],
                                                                value: Any) -> None:
    check = plain_check(schema)
    assert check is not None and check(value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}},
    {"type": "object", "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"a": {"enum": [1, 2]}}},
])
def test_any_other_schema_is_left_to_jsonschema(schema: dict[str, Any]) -> None:
    assert plain_check(schema) is None


def _toolbox(parameters: dict[str, Any]) -> ToolBox:
    config = build_config({
        "providers": [{"name": "p", "kind": "scripted", "script": "/dev/null"}],
        "tools": [{"name": "t", "kind": "echo", "parameters": parameters}]})
    return ToolBox(config.tools)


def test_a_call_the_plain_check_does_not_accept_gets_the_jsonschema_error() -> None:
    box = _toolbox({"type": "object", "properties": {"n": {"type": "integer"}},
                    "required": ["n"], "additionalProperties": False})
    assert box.check_arguments("t", '{"n": 3}') == ({"n": 3}, None)
    assert box.check_arguments("t", '{"n": 3.0}') == ({"n": 3.0}, None)  # via jsonschema
    args, problem = box.check_arguments("t", '{"n": "3"}')
    assert args is None and problem is not None
    assert problem.failure.message == ("arguments of t violate its schema at n: "
                                       "'3' is not of type 'integer'")
    args, problem = box.check_arguments("t", '{"n": 1, "m": 2}')
    assert problem is not None and "Additional properties" in problem.failure.message


# -- the arguments' JSON, read as json reads it -----------------------------------------

_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
              st.sampled_from(["\ud800", "\udfff x", "\x00", "\u00e9", "\U0001f600"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=10)


def _as_json_reads(name: str, text: str) -> Any:
    """What `parse_arguments` answered when it read every text with json."""
    try:
        args = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        return ("not valid JSON", f"{exc.msg} at {exc.pos}")
    return args if isinstance(args, dict) else ("not an object",)


def _answer(name: str, text: str) -> Any:
    args, problem = parse_arguments(name, text)
    if args is not None:
        return args
    assert problem is not None
    message = problem.failure.message
    if "not valid JSON" in message:
        return ("not valid JSON", message.split("not valid JSON: ", 1)[1])
    return ("not an object",)


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types throughout (1 is not 1.0; NaN is NaN)."""
    return repr(a) == repr(b) and json.dumps(a, sort_keys=False) == json.dumps(b)


@settings(max_examples=600, deadline=None)
@given(value=_json_values, pad=st.sampled_from(["", " ", "\n", "\t ", "\ufeff"]),
       cut=st.integers(0, 40))
def test_arguments_read_as_json_reads_them(value: Any, pad: str, cut: int) -> None:
    text = json.dumps({"v": value, "n": value}, ensure_ascii=bool(cut % 2))
    for t in (text, pad + text + pad, text[:cut], text.replace(":", ": ", 1),
              text.replace("}", ",}", 1)):
        assert _same(_answer("t", t), _as_json_reads("t", t)), t


@pytest.mark.parametrize("text", [
    '{"n": 123456789012345678901234567890}', '{"n": -9223372036854775809}',
    '{"n": 18446744073709551615}', '{"n": NaN}', '{"n": -Infinity}', '{"n": 1e400}',
    '{"s": "\\ud800"}', '{"n": 0.1234567890123456789012}', '{"a": 1, "a": 2}', "[1]",
    '"x"', "", "  ", '{"a": 1', '{"a": 01}', '{"a": 1}x', '{"a": "\t"}', "\ufeff{}",
])
def test_the_numbers_and_texts_orjson_reads_otherwise_are_read_as_json_reads_them(
        text: str) -> None:
    assert _same(_answer("t", text), _as_json_reads("t", text))
