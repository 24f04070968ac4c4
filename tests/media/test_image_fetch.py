"""Fetching a request's image: data: URLs, files under the allowed folder only, http(s) from
allowed hosts only (redirects included), bodies cut at max_bytes. The http tests run a server on
the loopback interface and read its request log to see what reached it."""

import asyncio
import base64
import http.server
import os
import threading
import time

import pytest

from tests.media.pictures import drawn, encoded
from treadle.media import ImageFetcher, MediaError, decode_base64

PNG = encoded(drawn(40, 30, 0))
PARAM = "messages[0].content[1].image_url"


class Handler(http.server.BaseHTTPRequestHandler):
    log: list[str] = []

    def do_GET(self):
        Handler.log.append(self.path)
        host = f"localhost:{self.server.server_address[1]}"
        if self.path == "/image.png":
            self.reply(200, PNG)
        elif self.path == "/big":
            self.reply(200, b"\0" * 2_000_000)
        elif self.path == "/redirect-here":
            self.redirect("/image.png")
        elif self.path == "/redirect-away":
            self.redirect(f"http://{host}/image.png")  # the same server, by a name not allowed
        elif self.path.startswith("/loop"):
            self.redirect(self.path + "x")
        elif self.path == "/endless":  # no Content-Length: the body runs until the connection closes
            self.send_response(200)
            self.end_headers()
            self.write_for(seconds=10, chunk=b"\0" * 65536, pause=0)
        elif self.path == "/drip":
            self.send_response(200)
            self.end_headers()
            self.write_for(seconds=3, chunk=b"\0", pause=0.05)
        else:
            self.reply(404, b"no such image")

    def reply(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def write_for(self, seconds, chunk, pause):
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                self.wfile.write(chunk)
                self.wfile.flush()
                time.sleep(pause)
        except OSError:  # the client stopped reading: what it should do
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    Handler.log.clear()


def loopback_fetcher(**options) -> ImageFetcher:
    return ImageFetcher(allowed_domains=["127.0.0.1"], **{"max_bytes": 1_000_000, "timeout": 5, **options})


def test_a_data_url_gives_its_bytes():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert ImageFetcher().fetch(url, PARAM) == PNG
    text = base64.b64encode(PNG).decode()
    wrapped = "\r\n".join(text[i : i + 76] for i in range(0, len(text), 76))  # MIME's line length
    assert ImageFetcher().fetch("data:image/PNG;base64," + wrapped, PARAM) == PNG
    assert ImageFetcher().fetch("data:image/png;base64," + text.rstrip("="), PARAM) == PNG


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png,rawbytes", "only base64"),
        ("data:text/plain;base64,aGVsbG8=", "'text/plain' is not an image"),
        ("data:;base64,aGVsbG8=", "'text/plain' is not an image"),
        ("data:image/png;base64", "needs a ','"),
        ("data:image/png;base64,not*base64!", "not valid base64"),
    ],
)
def test_a_bad_data_url_is_refused_with_its_reason(url, message):
    with pytest.raises(MediaError, match=message) as e:
        ImageFetcher().fetch(url, PARAM)
    assert e.value.param == PARAM


def test_base64_past_max_bytes_is_refused_before_decoding():
    assert decode_base64(base64.b64encode(b"x" * 1000).decode(), PARAM, max_bytes=1000) == b"x" * 1000
    with pytest.raises(MediaError, match="more than the 1000 bytes"):
        decode_base64(base64.b64encode(b"x" * 1003).decode(), PARAM, max_bytes=1000)


@pytest.mark.parametrize("url", ["ftp://example.com/cat.png", "gopher://example.com/", "javascript:alert(1)"])
def test_other_schemes_are_refused_by_name(url):
    scheme = url.split(":")[0]
    with pytest.raises(MediaError, match=f"images by {scheme}: URLs are not supported"):
        ImageFetcher(allowed_domains=["example.com"]).fetch(url, PARAM)


@pytest.fixture
def folders(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "sub" / "cat.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    os.symlink(outside / "secret.png", allowed / "link.png")
    os.symlink(outside, allowed / "linked_folder")
    return allowed, outside


def test_a_file_under_the_allowed_folder_is_read(folders):
    allowed, _ = folders
    fetcher = ImageFetcher(allowed_local_path=str(allowed))
    assert fetcher.fetch(str(allowed / "sub" / "cat.png"), PARAM) == PNG
    assert fetcher.fetch((allowed / "sub" / "cat.png").as_uri(), PARAM) == PNG
    assert fetcher.fetch("sub/cat.png", PARAM) == PNG  # relative: inside the folder
    assert fetcher.fetch(f"file://localhost{allowed}/sub/%63at.png", PARAM) == PNG


@pytest.mark.parametrize(
    "name",
    ["outside/secret.png", "allowed/../outside/secret.png", "allowed/sub/../../outside/secret.png", "allowed/link.png"]
    + ["allowed/linked_folder/secret.png"],
)
def test_a_file_outside_the_allowed_folder_is_refused(folders, name):
    allowed, _ = folders
    path = allowed.parent / name
    assert path.read_bytes() == PNG  # it is there to be read, were it allowed
    fetcher = ImageFetcher(allowed_local_path=str(allowed))
    for url in (str(path), path.as_uri(), f"file://{allowed.parent}/{name}"):
        with pytest.raises(MediaError, match="outside the allowed local media path"):
            fetcher.fetch(url, PARAM)


def test_files_are_refused_without_an_allowed_folder_and_past_max_bytes(folders):
    allowed, _ = folders
    for unset in (None, ""):
        with pytest.raises(MediaError, match="local files are not allowed"):
            ImageFetcher(allowed_local_path=unset).fetch(str(allowed / "sub" / "cat.png"), PARAM)
    with pytest.raises(ValueError, match="not a folder"):
        ImageFetcher(allowed_local_path=str(allowed / "sub" / "cat.png"))
    with pytest.raises(MediaError, match=f"more than the {len(PNG) - 1} bytes"):
        ImageFetcher(allowed_local_path=str(allowed), max_bytes=len(PNG) - 1).fetch("sub/cat.png", PARAM)
    with pytest.raises(MediaError, match="no such file"):
        ImageFetcher(allowed_local_path=str(allowed)).fetch("sub/dog.png", PARAM)
    with pytest.raises(MediaError, match="not one on 'example.com'"):
        ImageFetcher(allowed_local_path=str(allowed)).fetch(f"file://example.com{allowed}/sub/cat.png", PARAM)


def test_an_allowed_host_is_fetched_from(server):
    assert loopback_fetcher().fetch(f"{server}/image.png", PARAM) == PNG
    assert loopback_fetcher().fetch(f"{server}/redirect-here", PARAM) == PNG
    assert Handler.log == ["/image.png", "/redirect-here", "/image.png"]


@pytest.mark.parametrize("allowed", [["localhost"], ["127.0.0.2"], ["example.com"], []])
def test_a_host_not_allowed_is_refused_without_a_connection(server, allowed):
    with pytest.raises(MediaError, match="'127.0.0.1' are not allowed"):
        ImageFetcher(allowed_domains=allowed).fetch(f"{server}/image.png", PARAM)
    assert Handler.log == []


@pytest.mark.parametrize(
    "url", ["http://evil-example.com/a.png", "https://sub.example.com/a.png", "http://example.co/"]
)
def test_allowed_domains_match_exactly(url):
    with pytest.raises(MediaError, match="not among the allowed media domains"):
        ImageFetcher(allowed_domains=["example.com"]).fetch(url, PARAM)


def test_without_a_list_loopback_and_private_hosts_are_refused_without_a_connection(server):
    port = server.rsplit(":", 1)[1]
    for host in ("127.0.0.1", "localhost", "[::1]", "10.0.0.1", "169.254.169.254", "0.0.0.0"):
        with pytest.raises(MediaError, match="non-public address"):
            ImageFetcher().fetch(f"http://{host}:{port}/image.png", PARAM)
    assert Handler.log == []


def test_a_redirect_to_a_host_not_allowed_is_refused(server):
    with pytest.raises(MediaError, match="'localhost' are not allowed"):
        loopback_fetcher().fetch(f"{server}/redirect-away", PARAM)
    assert Handler.log == ["/redirect-away"]  # the redirect's target was never asked for


def test_redirects_are_followed_at_most_max_redirects_times(server):
    with pytest.raises(MediaError, match="redirects more than 3 times"):
        loopback_fetcher(max_redirects=3).fetch(f"{server}/loop", PARAM)
    assert Handler.log == ["/loop", "/loopx", "/loopxx", "/loopxxx"]


def test_a_body_past_max_bytes_is_refused(server):
    with pytest.raises(MediaError, match="2000000 bytes, more than the 1000000 allowed"):
        loopback_fetcher().fetch(f"{server}/big", PARAM)
    start = time.monotonic()
    with pytest.raises(MediaError, match="more than the 1000000 bytes allowed"):
        loopback_fetcher().fetch(f"{server}/endless", PARAM)  # no length announced: counted while read
    assert time.monotonic() - start < 5  # it stopped reading: the server would go on for 10 s


def test_a_slow_body_is_cut_at_the_timeout(server):
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        loopback_fetcher(timeout=0.5).fetch(f"{server}/drip", PARAM)
    assert time.monotonic() - start < 2


def test_an_http_error_is_refused_with_its_status(server):
    with pytest.raises(MediaError, match="HTTP 404"):
        loopback_fetcher().fetch(f"{server}/missing.png", PARAM)


def test_afetch_follows_the_same_rules(server, folders):
    allowed, _ = folders

    async def main():
        fetcher = ImageFetcher(allowed_domains=["127.0.0.1"], allowed_local_path=str(allowed), max_bytes=1_000_000)
        assert await fetcher.afetch(f"{server}/redirect-here", PARAM) == PNG
        assert await fetcher.afetch("sub/cat.png", PARAM) == PNG
        assert await fetcher.afetch("data:image/png;base64," + base64.b64encode(PNG).decode(), PARAM) == PNG
        for url, message in [
            (f"{server}/redirect-away", "'localhost' are not allowed"),
            (f"{server}/endless", "more than the 1000000 bytes"),
            (f"{server}/loop", "redirects more than 5 times"),
            (str(allowed / "link.png"), "outside the allowed local media path"),
        ]:
            with pytest.raises(MediaError, match=message):
                await fetcher.afetch(url, PARAM)
        with pytest.raises(MediaError, match="non-public address"):
            await ImageFetcher().afetch(f"{server}/image.png", PARAM)

    asyncio.run(main())
    assert "/image.png" in Handler.log and "/loopxxxxx" in Handler.log and "/loopxxxxxx" not in Handler.log
