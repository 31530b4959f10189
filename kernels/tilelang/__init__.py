"""TileLang kernels for Hopper (sm_90a; they also lower for sm_100a): MoE router and FP4/FP8 grouped expert
GEMMs, sink attention over the FP8 window / FP4 compressed caches, lightning-indexer scores.
See manifest.py for the registered op kinds and README.md ("Hopper (SM90) TileLang kernels") for measurements."""
