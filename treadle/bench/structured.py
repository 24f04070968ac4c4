"""Structured-output load for bench serve: which requests carry a JSON schema, and which schema.

A constrained request should cost the server what a real one does (a grammar compiled or found in
its cache, a token mask every step) yet not stop before the others, so that the two classes'
timings compare: every schema here requires an array too long to close within an output length.
"""

import itertools
import json
import random

# An array of at least 1000 integers: closing it takes at least 2000 tokens (a number and a comma
# each), more than a benchmark's output length, so a constrained request runs to max_tokens like an
# unconstrained one instead of finishing early once its JSON is complete.
DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1000}
    },
    "required": ["items"],
}
PADDING_TYPES = ("integer", "string", "boolean", "number")


def schema_bytes(schema: dict) -> int:
    """A schema's size as httpx sends it in a request body (compact JSON)."""
    return len(json.dumps(schema, separators=(",", ":")))


def structured_flags(n: int, ratio: float, seed: int) -> list[bool]:
    """Which of n requests are constrained: each with probability `ratio`, drawn from a stream of
    its own for the seed, so that the prompts (drawn from the seed's main stream) stay as they were."""
    rng = random.Random(f"structured-output:{seed}")
    return [rng.random() < ratio for _ in range(n)]


def distinct_schemas(k: int, nbytes: int, seed: int) -> list[dict]:
    """k schemas of at least `nbytes` (and at least one padding property) each, distinct from each
    other and from another seed's, so that each is a miss in a server's grammar cache: uniquely
    named optional properties, then DEFAULT_SCHEMA's required array so that none can close."""
    tag = f"{random.Random(f'structured-output-schemas:{seed}').getrandbits(32):08x}"
    return [_padded_schema(f"f{tag}_{i}_", nbytes) for i in range(k)]


def _padded_schema(prefix: str, nbytes: int) -> dict:
    props = {}
    size = schema_bytes(DEFAULT_SCHEMA)
    while size < nbytes or not props:
        name, spec = f"{prefix}{len(props)}", {"type": PADDING_TYPES[len(props) % len(PADDING_TYPES)]}
        props[name] = spec
        size += schema_bytes({name: spec}) - 1  # the entry and its comma, without the braces
    return {**DEFAULT_SCHEMA, "properties": {**props, **DEFAULT_SCHEMA["properties"]}}


def base_schema(args) -> dict:
    """The schema of --structured-output-schema FILE, else DEFAULT_SCHEMA."""
    if not args.structured_output_schema:
        return DEFAULT_SCHEMA
    with open(args.structured_output_schema, encoding="utf-8") as f:
        return json.load(f)


def check_structured_args(args) -> None:
    """Refuse flag combinations that would otherwise be silently ignored."""
    if not 0.0 <= args.structured_output_ratio <= 1.0:
        raise SystemExit(
            f"treadle bench: --structured-output-ratio must be in [0, 1], got {args.structured_output_ratio}"
        )
    if args.structured_output_schema_bytes and not args.structured_output_distinct_schemas:
        raise SystemExit("treadle bench: --structured-output-schema-bytes needs --structured-output-distinct-schemas")
    if args.structured_output_distinct_schemas and args.structured_output_schema:
        raise SystemExit(
            "treadle bench: --structured-output-distinct-schemas generates its schemas; drop --structured-output-schema"
        )
    given = args.structured_output_schema or args.structured_output_distinct_schemas
    if given and not args.structured_output_ratio:
        raise SystemExit("treadle bench: the structured-output schema flags need --structured-output-ratio > 0")


def request_schemas(args, n: int, seed: int) -> list[dict | None]:
    """The schema each of n requests carries (None: unconstrained); the constrained ones take the
    distinct schemas in turn, or all the base schema."""
    flags = structured_flags(n, args.structured_output_ratio, seed)
    k = args.structured_output_distinct_schemas
    pool = itertools.cycle(distinct_schemas(k, args.structured_output_schema_bytes, seed) if k else [base_schema(args)])
    return [next(pool) if flag else None for flag in flags]
