"""A Hugging Face hub model id (`org/name`) resolved to its folder in the local hub cache.

Operators coming from vLLM and SGLang start a server with the id they downloaded
(`huggingface-cli download meta-llama/Llama-3.1-8B-Instruct`, then `... meta-llama/Llama-3.1-8B-Instruct`).
The worker never downloads, but it serves such a model from the cache the download filled.

The cache layout is the one huggingface_hub documents and keeps stable
(https://huggingface.co/docs/huggingface_hub/guides/manage-cache):
`<cache>/models--<org>--<name>/refs/<branch or tag>` holds a commit hash and
`<cache>/models--<org>--<name>/snapshots/<commit>/` the files. It is read here by hand because
huggingface_hub is not among the worker's dependencies (transformers 5 no longer needs it) and the
lookup is these few lines; the cache folder is found as huggingface_hub finds it:
--download-dir, else HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """The hub cache folder a lookup reads (see the module docstring for the order)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model_source(source: str, revision: str | None, download_dir: str | None, flag: str) -> str:
    """`source` itself when it is a local folder; else, for a hub id, its snapshot folder in the cache.

    Raises ValueError naming `flag` when `source` is neither, or when --revision or --download-dir
    are given with a local folder (they only choose among a hub id's cached snapshots).
    """
    if os.path.isdir(source):
        if revision is not None or download_dir is not None:
            raise ValueError(f"argument {flag}: {source!r} is a local folder; --revision and --download-dir only "
                             "apply to a Hugging Face hub id (org/name) served from the local hub cache")
        return source
    if not _REPO_ID.fullmatch(source) or source.count("/") != 1:
        raise ValueError(f"argument {flag}: {source!r} is not a local folder (nor a Hugging Face hub id, org/name)")
    cache = hub_cache_dir(download_dir)
    repo = cache / ("models--" + source.replace("/", "--"))
    wanted = revision or "main"
    commit = wanted if _COMMIT.fullmatch(wanted) else None
    ref = repo / "refs" / wanted
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    snapshot = repo / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise ValueError(
            f"argument {flag}: {source!r} is not a local folder, and revision {wanted!r} of it is not in the Hugging "
            f"Face hub cache at {cache} (this worker never downloads weights: fetch it first, e.g. "
            f"`huggingface-cli download {source}`, or give the folder)")
    return str(snapshot)


def resolve_hub_ids(args) -> None:
    """Point `args.model`, `args.tokenizer` and `args.speculative_draft_model_path` (ServerArgs after
    parse_args) at local folders, in place: hub ids become their cached snapshots (--revision and
    --download-dir choose the model's; the tokenizer and the draft model take their main branch from
    the same cache). `served_model_name` keeps the id as given. Raises ValueError naming the flag."""
    given = args.model
    args.model = resolve_model_source(given, args.revision, args.download_dir, "model")
    if args.tokenizer == given:
        args.tokenizer = args.model
    for dest, flag in (("tokenizer", "--tokenizer"), ("speculative_draft_model_path", "--speculative-draft-model-path")):
        value = getattr(args, dest)
        if value is not None and not os.path.isdir(value):
            setattr(args, dest, resolve_model_source(value, None, args.download_dir, flag))
