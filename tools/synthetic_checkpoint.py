"""A checkpoint directory for the synthetic V4.1-Flash-width models (deepinfer.models.synthetic): config.json and the
package's tokenizer.json, no weights. The engine runs it with random weights (`model.load_format=dummy`, or
`dummy_shared` for the 40-layer model whose layers of one kind share their tensors: its draw fits one GPU), through
the CLI and any parallel layout, e.g. the multi-GPU launches of docs/parallel.md.

    python tools/synthetic_checkpoint.py --depth 6 --dspark --out /data/flash6     # FLASH_REDUCED + DSpark stages
    python tools/synthetic_checkpoint.py --depth 40 --dspark --out /data/flash40   # FLASH_FULL (the released pattern)
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run as a script

from deepinfer.models import synthetic  # noqa: E402
from deepinfer.models.config import ModelConfig  # noqa: E402

# the released checkpoint's quantization_config (MODEL_V41_SPEC.md §8.2), as embedded.py writes it
QUANTIZATION = {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}


def config_json(depth: int, dspark: bool, overrides: dict | None = None) -> dict:
    """`overrides`: config fields to change (tests: a narrow width of the same pattern)."""
    cfg = synthetic.config({**(synthetic.DSPARK_FLASH if dspark else {}), **(overrides or {})}, full_depth=depth == 40)
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "quantization_config": QUANTIZATION, "text_config": dict(cfg.raw)}


def write(out: Path, depth: int, dspark: bool, overrides: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data = config_json(depth, dspark, overrides)
    (out / "config.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "tokenizer.json").write_text((resources.files("deepinfer.assets") / "tokenizer.json").read_text())
    ModelConfig.from_file(out / "config.json")  # the loader's own parse: a bad file fails here, not at launch
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, choices=(6, 40), required=True,
                    help="6: FLASH_REDUCED (every layer kind once); 40: FLASH_FULL (the released 40-layer pattern)")
    ap.add_argument("--dspark", action="store_true", help="with V4.1-Flash's three DSpark draft stages")
    ap.add_argument("--out", required=True, help="the directory to write (model.path=...)")
    a = ap.parse_args(argv)
    print("wrote", write(Path(a.out), a.depth, a.dspark))
    return 0


if __name__ == "__main__":
    sys.exit(main())
