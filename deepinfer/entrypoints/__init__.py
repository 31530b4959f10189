"""DeepInfer-compatible entry points (`from deepinfer.entrypoints.llm import LLM`)."""
