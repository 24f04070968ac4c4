"""The model store: models by name in one directory (`--models-dir`, $TREADLE_MODELS, default
~/.cache/treadle/models), as `treadle pull / list / show / rm / cp` and the server's on-demand
loading see them.

    DIR/<entry>/manifest.json   the name, where it came from, its files with sizes and sha256s, and
                                what it is (architecture, quantization, context length, ...)
    DIR/<entry>/<files>         one .gguf file, or a Hugging Face folder's files
    DIR/<entry>/params.json     optional: generation defaults in Ollama's names
    DIR/.partial/*.part         downloads in progress (resumed by the next pull)
    DIR/.tmp-*                  an entry being assembled

An entry appears only whole: it is assembled in a .tmp- folder, its manifest written last, and
renamed into place; a cancelled pull leaves nothing listed. A reference is one of:

    hf://org/repo[:FILE.gguf|:QUANT]   org/repo[:...]   a Hugging Face repository, through
                                                         huggingface_hub's endpoint, token and cache
    https://host/path/model.gguf                         a plain URL
    ./model.gguf  /path/to/hf-folder                     a local file or folder, imported
"""

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from urllib.parse import quote

from treadle.store.fetch import Expected, FetchError, download, file_sha256, part_path, verify
from treadle.store.inspect import PARAMS_FILE, InspectError, describe, ollama_parameters
from treadle.utils import cache_root

MANIFEST = "manifest.json"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}(:[A-Za-z0-9._-]{1,100})?$")
SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# an HF folder's files a model needs (weights, config, tokenizer, template, card)
FOLDER_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|"
    r"chat_template\.jinja|chat_template\.json|[^/]*\.safetensors|model\.safetensors\.index\.json|vocab\.json|merges\.txt|"
    r"tokenizer\.model|README\.md|LICENSE(\.txt|\.md)?)$"
)
DEFAULT_QUANT = "Q4_K_M"  # Ollama's choice where a repository holds several


class StoreError(RuntimeError):
    """A pull, import or lookup that cannot be done; the message names what and why."""


class NotFound(StoreError):
    pass


def default_models_dir() -> str:
    return os.path.expanduser(os.environ.get("TREADLE_MODELS") or os.path.join(cache_root(), "models"))


def full_name(name: str) -> str:
    """Ollama's convention: a name without a tag is `name:latest`."""
    return name if ":" in name else f"{name}:latest"


def check_name(name: str) -> str:
    if not NAME.match(name) or ".." in name or name.endswith("/"):
        raise StoreError(f"{name!r} is not a model name: letters, digits, '.', '_', '-', '/', and one ':tag'")
    return full_name(name)


@dataclass(frozen=True)
class Ref:
    kind: str  # "hf" | "url" | "local"
    target: str  # repo id, URL, or path
    selector: str = ""  # hf: a file name or a quantization tag


def parse_ref(text: str) -> Ref:
    if text.startswith(("https://", "http://")):
        return Ref("url", text)
    if os.path.exists(os.path.expanduser(text)) or text.startswith(("/", "./", "../", "~")):
        return Ref("local", os.path.abspath(os.path.expanduser(text)))
    body = text.removeprefix("hf://").removeprefix("hf.co/").removeprefix("huggingface.co/")
    repo, _, selector = body.partition(":")
    if not re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", repo):
        raise StoreError(
            f"{text!r}: not a model reference "
            "(hf://org/repo[:FILE.gguf|:QUANT], org/repo, https://.../model.gguf, or a local path)"
        )
    return Ref("hf", repo, selector)


def default_name(ref: Ref, file: str | None = None) -> str:
    if ref.kind == "hf":
        base = ref.target.split("/")[-1].lower()
        tag = ref.selector.removesuffix(".gguf") if ref.selector else (_quant_tag(file) if file else "")
        return f"{base}:{tag}" if tag else f"{base}:latest"
    base = os.path.basename(os.path.normpath(ref.target.split("?")[0]))
    return full_name(base.removesuffix(".gguf") or "model")


def _quant_tag(file: str) -> str:
    m = re.search(r"(?i)(?<![A-Za-z0-9])((?:I?Q\d[A-Z0-9_]*)|F16|BF16|F32)(?=\.gguf$)", os.path.basename(file))
    return m.group(1).upper() if m else ""


class ModelStore:
    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(os.path.expanduser(root or default_models_dir()))
        self.partial = os.path.join(self.root, ".partial")

    # ------------------------------------------------------------ reading

    def entry_dir(self, name: str) -> str:
        return os.path.join(self.root, quote(full_name(name), safe=""))

    def manifests(self) -> list[dict]:
        """Every whole entry's manifest, by name; entries being assembled are not listed."""
        out = []
        if not os.path.isdir(self.root):
            return out
        for d in sorted(os.listdir(self.root)):
            if d.startswith("."):
                continue
            m = self._read_manifest(os.path.join(self.root, d))
            if m is not None:
                out.append(m)
        return sorted(out, key=lambda m: m["name"])

    def _read_manifest(self, entry: str) -> dict | None:
        try:
            with open(os.path.join(entry, MANIFEST), encoding="utf-8") as f:
                m = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(m, dict) or "name" not in m or "path" not in m:
            return None
        m["dir"] = entry
        m["model_path"] = os.path.join(entry, m["path"]) if m["path"] != "." else entry
        try:
            m["modified"] = os.path.getmtime(os.path.join(entry, MANIFEST))
        except OSError:
            m["modified"] = 0.0
        return m

    def get(self, name: str) -> dict:
        m = self._read_manifest(self.entry_dir(name))
        if m is None:
            raise NotFound(f"model {name!r} is not in the store ({self.root}); `treadle pull` it or see `treadle list`")
        return m

    def has(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.entry_dir(name), MANIFEST))

    def info(self, name: str):
        """The entry's ModelInfo (its params.json applied), read from its files now."""
        m = self.get(name)
        try:
            return describe(m["model_path"])
        except InspectError as e:
            raise StoreError(str(e)) from None

    # ------------------------------------------------------------ changing

    def remove(self, name: str) -> None:
        entry = self.entry_dir(name)
        if not self.has(name):
            raise NotFound(f"model {name!r} is not in the store ({self.root})")
        trash = os.path.join(self.root, f".tmp-rm-{uuid.uuid4().hex[:8]}")
        os.rename(entry, trash)  # gone from the listing at once
        shutil.rmtree(trash, ignore_errors=True)

    def copy(self, source: str, dest: str) -> dict:
        m = self.get(source)
        dest = check_name(dest)
        tmp = self._new_tmp()
        try:
            for f in m["files"]:
                _place(os.path.join(m["dir"], f["path"]), os.path.join(tmp, f["path"]))
            if os.path.isfile(os.path.join(m["dir"], PARAMS_FILE)):
                shutil.copyfile(os.path.join(m["dir"], PARAMS_FILE), os.path.join(tmp, PARAMS_FILE))
            return self._commit(tmp, {**_stored_fields(m), "name": dest})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def parameters(self, name: str) -> dict:
        """The entry's params.json as it was written (Ollama's names); {} where it has none."""
        path = os.path.join(self.get(name)["dir"], PARAMS_FILE)
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def set_parameters(self, name: str, params: dict) -> None:
        """The entry's params.json (Ollama's names), checked first."""
        m = self.get(name)
        ollama_parameters(params, "parameters")
        tmp = os.path.join(m["dir"], f".{PARAMS_FILE}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(params, f, indent=1)
        os.replace(tmp, os.path.join(m["dir"], PARAMS_FILE))

    def pull(self, text: str, name: str | None = None, progress: bool = True, log=print) -> dict:
        """Fetch or import the model `text` refers to; its manifest once it is listed."""
        ref = parse_ref(text)
        if ref.kind == "local":
            return self._import(ref, name)
        if ref.kind == "url":
            return self._pull_url(ref, name, progress, log)
        return self._pull_hf(ref, name, progress, log)

    def _new_tmp(self) -> str:
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-{uuid.uuid4().hex[:12]}")
        os.makedirs(tmp)
        return tmp

    def _commit(self, tmp: str, fields: dict) -> dict:
        """Describe the assembled entry, write its manifest last, rename it into place."""
        path = os.path.join(tmp, fields["path"]) if fields["path"] != "." else tmp
        try:
            info = describe(path)
        except InspectError as e:
            raise StoreError(f"{fields['source']}: not a model treadle can read: {e}") from None
        manifest = {
            **fields,
            "info": {k: v for k, v in info.as_dict().items() if k not in ("chat_template", "license")},
        }
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = self.entry_dir(fields["name"])
        if os.path.exists(final):  # a newer pull of the same name replaces the old entry
            old = os.path.join(self.root, f".tmp-old-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        return self.get(fields["name"])

    def _import(self, ref: Ref, name: str | None) -> dict:
        src = ref.target
        name = check_name(name or default_name(ref))
        tmp = self._new_tmp()
        try:
            if os.path.isfile(src):
                if not src.endswith(".gguf"):
                    raise StoreError(f"{src}: expected a .gguf file or a Hugging Face model folder")
                files = [os.path.basename(src)]
                _place(src, os.path.join(tmp, files[0]))
                path = files[0]
            elif os.path.isdir(src):
                files = sorted(n for n in os.listdir(src) if FOLDER_FILES.match(n) or n == PARAMS_FILE)
                if "config.json" not in files:
                    raise StoreError(f"{src}: no config.json (expected a .gguf file or a Hugging Face model folder)")
                for n in files:
                    _place(os.path.join(src, n), os.path.join(tmp, n))
                path = "."
            else:
                raise StoreError(f"{src}: no such file or folder")
            if files == [path] and path.endswith(".gguf"):
                _check_gguf(os.path.join(tmp, path))
            stored = [_stored(tmp, n) for n in files if n != PARAMS_FILE]
            return self._commit(tmp, {"name": name, "source": src, "path": path, "files": stored})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _pull_url(self, ref: Ref, name: str | None, progress: bool, log) -> dict:
        url = ref.target
        file = os.path.basename(url.split("?")[0])
        if not file.endswith(".gguf"):
            raise StoreError(f"{url}: a URL must name a .gguf file")
        name = check_name(name or default_name(ref))
        expected = Expected()
        try:
            part = download(url, part_path(self.partial, url, expected), expected, label=file, progress=progress)
        except FetchError as e:
            raise StoreError(str(e)) from None
        # no checksum from a plain server: the file must at least be a whole GGUF (header and every
        # tensor inside the file) before it is listed
        try:
            _check_gguf(part)
        except StoreError:
            os.remove(part)
            raise
        tmp = self._new_tmp()
        try:
            os.rename(part, os.path.join(tmp, file))
            return self._commit(tmp, {"name": name, "source": url, "path": file, "files": [_stored(tmp, file)]})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _pull_hf(self, ref: Ref, name: str | None, progress: bool, log) -> dict:
        from huggingface_hub import HfApi, hf_hub_url, try_to_load_from_cache
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
        from huggingface_hub.utils import build_hf_headers

        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        revision = os.environ.get("TREADLE_HF_REVISION", "main")
        try:
            tree = [
                f
                for f in HfApi(endpoint=endpoint).list_repo_tree(ref.target, recursive=True, revision=revision)
                if hasattr(f, "size")
            ]
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise StoreError(
                f"{ref.target}: no such repository on {endpoint} (or it needs HF_TOKEN): {type(e).__name__}"
            ) from None
        except HfHubHTTPError as e:
            raise StoreError(f"{ref.target}: cannot list the repository on {endpoint}: {e}") from None
        except OSError as e:
            raise StoreError(f"{ref.target}: cannot reach {endpoint}: {e}") from None
        chosen, path = _choose_files(ref, [f.path for f in tree])
        name = check_name(name or default_name(ref, path if path != "." else None))
        by_path = {f.path: f for f in tree}
        headers = build_hf_headers()  # HF_TOKEN, the hub's user agent
        tmp = self._new_tmp()
        try:
            for file in chosen:
                entry = by_path[file]
                expected = Expected(
                    size=entry.size,
                    sha256=entry.lfs.sha256 if entry.lfs else None,
                    git_sha1=None if entry.lfs else entry.blob_id,
                )
                cached = try_to_load_from_cache(ref.target, file, cache_dir=_hf_cache_dir(), revision=revision)
                dest = os.path.join(tmp, file)
                if isinstance(cached, str) and _matches(cached, expected):
                    log(f"{file}: in the Hugging Face cache")
                    _place(cached, dest)
                    continue
                url = hf_hub_url(ref.target, file, revision=revision, endpoint=endpoint)
                try:
                    part = download(
                        url,
                        part_path(self.partial, url, expected),
                        expected,
                        headers=headers,
                        label=file,
                        progress=progress,
                    )
                except FetchError as e:
                    raise StoreError(str(e)) from None
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.rename(part, dest)
            if path.endswith(".gguf"):
                _check_gguf(os.path.join(tmp, path))
            stored = [_stored(tmp, f) for f in chosen]
            source = f"hf://{ref.target}" + (f":{ref.selector}" if ref.selector else "")
            return self._commit(tmp, {"name": name, "source": source, "path": path, "files": stored})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _hf_cache_dir() -> str:
    """huggingface_hub's cache as its environment names it now ($HF_HUB_CACHE, $HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def _choose_files(ref: Ref, paths: list[str]) -> tuple[list[str], str]:
    """The repository's files to fetch and the path to load: one GGUF file, or a folder's files."""
    ggufs = [p for p in paths if p.endswith(".gguf") and "mmproj" not in os.path.basename(p).lower()]
    sel = ref.selector
    if sel.endswith(".gguf"):
        if sel not in paths:
            raise StoreError(f"{ref.target}: no file {sel!r} (its GGUF files: {', '.join(ggufs) or 'none'})")
        picked = [sel]
    elif sel:
        pattern = re.compile(rf"(?i)(?<![A-Za-z0-9]){re.escape(sel)}(?![A-Za-z0-9_])")
        picked = [p for p in ggufs if pattern.search(os.path.basename(p))]
        if not picked:
            tags = sorted({_quant_tag(p) for p in ggufs} - {""})
            raise StoreError(f"{ref.target}: no GGUF file for {sel!r} (its quantizations: {', '.join(tags) or 'none'})")
    elif "config.json" in paths and any(p.endswith(".safetensors") for p in paths):
        return [p for p in paths if FOLDER_FILES.match(p)], "."
    elif len(ggufs) == 1:
        picked = ggufs
    elif ggufs:
        picked = [p for p in ggufs if _quant_tag(p) == DEFAULT_QUANT]
        if not picked:
            tags = sorted({_quant_tag(p) for p in ggufs} - {""})
            raise StoreError(
                f"{ref.target}: several GGUF files; "
                f"name one as {ref.target}:QUANT ({', '.join(tags)}) or {ref.target}:FILE.gguf"
            )
    else:
        raise StoreError(f"{ref.target}: neither a GGUF file nor config.json with safetensors weights")
    if any(SPLIT_GGUF.search(p) for p in picked):
        raise StoreError(
            f"{ref.target}: {picked[0]} is one part of a split GGUF; "
            "split files are not supported (merge them with llama-gguf-split)"
        )
    if len(picked) > 1:
        raise StoreError(
            f"{ref.target}: {sel or DEFAULT_QUANT} matches several files ({', '.join(picked)}); name one as :FILE.gguf"
        )
    return picked + _mmproj_beside(picked[0], paths), picked[0]


def _mmproj_beside(model: str, paths: list[str]) -> list[str]:
    """The repository's image encoder for a GGUF model (llama.cpp's mmproj file in its folder), as
    llama.cpp's -hf fetches it: the F16 one where there are several, else the first by name."""
    folder = os.path.dirname(model)
    found = sorted(
        p
        for p in paths
        if os.path.dirname(p) == folder and p.endswith(".gguf") and "mmproj" in os.path.basename(p).lower()
    )
    f16 = [p for p in found if _quant_tag(p).upper() == "F16" or "f16" in os.path.basename(p).lower()]
    return (f16 or found)[:1]


def _matches(path: str, expected: Expected) -> bool:
    try:
        verify(path, expected, path)
        return True
    except FetchError:
        return False


def _check_gguf(path: str) -> None:
    from treadle.model.config import ModelLoadError
    from treadle.model.loading.gguf_file import open_gguf

    try:
        open_gguf(path)
    except ModelLoadError as e:
        raise StoreError(f"not a whole GGUF file: {e}") from None


def _place(src: str, dest: str) -> None:
    """A hard link where the filesystem allows (no second copy of the weights), else a copy."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        os.link(os.path.realpath(src), dest)
    except OSError:
        shutil.copyfile(src, dest)


def _stored(root: str, rel: str) -> dict:
    p = os.path.join(root, rel)
    return {"path": rel, "size": os.path.getsize(p), "sha256": file_sha256(p)}


def _stored_fields(m: dict) -> dict:
    return {k: m[k] for k in ("name", "source", "path", "files")}


def entry_summary(m: dict) -> dict:
    """A manifest as `list` shows it."""
    info = m.get("info") or {}
    return {
        "name": m["name"],
        "size": sum(f["size"] for f in m["files"]),
        "architecture": info.get("architecture", ""),
        "quantization": info.get("quantization", ""),
        "context_length": info.get("context_length"),
        "parameters": info.get("parameters"),
        "modified": m.get("modified", 0.0),
        "modified_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.get("modified", 0.0))),
        "format": info.get("format", ""),
        "sha256": m["files"][0]["sha256"] if len(m["files"]) == 1 else "",
    }
