"""The operator's endpoints: /health, /version, /metrics (Prometheus), /stats (the engine's numbers
and the loaded models'), and the web chat's page at /."""

import os

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response

from treadle import __version__
from treadle.server.checked_route import checked_router
from treadle.server.openapi_models import GATE, KEYED, Health, Stats, Version, replies
from treadle.server.prepare import require_ready
from treadle.server.protocol import RequestError

STATIC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "static")

router = checked_router()


@router.get("/", include_in_schema=False)
async def index():
    return FileResponse(os.path.join(STATIC_DIR, "index.html"))


@router.get("/health")
@replies(Health, "plain", 503, GATE, error_bodies={503: Health})
async def health(request: Request):
    hub = request.app.state.treadle.hub
    entry = hub.primary_entry  # the command line's model, while it is loaded
    if entry is not None and not entry.engine.ready:
        engine = entry.engine
        status = "loading" if engine.state == "ready" else engine.state
        body = Health(status=status, reason=engine.reason) if engine.reason else Health(status=status)
        return JSONResponse(body.model_dump(exclude_unset=True), status_code=503)
    return Health(status="ok").model_dump(exclude_unset=True)


@router.get("/version")
@replies(Version, "plain", GATE)
async def version():
    return Version(version=__version__).model_dump(exclude_unset=True)


@router.get("/metrics")
@replies(None, "plain", 401, GATE, media=["text/plain"])  # 401 only with --metrics-require-key
async def metrics(request: Request):
    state = request.app.state.treadle
    return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/stats")
@replies(Stats, "plain", 400, 404, 503, KEYED, GATE)  # 404: ?model= names no model
async def stats(request: Request, model: str | None = None):
    """The engine's numbers of `model` (default: the command line's), and every loaded model's
    memory and expiry under "models"."""
    hub = request.app.state.treadle.hub
    fleet = {"models": hub.describe(), "max_loaded_models": hub.max_loaded, "memory_budget_bytes": hub.memory_budget,
             "model_loads": hub.loads, "model_unloads": hub.unloads,
             "spare_core_bytes": hub.spare.rss() if hub.spare is not None else 0,
             "spare_core_ready": hub.spare is not None and hub.spare.ready}  # fmt: skip
    name = model if model is not None else hub.primary
    if name is None:
        return fleet
    entry = hub.loaded.get(hub.resolve_name(name).name)
    if entry is None:
        raise RequestError(f"model `{name}` is not loaded", "model", status=503, code="model_not_loaded")
    require_ready(entry.state)
    return {**entry.engine.stats(), **fleet}
