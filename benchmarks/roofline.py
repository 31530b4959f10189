#!/usr/bin/env python3
# Verbatim copy of shared/tools/roofline.py (the device machine only gets the repo); only this comment line is added.
"""Roofline floors for DeepSeek-V4.1 decode and prefill steps: the fewest bytes a step must move through device
memory and the FLOPs it must do, per layer, from a checkpoint's config.json (the released V4.1-Flash by default).

    python3 roofline.py [--config DIR/config.json] [--batch 1 8 64 256] [--context 4096 32768]
                        [--bandwidth 4.27e12] [--flops 699e12] [--prefill 8192]

Use these figures as the denominators of "fraction of roofline" so every benchmark counts the same way.
Assumptions (stated, so they can be argued with): weights are read once per step; routed experts in the released
format are FP4 (0.5 byte + 1/32 byte of scale per weight), attention/shared-expert/indexer-q/engram projections FP8
(1 byte + 1/1024 of scale), compressor/indexer-k/router/head/norms BF16, mHC FP32; the distinct routed experts a
batch of B tokens touches is E * (1 - (1 - k/E)^B) (uniform routing); the sliding window KV is FP8 (512 B/token),
compressed KV FP4 (288 B/entry), indexer keys FP4 (68 B/entry); each query reads the full window and top-k
compressed entries; index-source layers read every indexer key (the candidate source) or the candidate pool.
"""
import argparse, json, math

FLASH = dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=64, head_dim=512, q_lora_rank=1280,
             qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2304, n_routed_experts=384,
             n_shared_experts=1, num_experts_per_tok=6, sliding_window=128, index_n_heads=32, index_head_dim=128,
             index_topk=512, compress_ratios=[0, 0] + [2] * 18 + [1] * 20, kv_source_layer_ids=[2, 8, 14, 20],
             index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], candidate_source_layer_id=20,
             candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4, vocab_size=129280,
             engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256)
FP8, FP4, BF16, FP32 = 1 + 1 / 1024, 0.5 + 1 / 32, 2, 4


def load(path):
    if not path:
        return dict(FLASH)
    cfg = json.load(open(path))
    text = cfg.get("text_config", cfg)
    out = dict(FLASH)
    out.update({k: v for k, v in text.items() if k in FLASH and v is not None})
    out["compress_ratios"] = list(out["compress_ratios"])[: out["num_hidden_layers"]]
    return out


def layer_floor(c, layer, batch, context, prefill_tokens=0):
    """(bytes, flops) of one layer for a decode step of `batch` sequences at `context` tokens each,
    or for a prefill of `prefill_tokens` tokens (batch 1) when prefill_tokens > 0."""
    H, nh, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    q, og, ol, I = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"]
    E, k, n = c["n_routed_experts"], c["num_experts_per_tok"], c["hc_mult"]
    ratio = c["compress_ratios"][layer]
    tokens = prefill_tokens or batch
    w = 0.0  # weight bytes
    proj = H * q + q * nh * hd + H * hd + (nh * hd) * ol + og * ol * H  # wq_a, wq_b, wkv, wo_a (grouped), wo_b
    w += proj * FP8
    w += 2 * (2 + n) * n * n * H * FP32  # mHC fn for the attention and the FFN sites
    is_src = layer in c["kv_source_layer_ids"]
    is_idx = layer in c["index_source_layer_ids"]
    if is_src:
        w += H * hd * BF16 * (2 if ratio > 1 else 1)  # compressor wkv (+ wgate at ratio 2)
        w += hd * c["index_head_dim"] * BF16  # indexer wk
    if is_idx:
        w += q * c["index_n_heads"] * c["index_head_dim"] * FP8 + H * c["index_n_heads"] * BF16
    w += E * H * BF16  # router
    experts = E * (1 - (1 - k / E) ** tokens)
    w += experts * 3 * H * I * FP4 + c["n_shared_experts"] * 3 * H * I * FP8
    flops = 2 * tokens * (proj + (k + c["n_shared_experts"]) * 3 * H * I + E * H)
    if layer in c.get("engram_layer_ids", []):
        feats = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"] * c["engram_head_dim"]
        w += feats * (n + 1) * H * FP8 + tokens * feats * FP8
        flops += 2 * tokens * feats * (n + 1) * H
    # KV traffic and attention FLOPs
    win = min(c["sliding_window"], context)
    kv = 0.0
    if prefill_tokens:
        ctx = prefill_tokens
        kv += ctx * hd * FP8  # write own window KV
        att_keys = win + (min(c["index_topk"], ctx // max(ratio, 1)) if ratio else 0)
        flops += 2 * 2 * ctx * nh * hd * att_keys
        if is_idx:
            flops += 2 * ctx * c["index_n_heads"] * c["index_head_dim"] * (ctx / max(ratio, 1)) / 2
    else:
        per_seq = win * hd * FP8
        if ratio:
            entries = context // ratio
            per_seq += min(c["index_topk"], entries) * 288
            if is_idx:
                scored = entries if (layer == c["candidate_source_layer_id"] or layer < c["candidate_source_layer_id"]) \
                    else min(entries, c["candidate_topk_blocks"] * c["candidate_block_size"])
                per_seq += scored * 68
                flops += 2 * batch * c["index_n_heads"] * c["index_head_dim"] * scored
            att_keys = win + min(c["index_topk"], entries)
        else:
            att_keys = win
        kv += batch * per_seq
        flops += 2 * 2 * batch * nh * hd * att_keys
    return w + kv, flops


def step_floor(c, batch, context, prefill_tokens=0):
    total_b = total_f = 0.0
    for layer in range(c["num_hidden_layers"]):
        b, f = layer_floor(c, layer, batch, context, prefill_tokens)
        total_b += b; total_f += f
    tokens = prefill_tokens or batch
    total_b += c["vocab_size"] * c["hidden_size"] * BF16  # lm head (embedding rows are negligible)
    total_f += 2 * (1 if prefill_tokens else tokens) * c["vocab_size"] * c["hidden_size"]
    return total_b, total_f


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config"); ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (measure: device-to-device copy)")
    ap.add_argument("--flops", type=float, default=699e12, help="FLOP/s (measure: large bf16 GEMM)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768])
    a = ap.parse_args()
    c = load(a.config)
    print(f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['n_routed_experts']} experts top-{c['num_experts_per_tok']}")
    print("decode: batch context | GB/step | GFLOP/step | floor ms (max of bytes/BW, flops/F) | tokens/s ceiling")
    for ctx in a.context:
        for b in a.batch:
            by, fl = step_floor(c, b, ctx)
            ms = max(by / a.bandwidth, fl / a.flops) * 1e3
            print(f"  {b:5d} {ctx:7d} | {by / 1e9:8.2f} | {fl / 1e9:10.1f} | {ms:8.3f} | {b / ms * 1e3:10.0f}")
    for p in a.prefill:
        by, fl = step_floor(c, 1, p, prefill_tokens=p)
        ms = max(by / a.bandwidth, fl / a.flops) * 1e3
        print(f"prefill {p:6d} tokens | {by / 1e9:8.2f} GB | {fl / 1e12:8.1f} TFLOP | floor {ms:8.1f} ms | {p / ms * 1e3:9.0f} tok/s")
    print("per layer (decode, batch 1, context 4096): layer ratio | MB | MFLOP")
    for layer in range(c["num_hidden_layers"]):
        b, f = layer_floor(c, layer, 1, 4096)
        print(f"  {layer:3d} {c['compress_ratios'][layer]:2d} | {b / 1e6:8.1f} | {f / 1e6:8.1f}")


if __name__ == "__main__":
    main()
