"""The server's API key (serve.api_key, or the DEEPINFER_API_KEY environment variable through conf/serve/openai.yaml).

With a key set, every request to /v1/* (and /tokenize, /detokenize) must carry it, as the OpenAI SDK sends it
(`Authorization: Bearer KEY`) or as the Anthropic SDK does (`x-api-key: KEY`); anything else is a 401 in the
protocol's error shape. /health, /metrics and /version stay open for probes and scrapers (vLLM's rule: only /v1 is
guarded, plus the two routes that read the model's tokenizer). The comparison is constant-time (hmac).
"""

from __future__ import annotations

import hmac
import ipaddress

from deepinfer.serving.errors import HTTPError

GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def guarded(path: str) -> bool:
    return path.startswith(GUARDED_PREFIXES)


def presented_key(headers) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY` or `x-api-key: KEY` (None when neither)."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key else None


def check(expected: str, headers) -> None:
    """Raises a 401 HTTPError unless the request carries `expected`."""
    given = presented_key(headers)
    if given is None:
        raise HTTPError(401, "no API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                        "authentication_error", code="invalid_api_key")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPError(401, "the API key is not valid for this server", "authentication_error",
                        code="invalid_api_key")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed at start when the server listens beyond loopback without a key (None otherwise)."""
    if api_key or is_loopback(host):
        return None
    return (f"serving on {host} without an API key: anyone who can reach this port can use the model; set "
            "DEEPINFER_API_KEY (or serve.api_key) to require one")


def host_warning(host: str, allowed_hosts) -> str | None:
    """The warning printed at start when the server listens beyond loopback and accepts any Host header."""
    if allowed_hosts is not None or is_loopback(host):
        return None
    return (f"serving on {host} with any Host header accepted: set serve.allowed_hosts to the names clients use, "
            "to refuse requests routed here by a DNS-rebinding page")
