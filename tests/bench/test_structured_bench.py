"""The structured-output benchmark (specdec.benchmarks.structured_bench): its validity checks and report math by
hand, the shipped workload set, and a short run against a live server on the tiny artifact."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest
from click.testing import CliRunner

from specdec.benchmarks import structured_bench
from specdec.benchmarks.serve_load_client import Record, merge_tool_call_deltas
from specdec.benchmarks.structured_report import (StructuredCell, differing, edit_references, markdown, mask_cost,
                                                  prediction_totals, round_ratios, summarize_cell)
from specdec.benchmarks.structured_workloads import (STRUCTURED_FILE, WORKLOADS, StructuredItem, check_answer,
                                                     check_edit, check_json, check_tool_calls, load_items,
                                                     request_fields)
from specdec.models.errors import SpecdecError

pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "role": {"enum": ["admin", "guest"]}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def test_json_answers_parse_and_meet_their_schema():
    assert check_json('{"name": "Ann", "age": 40, "tags": ["a"], "role": "guest"}', SCHEMA) is None
    assert check_json('{"name": "Ann", "age": 4', SCHEMA).startswith("not JSON: ")
    assert check_json("", SCHEMA).startswith("not JSON: ")
    assert check_json('{"name": "Ann"}', SCHEMA) == "schema: 'age' is a required property"
    assert check_json('{"name": "Ann", "age": 4.5}', SCHEMA) == "schema: 4.5 is not of type 'integer' (at age)"
    assert check_json('{"name": "Ann", "age": 4, "role": "root"}', SCHEMA) == (
        "schema: 'root' is not one of ['admin', 'guest'] (at role)")
    assert check_json('{"name": "Ann", "age": 4, "tags": [1]}', SCHEMA) == (
        "schema: 1 is not of type 'string' (at tags/0)")
    assert check_json('{"name": "Ann", "age": 4, "x": 1}', SCHEMA).startswith("schema: Additional properties")


def test_tool_calls_name_a_tool_and_their_arguments_meet_its_parameters():
    tools = [WEATHER, TIME]
    assert check_tool_calls([{"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}], tools) is None
    # OpenAI's message shape too, and several calls
    assert check_tool_calls([{"id": "c1", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
                             {"name": "get_weather", "arguments": '{"city": "Rome"}'}], tools) is None
    assert check_tool_calls([], tools) == "no tool call"
    assert check_tool_calls([{"name": "get_news", "arguments": "{}"}], tools) == (
        "call 0: 'get_news' is not one of the tools (get_weather, get_time)")
    assert check_tool_calls([{"name": "get_weather", "arguments": '{"city": "Oslo"'}], tools).startswith(
        "call 0 (get_weather) arguments: not JSON")
    assert check_tool_calls([{"name": "get_time", "arguments": '{"zone": "UTC"}'},
                             {"name": "get_weather", "arguments": '{"unit": "K"}'}], tools) == (
        "call 1 (get_weather) arguments: schema: 'city' is a required property")


def test_an_edit_is_valid_when_it_equals_the_target_only_text():
    assert check_edit("x = 1\n", "x = 1\n") is None
    assert check_edit("x = 2\n", "x = 1\n") == "differs from target-only at character 4 (6 vs 6 characters)"
    assert check_edit("x = 1", "x = 1\n") == "differs from target-only at character 5 (5 vs 6 characters)"
    assert check_edit("x", None) == "no target-only text of this request to compare with"
    edit = StructuredItem("e", "edit", "Make it 2.\n\nx = 1\n", prediction="x = 1\n")
    assert check_answer(edit, "x = 1\n", [], "x = 1\n") is None
    assert check_answer(StructuredItem("t", "tools", "?", tools=(TIME,)), "", [], None) == "no tool call"


def test_streamed_tool_call_deltas_merge_per_index():
    calls: list[dict] = []
    merge_tool_call_deltas(calls, [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"ci'}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}},
                                   {"index": 1, "id": "call_2", "function": {"name": "get_time", "arguments": ""}}])
    merge_tool_call_deltas(calls, [{"index": 1, "function": {"arguments": '{"zone": "UTC"}'}}])
    merge_tool_call_deltas(calls, [{"function": {"name": "f", "arguments": "{}"}}])  # no index: the next call
    assert calls == [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                     {"id": "call_2", "name": "get_time", "arguments": '{"zone": "UTC"}'},
                     {"id": None, "name": "f", "arguments": "{}"}]


def test_mask_cost_and_prediction_tokens_are_sums_over_requests():
    records = [Record("a", ok=True, stats={"mask_seconds": 0.02, "target_calls": 10, "total_seconds": 1.0}),
               Record("b", ok=True, stats={"mask_seconds": 0.04, "target_calls": 20, "total_seconds": 1.0}),
               Record("c", ok=True, stats={"target_calls": 5, "total_seconds": 9.0}),  # no mask: not counted
               Record("d", ok=False, stats={"mask_seconds": 9.0, "target_calls": 1, "total_seconds": 9.0})]
    ms, share = mask_cost(records)
    assert ms == pytest.approx(2.0) and share == pytest.approx(0.03)
    assert mask_cost(records[2:]) == (None, None)
    assert prediction_totals([Record("a", ok=True, prediction_tokens=(30, 4)), Record("b", ok=True),
                              Record("c", ok=True, prediction_tokens=(0, 7))]) == (30, 11)
    assert prediction_totals([Record("a", ok=True)]) is None


def _cell(drafter: str, clients: int, records: list[Record], tokens: list[int], seconds: list[float],
          workload: str = "extract", server: str = "specdec") -> StructuredCell:
    return StructuredCell(server, drafter, clients, records=records, seconds=sum(seconds), workload=workload,
                          round_tokens=tokens, round_seconds=seconds)


def test_ratios_pool_rounds_and_pair_them_round_by_round():
    spec = _cell("auto", 1, [Record("a", ok=True, tokens=190)], [100, 90], [2.0, 3.0])
    base = _cell("none", 1, [Record("a", ok=True, tokens=110)], [50, 60], [2.0, 3.0])
    assert round_ratios(spec, base) == pytest.approx([2.0, 1.5])
    assert round_ratios(spec, _cell("none", 1, [], [0, 60], [2.0, 3.0])) == pytest.approx([1.5])
    items = {"a": StructuredItem("a", "extract", "?", response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})}
    spec.records = [Record("a", ok=True, tokens=95, text='{"name": "A", "age": 1}', ttft=0.5),
                    Record("a", ok=True, tokens=95, text='{"name": "A"}', ttft=1.5, finish_reason="length"),
                    Record("a", ok=False, error="HTTP 500")]
    s = summarize_cell(spec, items, {}, base)
    assert (s["valid"], s["checked"], s["validity"], s["errors"], s["invalid_cut"]) == (1, 2, 0.5, 1, 1)
    assert s["first_invalid"] == "a: schema: 'age' is a required property"
    assert s["tokens_per_second"] == pytest.approx(190 / 5) and s["ttft_p50"] == pytest.approx(1.0)
    assert s["vs_target_only"] == pytest.approx(190 / 110) and s["round_ratio_median"] == pytest.approx(1.75)
    assert summarize_cell(base, items, {}, base)["vs_target_only"] is None  # the base is not compared with itself
    report = markdown([s], {"setup": "S", "cpu": "C", "threads": 2, "command": "cmd", "equal_texts": "yes"})
    assert "| specdec | 1 | speculation | 2 (1 failed) | 50% (1/2; 1 cut) | 38.0 | 1.73x (1.50-2.00) | 1.00 |" in report
    assert "First invalid answer: specdec, a: schema: 'age' is a required property" in report


def test_edit_references_come_from_target_only_with_the_fewest_clients():
    cells = [_cell("none", 4, [Record("a", ok=True, text="four"), Record("b", ok=True, text="b4")], [], [], "edit"),
             _cell("none", 1, [Record("a", ok=True, text="one"), Record("c", ok=False)], [], [], "edit"),
             _cell("auto", 1, [Record("b", ok=True, text="spec")], [], [], "edit"),
             _cell("none", 1, [Record("b", ok=True, text="other")], [], [], "edit", server="vllm")]
    assert edit_references(cells) == {"a": "one", "b": "b4"}
    tool = [Record("t", ok=True, tool_calls=[{"name": "f", "arguments": "{}"}])]
    other = [Record("t", ok=True, tool_calls=[{"name": "f", "arguments": '{"x": 1}'}])]
    assert differing([_cell("none", 1, tool, [], []), _cell("auto", 1, tool, [], [])]) == []
    assert differing([_cell("none", 1, tool, [], []), _cell("auto", 1, other, [], [])]) == ["t"]


def test_the_shipped_set_has_sixteen_items_per_workload_that_load():
    items = load_items(STRUCTURED_FILE)
    assert [sum(i.workload == w for i in items) for w in WORKLOADS] == [16, 16, 16]
    assert len({i.id for i in items}) == len(items)
    for item in items:
        if item.workload == "extract":
            schema = item.schema()
            assert 5 <= len(schema["properties"]) <= 8 and item.response_format["json_schema"]["strict"] is True
            assert schema["required"] == list(schema["properties"]) and schema["additionalProperties"] is False
        elif item.workload == "tools":
            assert 2 <= len(item.tools) <= 4 and item.tool_choice == "required"
        else:
            assert item.prompt.endswith(item.prediction) and len(item.prediction) > 500
            assert request_fields(item) == {"prediction": {"type": "content", "content": item.prediction}}
            assert request_fields(item, plain=True) == {}  # the anchors have no Predicted Outputs


def _unbounded(schema: dict, where: str = "") -> list[str]:
    """Return the paths of free strings without maxLength and arrays without maxItems in `schema`."""
    found = []
    if schema.get("type") == "string" and "enum" not in schema and "maxLength" not in schema:
        found.append(where)
    if schema.get("type") == "array":
        found += ([where] if "maxItems" not in schema else []) + _unbounded(schema["items"], where + "[]")
    for name, value in schema.get("properties", {}).items():
        found += _unbounded(value, f"{where}.{name}")
    return found


def test_every_schema_of_the_set_bounds_its_strings_and_arrays():
    # A small greedy model can loop inside a string or an array until max_tokens cuts the JSON; bounds let the
    # grammar close it, as production extraction schemas do, so validity measures the grammar, not the loop.
    for item in load_items(STRUCTURED_FILE):
        schemas = [item.schema()] if item.workload == "extract" else [t["function"]["parameters"] for t in item.tools]
        for schema in schemas:
            assert _unbounded(schema or {}) == [], item.id
    assert _unbounded({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}) == [
        ".a", ".a[]"]


def test_a_bad_workload_line_is_named(tmp_path):
    data = tmp_path / "w.jsonl"
    data.write_text('{"id": "a", "workload": "edit", "instruction": "x", "original": "y"}\n{"id": "b"}\n')
    with pytest.raises(SpecdecError, match=r"w.jsonl:2: 'workload'"):
        load_items(data)
    data.write_text('{"id": "a", "workload": "poem", "prompt": "x"}\n')
    with pytest.raises(SpecdecError, match="unknown workload 'poem'"):
        load_items(data)


@pytest.mark.parametrize("flags, says", [
    (["--url", "http://127.0.0.1:1", "ARTIFACT"], "give ARTIFACT to start specdec serve, or --url"),
    ([], "give ARTIFACT to start specdec serve, or --url"),
    (["--url", "http://127.0.0.1:1", "--llama-server", "/bin/true"], "--llama-server needs --gguf"),
    (["--url", "http://127.0.0.1:1", "--vllm-python", "/bin/true"], "--vllm-python needs --hf-folder"),
    (["--url", "http://127.0.0.1:1", "--workloads", "poems"], "workloads are extract, tools, edit"),
    (["--url", "http://10.0.0.1:1"], "loopback"),
])
def test_bad_settings_get_one_line_before_any_server(tmp_path, flags, says):
    result = CliRunner().invoke(structured_bench.main, [*flags, "--output", str(tmp_path / "out")])
    assert result.exit_code != 0 and says in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()


# --- end to end, on the tiny artifact (512 positions: short items, short answers) ---

TINY_ITEMS = [
    {"id": "x1", "workload": "extract", "prompt": "Ann is 30. Extract name and age.",
     "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
         "type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["name", "age"], "additionalProperties": False}}}},
    {"id": "t1", "workload": "tools", "prompt": "Weather in Oslo?",
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
         "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
         "required": ["city", "unit"], "additionalProperties": False}}}], "tool_choice": "required"},
    {"id": "e1", "workload": "edit", "instruction": "Change 3 to 4.", "original": "limit = 3\nname = 'red fox'\n"},
]


@pytest.fixture(scope="module")
def live(tiny_artifacts, tmp_path_factory):
    """A live server on the tiny artifact and the tiny workload file; skipped when the server answers 400 to the
    structured fields (a build before structured outputs landed)."""
    httpx = pytest.importorskip("httpx")
    from specdec.runtime import Engine
    from tests.serve.conftest import MODEL, live_server

    data = tmp_path_factory.mktemp("structured-data") / "tiny.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in TINY_ITEMS) + "\n")
    artifact = tiny_artifacts["llama"]
    engine = Engine.load(artifact, provider="cpu", threads=1)
    with live_server(engine, artifact, max_concurrency=1, max_queue=8) as server:
        for row in TINY_ITEMS[:2]:
            fields = {k: row[k] for k in ("response_format", "tools", "tool_choice") if k in row}
            probe = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
            if probe.status_code == 400:
                pytest.skip(f"the server refuses {', '.join(fields)} (structured outputs not landed): "
                            f"{probe.text[:200]}")
        yield server, data, MODEL


@pytest.fixture(scope="module")
def tiny_run(live, tmp_path_factory):
    """Run the benchmark once against the live server; return (report JSON, output folder)."""
    server, data, model = live
    out = tmp_path_factory.mktemp("structured") / "out"
    result = CliRunner().invoke(structured_bench.main, [
        "--url", server.url, "--model", model, "--data", str(data), "--clients", "1", "--requests", "2",
        "--rounds", "1", "--max-tokens", "64", "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def test_a_short_run_against_the_live_server(tiny_run):
    report, out = tiny_run
    summaries = report["summaries"]
    assert [(s["workload"], s["drafter"]) for s in summaries] == [(w, d) for w in WORKLOADS for d in ("none", "auto")]
    for s in summaries:
        assert s["requests"] == 2 and s["errors"] == 0 and s["checked"] == 2 and s["tokens"] > 0, s
        assert 0 < s["ttft_p50"] <= s["ttft_p90"] and s["tokens_per_second"] > 0
        assert (s["vs_target_only"] is None) == (s["drafter"] == "none")
    by = {(s["workload"], s["drafter"]): s for s in summaries}
    # greedy: speculation changes no answer, so every edit equals target-only's and required calls validate
    assert report["setup"]["equal_texts"] == "yes"
    assert by[("edit", "auto")]["valid"] == by[("edit", "none")]["valid"] == 2
    assert by[("tools", "none")]["valid"] == by[("tools", "auto")]["valid"] == 2
    for decoding in ("none", "auto"):  # every edit request sent its prediction, so usage counts its tokens
        assert by[("edit", decoding)]["accepted_prediction_tokens"] is not None
    # speculation drafted the prediction and the target verified it (the tiny model's answer copies none of it)
    assert by[("edit", "auto")]["accepted_prediction_tokens"] + by[("edit", "auto")]["rejected_prediction_tokens"] > 0
    saved = json.loads((out / "structured.json").read_text())
    assert sum(len(c["records"]) for c in saved["cells"]) == 12
    tool_records = [r for c in saved["cells"] if c["workload"] == "tools" for r in c["records"]]
    assert all(r["finish_reason"] == "tool_calls" and r["tool_calls"][0]["name"] == "get_weather"
               for r in tool_records)
    text = (out / "structured.md").read_text()
    assert "## edit" in text and "| specdec | 1 | speculation | 2 | 100% (2/2) |" in text
    assert (out / "structured.png").stat().st_size > 0


def test_the_live_run_reports_the_grammars_mask_cost(tiny_run):
    report, out = tiny_run
    saved = json.loads((out / "structured.json").read_text())
    stats = [r["stats"] for c in saved["cells"] if c["workload"] == "extract" for r in c["records"]]
    if not any("mask_seconds" in s for s in stats):
        pytest.skip("the server's specdec stats carry no mask_seconds yet")
    for s in report["summaries"]:
        if s["workload"] in ("extract", "tools"):
            assert s["mask_ms_per_target_call"] > 0 and 0 < s["mask_share"] < 1, s


# A stand-in llama-server: answers /health, logs each request's argv and body, streams a fixed answer (a valid tool
# call when the request has tools, else the JSON {"name": "Ann", "age": 30} in two pieces) and closes.
FAKE_ANCHOR = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(LOG, "a") as log:
            log.write(json.dumps({"argv": sys.argv[1:], "body": body}) + "\\n")
        if body.get("tools"):
            call = {"index": 0, "id": "c0", "type": "function", "function": {
                "name": body["tools"][0]["function"]["name"], "arguments": '{"city": "Oslo", "unit": "C"}'}}
            deltas, finish = [{"tool_calls": [call]}], "tool_calls"
        else:
            deltas, finish = [{"content": '{"name": "Ann",'}, {"content": ' "age": 30}'}], "stop"
        events = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                   {"choices": [], "usage": {"completion_tokens": 5, "prompt_tokens": 9}}]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events:
            self.wfile.write(("data: " + json.dumps(event) + "\\n\\n").encode())
        self.wfile.write(b"data: [DONE]\\n\\n")

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_an_anchor_is_started_at_the_same_threads_and_sent_only_openais_fields(live, tmp_path):
    import sys

    server, data, model = live
    log = tmp_path / "requests.jsonl"
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{FAKE_ANCHOR}")
    fake.chmod(0o755)
    result = CliRunner().invoke(structured_bench.main, [
        "--url", server.url, "--model", model, "--data", str(data), "--clients", "1", "--requests", "1",
        "--rounds", "1", "--max-tokens", "16", "--threads", "3", "--llama-server", str(fake), "--gguf", "m.gguf",
        "--output", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    argv = sent[0]["argv"]
    assert argv[argv.index("-t") + 1] == "3" and argv[argv.index("-m") + 1] == "m.gguf" and "--jinja" in argv
    assert "--no-cache-prompt" in argv  # rounds send the same prompts again: none may find them cached
    bodies = {row["body"]["messages"][0]["content"][:8]: row["body"] for row in sent}
    assert len(sent) == 6  # a warm-up and a measured request per workload
    for body in bodies.values():
        assert body["stream"] and body["temperature"] == 0 and body["model"] == model
        assert not {"drafter", "specdec_stats", "num_draft_tokens", "prediction"} & set(body), body
    assert bodies["Ann is 3"]["response_format"]["type"] == "json_schema"
    assert bodies["Weather "]["tool_choice"] == "required" and bodies["Weather "]["parallel_tool_calls"] is False
    summaries = {(s["server"], s["workload"]): s for s in json.loads(result.stdout)["summaries"]}
    anchor = [summaries[("llama-server", w)] for w in WORKLOADS]
    assert [(s["valid"], s["checked"], s["tokens"]) for s in anchor] == [(1, 1, 5), (1, 1, 5), (0, 1, 5)]
    assert all(s["vs_target_only"] is not None and s["mask_share"] is None for s in anchor)


def test_no_server_started_here_caches_prompts(monkeypatch):
    """Rounds send the same prompts again; a prefix cache served one decoding's rounds more of them than the
    other's (edits, 1 client: 2.79x against 2.63x uncached), so specdec and both anchors start without one."""
    started = []

    class FakeServer:
        def __init__(self, mode, artifact, generations, threads, flags):
            started.append(flags)

        def wait_ready(self):
            return "http://127.0.0.1:1"

        def stop(self):
            pass

    monkeypatch.setattr(structured_bench, "ServerProcess", FakeServer)
    with ExitStack() as stack:
        structured_bench._start_servers(stack, "artifact", None, 2, "4", None, None, None, None)
    assert "--no-prefix-cache" in started[0]
    anchors = structured_bench.anchor_commands(2, 4, "llama-server", "m.gguf", "/venv/bin/python", "hf")
    assert "--no-cache-prompt" in anchors["llama-server"][0] and "--no-enable-prefix-caching" in anchors["vllm"][0]
