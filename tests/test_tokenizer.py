"""Tokenizer: checkpoint files, chat template, incremental detokenization (no broken characters), stop strings."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specter.builtin import TOKENIZER_TEXT, builtin_path, write_builtin
from specter.errors import CheckpointError, ConfigError
from specter.tokenizer import REPLACEMENT, Tokenizer, train_byte_level_bpe

MULTIBYTE = "café 日本語のテキスト 🙂🚀 smörgåsbord Ελληνικά ∑≈ hello world"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    loaded = Tokenizer.from_dir(builtin_path("tiny"))
    assert loaded is not None
    return loaded


def stream(tokenizer: Tokenizer, ids: list[int], stop_strings: tuple[str, ...] = (),
           context: list[int] | None = None) -> tuple[list[str], str, bool]:
    """Push ids one at a time; return the pieces (the last from finish()), their join and whether it stopped."""
    detokenizer = tokenizer.detokenizer(stop_strings, context or ())
    pieces = [detokenizer.push([token]) for token in ids]
    pieces.append(detokenizer.finish())
    assert "".join(pieces) == detokenizer.text
    return pieces, detokenizer.text, detokenizer.stopped


def test_builtin_tokens_split_characters(tokenizer):
    """The premise of the next tests: some single tokens decode to half a character."""
    ids = tokenizer.encode(MULTIBYTE)
    assert tokenizer.decode(ids) == MULTIBYTE
    assert any(REPLACEMENT in tokenizer.decode([token]) for token in ids)


def test_pieces_never_hold_broken_characters(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    pieces, text, stopped = stream(tokenizer, ids)
    assert text == MULTIBYTE and not stopped
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert sum(1 for piece in pieces if piece) > 5  # released as it goes, not all at the end


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab é日本🙂Ωж\n.,")), min_size=1, max_size=30))
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, joined, _ = stream(tokenizer, ids)
    assert joined == tokenizer.decode(ids) == text
    assert all(REPLACEMENT not in piece for piece in pieces)


def test_invalid_bytes_are_released_at_the_end(tokenizer):
    """A lone lead byte never completes: it is held back mid-stream and shown as U+FFFD by finish()."""
    lead_only = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == REPLACEMENT)
    ids = tokenizer.encode("ok ") + [lead_only]
    pieces, text, _ = stream(tokenizer, ids)
    assert REPLACEMENT not in "".join(pieces[:-1])
    assert text == tokenizer.decode(ids) and text.endswith(REPLACEMENT)


def test_stop_string_cuts_before_it_even_across_tokens(tokenizer):
    ids = tokenizer.encode("the draft proposes tokens and the target verifies them")
    pieces, text, stopped = stream(tokenizer, ids, stop_strings=("the target", "zzz"))
    assert stopped and text == "the draft proposes tokens and "
    assert all("the target" not in piece for piece in pieces)


def test_a_stop_string_before_a_split_character_stops_at_its_token(tokenizer):
    """A token may end a stop string and begin a character ('rg' and the first byte of 'å' in the builtin's vocab):
    the detokenizer stops at that token, not when the character completes."""
    ids = tokenizer.encode("smörgåsbord")
    detokenizer = tokenizer.detokenizer(("rg",))
    for n, token in enumerate(ids, 1):
        detokenizer.push([token])
        if "rg" in tokenizer.decode(ids[:n]).rstrip(REPLACEMENT):
            break
    assert tokenizer.decode(ids[:n]).endswith(REPLACEMENT)  # the premise: the character after the stop is split
    assert detokenizer.stopped and detokenizer.text + detokenizer.finish() == "smö"


def test_stop_string_never_partly_released_before_stopping(tokenizer):
    """Held back: no piece released before the stop shows the stop string's first characters past the cut."""
    ids = tokenizer.encode("hello world. the quick brown fox")
    detokenizer = tokenizer.detokenizer(("quick brown",))
    released = ""
    for token in ids:
        released += detokenizer.push([token])
        assert len(released) <= len("hello world. the ")
    assert detokenizer.stopped and released + detokenizer.finish() == "hello world. the "


def test_the_stop_string_that_comes_first_in_the_text_wins_whatever_its_place_in_the_list(tokenizer):
    """Both stop strings arrive in one push (a round's tokens come together): the text ends before the earlier one."""
    for stops in (("b", "a"), ("a", "b")):
        detokenizer = tokenizer.detokenizer(stops)
        text = detokenizer.push(tokenizer.encode("xaby")) + detokenizer.finish()
        assert detokenizer.stopped and text == detokenizer.text == "x", stops


def test_no_stop_string_leaves_text_whole(tokenizer):
    text = "experts that are resident on the device"
    _, joined, stopped = stream(tokenizer, tokenizer.encode(text), stop_strings=("absent",))
    assert joined == text and not stopped


def test_metaspace_decoder_keeps_spaces_incrementally():
    """Sentencepiece-style decoders strip a leading space; decoding with context keeps the spaces."""
    from tokenizers import Tokenizer as Fast, decoders, models, pre_tokenizers, trainers

    fast = Fast(models.BPE(unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.Metaspace()
    fast.decoder = decoders.Metaspace()
    fast.train_from_iterator([TOKENIZER_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    tokenizer = Tokenizer(fast)
    text = "the draft proposes tokens and the target verifies them"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    _, joined, _ = stream(tokenizer, ids)
    assert joined == text
    # A continuation after a prompt keeps the space between them (it began 'that c experts': 'tokens andthat c ...')
    for cut in range(1, len(ids)):
        prompt, answer = ids[:cut], ids[cut:]
        _, joined, _ = stream(tokenizer, answer, context=prompt)
        assert tokenizer.decode(prompt) + joined == text, cut
    cut = next(n for n in range(len(ids)) if tokenizer.decode(ids[:n]) == "the draft")
    assert stream(tokenizer, ids[cut:], ("tokens",), context=ids[:cut])[1:] == (" proposes ", True)


def test_a_continuation_after_a_prompt_is_its_text_in_the_whole_decode(tokenizer):
    """Byte-level BPE: after any prompt cut that ends on a whole character, prompt text + new text = the whole
    decode; a prompt ending inside a character leaves its context out (the character is split between them)."""
    ids = tokenizer.encode("smörgåsbord and " + MULTIBYTE + " experts")
    for cut in range(1, len(ids)):
        prompt = tokenizer.decode(ids[:cut])
        _, joined, _ = stream(tokenizer, ids[cut:], context=ids[:cut])
        if not prompt.endswith(REPLACEMENT):
            assert prompt + joined == tokenizer.decode(ids), cut
        else:
            assert joined == stream(tokenizer, ids[cut:])[1], cut


def test_builtin_tokenizer_is_deterministic_and_fits_the_vocabulary(tmp_path, tokenizer):
    first = write_builtin("tiny", tmp_path / "a")
    second = write_builtin("tiny", tmp_path / "b")
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert tokenizer.vocab_size <= json.loads((first / "config.json").read_text())["vocab_size"]
    assert tokenizer.special_tokens["eos_token"] == "<|endoftext|>"


def test_missing_tokenizer_is_none_and_broken_one_is_an_error(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_from_tokenizer_config(tmp_path):
    directory = shutil.copytree(builtin_path("tiny"), tmp_path / "m")
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    settings_file = directory / "tokenizer_config.json"
    settings_file.write_text(json.dumps(json.loads(settings_file.read_text()) | {"chat_template": template, "bos_token": "<s>"}))
    tokenizer = Tokenizer.from_dir(directory)
    messages = [{"role": "user", "content": "hello"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == "<s><user>hello<|endoftext|><assistant>"
    assert tokenizer.encode_chat(messages) == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("<|endoftext|>")


def test_no_chat_template_is_a_clear_error(tokenizer):
    with pytest.raises(ConfigError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_can_refuse(tmp_path):
    tokenizer = Tokenizer(train_byte_level_bpe(["abc"], 300), chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ConfigError, match="only user turns"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte, so every multi-byte character spans several tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def test_characters_split_over_byte_tokens_are_held_until_complete():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("a🙂é日")
    assert len(ids) == 1 + 4 + 2 + 3
    pieces, text, _ = stream(tokenizer, ids)
    assert pieces == ["a", "", "", "", "🙂", "", "é", "", "", "日", ""] and text == "a🙂é日"
    pieces, text, _ = stream(tokenizer, ids[:3])  # generation ends inside the emoji: one U+FFFD, at the end only
    assert pieces == ["a", "", "", REPLACEMENT] and text == "a" + REPLACEMENT


def test_streamed_text_never_shows_a_character_that_later_tokens_complete(tiny):
    """Through the engine's stream: with one token per byte, the pieces join to the final decode, so no piece
    released a U+FFFD for bytes the next tokens completed (a genuinely invalid byte stays U+FFFD in both)."""
    from specter import Engine, EngineConfig
    from specter.kernel import run

    tokenizer = byte_tokenizer()
    prompt = tokenizer.encode("日本")

    async def main():
        async with Engine.from_pretrained(tiny, EngineConfig(device="cpu"), tokenizer=tokenizer) as engine:
            async with engine.generate(prompt, max_new_tokens=40) as stream_:
                return [piece async for piece in stream_], stream_.result

    pieces, result = run(main())
    decoded = tokenizer.decode(result.token_ids)
    assert "".join(piece.text for piece in pieces) == result.text == decoded
    released = ""
    for piece in pieces[:-1]:
        released += piece.text
        assert decoded.startswith(released)


def test_a_long_text_encodes_to_the_same_ids_and_leaves_other_threads_their_turns(tokenizer):
    """Past GIL_FREE_CHARS the text goes through encode_batch, which releases the GIL: the server encodes prompts on
    a worker thread, and `encode` holding the GIL for a long prompt held the event loop (and every stream) with it."""
    import threading
    import time

    from specter.tokenizer import GIL_FREE_CHARS

    text = (MULTIBYTE + " ") * (2**19 // len(MULTIBYTE))
    assert len(text) > GIL_FREE_CHARS
    assert tokenizer.encode(text) == list(tokenizer.backend.encode(text).ids)
    assert tokenizer.encode(text, add_special_tokens=False) == list(tokenizer.backend.encode(text, add_special_tokens=False).ids)
    done, ticks = threading.Event(), 0
    worker = threading.Thread(target=lambda: (tokenizer.encode(text * 4), done.set()))
    start = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)  # each wake-up needs the GIL
        ticks += 1
    worker.join()
    elapsed = time.perf_counter() - start
    assert elapsed < 0.1 or ticks >= 10 * elapsed, (ticks, elapsed)  # held, it would be about 1 for the whole encode


def test_a_tokenizer_that_loads_but_cannot_encode_is_the_checkpoints_error(tmp_path):
    """A Unigram vocabulary without the unknown token it needs loads, then fails on any other text: the tokenizers
    library's bare Exception was a traceback of `generate`, now a CheckpointError naming the tokenizer."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import Unigram

    (tmp_path / "tokenizer.json").write_text(Backend(Unigram([("a", 0.0)])).to_str())
    broken = Tokenizer.from_dir(tmp_path)
    assert broken is not None and broken.encode("a")  # what it knows, it encodes
    with pytest.raises(CheckpointError, match=f"the tokenizer at {tmp_path} cannot encode this text .*give the prompt "
                                              "as token ids"):
        broken.encode("hi")


@pytest.mark.parametrize("ids", [[99999, -1], "abc", [1.5]])
def test_decoding_what_is_no_token_id_sequence_is_a_prompt_error(tokenizer, ids):
    from specter.errors import PromptError

    with pytest.raises(PromptError, match="token ids are a sequence of ints from 0"):
        tokenizer.decode(ids)


@pytest.mark.parametrize("template", [5, ["x"], [{"name": "default", "template": 5}], {"default": "x"}])
def test_a_chat_template_that_is_no_template_string_is_said_so(tmp_path, tokenizer, template):
    """A chat_template of another type read as no template at all ("has no chat template"), sending the user to
    look for a template that is there."""
    shutil.copy(builtin_path("tiny") / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(CheckpointError, match="tokenizer_config.json's chat_template is .*fix it, or remove it"):
        Tokenizer.from_dir(tmp_path)


def test_a_completion_continues_its_prompt_and_a_chat_answer_is_decoded_alone(tmp_path):
    """With a SentencePiece (Metaspace) tokenizer: a completion's text continues the prompt's (prompt + text reads as
    the whole sequence decodes; the space between them was dropped), a chat answer starts without that space (as
    Hugging Face, which decodes the new tokens alone, and OpenAI give it), and `continuation` says which for ids."""
    from tokenizers import Tokenizer as Fast, decoders, models, pre_tokenizers, trainers

    from specter import EngineConfig, SyncEngine

    directory = shutil.copytree(builtin_path("tiny"), tmp_path / "sp")
    fast = Fast(models.BPE(unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.Metaspace()
    fast.decoder = decoders.Metaspace()
    fast.train_from_iterator([TOKENIZER_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    fast.save(str(directory / "tokenizer.json"))
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m['content'] }} [/INST]{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": template}))
    engine = SyncEngine(directory, EngineConfig(device="cpu"))
    try:
        tokenizer = engine.engine.tokenizer
        ids = tokenizer.encode("tokens and")
        spaced = [t for t in range(300) if tokenizer.decode(ids + [t]).startswith("tokens and ")
                  and tokenizer.decode([t]) and not tokenizer.decode([t]).startswith(" ")]
        assert spaced, "the premise: tokens that decode with a leading space after context and without it alone"
        completion = engine.complete("tokens and", max_new_tokens=6)
        assert "tokens and" + completion.text == tokenizer.decode(ids + completion.token_ids)
        for content in TOKENIZER_TEXT.split()[:200]:  # a chat whose answer starts with a token a space begins
            chat_ids = engine.engine.encode([{"role": "user", "content": content}])
            answer = engine.complete([{"role": "user", "content": content}], max_new_tokens=6)
            if tokenizer.decode(chat_ids + answer.token_ids[:1]).endswith(" " + tokenizer.decode(answer.token_ids[:1])):
                break
        else:
            pytest.fail("no answer began with a spaced token")
        assert answer.text == tokenizer.decode(answer.token_ids) and not answer.text.startswith(" ")  # decoded alone
        as_ids = engine.complete(chat_ids, max_new_tokens=6, continuation=False)
        assert (as_ids.token_ids, as_ids.text) == (answer.token_ids, answer.text)
        continued = engine.complete(chat_ids, max_new_tokens=6)  # ids: a continuation unless said otherwise
        assert tokenizer.decode(chat_ids) + continued.text == tokenizer.decode(chat_ids + continued.token_ids)
    finally:
        engine.close()
