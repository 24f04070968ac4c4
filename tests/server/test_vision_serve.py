"""Images through `treadle serve` (OpenAI chat `image_url` parts) on a tiny random Gemma 3 that sees:
the reply's tokens are transformers' greedy ones for the same prompt and picture, and every bad
image is a 400 naming its field, after which no KV block stays allocated and the server serves on."""

import base64
import io
import json
import time

import httpx
import pytest
from PIL import Image

from tests.conftest import KEY, MODEL
from tests.server.test_app import assert_error
from tests.support.server_process import ServerProcess
from tests.support.vision_models import picture, reference, save_gemma3_vlm

NUM_TOKENS = 8


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = save_gemma3_vlm(str(tmp_path_factory.mktemp("gemma3_vlm")))
    s = ServerProcess(
        folder[0], "--served-model-name", "vlm", "--max-model-len", "512", "--limit-mm-per-prompt", '{"image": 2}',
        "--max-image-pixels", "250000",
    )  # fmt: skip
    s.wait_healthy()
    yield s, folder
    s.stop()


def chat(server, content, **extra) -> httpx.Response:
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": NUM_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": True, **extra}  # fmt: skip
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def tokens_of(reply: dict) -> list[str]:
    return [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]


def test_a_chat_with_an_image_matches_transformers(vlm):
    server, folder = vlm
    a, b = picture(1), picture(2, size=(30, 90))
    content = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": data_url(b, "JPEG")}},
    ]
    r = chat(server, content)
    assert r.status_code == 200, r.text
    prompt = "<start_of_turn>user\nLook: <start_of_image> and <start_of_image><end_of_turn>\n<start_of_turn>model\n"
    jpeg = Image.open(io.BytesIO(base64.b64decode(data_url(b, "JPEG").split(",", 1)[1]))).convert("RGB")
    expected = reference(folder, NUM_TOKENS, prompt, [a, jpeg])
    tok = folder[2]
    assert tokens_of(r.json()) == [tok.decode([t], skip_special_tokens=False) for t in expected]
    stats = httpx.get(server.url + "/stats").json()
    assert stats["encoder_cache"]["mm_cache_misses"] >= 2


def wait_idle(server) -> dict:
    deadline = time.time() + 30
    while True:
        stats = httpx.get(server.url + "/stats").json()
        if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 or time.time() > deadline:
            return stats


BAD = [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}], "not an image"),
    ([{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}], "example.com"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "local"),
    ([{"type": "image_url", "image_url": {"url": "ftp://host/cat.png"}}], "ftp"),
]


@pytest.mark.parametrize(("content", "words"), BAD)
def test_a_bad_image_is_a_400_naming_its_part_and_nothing_leaks(vlm, content, words):
    server, _ = vlm
    r = chat(server, [{"type": "text", "text": "what is it"}, *content])
    assert_error(r, 400, "messages[0].content[1].image_url")
    assert words.lower() in r.json()["error"]["message"].lower()
    assert wait_idle(server)["kv_blocks_used"] == 0


def test_too_many_images_too_many_pixels_and_a_bomb_are_refused(vlm):
    server, _ = vlm
    part = {"type": "image_url", "image_url": {"url": data_url(picture(3))}}
    r = chat(server, [part, part, part])
    assert_error(r, 400, "messages[0].content[0].image_url")
    assert "--limit-mm-per-prompt" in r.json()["error"]["message"]
    big = Image.new("RGB", (600, 600), (10, 20, 30))  # 360,000 pixels > --max-image-pixels 250000
    r = chat(server, [{"type": "image_url", "image_url": {"url": data_url(big)}}])
    assert_error(r, 400, "messages[0].content[0].image_url")
    assert "250000" in r.json()["error"]["message"]
    # a PNG whose header claims 100,000 x 100,000 pixels: refused from the header
    header = io.BytesIO()
    Image.new("L", (1, 1)).save(header, "PNG")
    raw = bytearray(header.getvalue())
    raw[16:24] = (100000).to_bytes(4, "big") * 2  # IHDR width and height (its CRC no longer matches)
    url = "data:image/png;base64," + base64.b64encode(bytes(raw)).decode()
    r = chat(server, [{"type": "image_url", "image_url": {"url": url}}])
    assert_error(r, 400, "messages[0].content[0].image_url")
    assert wait_idle(server)["kv_blocks_used"] == 0
    assert chat(server, "still serving?").status_code == 200


def test_a_text_model_refuses_an_image_with_a_400(server):
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(picture(1))}}]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert_error(r, 400, "messages[0].content[1].image_url")
    assert "takes no images" in r.json()["error"]["message"]


def openai_text(server, content) -> str:
    r = chat(server, content)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def b64(img: Image.Image) -> str:
    return data_url(img).split(",", 1)[1]


def test_every_dialect_takes_images_as_openai_chat_does(vlm):
    """Anthropic image blocks, Ollama's images (chat and generate) and the Responses API's
    input_image give the reply OpenAI chat gives for the same content."""
    server, _ = vlm
    img = picture(4)
    expected = openai_text(
        server, [{"type": "text", "text": "Say "}, {"type": "image_url", "image_url": {"url": data_url(img)}}]
    )
    greedy = {"temperature": 0, "max_tokens": NUM_TOKENS}
    source = {"type": "base64", "media_type": "image/png", "data": b64(img)}
    body = {"model": "vlm", **greedy, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Say "}, {"type": "image", "source": source}]}]}  # fmt: skip
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == expected
    body = {"model": "vlm", "temperature": 0, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Say "}, {"type": "input_image", "image_url": data_url(img)}]}]}  # fmt: skip
    r = httpx.post(server.url + "/v1/responses", json={**body, "max_output_tokens": NUM_TOKENS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == expected
    # Ollama puts a message's images before its text
    first = openai_text(
        server, [{"type": "image_url", "image_url": {"url": data_url(img)}}, {"type": "text", "text": "Say"}]
    )
    options = {"temperature": 0, "num_predict": NUM_TOKENS}
    body = {"model": "vlm", "stream": False, "options": options,
            "messages": [{"role": "user", "content": "Say", "images": [b64(img)]}]}  # fmt: skip
    r = httpx.post(server.url + "/api/chat", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == first
    body = {"model": "vlm", "stream": False, "options": options, "prompt": "Say", "images": [b64(img)]}
    r = httpx.post(server.url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["response"] == first


def test_a_dialect_s_bad_image_is_named_in_its_own_words(vlm):
    server, _ = vlm
    bad = {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}
    body = {"model": "vlm", "max_tokens": 2, "system": "be brief", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image", "source": bad}]}]}  # fmt: skip
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 400 and "messages[0].content[1].source" in r.text, r.text
    body = {"model": "vlm", "stream": False, "messages": [{"role": "user", "content": "hi", "images": ["bm90"]}]}
    r = httpx.post(server.url + "/api/chat", json=body)
    assert r.status_code == 400 and "messages[0].images[0]" in r.text, r.text
    body = {"model": "vlm", "stream": False, "prompt": "hi", "images": ["bm90"]}
    r = httpx.post(server.url + "/api/generate", json=body)
    assert r.status_code == 400 and r.json()["error"].startswith("images[0]: "), r.text
    body = {"model": "vlm", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:text/plain;base64,aGk="}]}]}  # fmt: skip
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 400 and "input[0].content[0].image_url" in r.text, r.text
    assert wait_idle(server)["kv_blocks_used"] == 0


def test_the_model_lists_say_it_sees(vlm, server):
    vision, _ = vlm
    card = httpx.get(vision.url + "/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]
    assert "vision" in httpx.post(vision.url + "/api/show", json={"model": "vlm"}).json()["capabilities"]
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/v1/models", headers=auth).json()["data"][0]["input_modalities"] == ["text"]
    show = httpx.post(server.url + "/api/show", json={"model": MODEL}, headers=auth).json()
    assert "vision" not in show["capabilities"]


def test_the_web_chat_sends_an_attached_image_and_shows_it(vlm, tmp_path):
    """The web chat's attach button appears for a model that sees: the chosen picture is shown in
    the conversation and sent with the message (the engine encodes it)."""
    from playwright.sync_api import sync_playwright

    from tests.server.test_webui import CHROMIUM, CHROMIUM_ARGS

    server, _ = vlm
    png = tmp_path / "dog.png"
    picture(21).save(png)
    misses = httpx.get(server.url + "/stats").json()["encoder_cache"]["mm_cache_misses"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        settings = {"system": "", "temperature": "0", "top_p": "1", "max_tokens": "4"}  # within --max-model-len
        page.add_init_script(f"localStorage.setItem('treadle.settings', {json.dumps(json.dumps(settings))})")
        page.goto(server.url + "/")
        page.wait_for_selector("#attach", state="visible")
        page.set_input_files("#attach-file", str(png))
        page.wait_for_selector("#attachments img")
        page.fill("#input", "What is in it?")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.user .images img")
        page.wait_for_selector(".msg.assistant .stats", timeout=60000)  # the reply ended
        assert page.locator("#attachments img").count() == 0  # sent with that message only
        browser.close()
    assert httpx.get(server.url + "/stats").json()["encoder_cache"]["mm_cache_misses"] == misses + 1


def test_a_text_model_s_web_chat_offers_no_attach_button(server):
    from playwright.sync_api import sync_playwright

    from tests.server.test_webui import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.add_init_script(f"localStorage.setItem('treadle.apiKey', {KEY!r})")
        page.goto(server.url + "/")
        page.wait_for_function(f"document.getElementById('model-name').textContent === {MODEL!r}")
        assert page.locator("#attach").is_hidden()
        browser.close()
