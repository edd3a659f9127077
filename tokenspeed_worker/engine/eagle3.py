"""The EAGLE-3 drafter: after each step, a draft chain per decoding request from a draft head
(models/llama_eagle3.py) that reads the target's hidden states.

Positions pair up as EAGLE-3 was trained: the head's position p takes the token at p + 1 and the
target's hidden states at p (its residual stream entering three layers, `LlamaModel.aux_layers`)
and predicts the token at p + 2. After every step the engine hands over the positions the target
computed for good (`after_step`):
  - extend: the head runs over those positions (a prefill chunk's, a decode's, a verify step's
    kept ones), writing its own paged KV cache (one layer, the target's block ids) at them;
  - chain: for each request now decoding, its last extended position gives the first draft token
    (argmax over the draft vocabulary, mapped by d2t); k - 1 more head steps, each on the token just
    drafted and the head's own pre-norm hidden state, give the rest (top-1 chains; trees would
    need a tree-shaped verify). These later positions are speculative: their K/V sit in the
    request's own blocks or in scratch blocks past the pool and are rewritten by the next extend.
The drafts go to the scheduler (`Scheduler.set_draft`), which the next schedule() uses.

A cached prefix block carries the head's K/V of its positions too (same block ids), written when
the request that computed it extended over them. Runs on the engine's device, eagerly; the target's
states come from each forward, a decode graph's from its static copy (model_executor/cuda_graph.py).
One GPU for now (the head would run on rank 0 only, its embedding is the sharded target's).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenspeed_worker.layers.attention import AttentionInputs
from tokenspeed_worker.models.llama_eagle3 import Eagle3Head, read_config
from tokenspeed_worker.scheduler.plan import SchedulePlan

logger = logging.getLogger(__name__)


class Eagle3Drafter:
    def __init__(self, path: str, runner, num_blocks: int, max_num_seqs: int, num_tokens: int,
                 max_batch: int = 0) -> None:
        """path: the head's folder; runner: the target's ModelRunner, built for EAGLE3 (it keeps the
        states the head reads: --eagle3-layers-to-capture) with its KV pool allocated; num_tokens:
        drafts per request and step; max_batch: with more running requests than this, no chain (the
        scheduler would not draft for them: SpeculativeConfig.max_speculative_batch; 0: no limit)."""
        self.max_batch = max_batch
        target = runner.model.model  # a LlamaModel keeping the states the head reads (ModelRunner, EAGLE3)
        if not getattr(target, "aux_layers", ()):
            raise ValueError("the model runner was not built for EAGLE3 (speculative_algorithm) and keeps no states")
        config = read_config(path)
        target_hidden = runner.hf_config.hidden_size
        if getattr(config, "target_hidden_size", None) not in (None, target_hidden):
            raise ValueError(f"--speculative-draft-model-path {path}: made for a target of hidden size "
                             f"{config.target_hidden_size}, the model's is {target_hidden}")
        self.device, self.dtype = runner.device, runner.dtype
        self.head = Eagle3Head(config, target_hidden)
        self.head.load(path)
        self.head.to(device=self.device, dtype=self.dtype)
        self.head.d2t = self.head.d2t.to(device=self.device, dtype=torch.int64)
        self.embed = target.embed_tokens
        self.target = target
        self.backend = runner.attention_backend
        self.block_size = runner.block_size
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks
        # Scratch blocks past the pool for the speculative positions beyond a request's own blocks.
        self.scratch_per_row = -(-(num_tokens + 1) // self.block_size)
        pool = num_blocks + 1 + max_num_seqs * self.scratch_per_row  # +1: the target's dummy block, if any
        attn = self.head.midlayer.attn
        shape = self.backend.kv_cache_shape(pool, self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_cache = torch.zeros((2, *shape), dtype=runner.kv_dtype, device=self.device)
        attn.bind_kv_cache(self.kv_cache[0], self.kv_cache[1], self.backend)
        self.scratch_base = num_blocks + 1
        logger.info("EAGLE-3 draft head %s: %d draft tokens per step, draft vocabulary %d, target layers %s, "
                    "draft KV %.1f MiB", path, num_tokens, self.head.draft_vocab_size, list(target.aux_layers),
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    # -- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def after_step(self, plan: SchedulePlan, final: np.ndarray, scheduler, finished: set[int]) -> None:
        """plan: the step the target just ran (its hidden states in `aux_hidden`); final[b]: how many of
        row b's computed positions are final (its kept tokens); finished: rows that ended in it."""
        aux = self.target.aux_hidden
        if aux is None:
            return
        self.target.aux_hidden = None
        cu = plan.cu_query_lens
        rows, tables, starts, counts, ids, hidden_index, known = [], [], [], [], [], [], []
        for b in range(plan.num_reqs):
            row, count = int(plan.req_ids[b]), int(final[b])
            if count <= 0 or row in finished or not scheduler.contains(row):
                continue
            tokens = scheduler.token_ids(row)
            ctx = int(plan.context_lens[b])
            rows.append(row)
            tables.append(scheduler.block_ids(row))
            starts.append(ctx)
            counts.append(count)
            ids.append(tokens[ctx + 1: ctx + 1 + count])  # the token after each position
            known.append(tokens.shape[0])
            hidden_index.append(np.arange(cu[b], cu[b] + count))
        if not rows:
            return
        hidden = aux[torch.from_numpy(np.concatenate(hidden_index)).to(self.device)]
        logits, pre_norm = self._forward(rows, tables, np.asarray(starts), np.asarray(counts), np.concatenate(ids),
                                         hidden, [None] * len(rows))
        # Rows now decoding: their last final position is the one before their newest token.
        last = np.cumsum(counts) - 1
        decoding = [i for i, row in enumerate(rows)
                    if starts[i] + counts[i] + 1 == known[i] and scheduler.output_len(row) > 0]
        if not decoding or (self.max_batch and scheduler.num_running > self.max_batch):
            return  # the head's K/V is extended regardless: later steps may draft
        pick = torch.from_numpy(last[decoding]).to(self.device)
        drafts = [self.head.target_ids(logits[pick].argmax(-1))]
        g = pre_norm[pick]
        d_rows = [rows[i] for i in decoding]
        d_tables = [tables[i] for i in decoding]
        position = np.asarray([starts[i] + counts[i] for i in decoding])  # the newest token's position
        scratch = [self.scratch_base + k * self.scratch_per_row + np.arange(self.scratch_per_row)
                   for k in range(len(decoding))]
        for _ in range(self.num_tokens - 1):
            logits, g = self._forward(d_rows, d_tables, position, np.ones(len(d_rows), dtype=np.int64),
                                      drafts[-1].cpu().numpy(), g, scratch)
            drafts.append(self.head.target_ids(logits.argmax(-1)))
            position = position + 1
        chains = torch.stack(drafts, dim=1).cpu().numpy()
        for k, row in enumerate(d_rows):
            scheduler.set_draft(row, chains[k])

    def _forward(self, rows, tables, starts, counts, ids, hidden, scratch):
        """The head over `counts[i]` positions of row i from `starts[i]` (its K/V before them in place),
        each on the token `ids` holds for it (flat) and its hidden state. Positions past a row's own
        blocks use its scratch blocks. Returns (logits, pre-norm hidden) per position."""
        bs = self.block_size
        width = max(len(t) + (0 if s is None else len(s)) for t, s in zip(tables, scratch))
        width = max(width, int(((starts + counts - 1) // bs).max()) + 1)
        block_tables = np.zeros((len(rows), width), dtype=np.int32)
        for i, (table, extra) in enumerate(zip(tables, scratch)):
            full = table if extra is None else np.concatenate([table, extra])
            block_tables[i, :len(full)] = full
        positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)]).astype(np.int64)
        owner = np.repeat(np.arange(len(rows)), counts)
        slots = block_tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        plan = SchedulePlan(
            req_ids=np.asarray(rows, dtype=np.int64), query_lens=np.asarray(counts, dtype=np.int32),
            context_lens=np.asarray(starts, dtype=np.int32), input_ids=np.asarray(ids, dtype=np.int64),
            positions=positions, slot_mapping=slots, block_tables=block_tables,
            sample_rows=np.arange(len(rows), dtype=np.int32))
        to = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a, dtype=dt)).to(self.device)  # noqa: E731
        metadata = self.backend.build_metadata(AttentionInputs(
            plan=plan, query_lens=to(plan.query_lens, np.int32), context_lens=to(plan.context_lens, np.int32),
            slot_mapping=to(slots, np.int64), block_tables=to(block_tables, np.int32), block_size=bs))
        input_ids = to(plan.input_ids, np.int64)
        return self.head(self.embed(input_ids), hidden, to(positions, np.int64), metadata)
