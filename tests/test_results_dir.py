"""benchmarks/results/ stays small: a text result (.json, .log, .txt, .csv) is committed plain only up to 8 KB; a
larger one is committed xz-compressed as NAME.EXT.xz (`xz -9e`), never both, and every .xz there decompresses. The
scripts that read results back take either form (benchmarks/results_io.py)."""

from __future__ import annotations

import importlib.util
import json
import lzma
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAIN_MAX = 8192
TEXT = (".json", ".log", ".txt", ".csv")

spec = importlib.util.spec_from_file_location("results_io", ROOT / "benchmarks" / "results_io.py")
results_io = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_io)


def tracked_results() -> list[Path]:
    """The files of benchmarks/results/ that git tracks (and the working tree has)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "benchmarks/results"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]
    if not paths:
        pytest.skip("no tracked benchmarks/results/ files")
    return paths


def test_text_results_over_8_kb_are_committed_xz_compressed():
    files = tracked_results()
    too_big = [f"{p.relative_to(ROOT)} ({p.stat().st_size} bytes)" for p in files
               if p.suffix in TEXT and p.stat().st_size > PLAIN_MAX]
    assert not too_big, f"over {PLAIN_MAX} bytes, commit these as `xz -9e FILE` (FILE.xz): {too_big}"
    names = {p.name for p in files}
    both = sorted(n for n in names if n + ".xz" in names)
    assert not both, f"committed both plain and .xz: {both}"


def test_every_compressed_result_decompresses():
    compressed = [p for p in tracked_results() if p.suffix == ".xz"]
    for p in compressed:
        assert Path(p.stem).suffix in TEXT, f"{p.name}: an .xz result is NAME{'|'.join(TEXT)}.xz"
        with lzma.open(p, "rt") as f:
            text = f.read()  # a corrupt or truncated .xz raises here
        if p.name.endswith(".json.xz"):
            json.loads(text)


def test_the_reader_takes_a_plain_and_an_xz_json(tmp_path):
    data = {"meta": {"model": "flash"}, "rows": [{"batch": 1, "tok_s": 2.5}]}
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.xz"
    plain.write_text(json.dumps(data))
    with lzma.open(packed, "wt") as f:
        json.dump(data, f)
    assert results_io.read_json(plain) == results_io.read_json(str(packed)) == data
    with results_io.open_result(packed, "w") as f:  # a rewrite (decode_gpu.py --targets-from) stays xz
        json.dump({"rows": []}, f)
    assert json.loads(lzma.decompress(packed.read_bytes())) == {"rows": []}
