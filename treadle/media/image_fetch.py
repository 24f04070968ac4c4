"""Fetching the bytes of an image that a request names: a base64 data: URL, an http(s) URL, or a
local file.

The rules are vLLM's `--allowed-media-domains` and `--allowed-local-media-path`:
- a host is allowed when its name is in the list exactly (no suffix match: `evil-example.com` is
  not `example.com`), and so must be the host of every redirect; without a list any host is, as
  long as all its addresses are public (no loopback, private, link-local, shared or multicast
  address: an image URL must not reach the server's own network). The addresses are checked when
  the name is resolved, before each request; a name that resolves differently a moment later (DNS
  rebinding) is not caught, as in vLLM. An empty list allows no host (in vLLM, any): remote images
  off.
- a file is allowed when its real path (symlinks and `..` resolved) lies inside the allowed
  folder; a relative path is taken inside that folder. Without a folder (None or ""), no file is.
Every body, downloaded or read, is refused past `max_bytes` (a download stops reading there), and a
download past `timeout` seconds in all, redirects included.

`fetch` blocks; `afetch` is the same for the server's event loop.
"""

import asyncio
import base64
import binascii
import contextlib
import ipaddress
import os
import socket
import time
import urllib.parse

import httpx

from treadle.media.images import MediaError

# Ask for the body as stored: a compressed one is inflated by httpx chunk by chunk, each chunk
# possibly far past max_bytes before the count sees it.
HEADERS = {"Accept-Encoding": "identity"}


class ImageFetcher:
    def __init__(
        self,
        allowed_domains: list[str] | None = None,
        allowed_local_path: str | None = None,
        max_bytes: int = 20 * 1024 * 1024,
        timeout: float = 10.0,
        max_redirects: int = 5,
    ):
        self.allowed_domains = None if allowed_domains is None else {d.lower().rstrip(".") for d in allowed_domains}
        if allowed_local_path and not os.path.isdir(allowed_local_path):
            raise ValueError(f"the allowed local media path {allowed_local_path!r} is not a folder")
        self.allowed_local_path = os.path.realpath(allowed_local_path) if allowed_local_path else None
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_redirects = max_redirects

    def fetch(self, url: str, param: str) -> bytes:
        """The bytes `url` names (data:, http(s):, file: or a path); MediaError naming `param` if it
        is not allowed or cannot be had."""
        kind = url_kind(url, param)
        if kind == "data":
            return decode_data_url(url, param, self.max_bytes)
        if kind == "http":
            return self._download(url, param)
        return self._read_file(local_path(url, param), param)

    async def afetch(self, url: str, param: str) -> bytes:
        kind = url_kind(url, param)
        if kind == "data":
            return decode_data_url(url, param, self.max_bytes)
        if kind == "http":
            return await self._adownload(url, param)
        return await asyncio.to_thread(self._read_file, local_path(url, param), param)

    def _download(self, url: str, param: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        with download_errors(self.timeout, param), httpx.Client(timeout=self.timeout, headers=HEADERS) as client:
            for _ in range(self.max_redirects + 1):
                host = self._allowed_host(url, param)
                if self.allowed_domains is None:
                    check_public(host, socket.getaddrinfo(host, None, type=socket.SOCK_STREAM), param)
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = str(response.url.join(response.headers["location"]))
                        continue
                    self._check_response(response, param)
                    body = bytearray()
                    for chunk in response.iter_bytes():
                        body += chunk
                        self._check_progress(len(body), deadline, param)
                    return bytes(body)
        raise MediaError(f"the image URL redirects more than {self.max_redirects} times", param)

    async def _adownload(self, url: str, param: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        loop = asyncio.get_running_loop()
        with download_errors(self.timeout, param):
            async with httpx.AsyncClient(timeout=self.timeout, headers=HEADERS) as client:
                for _ in range(self.max_redirects + 1):
                    host = self._allowed_host(url, param)
                    if self.allowed_domains is None:
                        check_public(host, await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), param)
                    async with client.stream("GET", url) as response:
                        if response.is_redirect:
                            url = str(response.url.join(response.headers["location"]))
                            continue
                        self._check_response(response, param)
                        body = bytearray()
                        async for chunk in response.aiter_bytes():
                            body += chunk
                            self._check_progress(len(body), deadline, param)
                        return bytes(body)
        raise MediaError(f"the image URL redirects more than {self.max_redirects} times", param)

    def _allowed_host(self, url: str, param: str) -> str:
        """The URL's host, if it may be fetched from (the first URL and every redirect's)."""
        try:
            parts = httpx.URL(url)
        except httpx.InvalidURL as e:
            raise MediaError(f"not a valid URL: {e}", param) from e
        if parts.scheme not in ("http", "https"):
            raise MediaError(f"the image URL leads to a {parts.scheme or 'schemeless'} URL, not http(s)", param)
        host = parts.host.rstrip(".")
        if not host:
            raise MediaError("the image URL has no host", param)
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise MediaError(f"images from {host!r} are not allowed: it is not among the allowed media domains", param)
        return host

    def _check_response(self, response: httpx.Response, param: str) -> None:
        if response.status_code != 200:
            raise MediaError(f"fetching the image failed: HTTP {response.status_code}", param)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise MediaError(f"the image is {declared} bytes, more than the {self.max_bytes} allowed", param)

    def _check_progress(self, received: int, deadline: float, param: str) -> None:
        if received > self.max_bytes:
            raise MediaError(f"the image is more than the {self.max_bytes} bytes allowed", param)
        if time.monotonic() > deadline:
            raise MediaError(f"fetching the image timed out after {self.timeout:g} s", param)

    def _read_file(self, path: str, param: str) -> bytes:
        if self.allowed_local_path is None:
            raise MediaError("local files are not allowed: no allowed local media path is set", param)
        root = self.allowed_local_path
        real = os.path.realpath(os.path.join(root, path))
        if os.path.commonpath([root, real]) != root:
            raise MediaError(f"the file {path!r} is outside the allowed local media path", param)
        try:
            with open(real, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise MediaError(f"no such file: {path!r}", param) from e
        except OSError as e:
            raise MediaError(f"cannot read {path!r}: {e.strerror}", param) from e
        if len(data) > self.max_bytes:
            raise MediaError(f"the file is more than the {self.max_bytes} bytes allowed", param)
        return data


@contextlib.contextmanager
def download_errors(timeout: float, param: str):
    """A failed download as a MediaError."""
    try:
        yield
    except socket.gaierror as e:
        raise MediaError(f"cannot resolve the image URL's host: {e}", param) from e
    except httpx.TimeoutException as e:
        raise MediaError(f"fetching the image timed out after {timeout:g} s", param) from e
    except httpx.HTTPError as e:
        raise MediaError(f"fetching the image failed: {e}", param) from e


def url_kind(url: str, param: str) -> str:
    """ "data", "http" or "file" (file: URLs and bare paths); MediaError for any other scheme."""
    if url[:5].lower() == "data:":
        return "data"
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return "http"
    if scheme in ("", "file"):
        return "file"
    raise MediaError(f"images by {scheme}: URLs are not supported (use data:, http(s): or file:)", param)


def local_path(url: str, param: str) -> str:
    if not url.lower().startswith("file:"):
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file: URL must name a local file, not one on {parts.netloc!r}", param)
    return urllib.parse.unquote(parts.path)


def decode_data_url(url: str, param: str, max_bytes: int) -> bytes:
    """The bytes of `data:image/...;base64,...` (RFC 2397); other media types and encodings refused."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError("a data: URL needs a ',' before its data", param)
    media_type, *options = header.split(";")
    if not options or options[-1].strip().lower() != "base64":
        raise MediaError("only base64 data: URLs are accepted (data:image/png;base64,...)", param)
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        raise MediaError(f"a data: URL of type {media_type or 'text/plain'!r} is not an image", param)
    return decode_base64(payload, param, max_bytes)


def decode_base64(text: str, param: str, max_bytes: int) -> bytes:
    """Standard base64 (Anthropic's and Ollama's image data, a data: URL's payload); line breaks and
    missing padding are tolerated."""
    text = "".join(text.split())
    if len(text.rstrip("=")) * 3 // 4 > max_bytes:  # the decoded length, known before decoding
        raise MediaError(f"the image is more than the {max_bytes} bytes allowed", param)
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error as e:
        raise MediaError(f"the image data is not valid base64: {e}", param) from e


def check_public(host: str, addresses: list, param: str) -> None:
    """Refuse a host any of whose addresses (getaddrinfo's) is not a public one."""
    for *_, sockaddr in addresses:
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])  # an IPv6 scope ("%eth0") is no part of it
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_global or address.is_multicast:
            raise MediaError(f"images from {host!r} are not allowed: it resolves to a non-public address", param)
