"""Schemathesis against treadle's own /openapi.json: every route, generated bodies and headers
(valid and invalid ones, and the same bodies with one string made of lone surrogates or control
characters: tests/support/schemathesis_hooks.py), with an API key set and with none. No 5xx, and
every response's status, content type, headers and body conform to the document; the server is
alive at the end.

The server runs a tiny random model (tests/support/fuzz_model_files.py's seed) with a 64-token context,
so that a generated request that does get through costs milliseconds; requests go one at a time,
so the waiting queue never nears its 503 limit.
"""

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.support import paths
from tests.support.fuzz_model_files import write_seed_hf
from tests.support.server_process import ServerProcess

EXAMPLES = 25  # per API operation and phase (examples, coverage, fuzzing)
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance"
)
KEY = "fuzz-key"
# the rerank routes reach their replies too: the tiny model reranks (its vocabulary's single letters as yes / no)
RERANK_CONFIG = {"template": "{instruction}|{query}|{doc}|", "instruction": "match?", "yes_token": "y", "no_token": "n"}
REPO = paths.REPO


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    write_seed_hf(folder)
    return folder


def schemathesis(url: str, *args: str, workdir) -> subprocess.CompletedProcess:
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", url + "/openapi.json",
        "--checks", CHECKS, "--max-examples", str(EXAMPLES), "--workers", "1", "--phases", "examples,coverage,fuzzing",
        "--generation-database", "none", "--seed", "1", "--no-color", "--request-timeout", "60",
        "--suppress-health-check", "all", *args,
    ]  # fmt: skip
    # the bodies also with one string made of lone surrogates, control characters, noncharacters
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900, env=env)


def test_every_route_conforms_to_the_openapi_document_under_generated_requests(tiny_model, tmp_path):
    """Fuzzed with the key (a server without --api-key answers the same bodies the same way: the key
    is checked before any route runs), then the same routes without it: each a documented 401."""
    server = ServerProcess(
        tiny_model, "--max-model-len", "64", "--served-model-name", "tiny", "--api-key", KEY,
        "--rerank-config", json.dumps(RERANK_CONFIG),
    )  # fmt: skip
    try:
        server.wait_healthy()
        run = schemathesis(server.url, "-H", f"Authorization: Bearer {KEY}", workdir=tmp_path)
        summary = run.stdout[run.stdout.rfind("SUMMARY") :]
        assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-2000:]
        assert "generated" in summary and "API Operations" in summary
        assert schemathesis(server.url, "--phases", "fuzzing", "--max-examples", "3", workdir=tmp_path).returncode == 0
        assert server.proc.poll() is None and httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert "Traceback" not in server.output()
    finally:
        server.stop()


def test_the_document_names_every_reply_and_every_stream():
    """Every 2xx JSON reply references a named component schema; the streamed routes declare their
    stream's media type; request validation errors are documented as the 400s they are, not 422."""
    from treadle.server.app import ServerSettings, build_app

    class Engine:  # build_app reads no more than this before the server starts
        ready, state, reason = True, "ready", None

    spec = build_app(Engine(), ServerSettings(served_model_name="m", model_root=".")).openapi()
    streams = {}
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            ok = op["responses"]["200"]["content"]
            if "application/json" in ok:
                ref = ok["application/json"]["schema"]["$ref"]
                assert ref.split("/")[-1] in spec["components"]["schemas"], (method, path)
            streams[(method, path)] = sorted(set(ok) - {"application/json"})
            assert "422" not in op["responses"] and ("400" in op["responses"] or "requestBody" not in op), (
                method,
                path,
            )
    assert streams[("post", "/v1/chat/completions")] == ["text/event-stream"]
    assert streams[("post", "/v1/messages")] == ["text/event-stream"]
    assert streams[("post", "/api/chat")] == ["application/x-ndjson"]
    assert streams[("get", "/metrics")] == ["text/plain"]
    assert len(streams) == 35  # 33, and the timelines: GET /v1/requests, GET /v1/requests/{id}/timeline


def test_what_a_route_answers_is_read_from_the_app_s_routes_and_none_may_go_undeclared():
    """openapi.py documents the routes the app has (routers included), each from its handler's
    @replies; a route added without one fails the document instead of going out undescribed."""
    from fastapi import APIRouter

    from treadle.server.app import ROUTERS, ServerSettings, build_app
    from treadle.server.openapi import api_routes, documented_routes, openapi_document

    class Engine:
        ready, state, reason = True, "ready", None

    app = build_app(Engine(), ServerSettings(served_model_name="m", model_root="."))
    routed = {(r.path_format, m) for module in ROUTERS for r in module.router.routes for m in r.methods}
    documented = {(r.path_format, m) for r, m in documented_routes(app)}
    assert documented == {(p, m) for p, m in routed if (p, m) != ("/", "GET")}  # the web chat's page: not in it
    assert len(api_routes(app.routes)) == sum(len(module.router.routes) for module in ROUTERS)

    extra = APIRouter()

    @extra.get("/undeclared")
    async def undeclared():
        return {}

    app.include_router(extra)
    with pytest.raises(TypeError, match=r"/undeclared: its handler .*undeclared has no @replies"):
        openapi_document(app)
