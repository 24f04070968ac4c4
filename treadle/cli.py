"""The `treadle` command: serve (the OpenAI-compatible server), router (in front of several), pull / list / show / rm /
cp (the model store), chat (terminal), run (one prompt), bench."""

import argparse
import os
import sys
from dataclasses import fields

from treadle.engine_config import ENGINE_HELP, add_engine_args, engine_config_from_args


def cmd_run(args) -> int:
    from treadle.engine.llm_engine import LLMEngine
    from treadle.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    prompt, images = args.prompt, None
    add_special = True
    if args.image:  # the images, then the text, in one user message of the chat template
        from treadle.media.vision_prompt import load_image

        vision = engine.vision_prompts
        pictures = [load_image(path) for path in args.image]
        message = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": prompt}]
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": message}])
        prompt, images = vision.build(prompt, pictures, add_special_tokens=False)
        add_special = False
    elif args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        add_special = False
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    engine.add_request("run", prompt, params, add_special_tokens=add_special, images=images)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                sys.stdout.write(c.text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def default_served_name(model: str | None) -> str:
    from treadle.model.loading.default_model import MODEL_NAME

    if model is None:
        return MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


# limits on what a client controls: a `treadle serve` flag each, defaults from ServerSettings
LIMIT_HELP = {
    "max_request_bytes": "largest request body, in bytes: beyond it a 413",
    "max_n": "most choices (n) a request may ask for",
    "max_logprobs": "most logprobs / top_logprobs a request may ask for, at most 20",
    "max_stop_strings": "most stop strings a request may send",
    "max_stop_length": "longest stop string a request may send, in characters",
    "max_logit_bias": "most logit_bias entries a request may send",
    "max_messages": "most messages a chat request may send",
    "max_concurrent_per_key": (
        "most requests in flight per API key (without keys: for the whole server); one more is a 429 with Retry-After; "
        "0: no limit"
    ),
    "request_body_timeout": (
        "seconds a request's whole body may take to arrive; past it a 408, and the request is never admitted"
    ),
    "max_stream_buffer_bytes": (
        "bytes of a streamed reply its client has not taken yet; past it the stream and its engine requests are aborted"
    ),
    "max_image_pixels": (
        "a model that sees: the most pixels (width x height) an image may have; a larger one is refused from its "
        "header, before it is decoded"
    ),
}


def add_limit_args(parser) -> None:
    from treadle.server.prepare import ServerSettings

    defaults = {f.name: f.default for f in fields(ServerSettings)}
    for name, text in LIMIT_HELP.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(defaults[name]),
            default=defaults[name],
            help=f"{text} (default: {defaults[name]})",
        )


def api_keys_from(flags: list[str] | None, env: str | None) -> tuple[str, ...]:
    """The keys of every --api-key, else of $TREADLE_API_KEY (comma-separated); blanks dropped."""
    given = flags if flags else (env or "").split(",")
    keys = tuple(dict.fromkeys(k.strip() for k in given if k.strip()))
    return keys


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH or '{"name": NAME, "path": PATH}' (vLLM's two forms) -> {NAME: PATH}."""
    import json

    out = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules {item}: expected NAME=PATH or {{"name": ..., "path": ...}}') from None
        else:
            name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {item}: expected NAME=PATH")
        if name in out:
            raise ValueError(f"--lora-modules: {name} is given twice")
        out[name] = os.path.abspath(os.path.expanduser(path))
    return out


def serve_models(args):
    """The models `treadle serve` answers to, from its positional model, each --model (PATH, or
    NAME=PATH), --models-dir and the model flags: (the command line's model path or None, ModelOptions)."""
    from treadle.engine_config import parse_size
    from treadle.model.loading.loader import resolve_model_path
    from treadle.server.http_server import ModelOptions, read_chat_template
    from treadle.server.model_hub import ModelSpec, parse_keep_alive
    from treadle.server.protocol import RequestError
    from treadle.utils import available_memory

    given = ([args.model_pos] if args.model_pos else []) + list(args.model or [])
    plain = [g for g in given if "=" not in g or os.path.exists(os.path.expanduser(g))]
    named = [g.split("=", 1) for g in given if g not in plain]
    if len(set(plain)) > 1:
        raise ValueError("give the served model once (positional or --model); name the others as --model NAME=PATH")
    models_dir = args.models_dir
    multi = models_dir is not None or bool(named)
    primary_path = plain[0] if plain else None
    specs = []
    primary = None
    if plain or not multi:
        primary = args.served_model_name or default_served_name(primary_path)
        specs.append(ModelSpec(primary, resolve_model_path(primary_path), read_chat_template(args.chat_template)))
    for name, path in named:
        if not name or not path:
            raise ValueError(f"--model {name}={path}: expected NAME=PATH")
        specs.append(ModelSpec(name, resolve_model_path(path)))
    try:
        keep = parse_keep_alive(args.keep_alive) if args.keep_alive is not None else 300.0
    except RequestError as e:
        raise ValueError(f"--keep-alive: {e.message}") from None
    primary_keep = keep if args.keep_alive is not None else None  # the command line's model stays, unless told
    if args.memory_budget is not None:
        budget = parse_size(args.memory_budget)
    else:
        free = available_memory()
        budget = int(free * 0.8) if multi and free else None
    if args.max_loaded_models < 1:
        raise ValueError("--max-loaded-models must be at least 1")
    options = ModelOptions(
        primary, specs, models_dir, args.max_loaded_models, budget, keep, primary_keep,
        parse_lora_modules(args.lora_modules),
        spare_core=multi and not args.no_spare_core,
    )  # fmt: skip
    return primary_path, options


def cmd_serve(args) -> int:
    # main() started an engine core (`_start_core_early`); replicas start theirs elsewhere
    early = getattr(args, "early_core", None)
    if early is not None and (args.data_parallel_size > 1 or args.data_parallel_backend == "ray"):
        early.drop()
        early = None
    return _serve(args, early)


def _serve(args, early_core) -> int:
    import json

    from treadle.server.app import ServerSettings
    from treadle.server.http_server import serve

    primary_path, models = serve_models(args)
    args.model = primary_path
    try:
        overrides = json.loads(args.override_generation_config) if args.override_generation_config else {}
        from treadle.store.inspect import checked_defaults

        overrides = checked_defaults(overrides, "--override-generation-config")
    except ValueError as e:
        raise ValueError(f"--override-generation-config: {e}") from None
    config = engine_config_from_args(args)
    if args.kv_events_port is not None:  # on the server's own address only
        host = f"[{args.host}]" if ":" in args.host else args.host
        config.kv_events_endpoint = f"tcp://{host}:{args.kv_events_port}"
    primary = next((s for s in models.named if s.name == models.primary), None)
    settings = ServerSettings(
        served_model_name=models.primary or "",
        model_root=primary.path if primary else "",
        api_keys=api_keys_from(args.api_key, os.environ.get("TREADLE_API_KEY")),
        metrics_require_key=args.metrics_require_key,
        log_requests=args.log_requests,
        max_waiting=args.max_waiting,
        chat_template=primary.chat_template if primary else None,
        max_schema_bytes=args.max_schema_bytes,
        **{name: getattr(args, name) for name in LIMIT_HELP},
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_stored_responses=args.max_stored_responses,
        pooling=args.pooling,
        generation_config=args.generation_config,
        override_generation_config=overrides,
        max_stored_timelines=args.max_stored_timelines,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        limit_mm_per_prompt=_mm_limits(args.limit_mm_per_prompt),
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allowed_local_media_path=args.allowed_local_media_path,
    )
    return serve(
        config,
        settings,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        max_engine_restarts=args.max_engine_restarts,
        log_level=args.log_level,
        data_parallel_size=args.data_parallel_size,
        routing={
            "policy": args.routing_policy,
            "balance_abs_threshold": args.balance_abs_threshold,
            "balance_rel_threshold": args.balance_rel_threshold,
            "cache_threshold": args.cache_threshold,
            "backend": args.data_parallel_backend,
            "ray_address": args.ray_address,
        },
        models=models,
        early_core=early_core,
    )


def add_routing_args(parser, what: str) -> None:
    """The routing policy's flags, the same for replicas inside a server and workers behind a router."""
    from treadle.routing.policy import POLICIES  # (the parser's imports wait: see build_parser)

    parser.add_argument(
        "--routing-policy",
        choices=POLICIES,
        default="cache_aware",
        help=(
            f"the {what} holding the prompt's longest cached prefix where it covers enough of the prompt and the load "
            "is in balance (cache_aware), in turn, or the least busy (default: cache_aware)"
        ),
    )
    parser.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=32,
        help=(
            f"cache_aware: when the busiest and idlest {what}s differ by more requests in flight than this, and ... "
            "(default: 32)"
        ),
    )
    parser.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help=(
            "... the busiest has more than this many times the idlest's, the idlest takes the request whatever is "
            "cached (default: 1.5)"
        ),
    )
    parser.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help=(
            f"cache_aware: a prompt of which the best {what} holds less than this fraction cached goes to the least "
            "busy one (default: 0.5)"
        ),
    )


def cmd_router(args) -> int:
    from treadle.model.loading.loader import load_tokenizer
    from treadle.routing.prompts import PromptReader
    from treadle.routing.router import RouterSettings, run_router
    from treadle.server.http_server import read_chat_template

    settings = RouterSettings(
        workers=args.worker,
        policy=args.routing_policy,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        cache_threshold=args.cache_threshold,
        api_keys=api_keys_from(args.api_key, os.environ.get("TREADLE_API_KEY")),
        worker_api_key=args.worker_api_key or os.environ.get("TREADLE_WORKER_API_KEY") or None,
        health_check_interval=args.health_check_interval,
        max_request_bytes=args.max_request_bytes,
        request_body_timeout=args.request_body_timeout,
    )
    prompts = PromptReader(
        load_tokenizer(args.model),
        chat_template=read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    return run_router(settings, prompts, host=args.host, port=args.port, log_level=args.log_level)


def add_router_parser(sub) -> None:
    r = sub.add_parser(
        "router",
        help="one OpenAI-compatible API in front of several treadle serve workers, routed by where prompts are cached",
    )
    r.add_argument(
        "--model",
        "-m",
        default=None,
        help=(
            "the workers' model: its tokenizer and chat template are read (no weights) to hash prompts as the engines "
            "do (default: the embedded SmolLM2-135M-Instruct)"
        ),
    )
    r.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="URL",
        help=(
            "a treadle serve worker's base URL, e.g. http://10.0.0.2:8000; give it once per worker (start workers with "
            "--kv-events-port for cache_aware)"
        ),
    )
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    r.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    r.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=(
            "require 'Authorization: Bearer KEY' from clients, as treadle serve does (default: $TREADLE_API_KEY, "
            "comma-separated, else none)"
        ),
    )
    r.add_argument(
        "--worker-api-key",
        default=None,
        help=(
            "the key sent to the workers instead of the client's, and with the router's own health checks of their "
            "/stats: needed when the workers have --api-key (default: $TREADLE_WORKER_API_KEY, else the client's "
            "headers are passed on)"
        ),
    )
    add_routing_args(r, "worker")
    _add_router_worker_args(r)
    r.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default: info)")
    r.set_defaults(func=cmd_router)


def _add_router_worker_args(r) -> None:
    """What the router must know of its workers' settings to read prompts as they do, and its limits."""
    from treadle.server.prepare import ServerSettings
    from treadle.server.reasoning import PARSERS as REASONING_PARSERS
    from treadle.server.tools import PARSERS as TOOL_PARSERS

    r.add_argument(
        "--health-check-interval",
        type=float,
        default=2.0,
        help="seconds between health checks of each worker (default: 2)",
    )
    r.add_argument(
        "--chat-template", default=None, help="the workers' --chat-template, if they have one (default: the model's)"
    )
    r.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_PARSERS,
        help="the workers' --tool-call-parser (default: auto)",
    )
    r.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="the workers' --reasoning-parser (default: off)",
    )
    defaults = {f.name: f.default for f in fields(ServerSettings)}
    r.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults["max_request_bytes"],
        help=f"{LIMIT_HELP['max_request_bytes']} (default: {defaults['max_request_bytes']})",
    )
    r.add_argument(
        "--request-body-timeout",
        type=float,
        default=defaults["request_body_timeout"],
        help=f"{LIMIT_HELP['request_body_timeout']} (default: {defaults['request_body_timeout']})",
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; `command` (the subcommand about to run, if known): the benchmarks'
    subcommands are built only for `bench` (their modules load httpx and numpy, ~30 MB a server
    would carry for nothing)."""
    from treadle.store.commands import add_store_parsers

    parser = argparse.ArgumentParser(prog="treadle", description="An LLM inference engine and server.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_router_parser(sub)
    add_store_parsers(sub)
    bench = sub.add_parser(
        "bench", help="benchmarks: serve (a server, like vllm bench serve), sweep, throughput (engine alone)"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    if command in (None, "bench"):
        add_bench_parsers(bench_sub)
    add_chat_parser(sub)
    add_run_parser(sub)
    return parser


def add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (and the web chat)")
    srv.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help=ENGINE_HELP["model"])
    srv.add_argument(
        "--model",
        "-m",
        action="append",
        default=None,
        help=ENGINE_HELP["model"]
        + "; NAME=PATH serves one more model under NAME, loaded when a request names it (give it once per model)",
    )
    _add_serve_model_args(srv)
    _add_serve_address_args(srv)
    _add_serve_replica_args(srv)
    _add_serve_request_args(srv)
    _add_serve_reply_args(srv)
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may finish after SIGINT/SIGTERM (default: 10)",
    )
    srv.add_argument(
        "--max-engine-restarts",
        type=int,
        default=3,
        help=(
            "restarts of a dead engine core process allowed within 10 minutes; one more and the server exits non-zero "
            "(default: 3)"
        ),
    )
    srv.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default: info)"
    )
    add_engine_args(
        srv, defaults={"compile": True, "decode_stall_ratio": 1.0}
    )  # a server runs long enough to profit; its streams must not freeze
    srv.set_defaults(func=cmd_serve)


def _add_serve_model_args(srv) -> None:
    """Which models a server answers to, when they load and unload, their generation defaults."""
    from treadle.store.store import default_models_dir

    srv.add_argument(
        "--models-dir",
        nargs="?",
        const=default_models_dir(),
        default=None,
        help=(
            "serve every model of this store (treadle pull) by name, loaded when a request names it; without DIR: "
            "$TREADLE_MODELS, else ~/.cache/treadle/models (default: off)"
        ),
    )
    srv.add_argument(
        "--max-loaded-models",
        type=int,
        default=3,
        help=(
            "models loaded at once (an engine core process each); one more unloads the least recently used idle one "
            "(default: 3)"
        ),
    )
    srv.add_argument(
        "--memory-budget",
        default=None,
        help=(
            "memory all loaded models may use (every engine core's resident set), e.g. 8G; a load unloads idle models, "
            "least recently used first, to fit (default: 80%% of the memory available at start when serving several "
            "models)"
        ),
    )
    srv.add_argument(
        "--no-spare-core",
        action="store_true",
        help=(
            "serving several models, do not keep a started engine core (Python and torch loaded, ~250 MB) waiting for "
            "the next model to load (default: kept, so a model loads in the time its files take; counted in "
            "--memory-budget, not started where it has no room)"
        ),
    )
    srv.add_argument(
        "--keep-alive",
        default=None,
        help=(
            "how long a model loaded on demand stays loaded once idle, e.g. 30s, 5m, 1h; 0: unload at once; "
            "-1: forever; a request's Ollama keep_alive overrides it; given, it applies to the command line's model "
            "too, which otherwise stays (default: 5m)"
        ),
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help=(
            "LoRA adapters (PEFT folders) of the command line's model, each served as model NAME (vLLM's flag; also as "
            'JSON \'{"name": ..., "path": ...}\'); more can be loaded at run time with POST /v1/load_lora_adapter '
            "(default: none)"
        ),
    )
    srv.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "vllm"],
        help=(
            "auto: a model's own generation defaults (generation_config.json, GGUF general.sampling.*, the store's "
            "params.json) apply where a request does not set them; vllm: treadle's defaults only (default: auto)"
        ),
    )
    srv.add_argument(
        "--override-generation-config",
        default=None,
        help=(
            "generation defaults on top of every model's, as JSON in SamplingParams' names, "
            "e.g. '{\"temperature\": 0.5}' (default: none)"
        ),
    )


def _add_serve_address_args(srv) -> None:
    """Where it listens and the keys it asks for."""
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    srv.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=(
            "require 'Authorization: Bearer KEY' on /v1/*, /api/*, /tokenize, /detokenize, /stats; give it several "
            "times for several keys (default: $TREADLE_API_KEY, comma-separated, else none)"
        ),
    )


def _add_serve_request_args(srv) -> None:
    """Logging and the limits on requests."""
    srv.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="put /metrics behind the API key too (default: open, for scrapers)",
    )
    srv.add_argument(
        "--log-requests",
        action="store_true",
        help="log each request's route and body at INFO (default: off; headers and keys are never logged)",
    )
    srv.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help=(
            "send an OpenTelemetry span per request over OTLP/HTTP to URL, e.g. http://localhost:4318/v1/traces; "
            "a caller's traceparent header is honoured (needs treadle[otel]) (default: off)"
        ),
    )
    srv.add_argument(
        "--limit-mm-per-prompt",
        default='{"image": 8}',
        help='a model that sees: the most images one request may carry, as JSON (vLLM\'s form; default: {"image": 8})',
    )
    srv.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="hosts whose http(s) image URLs the server fetches (default: none; data: URLs always work)",
    )
    srv.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a folder under which file:// image URLs and paths may be read (default: none)",
    )
    srv.add_argument(
        "--max-stored-timelines",
        type=int,
        default=1000,
        help="GET /v1/requests/{id}/timeline: the last requests whose timelines are kept (default: 1000)",
    )
    srv.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: the model file or folder name)"
    )
    srv.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja2 chat template (file or text) instead of the model's (default: the model's)",
    )
    srv.add_argument(
        "--max-waiting", type=int, default=1024, help="waiting requests beyond which new ones get 503 (default: 1024)"
    )
    add_limit_args(srv)
    srv.add_argument(
        "--max-schema-bytes",
        type=int,
        default=256 * 1024,
        help="largest output constraint (JSON schema, regex, grammar) a request may send, in bytes (default: 262144)",
    )


def _add_serve_reply_args(srv) -> None:
    """How replies are read: tool calls, reasoning, stored responses, embeddings' pooling."""
    # here rather than at the top: `treadle serve` starts its engine core before these (0.2 s)
    from treadle.server.reasoning import PARSERS as REASONING_PARSERS
    from treadle.server.tools import PARSERS as TOOL_PARSERS

    srv.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_PARSERS,
        help=(
            "how tool calls are read from replies under tool_choice auto; auto: from the chat template, harmony "
            "(gpt-oss) where it writes <|channel|>; openai: harmony (default: auto)"
        ),
    )
    srv.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help=(
            "split <think>...</think> reasoning from the answer into message.reasoning; openai_gptoss: harmony's "
            "analysis channel (on by itself where the chat template writes <|channel|>) (default: off)"
        ),
    )
    srv.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help=(
            "Responses API: responses kept in memory for previous_response_id and GET, oldest dropped first "
            "(default: 1000)"
        ),
    )
    srv.add_argument(
        "--pooling",
        default="last",
        choices=["last", "mean"],
        help=(
            "embeddings: the last token's final hidden state, or the mean over the input's tokens; normalized "
            "(default: last)"
        ),
    )


def _add_serve_replica_args(srv) -> None:
    """Replicas (several engine cores behind one server) and where they run; KV events."""
    srv.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine core processes (replicas) behind this one server, each with its share of the cores (default: 1)",
    )
    srv.add_argument(
        "--data-parallel-backend",
        choices=["mp", "ray"],
        default="mp",
        help=(
            "where the replicas run: child processes of this server (mp), or Ray actors placed on an existing Ray "
            "cluster (ray; see --ray-address) (default: mp)"
        ),
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help=(
            "the Ray cluster to join with --data-parallel-backend ray, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else "
            "the cluster `ray start` began on this machine)"
        ),
    )
    add_routing_args(srv, "replica")
    srv.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help=(
            "publish KV cache events (block stored / removed / all cleared, vLLM's ZMQ wire format) on --host at this "
            "port, the replay socket at the next one; /stats names them (default: off)"
        ),
    )


def add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="chat with a model in the terminal (no server needed)")
    chat.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help=ENGINE_HELP["model"])
    chat.add_argument("--model", "-m", default=None, help=ENGINE_HELP["model"])
    add_engine_args(chat)
    from treadle.chat import cmd_chat

    chat.set_defaults(func=cmd_chat)


def add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="generate from one prompt, streaming to the terminal")
    run.add_argument("prompt", help="the prompt text")
    run.add_argument("--model", "-m", default=None, help=ENGINE_HELP["model"])
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument(
        "--image",
        action="append",
        default=None,
        help="an image for a model that sees (a file, or an http(s) or data: URL; repeat for several): the prompt "
        "goes through the chat template after it",
    )
    run.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    run.add_argument("--temperature", type=float, default=0.7, help="sampling temperature, 0 for greedy (default: 0.7)")
    add_engine_args(run)
    run.set_defaults(func=cmd_run)


def add_bench_parsers(bench_sub) -> None:
    from treadle.bench.serve import add_serve_args, cmd_bench_serve
    from treadle.bench.sweep import add_sweep_args, cmd_bench_sweep
    from treadle.bench.throughput import add_throughput_args, cmd_bench_throughput

    b_serve = bench_sub.add_parser(
        "serve", help="drive an OpenAI-compatible server; vllm bench serve's flags and report"
    )
    add_serve_args(b_serve)
    b_serve.set_defaults(func=cmd_bench_serve)
    b_sweep = bench_sub.add_parser(
        "sweep", help="bench serve over concurrency levels for named servers; CSV, JSON, plots"
    )
    add_serve_args(b_sweep)
    add_sweep_args(b_sweep)
    b_sweep.set_defaults(func=cmd_bench_sweep, num_prompts=None, save_result=True, result_dir="bench-results")
    b_tp = bench_sub.add_parser("throughput", help="the engine alone, no HTTP")
    b_tp.add_argument("--model", "-m", default=None, help=ENGINE_HELP["model"])
    add_throughput_args(b_tp)
    add_engine_args(b_tp)
    b_tp.set_defaults(func=cmd_bench_throughput)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    early = _start_core_early(argv)
    if early is not None:
        _prebuild_tokenizer(argv)
    try:
        command = next((a for a in argv if not a.startswith("-")), None)
        args = build_parser(command).parse_args(argv)
        args.early_core = early
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad settings or an unloadable model: one line, no traceback
        print(f"treadle: error: {e}", file=sys.stderr)
        return 2
    finally:
        if early is not None:
            # a core never taken (bad arguments, replicas, a server that did not start); a no-op once one was
            early.drop()


def _named_model(argv: list[str]) -> str | None:
    """The one model file or folder a `treadle serve` command line names, found as the parser
    will find it where that is unambiguous (one --model/-m, or one argument naming an existing
    path, and no --models-dir); else None (NAME=PATH, several, or the default model)."""
    rest = argv[1:]
    if any(a == "--models-dir" or a.startswith("--models-dir=") for a in rest):
        return None
    given = [v for a, v in zip(rest, rest[1:]) if a in ("--model", "-m")]
    given += [a.split("=", 1)[1] for a in rest if a.startswith("--model=")]
    if not given:
        given = [a for a in rest if not a.startswith("-") and os.path.exists(os.path.expanduser(a))][:1]
    if len(given) != 1 or not os.path.exists(os.path.expanduser(given[0])):
        return None
    return os.path.expanduser(given[0])


def _prebuild_tokenizer(argv: list[str]) -> None:
    """`treadle serve` of one model file or folder: its tokenizer built before the parser's and the
    front end's imports (loader.prebuild_tokenizer: the build's transient peak then adds to ~15 MB
    rather than ~60)."""
    model = _named_model(argv)
    if model is None:
        return
    from treadle.model.loading.loader import prebuild_tokenizer

    prebuild_tokenizer(model)


def _start_core_early(argv: list[str]):
    """For `treadle serve`: an engine core started first, before the parser's imports and the
    front end's, so that its own start-up (Python, torch, the model code: about a second) runs
    beside them; it waits for the model (launchers.SpareCore), repacking the GGUF file the command
    names meanwhile (model/gguf_prefetch.py). Dropped where the arguments turn out not to want it
    (replicas, whose cores start elsewhere; --help)."""
    if argv[:1] != ["serve"] or {"-h", "--help"} & set(argv):
        return None
    from treadle.server.launchers import SpareCore

    model = _named_model(argv)
    early = SpareCore()
    early.fill(prefetch=model if model is not None and os.path.isfile(model) else None)
    return early


if __name__ == "__main__":
    sys.exit(main())


def _mm_limits(text: str) -> dict:
    """--limit-mm-per-prompt's JSON: {"image": N} with N >= 0."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--limit-mm-per-prompt: not JSON ({e})") from None
    if (
        not isinstance(value, dict)
        or set(value) - {"image"}
        or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in value.values())
    ):
        raise ValueError(f'--limit-mm-per-prompt: expected {{"image": N}} with N >= 0, got {text}')
    return {"image": 8, **value}
