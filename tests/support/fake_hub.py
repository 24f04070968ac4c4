"""A local HTTP server that speaks the Hugging Face hub's file API, as much of it as `treadle pull`
and huggingface_hub use: the repository tree (GET /api/models/ORG/REPO/tree/REV) and files
(HEAD / GET /ORG/REPO/resolve/REV/PATH, with Range, the hub's X-Repo-Commit, ETag, X-Linked-Etag
and X-Linked-Size headers). LFS files (name ending .gguf or .safetensors) are named by their sha256,
the others by their git blob id, as on the hub. Plain files under /files/NAME, without any checksum.

For the tests it records every request (method, path, Range, Authorization) and the bytes it
served, and can misbehave: `cut_after[path] = n` closes the connection after n bytes of the next
GET of that file, `corrupt.add(path)` serves one byte flipped, `delay` slows every chunk.
"""

import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".gguf", ".safetensors")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> path -> bytes
        self.plain: dict[str, bytes] = {}  # /files/NAME
        self.requests: list[dict] = []
        self.served: dict[str, int] = {}  # path -> body bytes sent
        self.cut_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.delay = 0.0  # seconds per chunk
        self.chunk = 65536  # body bytes per write
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def add_folder(self, repo: str, folder: str) -> None:
        files = self.repos.setdefault(repo, {})
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read()

    def gets(self, path_suffix: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == "GET" and r["path"].endswith(path_suffix)]

    # ------------------------------------------------------------ serving

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        with self.lock:
            self.requests.append(
                {
                    "method": h.command,
                    "path": path,
                    "range": h.headers.get("Range"),
                    "auth": h.headers.get("Authorization"),
                }
            )
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and "tree" in parts:
            i = parts.index("tree")
            repo = "/".join(parts[2:i])
            if repo not in self.repos:
                return self._json(h, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return self._json(h, 200, [self._tree_entry(p, d) for p, d in sorted(self.repos[repo].items())])
        if "resolve" in parts:
            i = parts.index("resolve")
            repo, file = "/".join(parts[:i]), "/".join(parts[i + 2 :])
            data = self.repos.get(repo, {}).get(file)
            if data is None:
                return self._json(h, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            lfs = file.endswith(LFS_SUFFIXES)
            etag = hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)
            extra = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
            if lfs:
                extra.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
            return self._file(h, head, f"{repo}/{file}", data, extra)
        if parts[0] == "files" and len(parts) == 2 and parts[1] in self.plain:
            return self._file(h, head, parts[1], self.plain[parts[1]], {})
        return self._json(h, 404, {"error": "not found"})

    def _tree_entry(self, path: str, data: bytes) -> dict:
        entry = {"type": "file", "path": path, "size": len(data), "oid": git_sha1(data)}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _json(self, h, status: int, body, headers: dict | None = None) -> None:
        raw = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)

    def _file(self, h, head: bool, key: str, data: bytes, headers: dict) -> None:
        if key in self.corrupt:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng[6:].split("-")[0])
            if start >= len(data):
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{len(data)}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if head:
            return
        cut = self.cut_after.pop(key, None)
        sent = 0
        try:
            step = self.chunk
            for i in range(0, len(body), step):
                chunk = body[i : i + step]
                if cut is not None and sent + len(chunk) > cut:
                    chunk = chunk[: max(0, cut - sent)]
                    h.wfile.write(chunk)
                    sent += len(chunk)
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(2)  # the connection drops mid-body
                    return
                if self.delay:
                    time.sleep(self.delay)
                h.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            pass
        finally:
            with self.lock:
                self.served[key] = self.served.get(key, 0) + sent
