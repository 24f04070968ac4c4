"""Where each request's time went (server/timeline.py): GET /v1/requests/{id}/timeline for one of the
last --max-stored-timelines requests, by its reply's id or the client's X-Request-Id; GET
/v1/requests for the latest (the web UI's engine view draws them)."""

from typing import Annotated

from fastapi import Query, Request

from treadle.server.checked_route import checked_router
from treadle.server.openapi_models import GATE, KEYED, RequestTimeline, RequestTimelineList, replies
from treadle.server.protocol import RequestError

router = checked_router()


@router.get("/v1/requests/{request_id}/timeline")
@replies(RequestTimeline, "openai", 404, KEYED, GATE)
async def timeline(request_id: str, request: Request):
    record = request.app.state.treadle.metrics.timelines.get(request_id)
    if record is None:
        raise RequestError(
            f"no timeline for request {request_id!r}: unknown, not finished yet, or older than the last "
            "--max-stored-timelines requests",
            "request_id",
            status=404,
            code="not_found",
        )
    return RequestTimeline(**record.as_json()).model_dump(exclude_unset=True)


@router.get("/v1/requests")
@replies(RequestTimelineList, "openai", 400, KEYED, GATE)
async def recent(request: Request, limit: Annotated[int, Query(ge=1, le=100000)] = 20):
    """The latest `limit` finished requests' timelines, oldest first."""
    records = request.app.state.treadle.metrics.timelines.recent(limit)
    data = [RequestTimeline(**r.as_json()) for r in records]
    return RequestTimelineList(object="list", data=data).model_dump(exclude_unset=True)
