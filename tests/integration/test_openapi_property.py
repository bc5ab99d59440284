"""A property run against the real daemon from its own OpenAPI description: every route
that takes a body, sent bodies built from the described schema (its fields with values
of any JSON type, unknown fields, wrong shapes). Whatever comes, the daemon answers no
5xx, every 4xx is JSON with an `error` (a 400 naming the `field`), and nothing it takes
(2xx) breaks the schema it describes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from tests.integration.harness import ECHO_TOOL, Daemon, script_file, scripted_provider

SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
reply = "ok"
"""

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("openapi")
    d = Daemon(tmp, scripted_provider(script_file(tmp / "script.toml", SCRIPT)) + ECHO_TOOL
               + '\n[budget.profiles.quick]\nmax_steps = 3\n')
    d.start()
    try:
        yield d
    finally:
        d.kill()


def _schema(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return {**doc["components"]["schemas"][name], "components": doc["components"]}


def _plausible(prop: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of the property's own type more often than not, anything else too."""
    types = [t.get("type") for t in prop.get("anyOf", [prop])]
    own: list[st.SearchStrategy[Any]] = []
    if "string" in types:
        own.append(st.sampled_from(["x", "hello", "s-1", "quick", "scripted", "7d", "0",
                                    "2030-01-01T00:00:00Z", "", "a" * 300]))
    if "integer" in types:
        own.append(st.integers(-3, 2**31))
    if "number" in types:
        own.append(st.floats(-1e3, 4e9, allow_nan=False))
    if "boolean" in types:
        own.append(st.booleans())
    if "enum" in prop:
        own.append(st.sampled_from(prop["enum"]))
    if "$ref" in prop or any("$ref" in t for t in prop.get("anyOf", [])):
        own.append(st.fixed_dictionaries({}, optional={
            "max_steps": st.integers(-1, 50), "max_tokens": JSON,
            "max_cost_usd": st.floats(0, 10)}))
    return st.one_of(*own, JSON) if own else JSON


def bodies(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    props = schema.get("properties", {})
    required = {name: _plausible(props[name]) for name in schema.get("required", [])}
    optional = {name: _plausible(p) for name, p in props.items() if name not in required}
    shaped = st.fixed_dictionaries(required, optional={**optional, "bogus": JSON})
    return st.one_of(shaped, shaped, shaped, JSON)


def check(d: Daemon, method: str, path: str, body: Any, schema: dict[str, Any]) -> None:
    status, answer = d.client.request(method, path, body)
    assert status < 500, (path, body, status, answer)
    if 400 <= status < 500:
        assert isinstance(answer, dict) and isinstance(answer.get("error"), str), answer
        if status == 400:
            assert answer.get("field"), (path, body, answer)
    if 200 <= status < 300 and body is not None:  # no body: an optional one left out
        items = body if isinstance(body, list) else [body]
        for item in items:
            Draft202012Validator(schema).validate(item)


def doc_of(d: Daemon) -> dict[str, Any]:
    status, doc = d.client.request("GET", "/v1/openapi.json")
    assert status == 200
    return doc  # type: ignore[no-any-return]


SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def test_submits_built_from_the_description_never_5xx_and_nothing_forbidden_is_taken(
        daemon: Daemon) -> None:
    schema = _schema(doc_of(daemon), "SubmitBody")

    @SETTINGS
    @given(st.one_of(bodies(schema), st.lists(bodies(schema), min_size=1, max_size=3)))
    def run(body: Any) -> None:
        check(daemon, "POST", "/v1/turns", body, schema)

    run()


@pytest.mark.parametrize(("path", "name"), [
    ("/v1/turns/{id}/messages", "MessageBody"), ("/v1/turns/{id}/cancel", "CancelBody"),
    ("/v1/intake", "IntakeBody"), ("/v1/prune", "PruneBody")])
def test_every_other_body_built_from_the_description_never_5xx(
        daemon: Daemon, path: str, name: str) -> None:
    doc = doc_of(daemon)
    assert path in doc["paths"]
    schema = _schema(doc, name)
    request = doc["paths"][path]["post"]["requestBody"]
    turn = daemon.submit("target")["id"]

    @SETTINGS
    @given(bodies(schema), st.sampled_from([turn, "t_0000000000000000"]))
    def run(body: Any, turn_id: str) -> None:
        if body is None and request["required"]:
            return  # a required body left out: a 400, checked by the routes' own tests
        check(daemon, "POST", path.replace("{id}", turn_id), body, schema)

    run()
    daemon.post("/v1/intake", {"open": True})


def test_query_parameters_from_the_description_never_5xx(daemon: Daemon) -> None:
    doc = doc_of(daemon)
    queries = [(path, p["name"]) for path, ops in doc["paths"].items()
               for op in [ops.get("get", {})] for p in op.get("parameters", [])
               if p["in"] == "query" and not path.endswith("events")]
    assert queries

    @SETTINGS
    @given(st.sampled_from(queries),
           st.one_of(st.text(max_size=12), st.integers().map(str),
                     st.floats(allow_nan=True).map(str)))
    def run(where: tuple[str, str], value: str) -> None:
        from urllib.parse import quote

        path, name = where
        target = path.replace("{id}", "t_0000000000000000") + f"?{name}={quote(value)}"
        status, answer = daemon.client.request("GET", target)
        assert status < 500, (target, status, answer)
        if status == 400:
            assert answer.get("field") == name, (target, answer)

    run()
