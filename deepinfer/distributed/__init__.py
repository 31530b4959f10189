"""The collectives and the math the model needs for the parallel layouts (issue 13, conf/parallel/): process groups
(groups, world), expert placement, expert-parallel MoE, EPLB (policy and runtime, expert moves) and balanced context
parallel.

This floor sits below the model and the engine (ARCHITECTURE.md §6): it imports torch, the config's types and the
kernels, never models/ or engine/. The layout arithmetic the resolve step checks lives in deepinfer.config.layout;
the data-parallel engine (the DP client, the lockstep DP core, follower ranks) lives in deepinfer.engine."""
