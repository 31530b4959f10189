"""The card the issues' targets are set for, and a benchmark's targets judged against it: a target measured on
another card (an H100 when no H200 was lent) keeps its measurement and what it would be there
(`met_on_this_card`), but `met` is False with a note saying so, since the ratio does not carry over (the
ceilings differ: the H100's measured copy bandwidth is ~71% of the H200's, its bf16 rate the same)."""

TARGET_CARD = "H200"


def on_card(targets: list[dict], gpu: str) -> list[dict]:
    """`targets` (each {"name", "measured", "target", "unit", "met"}) as measured on `gpu` (a device name)."""
    if TARGET_CARD in gpu:
        return targets
    return [dict(t, met=False, met_on_this_card=t["met"], card=gpu,
                 note=f"the target is set for the {TARGET_CARD}; measured on {gpu}") for t in targets]
