"""Install pyproject's dependencies (+ the test extra) without triton.

xgrammar and tilelang list triton for Linux x86_64; the CPU path never imports it and it
costs ~1 GB of download, so they are installed with --no-deps and their own requirements
(minus triton) are installed after, read from their installed metadata."""
import subprocess
import sys
import tomllib
from importlib.metadata import requires

from packaging.requirements import Requirement

SKIP = {"triton"}
NO_DEPS = {"xgrammar", "tilelang"}


def pip(*args: str) -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])


project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
pip("--no-deps", *[str(r) for r in wanted if r.name in NO_DEPS])
extra = []
for name in NO_DEPS:
    for spec in requires(name) or []:
        r = Requirement(spec)
        if r.name in SKIP or (r.marker and not r.marker.evaluate({"extra": ""})):
            continue
        extra.append(str(r))
pip(*[str(r) for r in wanted if r.name not in NO_DEPS], *extra)
