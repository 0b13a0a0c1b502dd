"""The OpenAI wire format: pydantic models of the requests the server takes and builders of its answers.

Only what Specter can honour is accepted; a field it cannot honour (n > 1, logprobs, echo, tools, tool_choice,
response_format other than text, logit_bias, functions, audio output, predicted outputs) is refused by name rather
than silently ignored, and fields it has no use for (user, metadata) are ignored as OpenAI does.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specter.api import FinishReason

MAX_STOP_STRINGS = 16  # OpenAI allows 4; more only slows the detokenizer's search, so be a little generous
SEED_LIMIT = 2**63  # the engine's seed is a non-negative int64
# Unknown fields are ignored (clients send ones we have no use for); known ones take JSON types strictly, as
# OpenAI does: "yes" is not true and "0.5" is not a number.
WIRE = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # NaN read "less than or equal to 2 (got NaN)"


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_not(values: list[Any], fits: Any) -> str:
    """The first element that does not fit, named by its index, for an error."""
    index = next(i for i, value in enumerate(values) if not fits(value))
    return f"element {index} is {as_json(values[index])}"


def as_json(value: Any, limit: int | None = 40) -> str:
    """A client's value for an error message, as the client wrote it: compact JSON (true, null, "é", {"a":1}), cut to
    `limit` characters with "…" after a cut. A list or object is rendered only as far as the cut, so a megabyte of
    token ids costs no more than a few. What JSON cannot write (bytes or a Decimal: Python's values, never the wire's)
    is written as its repr; a lone surrogate, which no UTF-8 answer can carry, as JSON's escape (\\ud800)."""
    pieces: list[str] = []
    size = 0
    try:
        for piece in json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=repr).iterencode(value):
            pieces.append(piece)
            size += len(piece)
            if limit is not None and size > limit:
                break
        text = "".join(pieces)
    except (TypeError, ValueError, RecursionError):  # a key JSON cannot name, a cycle, nesting past the stack
        text = repr(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIRequestError(Exception):
    """A request the server refuses: the HTTP status and the fields of OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = WIRE

    include_usage: bool | None = Field(False, description="Send one more chunk before [DONE] with the request's "
                                       "usage; null is false.")


class SamplingRequest(BaseModel):
    """Fields both endpoints share. Defaults follow OpenAI's: temperature 1, top_p 1, a fresh seed per request."""

    model_config = WIRE

    model: str = Field(description="The served model name (GET /v1/models).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy; None means OpenAI's default, 1.")
    top_p: float | None = Field(None, ge=0.0, le=1.0, description="Nucleus sampling; 1 (or None) keeps every token, "
                                "0 only the most likely one (greedy), as OpenAI takes it.")
    top_k: int | None = Field(None, ge=1, description="Keep the k most likely tokens (not in OpenAI's API; vLLM's name).")
    seed: int | None = Field(None, ge=-SEED_LIMIT, lt=SEED_LIMIT, description="Same seed and parameters, same tokens; "
                             "None draws one. An int64, as OpenAI's; a negative one draws one too (llama.cpp's -1, "
                             "which some clients send, means a random seed).")
    stop: str | list[str] | None = Field(None, description="Stop strings; the text ends before the first one found.")
    # OpenAI's schema lets a client send null for these (the official client's n=None does), meaning the default.
    stream: bool | None = Field(False, description="Server-sent events; null is false.")
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=1, description="One choice per request (n > 1 is not supported); null is 1.")
    logprobs: Any = Field(None, description="Not supported: must be absent, null or false (0 asks for the sampled "
                          "token's logprob in the completions API, so it is refused too).")
    top_logprobs: Any = Field(None, description="Not supported: must be absent or null.")
    presence_penalty: float | None = Field(None, description="Not supported: must be absent or 0.")
    frequency_penalty: float | None = Field(None, description="Not supported: must be absent or 0.")
    logit_bias: dict[str, Any] | None = Field(None, description="Not supported: must be absent, null or empty.")
    response_format: dict[str, Any] | None = Field(None, description="Only {\"type\": \"text\"} (the default); JSON "
                                                   "modes and schemas are not supported.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        # Before pydantic's union, whose error would name only its string branch ("stop.str").
        if isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise ValueError(f"stop strings must be strings; {_first_not(value, lambda item: isinstance(item, str))}")
        if value is not None and not isinstance(value, (str, list)):
            raise ValueError("stop must be a string or a list of strings")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        # GenerationConfig refuses an empty one too; here it is named as the client wrote it, before any encoding
        if value == "":
            raise ValueError("stop is empty; give the text to stop at, or leave stop out")
        if isinstance(value, list) and "" in value:
            raise ValueError(f"stop strings must not be empty; {_first_not(value, bool)}; give the text to stop at, "
                             "or leave it out")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value not in (None, 0):
            raise ValueError("not supported by this server; leave it out")
        return value

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value is not None and value is not False:  # 0 is a request too: the sampled token's own logprob
            raise ValueError("log probabilities are not supported by this server; leave it out")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("logit_bias is not supported by this server; leave it out")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError("only {\"type\": \"text\"} is supported; this server cannot constrain output to JSON")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # `stream` is declared first, so it is validated
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


BATCH_REFUSED = "got a batch of {count} prompts; send one prompt per request"


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. The prompt is text or token ids; a batch of one is taken, larger batches refused."""

    # Left to right: the shape check below already chose the branch, and a smart union would validate a long prompt
    # against every branch (seconds of the event loop for an 8 MB body).
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most; OpenAI's default is 16.")
    echo: bool | None = Field(False, description="Not supported: must be false (or null).")
    best_of: int | None = Field(None, ge=1, le=1, description="Not supported beyond 1.")
    suffix: None = Field(None, description="Not supported: must be absent.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """Text, token ids, or a batch (a list) of one of either, with an error naming the element that fits none:
        pydantic's union would report only its first branch ("prompt.str: Input should be a valid string"). A larger
        batch is refused before any pass over its prompts (the server takes one prompt a request)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("the prompt must be text, a list of token ids, or a batch of one of these")
        if not value or _is_id(value[0]):
            if not all(_is_id(item) for item in value):
                raise ValueError(f"token ids must be integers; {_first_not(value, _is_id)}")
        elif not isinstance(value[0], (str, list)):
            raise ValueError(f"element 0 is {as_json(value[0])}; a prompt is text, token ids (integers), or a batch of "
                             "one of these")
        elif len(value) != 1:
            raise ValueError(BATCH_REFUSED.format(count=len(value)))
        elif isinstance(value[0], list) and not all(_is_id(token) for token in value[0]):
            raise ValueError(f"a batch's token-id prompt holds only integers; {_first_not(value[0], _is_id)}")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIRequestError(400, BATCH_REFUSED.format(count=len(prompt)), param="prompt")
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = WIRE

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = WIRE

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        """Text or text parts, with an error naming the part that is not one (an image, say): pydantic's union would
        report only its string branch ("content.str: Input should be a valid string")."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")
        for index, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"content part {index} must be an object {{\"type\": \"text\", \"text\": ...}}")
            if part.get("type") != "text":
                raise ValueError(f"content part {index} is of type {as_json(part.get('type'))}: only text parts are "
                                 "supported (no images, audio or files)")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {index} needs 'text', a string")
        return value

    @model_validator(mode="after")
    def _content_where_required(self) -> "ChatMessage":
        # As OpenAI: only an assistant's message may go without content (it would carry tool calls instead).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id'")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """What the chat template sees: content parts joined into one string, as most templates expect."""
        content = self.content if not isinstance(self.content, list) else "".join(part.text for part in self.content)
        # OpenAI's newer name for the system role: checkpoints' templates know "system" (one that knows no other role
        # drops a "developer" turn without a word, and another would render a role the model was never trained on).
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:  # templates that render tool results name the call they answer
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: messages rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most; None: up to the context.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    tools: list[Any] | None = Field(None, description="Not supported: must be absent or empty.")
    functions: list[Any] | None = Field(None, description="The older tools: not supported, must be absent or empty.")
    tool_choice: Any = Field(None, description="Only absent, null or \"none\": there are no tools to call.")
    function_call: Any = Field(None, description="The older tool_choice: only absent, null or \"none\".")
    modalities: list[Any] | None = Field(None, description="Output kinds: only [\"text\"] (or absent); no audio.")
    audio: Any = Field(None, description="Audio output's settings: not supported, must be absent or null.")
    prediction: Any = Field(None, description="Predicted outputs: not supported, must be absent or null.")

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tools are not supported by this server")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise ValueError("tools are not supported by this server, so only \"none\" (or leaving it out) is allowed")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, value: list[Any] | None) -> list[Any] | None:
        if value is not None and value != ["text"]:
            raise ValueError(f"only [\"text\"] output is supported by this server, not {as_json(value)}")
        return value

    @field_validator("audio", "prediction")
    @classmethod
    def _not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            what = "audio output is" if info.field_name == "audio" else "predicted outputs are"
            raise ValueError(f"{what} not supported by this server; leave it out")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_limit_param(self) -> str:
        """The field the limit came from, for an error about it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ---- answers ------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def wire_finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI knows 'stop' and 'length'; a request that ends otherwise never reaches the client as finished."""
    return reason if reason in ("stop", "length") else None


class Answer:
    """The fixed fields of one request's answer or chunks: id, object type, creation time and model name."""

    def __init__(self, chat: bool, model: str, request_id: str) -> None:
        self.chat, self.model, self.id = chat, model, request_id
        self.created = int(time.time())

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: FinishReason, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": wire_finish_reason(finish_reason)}
            return self._head("chat.completion") | {"choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": wire_finish_reason(finish_reason)}
        return self._head("text_completion") | {"choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: FinishReason | None = None, *, first: bool = False,
              with_usage: bool = False) -> dict[str, Any]:
        """One streamed piece; with include_usage every chunk carries `usage: null`, as OpenAI's do."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": wire_finish_reason(finish_reason)}
            chunk = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": wire_finish_reason(finish_reason)}
            chunk = self._head("text_completion") | {"choices": [choice]}
        return chunk | {"usage": None} if with_usage else chunk

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        object_name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(object_name) | {"choices": [], "usage": usage(prompt_tokens, completion_tokens)}
