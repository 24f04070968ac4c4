"""The prefix cache's lower tiers: host RAM and disk, below the KV pool.

A full block leaves the pool when the pool reuses it (block_pool.py: the oldest free block loses its
hash). With a host tier, its KV is first copied out, before the step that overwrites it runs, into
the host tier (RAM, `--kv-offload-bytes`, least recently used first out). With a disk tier
(`--kv-cache-dir`, `--kv-disk-bytes`, least recently used file first out) every block is handed to
the writer thread as soon as the step that computed it ran (so a restart finds what was still in the
pool too), and again at its eviction if the writer had dropped it. A prefix lookup that misses the
pool asks the tiers:
- a block in the host tier is copied back into a fresh pool block before the step's forward (a
  memcpy of one page) and is in the pool's index again from then on;
- a block only on disk is read by the reader thread while its request waits in the queue (the
  other requests keep stepping; no step waits on the disk) into a staging area owned by that
  request; a later step loads it from there as from the host tier.

Keys: a block's chain hash (it covers every token before the block, the cache_salt and so a LoRA
adapter's digest) and its cache group, 33 bytes. A hybrid model's recurrent-state checkpoint
(state_cache.py) is a page too, keyed by the hash of the block that ends its prefix and the tag
STATE_TAG in place of a group: the state after that block, every recurrent layer's conv window then
its matrix state (`ModelRunner.read_states`), `state_bytes` long. The disk tier's folder is named by the model's
identity (`model_identity`: the digest of the model's files, the compute and KV dtypes, batch
invariance, the block size, the layout of the page), so a restarted server, or another server on
the same model and folder, finds the blocks of an earlier one, and a server on another model never
looks at them.

One file per block, `<key hex>.kv`, written to `<name>.tmp`, fsynced and renamed, so a reader sees
a whole file or none (a killed writer leaves a .tmp that the next start deletes):

    magic  b"TRDLKV01"          8 bytes
    identity                    32 bytes (the folder's name, again)
    key                         33 bytes
    payload length              8 bytes, little-endian
    crc32 of the payload        4 bytes, little-endian
    payload                     the page: every tensor pair of the block's group, keys then values

A file whose header or checksum disagrees (truncated, corrupt, another model's, another key's) is
deleted and counted as corrupt; its block is simply not found. Payloads are opaque bytes here (no
torch): the model runner makes and reads them (`ModelRunner.read_blocks` / `write_blocks`).
"""

import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

log = logging.getLogger("treadle")

MAGIC = b"TRDLKV01"
HEADER = struct.Struct("<8s32s33sQI")
KEY_BYTES = 33
FORMAT_VERSION = b"treadle-kv-tiers-2"  # change it when a page's layout or the KV's numerics change
STATE_TAG = 255  # a key's last byte: a recurrent-state checkpoint, not a cache group's KV
MAX_PENDING_WRITE_BYTES = 256 << 20  # past this the writer is behind: further writes are dropped, never waited for
READ_DELAY_ENV = "TREADLE_KV_DISK_READ_DELAY"  # seconds added to every disk read (tests of a slow disk)
WRITE_DELAY_ENV = "TREADLE_KV_DISK_WRITE_DELAY"  # seconds between writing a file and renaming it (tests)

HOST, DISK = "HOST", "DISK"  # the KV event media of the tiers (the pool's is kv_events.MEDIUM)


def tier_key(block_hash: bytes, group: int) -> bytes:
    return block_hash + bytes([group])


def state_key(block_hash: bytes) -> bytes:
    """The key of the recurrent-state checkpoint after this block."""
    return block_hash + bytes([STATE_TAG])


def files_digest(paths: list[str]) -> bytes:
    """sha256 over the files' contents (names and sizes too), remembered per (path, size, mtime) in
    ~/.cache/treadle/identity so a restart does not read the weights again."""
    import json

    from treadle.utils import cache_root

    memo_path = os.path.join(cache_root(), "identity", "files.json")
    try:
        with open(memo_path) as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256()
    changed = False
    for path in sorted(paths):
        st = os.stat(path)
        stamp = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
        digest = memo.get(stamp)
        if digest is None:
            fh = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    fh.update(chunk)
            digest = memo[stamp] = fh.hexdigest()
            changed = True
        h.update(f"{os.path.basename(path)}|{st.st_size}|{digest}\n".encode())
    if changed:
        try:
            os.makedirs(os.path.dirname(memo_path), exist_ok=True)
            tmp = f"{memo_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(memo, f)
            os.replace(tmp, memo_path)
        except OSError:
            pass
    return h.digest()


def model_identity(model_files: list[str], **facts) -> bytes:
    """32 bytes naming what a stored page means: the model's files and every fact that shapes a page
    (dtype, block size, KV dtype, the group layout, a quantization applied at load)."""
    h = hashlib.sha256(FORMAT_VERSION)
    h.update(files_digest(model_files))
    h.update(repr(sorted(facts.items())).encode())
    return h.digest()


@dataclass
class TierStats:
    hits: int = 0  # blocks found here by prefix lookups and loaded into the pool
    stored: int = 0  # blocks written here
    evicted: int = 0  # blocks dropped by the budget
    load_seconds: float = 0.0  # host: the step loop's copies into the pool; disk: file reads (on the reader thread)
    loads: int = 0
    dropped: int = 0  # disk: writes given up because the writer was behind
    corrupt: int = 0  # disk: files that failed their checks (deleted, never loaded)

    def as_dict(self, blocks: int, nbytes: int, budget: int) -> dict:
        return {
            "blocks": blocks,
            "bytes": nbytes,
            "budget_bytes": budget,
            "hits": self.hits,
            "stored": self.stored,
            "evicted": self.evicted,
            "loads": self.loads,
            "load_seconds": round(self.load_seconds, 6),
            "dropped": self.dropped,
            "corrupt": self.corrupt,
        }


class HostTier:
    """Pages in RAM under a byte budget, least recently used out first."""

    def __init__(self, budget: int):
        self.budget = budget
        self.pages: OrderedDict[bytes, object] = OrderedDict()
        self.nbytes = 0
        self.stats = TierStats()

    def __contains__(self, key: bytes) -> bool:
        return key in self.pages

    def put(self, key: bytes, page) -> list[bytes]:
        """Keep `page`; the keys evicted to make room."""
        size = len(memoryview(page).cast("B"))
        if size > self.budget:
            return []
        if key in self.pages:
            self.pages.move_to_end(key)
            return []
        self.pages[key] = page
        self.nbytes += size
        self.stats.stored += 1
        out = []
        while self.nbytes > self.budget:
            old, p = self.pages.popitem(last=False)
            self.nbytes -= len(memoryview(p).cast("B"))
            self.stats.evicted += 1
            out.append(old)
        return out

    def get(self, key: bytes):
        page = self.pages.get(key)
        if page is not None:
            self.pages.move_to_end(key)
        return page


class DiskTier:
    """Pages as files in `<root>/<identity hex>/`, under a byte budget (least recently used file out
    first), written by one thread and read by another."""

    def __init__(self, root: str, identity: bytes, budget: int, page_bytes: int, emit, state_bytes: int = 0):
        self.identity = identity
        self.emit = emit  # emit(medium, key, stored?): a KV event (called from the writer thread too)
        self.folder = os.path.join(root, identity.hex()[:32])
        self.budget = budget
        self.page_bytes, self.state_bytes = page_bytes, state_bytes
        self.stats = TierStats()
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest use first
        self.nbytes = 0
        self.pending_bytes = 0
        self.read_delay = float(os.environ.get(READ_DELAY_ENV) or 0)
        self.write_delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
        os.makedirs(self.folder, exist_ok=True)
        self._scan()
        self.writes: queue.Queue = queue.Queue()
        self.reads: queue.Queue = queue.Queue()
        self.done_reads: queue.Queue = queue.Queue()  # (owner, key, page or None), for the step loop
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def payload_bytes(self, key: bytes) -> int:
        return self.state_bytes if key[-1] == STATE_TAG else self.page_bytes

    def file_bytes(self, key: bytes) -> int:
        return HEADER.size + self.payload_bytes(key)

    def path(self, key: bytes) -> str:
        return os.path.join(self.folder, key.hex() + ".kv")

    def _scan(self) -> None:
        """The files an earlier server left, oldest use first; half-written ones deleted. A file of
        the wrong size is deleted now; its contents are checked when it is read."""
        found = []
        for entry in os.scandir(self.folder):
            name = entry.name
            if name.endswith(".tmp"):
                if not _writer_alive(name):  # a killed writer's half file (a live server's own is left to it)
                    _unlink(entry.path)
                continue
            if not name.endswith(".kv"):
                continue
            try:
                key = bytes.fromhex(name[:-3])
                st = entry.stat()
            except (ValueError, OSError):
                continue
            if len(key) != KEY_BYTES or st.st_size != self.file_bytes(key):
                self.stats.corrupt += 1
                _unlink(entry.path)
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.nbytes += size
        self._evict_over_budget()

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def put(self, key: bytes, page) -> bool:
        """Queue a page for writing; False when the writer is too far behind (the page is dropped)."""
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
                return True
            if self.pending_bytes + self.file_bytes(key) > MAX_PENDING_WRITE_BYTES:
                self.stats.dropped += 1
                return False
            self.pending_bytes += self.file_bytes(key)
        self.writes.put((key, page))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self.writes.get()
            if item is None:
                return
            key, page = item
            try:
                self._write(key, page)
            except Exception as e:  # noqa: BLE001 - the writer outlives any one page
                log.warning("KV disk tier: cannot write %s: %s", self.path(key), e)
            finally:
                with self.lock:
                    self.pending_bytes -= self.file_bytes(key)

    def _write(self, key: bytes, page) -> None:
        data = memoryview(page).cast("B")
        final = self.path(key)
        tmp = f"{final}.{os.getpid()}-{threading.get_ident()}.tmp"  # unique across processes sharing the folder
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, self.identity, key, len(data), zlib.crc32(data)))
            f.write(data)
            f.flush()
            if self.write_delay:
                time.sleep(self.write_delay)
            os.fsync(f.fileno())
        os.replace(tmp, final)
        with self.lock:
            if key not in self.index:
                self.index[key] = self.file_bytes(key)
                self.nbytes += self.file_bytes(key)
                self.stats.stored += 1
            self._evict_over_budget()
        self.emit(DISK, key, True)

    def _evict_over_budget(self) -> None:
        while self.nbytes > self.budget and self.index:
            old, size = self.index.popitem(last=False)
            self.nbytes -= size
            self.stats.evicted += 1
            _unlink(self.path(old))
            self.emit(DISK, old, False)

    def read(self, owner: str, keys: list[bytes]) -> None:
        """Read these pages on the reader thread; each arrives on `done_reads` (None: gone or bad)."""
        for key in keys:
            self.reads.put((owner, key))

    def _read_loop(self) -> None:
        while True:
            item = self.reads.get()
            if item is None:
                return
            owner, key = item
            started = time.perf_counter()
            if self.read_delay:
                time.sleep(self.read_delay)
            try:
                page = self._read(key)
            except Exception as e:  # noqa: BLE001 - the reader outlives any one page; its request recomputes
                log.warning("KV disk tier: cannot read %s: %s", self.path(key), e)
                page = None
            with self.lock:
                self.stats.load_seconds += time.perf_counter() - started
                self.stats.loads += 1
            self.done_reads.put((owner, key, page))

    def _read(self, key: bytes):
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self._forget(key, corrupt=False)
            return None
        ok = len(data) == self.file_bytes(key)
        if ok:
            magic, identity, stored_key, length, crc = HEADER.unpack_from(data)
            payload = memoryview(data)[HEADER.size :]
            ok = (
                magic == MAGIC
                and identity == self.identity
                and stored_key == key
                and length == self.payload_bytes(key)
                and zlib.crc32(payload) == crc
            )
        if not ok:
            log.warning("KV disk tier: %s failed its checks (truncated, corrupt or not this model's): deleted", path)
            self._forget(key, corrupt=True)
            _unlink(path)
            return None
        try:
            os.utime(path)  # its last use, for the budget's order after a restart
        except OSError:
            pass
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
        return bytearray(payload)

    def _forget(self, key: bytes, corrupt: bool) -> None:
        with self.lock:
            size = self.index.pop(key, None)
            if size is not None:
                self.nbytes -= size
                self.emit(DISK, key, False)
            if corrupt:
                self.stats.corrupt += 1

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the queued writes are on disk (tests, a clean shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.pending_bytes == 0:
                    return
            time.sleep(0.005)

    def close(self) -> None:
        self.writes.put(None)
        self.reads.put(None)
        for t in self._threads:
            t.join(5)


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that is writing `<key>.kv.<pid>-<thread>.tmp` still runs (not this one: a
    start's own scan runs before its writer)."""
    try:
        pid = int(tmp_name.rsplit(".", 2)[-2].split("-")[0])
    except (ValueError, IndexError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass
class Staged:
    """A waiting request's pages read from disk (key -> page), and the keys still being read."""

    pages: dict[bytes, object] = field(default_factory=dict)
    reading: set[bytes] = field(default_factory=set)


class KVTiers:
    """The host and disk tiers and the pages staged for waiting requests; used by the KV cache
    manager (lookups, the pages to save and load) on the step loop's thread only."""

    def __init__(
        self,
        host_bytes: int,
        disk_root: str | None = None,
        disk_bytes: int = 0,
        identity: bytes = b"",
        page_bytes: int = 0,
        state_bytes: int = 0,
    ):
        """host_bytes: the host tier's budget (0: none); disk_root: the disk tier's folder (None: none),
        disk_bytes its budget (EngineConfig holds both defaults)."""
        # (medium, key, stored?) since take_events, once record_events() was called (deque.append is
        # atomic: the disk writer appends from its thread)
        self.events: deque[tuple[str, bytes, bool]] | None = None
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = (
            DiskTier(disk_root, identity, disk_bytes, page_bytes, self._emit, state_bytes) if disk_root else None
        )
        self.staged: dict[str, Staged] = {}  # request id -> its pages read from disk

    def locate(self, key: bytes, owner: str) -> str | None:
        """Where a lookup can get this page: HOST (the host tier or the owner's staged pages, loaded
        this step), DISK (a read first), or None."""
        if self.host is not None and key in self.host:
            return HOST
        staged = self.staged.get(owner)
        if staged is not None and key in staged.pages:
            return HOST
        if self.disk is not None and key in self.disk:
            return DISK
        return None

    def prefetch(self, owner: str, keys: list[bytes]) -> bool:
        """Start reading `keys` from disk for `owner`; True once none of them is being read (each
        arrived, or turned out gone or bad)."""
        self.poll()
        staged = self.staged.setdefault(owner, Staged())
        todo = [k for k in keys if k not in staged.pages and k not in staged.reading]
        staged.reading.update(todo)
        self.disk.read(owner, todo)
        return not staged.reading

    def poll(self) -> None:
        """Take in the pages the reader finished."""
        if self.disk is None:
            return
        while True:
            try:
                owner, key, page = self.disk.done_reads.get_nowait()
            except queue.Empty:
                return
            staged = self.staged.get(owner)
            if staged is None:
                continue  # the request ended meanwhile
            staged.reading.discard(key)
            if page is not None:
                staged.pages[key] = page

    def page(self, key: bytes, owner: str):
        """The page a lookup located, for loading into the pool. Nothing leaves the host tier here (a
        hit's later pages must still be there): a staged page is not put into it (the disk has it)."""
        staged = self.staged.get(owner)
        if staged is not None and key in staged.pages:
            page = staged.pages.pop(key)
            self.disk.stats.hits += 1
            return page
        page = self.host.get(key)
        self.host.stats.hits += 1
        self.host.stats.loads += 1
        return page

    def release(self, owner: str) -> None:
        """The request ended or started: its staged pages not loaded are dropped."""
        self.staged.pop(owner, None)

    def save(self, key: bytes, page) -> None:
        """A page the pool is evicting: into the host tier and to the disk writer."""
        if self.host is not None:
            self._host_put(key, page)
        if self.disk is not None and key not in self.disk:
            self.disk.put(key, page)

    def wants(self, key: bytes) -> bool:
        """Whether a page evicted from the pool needs copying out (a tier lacks it)."""
        return (self.host is not None and key not in self.host) or (self.disk is not None and key not in self.disk)

    def _host_put(self, key: bytes, page) -> None:
        if key in self.host:
            self.host.get(key)
            return
        for old in self.host.put(key, page):
            self._emit(HOST, old, False)
        if key in self.host:
            self._emit(HOST, key, True)

    def record_events(self) -> None:
        """From now on keep events, starting with the blocks an earlier server left on disk."""
        self.events = deque()
        if self.disk is not None:
            with self.disk.lock:
                for key in self.disk.index:
                    self._emit(DISK, key, True)

    def _emit(self, medium: str, key: bytes, stored: bool) -> None:
        if self.events is not None:
            self.events.append((medium, key, stored))

    def take_events(self) -> list[tuple[str, bytes, bool]]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def reading(self) -> bool:
        """Whether some waiting request's pages are still being read."""
        return any(s.reading for s in self.staged.values())

    def count_load_seconds(self, seconds: float) -> None:
        """The step loop's copies of a step's pages into the pool (host pages and staged disk pages)."""
        if self.host is not None:
            self.host.stats.load_seconds += seconds

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict:
        out = {}
        if self.host is not None:
            out["host"] = self.host.stats.as_dict(len(self.host.pages), self.host.nbytes, self.host.budget)
        if self.disk is not None:
            d = self.disk
            with d.lock:
                out["disk"] = {**d.stats.as_dict(len(d.index), d.nbytes, d.budget), "folder": d.folder}
        return out
