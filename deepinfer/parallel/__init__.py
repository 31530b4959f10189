"""Building blocks of the parallel layouts (issue 13): process groups, expert placement, expert-parallel MoE and
the EPLB placement policy. Not wired into the engine or the config yet: `parallel=single` is the only layout."""
