"""The tokenizer folder as the zip the smg gateway's GetTokenizer client expects.

The gateway calls GetTokenizer only when it cannot read the tokenizer itself
(no local --tokenizer-path/--model-path, no folder at GetModelInfo's path, no
hub). What it does with the reply, read from the smg source: the client in
lightseekorg/smg `crates/grpc_client/src/tokenizer_bundle.rs` (its error
strings are in the smg 1.13.0 binary we test against), and the bundles the
published servicers produce (lightseekorg/smg
`grpc_servicer/smg_grpc_servicer/tokenizer_bundle.py`, smg-project/smg
`crates/engine_servicer/src/tokenizer_bundle.rs`):

- concatenates `data` of every chunk; fails on an empty stream, empty data, or
  a stream whose LAST chunk has no `sha256` ("Stream ended without terminal
  sha256 fingerprint"); `sha256` is the hex SHA-256 of the whole zip (compared
  case-insensitively), empty on the earlier chunks;
- rejects more than 200 MiB streamed, more than 50 zip entries, more than
  500 MiB uncompressed, or an entry name with `..`, a root or a drive prefix;
- extracts the zip into a temp dir and loads the tokenizer from that dir, so
  entries are flat file names relative to the tokenizer folder (no folder
  prefix, no directory entries).

The published servicers bundle the same selection: these exact names, then
`*.tiktoken`, `*.jinja`, `*.model` (top-level regular files), Deflate, in 64 KiB
chunks; we do the same so the gateway sees what it sees from SGLang or vLLM.
Entries get a fixed timestamp and mode, so the same files give the same bytes
and the same sha256 on every call.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

CHUNK_SIZE = 64 * 1024

# In bundle order: the published servicers' list (the gateway's own
# tokenizer-file list plus the model's config files).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",  # SentencePiece
    "tiktoken.model",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
TOKENIZER_SUFFIXES = (".tiktoken", ".jinja", ".model")

# The gateway's limits (crates/grpc_client/src/tokenizer_bundle.rs).
MAX_ZIP_ENTRIES = 50
MAX_UNCOMPRESSED_BYTES = 500 * 1024 * 1024
MAX_BUNDLE_BYTES = 200 * 1024 * 1024

_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_REGULAR_FILE_0644 = (0o100644 << 16)


def select_tokenizer_files(tokenizer_dir: str | Path) -> list[tuple[str, Path]]:
    """(entry name, path) of what goes into the bundle, in bundle order."""
    folder = Path(tokenizer_dir)
    selected = [(name, folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not folder.is_dir():
        return selected
    names = sorted(entry.name for entry in folder.iterdir() if entry.is_file())
    added = {name for name, _ in selected}
    for suffix in TOKENIZER_SUFFIXES:
        for name in names:
            if name.endswith(suffix) and name not in added:
                selected.append((name, folder / name))
                added.add(name)
    return selected


def build_tokenizer_zip(tokenizer_dir: str | Path) -> bytes:
    """The tokenizer files of `tokenizer_dir` as one flat, deterministic zip.

    Raises FileNotFoundError when the folder holds no tokenizer file, and
    ValueError when the bundle would break one of the gateway's limits.
    """
    files = select_tokenizer_files(tokenizer_dir)
    if not files:
        raise FileNotFoundError(f"No tokenizer files found in {tokenizer_dir}")
    if len(files) > MAX_ZIP_ENTRIES:
        raise ValueError(f"{len(files)} tokenizer files in {tokenizer_dir}; the gateway takes at most {MAX_ZIP_ENTRIES}")
    uncompressed = sum(path.stat().st_size for _, path in files)
    if uncompressed > MAX_UNCOMPRESSED_BYTES:
        raise ValueError(f"tokenizer files in {tokenizer_dir} hold {uncompressed} bytes; the gateway takes at most {MAX_UNCOMPRESSED_BYTES}")

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, path in files:
            entry = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = _REGULAR_FILE_0644
            archive.writestr(entry, path.read_bytes())
    data = buffer.getvalue()
    if len(data) > MAX_BUNDLE_BYTES:
        raise ValueError(f"tokenizer bundle is {len(data)} bytes; the gateway takes at most {MAX_BUNDLE_BYTES}")
    return data


def iter_tokenizer_chunks(tokenizer_dir: str | Path, chunk_size: int = CHUNK_SIZE) -> Iterator[tuple[bytes, str]]:
    """(data, sha256) per GetTokenizerChunk: sha256 hex of the whole zip on the last chunk only.

    The zip is built before the first chunk is yielded, so errors surface
    before anything is streamed.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = build_tokenizer_zip(tokenizer_dir)
    return _chunks(data, hashlib.sha256(data).hexdigest(), chunk_size)


def _chunks(data: bytes, sha256: str, chunk_size: int) -> Iterator[tuple[bytes, str]]:
    starts = range(0, len(data), chunk_size)
    last = starts[-1]
    for start in starts:
        yield data[start : start + chunk_size], (sha256 if start == last else "")
