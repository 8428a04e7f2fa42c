"""The page at `/`, driven in headless Chromium (Debian's package) by Playwright: the streamed answer is the
API's own, its tokens carry how they came, the figures fill in, compare runs target-only, keys work."""

from __future__ import annotations

import shutil

import httpx
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


@pytest.fixture(scope="module")
def close_engine(tiny_close_artifacts):
    """The llama pair whose draft is the target plus noise: accepted drafts, rejections and bonus tokens."""
    return Engine.load(tiny_close_artifacts["llama"], provider="cpu", threads=1), tiny_close_artifacts["llama"]


def _ask(page, prompt: str, status: str = "done") -> None:
    page.fill("textarea", prompt)
    page.press("textarea", "Enter")
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
        assert page.locator("textarea").count() == 1
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
