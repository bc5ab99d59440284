"""The OpenAPI description: docs/openapi.json is what the daemon serves, every route the
server registers is in it, and its request bodies are the models the routes validate
with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web
from jsonschema import Draft202012Validator

from turnkeeper.control import openapi
from turnkeeper.control.bodies import SubmitBody
from turnkeeper.control.routes import add_routes

DOC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_docs_openapi_json_is_the_description_the_daemon_serves() -> None:
    if not DOC.exists():
        pytest.skip("docs/openapi.json is not beside the package")
    assert DOC.read_text(encoding="utf-8") == openapi.text(), (
        "docs/openapi.json is stale: python -m turnkeeper.control.openapi > docs/openapi.json")


def test_every_route_the_server_registers_is_described() -> None:
    app = web.Application()
    add_routes(app)
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    described = {(m, p) for p, ops in openapi.document()["paths"].items() for m in ops}
    assert served == described


def test_the_description_is_openapi_3_1_with_valid_json_schemas() -> None:
    doc = openapi.document()
    assert doc["openapi"].startswith("3.1.")
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    refs = set(json.dumps(doc).split('"#/components/schemas/')[1:])
    assert {r.split('"')[0] for r in refs} <= set(doc["components"]["schemas"])
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"], (method, path)
            names = [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]
            assert names == (["id"] if "{id}" in path else []), (method, path)


def test_the_submit_body_is_the_schema_of_the_model_the_route_validates_with() -> None:
    described = openapi.document()["components"]["schemas"]["SubmitBody"]
    model = SubmitBody.model_json_schema(ref_template=openapi.REF)
    model.pop("$defs", None)
    assert described == model
    assert described["additionalProperties"] is False
    assert "idempotency_key" in described["properties"]
