"""Runners of the StepProgram. sequential.py: one request at a time, until the engine lands."""
