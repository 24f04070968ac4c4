"""Process-level helpers shared by the front end, the engine core and the compiler process
(torch-free): where treadle caches things, a process's resident memory, ending with a parent."""

import ctypes
import os
import signal
import sys


def cache_root() -> str:
    """~/.cache/treadle, or $XDG_CACHE_HOME/treadle: compiled graphs, kernels, inductor's cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "treadle")


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process in bytes; empty where /proc is not."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere a no-op).

    Loading leaves freed temporaries in the heap: a 262K-token tokenizer's JSON parse, the float32
    copies weights are converted from. glibc keeps most of them mapped (small blocks, fragmented),
    so they stay in the resident set for the process's life (~200 MB for Gemma 3's tokenizer
    alone) unless trimmed once the load is over."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def zeroed_pages(nbytes: int) -> memoryview | None:
    """`nbytes` of fresh anonymous memory (private): the kernel's zero pages, made resident only
    where written (a KV pool's explicit zeroing cost a 537 MB pool ~60 ms of its engine's start,
    and its whole size in RSS before the first request). None where the OS gives no such map."""
    import mmap

    if nbytes <= 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    except (OSError, ValueError):
        return None


_LOW_BIT = bytes(b & 1 for b in range(256))


def resident_bytes(address: int, nbytes: int) -> int | None:
    """How many bytes of [address, address + nbytes) are resident (mincore, Linux), counted in
    whole pages; None where it cannot be told."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = address // page * page
    pages = (address + nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return min(nbytes, bytes(vec).translate(_LOW_BIT).count(1) * page)  # bit 0: resident


def file_key(path: str) -> tuple | None:
    """A file's identity: its absolute path, size and modification time (None: not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), st.st_size, st.st_mtime_ns)


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Have the C heap map every allocation of `threshold` bytes or more on its own and unmap it
    when freed (glibc's M_MMAP_THRESHOLD; elsewhere a no-op). By default glibc raises that
    threshold to the size of the largest block freed so far, so after one prompt step the next
    steps' activations (tens of MB for a 1B model) come from the heap and stay resident when freed:
    the engine core's peak grew ~60 MB over its first requests. A fixed threshold also keeps the
    weights, each a block of its own, from fragmenting the heap. Costs a prompt step a page fault
    per 4 KB of its large buffers; a decode step's are small. 1 MB rather than 4: a prompt step's
    256-row slices (1-4 MB each) then leave no free holes in the heap either (a lower peak for a
    continuous many-user run, at a small cost to long prompts; single-stream decode is unaffected)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def end_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent dies, even a killed parent
    (PR_SET_PDEATHSIG; Linux, elsewhere a no-op). With `parent` (its pid, known before this
    process started): exit now if that parent is already gone."""
    try:
        ctypes.CDLL(None).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent is not None and os.getppid() != parent:  # it died before the line above
        sys.exit(0)
