"""The frontend, shared by LLM.generate, LLM.generate_iter and the OpenAI server: one input processor (validation,
the seed rule, n-expansion), one output processor (the DecodeStream detokenizer, the stop-string cut, RequestOutput
assembly) and two thin loops over the engine core's client: LLMEngine (synchronous: add_request + step, and the
`stream` generator) and AsyncEngine (asyncio).

Floors: entry points (api, serving, __main__) > frontend > engine. The frontend imports the engine, never the
reverse.
"""

from deepinfer.frontend.input_processor import EngineInput, InputProcessor
from deepinfer.frontend.llm_engine import EngineDeadError, LLMEngine
from deepinfer.frontend.output_processor import OutputProcessor, RequestState

__all__ = ["EngineDeadError", "EngineInput", "InputProcessor", "LLMEngine", "OutputProcessor", "RequestState"]
