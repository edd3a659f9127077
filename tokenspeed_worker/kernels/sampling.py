"""Triton kernel for the sampler's hot loop: hashed noise + Gumbel argmax over the vocabulary, fused.

The torch backend materializes several int64 [S, V] temporaries to hash the noise, then two
logs, an add and an argmax. Here one pass reads each score once, hashes (row key, vocab index)
with the same splitmix64 as sampling/sampler.py, takes the same float32 -log(-log(u)) through
libdevice's logf (what torch's CUDA log calls), and keeps a running (max, first index). The
vocabulary is split into chunks across programs (grid S x chunks) so even one row fills the
GPU; a second tiny kernel reduces over the chunks, taking the first chunk holding the maximum,
so ties resolve to the lowest index exactly like torch.argmax.

`argmax` is the same two kernels without the noise: the greedy path. torch's argmax runs one
row's 128k-entry reduction on too few blocks; split over chunks it fills the GPU.

Importable without triton (CPU machines): AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations


import torch

from tokenspeed_worker import env

try:
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except ImportError:  # older layouts
        from triton.language.extra.cuda import libdevice
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    libdevice = None
    AVAILABLE = False

# Scores per program: big enough to amortize the row key load, small enough for many programs.
BLOCK_VOCAB = 4096


if AVAILABLE:

    @triton.jit
    def _splitmix64(x):
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _gumbel_argmax_chunks(
        scores_ptr,
        score_row_stride,
        row_keys_ptr,
        vocab_size,
        chunk_max_ptr,
        chunk_arg_ptr,
        num_chunks,
        BLOCK: tl.constexpr,
        LIBDEVICE_LOG: tl.constexpr,
        NOISE: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offsets < vocab_size
        scores = tl.load(
            scores_ptr + row.to(tl.int64) * score_row_stride + offsets, mask=in_vocab, other=float("-inf")
        ).to(tl.float32)
        if NOISE:
            key = tl.load(row_keys_ptr + row).to(tl.uint64, bitcast=True)
            bits = _splitmix64(key + (offsets.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
            top24 = (bits >> 40).to(tl.int32).to(tl.float32)  # 24 bits: exact in float32
            # Below 1 (sampling/sampler.hashed_uniform: the largest top24 + 0.5 rounds to 2^24).
            uniform = tl.minimum((top24 + 0.5) * (1.0 / 16777216.0), 0.99999994039535522)
            if LIBDEVICE_LOG:
                perturbed = scores - libdevice.log(-libdevice.log(uniform))
            else:  # the interpreter (TRITON_INTERPRET=1) has no libdevice
                perturbed = scores - tl.log(-tl.log(uniform))
        else:
            perturbed = scores
        perturbed = tl.where(in_vocab, perturbed, float("-inf"))
        best = tl.max(perturbed, axis=0)
        arg = tl.argmax(perturbed, axis=0, tie_break_left=True)
        tl.store(chunk_max_ptr + row * num_chunks + chunk, best)
        tl.store(chunk_arg_ptr + row * num_chunks + chunk, chunk * BLOCK + arg)

    @triton.jit
    def _argmax_over_chunks(chunk_max_ptr, chunk_arg_ptr, out_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr):
        row = tl.program_id(0)
        offsets = tl.arange(0, BLOCK_CHUNKS)
        valid = offsets < num_chunks
        best = tl.load(chunk_max_ptr + row * num_chunks + offsets, mask=valid, other=float("-inf"))
        first = tl.argmax(best, axis=0, tie_break_left=True)  # the first chunk holding the maximum
        tl.store(out_ptr + row, tl.load(chunk_arg_ptr + row * num_chunks + first).to(tl.int64))


if AVAILABLE:

    @triton.jit
    def _widen_argmax_kernel(
        src_ptr, src_row_stride, dst_ptr, dst_row_stride, vocab_size,
        chunk_max_ptr, chunk_arg_ptr, counter_ptr, out_ptr, num_chunks,
        BLOCK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
    ):
        """Program (row, chunk): the chunk's logits widened to float32 into dst, and its (max, first
        index) into the workspace; the row's last chunk to arrive takes the first chunk holding the
        maximum (as _argmax_over_chunks) and resets the row's arrival counter."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offsets < vocab_size
        scores = tl.load(src_ptr + row.to(tl.int64) * src_row_stride + offsets, mask=in_vocab,
                         other=float("-inf")).to(tl.float32)
        tl.store(dst_ptr + row.to(tl.int64) * dst_row_stride + offsets, scores, mask=in_vocab)
        scores = tl.where(in_vocab, scores, float("-inf"))
        tl.store(chunk_max_ptr + row * num_chunks + chunk, tl.max(scores, axis=0))
        tl.store(chunk_arg_ptr + row * num_chunks + chunk, chunk * BLOCK + tl.argmax(scores, axis=0, tie_break_left=True))
        # Every thread's stores before the one thread's release of the counter (kernels/attention.py).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == num_chunks - 1:
            chunks = tl.arange(0, BLOCK_CHUNKS)
            valid = chunks < num_chunks
            # .cg: from L2, where the other programs' entries are (not a stale L1 line).
            best = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"),
                           cache_modifier=".cg")
            first = tl.argmax(best, axis=0, tie_break_left=True)
            arg = tl.load(chunk_arg_ptr + row * num_chunks + first, cache_modifier=".cg")
            tl.store(out_ptr + row, arg.to(tl.int64))
            tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")


def argmax_workspace(max_rows: int, vocab_size: int, device: torch.device | str,
                     block: int = BLOCK_VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """widen_and_argmax's scratch for up to max_rows rows: per-chunk maxima (float32) and indices
    (int32), and per-row arrival counters (int32, zero; every call leaves them zero). Allocate once,
    outside any CUDA-graph capture: one workspace serves every call and replay."""
    num_chunks = -(-vocab_size // block)
    return (torch.empty((max_rows, num_chunks), dtype=torch.float32, device=device),
            torch.empty((max_rows, num_chunks), dtype=torch.int32, device=device),
            torch.zeros(max_rows, dtype=torch.int32, device=device))


def widen_and_argmax(logits: torch.Tensor, out_logits: torch.Tensor, out_tokens: torch.Tensor,
                     workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block: int = BLOCK_VOCAB) -> None:
    """out_logits[:] = logits as float32 and out_tokens[:] = each row's first maximum (torch.argmax),
    in one launch: the decode graphs' tail, where the widening copy and the two argmax kernels were
    three launches after the LM head. logits: [S, V] (contiguous along V); out_logits float32
    [S, V]; out_tokens int64 [S], contiguous; workspace: argmax_workspace(>= S rows, V)."""
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    num_rows, vocab_size = logits.shape
    chunk_max, chunk_arg, counter = workspace
    num_chunks = triton.cdiv(vocab_size, block)
    if out_logits.shape != logits.shape or out_logits.dtype != torch.float32 or out_logits.stride(1) != 1:
        raise ValueError(f"out_logits must be float32 {tuple(logits.shape)}, contiguous along the vocabulary")
    if out_tokens.shape != (num_rows,) or out_tokens.dtype != torch.int64 or not out_tokens.is_contiguous():
        raise ValueError(f"out_tokens must be a contiguous int64 [{num_rows}] tensor")
    if (chunk_max.shape[0] < num_rows or chunk_max.shape[1] != num_chunks or chunk_arg.shape != chunk_max.shape
            or counter.shape[0] < num_rows or counter.dtype != torch.int32):
        raise ValueError(f"workspace {tuple(chunk_max.shape)}, {tuple(counter.shape)} does not fit {num_rows} rows "
                         f"of {num_chunks} chunks; see argmax_workspace")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if num_rows == 0:
        return
    _widen_argmax_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), out_logits, out_logits.stride(0), vocab_size,
        chunk_max, chunk_arg, counter, out_tokens, num_chunks,
        BLOCK=block, BLOCK_CHUNKS=max(2, triton.next_power_of_2(num_chunks)),
    )


def gumbel_argmax(scores: torch.Tensor, row_keys: torch.Tensor, block: int = BLOCK_VOCAB) -> torch.Tensor:
    """argmax over v of scores[s, v] - log(-log(u(row_keys[s], v))): int64 [S].

    scores: float32 [S, V] (contiguous along V; -inf = filtered out); row_keys: int64 [S] from
    sampling.sampler.row_keys. Equals the torch backend's draw for the same inputs.
    """
    row_keys = row_keys.to(device=scores.device, dtype=torch.int64).contiguous()
    return _chunked_argmax(scores, row_keys, block)


def argmax(scores: torch.Tensor, block: int = BLOCK_VOCAB, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [S]: the first index of each row's maximum (torch.argmax(scores, -1)), for [S, V] float
    scores; written into `out` (int64 [S], contiguous) when given."""
    return _chunked_argmax(scores, None, block, out)


def _chunked_argmax(scores: torch.Tensor, row_keys: torch.Tensor | None, block: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    num_rows, vocab_size = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if num_rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=scores.device) if out is None else out
    num_chunks = triton.cdiv(vocab_size, block)
    chunk_max = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=scores.device)
    chunk_arg = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=scores.device)
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=scores.device)
    elif out.shape != (num_rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 [{num_rows}] tensor")
    noise = row_keys is not None
    _gumbel_argmax_chunks[(num_rows, num_chunks)](
        scores, scores.stride(0), row_keys if noise else chunk_arg, vocab_size, chunk_max, chunk_arg, num_chunks,
        BLOCK=block, LIBDEVICE_LOG=not env.triton_interpreter(), NOISE=noise,
    )
    _argmax_over_chunks[(num_rows,)](chunk_max, chunk_arg, out, num_chunks,
                                     BLOCK_CHUNKS=max(2, triton.next_power_of_2(num_chunks)))
    return out
