"""The declarative pipeline: a registry of stage components and the builder that turns conf/pipeline/*.yaml
into the StepProgram the runners (sequential now, the engine later) execute."""

from deepinfer.pipeline.build import build_program, load_program
from deepinfer.pipeline.program import StageInfo, StepProgram
from deepinfer.pipeline.registry import REGISTRY, Component, Registry

__all__ = ["REGISTRY", "Component", "Registry", "StageInfo", "StepProgram", "build_program", "load_program"]
