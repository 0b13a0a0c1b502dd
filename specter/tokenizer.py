"""Text in and out: a checkpoint's `tokenizer.json` (through `tokenizers`), its chat template, and
incremental detokenization that never releases half a character and stops at stop strings."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from specter.errors import CheckpointError, ConfigError, PromptError, SpecterError, unreadable
from specter.paths import json_value

TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


GIL_FREE_CHARS = 1 << 16
"""Texts longer than this are encoded by `encode_batch_fast` (or `encode_batch`), which releases the GIL while it
works (`encode` holds it: a megabyte takes about a second), so a server thread encoding a long prompt leaves the event
loop its turns; the ids are the same. Short texts keep `encode`, which sets no parallelism flag (a batch marks the process as having used
its thread pool, which a later fork warns about)."""


class Tokenizer:
    """A fast tokenizer plus what the checkpoint directory says about it (special tokens, chat template)."""

    def __init__(self, backend: Any, *, chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None,
                 source: str = "<memory>", template_source: str | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.source = source
        self.template_source = template_source or f"the chat template of the tokenizer at {source}"  # for its errors

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        path = Path(path)
        try:
            if not (path / TOKENIZER_FILE).is_file():
                return None
            settings = _read_json(path / "tokenizer_config.json")
            template, template_source = _chat_template(path, settings)
            backend = _load_backend(path / TOKENIZER_FILE)
        except OSError as error:  # most often permissions: the directory or a file not readable by this user
            raise unreadable(Path(error.filename or path), error) from None
        special = {key: _token_text(settings.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(backend, chat_template=template, special_tokens={key: text for key, text in special.items() if text},
                   source=str(path), template_source=template_source)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text, "the prompt text")
        try:
            if len(text) > GIL_FREE_CHARS:
                # encode_batch_fast (tokenizers 0.20+) keeps no character offsets: the same ids, and an encoding that
                # is quicker to make and to free (freeing it holds the GIL, and with it the server's event loop)
                encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
                return list(encode([text], add_special_tokens=add_special_tokens)[0].ids)
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as error:  # the tokenizers library raises a bare Exception: a tokenizer.json that loads but
            # cannot encode (a vocabulary without the unknown token it needs, say) is the checkpoint's fault
            raise CheckpointError(f"the tokenizer at {self.source} cannot encode this text ({error}); fix its "
                                  f"{TOKENIZER_FILE}, or give the prompt as token ids") from error

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError, ValueError) as error:  # not a sequence of non-negative ints
            raise PromptError(f"cannot decode {_shown(token_ids)}: token ids are a sequence of ints from 0 ({error})") from None

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the checkpoint's chat template (jinja2)."""
        if self.chat_template is None:
            raise ConfigError(f"the tokenizer at {self.source} has no chat template (tokenizer_config.json `chat_template`); "
                              "pass the prompt as text or token ids instead of messages")
        for index, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(value, f"chat message {index}'s {key!r}")
        environment = _jinja_environment()
        from jinja2 import TemplateSyntaxError

        try:
            template = environment.from_string(self.chat_template)
        except TemplateSyntaxError as error:
            raise PromptError(f"{self.template_source} is not a valid jinja template (line {error.lineno}: {error.message}); "
                              "fix the template, or pass the prompt as text or token ids instead of messages") from None
        try:
            text = template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except SpecterError:
            raise  # the template's own raise_exception: its message already says why
        except Exception as error:  # the template is code from the checkpoint; whatever it trips on is its failure
            raise PromptError(f"{self.template_source} failed on these messages ({type(error).__name__}: {error}); "
                              "fix the template or the messages, or pass the prompt as text or token ids") from None
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # the messages were checked above: the template wrote it
            raise PromptError(f"{self.template_source} rendered text that is not valid Unicode (character "
                              f"{error.start} is U+{ord(text[error.start]):04X}, a lone surrogate, from the template "
                              "itself); fix the template, or pass the prompt as text or token ids") from None
        return text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes the special tokens itself (BOS included), so the tokenizer must not add them again.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def within(self, ids: list[int], vocab_size: int) -> list[int]:
        """`ids` this tokenizer gave for a text, refused where the model has no embedding row for one: the message
        names the mismatch between tokenizer and checkpoint, not the user's text."""
        beyond = sorted({token for token in ids if token >= vocab_size})
        if beyond:
            raise PromptError(f"the tokenizer at {self.source} gave token ids {beyond[:5]} for this text, beyond the "
                              f"model's vocabulary 0..{vocab_size - 1} (config.json vocab_size): the tokenizer does "
                              "not match the checkpoint's embeddings; use the checkpoint's own tokenizer.json, or "
                              "avoid the tokens it has beyond the model's (often added special tokens)")
        return ids

    def detokenizer(self, stop_strings: Iterable[str] = (), context: Sequence[int] = ()) -> Detokenizer:
        return Detokenizer(self, stop_strings, context)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_text(text: str, what: str, instead: str = ", or the prompt as token ids") -> None:
    """Refuse text that is not valid Unicode (lone surrogates, which is what Python makes of bytes that are not
    UTF-8 in command-line arguments and file names), naming the character's position: a tokenizer cannot encode it."""
    if not isinstance(text, str):
        raise PromptError(f"{what} must be a str, got {type(text).__name__}; decode bytes first (data.decode('utf-8'))")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        origin = f", which stands for the byte 0x{code - 0xDC00:02X} that is not UTF-8" if 0xDC80 <= code <= 0xDCFF else ""
        raise PromptError(f"{what} is not valid Unicode: character {error.start} is U+{code:04X}, a lone surrogate{origin}; "
                          f"give the text as UTF-8 (check the terminal's or the file's encoding){instead}") from None


CONTEXT_TOKENS = 6
"""Prompt ids a detokenizer decodes its first new tokens after: enough for any decoder's look-back (a SentencePiece
space, a byte-level character of up to 4 tokens), few enough to cost nothing."""


class Detokenizer:
    """Turns committed token ids into text pieces as they arrive.

    A piece never ends inside a character: when the bytes so far end with an incomplete UTF-8 sequence
    (byte-level BPE splits characters across tokens), the text waits for the next token. With stop
    strings, the last `len(longest stop) - 1` characters are held back too, so that text before a stop
    string is never released past it; once a stop string appears, the text is cut just before it and
    `stopped` is set. `finish()` releases what is left. The pieces joined equal `text`.

    `context`: the prompt's ids, of which the last `CONTEXT_TOKENS` are decoded before the first new token and never
    released, so that the new text continues the prompt's as the whole sequence decodes (prompt + text ==
    decode(prompt + tokens)): a SentencePiece decoder (Metaspace: Mixtral's, Phi's) strips a leading space from text
    that starts at a token, which dropped the space between a prompt and its continuation. A context whose text
    ends inside a character is left out (its character is split between prompt and answer).
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: Iterable[str] = (), context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        context = list(context)[-CONTEXT_TOKENS:]
        if context and tokenizer.decode(context).endswith(REPLACEMENT):
            context = []
        self.token_ids: list[int] = context  # the context's ids, then the new ones
        self._prefix_offset = 0  # decoding restarts here, so decoders that strip a leading space see context
        self._read_offset = len(context)  # tokens before this are in `_decoded` (or are the context)
        self._decoded = ""  # complete text decoded so far (cut at a stop string)
        self._released = 0  # characters of `_decoded` handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._decoded[: self._released]

    def push(self, token_ids: Sequence[int]) -> str:
        """Add committed tokens; return the text that is now safe to release (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        self._append(self._complete_new_text())
        return self._release(len(self._decoded) if self.stopped else len(self._decoded) - self._hold)

    def finish(self) -> str:
        """The end of generation: release everything, including a last incomplete character (as U+FFFD)."""
        if not self.stopped:
            self._append(self._new_text(allow_incomplete=True))
        return self._release(len(self._decoded))

    def _complete_new_text(self) -> str:
        return self._new_text(allow_incomplete=False)

    def _new_text(self, allow_incomplete: bool) -> str:
        window = self.token_ids[self._prefix_offset:]
        before = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(window)
        if len(full) <= len(before):
            return ""
        if full.endswith(REPLACEMENT) and not allow_incomplete:
            self._stop_before_incomplete(full[len(before):].rstrip(REPLACEMENT))
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return full[len(before):]

    def _stop_before_incomplete(self, complete: str) -> None:
        """The new text ends inside a character and waits for it, but a stop string may already stand whole in its
        `complete` part before that character: cut there now, not a token or more later (when the text may have hit
        its token limit and would end as 'length', with a token past the stop counted). Without a stop the part stays
        unread, to be decoded whole with its character."""
        if complete and _first_stop(self._decoded + complete, self.stop_strings, self._search_from()) is not None:
            self._append(complete)

    def _search_from(self) -> int:
        """Where a stop string in text added now could begin: it may straddle the old text and the new."""
        return max(0, len(self._decoded) - self._hold)

    def _append(self, new_text: str) -> None:
        if not new_text:
            return
        search_from = self._search_from()
        self._decoded += new_text
        cut = _first_stop(self._decoded, self.stop_strings, search_from)
        if cut is not None:
            self._decoded = self._decoded[:cut]
            self.stopped = True

    def _release(self, upto: int) -> str:
        upto = max(upto, self._released)
        piece = self._decoded[self._released : upto]
        self._released = upto
        return piece


def _first_stop(text: str, stop_strings: Sequence[str], start: int) -> int | None:
    found = [index for stop in stop_strings if (index := text.find(stop, start)) != -1]
    return min(found) if found else None


def _load_backend(file: Path) -> Any:
    tokenizers = _require_tokenizers()
    with file.open("rb"):  # an unreadable file is an OSError here, not the library's vaguer message
        pass
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception for malformed files
        raise CheckpointError(f"{file}: cannot read the tokenizer ({exc}); the file must be a Hugging Face tokenizer.json") from exc


def _require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("text prompts need the `tokenizers` package; install it (pip install tokenizers) "
                          "or pass prompts as token ids") from None
    return tokenizers


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        settings = json_value(file.read_text())
    except ValueError as exc:  # not JSON, not UTF-8, nested too deeply
        raise CheckpointError(f"{file}: not valid JSON ({exc}); fix or remove the file") from exc
    if not isinstance(settings, dict):
        raise CheckpointError(f"{file}: expected a JSON object at the top level, got {type(settings).__name__}; fix or remove the file")
    return settings


def _chat_template(path: Path, settings: Mapping[str, Any]) -> tuple[str | None, str]:
    """`chat_template.jinja` when present, else tokenizer_config.json's `chat_template` (a string, or named list);
    with where it came from, for its errors."""
    file = path / "chat_template.jinja"
    if file.is_file():
        try:
            return file.read_bytes().decode("utf-8"), str(file)
        except UnicodeDecodeError as error:
            raise CheckpointError(f"{file}: not UTF-8 text ({error}); save the template as UTF-8, or remove the file "
                                  "to use tokenizer_config.json's chat_template") from None
    template = settings.get("chat_template")
    source = f"{path / 'tokenizer_config.json'}'s chat_template"
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default") or next(iter(named.values()), None)
        if template is not None and not isinstance(template, str) or (template is None and settings["chat_template"]):
            raise CheckpointError(f"{source} is a list without a template string: each entry is "
                                  "{\"name\": ..., \"template\": \"...\"}; fix it, or remove it to serve without chat")
    elif template is not None and not isinstance(template, str):  # it would read as no template at all
        raise CheckpointError(f"{source} is {type(template).__name__} {str(template)[:40]!r}, not a template string; "
                              "fix it, or remove it to serve without chat")
    return template, source


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _jinja_environment() -> Any:
    """The environment transformers renders chat templates in (its `_compile_jinja_template`), so templates render
    identically: its settings, the loop controls ({% break %}, {% continue %}), the {% generation %} block (rendered as
    its body; transformers only notes where it falls), `strftime_now(format)`, and its `tojson` (not HTML-escaped,
    non-ASCII kept, keys in their order, with indent and separators)."""
    try:
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat templates need the `jinja2` package; install it (pip install jinja2) "
                          "or pass the prompt as text or token ids") from None

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: marks an assistant's text for training masks; renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:  # templates call this to refuse a conversation
        raise ConfigError(f"the chat template refused the messages: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:  # templates that date the system prompt (Llama 3's "Today Date")
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = ()) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` (deterministic for the same input)."""
    tokenizers = _require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer
