"""The OpenAI wire format of ``specstore serve``: request models, response and chunk bodies, errors.

Owns what ``/v1/chat/completions`` and ``/v1/completions`` accept (pydantic models; parameters
that would change the output and are not implemented, such as ``n > 1``, ``stop`` or
``logprobs``, are refused by name rather than ignored) and the JSON they answer with, including
the vendor field ``specstore`` (the ``NAME@VERSION`` that served the request, method, MAT and
step statistics). Pure functions over ``ServedResult``: no HTTP, no engine calls (serve.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specstore.runtime.engine import ServedResult


class RequestError(ValueError):
    """A request the server refuses: HTTP ``status`` with an OpenAI error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict:
        return error_body(str(self), type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class VendorOptions(BaseModel):
    """The request's own ``specstore`` field (``extra_body`` in the openai client)."""

    model_config = ConfigDict(extra="forbid")
    method: str | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send many optional fields; the ones that matter are checked
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: str | list[str] | None = None
    specstore: VendorOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def method(self) -> str | None:
        return self.specstore.method if self.specstore else None


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)

    def chat_messages(self) -> list[dict]:
        """The messages as ``{"role", "content"}`` dicts for the chat template (``developer`` is a
        system message; text parts are joined)."""
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise RequestError("only text content parts are supported", param=f"messages.{i}.content")
                content = "".join(p.text or "" for p in m.content)
            else:
                content = m.content or ""
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool = False

    def raw_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise RequestError("one prompt per request (batches are not supported)", param="prompt")
            return self.prompt[0]
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("the prompt is empty", param="prompt")
        return self.prompt

    def limit(self) -> int | None:
        return self.max_tokens


# parameters that would change what is generated: refused unless left at their neutral value
_NEUTRAL = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1), "suffix": (None, ""), "echo": (None, False), "response_format": (None, {"type": "text"}),
}


def parse_request(kind: Literal["chat", "completion"], body: object) -> ChatRequest | CompletionRequest:
    """Validate a request body; raise RequestError (400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        request = (ChatRequest if kind == "chat" else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise RequestError(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    if request.n != 1:
        raise RequestError("n must be 1 (one completion per request)", param="n")
    if request.stop:
        raise RequestError("stop sequences are not supported", param="stop")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise RequestError(f"{name} is not supported by this server", param=name)
    return request


def finish_reason(result: ServedResult) -> str:
    return "stop" if result.stop_reason == "eos" else "length"


def vendor(result: ServedResult) -> dict:
    """The ``specstore`` field of every response."""
    s = result.stats
    return {
        "datastore": result.datastore, "reference": result.reference, "method": result.method, "mat": s.mat,
        "acceptance_rate": s.acceptance_rate, "steps": s.steps, "num_drafted": s.num_drafted, "num_accepted": s.num_accepted,
        "drafting_s": s.drafting_s, "verifying_s": s.verifying_s, "stop_reason": result.stop_reason, "lossless": result.lossless,
        "overlay": result.overlay,  # with the overlay on: its nodes drafted and accepted in this request
    }


def usage(result: ServedResult) -> dict:
    n, m = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def chat_response(rid: str, created: int, model: str, result: ServedResult) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
              "finish_reason": finish_reason(result)}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(result), "specstore": vendor(result)}


def completion_response(rid: str, created: int, model: str, result: ServedResult) -> dict:
    choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result)}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(result), "specstore": vendor(result)}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None, *, role: bool = False,
          result: ServedResult | None = None) -> dict:
    """One streamed chunk: a piece of text, the opening role (chat), or the closing chunk with the
    finish reason and the ``specstore`` field (``result``)."""
    reason = finish_reason(result) if result is not None else None
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
    else:
        body = {"object": "text_completion", "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}
    out = {"id": rid, "created": created, "model": model, **body}
    if result is not None:
        out["specstore"] = vendor(result)
    return out


def usage_chunk(kind: str, rid: str, created: int, model: str, result: ServedResult) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(result)}
