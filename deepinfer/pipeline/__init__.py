"""The declarative pipeline: the builder that turns conf/pipeline/*.yaml into the StepProgram the runners execute,
from the components registered in deepinfer.config.components (the config's, so the resolve step can check the
names without importing the builder)."""

from deepinfer.pipeline.build import build_program, load_program
from deepinfer.pipeline.program import StageInfo, StepProgram

__all__ = ["StageInfo", "StepProgram", "build_program", "load_program"]
