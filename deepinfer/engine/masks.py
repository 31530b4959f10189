"""Grammar bitmasks built on a helper thread while the model's forward runs.

The runner allocates the mask (a torch op, kept on the thread that runs the model: every thread that runs
parallel torch ops gets its own OpenMP team) and starts filling it here; xgrammar fills rows in C++ (per row only
small torch ops follow), so the fill overlaps the forward. The runner joins before sampling, which is what keeps
each GrammarState single-threaded in time: filled here, then advanced by the sampler after the join.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class MaskBuilder:
    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None  # started on the first grammar row

    def start(self, rows: list, vocab_width: int) -> Future | None:
        """rows: SampleRows; None when no row has a grammar. The Future gives the CPU int32 bitmask."""
        if all(row.grammar_state is None for row in rows):
            return None
        from deepinfer.sampling.bitmask import allocate_bitmask

        mask = allocate_bitmask(len(rows), vocab_width)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-mask")
        return self._pool.submit(_fill, rows, mask)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _fill(rows: list, mask):
    for r, row in enumerate(rows):
        if row.grammar_state is not None:
            row.grammar_state.fill_bitmask(mask, r)
    return mask
