"""Mixture of experts: a router picks `top_k` of `num_experts` SiLU-gated MLPs per token, and the
token's output is their sum weighted by the router's probabilities.

    SparseMoeBlock(x) = sum over the chosen e of w_e * down_e(silu(gate_e x) * up_e x)

- `select_experts(router_logits, top_k, renormalize)`: softmax over all experts in float32, the
  top_k of it, renormalized to sum to 1 where the model says so (Qwen3-MoE's `norm_topk_prob`,
  always for Mixtral). Shaped so grouped top-k (DeepSeek) can add its own selection; a shared
  expert (Qwen2-MoE) is a dense branch beside the experts (`SparseMoeBlock(shared_expert=...)`).
- `FusedMoE`: every expert's weights stacked, `w13_weight` [E, 2 I, H] (gate rows, then up rows)
  and `w2_weight` [E, H, I], loaded from the checkpoint's per-expert matrices (Qwen3-MoE's
  `experts.<e>.gate_proj/up_proj/down_proj`, Mixtral's `experts.<e>.w1/w3/w2`). Tensor parallel:
  each rank holds I / tp of every expert's intermediate rows (gate and up split by rows, down by
  columns) and the outputs are summed over ranks, as the dense MLP does. Expert parallel
  (`expert_parallel(ep)` while building; --ep-size, --enable-expert-parallel): the experts are
  dealt in E / ep contiguous ranges to ep groups of tp / ep consecutive ranks, each group's ranks
  splitting their experts' intermediate rows; every rank sees every token (attention is tensor
  parallel, its output replicated), runs the pairs routed to its own experts, and the same
  all-reduce sums the partial outputs. No all-to-all: the tokens are already everywhere.

The router's choice runs as one kernel and the experts as grouped GEMMs (kernels/moe.py: pairs
sorted by expert on the device, one Triton kernel per projection; a decode step's few pairs skip
the sort for two GEMV kernels; no host sync, so CUDA graphs capture them) where the fused kernels
run (layers/fused_kernels.py: CUDA with triton), checked once after loading against the
reference (`kernels_agree`). Elsewhere, the reference: a loop over the experts chosen in the step
(each expert's tokens gathered, its MLP, the weighted rows added back), exact against
transformers, which syncs with the host once per step, so no CUDA graphs there.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_worker import distributed
from tokenspeed_worker.kernels.fp8 import FP8_DTYPE, expand_scales
from tokenspeed_worker.kernels.moe import ExpertScales, GroupedConfig, nearest_tiles, parse_tiles, tiles_key
from tokenspeed_worker.layers import small_batch_gemv
from tokenspeed_worker.layers.fused_kernels import use_fused
from tokenspeed_worker.layers.layernorm import PendingNorm
from tokenspeed_worker.layers.linear import Linear, _divide
from tokenspeed_worker.layers.quantization import methods as quant_methods

logger = logging.getLogger(__name__)

# A checkpoint expert tensor: "<prefix>.experts.<e>.<name>.<kind>", kind "weight" or, for FP8
# experts, its scale ("weight_scale", "weight_scale_inv") or a static input scale; name -> which
# part of FusedMoE.
EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<expert>\d+)\.(?P<name>\w+)\."
                           r"(?P<kind>weight|weight_scale|weight_scale_inv|input_scale)$")
PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def expert_param_name(kind: str, part: str) -> str | None:
    """FusedMoE's parameter for a checkpoint expert tensor of `kind` and `part`; None for a static
    input scale (FP8 experts multiply 16-bit activations: there is nothing to scale)."""
    if kind == "input_scale":
        return None
    stem = "w2" if part == "down" else "w13"
    return f"{stem}_weight" if kind == "weight" else f"{stem}_scale"


_EP_SIZE = 1  # the expert parallel size FusedMoE layers are built with (expert_parallel)


@contextmanager
def expert_parallel(size: int) -> Iterator[None]:
    """Within the block, FusedMoE layers deal their experts to `size` groups of the ranks."""
    global _EP_SIZE
    previous, _EP_SIZE = _EP_SIZE, size
    try:
        yield
    finally:
        _EP_SIZE = previous


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]) of router_logits [T, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """The experts of one layer, stacked (module docstring); forward(x, weights, ids) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, prefix: str = "") -> None:
        super().__init__()
        self.use_kernels = True  # False after kernels_agree() found the kernels wrong on this device
        self.gemv = small_batch_gemv.current()  # times a decode step's paths (the runner's chooser, or None)
        self.num_experts = num_experts  # the model's, all ranks together; expert ids are global
        ep = _EP_SIZE
        moe_tp = distributed.size() // ep
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts cannot be dealt evenly to {ep} expert-parallel groups "
                             f"(--ep-size must divide the number of experts)")
        self.num_local_experts = num_experts // ep
        self.first_expert = (distributed.rank() // moe_tp) * self.num_local_experts  # this rank's: [first, first + local)
        self.moe_tp_rank = distributed.rank() % moe_tp
        self.full_intermediate = intermediate_size
        self.intermediate = _divide(intermediate_size, moe_tp, "the experts' intermediate size")
        local, n = self.num_local_experts, self.intermediate
        # FP8 experts (the checkpoint's quantization config, unless it ignores the experts): FP8
        # weights and every expert matrix's whole scale tensor (this rank's rows are picked from
        # it after loading, whatever the tensor-parallel split); process_weights_after_loading
        # keeps them FP8 for the grouped GEMM or dequantizes them.
        config = quant_methods.current_config()
        name = f"{prefix}.experts" if prefix else "experts"
        quantized = config is not None and not config.online and config.layer_is_quantized(name, [name])
        self.scheme = config.scheme if quantized else None  # online FP8 (--quantization fp8) leaves experts 16-bit
        dtype = FP8_DTYPE if self.scheme is not None else None
        self.params_dtype = torch.get_default_dtype()  # the model's: what FP8 experts are dequantized to
        self.tuned_tiles: dict[int, GroupedConfig] = {}  # the grouped GEMMs' tiles by pair count (take_tuned_tiles)
        self._tiles_at: dict[int, GroupedConfig | None] = {}  # pair count -> nearest_tiles of it (memo)
        self.w13_scales: ExpertScales | None = None  # kept FP8 experts' (process_weights_after_loading)
        self.w2_scales: ExpertScales | None = None
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * n, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, n, dtype=dtype), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.expert_loader = self.load_expert
        if self.scheme is not None:
            gate_tile, down_tile = self._tile((intermediate_size, hidden_size)), self._tile((hidden_size, intermediate_size))
            self.w13_scale = nn.Parameter(torch.empty(local, 2, -(-intermediate_size // gate_tile[0]),
                                                      -(-hidden_size // gate_tile[1]), dtype=torch.float32),
                                          requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(local, -(-hidden_size // down_tile[0]),
                                                     -(-intermediate_size // down_tile[1]), dtype=torch.float32),
                                         requires_grad=False)
            for param in (self.w13_scale, self.w2_scale):
                param.expert_loader = self.load_expert_scale

    def _tile(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The (rows, cols) a scale covers in a checkpoint expert matrix of `shape`."""
        if self.scheme.weight == "block":
            return self.scheme.block
        return (1, shape[1]) if self.scheme.weight == "channel" else shape

    def load_expert_scale(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str) -> int:
        """Copy expert `expert`'s whole scale tensor of `part` into `param` (FP8 experts); returns
        the elements filled (0 for another rank's expert)."""
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return 0
        target = param.data[local] if part == "down" else param.data[local, 0 if part == "gate" else 1]
        if loaded.numel() != target.numel():
            raise ValueError(f"expert {expert} {part} scale: expected {tuple(target.shape)} ({self.scheme.weight} "
                             f"scales), checkpoint has {tuple(loaded.shape)}")
        target.copy_(loaded.reshape(target.shape))
        return target.numel()

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """FP8 experts: kept FP8 with this rank's scales (`w13_scales`, `w2_scales`) where the
        grouped-GEMM kernels run on a GPU that keeps FP8 (compute capability 9.0+; also forced in
        tests), else each weight times its scales in the model's dtype. The checkpoint's whole
        scale tensors are dropped. Nothing to do for 16-bit experts."""
        if self.scheme is None:
            return
        device = self.w13_weight.device
        keep = self._kernels(self.w13_weight) is not None and (
            device.type != "cuda" or quant_methods.keeps_fp8(device))
        if keep and self._keep_fp8():
            return
        dtype = self.params_dtype
        n, offset = self.intermediate, self.moe_tp_rank * self.intermediate
        full, hidden = self.full_intermediate, self.w13_weight.shape[2]
        gate_tile, down_tile = self._tile((full, hidden)), self._tile((hidden, full))
        w13 = torch.empty(self.w13_weight.shape, dtype=dtype, device=self.w13_weight.device)
        w2 = torch.empty(self.w2_weight.shape, dtype=dtype, device=self.w2_weight.device)
        for e in range(self.num_local_experts):
            for half in range(2):  # gate rows, then up rows
                scales = expand_scales(self.w13_scale[e, half], *gate_tile, (full, hidden))[offset:offset + n]
                rows = slice(half * n, (half + 1) * n)
                w13[e, rows] = (self.w13_weight[e, rows].float() * scales).to(dtype)
            scales = expand_scales(self.w2_scale[e], *down_tile, (hidden, full))[:, offset:offset + n]
            w2[e] = (self.w2_weight[e].float() * scales).to(dtype)
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        del self.w13_scale, self.w2_scale

    def _keep_fp8(self) -> bool:
        """Keep the FP8 weights, with this rank's tiles of the scales as the grouped GEMM reads
        them (kernels/moe.ExpertScales); False (nothing changed) where this rank's columns of the
        down projection start inside a column group, which the GEMM cannot scale."""
        n, offset = self.intermediate, self.moe_tp_rank * self.intermediate
        full, hidden = self.full_intermediate, self.w13_weight.shape[2]
        (gate_rows, gate_cols), (down_rows, down_cols) = self._tile((full, hidden)), self._tile((hidden, full))
        if down_cols < full and (offset % down_cols or down_cols % 16) or gate_cols < hidden and gate_cols % 16:
            return False
        if n % gate_rows == 0:  # this rank's gate and up rows are whole tile rows
            rows = self.w13_scale[:, :, offset // gate_rows:(offset + n) // gate_rows]
        else:  # one scale row per weight row
            rows = self.w13_scale.repeat_interleave(gate_rows, 2)[:, :, offset:offset + n]
            gate_rows = 1
        w13_scales = rows.reshape(self.num_local_experts, -1, rows.shape[-1]).contiguous()
        first = offset // down_cols if down_cols < full else 0
        w2_scales = self.w2_scale[:, :, first:first + -(-n // min(down_cols, full))].contiguous()
        del self.w13_scale, self.w2_scale
        self.w13_scales = ExpertScales(w13_scales, gate_rows, min(gate_cols, hidden))
        self.w2_scales = ExpertScales(w2_scales, down_rows, min(down_cols, n))
        return True

    def _dense_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the reference loop multiplies them: kept FP8 weights times their scales."""
        if self.w13_scales is None:
            return self.w13_weight, self.w2_weight
        out = []
        for weight, sc in ((self.w13_weight, self.w13_scales), (self.w2_weight, self.w2_scales)):
            scales = torch.stack([expand_scales(sc.scales[e], sc.rows, sc.cols, weight.shape[1:])
                                  for e in range(weight.shape[0])])
            out.append((weight.float() * scales).to(self.params_dtype))
        return out[0], out[1]

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str) -> int:
        """Copy this rank's share of expert `expert`'s checkpoint matrix `part` ("gate", "up",
        "down") into `param`; returns the elements filled (0 for another rank's expert)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the model has {self.num_experts})")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return 0
        n, rank = self.intermediate, self.moe_tp_rank
        hidden = self.w13_weight.shape[2]
        if part == "down":
            if tuple(loaded.shape) != (hidden, self.full_intermediate):
                raise ValueError(f"expert down matrix: expected {(hidden, self.full_intermediate)}, "
                                 f"checkpoint has {tuple(loaded.shape)}")
            target, source = param.data[local], loaded.narrow(1, rank * n, n)
        else:
            if tuple(loaded.shape) != (self.full_intermediate, hidden):
                raise ValueError(f"expert {part} matrix: expected {(self.full_intermediate, hidden)}, "
                                 f"checkpoint has {tuple(loaded.shape)}")
            target = param.data[local].narrow(0, 0 if part == "gate" else n, n)
            source = loaded.narrow(0, rank * n, n)
        target.copy_(source)
        return target.numel()

    def take_tuned_tiles(self, stored: dict[str, str]) -> int:
        """Take the grouped GEMMs' tiles tuned for this layer's shape as it runs (its experts, hidden
        and intermediate rows on this rank, its weights' dtype after loading) from `stored`
        ({kernels/moe.tiles_key/pairs: tiles_text}, kernel_cache.MOE_FILE); returns how many."""
        prefix = tiles_key(self.num_local_experts, self.w13_weight.shape[2], self.intermediate, self.w13_weight.dtype)
        for key, text in stored.items():
            shape, _, pairs = key.rpartition("/")
            tiles = parse_tiles(text)
            if shape == prefix and pairs.isdigit() and tiles is not None:
                self.tuned_tiles[int(pairs)] = tiles
        self._tiles_at.clear()
        return len(self.tuned_tiles)

    def _tiles(self, pairs: int) -> GroupedConfig | None:
        """The tuned tiles nearest `pairs`, looked up once per pair count (an eager step calls this in
        every MoE layer)."""
        if pairs not in self._tiles_at:
            self._tiles_at[pairs] = nearest_tiles(self.tuned_tiles, pairs)
        return self._tiles_at[pairs]

    def _kernels(self, x: torch.Tensor):
        return use_fused(x, "moe") if self.use_kernels else None

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a step can be captured: the grouped-GEMM kernels run, not the loop (a host sync)."""
        return self._kernels(self.w13_weight) is not None

    @torch.no_grad()
    def kernels_agree(self, top_k: int, tokens: tuple[int, ...] = (37, 2)) -> bool:
        """Run the kernels once on random tokens (a prefill's grouped GEMMs and a decode step's
        kernels, with the routing kernel) against the loop; False (and the loop from then on) where
        they disagree beyond rounding: a kernel this GPU, driver or Triton miscompiles."""
        kernels = self._kernels(self.w13_weight)
        if kernels is None:
            return True
        error = 0.0
        for count in tokens:
            x = torch.randn(count, self.w13_weight.shape[2], device=self.w13_weight.device, dtype=self.params_dtype)
            logits = torch.randn(count, self.num_experts, device=x.device)
            weights, ids = kernels.route(logits, top_k, True)
            expected_weights, expected_ids = select_experts(logits, top_k, True)
            if not torch.equal(ids.long(), expected_ids) or not torch.allclose(weights, expected_weights, atol=1e-6):
                error = float("inf")
                break
            got = self._experts(x, weights, ids).float()
            self.use_kernels = False
            expected = self._experts(x, weights, ids).float()
            self.use_kernels = True
            error = max(error, ((got - expected).norm() / expected.norm().clamp(min=1e-30)).item())
        self.use_kernels = error < 2e-2  # the model dtype's rounding of the intermediate rows
        if not self.use_kernels:
            logger.error("MoE: the grouped-GEMM kernels disagree with the reference loop on this device (relative "
                         "error %.3g); the experts run the loop, without CUDA graphs", error)
        return self.use_kernels

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The sum over every rank's experts; reduce=False: this rank's part, for the caller's one all-reduce."""
        out = self._experts(x, weights, ids)
        return distributed.all_reduce(out) if reduce and distributed.size() > 1 else out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's sum over the chosen experts it holds: the grouped-GEMM kernels where they
        run, else the loop. ids are global; with expert parallelism another rank's expert becomes
        num_local_experts, which neither path computes (its pairs add nothing here)."""
        if self.num_local_experts != self.num_experts:
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.num_local_experts), ids, self.num_local_experts)
        kernels = self._kernels(x)
        if kernels is not None:
            def run(decode=None):
                return kernels.fused_experts(x, self.w13_weight, self.w2_weight, weights, ids,
                                             foreign=self.num_local_experts != self.num_experts,
                                             w13_scales=self.w13_scales, w2_scales=self.w2_scales,
                                             total_experts=self.num_experts, decode=decode,
                                             config=self._tiles(ids.numel()))

            # A decode step on the GPU: the chooser's timed path (elsewhere, Triton's interpreter in
            # tests, fused_experts' own rule: timing means nothing there).
            if self.gemv is not None and x.is_cuda and 0 < ids.numel() <= kernels.SMALL_PAIRS:
                return self.gemv.experts(x, self.w13_weight, run, lambda: run(False),
                                         kernels.decode_configs(self.w13_weight))
            return run()
        w13, w2 = self._dense_experts()
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            if expert == self.num_local_experts:
                continue
            tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
            gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert])
            out.index_add_(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
        return out


def is_sparse_layer(config, index: int) -> bool:
    """Whether layer `index` of a Qwen-MoE config has experts: not listed in `mlp_only_layers`, and
    on the `decoder_sparse_step` stride (the others keep a dense MLP)."""
    return (index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (index + 1) % config.decoder_sparse_step == 0)


class SparseMoeBlock(nn.Module):
    """The MLP of a layer with experts: the router (`gate`, replicated on every rank) and the experts,
    and where the model has one (Qwen2-MoE) a shared expert beside them: a dense MLP every token
    passes through (tensor parallel as the dense MLPs are), scaled per token by
    sigmoid(shared_expert_gate(x)) (a one-row Linear, replicated and 16-bit as the router) and added
    to the experts' sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 prefix: str = "", router_name: str = "gate", shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.router_name = top_k, renormalize, router_name
        with quant_methods.building(None):  # the router stays 16-bit in FP8 checkpoints (Qwen3-*-FP8, DeepSeek)
            setattr(self, router_name, Linear(hidden_size, num_experts, prefix=f"{prefix}.{router_name}"))
            self.shared_expert_gate = None
            if shared_expert is not None:
                self.shared_expert_gate = Linear(hidden_size, 1, prefix=f"{prefix}.shared_expert_gate")
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, prefix=prefix)
        self.shared_expert = shared_expert

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            x = x.apply()
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = getattr(self, self.router_name)(x)
        kernels = self.experts._kernels(logits)
        if kernels is not None:  # the same choice in one kernel
            weights, ids = kernels.route(logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(logits, self.top_k, self.renormalize)
        if self.shared_expert is None:
            return self.experts(x, weights, ids).view(shape)
        # transformers' order and roundings: the gate's sigmoid, its product, the sum. Under tensor
        # or expert parallelism both terms are partial sums over the ranks and the per-token scale is
        # replicated, so one all-reduce of their sum replaces one per term.
        out = self.experts(x, weights, ids, reduce=False)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        if distributed.size() > 1:
            out = distributed.all_reduce(out)
        return out.view(shape)
