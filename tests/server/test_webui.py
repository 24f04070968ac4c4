"""The web chat in headless Chromium (Debian's /usr/bin/chromium through Playwright) against a real server."""

import json
import os
import time

import httpx
import pytest
from playwright.sync_api import sync_playwright

from tests.conftest import KEY, MODEL
from tests.support import paths

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = os.path.join(paths.REPO, "test-artifacts")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def stats(server):
    return httpx.get(server.url + "/stats", headers={"Authorization": f"Bearer {KEY}"}).json()


def test_chat_streams_stops_and_persists(server, browser):
    os.makedirs(ARTIFACTS, exist_ok=True)
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.goto(server.url + "/")
    # the server wants a key: the page opens its settings; the key is entered once and kept
    page.wait_for_selector("#set-api-key", state="visible")
    page.fill("#set-api-key", KEY)
    page.press("#set-api-key", "Tab")
    page.wait_for_function(f"document.getElementById('model-name').textContent === {json.dumps(MODEL)}")
    page.fill("#set-max-tokens", "3000")
    page.fill("#input", "Write a very long story about a dragon who learns to bake bread.")
    page.press("#input", "Enter")

    reply = page.locator(".msg.assistant .body").last
    lengths = set()
    deadline = time.time() + 60
    while len(lengths) < 3 and time.time() < deadline:
        lengths.add(len(reply.inner_text()))
        time.sleep(0.1)
    assert len(lengths) >= 3, "the reply did not stream"
    assert stats(server)["num_running"] == 1
    page.screenshot(path=os.path.join(ARTIFACTS, "webui-streaming.png"))

    page.click("#stop")
    deadline = time.time() + 15
    while time.time() < deadline:
        s = stats(server)
        if s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
            break
        time.sleep(0.1)
    s = stats(server)
    assert s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    page.wait_for_selector(".msg.assistant .stats")
    assert "stopped" in page.inner_text(".msg.assistant .stats")
    partial = reply.inner_text()
    assert partial

    page.reload()
    page.wait_for_selector(".msg.user")
    assert "dragon" in page.inner_text(".msg.user")
    assert page.inner_text(".msg.assistant .body") == partial
    assert page.locator("#conversations li").count() == 1
    assert not page.locator("#settings").is_visible()  # the stored key is used; no need to ask again
    page.click("#toggle-settings")
    assert page.locator("#settings").is_visible() and page.input_value("#set-max-tokens") == "3000"
    page.screenshot(path=os.path.join(ARTIFACTS, "webui.png"))

    page.click("#new-chat")
    assert page.locator("#conversations li").count() == 2
    page.locator("#conversations li.active .delete").click()
    assert page.locator("#conversations li").count() == 1
    page.close()


EVIL = (
    "Here is **bold** and `code`.\n\n"
    '<img src=x onerror="window.__xss = 1">\n'
    "<script>window.__xss = 2</script>\n"
    "[click](javascript:window.__xss=3)\n\n"
    "```python\nprint('<b>hi</b>')\n```\n"
)


def sse(content: str) -> str:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": content[:40]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": content[40:]}, "finish_reason": "stop"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": 30,
                "total_tokens": 35,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        },
    ]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_model_output_cannot_inject_html(server, browser):
    page = browser.new_page(viewport={"width": 390, "height": 760})  # a phone-sized window
    page.add_init_script(f"localStorage.setItem('treadle.apiKey', {json.dumps(KEY)})")
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse(EVIL)),
    )
    page.goto(server.url + "/")
    page.fill("#input", "say something nasty")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant .stats")
    body = page.locator(".msg.assistant .body")
    assert page.evaluate("window.__xss") is None
    assert body.locator("img, script").count() == 0
    assert body.locator("a").count() == 0  # javascript: links are not links
    text = body.inner_text()
    assert '<img src=x onerror="window.__xss = 1">' in text and "<script>" in text
    assert body.locator("strong").inner_text() == "bold"
    assert body.locator("pre code").inner_text() == "print('<b>hi</b>')"
    # narrow window: the conversation list is tucked away, the composer stays usable
    assert page.locator("#composer").is_visible()
    assert page.locator("#toggle-sidebar").is_visible()
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, "webui-phone.png"))
    page.close()


def test_the_engine_view_draws_recent_requests_and_a_click_shows_one(server, browser):
    """The engine panel's bars (GET /v1/requests): one row per finished request, its phases in their
    colours on one time axis; a click lists that request's phases (GET /v1/requests/{id}/timeline)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.add_init_script(f"localStorage.setItem('treadle.apiKey', {json.dumps(KEY)})")
    page.goto(server.url + "/")
    page.wait_for_selector("#st-timeline g rect.phase.decode")
    rows = page.locator("#st-timeline g")
    assert rows.count() >= 2
    assert page.locator("#st-timeline g").last.locator("rect.phase.prefill").count() >= 1
    colour = page.locator("#st-timeline rect.phase.decode").first.get_attribute("fill")
    assert colour == "#2f9e5a"
    rows.last.locator("rect.hit").click()
    page.wait_for_selector("#st-request table")
    details = page.locator("#st-request").inner_text()
    assert "queued" in details and "prefill" in details and "decode" in details
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, "webui-timelines.png"))
    page.close()
