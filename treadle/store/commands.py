"""`treadle pull / list / show / rm / cp`: the model store from the terminal (Ollama's verbs)."""

import json
import sys
import time

from treadle.store.inspect import human_bytes, human_count
from treadle.store.store import ModelStore, StoreError, entry_summary

MODELS_DIR_HELP = "the model store (default: $TREADLE_MODELS, else ~/.cache/treadle/models)"


def _store(args) -> ModelStore:
    return ModelStore(args.models_dir)


def _fail(e: Exception) -> int:
    print(f"treadle: error: {e}", file=sys.stderr)
    return 1


def cmd_pull(args) -> int:
    store = _store(args)
    try:
        m = store.pull(args.ref, name=args.name, progress=not args.quiet, log=lambda text: print(text, file=sys.stderr))
    except StoreError as e:
        return _fail(e)
    print(f"{m['name']}: {human_bytes(sum(f['size'] for f in m['files']))} in {m['dir']}")
    return 0


def _ago(t: float) -> str:
    s = max(0, time.time() - t)
    for unit, n in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s >= n:
            return f"{int(s // n)} {unit} ago"
    return "just now"


def cmd_list(args) -> int:
    rows = [entry_summary(m) for m in _store(args).manifests()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [("NAME", "SIZE", "ARCH", "PARAMS", "QUANT", "CONTEXT", "MODIFIED")]
    for r in rows:
        ctx = str(r["context_length"] or "")
        table.append(
            (
                r["name"],
                human_bytes(r["size"]),
                r["architecture"],
                human_count(r["parameters"]),
                r["quantization"],
                ctx,
                _ago(r["modified"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def cmd_show(args) -> int:
    store = _store(args)
    try:
        m = store.get(args.name)
        info = store.info(args.name)
    except StoreError as e:
        return _fail(e)
    if args.template:
        print(info.chat_template)
        return 0
    if args.license:
        print(info.license)
        return 0
    if args.parameters:
        for key, value in info.defaults.items():
            print(f"{key} {json.dumps(value)}")
        return 0
    if args.json:
        print(
            json.dumps({"name": m["name"], "source": m["source"], "path": m["model_path"], **info.as_dict()}, indent=1)
        )
        return 0
    print("  Model")
    for label, value in (
        ("architecture", info.architecture),
        ("parameters", human_count(info.parameters)),
        ("context length", info.context_length or ""),
        ("quantization", info.quantization),
        ("format", info.format),
        ("size", human_bytes(info.size)),
        ("source", m["source"]),
    ):
        print(f"    {label:<20}{value}")
    if info.defaults:
        print("\n  Parameters")
        for key, value in info.defaults.items():
            print(f"    {key:<20}{json.dumps(value)}")
    if info.license:
        print("\n  License")
        print(f"    {info.license}")
    return 0


def cmd_rm(args) -> int:
    store = _store(args)
    for name in args.names:
        try:
            store.remove(name)
        except StoreError as e:
            return _fail(e)
        print(f"deleted '{name}'")
    return 0


def _parameter(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as JSON where it parses (0.2, 64, ["a"]) and as a string otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise StoreError(f"--param {text!r}: expected KEY=VALUE, e.g. temperature=0.2")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def cmd_cp(args) -> int:
    store = _store(args)
    try:
        params = dict(_parameter(p) for p in args.param)
        m = store.copy(args.source, args.dest)
        if params:
            try:
                store.set_parameters(m["name"], {**store.parameters(m["name"]), **params})
            except ValueError:
                store.remove(m["name"])  # a copy with parameters it refused is not left behind
                raise
    except (StoreError, ValueError) as e:
        return _fail(e)
    print(
        f"copied '{args.source}' to '{m['name']}'"
        + (f" with {', '.join(f'{k}={v}' for k, v in params.items())}" if params else "")
    )
    return 0


def add_store_parsers(sub) -> None:
    p = sub.add_parser(
        "pull",
        help="fetch a model into the store: hf://org/repo[:QUANT|:FILE.gguf], org/repo, an https:// GGUF, "
        "or a local path",
    )
    p.add_argument(
        "ref",
        help="hf://org/repo[:QUANT|:FILE.gguf], org/repo, https://.../model.gguf, or a local .gguf file / HF folder",
    )
    p.add_argument(
        "--name",
        default=None,
        help="the name to keep it under (default: the repository or file name, and its quant tag)",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", aliases=["ls"], help="the models in the store")
    ls.add_argument("--json", action="store_true", help="as JSON")
    ls.set_defaults(func=cmd_list)
    s = sub.add_parser(
        "show", help="a stored model: architecture, parameters, context, quantization, defaults, license"
    )
    s.add_argument("name")
    for flag, what in (
        ("--template", "its chat template"),
        ("--parameters", "its generation defaults"),
        ("--license", "its license"),
    ):
        s.add_argument(flag, action="store_true", help=f"print {what} only")
    s.add_argument("--json", action="store_true", help="everything, as JSON")
    s.set_defaults(func=cmd_show)
    r = sub.add_parser("rm", help="delete models from the store")
    r.add_argument("names", nargs="+")
    r.set_defaults(func=cmd_rm)
    c = sub.add_parser("cp", help="copy a stored model under another name (hard links: no second copy of the weights)")
    c.add_argument("source")
    c.add_argument("dest")
    c.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE",
        help="a generation default of the copy, in Ollama's PARAMETER names "
        "(temperature, top_p, top_k, min_p, repeat_penalty, "
        "num_predict, stop, seed, presence_penalty, frequency_penalty); repeatable",
    )  # fmt: skip
    c.set_defaults(func=cmd_cp)
    for parser in (p, ls, s, r, c):
        parser.add_argument("--models-dir", default=None, help=MODELS_DIR_HELP)
