"""`treadle bench serve --save-timelines out.json`: each request's timeline (GET
/v1/requests/{id}/timeline, by the X-Request-Id of its reply) kept for the run, and drawn as the web
UI's engine view draws them: one bar per request on one time axis, its phases in their colours
(out.png beside out.json)."""

import json
import os

import httpx

# the web UI's colours (treadle/server/static/app.js)
PHASE_COLOURS = {
    "model_load": "#8e8e93",
    "queued": "#e0a526",
    "prefill": "#3b7dd8",
    "decode": "#2f9e5a",
    "preempted": "#d0453c",
}


def fetch_timelines(base_url: str, headers: dict, request_ids: list[str]) -> tuple[list[dict], list[str]]:
    """The timelines of the run's requests (those with an id), and the ids the server had none for."""
    found, missing = [], []
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        for rid in request_ids:
            if not rid:
                continue
            r = client.get(f"/v1/requests/{rid}/timeline")
            if r.status_code == 200:
                found.append(r.json())
            else:
                missing.append(rid)
    return found, missing


def plot_timelines(records: list[dict], path: str, title: str | None = None) -> str:
    """One row per request (its first choice's phases), arrival order, seconds from the first arrival."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    records = sorted(records, key=lambda r: r["arrival"])
    t0 = records[0]["arrival"] if records else 0.0
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.18 * len(records) + 1.2)))
    for row, rec in enumerate(records):
        base = rec["arrival"] - t0
        if rec.get("e2e") is not None:
            ax.barh(row, rec["e2e"], left=base, height=0.8, color="#eeeeee")
        for p in rec["choices"][0]["phases"] if rec["choices"] else []:
            if p["start"] is None:
                continue
            end = p["end"] if p["end"] is not None else (rec.get("e2e") or p["start"])
            ax.barh(row, max(end - p["start"], 1e-4), left=base + p["start"], height=0.8,
                    color=PHASE_COLOURS.get(p["name"], "#999999"))  # fmt: skip
    ax.set_ylim(len(records) - 0.5, -0.5)
    ax.set_xlabel("seconds since the first request's arrival")
    ax.set_ylabel("requests (arrival order)")
    ax.legend(
        handles=[Patch(color=c, label=n.replace("_", " ")) for n, c in PHASE_COLOURS.items()],
        loc="lower right",
        fontsize=8,
    )
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_timelines(base_url: str, headers: dict, request_ids: list[str], path: str, title: str | None = None) -> list:
    """Fetch, write `path` (JSON: {"timelines": [...], "missing": [...]}) and its picture beside it;
    the paths written."""
    records, missing = fetch_timelines(base_url, headers, request_ids)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"timelines": records, "missing": missing}, f, indent=1)
    picture = plot_timelines(records, os.path.splitext(path)[0] + ".png", title)
    return [path, picture]
