"""A plain schema checked without jsonschema: most tools' parameters use only a few
keywords (types, properties, required, string enums, bounds), and a call's arguments are
checked on every tool call. The test made here may only ever accept what jsonschema
accepts; anything it does not accept goes to jsonschema, which also words the error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Keywords that never reject an instance (annotations; `format` is not asserted: the
# validators are built without a format checker).
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment",
                          "$schema", "format", "deprecated", "readOnly", "writeOnly"})
_PLAIN_KEYWORDS = _ANNOTATIONS | {"type", "properties", "required",
                                  "additionalProperties", "items", "enum", "minLength",
                                  "maxLength", "minimum", "maximum"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# JSON Schema type -> a test that is True only for what the type certainly allows
# (`integer` also allows 2.0: such an instance goes to jsonschema instead).
_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: type(v) is int,
    "number": _is_number,
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def plain_check(schema: Any) -> Callable[[Any], bool] | None:
    """For a schema of the plain keywords only (types, properties, required,
    additionalProperties true or false, items, string enums, length and range bounds),
    a test that answers True only for an instance the schema accepts; False means "ask
    jsonschema", never "invalid". None for any other schema: jsonschema checks it all."""
    if schema is True or schema == {}:
        return lambda _v: True
    if not isinstance(schema, dict) or not set(schema) <= _PLAIN_KEYWORDS:
        return None
    tests: list[Callable[[Any], bool]] = []
    kind = schema.get("type")
    # An object's own type is tested by its object test (below), not by a test of its own.
    typed_object = False
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not kinds or any(k not in _TYPES for k in kinds):
            return None
        if kinds == ["object"]:
            typed_object = True
        elif len(kinds) == 1:
            tests.append(_TYPES[kinds[0]])
        else:
            of = tuple(_TYPES[k] for k in kinds)
            tests.append(lambda v: any(t(v) for t in of))
    if "enum" in schema:
        enum = schema["enum"]
        if not isinstance(enum, list) or not all(isinstance(e, str) for e in enum):
            return None
        allowed = frozenset(enum)
        tests.append(lambda v: isinstance(v, str) and v in allowed)
    for word, bound_test in _BOUNDS.items():
        if word in schema:
            made = bound_test(schema[word])
            if made is None:
                return None
            tests.append(made)
    if "items" in schema:
        item = plain_check(schema["items"])
        if item is None:
            return None
        tests.append(lambda v: not isinstance(v, list) or all(item(x) for x in v))
    object_test = _plain_object(schema, typed=typed_object)
    if object_test is None:
        return None
    if object_test is not _ANY:
        tests.append(object_test)
    if len(tests) == 1:
        return tests[0]
    if len(tests) == 2:  # the usual pair, without a generator
        first, second = tests
        return lambda v: first(v) and second(v)
    return lambda v: all(t(v) for t in tests)


def _ANY(_value: Any) -> bool:
    return True


def NEVER(_value: Any) -> bool:
    """The test of a schema that is not plain: every instance goes to jsonschema."""
    return False


def _min_length(n: Any) -> Callable[[Any], bool] | None:
    if type(n) is not int:
        return None
    return lambda v: not isinstance(v, str) or len(v) >= n


def _max_length(n: Any) -> Callable[[Any], bool] | None:
    if type(n) is not int:
        return None
    return lambda v: not isinstance(v, str) or len(v) <= n


def _minimum(n: Any) -> Callable[[Any], bool] | None:
    if not _is_number(n):
        return None
    return lambda v: not _is_number(v) or v >= n


def _maximum(n: Any) -> Callable[[Any], bool] | None:
    if not _is_number(n):
        return None
    return lambda v: not _is_number(v) or v <= n


# The bound keywords: each applies to one kind of instance and passes any other.
_BOUNDS: dict[str, Callable[[Any], Callable[[Any], bool] | None]] = {
    "minLength": _min_length, "maxLength": _max_length,
    "minimum": _minimum, "maximum": _maximum}


# The type tests that are an isinstance() alone: a property whose whole test is one of
# these is tested inline by its object's test.
_INSTANCE_OF: dict[Callable[[Any], bool], type] = {
    _TYPES["string"]: str, _TYPES["object"]: dict, _TYPES["array"]: list,
    _TYPES["boolean"]: bool}


def _plain_object(schema: dict[str, Any], *, typed: bool = False
                  ) -> Callable[[Any], bool] | None:
    """The object keywords of a plain schema (they apply only to an object); `typed`:
    the schema's type is "object", and the test tests that too."""
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    if (not isinstance(properties, dict) or not isinstance(required, list)
            or not all(isinstance(r, str) for r in required) or not isinstance(extra, bool)):
        return None
    # Each property's test: an isinstance() (`kinds`) or a function (`checks`).
    kinds: dict[str, type] = {}
    checks: dict[str, Callable[[Any], bool]] = {}
    for key, sub in properties.items():
        check = plain_check(sub)
        if check is None:
            return None
        kind = _INSTANCE_OF.get(check)
        if kind is not None:
            kinds[key] = kind
        else:
            checks[key] = check
    if not kinds and not checks and not required and extra is True:
        return _TYPES["object"] if typed else _ANY
    needed = tuple(required)
    closed = extra is False
    other = not typed  # what the test answers for an instance that is not an object

    def test(value: Any) -> bool:
        if not isinstance(value, dict):
            return other
        for key in needed:
            if key not in value:
                return False
        for key, item in value.items():
            kind = kinds.get(key)
            if kind is not None:
                if not isinstance(item, kind):
                    return False
                continue
            check = checks.get(key)
            if check is None:
                if closed:
                    return False
            elif not check(item):
                return False
        return True

    return test

