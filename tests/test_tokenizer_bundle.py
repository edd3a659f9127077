"""GetTokenizer's zip is what the smg gateway accepts and can load a tokenizer from.

The gateway's client (smg `crates/grpc_client/src/tokenizer_bundle.rs`)
concatenates the chunks, checks the sha256 on the last one against the whole
zip, checks entry count and names, extracts the zip flat into a temp dir and
loads the tokenizer from there; these tests do the same steps in Python.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the package may not be pip-installed
    sys.path.insert(0, str(REPO_ROOT))

from tokenspeed_worker.server.tokenizer_bundle import (  # noqa: E402
    CHUNK_SIZE,
    MAX_ZIP_ENTRIES,
    build_tokenizer_zip,
    iter_tokenizer_chunks,
    select_tokenizer_files,
)

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _gateway_receive(chunks: list[tuple[bytes, str]]) -> bytes:
    """The gateway's collect_stream_bundle + validate_bundle_sha256 + validate_zip_archive."""
    assert chunks, "Empty stream: no chunks received"
    assert chunks[-1][1], "Stream ended without terminal sha256 fingerprint"
    data = b"".join(piece for piece, _ in chunks)
    assert data, "Received empty stream bundle"
    assert hashlib.sha256(data).hexdigest() == chunks[-1][1].lower(), "Bundle fingerprint mismatch"
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        entries = archive.infolist()
        assert len(entries) <= MAX_ZIP_ENTRIES
        for entry in entries:
            path = PurePosixPath(entry.filename)
            assert not path.is_absolute() and ".." not in path.parts, entry.filename
    return data


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A model folder as prepare_smollm2.py writes one, plus files that must stay out."""
    folder = tmp_path / "model"
    folder.mkdir()
    files = {
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE"}}),
        "tokenizer_config.json": json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}),
        "special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>"}),
        "generation_config.json": json.dumps({"eos_token_id": 2}),
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}),
        "vocab.json": json.dumps({"a": 0}),
        "merges.txt": "#version: 0.2\na b\n",
        "chat_template.jinja": CHAT_TEMPLATE,
        "zeta.jinja": "z",
        "model.safetensors": "weights",
        "README.md": "docs",
        "tokenizer.json.bak": "old",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "original").mkdir()
    (folder / "original" / "tokenizer.model").write_text("nested")
    (folder / "dir.jinja").mkdir()
    return folder


def test_bundle_holds_the_tokenizer_files_flat_in_gateway_order(tokenizer_dir):
    data = build_tokenizer_zip(tokenizer_dir)

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        assert names == [
            "tokenizer.json",
            "tokenizer_config.json",
            "config.json",
            "generation_config.json",
            "special_tokens_map.json",
            "vocab.json",
            "merges.txt",
            "chat_template.jinja",
            "zeta.jinja",
        ]
        for entry in archive.infolist():
            assert entry.compress_type == zipfile.ZIP_DEFLATED
            assert not entry.is_dir()
            assert archive.read(entry) == (tokenizer_dir / entry.filename).read_bytes()
        assert json.loads(archive.read("tokenizer_config.json"))["chat_template"] == CHAT_TEMPLATE


def test_chunks_carry_sha256_of_the_whole_zip_on_the_last_chunk_only(tokenizer_dir):
    chunks = list(iter_tokenizer_chunks(tokenizer_dir, chunk_size=100))

    assert len(chunks) > 2
    assert all(sha == "" for _, sha in chunks[:-1])
    assert all(len(piece) == 100 for piece, _ in chunks[:-1])
    data = _gateway_receive(chunks)
    assert data == build_tokenizer_zip(tokenizer_dir)
    assert chunks[-1][1] == hashlib.sha256(data).hexdigest()


def test_default_chunks_are_64_kib_and_an_exact_multiple_adds_no_empty_chunk(tokenizer_dir):
    (tokenizer_dir / "merges.txt").write_bytes(random.Random(0).randbytes(3 * CHUNK_SIZE))  # incompressible
    data = build_tokenizer_zip(tokenizer_dir)
    chunks = list(iter_tokenizer_chunks(tokenizer_dir))
    assert len(chunks) == 4
    assert [len(piece) for piece, _ in chunks[:-1]] == [CHUNK_SIZE] * (len(chunks) - 1)
    assert _gateway_receive(chunks) == data

    exact = list(iter_tokenizer_chunks(tokenizer_dir, chunk_size=len(data)))
    assert len(exact) == 1 and exact[0][0] == data and exact[0][1]


def test_same_files_give_the_same_bytes(tokenizer_dir):
    first = build_tokenizer_zip(tokenizer_dir)
    for path in tokenizer_dir.iterdir():
        if path.is_file():
            path.touch()  # a new mtime must not change the fingerprint

    assert build_tokenizer_zip(tokenizer_dir) == first


def test_selection_follows_symlinks_and_ignores_nested_files(tokenizer_dir, tmp_path):
    blob = tmp_path / "blob"
    blob.write_text("sentencepiece")
    (tokenizer_dir / "tokenizer.model").symlink_to(blob)  # as in a hub cache snapshot

    names = [name for name, _ in select_tokenizer_files(tokenizer_dir)]

    assert "tokenizer.model" in names and names.count("tokenizer.model") == 1
    with zipfile.ZipFile(io.BytesIO(build_tokenizer_zip(tokenizer_dir))) as archive:
        assert archive.read("tokenizer.model") == b"sentencepiece"


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: p])
def test_no_tokenizer_files_is_file_not_found(tmp_path, make):
    folder = make(tmp_path)
    (tmp_path / "model.safetensors").write_text("weights only")

    with pytest.raises(FileNotFoundError, match="No tokenizer files"):
        iter_tokenizer_chunks(folder)


def test_more_entries_than_the_gateway_takes_is_refused(tokenizer_dir):
    for index in range(MAX_ZIP_ENTRIES):
        (tokenizer_dir / f"template_{index:02d}.jinja").write_text("x")

    with pytest.raises(ValueError, match="at most 50"):
        build_tokenizer_zip(tokenizer_dir)


def test_chunk_size_must_be_positive(tokenizer_dir):
    with pytest.raises(ValueError):
        iter_tokenizer_chunks(tokenizer_dir, chunk_size=0)


@pytest.mark.slow
def test_gateway_side_tokenizer_loads_from_the_extracted_bundle(tmp_path):
    """A real BPE tokenizer saved by transformers survives the round trip."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")

    model = tokenizers.models.BPE(unk_token="<unk>")
    trained = tokenizers.Tokenizer(model)
    trained.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    trained.train_from_iterator(["The capital of France is Paris."] * 20 + ["hello world"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=trained, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    source = tmp_path / "source"
    fast.save_pretrained(source)

    data = _gateway_receive(list(iter_tokenizer_chunks(source)))
    extracted = tmp_path / "extracted"
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        archive.extractall(extracted)

    text = "The capital of France is Paris."
    assert tokenizers.Tokenizer.from_file(str(extracted / "tokenizer.json")).encode(text).ids == trained.encode(text).ids
    reloaded = transformers.AutoTokenizer.from_pretrained(extracted)
    assert reloaded(text).input_ids == fast(text).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
