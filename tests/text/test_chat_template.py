"""Chat templates are someone else's code: known template-injection payloads, and templates that
build huge values or loop too long, are clear errors (ValueError naming what happened), fast."""

import time

import pytest

from treadle.text.chat_template import MAX_CHARS, render

MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}

# From public write-ups of Jinja2 template injection (SSTI); each is refused, or reaches nothing
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__code__.co_consts }}",
    "{{ messages.append({'role': 'system'}) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ request.application.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__init__.__globals__ }}",
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{{ (messages|attr('__class__')).__mro__ }}",
    "{{ namespace.__init__.__globals__ }}",
]

HUGE = [
    ("{{ 'a' * 1000000000 }}", "repetition"),
    ("{{ 10 ** 1000000 }}", "bits"),
    ("{{ '%1000000000d' % 1 }}", "width"),
    ("{{ '%1000000000d'|format(1) }}", "width"),
    ("{{ '{:1000000000}'.format(1) }}", "width"),
    ("{{ 'x'|center(1000000000) }}", "at most"),
    ("{{ 'x'.ljust(1000000000) }}", "at most"),
    ("{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "string"),
    ("{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "sum"),
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = ns.l * 2 %}{% endfor %}",
        "repetition of 2097152 items",
    ),
    ("{{ ('x' * 10000)|replace('', 'y' * 10000) }}", "replacement"),
    ("{{ (range(60000)|list)|join('x' * 4000) }}", "join"),
    ("{{ ('\t' * 100000).expandtabs(4000) }}", "tabs"),
    ("{{ ('a ' * 100000)|wordwrap(1, wrapstring='y' * 4000) }}", "wrapped"),
    ("{{ ([[1] * 4000] * 4000)|sum(start=[]) }}", "items"),
    ("{{ (range(60000)|list)|tojson(indent=4000) }}", "JSON"),
    ("{{ [1]|batch(100000000, 'x')|list }}", "at most"),
    ("{% set a = 'a' * 16000000 %}{% set b = [a] * 500 %}{{ b }}", "output value"),
    ("{% set a = 'a' * 16000000 %}{% set b = [a] * 500 %}{{ b|string|length }}", "a text"),
    ("{% set a = 'a' * 16000000 %}{% set b = [a] * 500 %}{{ '%s' % b }}", "formatted"),
    ("{% set a = 'a' * 16000000 %}{% set b = [a] * 500 %}{{ b|tojson }}", "JSON"),
    ("{% set a = 'a' * 10000000 %}{% set x %}{% for i in range(500) %}{{ a }}{% endfor %}{% endset %}", "block"),
    ("{% set a = 'a' * 10000000 %}{% macro m() %}{{ a }}{{ a }}{% endmacro %}{{ m() }}", "block"),
]

SLOW = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    (
        "{% macro f(n) %}{% for i in range(100000) %}{{ f(n) if false }}{% endfor %}{% endmacro %}"
        "{% for i in range(100000) %}{{ f(1) }}{% endfor %}"
    ),
]


@pytest.mark.parametrize("payload", ESCAPES)
def test_template_injection_payloads_are_refused(payload):
    try:
        out = render(payload, MESSAGES)
    except ValueError as e:
        assert "SecurityError" in str(e) or "UndefinedError" in str(e), e
    else:
        assert out == ""  # an unsafe attribute reads as undefined: nothing of the interpreter shows


@pytest.mark.parametrize("payload,said", HUGE)
def test_huge_values_are_refused_before_they_are_built(payload, said):
    start = time.monotonic()
    with pytest.raises(ValueError, match="chat template failed") as e:
        render(payload, MESSAGES, time_limit=30)
    assert said in str(e.value)
    assert time.monotonic() - start < 5  # refused, not computed and then measured


@pytest.mark.parametrize("payload", SLOW)
def test_templates_that_loop_too_long_stop_at_the_time_limit(payload):
    start = time.monotonic()
    with pytest.raises(ValueError, match="ran longer than 0.5 s"):
        render(payload, MESSAGES, time_limit=0.5)
    assert time.monotonic() - start < 3


def test_output_is_bounded_and_ordinary_templates_still_work():
    with pytest.raises(ValueError, match="output passed 1000 characters"):
        render("{% for i in range(100000) %}xxxxxxxx{% endfor %}", MESSAGES, max_chars=1000)
    with pytest.raises(ValueError, match="does not parse"):
        render("{% for %}", MESSAGES)
    with pytest.raises(ValueError, match="TemplateError: no system role"):
        render("{{ raise_exception('no system role') }}", MESSAGES)
    numbers = (
        "{{ 5000|string }} {{ [[1], [2]]|sum(start=[]) }} {{ x|default(10000) }} "
        "{% set ns = namespace(n=100000) %}{{ ns.n }} {{ 'ab'|center(6) }}|"
    )
    assert render(numbers, MESSAGES) == "5000 [1, 2] 10000 100000   ab  |"
    assert (
        render("{{ messages|tojson(indent=2) }}", MESSAGES)
        == '[\n  {\n    "role": "user",\n    "content": "hi"\n  }\n]'
    )
    assert (
        render("{{ messages|tojson(separators=(',', ':')) }}", MESSAGES) == '[{"role":"user","content":"hi"}]'
    )  # Kimi-K2's
    assert (
        render("{{ 'Knowledge cutoff: 20240601, %s' % 'today' }} {{ '{} 1234567'.format(7) }}", MESSAGES)
        == "Knowledge cutoff: 20240601, today 7 1234567"
    )
    big = "y" * (MAX_CHARS // 2)  # a long conversation is not a huge value
    assert (
        len(render("{% for m in messages %}{{ m.content ~ '|' }}{% endfor %}", {"messages": [{"content": big}]}))
        == len(big) + 1
    )
