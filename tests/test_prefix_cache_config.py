"""How prefix caching is switched: cache.prefix_caching (null: on, in every layout), DEEPINFER_PREFIX_CACHING (this
project's variable, read in conf/config.yaml; a CLI override wins) and vLLM's LLM(enable_prefix_caching=...); a bad
value is a one-line error naming the variable or argument and the allowed values."""

from __future__ import annotations

import pytest

from deepinfer.api import load_settings, overrides_for
from deepinfer.config.env_vars import unhonoured
from deepinfer.config.errors import ConfigError
from options_helpers import CPU

VAR = "DEEPINFER_PREFIX_CACHING"


def prefix_caching(*overrides: str) -> bool:
    return load_settings(list(overrides), found=CPU).cache.prefix_caching


@pytest.mark.parametrize("layout", ["single", "dep2", "cp2"])
def test_null_is_on_in_every_layout_and_yoco_mode(monkeypatch, layout):
    monkeypatch.delenv(VAR, raising=False)
    extra = [] if layout == "single" else ["engine.process=subprocess"]
    assert prefix_caching(f"parallel={layout}", *extra) is True
    if layout != "cp2":  # cp refuses YOCO
        assert prefix_caching(f"parallel={layout}", "yoco=compact", *extra) is True
    assert prefix_caching(f"parallel={layout}", "cache.prefix_caching=false", *extra) is False


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), ("on", True), ("0", False), ("false", False),
                                         ("off", False)])
def test_the_variable_switches_it_and_the_cli_wins(monkeypatch, value, want):
    monkeypatch.setenv(VAR, value)
    assert prefix_caching() is want
    assert prefix_caching(f"cache.prefix_caching={str(not want).lower()}") is (not want)
    assert not [n for n, _ in unhonoured({VAR: value})]  # honoured: no "not honoured" warning


@pytest.mark.parametrize("value", ["maybe", "", "enabled"])
def test_a_bad_variable_value_is_a_one_line_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(ConfigError) as exc:
        prefix_caching()
    msg = str(exc.value)
    assert "\n" not in msg and VAR in msg and f"resolved to {value!r}" in msg and "allowed: true or false" in msg


def test_vllms_enable_prefix_caching_argument_maps_onto_the_setting(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert overrides_for(None, enable_prefix_caching=False) == ["cache.prefix_caching=false"]
    assert prefix_caching(*overrides_for(None, enable_prefix_caching=False)) is False
    assert prefix_caching(*overrides_for(None, enable_prefix_caching=None)) is True
    with pytest.raises(ConfigError, match=r"^LLM\(enable_prefix_caching='yes'\) is not allowed; allowed: True, "
                                          r"False or None$"):
        overrides_for(None, enable_prefix_caching="yes")
