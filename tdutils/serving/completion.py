"""Streaming `/v1/completions` client for vLLM's OpenAI-compatible server, prompts given as token ids.

The serving path (docs/design.md §6) sends each request's token ids to vLLM and needs the generated token
*ids* back, not only text. vLLM returns them when the server runs with `--return-tokens-as-token-ids` (or the
request sets `return_tokens_as_token_ids`) and the request asks for `logprobs`: every generated token then
appears in `choices[0].logprobs.tokens` as a string `"token_id:<N>"`. One SSE chunk may carry **several**
tokens: every entry counts, and the count is checked against the final `usage.completion_tokens`.

- `iter_sse_lines`: the stream's bytes as lines, UTF-8 whatever `Content-Type` says, a leading BOM ignored.
- `iter_token_events`: one `TokenEvent(token_id, text, finish_reason)` per token (its docstring: the format).
- `make_post_completion(base_url, model_name)`: a callable with LMCache's `PostCompletion` signature
  `(prompt_token_ids, sampling_params, cache_salt) -> Iterable[TokenEvent]`, so LMCache's SDK request
  streams can drive it; with lmcache installed it yields the SDK's own `TokenEvent` type.
Errors: `CompletionError` (a `RuntimeError`; subclasses `CompletionHTTPError`, `CompletionConnectionError`,
`CompletionTimeoutError`, `TokenFormatError`) for a failed request or bad stream; `ValueError`: bad arguments.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIMEOUT_S = 120.0  # longest silence allowed between two bytes of a stream (a long prefill)
DEFAULT_CONNECT_TIMEOUT_S = 5.0

VLLM_START_HINT = (
    "start vLLM with token ids in its stream, e.g. `vllm serve MODEL --port 8000 --return-tokens-as-token-ids "
    "--no-enable-prefix-caching --enforce-eager --kv-transfer-config '{...LMCacheMPConnector...}'` "
    "(docs/engines_and_serving.md, section 'On a GPU (vLLM + LMCache)'), or pass the right base_url"
)
_TOKEN_PREFIX = "token_id:"


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of a completion stream.

    Attributes:
        token_id: the vocabulary id of the token.
        text: the text this token adds. When one SSE chunk carries several tokens, the chunk's whole
            text is given to its first token and the others get `""`, so joining all texts never
            duplicates text.
        finish_reason: `"length"`, `"stop"`, ... on the last token of the chunk that ended the stream;
            None elsewhere.
    """

    token_id: int
    text: str = ""
    finish_reason: str | None = None


@dataclass
class StreamResult:
    """What a stream said besides its tokens (filled in by `iter_token_events`).

    Attributes:
        tokens: number of token events yielded.
        finish_reason: the last `finish_reason` seen (None when the server sent none).
        usage: the last `usage` object seen (`{"prompt_tokens", "completion_tokens", ...}`), or None.
        done: True once `data: [DONE]` was read.
    """

    tokens: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    done: bool = False
    chunks: int = field(default=0)


class CompletionError(RuntimeError):
    """A completion request failed (server error, bad stream, lost tokens)."""


class CompletionHTTPError(CompletionError):
    """The server answered with an HTTP error status; `status` and `body` hold what it sent."""

    def __init__(self, message: str, status: int, body: str):
        super().__init__(message)
        self.status = status
        self.body = body


class CompletionConnectionError(CompletionError, ConnectionError):
    """The server could not be reached (connection refused, DNS failure, connect timeout)."""


class CompletionTimeoutError(CompletionError, TimeoutError):
    """The server went silent for longer than the read timeout."""


class TokenFormatError(CompletionError, ValueError):
    """The stream is not in the expected format (bad JSON, tokens not given as `token_id:<N>`)."""


def _quote(line: str, limit: int = 300) -> str:
    return repr(line if len(line) <= limit else line[:limit] + "...")


def _token_id(entry: Any) -> int:
    """`"token_id:123"` -> 123; anything else raises `TokenFormatError` saying how to fix the server."""
    if isinstance(entry, str) and entry.startswith(_TOKEN_PREFIX):
        digits = entry[len(_TOKEN_PREFIX):]
        if digits.isdigit():  # isdigit: no sign, no spaces; token ids are non-negative
            return int(digits)
    raise TokenFormatError(
        f"logprobs.tokens entry {_quote(str(entry))} is not of the form 'token_id:<int>'; the server sends token "
        f"text instead of token ids: start vLLM with --return-tokens-as-token-ids")


def _chunk_events(chunk: dict, raw: str, result: StreamResult) -> list[TokenEvent]:
    """Token events of one parsed SSE chunk; records usage / finish_reason in `result`."""
    if "error" in chunk:  # vLLM reports errors raised mid-stream as an in-band `data: {"error": ...}`
        err = chunk["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise CompletionError(f"the server reported an error inside the stream: {msg}")
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    choices = chunk.get("choices")
    if choices is None:
        raise TokenFormatError(f"SSE chunk has no 'choices' field: {_quote(raw)}")
    if not choices:  # the final usage-only chunk
        return []
    if len(choices) != 1 or choices[0].get("index", 0) != 0:
        raise TokenFormatError(f"expected exactly one choice with index 0 (n=1), got {_quote(raw)}")
    choice = choices[0]
    text = choice.get("text") or ""
    finish = choice.get("finish_reason")
    logprobs = choice.get("logprobs")
    entries = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if entries is None:
        if choice.get("token_ids"):  # `return_token_ids: true` gives the ids directly
            ids = [int(t) for t in choice["token_ids"]]
        elif text:
            raise TokenFormatError(
                f"SSE chunk carries text but no token ids (no logprobs.tokens): {_quote(raw)}; request logprobs "
                f"and start vLLM with --return-tokens-as-token-ids")
        else:
            ids = []
    else:
        ids = [_token_id(e) for e in entries]
    if finish is not None:
        result.finish_reason = finish
    events = [TokenEvent(t, text if i == 0 else "", finish if i == len(ids) - 1 else None)
              for i, t in enumerate(ids)]
    if not ids and text:
        raise TokenFormatError(f"SSE chunk carries text {text!r} but no tokens: {_quote(raw)}")
    return events


_BOM = "\ufeff"
_EOL = re.compile(r"\r\n|\r|\n")  # SSE line terminators; str.splitlines would also split at U+2028 etc.


def iter_sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Split the raw bytes of an event stream into lines (terminators removed), decoded as UTF-8.

    The event-stream format is always UTF-8 and a leading byte-order mark is ignored (WHATWG HTML,
    "Server-sent events", parsing an event stream), whatever charset the response's `Content-Type` names;
    decoding by that header (httpx's `iter_lines`) would garble non-ASCII text and keep the BOM. Lines end
    at `\r\n`, `\n` or `\r`, also when a terminator or a multi-byte character is split between chunks.

    Args:
        chunks: the body as byte chunks of any size (e.g. `httpx.Response.iter_bytes()`).

    Yields:
        Lines as `str`, without their terminators; a last line without a terminator is yielded too.

    Raises:
        UnicodeDecodeError: the bytes are not UTF-8.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, first = "", True
    for chunk in chunks:
        buf += decoder.decode(chunk)
        if first and buf:  # the decoder emits whole characters only, so a split BOM arrives whole
            buf, first = buf.removeprefix(_BOM), False
        # A trailing "\r" may be the first half of "\r\n": keep it until the next character is known.
        held = buf.endswith("\r")
        lines = _EOL.split(buf[:-1] if held else buf)
        buf = lines.pop() + ("\r" if held else "")
        yield from lines
    buf += decoder.decode(b"", final=True)
    if first:
        buf = buf.removeprefix(_BOM)
    lines = _EOL.split(buf)
    last = lines.pop()
    yield from lines
    if last:
        yield last


def iter_token_events(lines: Iterable[str | bytes], *, result: StreamResult | None = None,
                      require_done: bool = False) -> Iterator[TokenEvent]:
    """Parse server-sent-event lines of a vLLM completion stream into one `TokenEvent` per generated token.

    Rules: a byte-order mark at the start of the first line is ignored (the event-stream format is UTF-8,
    a leading BOM is not part of the first field); blank lines end an event; lines starting with `:` are comments (keep-alives) and are skipped;
    `event:`/`id:`/`retry:` fields are ignored; a `data:` line holds one JSON chunk (several `data:` lines
    are joined with newlines, as SSE specifies, until they form a complete JSON value); `data: [DONE]`
    ends the stream and nothing after it is read. In a chunk, every `"token_id:<N>"` entry of
    `choices[0].logprobs.tokens` is one event; the chunk's text goes to its first event (see
    `TokenEvent`); chunks with empty `choices` only carry `usage`; chunks with no tokens and no text
    (a bare `finish_reason`) yield nothing.

    Wire format (what vLLM 0.2x sends)::

        data: {"choices":[{"index":0,"text":" the","logprobs":{"tokens":["token_id:279"],...},
               "finish_reason":null}],...}
        <blank line>
        : keep-alive comment
        data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,...}}
        data: [DONE]

    Args:
        lines: text lines (str or UTF-8 bytes), with or without their line endings.
        result: optional `StreamResult` filled in as the stream is read (usage, finish_reason, done).
        require_done: raise if the lines end before `[DONE]` (a stream cut short).

    Yields:
        `TokenEvent(token_id, text, finish_reason)`.

    Raises:
        TokenFormatError: malformed JSON (the line is quoted), a chunk without `choices`, token strings
            not of the form `token_id:<int>` (start vLLM with `--return-tokens-as-token-ids`), text
            without token ids, or more than one choice.
        CompletionError: an in-band error chunk; usage.completion_tokens disagreeing with the number of
            tokens read; with `require_done`, no `[DONE]`.
    """
    result = result if result is not None else StreamResult()
    pending: list[str] = []  # data lines of the current event not yet forming a complete JSON value
    for line, value in _sse_data_lines(lines):
        if value is None:  # a blank line: the end of an event
            if pending:  # whose data never parsed
                raise TokenFormatError(f"malformed JSON in SSE data: {_quote(chr(10).join(pending))}")
            continue
        if not pending and value.strip() == "[DONE]":
            result.done = True
            break
        pending.append(value)
        data = "\n".join(pending)
        try:
            events = _dispatch(data, result)
        except json.JSONDecodeError as exc:
            if len(pending) > 1 or not _maybe_incomplete(data, exc):
                raise TokenFormatError(f"malformed JSON in SSE data line {_quote(line)}: {exc.msg}") from None
            continue  # an event split over several data: lines; wait for the rest
        pending.clear()
        for ev in events:
            result.tokens += 1
            yield ev
    else:
        if pending:
            raise TokenFormatError(f"malformed JSON in SSE data: {_quote(chr(10).join(pending))}")
        if require_done:
            raise CompletionError(f"the stream ended after {result.tokens} tokens without 'data: [DONE]' "
                                  f"(connection closed early?)")
    usage_count = (result.usage or {}).get("completion_tokens")
    if usage_count is not None and int(usage_count) != result.tokens:
        raise CompletionError(f"the server reports usage.completion_tokens={usage_count} but the stream carried "
                              f"{result.tokens} token ids; tokens were lost or duplicated")


def _sse_data_lines(lines: Iterable[str | bytes]) -> Iterator[tuple[str, str | None]]:
    """`(line, value)` for each blank line (value None: an event ends) and each `data:` line (value: the field's
    value, one leading space removed) of an event stream; comments (`:`), other fields (`event:`, `id:`,
    `retry:`, unknown ones) and a byte-order mark at the start of the first line are skipped."""
    first = True
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else str(raw)
        if first:
            line, first = line.removeprefix(_BOM), False
        line = line.rstrip("\r\n")
        if not line:
            yield line, None
            continue
        name, _, value = line.partition(":")
        if name == "data":  # a comment has the empty name; event:, id:, retry: carry nothing we use
            yield line, value.removeprefix(" ")


def _dispatch(data: str, result: StreamResult) -> list[TokenEvent]:
    """The events of one complete `data:` JSON value (json.JSONDecodeError while it is incomplete)."""
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise TokenFormatError(f"SSE data is not a JSON object: {_quote(data)}")
    result.chunks += 1
    return _chunk_events(chunk, data, result)


def _maybe_incomplete(data: str, exc: json.JSONDecodeError) -> bool:
    """True when `data` could be the start of a JSON value continued on the next `data:` line."""
    return exc.pos >= len(data.rstrip()) and data.lstrip().startswith(("{", "["))


def _base_url(base_url: str) -> str:
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http(s) URL such as 'http://localhost:8000', got {base_url!r}")
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _check_prompt(prompt_token_ids: Sequence[int]) -> list[int]:
    try:
        ids = [int(t) for t in prompt_token_ids]
    except (TypeError, ValueError):
        raise ValueError("prompt_token_ids must be a sequence of integer token ids") from None
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    if min(ids) < 0:
        raise ValueError(f"prompt_token_ids contains a negative id ({min(ids)})")
    return ids


def http_error_message(url: str, status: int, text: str, model_name: str) -> str:
    """The message of a `CompletionHTTPError`: vLLM's own error message (its JSON body's `error.message`, else
    the body), plus what to do for the errors a user makes most (a model name vLLM does not serve, a prompt
    longer than the model's context)."""
    detail = text[:2000]
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict) and err.get("message"):
        detail = str(err["message"])
    elif isinstance(err, str) and err:
        detail = err
    msg = f"POST {url} returned HTTP {status}: {detail}"
    if status == 404 and "does not exist" in detail:
        msg += f" (fix: pass the model name vLLM serves, as GET /v1/models lists it, instead of {model_name!r})"
    elif status == 400 and "maximum context length" in detail:
        msg += " (fix: shorten the prompt or lower max_tokens, or start vLLM with a larger --max-model-len)"
    return msg


def _sdk_token_event():
    """LMCache's `TokenEvent` class when lmcache is installed (its request streams expect it), else ours."""
    try:
        from lmcache.sdk.request import TokenEvent as SDKTokenEvent  # type: ignore
    except ImportError:  # lmcache is optional
        return None
    return SDKTokenEvent


class PostCompletion:
    """Callable `(prompt_token_ids, sampling_params, cache_salt) -> Iterator[event]` over one vLLM server.

    Made by `make_post_completion`; one instance holds one `httpx.Client` (thread-safe, shared by the
    concurrent request streams of a batch). Each call is a generator: the HTTP request starts at the
    first `next()`, and closing the generator early closes the connection.

    Attributes:
        url: the `/v1/completions` endpoint.
        model_name: the `model` field sent.
        last_result: `StreamResult` of the most recent finished call in any thread (diagnostics).
    """

    def __init__(self, base_url: str, model_name: str, *, timeout: float = DEFAULT_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S, extra_body: dict | None = None,
                 event_type=None, transport=None):
        import httpx

        if not model_name or not isinstance(model_name, str):
            raise ValueError(f"model_name must be the model name vLLM serves (see GET /v1/models), got {model_name!r}")
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if value is None or not float(value) > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        self.url = _base_url(base_url) + "/completions"
        self.model_name = model_name
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.extra_body = dict(extra_body or {})
        self.event_type = event_type if event_type is not None else (_sdk_token_event() or TokenEvent)
        self.last_result: StreamResult | None = None
        # pool=timeout: a call waiting for a free connection also gives up in finite time; no connection cap,
        # since a batch opens one stream per request.
        self._client = httpx.Client(
            timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout, pool=self.timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64), transport=transport)

    def body(self, prompt_token_ids: Sequence[int], sampling_params: dict | None, cache_salt: str) -> dict:
        """The JSON body of one request (see `__call__`)."""
        params = dict(sampling_params or {})
        for key in ("model", "prompt", "stream"):
            if key in params:
                raise ValueError(f"sampling_params must not set {key!r}; the client sets it")
        body = {**self.extra_body, **params, "model": self.model_name, "prompt": _check_prompt(prompt_token_ids),
                "stream": True, "return_tokens_as_token_ids": True}
        # logprobs=0 returns the sampled token only, which is where its id travels.
        if body.get("logprobs") is None:
            body["logprobs"] = 0
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        if cache_salt:  # vLLM rejects an empty salt; no salt means the shared, unsalted namespace
            body["cache_salt"] = str(cache_salt)
        return body

    def __call__(self, prompt_token_ids: Sequence[int], sampling_params: dict | None = None,
                 cache_salt: str = "") -> Iterator:
        """Stream one completion; yields one event (`event_type(token_id=, text=)`) per generated token.

        Args:
            prompt_token_ids: the prompt as token ids (non-empty, non-negative ints).
            sampling_params: OpenAI/vLLM completion fields (`max_tokens`, `temperature`, `ignore_eos`, ...).
            cache_salt: vLLM/LMCache cache salt; `""` sends none.

        Raises:
            ValueError: bad prompt or sampling_params (before anything is sent).
            CompletionConnectionError: the server cannot be reached (the message names the URL and how to
                start vLLM).
            CompletionTimeoutError: no byte for `timeout` seconds.
            CompletionHTTPError: an HTTP error status (message has the status and the body).
            TokenFormatError / CompletionError: see `iter_token_events`.
        """
        body = self.body(prompt_token_ids, sampling_params, cache_salt)
        return self._stream(body)

    def _stream(self, body: dict) -> Iterator:
        import httpx

        result = StreamResult()
        try:
            with self._client.stream("POST", self.url, json=body) as resp:
                if resp.status_code >= 400:
                    text = resp.read().decode("utf-8", "replace")
                    raise CompletionHTTPError(http_error_message(self.url, resp.status_code, text, self.model_name),
                                              resp.status_code, text)
                # Decode the bytes ourselves: an event stream is UTF-8 whatever the header says (iter_sse_lines).
                for ev in iter_token_events(iter_sse_lines(resp.iter_bytes()), result=result, require_done=True):
                    yield self.event_type(token_id=ev.token_id, text=ev.text)
        except httpx.ConnectError as exc:
            raise CompletionConnectionError(f"cannot connect to vLLM at {self.url} ({exc}); {VLLM_START_HINT}") from exc
        except httpx.ConnectTimeout as exc:
            raise CompletionConnectionError(f"connecting to vLLM at {self.url} timed out after {self.connect_timeout:g}s; "
                                            f"{VLLM_START_HINT}") from exc
        except httpx.ReadTimeout as exc:
            raise CompletionTimeoutError(f"vLLM at {self.url} sent nothing for {self.timeout:g}s (read timeout) after "
                                         f"{result.tokens} tokens; raise timeout= for very long prefills") from exc
        except httpx.PoolTimeout as exc:
            raise CompletionTimeoutError(f"no free connection to {self.url} within {self.timeout:g}s") from exc
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise CompletionError(f"the stream from {self.url} broke after {result.tokens} tokens: {exc}") from exc
        self.last_result = result

    def close(self) -> None:
        """Close the HTTP connections."""
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def make_post_completion(base_url: str, model_name: str, *, timeout: float = DEFAULT_TIMEOUT_S,
                         connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S, extra_body: dict | None = None,
                         event_type=None, transport=None) -> PostCompletion:
    """A `post_completion(prompt_token_ids, sampling_params, cache_salt)` callable for LMCache's SDK streams.

    Args:
        base_url: the vLLM server, `http://HOST:PORT` (with or without `/v1`).
        model_name: the served model name (`GET /v1/models`).
        timeout: read timeout in seconds: the longest silence allowed inside a stream (prefill of a long
            prompt included); finite.
        connect_timeout: seconds to establish a connection; finite.
        extra_body: extra JSON fields sent with every request.
        event_type: class built as `event_type(token_id=, text=)` per token; default LMCache's
            `lmcache.sdk.request.TokenEvent` when lmcache is installed, else `tdutils.serving.completion.TokenEvent`.
        transport: an httpx transport (tests).

    Returns:
        A `PostCompletion`; call `.close()` (or use it as a context manager) when done.

    Raises:
        ValueError: bad URL, empty model name, non-finite timeouts.
    """
    return PostCompletion(base_url, model_name, timeout=timeout, connect_timeout=connect_timeout,
                          extra_body=extra_body, event_type=event_type, transport=transport)


__all__ = ["CompletionConnectionError", "CompletionError", "CompletionHTTPError", "CompletionTimeoutError",
           "PostCompletion", "StreamResult", "TokenEvent", "TokenFormatError", "iter_sse_lines", "iter_token_events",
           "make_post_completion"]
