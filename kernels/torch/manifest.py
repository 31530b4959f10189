"""The torch reference backend: every op kind, on any device torch runs on."""

from deepinfer.kernels.registry import register

_DEVICES = ("cpu", "cuda", "npu")
_WHERE = {
    "linear": "linear",
    "grouped_linear": "linear",
    "rms_norm": "norm",
    "rope": "rope",
    "fake_quant_fp8": "quant",
    "fake_quant_fp4": "quant",
    "encode_fp8": "cache_formats",
    "encode_fp4": "cache_formats",
    "window_kv": "window_kv",
    "mhc_mixes": "mhc",
    "mhc_collapse": "mhc",
    "mhc_collapse_norm": "mhc",
    "mhc_expand": "mhc",
    "sink_attention": "attention",
    "sink_attention_decode": "attention",
    "compressor_pool": "compressor",
    "indexer_scores": "indexer",
    "indexer_scores_fp4": "indexer",
    "index_topk_ids": "indexer",
    "index_topk_rows": "indexer",
    "moe_router": "moe",
    "moe_experts": "moe",
    "engram_hash": "engram",
    "engram_gate": "engram",
    "vision_attention": "vision",
}
for _kind, _module in _WHERE.items():
    register(_kind, "torch", _DEVICES, f"deepinfer.kernels.torch.{_module}.{_kind}")
