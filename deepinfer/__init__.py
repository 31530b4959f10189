"""DeepInfer: an inference engine for DeepSeek-V4.1-Flash.

    from deepinfer import LLM, SamplingParams
    with LLM() as llm:                       # the embedded tiny model on the CPU
        print(llm.generate("def f(", SamplingParams(temperature=0, max_tokens=16))[0].text)

Names are imported lazily so `import deepinfer` (and `python -m deepinfer --help`) stays cheap.
"""

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from deepinfer.api import LLM

        return LLM
    if name == "RequestOutput":
        from deepinfer.outputs import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from deepinfer.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
