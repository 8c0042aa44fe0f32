"""HTTP probes of the serving path: vLLM's `/v1/models`, LMCache's `/healthcheck` and `/status`, each with a
finite timeout and an error that says how to start the server (`ServerError`)."""

from __future__ import annotations

LMCACHE_START_HINT = (
    "start it with `lmcache server --l1-size-gb 40 --eviction-policy LRU --chunk-size 256 --port 6555 "
    "--http-port 8080 --shm-name tdutils --no-l1-use-lazy --supported-transfer-mode auto --enable transfer_query` "
    "(docs/engines_and_serving.md, section 'On a GPU (vLLM + LMCache)'), or point at it: lmcache_url= / lmcache_http_url= (command line: --lmcache-url / "
    "--lmcache-http-url)")
VLLM_START_HINT = (
    "start it with `vllm serve MODEL --port 8000 --no-enable-prefix-caching --enforce-eager "
    "--return-tokens-as-token-ids --max-num-batched-tokens 32768 --kv-transfer-config '{\"kv_connector\": \"LMCacheMPConnector\", \"kv_role\": "
    "\"kv_both\", \"kv_connector_extra_config\": {\"lmcache.mp.port\": 6555, "
    "\"lmcache.mp.transfer_intermediate_tensors\": true, \"lmcache.mp.q.ring_depth\": 2}}'` (docs/engines_and_serving.md, section "
    "'On a GPU (vLLM + LMCache)'), or point at it: vllm_url= (command line: --vllm-url)")

class ServerError(ConnectionError):
    """A server is down, unreachable, or not set up as the serving path needs (the message says the fix)."""


def http_json(method: str, url: str, *, timeout: float, body=None, what: str = "", hint: str = ""):
    """One JSON request with a finite timeout; returns the decoded body.

    Raises:
        ServerError: connection refused / timeout (message names `what`, the URL and `hint`), an HTTP error
            status (with the body), or a body that is not JSON.
    """
    import httpx

    try:
        resp = httpx.request(method, url, json=body, timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)))
    except httpx.TimeoutException as exc:
        raise ServerError(f"{what or url} did not answer within {timeout:g}s ({url}); {hint}") from exc
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {what or url} at {url} ({exc.__class__.__name__}: {exc}); {hint}") from exc
    if resp.status_code >= 400:
        raise ServerError(f"{method} {url} returned HTTP {resp.status_code}: {resp.text[:1000]}")
    try:
        return resp.json()
    except ValueError as exc:
        raise ServerError(f"{method} {url} did not return JSON: {resp.text[:300]!r}") from exc


def served_models(vllm_url: str, *, timeout: float = 10.0) -> list[dict]:
    """`GET /v1/models` of vLLM: the served models (`id`, `root`, `max_model_len`, ...)."""
    data = http_json("GET", vllm_url.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=timeout,
                     what="vLLM", hint=VLLM_START_HINT)
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        raise ServerError(f"vLLM at {vllm_url} answered /v1/models without a 'data' list: {str(data)[:300]}")
    return models


def lmcache_health(http_url: str, *, timeout: float = 10.0) -> None:
    """Raise ServerError unless LMCache's `GET /healthcheck` says healthy."""
    data = http_json("GET", http_url.rstrip("/") + "/healthcheck", timeout=timeout, what="the LMCache server",
                     hint=LMCACHE_START_HINT)
    if not isinstance(data, dict) or data.get("status") != "healthy":
        raise ServerError(f"LMCache at {http_url} is not healthy: {data}")


def registered_models(status: dict) -> dict[str, dict]:
    """Model name -> registration entry (its `kv_cache_layout`) from LMCache's `GET /status`."""
    out = {}
    for entry in (status.get("cache_context_meta") or {}).values():
        if isinstance(entry, dict) and entry.get("model_name"):
            out[entry["model_name"]] = entry
    return out


def lmcache_model_name(model: str, root: str | None, registered: dict) -> str | None:
    """The name LMCache knows the served model by, or None when it has no registration for it.

    vLLM's LMCache connector registers the KV layout under vLLM's model *path* (`--model`, which
    `/v1/models` reports as `root`), not under `--served-model-name`; the two differ as soon as a server
    names its model. So the served name is tried first, then the root.
    """
    for name in (model, root):
        if name and name in registered:
            return name
    return None
