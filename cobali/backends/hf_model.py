"""A GGUF model by its Hugging Face repository (`--hf-repo REPO[:QUANT]`, `--hf-file FILE`), fetched into
huggingface_hub's cache and picked as llama-server picks it (llama.cpp's common/download.cpp):

- `--hf-file`: that file, its name matched case-insensitively;
- `:QUANT`: the first model GGUF whose name holds QUANT followed by `.` or `-`, case-insensitively;
- neither: Q4_K_M, else Q8_0, else the first model GGUF.

Model GGUFs are those that are not projectors, imatrices or draft heads. A model split in parts
(`name-00001-of-00003.gguf`) is picked by its first part, and every part is fetched: llama.cpp loads the rest
from beside the first. HF_HUB_OFFLINE=1 (or no network) picks among the files already in the cache."""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
HF_EXTRA = "pip install '.[hf]' (huggingface_hub)"
_SPLIT = re.compile(r"^(.+)-(\d{5})-of-(\d{5})$", re.I)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)


def split_repo(spec: str) -> tuple[str, str]:
    """'owner/name[:QUANT]' -> (repo, quant or '')."""
    repo, _, quant = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ValueError(f"--hf-repo: expected OWNER/NAME[:QUANT], got {spec!r}")
    return repo, quant


def _split_info(path: str) -> tuple[str, int, int]:
    """(the name without .gguf and its split suffix, part number, parts) of a GGUF's path."""
    stem = path[:-len(".gguf")] if path.lower().endswith(".gguf") else path
    found = _SPLIT.match(stem)
    return (found[1], int(found[2]), int(found[3])) if found else (stem, 1, 1)


def quant_tag(path: str) -> str:
    """The quant a GGUF's name ends in (Q4_K_M in 'SmolLM2-135M.Q4_K_M.gguf'), '' if none."""
    found = _TAG.search(_split_info(path)[0])
    return found[1].upper() if found else ""


def model_ggufs(files: list[str]) -> list[str]:
    """The model GGUFs among a repository's files, each split model by its first part only."""
    return [f for f in files if f.lower().endswith(".gguf") and not any(k in f.rsplit("/", 1)[-1] for k in NOT_A_MODEL)
            and _split_info(f)[1] == 1]


def pick_gguf(files: list[str], quant: str = "", hf_file: str | None = None, repo: str = "the repository") -> str:
    """The file llama-server would load from a repository holding `files`."""
    if hf_file:
        for f in files:
            if f.lower() == hf_file.lower():
                return f
        raise ValueError(f"--hf-file {hf_file!r} is not in {repo}; its GGUF files: {_listing(files)}")
    models = model_ggufs(files)
    for tag in [quant] if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.I)
        for f in models:
            if pattern.search(f):
                return f
    if quant or not models:
        quants = sorted({quant_tag(f) for f in models} - {""})
        what = f"no {quant} GGUF" if quant else "no GGUF model"
        raise ValueError(f"{what} in {repo}: it has " + (", ".join(quants) if quants else _listing(files)))
    return models[0]


def split_parts(files: list[str], first: str) -> list[str]:
    """Every part of the split model whose first part is `first` (just `first` when it is whole)."""
    prefix, _, count = _split_info(first)
    return [f for f in files if _split_info(f)[0] == prefix and _split_info(f)[2] == count] if count > 1 else [first]


def _listing(files: list[str]) -> str:
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    return ", ".join(ggufs) if ggufs else "no .gguf files"


def resolve_hf_model(spec: str, hf_file: str | None = None) -> str:
    """Fetch (or find in the cache) the GGUF `--hf-repo spec [--hf-file F]` names; its local path."""
    try:
        import huggingface_hub as hub
        from huggingface_hub.utils import HfHubHTTPError, OfflineModeIsEnabled
    except ImportError:
        raise ValueError(f"--hf-repo needs the hf extra: {HF_EXTRA}") from None
    repo, quant = split_repo(spec)
    try:
        files = hub.list_repo_files(repo)
        local = None
    except (OfflineModeIsEnabled, HfHubHTTPError, OSError) as err:
        local = _cached_snapshot(hub, repo, err)
        files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    chosen = pick_gguf(files, quant, hf_file, repo)
    paths = []
    for part in split_parts(files, chosen):
        try:
            paths.append(str(local / part) if local else hub.hf_hub_download(repo, part))
        except (HfHubHTTPError, OSError) as err:
            raise ValueError(f"could not fetch {part} from {repo}: {err}") from None
    return paths[0]


def _cached_snapshot(hub, repo: str, why: Exception) -> Path:
    """The cached snapshot of `repo`, when the hub cannot be asked for its files."""
    try:
        return Path(hub.snapshot_download(repo, local_files_only=True))
    except Exception:  # not cached either: the hub's error says why
        raise ValueError(f"cannot list {repo} on the hub ({type(why).__name__}: {why}), and it is not in the "
                         "cache") from None
