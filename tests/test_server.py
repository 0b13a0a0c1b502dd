"""`specter serve` as a client sees it: live servers on loopback (subprocesses, so hang-ups and SIGTERM are
real), driven by the official openai client and raw httpx; answers compared with the Python API's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# CI installs the test extras, so there a missing client is an install defect and must fail; elsewhere (the GPU
# machine, which runs `-m gpu` and has no openai) the module skips instead of stopping the collection.
if os.environ.get("CI"):
    import httpx
    import openai
    import starlette  # noqa: F401
else:
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")

from specter import EngineConfig, SyncEngine

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ARGS = ["--device", "cpu", "--residents", "2", "--max-context", "256"]  # speculation on, 2 of 16 experts resident
ENGINE = EngineConfig(device="cpu", residents=2, max_context=256)  # the same engine in this process, for reference
KEY = "test-key"
BODY_LIMIT = 65536  # the `server` fixture's --max-body-bytes
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'trip' %}{{ m.missing.attribute }}{% endif %}"
                 "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _die_with_parent() -> None:
    """A server outlives no test run, even one killed before its fixtures' teardown (Linux: PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class LiveServer:
    """`python -m specter serve` in a subprocess on an ephemeral loopback port; its stderr is kept."""

    def __init__(self, model: Path, *extra: str) -> None:
        env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # one thread: the reference runs with one
        self.model = str(model)  # the served name, without --served-model-name
        command = [sys.executable, "-m", "specter", "serve", "--model", self.model, "--port", "0", *ENGINE_ARGS, *extra]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                                        preexec_fn=_die_with_parent)
        self.log: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._ready.wait(120) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if match := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # exited

    @property
    def pid(self) -> int:
        return self.process.pid

    def client(self, key: str = "none", **options: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60, **options)

    def async_client(self, key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines())
                if name and not name.startswith("#")}

    def wait_idle(self, within_s: float) -> float:
        """Seconds until no request runs or waits; fails after `within_s`."""
        start = time.monotonic()
        while time.monotonic() - start < within_s:
            health = self.health()
            if health["running"] == 0 and health["queue_depth"] == 0:
                return time.monotonic() - start
            time.sleep(0.02)
        raise AssertionError(f"the server still holds requests after {within_s} s: {self.health()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        if self.process.stderr is not None:
            self.process.stderr.close()


def proc_usage(pid: int) -> dict[str, int]:
    """RSS (bytes), threads and open file descriptors of a process, from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss": int(status["VmRSS"].split()[0]) * 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


@pytest.fixture(scope="module")
def chat_model(tiny, tmp_path_factory) -> Path:
    """The tiny checkpoint with a chat template: the fixture checkpoint the chat endpoint is tested on."""
    directory = shutil.copytree(tiny, tmp_path_factory.mktemp("chat") / "model")
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": CHAT_TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def server(tiny):
    live = LiveServer(tiny, "--max-queue", "64", "--max-body-bytes", str(BODY_LIMIT))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def chat_server(chat_model):
    """A keyed server with room for one waiting request, under another name."""
    live = LiveServer(chat_model, "--api-key", KEY, "--max-queue", "1", "--served-model-name", "fixture-chat")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference(tiny, one_thread):
    with SyncEngine(tiny, ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def chat_reference(chat_model, one_thread):
    with SyncEngine(chat_model, ENGINE) as engine:
        yield engine


def stream_text(stream) -> tuple[str, str | None, object]:
    """Text, finish_reason and usage of a streamed completion (completions or chat)."""
    texts, finish, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts.append(choice.delta.content or "" if hasattr(choice, "delta") else choice.text)
            finish = choice.finish_reason or finish
    return "".join(texts), finish, usage


# ---- answers equal the Python API's ---------------------------------------------------------------------
def test_models_and_health(server):
    models = server.client().models.list()
    assert [model.id for model in models.data] == [server.model]
    assert server.health() | {"tasks": 0} == {"status": "ok", "model": models.data[0].id, "queue_depth": 0, "running": 0,
                                             "held_slots": 0, "tasks": 0}


@pytest.mark.parametrize("prompt", ["hello world", [5, 17, 300, 42]], ids=["text", "token-ids"])
def test_completion_equals_engine_streamed_and_not(server, reference, prompt):
    model = server.client().models.list().data[0].id
    expected = reference.complete(prompt, max_new_tokens=8, temperature=0)
    whole = server.client().completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected.prompt_ids), 8)
    streamed = server.client().completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    text, finish, usage = stream_text(streamed)
    assert (text, finish, usage.completion_tokens) == (expected.text, "length", 8)


def test_seeded_sampling_is_reproducible_and_matches_engine(server, reference):
    client, model = server.client(), server.client().models.list().data[0].id
    params = dict(temperature=0.9, top_p=0.95, seed=11)
    expected = reference.complete("the quick brown fox", max_new_tokens=10, top_k=40, **params)
    answers = [client.completions.create(model=model, prompt="the quick brown fox", max_tokens=10, extra_body={"top_k": 40},
                                         **params).choices[0].text for _ in range(2)]
    streamed, _, _ = stream_text(client.completions.create(model=model, prompt="the quick brown fox", max_tokens=10,
                                                           extra_body={"top_k": 40}, stream=True, **params))
    assert answers == [expected.text, expected.text] and streamed == expected.text
    other = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=10, extra_body={"top_k": 40},
                                      **(params | {"seed": 12}))
    assert other.choices[0].text != expected.text  # the seed is used, not ignored
    # OpenAI's seed is an int64; -1 from clients of llama.cpp means "random": answered, not refused
    minus_one = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=10,
                                          extra_body={"top_k": 40}, **(params | {"seed": -1}))
    assert minus_one.choices[0].finish_reason == "length"


def test_a_negative_seed_draws_one_as_no_seed_does(monkeypatch):
    """It was refused (400), then taken modulo 2**63: every -1 request sampled alike, where its clients mean random."""
    from specter.server import app
    from specter.server.protocol import CompletionRequest

    monkeypatch.setattr(app.secrets, "randbelow", lambda bound: 1234)
    seeds = [app._generation(CompletionRequest.model_validate({"model": "m", "prompt": "a", "seed": seed}), 4).seed
             for seed in (-1, -2**63, None, 0, 7)]
    assert seeds == [1234, 1234, 1234, 0, 7]


def test_stop_string_ends_the_text_with_finish_reason_stop(server, reference):
    model = server.client().models.list().data[0].id
    full = reference.complete("hello world", max_new_tokens=12, temperature=0).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    expected = reference.complete("hello world", max_new_tokens=12, temperature=0, stop_strings=(stop,))
    whole = server.client().completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0, stop=[stop])
    streamed = stream_text(server.client().completions.create(model=model, prompt="hello world", max_tokens=12,
                                                              temperature=0, stop=stop, stream=True))
    assert expected.finish_reason == "stop" and stop not in expected.text
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected.text, "stop")
    assert streamed[:2] == (expected.text, "stop")


def test_chat_uses_the_template_and_equals_engine(chat_server, chat_reference):
    client = chat_server.client(KEY)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    expected = chat_reference.complete(messages, max_new_tokens=6, temperature=0)
    assert expected.prompt_ids == chat_reference.engine.encode("system: be brief\nuser: hello\nassistant:")
    whole = client.chat.completions.create(model="fixture-chat", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(expected.prompt_ids) and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="fixture-chat", messages=messages, max_completion_tokens=6,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_developer_message_is_the_system_message(chat_server, chat_reference):
    """OpenAI's newer name for the system role (the official client sends it): templates know "system", and the
    fixture's renders any role by name, so a "developer" turn passed through would read "developer: ..." (a template
    that knows only user, assistant and system drops it without a word)."""
    client = chat_server.client(KEY)
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello"}]
    expected = chat_reference.complete(system, max_new_tokens=6, temperature=0)
    answer = client.chat.completions.create(model="fixture-chat", messages=developer, max_tokens=6, temperature=0)
    assert answer.usage.prompt_tokens == len(expected.prompt_ids)
    assert answer.choices[0].message.content == expected.text


def test_top_p_0_keeps_the_most_likely_token_alone(server, reference):
    """OpenAI takes top_p from 0 to 1; 0 keeps only the most likely token: the greedy text, whatever the temperature."""
    expected = reference.complete("hello world", max_new_tokens=8, temperature=0).text
    for temperature in (None, 1.5):
        answer = server.client().completions.create(model=server.model, prompt="hello world", max_tokens=8, top_p=0,
                                                    seed=3, **({} if temperature is None else {"temperature": temperature}))
        assert answer.choices[0].text == expected


# ---- bad requests -----------------------------------------------------------------------------------------
BAD = {
    "malformed JSON": ("/v1/completions", b'{"model": "M", "prompt": "hi",', 400, None),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None),
    "missing prompt": ("/v1/completions", {"model": "M"}, 400, "prompt"),
    "missing model": ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    "missing messages": ("/v1/chat/completions", {"model": "M"}, 400, "messages"),
    "temperature < 0": ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    "top_p > 1": ("/v1/completions", {"model": "M", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "max_tokens 0": ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "n > 1": ("/v1/completions", {"model": "M", "prompt": "hi", "n": 2}, 400, "n"),
    "seed below int64": ("/v1/completions", {"model": "M", "prompt": "hi", "seed": -2**63 - 1}, 400, "seed"),
    "logprobs": ("/v1/completions", {"model": "M", "prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    "stream not a bool": ("/v1/completions", {"model": "M", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    "unknown model": ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    "prompt past the context": ("/v1/completions", {"model": "M", "prompt": [7] * 300, "max_tokens": 1}, 400, "prompt"),
    "max_tokens past the context": ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 256}, 400, "max_tokens"),
    "token id outside the vocabulary": ("/v1/completions", {"model": "M", "prompt": [1, 99999]}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {"model": "M", "prompt": ""}, 400, "prompt"),
    "batch of prompts": ("/v1/completions", {"model": "M", "prompt": ["a", "b"]}, 400, "prompt"),
    "chat without a template": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}]},
                                400, "messages"),
    "unknown role": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "robot", "content": "hi"}]}, 400,
                     "messages"),
    "unknown path": ("/v1/embeddings", {"model": "M", "input": "hi"}, 404, None),
    "logprobs 0 (the sampled token's)": ("/v1/completions", {"model": "M", "prompt": "hi", "logprobs": 0}, 400, "logprobs"),
    "logit_bias": ("/v1/completions", {"model": "M", "prompt": "hi", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    "stream_options without a stream": ("/v1/completions", {"model": "M", "prompt": "hi",
                                                            "stream_options": {"include_usage": True}}, 400, "stream_options"),
    "JSON mode": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                                           "response_format": {"type": "json_object"}}, 400, "response_format"),
    "tool_choice without tools": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                                                           "tool_choice": "required"}, 400, "tool_choice"),
    "legacy functions": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                                                  "functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    "a user message without content": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user"}]}, 400,
                                       "messages"),
    "a tool message without tool_call_id": ("/v1/chat/completions", {"model": "M", "messages": [
        {"role": "tool", "content": "42"}]}, 400, "messages"),
    "a body over --max-body-bytes": ("/v1/completions", {"model": "M", "prompt": "x" * BODY_LIMIT}, 413, None),
    "a message that is not an object": ("/v1/chat/completions", {"model": "M", "messages": ["hi"]}, 400, "messages"),
    "an image content part": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages"),
    "stream_options not an object": ("/v1/completions", {"model": "M", "prompt": "hi", "stream": True,
                                                         "stream_options": "yes"}, 400, "stream_options"),
    "a token id that is a boolean": ("/v1/completions", {"model": "M", "prompt": [1, True]}, 400, "prompt"),
    "a null stop string": ("/v1/completions", {"model": "M", "prompt": "hi", "stop": [None]}, 400, "stop"),
    "an empty stop string": ("/v1/completions", {"model": "M", "prompt": "hi", "stop": ["\n", ""]}, 400, "stop"),
    "top_p < 0": ("/v1/completions", {"model": "M", "prompt": "hi", "top_p": -0.1}, 400, "top_p"),
    "audio output": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                                              "modalities": ["text", "audio"], "audio": {"voice": "alloy"}}, 400,
                     "modalities"),
    "audio settings alone": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                                                      "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    "a predicted output": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                                                    "prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
}

# What each malformed part of a valid JSON object is told: the element and what it must be, as the client wrote it.
# (pydantic's own errors said "the body must be a JSON object" of a bad array element, and named only the string
# branch of a union: "'prompt.str': Input should be a valid string" of [1, true].)
NAMED = {  # the fields beside "model", the error's param, what its message must say
    "a message that is not an object": ({"messages": ["hi"]}, "messages", "'messages.0' must be a JSON object"),
    "stream_options not an object": ({"prompt": "hi", "stream": True, "stream_options": "yes"}, "stream_options",
                                     "'stream_options' must be a JSON object"),
    "an image content part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                              "messages", "content part 0 is of type \"image_url\": only text parts are supported"),
    "a text part without text": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
                                 "content part 0 needs 'text', a string"),
    "content of another type": ({"messages": [{"role": "user", "content": 5}]}, "messages",
                                "content must be a string or a list of text parts"),
    "a boolean token id": ({"prompt": [1, True]}, "prompt", "token ids must be integers; element 1 is true"),
    "a float token id": ({"prompt": [1.5]}, "prompt", "element 0 is 1.5; a prompt is text, token ids (integers)"),
    "a text in a batch's id list": ({"prompt": [[1, "a"]]}, "prompt",
                                    "a batch's token-id prompt holds only integers; element 1 is \"a\""),
    "a batch of two, one not a prompt": ({"prompt": ["a", 2]}, "prompt",
                                         "got a batch of 2 prompts; send one prompt per request"),
    "a prompt object": ({"prompt": {"text": "hi"}}, "prompt", "the prompt must be text, a list of token ids, or a batch"),
    "a null stop string": ({"prompt": "hi", "stop": ["\n", None]}, "stop",
                           "stop strings must be strings; element 1 is null"),
    "a numeric stop": ({"prompt": "hi", "stop": 5}, "stop", "stop must be a string or a list of strings"),
    "an empty stop string": ({"prompt": "hi", "stop": ["\n", ""]}, "stop",
                             'stop strings must not be empty; element 1 is ""'),
    "an empty stop": ({"prompt": "hi", "stop": ""}, "stop", "stop is empty; give the text to stop at"),
}


@pytest.mark.parametrize("case", NAMED, ids=list(NAMED))
def test_a_malformed_field_is_named_with_what_it_must_be(case):
    from pydantic import ValidationError

    from specter.server.app import _validation_error
    from specter.server.protocol import ChatCompletionRequest, CompletionRequest

    fields, param, expected = NAMED[case]
    request = ChatCompletionRequest if "messages" in fields else CompletionRequest
    with pytest.raises(ValidationError) as invalid:
        request.model_validate_json(json.dumps({"model": "m", **fields}))
    error = _validation_error(invalid.value)
    assert error.status == 400 and error.code == "invalid_value" and error.param == param
    assert expected in error.message, error.message
    assert ".str" not in error.message and "ChatMessage" not in error.message


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2]], ["a"], "a", []])
def test_every_prompt_shape_openai_takes_still_validates(prompt):
    from specter.server.protocol import CompletionRequest

    assert CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": prompt})).prompt == prompt


# The value a client sent, echoed in its error as it wrote it: JSON (true, null, "abc"), not Python's repr (True, None,
# 'abc', {'5': 100}), as the shape messages above already did. "M" is the served name.
ECHOED = {  # path, body, status, what the message must say
    "a boolean temperature": ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": True}, 400,
                              "'temperature': Input should be a valid number (got true)"),
    "a null model": ("/v1/completions", {"model": None, "prompt": "hi"}, 400,
                     "'model': Input should be a valid string (got null)"),
    "max_tokens as a string": ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": "16"}, 400,
                               '(got "16")'),
    "logit_bias": ("/v1/completions", {"model": "M", "prompt": "hi", "logit_bias": {"5": 100}}, 400, '(got {"5":100})'),
    "non-ASCII text": ("/v1/completions", {"model": "M", "prompt": "hi", "top_p": "é"}, 400, '(got "é")'),
    "stream_options not an object": ("/v1/completions", {"model": "M", "prompt": "hi", "stream": True,
                                                         "stream_options": "yes"}, 400,
                                     "'stream_options' must be a JSON object (got \"yes\")"),
    "a message without content": ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "name": None}]},
                                  400, '(got {"role":"user","name":null})'),
    "an unknown model": ("/v1/completions", {"model": "gpt-4's", "prompt": "hi"}, 404,
                         'the model "gpt-4\'s" does not exist; this server serves "M"'),
}


@pytest.mark.parametrize("case", ECHOED, ids=list(ECHOED))
def test_an_error_echoes_the_clients_value_as_json(server, case):
    path, body, status, expected = ECHOED[case]
    body = {key: server.model if value == "M" else value for key, value in body.items()}
    expected = expected.replace('"M"', json.dumps(server.model))
    response = httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert expected in message, message
    assert not re.search(r"\b(True|False|None)\b", message), message


def test_every_echoed_value_is_json_and_so_is_the_rest(server):
    """The model's 404 from /v1/models/{name}, the 415's Content-Type and a long value (cut, with the cut shown)."""
    served = json.dumps(server.model)
    missing = httpx.get(f"{server.url}/v1/models/it's", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == f'the model "it\'s" does not exist; this server serves {served}'
    plain = httpx.post(f"{server.url}/v1/completions", content=b"{}", timeout=10,
                       headers={"content-type": "text/plain"})
    assert plain.status_code == 415 and plain.json()["error"]["message"].endswith('(got "text/plain")')
    bare = httpx.post(f"{server.url}/v1/completions", content=b"{}", headers={"content-type": ""}, timeout=10)
    assert bare.status_code == 415 and bare.json()["error"]["message"].endswith("(got no Content-Type)")
    long = httpx.post(f"{server.url}/v1/completions", timeout=10,
                      json={"model": server.model, "prompt": "hi", "top_p": "y" * 1000})
    assert long.status_code == 400 and long.json()["error"]["message"].endswith(f'(got "{"y" * 79}…)')


def test_a_value_json_cannot_write_still_gets_a_message_a_utf8_answer_can_carry():
    """Python-mode inputs (bytes, a Decimal, a key that is no string, a cycle) fall back to their repr; a lone
    surrogate (the wire's parser refuses one, a Python caller need not) is escaped as JSON would, not a 500 on encoding
    the answer; a megabyte of ids is rendered only as far as the cut."""
    from decimal import Decimal

    from pydantic import ValidationError
    from starlette.responses import JSONResponse

    from specter.server.app import _validation_error
    from specter.server.protocol import CompletionRequest, as_json

    assert as_json(True) == "true" and as_json(None) == "null" and as_json("é") == '"é"'
    assert as_json(float("nan")) == "NaN"  # as the wire's parser takes it
    assert as_json({"a": [1, None]}) == '{"a":[1,null]}' and as_json("a\nb") == '"a\\nb"'
    assert as_json("\ud800x") == '"\\ud800x"'
    assert as_json(b"ab") == '"b\'ab\'"' and as_json(Decimal("1.5")) == '"Decimal(\'1.5\')"'
    assert as_json({(1, 2): 3}) == "{(1, 2): 3}"
    cycle: list = []
    cycle.append(cycle)
    assert as_json(cycle) == "[[...]]"
    assert as_json("x" * 50) == '"' + "x" * 39 + "…"
    seen: list[int] = []

    class Ids(list):
        def __iter__(self):
            for token in super().__iter__():
                seen.append(token)
                yield token

    assert as_json(Ids([1] * 10**6), 10) == "[1,1,1,1,1…" and len(seen) < 10
    assert as_json("x" * 50, None) == json.dumps("x" * 50)
    for value in (b"\xff", Decimal("2.5"), "\ud800", {"\udc00": 1}):
        with pytest.raises(ValidationError) as invalid:
            CompletionRequest.model_validate({"model": "m", "prompt": "hi", "temperature": value})
        error = _validation_error(invalid.value)
        assert error.message.startswith("'temperature': ") and JSONResponse(error.body()).body


def test_a_token_id_prompt_past_the_context_is_refused_before_any_pass_over_its_ids():
    """Megabytes of ids past the context were checked id by id on the event loop first (1.3 s for 4 million, every
    stream held), where the same text's refusal took its JSON parse alone."""
    from types import SimpleNamespace

    from specter.server.app import _encode
    from specter.server.protocol import APIRequestError

    passes: list[int] = []
    engine = SimpleNamespace(encode=lambda ids: passes.append(len(ids)) or list(ids), spec=SimpleNamespace(vocab_size=100))
    state = SimpleNamespace(engine=engine, max_context=256)
    with pytest.raises(APIRequestError) as refused:
        asyncio.run(_encode(state, [1] * 256, "prompt"))
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt" and passes == []
    assert asyncio.run(_encode(state, [1] * 255, "prompt")) == [1] * 255 and passes == [255]


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case):
    path, body, status, param = BAD[case]
    model = server.client().models.list().data[0].id
    content = body if isinstance(body, bytes) else json.dumps({k: model if v == "M" else v for k, v in body.items()}).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert "Traceback" not in response.text and "File \"" not in response.text
    assert server.client().completions.create(model=model, prompt="hi", max_tokens=1, temperature=0).choices[0].text is not None


def test_null_means_the_default_where_openai_allows_it(server, reference):
    """The official client sends null for a parameter given as None (n=None); OpenAI's schema allows it for these."""
    model = server.client().models.list().data[0].id
    expected = reference.complete("hello", max_new_tokens=4, temperature=0).text
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0, "n": None, "stream": None,
            "echo": None, "stop": None, "seed": None}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
    streamed = server.client().completions.create(model=model, prompt="hello", max_tokens=4, temperature=0, n=None,
                                                  stream=True, stream_options={"include_usage": None})
    text, finish, usage = stream_text(streamed)
    assert (text, finish, usage) == (expected, "length", None)  # include_usage null: no usage chunk


def test_a_client_gone_while_sending_its_body_is_no_server_error(server):
    """Hanging up before the declared body arrived is the client's doing: counted as a hang-up (499), not logged as an
    internal error with a traceback whose locals hold the partial body."""
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    before, logged = server.metrics(), len(server.log)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n{\"model\": \"secret")
        time.sleep(0.3)  # the server is reading the body
    deadline = time.monotonic() + 10
    while (after := server.metrics()).get(GONE, 0) == before.get(GONE, 0):
        assert time.monotonic() < deadline, "the hang-up was never counted"
        time.sleep(0.05)
    assert after.get(FAILED, 0) == before.get(FAILED, 0)
    assert not any("internal_error" in line or "secret" in line for line in server.log[logged:]), server.log[logged:]
    model = server.client().models.list().data[0].id
    assert server.client().completions.create(model=model, prompt="hi", max_tokens=1, temperature=0).choices


GONE = 'specter_http_responses_total{endpoint="/v1/completions",status="499"}'
FAILED = 'specter_http_responses_total{endpoint="/v1/completions",status="500"}'


def test_the_openai_client_reads_the_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=400)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="hi")
    assert missing.value.code == "model_not_found"
    assert httpx.delete(f"{server.url}/v1/completions", timeout=10).status_code == 405


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(chat_server, scheme):
    url = f"{chat_server.url}/v1/models"
    assert httpx.get(url, headers={"authorization": f"{scheme} {KEY}"}, timeout=10).status_code == 200
    assert httpx.get(url, headers={"authorization": f"{scheme} {KEY.upper()}"}, timeout=10).status_code == 401
    assert httpx.get(url, headers={"authorization": f"Basic {KEY}"}, timeout=10).status_code == 401
    assert httpx.get(url, headers={"authorization": KEY}, timeout=10).status_code == 401


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_rather_than_serving_everyone(key, capsys):
    from specter.cli import build_parser
    from specter.server.asgi import Gate

    with pytest.raises(SystemExit) as refused:  # argparse's exit 2, before any model loads
        build_parser().parse_args(["serve", "--api-key", key])
    assert refused.value.code == 2 and "--api-key: must not be empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must not be empty"):
        Gate(lambda *args: None, None, key)  # type: ignore[arg-type]


def test_api_key_is_required_on_the_api_only(chat_server):
    with pytest.raises(openai.AuthenticationError):
        chat_server.client("wrong").models.list()
    response = httpx.post(f"{chat_server.url}/v1/chat/completions", json={"model": "fixture-chat", "messages": []}, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
    assert chat_server.client(KEY).models.list().data[0].id == "fixture-chat"
    assert httpx.get(f"{chat_server.url}/health", timeout=10).status_code == 200  # probes need no key


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_gets_415(server, content_type):
    """A browser may POST text/plain or a form across sites without asking first; JSON only keeps a page the user
    visits from starting generations on a server on their loopback."""
    body = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 1}).encode()
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=30)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    charset = {"content-type": "application/json; charset=utf-8"}  # a parameter is fine
    assert httpx.post(f"{server.url}/v1/completions", content=body, headers=charset, timeout=30).status_code == 200


def test_a_chunked_body_over_the_limit_gets_413_as_it_comes(server):
    """Without a Content-Length the body is counted as it arrives and refused once past the limit."""
    def chunks():
        yield b'{"model": "x", "prompt": "'
        for _ in range(2 * BODY_LIMIT // 4096):
            yield b"y" * 4096
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert "--max-body-bytes" in response.json()["error"]["message"]


def test_one_models_card(server):
    client = server.client()
    card = client.models.retrieve(server.model)
    assert card.id == server.model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found"


def test_a_template_error_names_the_served_model_not_its_directory(chat_server, chat_model):
    """The checkpoint's place on the server's disk stays there: a client sees the name --served-model-name chose."""
    response = httpx.post(f"{chat_server.url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "fixture-chat", "messages": [{"role": "user", "content": "trip"}]})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "<model 'fixture-chat'>/tokenizer_config.json's chat_template failed on these messages" in message, message
    assert str(chat_model) not in response.text and str(chat_model.parent) not in response.text


def test_a_default_max_tokens_past_the_context_says_it_was_the_default(server):
    model = server.client().models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as bad:
        server.client().completions.create(model=model, prompt=[7] * 250)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "max_tokens"
    assert "max_tokens 16 (OpenAI's default for completions: none was given) plus the prompt's 250" in bad.value.message
    with pytest.raises(openai.BadRequestError) as sent:
        server.client().completions.create(model=model, prompt=[7] * 250, max_tokens=16)
    assert "max_tokens 16 plus the prompt's 250" in sent.value.message


def test_max_completion_tokens_past_the_context_is_named_as_sent(chat_server):
    with pytest.raises(openai.BadRequestError) as bad:
        chat_server.client(KEY).chat.completions.create(model="fixture-chat", messages=[{"role": "user", "content": "hi"}],
                                                        max_completion_tokens=5000)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "max_completion_tokens"
    assert "max_completion_tokens 5000" in bad.value.message


def test_a_long_prompt_is_encoded_without_holding_the_server(chat_server):
    """A prompt of megabytes takes the tokenizer about a second; the server answers others meanwhile (it held the
    event loop, and every stream on it, for the whole encode)."""
    prompt = "hello world " * 400_000  # 4.8 MB, under the default 8 MiB limit; far past the context
    answer: list[httpx.Response] = []
    big = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{chat_server.url}/v1/completions", json={"model": "fixture-chat", "prompt": prompt, "max_tokens": 1},
        headers={"authorization": f"Bearer {KEY}"}, timeout=60)))
    start = time.monotonic()
    big.start()
    time.sleep(0.3)  # the body is sent and the encode under way
    asked = time.monotonic()
    assert chat_server.health()["status"] == "ok"
    health_s, big_running = time.monotonic() - asked, big.is_alive()
    big.join(60)
    big_s = time.monotonic() - start
    assert answer[0].status_code == 400 and answer[0].json()["error"]["code"] == "context_length_exceeded"
    if big_running:  # the health check ran during the encode: it was not held behind it
        assert health_s < max(0.5, (big_s - 0.3) / 3), (health_s, big_s)


# ---- hang-ups, a full queue, a storm ---------------------------------------------------------------------
def test_hanging_up_cancels_the_request_at_once(server):
    model = server.client().models.list().data[0].id
    before = server.metrics()
    stream = server.client().completions.create(model=model, prompt="hello", max_tokens=240, temperature=0, stream=True)
    for _, _chunk in zip(range(2), stream):
        pass
    stream.close()  # the connection goes: 240 tokens would take seconds more
    server.wait_idle(within_s=5)
    with pytest.raises(httpx.TimeoutException):  # unstreamed: the client gives up before the answer
        httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 240}, timeout=0.5)
    server.wait_idle(within_s=5)
    after = server.metrics()
    assert after['specter_requests_finished_total{reason="cancelled"}'] - before.get(
        'specter_requests_finished_total{reason="cancelled"}', 0) == 2
    assert after["specter_generation_tokens_total"] - before["specter_generation_tokens_total"] < 2 * 240
    assert server.health()["held_slots"] == 0


def test_a_full_queue_answers_429_with_retry_after(chat_server):
    client = chat_server.client(KEY)
    messages = [{"role": "user", "content": "hello"}]
    running = client.chat.completions.create(model="fixture-chat", messages=messages, max_tokens=200, stream=True)
    next(iter(running))  # holds the engine
    waiting = client.chat.completions.create(model="fixture-chat", messages=messages, max_tokens=4, stream=True)
    try:
        assert chat_server.health()["queue_depth"] == 1
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="fixture-chat", messages=messages, max_tokens=4)
        retry_after = refused.value.response.headers["retry-after"]
        assert retry_after.isdigit() and 1 <= int(retry_after) <= 60  # whole seconds, at most a minute
        assert refused.value.code == "queue_full"
        assert f"retry after {retry_after} s" in refused.value.response.json()["error"]["message"]  # the body says it too
    finally:
        running.close()
        waiting.close()
    chat_server.wait_idle(within_s=5)
    answer = client.chat.completions.create(model="fixture-chat", messages=messages, max_tokens=2)
    assert answer.choices[0].finish_reason == "length"


STORM_PROMPTS = [("hello world", {}), ("the draft proposes", {}), ([5, 17, 300, 42], {}), ("café 🙂", {}),
                 ("once upon a time", {"temperature": 0.8, "seed": 3}), ("experts", {"temperature": 1.0, "seed": 9}),
                 ("memory budget", {"temperature": 0.7, "top_p": 0.9, "seed": 1}), ("a b c", {"temperature": 0.0})]
STORM_TOKENS = 6


async def storm(server: LiveServer, streams: int, hang_up_every: int = 0) -> list[tuple[int, str | None]]:
    """`streams` concurrent streamed completions; every `hang_up_every`-th hangs up after its first chunk and every
    7th after 50 ms (before its first chunk while it queues). Returns (prompt index, text or None if hung up)."""
    async with server.async_client() as client:
        model = (await client.models.list()).data[0].id

        async def one(i: int) -> tuple[int, str | None]:
            prompt, params = STORM_PROMPTS[i % len(STORM_PROMPTS)]
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=STORM_TOKENS, stream=True,
                                                     **({"temperature": 0} | params))
            if hang_up_every and i % 7 == 3:
                await asyncio.sleep(0.05)
                await stream.close()
                return i, None
            texts = []
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
                if hang_up_every and i % hang_up_every == 1:
                    await stream.close()
                    return i, None
            return i, "".join(texts)

        return await asyncio.gather(*(one(i) for i in range(streams)))


def test_storm_of_streams_with_hang_ups_leaks_nothing(server, reference):
    solo = [reference.complete(prompt, max_new_tokens=STORM_TOKENS, **({"temperature": 0} | params)).text
            for prompt, params in STORM_PROMPTS]
    asyncio.run(storm(server, 12, hang_up_every=4))  # warm-up: lazily made threads and buffers exist before the baseline
    server.wait_idle(within_s=30)
    baseline, tasks_before, before = proc_usage(server.pid), server.health()["tasks"], server.metrics()

    results = asyncio.run(storm(server, 40, hang_up_every=4))
    server.wait_idle(within_s=30)
    finished = [(i, text) for i, text in results if text is not None]
    assert len(finished) >= 25
    assert all(text == solo[i % len(STORM_PROMPTS)] for i, text in finished), "a stream differs from its solo answer"

    time.sleep(0.5)  # closed connections reach the server's loop
    after, health = proc_usage(server.pid), server.health()
    assert health["held_slots"] == 0 and health["tasks"] <= tasks_before
    assert after["threads"] <= baseline["threads"] + 1
    assert after["fds"] <= baseline["fds"] + 2
    assert after["rss"] <= baseline["rss"] + 48 * 2**20, (baseline, after)

    metrics = server.metrics()
    new = {name: metrics[name] - before.get(name, 0) for name in metrics}
    assert new["specter_time_to_first_token_seconds_count"] >= len(finished)
    assert new["specter_time_per_output_token_seconds_count"] >= len(finished)
    assert new['specter_requests_finished_total{reason="length"}'] == len(finished)
    assert new['specter_requests_finished_total{reason="cancelled"}'] >= 40 - len(finished) - 2  # unstarted ones may slip
    assert new['specter_http_responses_total{endpoint="/v1/completions",status="200"}'] == 40
    assert new["specter_draft_tokens_total"] > 0 and new["specter_h2d_bytes_total"] > 0
    assert 0 < metrics["specter_acceptance_rate"] <= 1 and metrics["specter_mean_accepted_length"] >= 1
    assert 0 < metrics["specter_expert_hit_rate"] <= 1 and metrics["specter_h2d_bytes_per_token"] > 0
    assert metrics["specter_stall_seconds_total"] >= 0 and metrics["specter_queue_depth"] == 0
    assert metrics["specter_requests_running"] == 0 and metrics["specter_expert_slots_held"] == 0


# ---- shutdown ---------------------------------------------------------------------------------------------
def read_events(url: str, body: dict, first_chunk: threading.Event, out: list) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(line.removeprefix("data: "))
                first_chunk.set()


def test_sigterm_drains_streams_then_exits(tiny, reference):
    live = LiveServer(tiny)
    try:
        lengths = (48, 24)  # the first runs while the second waits for the engine
        expected = [reference.complete("hello world", max_new_tokens=n, temperature=0).text for n in lengths]
        outs: list[list[str]] = [[], []]
        started = [threading.Event(), threading.Event()]
        readers = [threading.Thread(target=read_events, args=(live.url, {"model": str(tiny), "prompt": "hello world",
                                                                         "max_tokens": n, "temperature": 0, "stream": True},
                                                              started[i], outs[i]), daemon=True)
                   for i, n in enumerate(lengths)]
        readers[0].start()
        assert started[0].wait(30)
        readers[1].start()
        deadline = time.monotonic() + 10
        while live.health()["queue_depth"] < 1 and not started[1].is_set():  # the second is admitted (or already runs)
            assert time.monotonic() < deadline, live.health()
            time.sleep(0.005)
        live.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(f"{live.url}/health", timeout=5)
        for reader in readers:
            reader.join(60)
        assert live.process.wait(60) == 0, "".join(live.log)
        for out, text in zip(outs, expected):
            assert out[-1] == "[DONE]"
            assert "".join(json.loads(event)["choices"][0]["text"] for event in out[:-1]) == text
        assert not any("Traceback" in line for line in live.log), "".join(live.log)
    finally:
        live.stop()


def test_past_the_drain_timeout_requests_end_with_503_and_an_error_event(tiny):
    """SIGTERM with requests longer than --drain-timeout: the stream ends with an OpenAI error event, the queued
    answer is a JSON 503, the process exits 0 and logs no traceback (uvicorn's own timeout cancelled the tasks:
    a plain-text 500 and a cut stream)."""
    live = LiveServer(tiny, "--drain-timeout", "0.3")
    try:
        events: list[str] = []
        started = threading.Event()
        streamer = threading.Thread(target=read_events, args=(live.url, {"model": str(tiny), "prompt": "hello world",
                                                                         "max_tokens": 240, "temperature": 0,
                                                                         "stream": True}, started, events), daemon=True)
        streamer.start()
        assert started.wait(30)
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(httpx.post(
            f"{live.url}/v1/completions", json={"model": str(tiny), "prompt": "hi", "max_tokens": 200}, timeout=60)),
            daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while live.health()["queue_depth"] < 1:
            assert time.monotonic() < deadline, live.health()
            time.sleep(0.005)
        live.process.send_signal(signal.SIGTERM)
        streamer.join(60)
        waiter.join(60)
        assert live.process.wait(60) == 0, "".join(live.log)
        last = json.loads(events[-1])
        assert last["error"]["type"] == "server_error" and "shutting down" in last["error"]["message"], events[-3:]
        assert queued[0].status_code == 503 and queued[0].headers["content-type"] == "application/json"
        assert queued[0].json()["error"]["type"] == "server_error"
        for message in (last["error"]["message"], queued[0].json()["error"]["message"]):  # not the Python API's advice
            assert "from_pretrained" not in message, message
        assert not any("Traceback" in line for line in live.log), "".join(live.log)
    finally:
        live.stop()


# ---- the command line and the load generator ---------------------------------------------------------------
def test_serve_refuses_a_checkpoint_without_a_tokenizer_before_loading(tiny, tmp_path, monkeypatch, capsys):
    """Every answer is text: a server on a checkpoint without tokenizer.json answered empty strings."""
    from specter.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the checkpoint's tokenizer was checked")

    monkeypatch.setattr("specter.api.Engine.load", no_load)
    ids_only = shutil.copytree(tiny, tmp_path / "ids-only")
    (ids_only / "tokenizer.json").unlink()
    assert main(["serve", "--model", str(ids_only), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json, and every answer of the server is text" in err and err.count("\n") == 1, err


def test_serve_takes_generate_engine_options():
    from specter.cli import build_parser, engine_config
    from specter.server.cli import engine_args

    args = build_parser().parse_args(["serve", "--budget", "1GiB", "--k", "2", "--quant", "int8", "--link", "gen4",
                                      "--eviction", "lru", "--sampling", "rejection", "--max-queue", "3"])
    config = engine_config(engine_args(args))
    assert (config.budget, config.draft.k, config.draft.quant, config.link, config.eviction, config.draft.sampling) == (
        2**30, 2, "int8", "gen4", "lru", "rejection")
    assert (args.host, args.max_queue) == ("127.0.0.1", 3)
    for bad in (["--max-queue", "-1"], ["--port", "70000"], ["--port", "-1"], ["--drain-timeout", "-5"]):
        with pytest.raises(SystemExit):  # argparse's exit 2 with the rule, before any model loads
            build_parser().parse_args(["serve", *bad])
    sizes = {"65536": 65536, "8MiB": 8 * 2**20, "1KiB": 1024}  # as --budget takes sizes; a bare number is bytes
    assert {text: build_parser().parse_args(["serve", "--max-body-bytes", text]).max_body_bytes for text in sizes} == sizes


@pytest.mark.parametrize("option, value, says", [
    ("--host", "", "--host: must not be empty or blank; leave --host out for loopback only"),  # an unset $HOST: not
    ("--host", " ", "--host: must not be empty"),  # every interface with no word said
    ("--served-model-name", "", "--served-model-name: must not be empty"),
    ("--port", "abc", "--port: expected a TCP port, a whole number from 0 to 65535, got 'abc'"),  # was "invalid _port value"
    ("--max-queue", "x", "--max-queue: expected a whole number 0 or more, got 'x'"),
    ("--drain-timeout", "soon", "--drain-timeout: expected seconds (a number 0 or more), got 'soon'"),
    ("--max-body-bytes", "8MB!", "--max-body-bytes: '8MB!' is not a size"),
    ("--max-body-bytes", "0", "--max-body-bytes: must be 1 byte or more, got 0"),
])
def test_serve_options_name_what_was_wrong(option, value, says, capsys):
    from specter.cli import build_parser

    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", option, value])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and says in err and "_port" not in err and "_positive" not in err, err


def test_serve_load_benchmark_against_a_running_server(server, tmp_path):
    out = tmp_path / "load.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", server.url, "--concurrency", "1", "3",
               "--requests", "1", "--max-tokens", "3", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert [level["clients"] for level in results["levels"]] == [1, 3]
    assert all(level["tokens"] == 3 * level["requests"] and level["tokens_per_s"] > 0 for level in results["levels"])
    assert "TTFT p50 ms" in done.stdout


def run_releasing(main, state, release: threading.Event) -> None:
    """Run an encoder test's `main`, then release its held encodes and stop the state's two encoder threads."""
    try:
        asyncio.run(main())
    finally:
        release.set()
        state.encoder.shutdown()
        state.long_encoder.shutdown()


def test_text_prompts_wait_for_the_encoder_in_a_bounded_line_and_token_ids_skip_it():
    """The encoder thread sits before admission: without a bound, every connection's body would be read and held while
    it waited there, past --max-queue. As many may wait as for the engine; one more is a 429."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from specter.server.admission import AdmissionQueue
    from specter.server.app import _encode
    from specter.server.protocol import APIRequestError

    release = threading.Event()
    encoded: list[object] = []

    def encode(prompt):
        encoded.append(prompt)
        if isinstance(prompt, str):
            release.wait(10)
            return [1, 2]
        return list(prompt)

    engine = SimpleNamespace(encode=encode, spec=SimpleNamespace(vocab_size=100))
    state = SimpleNamespace(engine=engine, queue=AdmissionQueue(1), encoder=ThreadPoolExecutor(1),
                            long_encoder=ThreadPoolExecutor(1), encoding=0, max_context=256)

    async def main():
        first = asyncio.ensure_future(_encode(state, "a long text", "prompt"))
        second = asyncio.ensure_future(_encode(state, "another", "prompt"))
        await asyncio.sleep(0.05)
        with pytest.raises(APIRequestError) as busy:
            await _encode(state, "one too many", "prompt")
        assert busy.value.status == 429 and busy.value.code == "queue_full"
        assert await _encode(state, [3, 4], "prompt") == [3, 4]  # ids need no tokenizer: not behind the texts
        release.set()
        assert await first == [1, 2] and await second == [1, 2]
        assert state.encoding == 0

    run_releasing(main, state, release)
    assert "one too many" not in encoded


def test_the_queue_holds_one_running_and_max_queue_waiting_even_before_the_first_takes_its_turn():
    """A ticket admitted to an idle engine counts as waiting until its task takes the turn (a stream's only when its
    response starts): two requests arriving together at an idle server with --max-queue 1 both fit (the second got
    a 429), a third does not; with --max-queue 0 only one is in flight."""
    from specter.server.admission import AdmissionQueue, QueueFull

    async def main():
        queue = AdmissionQueue(1)
        first, second = queue.admit(), queue.admit()  # neither has taken the turn yet
        with pytest.raises(QueueFull) as full:
            queue.admit()
        assert full.value.waiting == 1
        async with first:
            with pytest.raises(QueueFull):
                queue.admit()
        async with second:
            third = queue.admit()  # the first is done: a place is free
        third.close()
        assert (queue.waiting, queue.running) == (0, 0)
        alone = AdmissionQueue(0)
        ticket = alone.admit()
        with pytest.raises(QueueFull):
            alone.admit()
        ticket.close()
        alone.admit().close()

    asyncio.run(main())


def test_retry_after_follows_how_long_requests_held_the_turn(monkeypatch):
    """Retry-After is about one service time: a moving average of how long each request held the engine, whole
    seconds rounded up, 1 at least and 60 at most; it starts at 1 s."""
    from specter.server import admission
    from specter.server.admission import AdmissionQueue, QueueFull

    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    queue = AdmissionQueue(0)

    def retry_after() -> int:
        held = queue.admit()
        with pytest.raises(QueueFull) as full:
            queue.admit()
        held.close()
        return full.value.retry_after_s

    async def serve(seconds: float) -> None:
        async with queue.admit():
            clock[0] += seconds

    async def main() -> list[int]:
        seen = [retry_after()]
        await serve(10.0)  # 0.8 * 1 + 0.2 * 10 = 2.8 s
        seen.append(retry_after())
        for _ in range(20):
            await serve(10.0)
        seen.append(retry_after())  # about 10 s
        for _ in range(40):
            await serve(0.01)
        seen.append(retry_after())  # fast requests again: never below 1
        for _ in range(40):
            await serve(1000.0)
        seen.append(retry_after())  # capped at a minute
        return seen

    assert asyncio.run(main()) == [1, 3, 10, 1, 60]


def test_a_request_cancelled_while_it_waits_gives_its_place_back():
    from specter.server.admission import AdmissionQueue, QueueFull

    async def main():
        queue = AdmissionQueue(1)
        running = queue.admit()
        await running.__aenter__()
        waiter = queue.admit()
        entered = asyncio.Event()

        async def wait_for_turn():
            entered.set()
            async with waiter:
                pytest.fail("the turn is held: the waiter must not get it")

        task = asyncio.ensure_future(wait_for_turn())
        await entered.wait()
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):  # one running, one waiting: full
            queue.admit()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (queue.waiting, queue.running) == (0, 1)
        after = queue.admit()  # the cancelled waiter's place is free again
        await running.__aexit__(None, None, None)
        async with after:
            assert (queue.waiting, queue.running) == (0, 1)
        assert (queue.waiting, queue.running) == (0, 0)

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_short_text_prompt_is_not_encoded_behind_a_long_one():
    """Long texts (past GIL_FREE_CHARS) have their own encoder thread: seconds of tokenizing a megabyte, which the
    context check may then refuse, hold up no short prompt."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from specter.server.admission import AdmissionQueue
    from specter.server.app import _encode
    from specter.tokenizer import GIL_FREE_CHARS

    release = threading.Event()

    def encode(prompt):
        if len(prompt if isinstance(prompt, str) else prompt[0]["content"]) > GIL_FREE_CHARS:
            release.wait(10)
        return [1, 2]

    engine = SimpleNamespace(encode=encode, spec=SimpleNamespace(vocab_size=100))
    state = SimpleNamespace(engine=engine, queue=AdmissionQueue(4), encoder=ThreadPoolExecutor(1),
                            long_encoder=ThreadPoolExecutor(1), encoding=0)

    async def main():
        long_text = asyncio.ensure_future(_encode(state, "x" * (GIL_FREE_CHARS + 1), "prompt"))
        long_chat = asyncio.ensure_future(_encode(state, [{"role": "user", "content": "y" * (GIL_FREE_CHARS + 1)}],
                                                  "messages"))
        await asyncio.sleep(0.05)
        assert await asyncio.wait_for(_encode(state, "short", "prompt"), 5) == [1, 2]
        assert await asyncio.wait_for(_encode(state, [{"role": "user", "content": "hi"}], "messages"), 5) == [1, 2]
        assert not long_text.done() and not long_chat.done()
        release.set()
        assert await long_text == [1, 2] and await long_chat == [1, 2]

    run_releasing(main, state, release)


def test_the_port_probe_takes_an_empty_host_and_names_a_bad_one():
    from specter.errors import ConfigError
    from specter.server.cli import check_address

    check_address("", 0)  # all interfaces, as uvicorn reads it
    with pytest.raises(ConfigError, match="cannot listen on"):
        check_address("x" * 70 + ".example", 8000)  # too long a label for IDNA: a UnicodeError


@pytest.mark.parametrize("error, status", [("PluginError", 500), ("RequestCancelled", 503), ("EngineClosed", 503)])
def test_a_request_the_engine_ended_is_500_for_a_plugins_failure_and_503_otherwise(error, status):
    """A policy plug-in that raised mid-request was a 503, 'try again later', where sent again it fails again: the
    server's defect, a 500; the engine's closing stays a 503. The served model is named, not the checkpoint's path."""
    from types import SimpleNamespace

    from specter import errors
    from specter.server.app import _ended

    cause = getattr(errors, error, None) or type(error, (errors.SpecterError,), {})
    state = SimpleNamespace(model_name="served", engine=SimpleNamespace(tokenizer=SimpleNamespace(source="/srv/ckpt")))
    answer = _ended(state, cause("eviction plug-in 'x' (dist y): victims() raised in /srv/ckpt"))
    assert answer.status == status and answer.body()["error"]["type"] == "server_error"
    assert ("/srv/ckpt" not in answer.message) and (error == "RequestCancelled" or "<model 'served'>" in answer.message)


def test_a_client_that_stops_reading_its_stream_does_not_hold_the_engine():
    """A streamed answer's writes block while the client reads nothing (its socket full): the request held the
    engine's turn until the client read, so every request behind it waited (20 s and more, for as long as the client
    stayed). The events now drain into a buffer: the turn ends with the generation; a hang-up still cancels it."""
    from specter.server.admission import AdmissionQueue
    from specter.server.asgi import EventStream

    queue = AdmissionQueue(4)
    generated: list[int] = []
    gone = asyncio.Event()

    async def events(ticket, count):
        async with ticket:  # the engine's turn, as app._pieces holds it
            for index in range(count):
                generated.append(index)
                await asyncio.sleep(0)
                yield f"data: {index}\n\n".encode()

    async def stalled_send(message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client never reads

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def main():
        first = queue.admit()
        stalled = asyncio.ensure_future(EventStream(events(first, 50), first)({"path": "/v1/completions"}, receive, stalled_send))
        second = queue.admit()
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(EventStream(events(second, 3), second)({"path": "/v1/completions"}, receive, send), 5)
        assert [m.get("body") for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
        assert generated.count(49) == 1 and not stalled.done()  # the first generated all of its answer meanwhile
        gone.set()  # it hangs up: its stream ends
        await asyncio.wait_for(stalled, 5)
        assert (queue.waiting, queue.running) == (0, 0)

    asyncio.run(main())


def test_a_hang_up_mid_generation_cancels_the_drawing_of_events():
    from specter.server.admission import AdmissionQueue
    from specter.server.asgi import EventStream

    queue = AdmissionQueue(1)
    drawn, closed = [], []
    gone = asyncio.Event()

    async def events(ticket):
        try:
            async with ticket:
                for index in range(10_000):
                    drawn.append(index)
                    if index == 5:
                        gone.set()
                    await asyncio.sleep(0.001)
                    yield b"data: x\n\n"
        finally:
            closed.append(True)

    async def send(message):
        pass

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def main():
        ticket = queue.admit()
        await asyncio.wait_for(EventStream(events(ticket), ticket)({"path": "/v1/completions"}, receive, send), 5)
        assert closed == [True] and len(drawn) < 100 and (queue.waiting, queue.running) == (0, 0)

    asyncio.run(main())


class _FailingEngine:
    """An engine that admits a token-id prompt and fails inside its generation (a CUDA error, a lost file)."""

    def __init__(self, error: BaseException) -> None:
        from types import SimpleNamespace

        self.error = error
        self.config = SimpleNamespace(max_context=64)
        self.spec = SimpleNamespace(max_position=64, vocab_size=100)
        self.tokenizer = SimpleNamespace(source="/srv/ckpt")

    def encode(self, prompt):
        return list(prompt)

    def generate(self, prompt_ids, generation):
        error = self.error

        class Failing:
            async def __aenter__(self):
                raise error

            async def __aexit__(self, *exc_info):
                return False

        return Failing()


@pytest.mark.parametrize("error", [RuntimeError("boom"), OSError(5, "Input/output error")])
def test_an_unexpected_engine_error_is_a_logged_openai_500_streamed_or_not(error):
    """Unstreamed, Starlette's own plain-text 'Internal Server Error' answered; an engine's OSError was taken for the
    client's hang-up (counted 499, its cause never logged)."""
    from structlog.testing import capture_logs

    from specter.server.app import create_app

    app = create_app(_FailingEngine(error), model_name="m")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            whole = await client.post("/v1/completions", json=body)
            streamed = await client.post("/v1/completions", json=body | {"stream": True})
        return whole, streamed, app.metrics.render({})

    with capture_logs() as logs:
        whole, streamed, metrics = asyncio.run(main())
    assert whole.status_code == 500 and whole.headers["content-type"] == "application/json"
    assert whole.json()["error"]["type"] == "server_error" and "logged the cause" in whole.json()["error"]["message"]
    assert '"server_error"' in streamed.text and streamed.text.rstrip().endswith("}")
    assert [entry["event"] for entry in logs].count("server.internal_error") == 1  # the unstreamed one, once
    assert any(entry["event"] == "server.stream_failed" for entry in logs)
    assert 'status="500"' in metrics and 'status="499"' not in metrics
