"""What the loader's finiteness check (deepinfer/models/loading/materialize.py `_check_finite`: one aminmax pass
over each chunk just written) costs in load time: the embedded model loaded with the check and with it switched
off, best of `--repeats` loads each. The test suite checks what the check covers, not its cost
(tests/test_reliability_checkpoint.py).

    python benchmarks/finiteness_check.py [--model embedded:tiny-random] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

from deepinfer import embedded
from deepinfer.models.loading import load_checkpoint
from deepinfer.models.loading import materialize as m


def best_load_seconds(path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        load_checkpoint(path)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:tiny-random", help="a checkpoint directory or embedded:NAME")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = embedded.materialize(args.model.removeprefix("embedded:")) if args.model.startswith("embedded:") \
        else args.model
    with_check = best_load_seconds(path, args.repeats)
    original = m._check_finite
    m._check_finite = lambda *a: None
    try:
        without = best_load_seconds(path, args.repeats)
    finally:
        m._check_finite = original
    print(f"load {without * 1e3:.1f} ms without the check, {with_check * 1e3:.1f} ms with it "
          f"(+{(with_check - without) / without:.1%})")


if __name__ == "__main__":
    main()
