import torch

# The tiny test models are dominated by per-op overhead; torch's intra-op thread pool only adds
# contention (a 16x64 GEMM takes ~8 us on one thread and can take >1 ms on two busy cores).
torch.set_num_threads(1)
