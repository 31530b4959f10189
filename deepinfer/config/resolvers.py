"""OmegaConf resolvers the config tree uses, registered when deepinfer.config is imported (before any compose).

`${di.for_model:PATH,MODEL,THEN,ELSE}`: THEN when model.path PATH is MODEL, else ELSE. A model's config group
uses it for the sampling defaults that suit that model only (conf/model/tiny.yaml): pointing model.path at
another checkpoint gets ELSE (the schema's defaults), and an explicit `sampling.*` override replaces the whole
expression.

`${di.engram_storage:VALUE}`: DeepInfer's DEEPINFER_ENGRAM_FORCE_GPU_STORAGE (VALUE; empty when unset) as
model.engram_storage: 1/true -> device, 0/false -> host, unset -> device (the schema's default); anything else is
a one-line error naming the variable.
"""

from omegaconf import OmegaConf


def _for_model(path, model, then, otherwise):
    return then if str(path) == str(model) else otherwise


_FORCE_GPU = {"1": "device", "true": "device", "0": "host", "false": "host", "": "device"}


def _engram_storage(value):
    from deepinfer.config.errors import ConfigError

    key = str(value).strip().lower()
    if key not in _FORCE_GPU:
        raise ConfigError(f"DEEPINFER_ENGRAM_FORCE_GPU_STORAGE={value!r} is not allowed; allowed: 1 or true (Engram "
                          "tables on the GPU), 0 or false (in host memory)")
    return _FORCE_GPU[key]


def register() -> None:
    if not OmegaConf.has_resolver("di.for_model"):
        OmegaConf.register_new_resolver("di.for_model", _for_model)
    if not OmegaConf.has_resolver("di.engram_storage"):
        OmegaConf.register_new_resolver("di.engram_storage", _engram_storage)
