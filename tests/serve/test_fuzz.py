"""The API fuzzed from its own OpenAPI document (schemathesis): no 5xx, and the server alive after."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from specdec.serve import protocol  # noqa: E402
from tests.serve.conftest import live_server  # noqa: E402

SCHEMA = schemathesis.openapi.from_dict(protocol.openapi_schema())
SCHEMA.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
CASES_PER_BODY_ROUTE = 260  # two body routes: 520+ cases, most of them bodies the routes must refuse
calls: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzzed_server(serve_engine, serve_artifact):
    # Batching on, short answers: the fuzz is about input handling, not about generating long texts.
    with live_server(serve_engine, serve_artifact, max_batch=4, max_queue=64, max_tokens_default=8) as server:
        yield server


@SCHEMA.parametrize()
@settings(max_examples=CASES_PER_BODY_ROUTE, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error(case, fuzzed_server):
    response = case.call(base_url=fuzzed_server.url, timeout=60)
    calls[case.operation.label] = calls.get(case.operation.label, 0) + 1
    assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:300])


def test_the_fuzz_ran_its_cases_and_the_server_still_answers(fuzzed_server):
    body_routes = sum(count for label, count in calls.items() if label.startswith("POST"))
    assert body_routes >= 500, calls
    answer = httpx.post(fuzzed_server.url + "/v1/completions", timeout=60,
                        json={"prompt": "Hello world", "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200
    assert fuzzed_server.state.admission.running == 0 and fuzzed_server.state.admission.waiting == 0
