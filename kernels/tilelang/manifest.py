"""The TileLang SM90 backend (`tilelang-sm90`): which op kinds it implements. Importing this file imports no
kernel code; the registry loads each target only when a hardware config prefers this backend.

Each registered function keeps the torch op's signature and semantics and falls back to the torch op for
inputs its kernels do not cover (documented per function). Fast paths with explicit cache/weight formats:
linear.fp8_linear (Fp8BlockWeight), moe.moe_experts_packed, attention.sink_attention_decode, indexer.indexer_scores_fp4.
"""

from deepinfer.kernels.registry import register

BACKEND = "tilelang-sm90"
_WHERE = {
    "linear": "linear",
    "grouped_linear": "linear",
    "moe_router": "moe",
    "moe_experts": "moe",
    "sink_attention": "attention",
    "sink_attention_decode": "attention",
    "indexer_scores": "indexer",
    "indexer_scores_fp4": "indexer",
    "mhc_mixes": "mhc",
    "mhc_collapse": "mhc",
    "mhc_collapse_norm": "mhc",
    "mhc_expand": "mhc",
    "index_topk_ids": "topk",
    "index_topk_rows": "topk",
    "rms_norm": "rowwise",
    "rope": "rowwise",
    "fake_quant_fp8": "rowwise",
    "fake_quant_fp4": "rowwise",
    "encode_fp8": "rowwise",
    "encode_fp4": "rowwise",
    "window_kv": "window_kv",
    "compressor_pool": "compressor",
    "engram_hash": "engram",
    "engram_gate": "engram",
}
for _kind, _module in _WHERE.items():
    register(_kind, BACKEND, ("cuda",), f"deepinfer.kernels.tilelang.{_module}.{_kind}")
