"""The page at `/`, driven in headless Chromium (Debian's package) by Playwright: the streamed answer is the
API's own, its tokens carry how they came, the figures fill in, compare runs target-only, keys work; JSON-schema
mode answers JSON (a schema that is not JSON is flagged before sending, a 400 shows its message), a required
tool call shows as a call box, a prediction is sent and its token counts shown, logprobs show on hover."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import jsonschema
import pytest

from specdec.runtime import Engine
from tests.serve.conftest import live_server

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (make install adds Debian's chromium)")
# what a root sandbox with a closed network needs (../shared/ANCHORS.md)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
PROMPT = "one two three one two three one two"
# SPECDEC_PAGE_SCREENSHOT=docs/playground.png keeps the JSON-schema test's screenshot (what the docs show)
SCREENSHOT = os.environ.get("SPECDEC_PAGE_SCREENSHOT")


@pytest.fixture(scope="module")
def close_engine(tiny_close_artifacts):
    """The llama pair whose draft is the target plus noise: accepted drafts, rejections and bonus tokens."""
    return Engine.load(tiny_close_artifacts["llama"], provider="cpu", threads=1), tiny_close_artifacts["llama"]


@pytest.fixture(scope="module")
def page_server(close_engine):
    """A server without keys, shared by the tests of this round's fields."""
    engine, artifact = close_engine
    with live_server(engine, artifact, max_batch=2, kv_capacity=512) as server:  # the tools' system text is long
        yield server


@pytest.fixture
def page(page_server):
    """A fresh page on `page_server` (1000 px wide, what docs/playground.png shows); `page.sent` lists the
    bodies it posts to /v1/chat/completions."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1000, "height": 800})
        page.sent = []
        page.on("request", lambda r: page.sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
        page.goto(page_server.url + "/")
        yield page
        browser.close()


def _ask(page, prompt: str, status: str = "done") -> None:
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_function(f"['{status}', 'failed'].includes(document.getElementById('status').textContent)",
                           timeout=120_000)


def _set(page) -> None:
    page.select_option("#drafter", "model")
    page.fill("#k", "3")
    page.fill("#max_tokens", "48")


def test_the_page_streams_the_apis_answer_with_each_tokens_kind(close_engine, tmp_path):
    engine, artifact = close_engine
    with live_server(engine, artifact, max_batch=2, kv_capacity=256) as server, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.goto(server.url + "/")
        assert page.locator("textarea:visible").count() == 1  # the JSON boxes show only when asked for
        _set(page)
        _ask(page, PROMPT)
        assert page.text_content("#status") == "done", page.text_content("#error")
        answer = "#conversation .assistant span:not([data-kind=rejected])"
        text = page.eval_on_selector_all(answer, "els => els.map(e => e.textContent).join('')")
        kinds = page.eval_on_selector_all("#conversation .assistant span", "els => els.map(e => e.dataset.kind)")
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48, "temperature": 0,
                "drafter": "model", "num_draft_tokens": 3}
        expected = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert text == expected["choices"][0]["message"]["content"]
        assert {"accepted", "recovered", "bonus"} <= set(kinds) and "rejected" in kinds
        for figure in ("#tps", "#ttft", "#alpha", "#tpc"):
            assert page.text_content(figure) != "-", figure
        assert page.locator("#kplot rect").count() > 0
        page.click("#compare")
        page.wait_for_function("document.getElementById('status').textContent === 'compared'", timeout=120_000)
        assert page.text_content("#cmp_tps") != "-" and page.text_content("#cmp_alpha") == "-"
        page.click("#curl")
        assert "curl -sN" in page.text_content("#snippet") and '"drafter":"model"' in page.text_content("#snippet")
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        browser.close()


def test_the_page_asks_for_the_key_and_keeps_it_for_the_tab(close_engine):
    engine, artifact = close_engine
    with live_server(engine, artifact, max_batch=2, kv_capacity=256, api_keys=("s3cret",)) as server, \
            sync_api.sync_playwright() as p:
        assert httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 401
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.goto(server.url + "/")  # the page itself needs no key, and holds none
        assert "s3cret" not in page.content()
        assert not page.is_visible("#key")  # asked for only once the server answers 401
        _set(page)
        _ask(page, PROMPT, status="done")
        assert page.text_content("#status") == "failed" and "API key" in page.text_content("#error")
        assert page.is_visible("#key")
        page.fill("#key", "s3cret")
        page.click("#keysave")
        _ask(page, PROMPT)
        assert page.text_content("#status") == "done", page.text_content("#error")
        assert page.eval_on_selector_all("#conversation .assistant span", "els => els.length") > 0
        browser.close()


def _answer_text(page) -> str:
    return page.eval_on_selector_all("#conversation .assistant span:not([data-kind=rejected])",
                                     "els => els.map(e => e.textContent).join('')")


def test_json_schema_mode_flags_a_bad_schema_shows_a_400_and_answers_json(page, page_server):
    _set(page)
    page.fill("#max_tokens", "80")
    assert not page.is_visible("#schema")
    page.select_option("#format", "json_schema")
    schema = json.loads(page.input_value("#schema"))  # the prefilled example
    example = page.input_value("#schema")
    page.fill("#schema", "{not json")
    _ask(page, PROMPT, status="not sent")
    assert page.text_content("#status") == "not sent" and "schema box is not JSON" in page.text_content("#error")
    assert "invalid" in page.get_attribute("#schema", "class") and page.sent == []
    assert page.locator("#conversation .turn").count() == 0
    assert page.input_value("#prompt") == PROMPT  # kept, to send again
    page.fill("#schema", "[]")  # JSON, but the server's to refuse
    _ask(page, PROMPT)
    assert page.text_content("#status") == "failed"
    assert page.text_content("#error").startswith("400") and "json_schema" in page.text_content("#error")
    assert page.locator("#conversation .turn").count() == 0 and page.input_value("#prompt") == PROMPT
    page.fill("#schema", example)
    _ask(page, PROMPT)
    assert page.text_content("#status") == "done", page.text_content("#error")
    text = _answer_text(page)
    jsonschema.validate(json.loads(text), schema)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 80, "temperature": 0,
            "drafter": "model", "num_draft_tokens": 3, "response_format": page.sent[-1]["response_format"]}
    expected = httpx.post(page_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert text == expected["choices"][0]["message"]["content"]
    if SCREENSHOT:
        page.screenshot(path=SCREENSHOT)
    page.click("#python")  # the snippet runs as it stands, with the openai client
    printed = subprocess.run([sys.executable, "-c", page.text_content("#snippet")], capture_output=True, text=True,
                             timeout=120)
    assert printed.returncode == 0 and printed.stdout == text, printed.stderr


def test_a_required_tool_call_shows_as_a_call_box_and_the_next_message_is_its_result(page):
    _set(page)
    page.fill("#max_tokens", "96")
    page.select_option("#tool_choice", "required")
    assert page.is_visible("#tools")
    _ask(page, "Weather in Paris?")
    assert page.text_content("#status") == "done", page.text_content("#error")
    sent = page.sent[-1]
    assert sent["tool_choice"] == "required" and sent["tools"][0]["function"]["name"] == "get_weather"
    assert page.locator("#conversation .assistant .call").count() == 1
    assert page.locator("#conversation .assistant span").count() == 0  # the call's JSON is not shown as text
    assert page.text_content(".call .name") == "get_weather"
    arguments = page.text_content(".call .arguments")
    assert "\n" in arguments and set(json.loads(arguments)) == {"city", "unit"}  # pretty-printed
    page.select_option("#tool_choice", "auto")
    page.fill("#max_tokens", "16")  # the tiny model has 512 positions
    _ask(page, "18 degrees, sunny")
    assert page.text_content("#status") == "done", page.text_content("#error")
    call, result = page.sent[-1]["messages"][-2:]
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "18 degrees, sunny"}


def test_a_prediction_is_sent_and_its_token_counts_shown_with_logprobs_on_hover(page, page_server):
    _set(page)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48, "temperature": 0}
    plain = httpx.post(page_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    predicted = plain["choices"][0]["message"]["content"]
    assert not page.is_visible("#prediction")
    page.check("#predict")
    page.fill("#prediction", predicted)
    page.check("#logprobs")
    _ask(page, PROMPT)
    assert page.text_content("#status") == "done", page.text_content("#error")
    assert page.sent[-1]["prediction"] == {"type": "content", "content": predicted}
    assert _answer_text(page) == predicted  # a prediction changes the drafts, never the answer
    accepted, rejected = (int(n) for n in page.text_content("#pred").split(" / "))
    assert accepted > 0 and rejected >= 0
    titles = page.eval_on_selector_all("#conversation .assistant span:not([data-kind=rejected])",
                                       "els => els.map(e => e.title)")
    assert titles and all(t.startswith("logprob -") or t.startswith("logprob 0") for t in titles), titles
    assert all("top: " in t for t in titles)
    page.uncheck("#predict")  # a prediction box that is closed sends none
    _ask(page, PROMPT)
    assert "prediction" not in page.sent[-1] and page.text_content("#pred") == "-"
