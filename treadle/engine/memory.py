"""Resident memory of a process, from /proc (torch-free: the HTTP front end uses it too)."""


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
