"""Chat templates, rendered as the untrusted code they are.

A template comes from a model file (GGUF metadata, tokenizer_config.json) or a --chat-template
file: someone else's Jinja2 program, run on every chat request. It runs in Jinja2's immutable
sandbox (no `__class__`, `__globals__`, attributes of callables or in-place mutation), with
Hugging Face's conventions (`tojson`, `raise_exception`, `strftime_now`, loop controls), and
within bounds a sandbox alone does not give:

- time: a trace function, active only while this render runs on this thread, checks the deadline
  at every line of the template's compiled code (a loop that calls nothing is still a line);
- size: the output, and every value an operator, a concatenation, a call or a filter makes, is
  at most `max_chars`; an operation whose result is known to be too large (`"a" * 10**9`,
  `"%999999999d"`, `x.center(10**9)`, `10**10**9`) is refused before it is computed, not after.

Any failure (a syntax error, a refused operation, the template's own `raise_exception`) is a
`ValueError` that says what happened.
"""

import functools
import json
import re
import sys
import threading
import time
from datetime import datetime

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.filters import make_attrgetter
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_CHARS = 16 * 1024 * 1024  # a rendered conversation, or any string built on the way to it
MAX_ITEMS = 1024 * 1024  # any list, tuple or dict built on the way
TIME_LIMIT = 5.0  # seconds for one render
MAX_INT_ARGUMENT = 4096  # a width or count passed to a call or filter (range has its own bound)
MAX_INT_BITS = 65536  # integers the template computes

_TEMPLATE_FILE = "<template>"
# widths and precisions: printf's %[flags][width][.precision]type, and str.format's {field:spec}
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?[a-zA-Z%]")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_DIGITS = re.compile(r"\d+")


# filters whose numeric parameters say how much to make (the value itself may be any number)
WIDTH_FILTERS = frozenset(["center", "indent", "wordwrap", "batch", "slice", "truncate"])


class TemplateLimit(jinja2.TemplateError):
    """The template went past one of its bounds."""


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    """Hugging Face's tojson. Its size is estimated before json.dumps builds it; an indented dump
    (whose indentation can be most of it) is written piece by piece and stops at the limit."""
    bounds = _bounds()
    bounds.check_planned(estimated_chars(value, bounds.max_chars), "a JSON text")
    if indent is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)
    parts, size = [], 0
    for piece in json.JSONEncoder(
        indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators
    ).iterencode(value):
        size += len(piece)
        bounds.check_planned(size, "a JSON text")
        parts.append(piece)
    return "".join(parts)


@jinja2.pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """Jinja's sum, in linear time when it adds lists or tuples (Python's sum copies the growing
    list at every item: a million one-item lists would be a trillion copies)."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    if not isinstance(start, (list, tuple)):
        return sum(iterable, start)
    out, bounds = list(start), _bounds()
    for item in iterable:
        if not isinstance(item, type(start)):
            raise TypeError(
                f'can only concatenate {type(start).__name__} (not "{type(item).__name__}") to {type(start).__name__}'
            )
        out.extend(item)
        bounds.check_size(out, "a sum")
    return type(start)(out)


class _Bounds:
    """The running render's deadline and size limit (one render per thread at a time)."""

    def __init__(self, deadline: float, max_chars: int, time_limit: float):
        self.deadline, self.max_chars, self.time_limit = deadline, max_chars, time_limit

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"the chat template ran longer than {self.time_limit:g} s")

    def check_size(self, value, what: str = "a value") -> None:
        if isinstance(value, (str, bytes)) and len(value) > self.max_chars:
            raise TemplateLimit(f"the chat template built {what} of {len(value)} characters; at most {self.max_chars}")
        if isinstance(value, (list, tuple, dict, set)) and len(value) > MAX_ITEMS:
            raise TemplateLimit(f"the chat template built {what} of {len(value)} items; at most {MAX_ITEMS}")
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(
                f"the chat template computed an integer of {value.bit_length()} bits; at most {MAX_INT_BITS}"
            )

    def check_planned(self, size: int, what: str, of=str) -> None:
        """A result of `size` characters (or items, if `of` is not a string type) is about to be built."""
        text = of in (str, bytes)
        limit = self.max_chars if text else MAX_ITEMS
        if size > limit:
            raise TemplateLimit(
                f"the chat template asked for {what} of {size} {'characters' if text else 'items'}; at most {limit}"
            )

    def check_format(self, text, braces: bool = False) -> None:
        """A printf (or, with `braces`, str.format) pattern with a huge width or precision."""
        if not isinstance(text, str):
            return
        if braces:
            numbers = [d for m in _BRACE_SPEC.finditer(text) for d in _DIGITS.findall(m.group(1))]
        else:
            numbers = [d for m in _PRINTF_SPEC.finditer(text) for d in m.groups() if d]
        for d in numbers:
            if len(d) > 6 or int(d) > MAX_INT_ARGUMENT:
                raise TemplateLimit(f"the chat template formats with a width of {d}; at most {MAX_INT_ARGUMENT}")


_local = threading.local()


def _bounds() -> _Bounds:
    bounds = getattr(_local, "bounds", None)
    if bounds is None:  # a template object used outside render(): no bounds were set
        raise TemplateLimit("chat templates are rendered through treadle.text.chat_template.render")
    return bounds


def _sequence_length(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class _GuardedCodeGenerator(CodeGenerator):
    """`a ~ b` (string concatenation) goes through the environment, which checks its size."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

    def __init__(self):
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], finalize=_finalize
        )
        for name, f in list(self.filters.items()):
            self.filters[name] = _guarded_filter(name, f)
        self.filters["tojson"] = _guarded_filter("tojson", _tojson)
        self.filters["sum"] = _guarded_filter("sum", _sum)
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def checked_concat(self, parts) -> str:
        """`a ~ b`: the parts' text, estimated before any is built."""
        bounds = _bounds()
        bounds.check_planned(sum(estimated_chars(p, bounds.max_chars) for p in parts), "a string")
        return "".join(str(p) for p in parts)

    @staticmethod
    def concat(parts) -> str:
        """The join of a block's output ({% set %}...{% endset %}, macros, caller(), {% filter %})."""
        parts = list(parts)
        _bounds().check_planned(sum(len(p) for p in parts), "a block's text")
        return "".join(parts)

    def call_binop(self, context, operator, left, right):
        bounds = _bounds()
        bounds.check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                length = _sequence_length(seq)
                if length is not None and isinstance(n, int):
                    bounds.check_planned(length * max(n, 0), "a repetition", type(seq))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left).bit_length() - 1, 0) * right > MAX_INT_BITS:
                raise TemplateLimit(
                    f"the chat template computes {left} ** {right}, an integer of more than {MAX_INT_BITS} bits"
                )
        elif operator == "+":
            a, b = _sequence_length(left), _sequence_length(right)
            if a is not None and b is not None:
                bounds.check_planned(a + b, "a sum", type(left))
        elif operator == "%":
            bounds.check_format(left)
            bounds.check_planned(
                estimated_chars(right, bounds.max_chars) + (len(left) if isinstance(left, str) else 0),
                "a formatted text",
            )
        result = super().call_binop(context, operator, left, right)
        bounds.check_size(result)
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        bounds = _bounds()
        bounds.check_time()
        receiver = getattr(__obj, "__self__", None)
        if isinstance(receiver, str) and args:  # widths (center, ljust, zfill, ...), and the amplifiers
            _check_arguments(args, kwargs)
            name = getattr(__obj, "__name__", "")
            if name == "replace" and len(args) >= 2:
                _check_replace(bounds, receiver, args[0], args[1])
            elif name == "join":
                _check_join(bounds, receiver, args[0])
            elif name == "expandtabs" and isinstance(args[0], int):
                bounds.check_planned(len(receiver) + receiver.count("\t") * args[0], "expanded tabs")
        result = super().call(__context, __obj, *args, **kwargs)
        bounds.check_size(result)
        return result

    def wrap_str_format(self, value):
        """`str.format` and `format_map`, which the sandbox wraps: no huge widths either."""
        if isinstance(getattr(value, "__self__", None), str) and getattr(value, "__name__", "") in (
            "format",
            "format_map",
        ):
            _bounds().check_format(value.__self__, braces=True)
        return super().wrap_str_format(value)


def estimated_chars(value, budget: int) -> int:
    """About how many characters str(value) has, counted without building it; stops counting once
    past `budget` (a list of a million references to one long string is not walked to the end)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        items = (x for pair in value.items() for x in pair)
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = iter(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 2
    else:
        return 32  # other numbers, None, Undefined, a callable's repr
    total = 2
    for item in items:
        total += 2 + estimated_chars(item, budget - total)
        if total > budget:
            break
    return total


def _finalize(value):
    """What `{{ value }}` prints: its text estimated first, so a container of huge strings is refused unbuilt."""
    bounds = _bounds()
    bounds.check_planned(estimated_chars(value, bounds.max_chars), "an output value")
    return value


def _check_arguments(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARGUMENT:
            raise TemplateLimit(f"the chat template passes {a} to a call; arguments are at most {MAX_INT_ARGUMENT}")


def _check_replace(bounds: _Bounds, text, old, new) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        occurrences = len(text) + 1 if not old else text.count(old)
        bounds.check_planned(len(text) + occurrences * (len(new) - len(old)), "a replacement")


def _check_join(bounds: _Bounds, separator, items) -> None:
    if isinstance(separator, str) and hasattr(items, "__len__"):
        texts = sum(len(x) for x in items if isinstance(x, str)) if len(items) <= MAX_ITEMS else 0
        bounds.check_planned(len(separator) * max(len(items) - 1, 0) + texts, "a join")


def _planned_by_filter(bounds: _Bounds, name: str, values: list, kwargs: dict) -> None:
    """The filters whose output can be many times their input, estimated before they run."""
    text = values[0] if values and isinstance(values[0], str) else None
    arg = values[1] if len(values) > 1 else None
    if name == "format" and values:
        bounds.check_format(values[0])
    elif name == "replace" and len(values) >= 3:
        _check_replace(bounds, values[0], values[1], values[2])
    elif name == "join" and values:
        _check_join(bounds, kwargs.get("d", arg if isinstance(arg, str) else ""), values[0])
    elif name in ("string", "pprint", "e", "escape", "forceescape", "safe") and values:
        bounds.check_planned(estimated_chars(values[0], bounds.max_chars), "a text")
    elif name == "indent" and text is not None:
        width = kwargs.get("width", arg if arg is not None else 4)
        width = len(width) if isinstance(width, str) else int(width)
        bounds.check_planned(len(text) + (text.count("\n") + 1) * width, "an indented text")
    elif name == "wordwrap" and text is not None:
        width = max(int(kwargs.get("width", arg if arg is not None else 79)), 1)
        wrap = kwargs.get("wrapstring", values[3] if len(values) > 3 else "\n") or "\n"
        bounds.check_planned(len(text) + (len(text) // width + text.count(" ") + 1) * len(wrap), "a wrapped text")


def _guarded_filter(name: str, f):
    """A filter with the bounds a call has: no huge widths or counts, a result of bounded size."""

    @functools.wraps(f)  # keeps Jinja's pass_context / pass_environment marks
    def guarded(*args, **kwargs):
        bounds = _bounds()
        bounds.check_time()
        values = [a for a in args if not isinstance(a, (Context, jinja2.Environment, EvalContext))]
        if name in WIDTH_FILTERS:
            _check_arguments(values[1:], kwargs)
        _planned_by_filter(bounds, name, values, kwargs)
        result = f(*args, **kwargs)
        bounds.check_size(result)
        return result

    return guarded


_environment = GuardedEnvironment()
_compiled: dict[str, jinja2.Template] = {}


def compile_template(source: str) -> jinja2.Template:
    template = _compiled.get(source)
    if template is None:
        try:
            template = _environment.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e}") from e
        except RecursionError:
            raise ValueError("chat template does not parse: it is nested too deeply") from None
        if len(_compiled) >= 64:  # --chat-template and the model's own, normally; never unbounded
            _compiled.pop(next(iter(_compiled)))
        _compiled[source] = template
    return template


def render(source: str, context: dict, *, max_chars: int = MAX_CHARS, time_limit: float = TIME_LIMIT) -> str:
    """The template's output for `context`, within the bounds; ValueError if it fails or passes one."""
    template = compile_template(source)
    bounds = _Bounds(time.monotonic() + time_limit, max_chars, time_limit)

    def line(frame, event, arg):  # noqa: ARG001 (a local trace function's signature)
        """At each line of the template's code: past the deadline, the template stops there."""
        if event == "line" and time.monotonic() > bounds.deadline:
            raise TemplateLimit(f"the chat template ran longer than {time_limit:g} s")
        return line

    def trace(frame, event, arg):  # noqa: ARG001 (sys.settrace's signature)
        """Frames of the template's code are traced line by line; nothing else is (nor interrupted)."""
        return line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous_bounds, _local.bounds = getattr(_local, "bounds", None), bounds
    previous_trace = sys.gettrace()
    sys.settrace(trace)
    try:
        parts, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                raise TemplateLimit(f"the chat template's output passed {max_chars} characters")
            parts.append(piece)
        return "".join(parts)
    except Exception as e:  # the template is the model's code: any failure is the template's
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
    finally:
        sys.settrace(previous_trace)
        _local.bounds = previous_bounds
