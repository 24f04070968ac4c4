"""Building treadle's C kernels: compiled on first use with the system's C compiler, cached.

Each source is built with `cc -O3 -march=native -I <this folder>` (and its own flags; the shared
headers, bf16.h, are part of the key) into ~/.cache/treadle/kernels/,
keyed by the source, the compiler, the flags and the CPU, then loaded with ctypes (which releases
the GIL during a call). `-fopenmp`: the parallel loops run on torch's own OpenMP pool (same
soname, already loaded), so no second set of threads competes with torch's for the cores.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading

from treadle.utils import cache_root

HERE = os.path.dirname(__file__)
log = logging.getLogger("treadle.kernels")
BASE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fopenmp"]


def build(source_name: str, flags: list[str]) -> ctypes.CDLL:
    """Compile HERE/source_name (once per source, compiler, flags and CPU) and load it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    source_path = os.path.join(HERE, source_name)
    with open(source_path, "rb") as f:
        source = f.read()
    for header in sorted(n for n in os.listdir(HERE) if n.endswith(".h")):  # what the sources include
        with open(os.path.join(HERE, header), "rb") as f:
            source += f.read()
    all_flags = [*BASE_FLAGS, *flags]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    with open("/proc/cpuinfo", "rb") if os.path.exists("/proc/cpuinfo") else open(os.devnull, "rb") as f:
        cpu = next((line for line in f if line.startswith(b"flags")), b"")
    key = hashlib.sha256(
        source + version.encode() + cpu + " ".join(all_flags).encode() + platform.machine().encode()
    ).hexdigest()[:16]
    folder = os.path.join(cache_root(), "kernels")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{os.path.splitext(source_name)[0]}-{key}.so")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        result = subprocess.run(
            [cc, *all_flags, "-I", HERE, source_path, "-o", tmp, "-lm"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source_name}: {result.stderr.strip()[:500]}")
        os.replace(tmp, path)
    return ctypes.CDLL(path)


class Library:
    """A kernel library made by `make()` (build() and its ctypes signatures) on first use, once;
    where it cannot be, `warning` (with %s for the reason) is logged once and `available()` is
    False, so the caller keeps its torch path. `lib` is the loaded library."""

    def __init__(self, make, warning: str):
        self._make, self._warning = make, warning
        self._lock = threading.Lock()
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None

    def available(self) -> bool:
        if self.lib is None and self.error is None:
            with self._lock:
                if self.lib is None and self.error is None:
                    try:
                        self.lib = self._make()
                    except Exception as e:  # noqa: BLE001 - any failure leaves the caller's torch path, which is correct
                        self.error = f"{type(e).__name__}: {e}"
                        log.warning(self._warning, self.error)
        return self.lib is not None
