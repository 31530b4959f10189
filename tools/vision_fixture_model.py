"""A small text+vision checkpoint made only from the repo's golden fixtures, for CPU examples and tests:
the text model of a tiny text fixture (tests/fixtures/deepseek_v41/<text>: its config, tokenizer and weights) plus the
image path of tests/fixtures/deepseek_v41_vision/tiny-vit2 (its vision_config, image_token_id 511 and its BF16
vision.* / aligner.* / image_* tensors). Nothing is drawn or invented: tiny-vit2 was made for these text fixtures
(its aligner writes rows of width 64 into a vocab of 512, their hidden_size and vocab_size, and its stored prompt ids
come from their tokenizer), so the two fit as they are. The placeholder is id 511 (the text fixtures' tokenizer has no
image token: 511 is the ordinary piece "ation", so write prompts as token ids).

    python tools/vision_fixture_model.py ./tiny-vision                              # text of tiny-swa-csa2
    python tools/vision_fixture_model.py ./tiny-vision-engram --text tiny-engram-hc4

The fixtures are not in the installed package (tests/ is not shipped), so this runs from a checkout.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
VISION = FIXTURES / "deepseek_v41_vision" / "tiny-vit2"
TEXTS = ("tiny-swa-csa2", "tiny-engram-hc4", "tiny-swa-csa2-fp8fp4")
VISION_KEYS = ("image_token_id", "vision_config")  # what tiny-vit2's config.json adds to the text config


def config_json(text: str) -> dict:
    cfg = json.loads((FIXTURES / "deepseek_v41" / text / "config.json").read_text())
    vis = json.loads((VISION / "config.json").read_text())
    for key in ("hidden_size", "vocab_size"):  # the aligner's output width and the span sentinels' base
        have, want = cfg["text_config"][key], vis["text_config"][key]
        if have != want:
            raise SystemExit(f"--text {text}: text_config.{key} is {have} but tiny-vit2 is made for {want}")
    cfg.update({k: vis[k] for k in VISION_KEYS})
    return cfg


def write(out: Path, text: str = TEXTS[0]) -> Path:
    """`out` (created, or refused if it holds files) with config.json, tokenizer.json and one model.safetensors."""
    from safetensors.torch import load_file, save_file

    if text not in TEXTS:
        raise SystemExit(f"--text {text!r}; allowed: {', '.join(TEXTS)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; allowed: a new or empty directory")
    cfg = config_json(text)
    src = FIXTURES / "deepseek_v41" / text
    tensors = load_file(str(src / "model.safetensors"))  # not cases.safetensors: the loader reads every file
    vision = load_file(str(VISION / "model.safetensors"))
    clash = sorted(set(tensors) & set(vision))
    if clash:
        raise SystemExit(f"{text} and tiny-vit2 both hold {clash[:3]}; allowed: disjoint tensor names")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    save_file({**tensors, **vision}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the checkpoint directory to write (new or empty)")
    ap.add_argument("--text", default=TEXTS[0], choices=TEXTS, help="the text fixture (default %(default)s)")
    args = ap.parse_args(argv)
    print(write(args.out, args.text))


if __name__ == "__main__":
    main()
