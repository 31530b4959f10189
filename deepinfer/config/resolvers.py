"""OmegaConf resolvers the config tree uses, registered when deepinfer.config is imported (before any compose).

`${di.for_model:PATH,MODEL,THEN,ELSE}`: THEN when model.path PATH is MODEL, else ELSE. A model's config group
uses it for the sampling defaults that suit that model only (conf/model/tiny.yaml): pointing model.path at
another checkpoint gets ELSE (the schema's defaults), and an explicit `sampling.*` override replaces the whole
expression.
"""

from omegaconf import OmegaConf


def _for_model(path, model, then, otherwise):
    return then if str(path) == str(model) else otherwise


def register() -> None:
    if not OmegaConf.has_resolver("di.for_model"):
        OmegaConf.register_new_resolver("di.for_model", _for_model)
