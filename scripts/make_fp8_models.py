"""Make tiny FP8 checkpoints, one per format the worker loads, from the tiny float models of
make_tiny_models.py, each with its dequantized reference (the same weights as float32, without a
quantization config) that transformers loads.

    <out>/<name>/       the FP8 checkpoint (config.json with quantization_config, or
                        hf_quant_config.json for ModelOpt; FP8 e4m3 weights and float32 scales)
    <out>/<name>-ref/   float32: every quantized weight replaced by fp8 * scale

Formats (name: base model, scheme):
    ct-tensor     qwen2-bias      compressed-tensors, per-tensor weights, static per-tensor input scales
    ct-channel    llama-gqa-tied  compressed-tensors, per-channel weights, dynamic per-token
                                  activations; ignores layer 0's q/k/v ("re:") and lm_head
    fp8-tensor    qwen2-bias      quant_method fp8, per-tensor weight_scale, static input_scale
    fp8-block     qwen3-qknorm    quant_method fp8, weight_block_size [128, 128] (weight_scale_inv)
                                  on 64/128-wide matrices: partial blocks only
    fp8-block-moe qwen3-moe       fp8-block with FP8 experts (their routers 16-bit)
    ct-channel-moe mixtral        compressed-tensors per-channel, FP8 experts (w1/w2/w3)
    fp8-sharded   qwen2-bias      fp8-tensor saved in several shards with an index
    modelopt      llama-gqa-tied  ModelOpt FP8 (hf_quant_config.json), with k/v cache scales
    online        llama-gqa-tied  no quantization: the float checkpoint itself, for `--quantization fp8`
                                  (its reference: every linear weight quantized per output channel)

Deterministic and idempotent (a finished folder is left alone).

    python scripts/make_fp8_models.py [out_dir]      # default: .cache/fp8_models
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

FP8_MAX = 448.0
# Every linear weight, the experts' too (Qwen3-MoE's gate/up/down_proj, Mixtral's w1/w2/w3); not a
# router (`mlp.gate`, `block_sparse_moe.gate`), which FP8 checkpoints keep 16-bit.
LINEAR = re.compile(r"\.((q|k|v|o|gate|up|down)_proj|experts\.\d+\.w[123])\.weight$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def _ct_config(weights: str, activations: dict | None, ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True},
            "input_activations": activations,
        }},
        "ignore": ignore,
    }


STATIC_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}

# name -> (base tiny model, weight scheme, static input scales, quantization_config or None, extra)
SPECS: dict[str, tuple[str, str, bool, dict | None, dict]] = {
    "ct-tensor": ("qwen2-bias", "tensor", True, _ct_config("tensor", STATIC_TENSOR, ["lm_head"]), {}),
    "ct-channel": ("llama-gqa-tied", "channel", False,
                   _ct_config("channel", DYNAMIC_TOKEN, ["lm_head", r"re:model\.layers\.0\.self_attn\.[qkv]_proj"]),
                   {"ignore_re": r"model\.layers\.0\.self_attn\.[qkv]_proj"}),
    "fp8-tensor": ("qwen2-bias", "tensor", True, {"quant_method": "fp8", "activation_scheme": "static"}, {}),
    "fp8-block": ("qwen3-qknorm", "block", False,
                  {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [128, 128]}, {}),
    "fp8-block-moe": ("qwen3-moe", "block", False,
                      {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                       "weight_block_size": [128, 128]}, {}),
    "ct-channel-moe": ("mixtral", "channel", False, _ct_config("channel", DYNAMIC_TOKEN, ["lm_head"]), {}),
    "fp8-sharded": ("qwen2-bias", "tensor", True, {"quant_method": "fp8", "activation_scheme": "static"},
                    {"shards": 4}),
    "modelopt": ("llama-gqa-tied", "tensor", True, None, {"modelopt": True}),
    "online": ("llama-gqa-tied", "channel", False, None, {"online": True}),
}


def quantize(weight, scheme: str, block: int = 128):
    """(fp8 weight, float32 scale, dequantized float32 weight) of a float [out, in] matrix."""
    import torch

    w = weight.to(torch.float32)
    if scheme == "tensor":
        scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12).reshape(())
        full = scale
    elif scheme == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        full = scale
    else:
        out, inp = w.shape
        rows, cols = math.ceil(out / block), math.ceil(inp / block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:out, :inp] = w
        tiles = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3))
        scale = (tiles / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.to(torch.float32) * full


def _save(tensors: dict, out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_pair(name: str, base: Path, out: Path, ref: Path) -> None:
    import torch
    from safetensors import safe_open

    base_name, scheme, static, qconfig, extra = SPECS[name]
    torch.manual_seed(0)
    state = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    quantized, reference = {}, {}
    for key, tensor in state.items():
        module = key[: -len(".weight")]
        if not LINEAR.search(key) or ("ignore_re" in extra and re.fullmatch(extra["ignore_re"], module)):
            quantized[key] = reference[key] = tensor
            continue
        q, scale, deq = quantize(tensor, scheme)
        reference[key] = deq
        if extra.get("online"):  # the worker quantizes the float weight itself
            quantized[key] = tensor
            continue
        quantized[key] = q
        quantized[f"{module}.{'weight_scale_inv' if scheme == 'block' else 'weight_scale'}"] = scale
        if static:  # a made-up calibration: the scale of a unit-range activation
            quantized[f"{module}.input_scale"] = torch.tensor(1.0 / FP8_MAX + 0.001 * len(module) / 100)
    config = json.loads((base / "config.json").read_text())
    for folder in (out, ref):
        for file in TOKENIZER_FILES:
            if (base / file).exists():
                shutil.copy(base / file, folder / file)
    (ref / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _save(reference, ref, 1)
    if extra.get("modelopt"):
        for layer in range(config["num_hidden_layers"]):
            for kv in "kv":
                quantized[f"model.layers.{layer}.self_attn.{kv}_proj.{kv}_scale"] = torch.tensor(1.0)
        hf_quant = {"producer": {"name": "modelopt", "version": "0.19.0"},
                    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    elif qconfig is not None:
        config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _save(quantized, out, extra.get("shards", 1))


def _is_complete(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def make_all(out_dir: str | os.PathLike, tiny_models: dict[str, Path]) -> dict[str, tuple[Path, Path]]:
    """Every FP8 model and its reference under out_dir (finished ones are left alone), made from
    the tiny models `tiny_models` (name -> folder, as make_tiny_models.make_all returns them);
    name -> (FP8 folder, reference folder)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: (out_dir / name, out_dir / f"{name}-ref") for name in SPECS}
    for name, (fp8_dir, ref_dir) in paths.items():
        if _is_complete(fp8_dir) and _is_complete(ref_dir):
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_dir))
        (tmp / "fp8").mkdir()
        (tmp / "ref").mkdir()
        make_pair(name, tiny_models[SPECS[name][0]], tmp / "fp8", tmp / "ref")
        for src, dst in ((tmp / "ref", ref_dir), (tmp / "fp8", fp8_dir)):  # the FP8 folder last: it marks done
            shutil.rmtree(dst, ignore_errors=True)
            os.rename(src, dst)
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("out_dir", nargs="?", default=str(root / ".cache" / "fp8_models"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(root / "scripts"))
    import make_tiny_models

    for name, (fp8_dir, ref_dir) in make_all(args.out_dir, make_tiny_models.make_all(root / ".cache" / "tiny_models")).items():
        print(f"{name}: {fp8_dir} (reference {ref_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
