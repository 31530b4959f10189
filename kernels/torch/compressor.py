import torch


def compressor_pool(kv: torch.Tensor, gate: torch.Tensor, ratio: int) -> torch.Tensor:
    """Complete groups of `ratio` tokens: kv, gate [G * ratio, D] fp32 -> [G, D] fp32, a softmax
    over the tokens of each group, separately per channel."""
    g, d = kv.shape[0] // ratio, kv.shape[-1]
    kv = kv[: g * ratio].view(g, ratio, d)  # d, not -1: no complete group gives [0, D]
    gate = gate[: g * ratio].view(g, ratio, d)
    return (kv * gate.softmax(dim=1, dtype=torch.float32)).sum(dim=1)
