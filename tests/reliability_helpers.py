"""Objects the reliability tests send into an engine-core process (importable there through PYTHONPATH)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from deepinfer.sampling import SamplingParams


@dataclass
class StallingParams(SamplingParams):
    """Valid params whose fields, read in any process but the one that made them, block for an hour: a step
    loop stuck in a call that never returns, while the rest of the process (its heartbeat thread) runs on."""

    made_in: int = field(default_factory=os.getpid)

    def __getattribute__(self, name):
        if name != "made_in" and not name.startswith("__") and os.getpid() != object.__getattribute__(self, "made_in"):
            time.sleep(3600)
        return object.__getattribute__(self, name)
