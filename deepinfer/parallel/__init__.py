"""The parallel layouts (issue 13, conf/parallel/): process groups (groups, world), the layout arithmetic (layout),
expert placement, expert-parallel MoE, EPLB (policy and runtime), balanced context parallel (in the model), and the
data-parallel engine: one engine core per rank in lockstep (lockstep), started by the frontend or torchrun (launch,
rank_process)."""
