"""MODEL arguments: a local folder, `demo`, a curated tag (models.yaml) or a Hugging Face id.

    ./my-model                         a local Hugging Face-layout folder
    demo                               a small generated model, made on first use
    llama3.3:70b                       a tag of models.yaml -> repo id at a revision
    Qwen/Qwen2.5-1.5B-Instruct[@rev]   a Hugging Face repo id, downloaded into huggingface_hub's cache

Downloads take only what spill reads (config, tokenizer files, safetensors and index), honour
HF_HUB_OFFLINE and a token in the environment (HF_TOKEN), and never prompt. Every failure is one
sentence naming the fix. A model is classified from its config.json before any weight is read.
"""

import json
import os
import re
import shutil
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from spill import config
from spill.errors import SpillError

DEMO = dict(family="llama", size="small", seed=0, dtype="bfloat16")
ALLOW = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
         "*.safetensors", "model.safetensors.index.json"]
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class Tag:
    name: str
    repo: str
    revision: str
    quantization: str
    note: str = ""
    group_size: int = 64      # of a quantized tag (mlx-community's default)

    @property
    def bits(self) -> int:
        """4 or 8 for an MLX-quantized tag ("4bit", "8bit"), else 0."""
        return int(self.quantization[:-3]) if re.fullmatch(r"\d+bit", self.quantization) else 0

    @property
    def base(self) -> str:
        """The model's tag without its variant: tags of one model differ only after the last '-' of
        the part after ':' (llama3.3:70b-4bit -> llama3.3:70b)."""
        family, _, size = self.name.rpartition(":")
        return f"{family}:{size.rsplit('-', 1)[0]}" if family else self.name


@cache
def tags() -> dict[str, Tag]:
    """The curated tags shipped inside the package (coordinator/models.yaml)."""
    return read_tags(resources.files("spill.coordinator").joinpath("models.yaml").read_text())


def read_tags(text: str) -> dict[str, Tag]:
    import yaml
    return {name: Tag(name, **entry) for name, entry in yaml.safe_load(text).items()}


def variants(model: str) -> list[tuple[str, int, int]]:
    """(tag, bits, group size) of the quantized tags of MODEL's model (MODEL: a tag, or a tag's repo id)."""
    known = tags()
    name = model if model in known else next((t.name for t in known.values() if t.repo == model.partition("@")[0]), "")
    if not name:
        return []
    return [(t.name, t.bits, t.group_size) for t in known.values()
            if t.name != name and t.bits and t.base == known[name].base]


def hub_cache() -> Path:
    """huggingface_hub's own cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve(model: str, *, classify: bool = True) -> Path:
    """The local folder for MODEL, downloading a Hugging Face model when it is not cached yet.

    With `classify`, a model spill cannot run yet is refused with its sentence here, before any
    weight is read."""
    folder = _folder(model)
    if classify:
        from spill.streamer.families import verdict
        v = verdict(_config(folder, model))
        if not v.runs:
            raise SpillError(f"model {model!r}: {v.why}")
    return folder


def warning(folder: Path) -> str:
    """The one-line warning for a family spill has not verified ("" for a verified one)."""
    from spill.streamer.families import verdict
    v = verdict(_config(folder, str(folder)))
    return v.why if v.runs else ""


def _folder(model: str) -> Path:
    if model == "demo":
        folder = config.home() / "models" / "demo"
        if not (folder / "config.json").exists():
            from spill.factory import make_model
            make_model(folder, **DEMO)
        return folder
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if model in tags():
        tag = tags()[model]
        return download(tag.repo, tag.revision, model)
    repo, _, revision = model.partition("@")
    if _REPO.fullmatch(repo) and not model.startswith((".", "/", "~")):
        return download(repo, revision or "main", model)
    if ":" in model and "/" not in model:
        raise SpillError(f"model {model!r}: no such tag in models.yaml; `spill models` lists the tags, "
                         "or give a Hugging Face id (org/name) or a local folder")
    raise SpillError(f"model {model!r}: expected a local model folder, a tag or a Hugging Face id (org/name), "
                     "found no such folder; check the path")


def download(repo: str, revision: str, model: str) -> Path:
    """snapshot_download of the files spill reads; a cached snapshot is used without the network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as e
    cache_dir = hub_cache()
    constants.HF_HUB_OFFLINE = offline()   # huggingface_hub reads it once, at import; spill per call
    try:
        if not offline():
            _check_room(repo, revision, cache_dir)
        folder = snapshot_download(repo, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW,
                                   local_files_only=offline(), endpoint=os.environ.get("HF_ENDPOINT"))
    except e.HFValidationError:
        raise SpillError(f"model {model!r} is not a valid Hugging Face id; write it as org/name or "
                         "org/name@revision") from None
    except e.GatedRepoError:
        raise SpillError(f"model {repo!r} is gated and this machine has no access: accept its terms at "
                         f"https://huggingface.co/{repo} and set HF_TOKEN to a token of that account") from None
    except e.RepositoryNotFoundError:
        raise SpillError(f"model {repo!r}: no such repository on Hugging Face (or it is private); check the "
                         "repo id, or set HF_TOKEN to a token that can read it") from None
    except e.RevisionNotFoundError:
        raise SpillError(f"model {repo!r} has no revision {revision!r}; give a branch, tag or commit of the "
                         "repository (main is the default)") from None
    except e.LocalEntryNotFoundError:
        if offline():
            raise SpillError(f"model {repo!r} at {revision!r} is not in the cache {cache_dir} and HF_HUB_OFFLINE "
                             f"is set; unset HF_HUB_OFFLINE and run `spill pull {model}`") from None
        raise SpillError(f"model {repo!r} at {revision!r} is not in the cache {cache_dir} and the Hugging Face "
                         f"Hub cannot be reached; connect to the network and run `spill pull {model}`") from None
    return Path(folder)


def _check_room(repo: str, revision: str, cache_dir: Path) -> None:
    """Refuse a download that would not fit: the files spill reads, less those already cached."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as e
    from huggingface_hub.utils import filter_repo_objects
    try:
        info = HfApi(endpoint=os.environ.get("HF_ENDPOINT")).model_info(repo, revision=revision, files_metadata=True)
    except (e.RepositoryNotFoundError, e.RevisionNotFoundError):
        raise
    except Exception:   # no network, the Hub down: snapshot_download says so, or uses the cache
        return
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    snapshot = cache_dir / ("models--" + repo.replace("/", "--")) / "snapshots" / (info.sha or "-")
    need = sum(sizes[f] for f in filter_repo_objects(sizes, allow_patterns=ALLOW) if not (snapshot / f).exists())
    check_room(cache_dir, need, f"model {repo!r} needs", "or point HF_HUB_CACHE at a disk with room")


def check_room(folder: Path, need: int, what: str, fix: str) -> None:
    """One sentence when fewer than `need` bytes are free where `folder` is (or will be)."""
    existing = Path(folder).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    usage = shutil.disk_usage(existing)
    free = usage.free
    if need > free and usage.total:   # a total of 0: /proc and the like, whose own refusal names the fix
        from spill.memory import format_size
        raise SpillError(f"{what} {format_size(need)} in {folder} but {format_size(free)} is free there; "
                         f"free {format_size(need - free)} {fix}")


def output_bytes(rows: int, max_tokens: int) -> int:
    """A generous guess at a job's output: a JSON line of ~600 bytes per row plus ~8 bytes a token."""
    return rows * (600 + 8 * max_tokens)


def _config(folder: Path, model: str) -> dict:
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpillError(f"model {model!r}: {folder} has no config.json; it is not a Hugging Face-layout "
                         "model folder") from None
    except (ValueError, UnicodeDecodeError):
        raise SpillError(f"model {model!r}: {path} is not valid JSON; re-download the model") from None
    if not isinstance(data, dict):
        raise SpillError(f"model {model!r}: {path} is not a JSON object; re-download the model")
    return data


@dataclass(frozen=True)
class Cached:
    name: str          # repo id (huggingface_hub's cache) or folder name ($SPILL_HOME/models)
    folder: Path
    size: int          # bytes on disk
    family: str        # config.json's model_type
    status: str        # verified, expected or not_yet


def cached() -> list[Cached]:
    """Models on this machine: huggingface_hub's cache (newest snapshot of each) and $SPILL_HOME/models."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    found = []
    try:
        repos = [r for r in scan_cache_dir(hub_cache()).repos if r.repo_type == "model"]
    except CacheNotFound:
        repos = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        newest = max(repo.revisions, key=lambda r: r.last_modified, default=None)
        if newest is not None and (newest.snapshot_path / "config.json").exists():
            found.append(_cached(repo.repo_id, newest.snapshot_path, repo.size_on_disk))
    local = config.home() / "models"
    for folder in sorted(local.iterdir()) if local.is_dir() else []:
        if (folder / "config.json").exists():
            found.append(_cached(folder.name, folder, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())))
    return found


def _cached(name: str, folder: Path, size: int) -> Cached:
    from spill.streamer.families import verdict
    try:
        conf = _config(folder, name)
    except SpillError:
        return Cached(name, folder, size, "?", "not_yet")
    v = verdict(conf)
    return Cached(name, folder, size, v.model_type or "?", v.status)
