"""One file over HTTP into a part file that survives interruption: resumed with a Range request
(the next attempt in this run, or the next `treadle pull`), shown with a progress bar (size and
speed), checked against the checksum the server gave before anyone may use it.

Checksums: the Hugging Face hub names an LFS file's sha256 and a small file's git blob id (the
sha1 of "blob <size>\\0" + its bytes); `Expected` carries either. A part file is kept under a key
of the URL and the expected checksum, so a file that changed upstream is never resumed into.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx  # imported where a download starts: a server that never pulls does not load it (~18 MB)

CHUNK = 1 << 16  # bytes read and written at a time: what a dropped connection may lose
RETRIES = 5  # attempts in a row that bring no new byte, before the download gives up


class FetchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Expected:
    """What a finished download must be: its size and a checksum, where the source names them."""

    size: int | None = None
    sha256: str | None = None
    git_sha1: str | None = None  # the hub's id of a file kept in git rather than LFS

    @property
    def key(self) -> str:
        return self.sha256 or self.git_sha1 or ""


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def git_blob_sha1(path: str) -> str:
    h = hashlib.sha1()
    h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def verify(path: str, expected: Expected, what: str) -> None:
    """A FetchError naming the file unless it has the expected size and checksum."""
    size = os.path.getsize(path)
    if expected.size is not None and size != expected.size:
        raise FetchError(f"{what}: {size} bytes, expected {expected.size}")
    if expected.sha256 is not None:
        got = file_sha256(path)
        if got != expected.sha256:
            raise FetchError(f"{what}: sha256 {got} does not match the source's {expected.sha256}: the file is corrupt")
    elif expected.git_sha1 is not None:
        got = git_blob_sha1(path)
        if got != expected.git_sha1:
            raise FetchError(
                f"{what}: git blob id {got} does not match the source's {expected.git_sha1}: the file is corrupt"
            )


def part_path(partial_dir: str, url: str, expected: Expected) -> str:
    key = hashlib.sha256(f"{url}\n{expected.key}".encode()).hexdigest()[:24]
    name = os.path.basename(url.split("?")[0])[-80:] or "download"
    return os.path.join(partial_dir, f"{key}-{name}.part")


def download(
    url: str, part: str, expected: Expected, *, headers: dict | None = None, label: str = "", progress: bool = True
) -> str:
    """Fetch `url` into `part` (resuming what is there), check it against `expected`; the part
    file's path once whole and checked. A corrupt result is deleted: the next try starts clean."""
    from tqdm import tqdm

    os.makedirs(os.path.dirname(part), exist_ok=True)
    headers = dict(headers or {})
    headers["Accept-Encoding"] = "identity"  # sizes and ranges of the bytes themselves
    label = label or os.path.basename(url)
    have = os.path.getsize(part) if os.path.exists(part) else 0
    bar = tqdm(
        total=expected.size,
        initial=have,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=label,
        disable=not progress,
        leave=True,
    )
    tries, validator = 0, None
    import httpx

    try:
        with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, connect=10.0)) as client:
            while True:
                if expected.size is not None and have == expected.size:
                    break
                if expected.size is not None and have > expected.size:
                    os.remove(part)  # not this file's bytes
                    have = 0
                    bar.reset(total=expected.size)
                request_headers = dict(headers)
                if have:
                    request_headers["Range"] = f"bytes={have}-"
                    if validator:
                        request_headers["If-Range"] = validator
                before = have
                try:
                    done, have, validator = _get(client, url, part, have, request_headers, bar)
                except (httpx.TransportError, FetchTransient) as e:
                    have = os.path.getsize(part) if os.path.exists(part) else 0
                    tries = 0 if have > before else tries + 1
                    if tries >= RETRIES:
                        raise FetchError(
                            f"{label}: the download failed {RETRIES} times in a row ({e}); "
                            "run the pull again to resume it"
                        ) from None
                    time.sleep(min(8.0, 0.5 * 2**tries))
                    continue
                if done:
                    break
    finally:
        bar.close()
    try:
        verify(part, expected, label)
    except FetchError:
        os.remove(part)
        raise
    return part


class FetchTransient(Exception):
    """The server cut the body short, or answered with a status worth retrying."""


def _get(client: httpx.Client, url: str, part: str, have: int, headers: dict, bar) -> tuple[bool, int, str | None]:
    """One GET appended to `part`: (whole, bytes held, the validator to resume against)."""
    with client.stream("GET", url, headers=headers) as r:
        if r.status_code in (408, 429, 500, 502, 503, 504):
            raise FetchTransient(f"HTTP {r.status_code}")
        if (
            r.status_code == 416 and have
        ):  # nothing past what we hold: the part is the whole file (or is wrong: checked after)
            return True, have, None
        if r.status_code >= 400:
            raise FetchError(f"{url}: HTTP {r.status_code} {_reason(r)}")
        validator = r.headers.get("etag") or r.headers.get("last-modified")
        if r.status_code == 200 and have:  # the server ignored the range (or the file changed): start over
            have = 0
            bar.reset()
        total = _total(r, have)
        if total is not None and bar.total is None:
            bar.total = total
            bar.refresh()
        with open(part, "ab" if have else "wb") as f:
            try:
                for chunk in r.iter_bytes():  # as the bytes arrive: a dropped connection loses none it delivered
                    f.write(chunk)
                    have += len(chunk)
                    bar.update(len(chunk))
            finally:
                f.flush()
                os.fsync(f.fileno())
        if total is not None and have < total:
            raise FetchTransient(f"the connection closed after {have} of {total} bytes")
        return True, have, validator


def _total(r: httpx.Response, have: int) -> int | None:
    content_range = r.headers.get("content-range", "")
    if r.status_code == 206 and "/" in content_range and content_range.rsplit("/", 1)[1].isdigit():
        return int(content_range.rsplit("/", 1)[1])
    length = r.headers.get("content-length")
    return (int(length) + (have if r.status_code == 206 else 0)) if length and length.isdigit() else None


def _reason(r: httpx.Response) -> str:
    import httpx

    try:
        r.read()
        text = r.text.strip()
    except httpx.HTTPError:
        text = ""
    return (r.reason_phrase + (f": {text[:200]}" if text else "")).strip()
