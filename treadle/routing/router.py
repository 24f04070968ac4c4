"""`treadle router`: one OpenAI-compatible front door for several `treadle serve` workers.

    clients --HTTP--> router --HTTP--> worker (treadle serve --kv-events-port P), on any machine
                        ^------ZMQ SUB-- each worker's KV cache events (vLLM's wire format)

Each request goes to the worker the routing policy (routing/policy.py) picks: by default the one holding
the longest cached prefix of the request's prompt. The router finds the prompt's token ids as the
workers do (prompts.py: the model's tokenizer and chat template, no weights), hashes its full
blocks as the engines do, and asks its index of every worker's KV events (kv_index.py) which
worker holds how many of them. A worker announces its event endpoint in its /stats, so `--worker
URL` is all the router needs.

The router health-checks each worker (GET /health, then /stats for its load, block size, event
endpoint and engine pid) every `--health-check-interval` seconds, and forgets what a worker held
when it stops answering or its engine restarts. A request goes only to healthy workers; if its
worker cannot be reached or answers 5xx before anything has been sent to the client, it is tried
on the next best worker (once per worker), so a client sees a worker's death only if it happens
mid-reply. Replies stream through as the worker sends them: bytes are forwarded, never buffered.
A client that disconnects closes its worker connection, which aborts its request there.

Replies carry `x-treadle-worker` (the worker's URL) and, where the policy predicted one,
`x-treadle-predicted-cached-tokens`: what the worker will report as cached_tokens.
"""

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from treadle import __version__
from treadle.routing.kv_index import KVEventSubscriber
from treadle.routing.policy import RoutingPolicy
from treadle.routing.prompts import PromptReader
from treadle.server.errors import error_response
from treadle.server.middleware import PROTECTED_PREFIXES, BodyGate, key_accepted, key_refused, presented_key

log = logging.getLogger("treadle.router")

RETRY_STATUSES = frozenset({500, 502, 503, 504, 529})  # the worker could not take it: another may
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "host",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
    }
)
GENERATION_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/api/chat",
        "/api/generate",
        "/v1/responses",
        "/v1/embeddings",
        "/api/embed",
    }
)
HIT_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class RouterSettings:
    workers: list[str]
    policy: str = "cache_aware"
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.5
    api_keys: tuple[str, ...] = ()
    worker_api_key: str | None = None
    health_check_interval: float = 2.0
    max_request_bytes: int = 4 * 1024 * 1024
    request_body_timeout: float = 30.0


@dataclass
class Worker:
    url: str
    healthy: bool = False
    reason: str | None = "not checked yet"
    in_flight: int = 0  # requests this router sent it that have not ended
    stats: dict = field(default_factory=dict)
    engine_pid: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    events_endpoint: str | None = None
    subscriber: KVEventSubscriber | None = None


def reachable(endpoint: str | None, worker_url: str) -> str | None:
    """A worker's announced tcp:// endpoint as the router can connect to it: an unspecified
    address (0.0.0.0, ::) is the worker's own host. ipc:// endpoints (a worker's replicas inside
    it) are the worker's business: it routes between them itself."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("0.0.0.0", "[::]", "*", "::"):
        worker_host = urlsplit(worker_url).hostname or "127.0.0.1"
        host = f"[{worker_host}]" if ":" in worker_host else worker_host
    return f"tcp://{host}:{port}"


class Router:
    def __init__(self, settings: RouterSettings, prompts: PromptReader):
        self.settings = settings
        self.prompts = prompts
        self.policy = RoutingPolicy(
            settings.policy, settings.balance_abs_threshold, settings.balance_rel_threshold, settings.cache_threshold
        )
        self.workers = {url: Worker(url) for url in (u.rstrip("/") for u in settings.workers)}
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.m_requests = Counter(
            "treadle_router:requests",
            "Requests sent to each worker (retries included).",
            ["worker"],
            registry=self.registry,
        )
        self.m_retries = Counter(
            "treadle_router:retries",
            "Requests tried again on another worker, by the worker that failed them.",
            ["worker"],
            registry=self.registry,
        )
        self.m_unroutable = Counter(
            "treadle_router:unroutable_requests",
            "Requests refused because no healthy worker could take them.",
            registry=self.registry,
        )
        self.m_hits = Histogram(
            "treadle_router:routed_prefix_hit_tokens",
            "Cached prompt tokens predicted at the chosen worker, per routed request.",
            buckets=HIT_BUCKETS,
            registry=self.registry,
        )
        self.m_hit_tokens = Counter(
            "treadle_router:routed_prefix_hit_tokens_by_worker",
            "Cached prompt tokens predicted, by worker.",
            ["worker"],
            registry=self.registry,
        )
        self.m_healthy = Gauge(
            "treadle_router:worker_healthy",
            "1 while the worker passes its health check.",
            ["worker"],
            registry=self.registry,
        )
        self.m_in_flight = Gauge(
            "treadle_router:worker_requests_in_flight",
            "Requests in flight at each worker, from this router.",
            ["worker"],
            registry=self.registry,
        )
        for url in self.workers:
            self.m_healthy.labels(url).set(0)
            self.m_in_flight.labels(url).set(0)

    # ------------------------------------------------------------ lifecycle and health

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        await asyncio.gather(*(self.check(w) for w in self.workers.values()))
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for w in self.workers.values():
            if w.subscriber is not None:
                w.subscriber.stop()
        if self.client is not None:
            await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval)
            await asyncio.gather(*(self.check(w) for w in self.workers.values()))

    def worker_headers(self) -> dict:
        key = self.settings.worker_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def check(self, w: Worker) -> None:
        timeout = max(1.0, self.settings.health_check_interval)
        try:
            health = await self.client.get(w.url + "/health", timeout=timeout)
            if health.status_code != 200:
                return self._unhealthy(w, f"/health answered {health.status_code}: {health.text[:200]}")
            stats = await self.client.get(w.url + "/stats", headers=self.worker_headers(), timeout=timeout)
            if stats.status_code != 200:
                return self._unhealthy(w, f"/stats answered {stats.status_code}: {stats.text[:200]}")
            if w.max_model_len is None:
                models = await self.client.get(w.url + "/v1/models", headers=self.worker_headers(), timeout=timeout)
                if models.status_code == 200 and models.json().get("data"):
                    w.max_model_len = models.json()["data"][0].get("max_model_len")
        except (httpx.HTTPError, ValueError) as e:
            return self._unhealthy(w, f"{type(e).__name__}: {e}")
        s = stats.json()
        if not w.healthy:
            log.info("worker %s is healthy", w.url)
        w.healthy, w.reason, w.stats = True, None, s
        w.block_size = s.get("block_size") or w.block_size
        self.m_healthy.labels(w.url).set(1)
        endpoint = reachable(s.get("kv_events_endpoint"), w.url)
        if endpoint != w.events_endpoint:
            self._subscribe(w, endpoint, reachable(s.get("kv_events_replay_endpoint"), w.url))
        elif w.engine_pid is not None and s.get("engine_pid") != w.engine_pid and w.subscriber is not None:
            w.subscriber.reset()  # its engine restarted: an empty cache, events numbered from 0
        w.engine_pid = s.get("engine_pid")

    def _subscribe(self, w: Worker, endpoint: str | None, replay: str | None) -> None:
        if w.subscriber is not None:
            w.subscriber.stop()
            w.subscriber = None
        self.policy.index.forget(w.url)
        w.events_endpoint = endpoint
        if endpoint is not None and replay is not None:
            log.info("worker %s: KV events from %s", w.url, endpoint)
            w.subscriber = KVEventSubscriber(self.policy.index, w.url, endpoint, replay).start()
        elif self.policy.policy == "cache_aware":
            log.warning(
                "worker %s publishes no KV events (start it with --kv-events-port): routed by load alone", w.url
            )

    def _unhealthy(self, w: Worker, reason: str) -> None:
        if w.healthy:
            log.warning("worker %s is unhealthy: %s", w.url, reason)
        w.healthy, w.reason = False, reason
        self.m_healthy.labels(w.url).set(0)
        self.policy.index.forget(w.url)  # whatever it held, it serves nothing now
        if w.subscriber is not None:
            w.subscriber.reset()  # when it is back, its events are read afresh

    @property
    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    # ------------------------------------------------------------ forwarding

    def _pick(self, exclude: set[str], prompt) -> tuple[Worker, int | None] | None:
        candidates = [w for w in self.healthy if w.url not in exclude]
        if not candidates:
            return None
        block = next((w.block_size for w in candidates if w.block_size), 16)
        ids, salt = (prompt.token_ids, prompt.cache_salt) if prompt is not None else (None, None)
        choice = self.policy.choose({w.url: w.in_flight for w in candidates}, ids, block, salt)
        return self.workers[choice.worker], choice.predicted_hit_tokens

    async def forward(self, request: Request, body: bytes, prompt=None, only: list[Worker] | None = None) -> Response:
        """Send the request to the best healthy worker; on a connection failure or a 5xx before
        any byte reached the client, to the next best."""
        path = request.url.path
        tried: set[str] = set() if only is None else {u for u in self.workers if u not in {w.url for w in only}}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if self.settings.worker_api_key:
            headers = {
                k: v for k, v in headers.items() if k.lower() not in ("authorization", "x-api-key")
            } | self.worker_headers()
        last_error = "no worker is healthy"
        while True:
            picked = self._pick(tried, prompt)
            if picked is None:
                self.m_unroutable.inc()
                return error_response(
                    path, 503, f"no worker could take the request: {last_error}", headers={"Retry-After": "1"}
                )
            w, predicted = picked
            tried.add(w.url)
            self._enter(w)
            self.m_requests.labels(w.url).inc()
            url = w.url + path + (f"?{request.url.query}" if request.url.query else "")
            try:
                upstream = await self.client.send(
                    self.client.build_request(request.method, url, content=body, headers=headers), stream=True
                )
            except httpx.TransportError as e:
                self._leave(w)
                last_error = f"{w.url}: {type(e).__name__}: {e}"
                self._unhealthy(w, last_error)
                self.m_retries.labels(w.url).inc()
                continue
            if upstream.status_code in RETRY_STATUSES:
                text = (await upstream.aread())[:300].decode(errors="replace")
                await upstream.aclose()
                self._leave(w)
                last_error = f"{w.url} answered {upstream.status_code}: {text}"
                self.m_retries.labels(w.url).inc()
                continue
            if predicted is not None:
                self.m_hits.observe(predicted)
                self.m_hit_tokens.labels(w.url).inc(predicted)
            out_headers = {
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in HOP_HEADERS and k.lower() != "content-encoding"
            }
            out_headers["x-treadle-worker"] = w.url
            if predicted is not None:
                out_headers["x-treadle-predicted-cached-tokens"] = str(predicted)
            return PassThrough(
                upstream, lambda w=w: self._leave(w), status_code=upstream.status_code, headers=out_headers
            )

    def _enter(self, w: Worker) -> None:
        w.in_flight += 1
        self.m_in_flight.labels(w.url).set(w.in_flight)

    def _leave(self, w: Worker) -> None:
        w.in_flight -= 1
        self.m_in_flight.labels(w.url).set(w.in_flight)

    async def owner_of_response(self, response_id: str) -> list[Worker]:
        """The workers holding a stored Responses API response (each keeps its own)."""
        found = []
        for w in self.healthy:
            try:
                r = await self.client.get(
                    f"{w.url}/v1/responses/{response_id}", headers=self.worker_headers(), timeout=10
                )
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                found.append(w)
        return found

    def stats(self) -> dict:
        return {
            "routing_policy": self.policy.policy,
            "healthy_workers": len(self.healthy),
            "workers": [
                {
                    "url": w.url,
                    "healthy": w.healthy,
                    "reason": w.reason,
                    "requests_in_flight": w.in_flight,
                    "routed_requests": self.policy.routed.get(w.url, 0),
                    "kv_events_endpoint": w.events_endpoint,
                    "stats": w.stats,
                }
                for w in self.workers.values()
            ],
        }


class PassThrough(StreamingResponse):
    """A worker's reply, forwarded chunk by chunk as it arrives; the worker connection is closed
    when the reply ends, however it ends (a client that left included: the worker then aborts)."""

    def __init__(self, upstream: httpx.Response, on_close, **kwargs):
        super().__init__(upstream.aiter_raw(), **kwargs)
        self.upstream, self.on_close = upstream, on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            self.on_close()


def build_router_app(router: Router) -> FastAPI:
    settings = router.settings

    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(
        title="treadle router",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=asynccontextmanager(lifespan),
    )
    keys = [k.encode() for k in settings.api_keys]
    app.add_middleware(BodyGate, limit=settings.max_request_bytes, timeout=settings.request_body_timeout)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if keys and request.url.path.startswith(PROTECTED_PREFIXES) and not key_accepted(keys, presented_key(request)):
            return key_refused(request.url.path)
        return await call_next(request)

    @app.get("/health")
    async def health():
        n = len(router.healthy)
        if not n:
            reasons = {w.url: w.reason for w in router.workers.values()}
            return JSONResponse(
                {"status": "unavailable", "reason": "no worker is healthy", "workers": reasons}, status_code=503
            )
        return {"status": "ok", "healthy_workers": n, "workers": len(router.workers)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        return router.stats()

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request):
        owners = await router.owner_of_response(response_id)
        if not owners:
            return error_response(request.url.path, 404, f"Response with id '{response_id}' not found.")
        return await router.forward(request, await request.body(), only=owners)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def anything(path: str, request: Request):
        body = await request.body()
        route = request.url.path
        prompt, only = None, None
        if request.method == "POST" and route in GENERATION_PATHS:
            started = time.monotonic()
            prompt = await router.prompts.read(route, body)
            log.debug("prompt of %s read in %.1f ms", route, 1000 * (time.monotonic() - started))
            if route == "/v1/responses" and prompt is None:
                previous = _previous_response_id(body)
                if previous:
                    only = await router.owner_of_response(previous) or None
        return await router.forward(request, body, prompt, only)

    return app


def _previous_response_id(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    value = data.get("previous_response_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def run_router(
    settings: RouterSettings, prompts: PromptReader, *, host: str, port: int, log_level: str = "info"
) -> int:
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_router_app(Router(settings, prompts))
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    return 0
