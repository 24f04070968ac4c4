"""The developers' set of JSON schemas for structured output tests: (prompt, schema) pairs that use
nested objects, arrays with min/max items, enums, string patterns and formats, numbers with bounds,
anyOf, $ref / $defs, required and optional properties, additionalProperties false."""

STRICT = {"additionalProperties": False}


def obj(props: dict, required: list | None = None, **extra) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        **STRICT,
        **extra,
    }


S = {"type": "string"}
I = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}

SCHEMAS = [
    (
        "Describe a person named Alice who is 30 years old.",
        obj({"name": S, "age": {**I, "minimum": 0, "maximum": 150}}),
    ),
    (
        "Give the capital of France and its population.",
        obj({"city": S, "country": S, "population": {**I, "minimum": 0}}),
    ),
    ("List three fruits.", obj({"fruits": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}})),
    ("Rate the movie Inception.", obj({"title": S, "rating": {**N, "minimum": 0, "maximum": 10}, "recommended": B})),
    (
        "What is the weather like today?",
        obj(
            {
                "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                "temperature_c": {**I, "minimum": -60, "maximum": 60},
            }
        ),
    ),
    (
        "Create a user account for bob.",
        obj({"username": {**S, "pattern": "^[a-z][a-z0-9_]{2,15}$"}, "email": {**S, "format": "email"}}),
    ),
    (
        "Schedule a meeting for next Monday.",
        obj(
            {
                "topic": S,
                "date": {**S, "format": "date"},
                "attendees": {"type": "array", "items": S, "minItems": 1, "maxItems": 4},
            }
        ),
    ),
    (
        "Describe a book.",
        obj({"title": S, "author": obj({"first": S, "last": S}), "year": {**I, "minimum": 1400, "maximum": 2030}}),
    ),
    (
        "Give a color in RGB.",
        obj(
            {
                "r": {**I, "minimum": 0, "maximum": 255},
                "g": {**I, "minimum": 0, "maximum": 255},
                "b": {**I, "minimum": 0, "maximum": 255},
            }
        ),
    ),
    ("Is the sky blue? Answer with a reason.", obj({"answer": B, "reason": {**S, "maxLength": 80}})),
    (
        "Describe a laptop for sale.",
        obj({"model": S, "price": {**N, "exclusiveMinimum": 0, "maximum": 10000}, "in_stock": B}, ["model", "price"]),
    ),
    (
        "Describe a shape.",
        {
            "anyOf": [
                obj({"kind": {"const": "circle"}, "radius": {**N, "minimum": 0}}),
                obj({"kind": {"const": "square"}, "side": {**N, "minimum": 0}}),
            ]
        },
    ),
    (
        "Give the address of a company.",
        {
            "$defs": {"address": obj({"street": S, "city": S, "zip": {**S, "pattern": "^[0-9]{5}$"}})},
            **obj({"company": S, "address": {"$ref": "#/$defs/address"}}),
        },
    ),
    (
        "Log an event with a unique id.",
        obj({"id": {**S, "format": "uuid"}, "level": {"enum": ["debug", "info", "warning", "error"]}, "message": S}),
    ),
    (
        "Record a server.",
        obj({"hostname": S, "ip": {**S, "format": "ipv4"}, "port": {**I, "minimum": 1, "maximum": 65535}}),
    ),
    ("Give a timestamp for a deployment.", obj({"service": S, "deployed_at": {**S, "format": "date-time"}})),
    (
        "Describe a pet.",
        obj(
            {
                "name": S,
                "species": {"enum": ["dog", "cat", "bird", "fish"]},
                "age": {**I, "minimum": 0, "maximum": 40},
                "nickname": S,
            },
            ["name", "species"],
        ),
    ),
    (
        "Give the score of a football match.",
        obj(
            {
                "home": S,
                "away": S,
                "score": {"type": "array", "items": {**I, "minimum": 0, "maximum": 20}, "minItems": 2, "maxItems": 2},
            }
        ),
    ),
    (
        "Describe a recipe.",
        obj(
            {
                "name": S,
                "ingredients": {
                    "type": "array",
                    "items": obj({"item": S, "grams": {**I, "minimum": 1, "maximum": 5000}}),
                    "minItems": 1,
                    "maxItems": 4,
                },
            }
        ),
    ),
    ("Translate 'hello' into Spanish.", obj({"source": S, "target": S, "language": {"enum": ["es", "fr", "de"]}})),
    ("Give a phone contact.", obj({"name": S, "phone": {**S, "pattern": "^\\+?[0-9]{7,12}$"}})),
    (
        "Summarize a product review.",
        obj(
            {
                "sentiment": {"enum": ["positive", "neutral", "negative"]},
                "stars": {**I, "minimum": 1, "maximum": 5},
                "summary": {**S, "maxLength": 100},
            }
        ),
    ),
    (
        "Describe a tree of two nodes.",
        {
            "$defs": {
                "node": obj(
                    {"value": I, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                    ["value"],
                )
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "Give a flight booking.",
        obj(
            {
                "from": {**S, "pattern": "^[A-Z]{3}$"},
                "to": {**S, "pattern": "^[A-Z]{3}$"},
                "passengers": {**I, "minimum": 1, "maximum": 9},
            }
        ),
    ),
    ("Return an HTTP status.", obj({"code": {"enum": [200, 201, 400, 404, 500]}, "ok": B})),
    (
        "Give coordinates of London.",
        obj({"lat": {**N, "minimum": -90, "maximum": 90}, "lon": {**N, "minimum": -180, "maximum": 180}}),
    ),
    (
        "Describe a task in a todo list.",
        obj(
            {
                "task": S,
                "done": B,
                "priority": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"}]},
            }
        ),
    ),
    (
        "Give a short poem title and its lines.",
        obj(
            {
                "title": {**S, "minLength": 1, "maxLength": 40},
                "lines": {"type": "array", "items": {**S, "maxLength": 60}, "minItems": 2, "maxItems": 4},
            }
        ),
    ),
    (
        "Describe an employee.",
        obj(
            {
                "name": S,
                "department": {"enum": ["engineering", "sales", "support"]},
                "manager": {"anyOf": [S, {"type": "null"}]},
            }
        ),
    ),
    (
        "Give a version number of a software release.",
        obj({"name": S, "version": {**S, "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}, "stable": B}),
    ),
    (
        "Describe a car.",
        obj({"make": S, "model": S, "year": {**I, "minimum": 1900, "maximum": 2030}, "electric": B}, ["make", "model"]),
    ),
    (
        "Give a set of tags for a blog post.",
        obj(
            {
                "post": S,
                "tags": {
                    "type": "array",
                    "items": {"enum": ["python", "ml", "web", "data"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
]
