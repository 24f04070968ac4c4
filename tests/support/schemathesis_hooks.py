"""Schemathesis hooks for tests/server/test_openapi.py (SCHEMATHESIS_HOOKS=tests.support.schemathesis_hooks):
besides the bodies the schema generates, the same bodies with one string replaced by text that
JSON carries and tokenizers choke on: lone surrogates (escaped in the JSON text, "\\ud800"),
control characters, noncharacters."""

import schemathesis
from hypothesis import strategies as st

ODD = st.sampled_from(
    ["\ud800", "x\udfffy", "\ud83d", "\x00", "a\x1b[0m", "\u0085\u2028", "\ufffe\uffff", "\U0010ffff"]
) | st.text(st.characters(exclude_categories=()), min_size=1, max_size=6)


def _string_paths(value, path=()):
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _string_paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _string_paths(v, (*path, i))


def _replaced(value, path, text):
    if not path:
        return text
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (_replaced(v, rest, text) if k == head else v) for k, v in value.items()}
    return [(_replaced(v, rest, text) if i == head else v) for i, v in enumerate(value)]


@schemathesis.hook
def flatmap_body(context, body):
    paths = list(_string_paths(body))
    if not paths:
        return st.just(body)
    odd = st.tuples(st.sampled_from(paths), ODD).map(lambda pt: _replaced(body, pt[0], pt[1]))
    return st.just(body) | odd
