"""Result files read back (plots, docs tables, retargeting): those over 8 KB are committed xz-compressed in
benchmarks/results/ (NAME.json.xz; tests/test_results_dir.py), so a reader takes a plain file or an .xz alike."""

import json
import lzma


def open_result(path, mode: str = "r"):
    """`path` opened as text, through xz when its name ends in .xz (written with `xz -9e`'s preset)."""
    if str(path).endswith(".xz"):
        return lzma.open(path, mode + "t", preset=(9 | lzma.PRESET_EXTREME) if "w" in mode else None)
    return open(path, mode)


def read_json(path):
    """A recorded result file's JSON, plain or .xz."""
    with open_result(path) as f:
        return json.load(f)
