"""The public API: load/close, streaming, complete, stop ids and strings, FIFO queueing, cancellation, sync wrapper."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

import specter
from specter import Engine, EngineConfig, GenerationConfig, SyncEngine
from specter.decode import greedy_decode, run_sync
from specter.errors import PromptError, RequestCancelled
from specter.kernel import run
from specter.build import load_resident

OFFLOADED = EngineConfig(device="cpu", residents=2)  # 2 of 16 experts per layer on the "device", speculation on
PROMPT = [5, 17, 300, 42]


@pytest.fixture(scope="module")
def baseline(tiny):
    """Plain greedy decoding with every expert resident: the output every mode must equal."""
    loaded = load_resident(tiny, EngineConfig(device="cpu"))
    return lambda prompt, n: run_sync(greedy_decode(loaded.model, loaded.experts, prompt, n))


def assert_engine_clean(engine: Engine) -> None:
    runtime = engine.runtime
    assert runtime.kv.length == 0 and runtime.plan is None
    for layer in range(runtime.cache.num_layers):
        assert runtime.cache.protected_experts(layer) == set()
        assert runtime.cache.pinned_experts(layer) == []


def test_complete_equals_baseline_and_stream(tiny, baseline):
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            result = await engine.complete(PROMPT, max_new_tokens=12)
            async with engine.generate(PROMPT, GenerationConfig(max_new_tokens=12)) as stream:
                pieces = [piece async for piece in stream]
            return engine, result, pieces, stream

    engine, result, pieces, stream = run(main())
    assert result.token_ids == baseline(PROMPT, 12)
    assert [t for piece in pieces for t in piece.token_ids] == result.token_ids
    assert len(pieces) >= 2 and pieces[-1].finished and not any(piece.finished for piece in pieces[:-1])
    assert result.finish_reason == "length" and stream.result.token_ids == result.token_ids
    assert "".join(piece.text for piece in pieces) == result.text == engine.tokenizer.decode(result.token_ids)
    stats = result.stats.as_dict()
    assert stats["new_tokens"] == 12 and stats["prompt_tokens"] == len(PROMPT)
    assert stats["ttft_s"] > 0 and stats["tpot_s"] > 0 and stats["rounds"] >= 1
    assert 0 < stats["acceptance_rate"] <= 1 and stats["mean_accepted_length"] >= 1
    assert stats["misses"] > 0 and stats["h2d_bytes"] > 0 and 0 <= stats["hit_rate"] <= 1


def test_h2d_bytes_are_per_request(tiny):
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            first = await engine.complete(PROMPT, max_new_tokens=8)
            second = await engine.complete(PROMPT, max_new_tokens=8)
            return first.stats, second.stats, engine.runtime.cache.stats.total().bytes_loaded

    first, second, lifetime = run(main())
    assert 0 < first.h2d_bytes and 0 < second.h2d_bytes and first.h2d_bytes + second.h2d_bytes <= lifetime
    # The prompt's forward loads from a cold cache; the decode's bytes per token leave those out.
    assert 0 < first.h2d_prefill_bytes < first.h2d_bytes
    assert first.as_dict()["h2d_prefill_bytes"] == first.h2d_prefill_bytes


def test_the_prompts_stall_is_kept_apart_so_the_bench_counts_decode_stall_per_token(tiny):
    """The bench's stall ms/tok divided the whole request's stall, the prompt's cold loads included, by every token:
    on a slow link it came out above TPOT (88.6 against 88.2 ms on the quick matrix)."""
    from specter.bench.report import _decode_per_token

    async def main():
        config = EngineConfig(device="cpu", residents=2, max_context=64, link="0.05")
        async with Engine.from_pretrained(tiny, config) as engine:
            return await engine.complete(PROMPT, max_new_tokens=8)

    result = run(main())
    stats = result.stats.as_dict()
    assert 0 < stats["stall_prefill_s"] <= stats["stall_s"]
    per_token = _decode_per_token([stats], "stall_s", "stall_prefill_s", scale=1e3)
    assert per_token == round(1e3 * (stats["stall_s"] - stats["stall_prefill_s"]) / 7, 3)
    assert per_token <= 1e3 * stats["tpot_s"]


def test_prefill_bytes_are_the_first_tokens_and_traced_rounds_carry_their_bytes(tiny, tmp_path):
    from specter.replay import recorded_bytes
    from specter.trace import read_trace

    config = EngineConfig(device="cpu", residents=2, lookahead="fixed", draft=dict(k=3))

    async def main():
        async with Engine.from_pretrained(tiny, config) as engine:
            one = await engine.complete(PROMPT, max_new_tokens=1)
            engine.runtime.record_trace(tmp_path / "t.jsonl")
            many = await engine.complete(PROMPT, max_new_tokens=12)
            return one.stats, many.stats

    one, many = run(main())
    assert one.new_tokens == 1 and one.h2d_prefill_bytes == one.h2d_bytes > 0 and one.h2d_decode_bytes_per_token == 0
    _, rounds = read_trace(tmp_path / "t.jsonl")
    assert rounds and all(r.k == 3 and r.loaded_bytes is not None and r.loaded_bytes >= 0 for r in rounds)
    for r in rounds:  # the plans' counts: made during the draft, never more than the round's totals
        assert r.checkpoints and all(1 <= steps <= 3 for steps, _ in r.checkpoints)
        totals = r.predicted_counts(16)
        assert all((counts <= totals).all() for _, counts in r.checkpoint_counts(16))
    # every round of this request drafts, so the traced rounds' bytes are its bytes after the first token (less a
    # prefetch that lands between a round's end and the next round's start, counted in neither)
    assert 0 < recorded_bytes(rounds) <= many.h2d_bytes - many.h2d_prefill_bytes


def test_text_prompt_and_await_form(tiny):
    async def main():
        engine = await Engine.from_pretrained(tiny, OFFLOADED)
        try:
            by_text = await engine.complete("hello world", max_new_tokens=6)
            by_ids = await engine.complete(engine.tokenizer.encode("hello world"), max_new_tokens=6)
        finally:
            await engine.aclose()
        return by_text, by_ids

    by_text, by_ids = run(main())
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt_ids == by_ids.prompt_ids


def test_stop_token_id_and_checkpoint_eos(tiny, tmp_path, baseline):
    free_run = baseline(PROMPT, 16)
    stop = free_run[5]
    expected = free_run[: free_run.index(stop) + 1]
    directory = shutil.copytree(tiny, tmp_path / "m")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))

    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            by_request = await engine.complete(PROMPT, max_new_tokens=16, stop_token_ids=(stop,))
        async with Engine.from_pretrained(directory, OFFLOADED) as engine:
            by_eos = await engine.complete(PROMPT, max_new_tokens=16)
        return by_request, by_eos

    for result in run(main()):
        assert result.token_ids == expected and result.finish_reason == "stop"
        assert result.stats.new_tokens == len(expected)


def test_stop_string_truncates_text_and_tokens(tiny):
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            free = await engine.complete(PROMPT, max_new_tokens=24)
            stop = next(free.text[i : i + 2] for i in range(4, len(free.text)) if "\ufffd" not in free.text[i : i + 2])
            stopped = await engine.complete(PROMPT, max_new_tokens=24, stop_strings=(stop,))
            return free, stop, stopped

    free, stop, stopped = run(main())
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.find(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)] and len(stopped.token_ids) < len(free.token_ids)


def test_a_stop_string_ending_where_a_character_begins_stops_with_its_token(tiny):
    """Byte-level BPE: the token that completes a stop string can also carry the first byte of the next character
    (tiny greedy from "hello": 'rg' and the lead byte of a character in its 8th token). The stop is found at that
    token, so a request whose token limit falls there ends with 'stop' and no token after it (it ended 'length')."""
    with SyncEngine(tiny, OFFLOADED) as engine:
        free = engine.complete("hello", max_new_tokens=12)
        decode = engine.engine.tokenizer.decode
        at = next(n for n in range(1, 13) if "rg" in decode(free.token_ids[:n]).rstrip("\ufffd"))
        assert at == 8 and decode(free.token_ids[:at]).endswith("\ufffd")  # the premise: a character begun there
        stopped = engine.complete("hello", max_new_tokens=at, stop_strings=("rg",))
        longer = engine.complete("hello", max_new_tokens=12, stop_strings=("rg",))
    expected = decode(free.token_ids[:at]).split("rg")[0]
    for result in (stopped, longer):
        assert (result.finish_reason, result.text, result.token_ids) == ("stop", expected, free.token_ids[:at])


def test_concurrent_requests_are_served_in_arrival_order(tiny, baseline):
    prompts = [[3, 4, 5], [9, 8], [100, 200, 300, 400], [7]]
    events: list[int] = []

    async def one(engine: Engine, index: int) -> list[int]:
        async with engine.generate(prompts[index], max_new_tokens=8) as stream:
            async for _ in stream:
                events.append(index)
        return stream.result.token_ids

    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            tasks = []
            for index in range(len(prompts)):
                tasks.append(asyncio.create_task(one(engine, index)))
                await asyncio.sleep(0)  # let it join the queue before the next arrives
            return await asyncio.gather(*tasks)

    outputs = run(main())
    assert outputs == [baseline(prompt, 8) for prompt in prompts]
    order = [index for position, index in enumerate(events) if position == 0 or events[position - 1] != index]
    assert order == [0, 1, 2, 3]  # each request's pieces are contiguous, first come first served


def test_cancel_waiting_and_running_requests_leaves_engine_clean(tiny, baseline):
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            running = engine.generate(PROMPT, max_new_tokens=40)
            first_piece = asyncio.Event()

            async def consume():
                async for _ in running:
                    first_piece.set()

            runner = asyncio.create_task(consume())
            waiter = asyncio.create_task(engine.complete([1, 2], max_new_tokens=8))
            await first_piece.wait()
            await asyncio.sleep(0.005)  # somewhere inside a round
            waiter.cancel()
            runner.cancel()
            results = await asyncio.gather(runner, waiter, return_exceptions=True)
            assert all(isinstance(result, asyncio.CancelledError) for result in results)
            assert running.finish_reason == "cancelled" and 0 < len(running.token_ids) < 40
            assert_engine_clean(engine)
            return await engine.complete([1, 2], max_new_tokens=8)

    assert run(main()).token_ids == baseline([1, 2], 8)


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_a_stream_ended_early_keeps_the_text_it_held_back_for_a_stop_string(tiny, how):
    """While a stop string may still complete, the stream holds back up to its length less one character; a stream
    left or cancelled kept `text` at what was released (empty for 12 committed tokens with a long stop string)."""
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            stream = engine.generate("hello", max_new_tokens=40, stop_strings=("a stop string that never appears " * 4,))

            async def read() -> None:
                async with stream:
                    async for _ in stream:
                        if len(stream.token_ids) >= 10:
                            if how == "break":
                                break
                            asyncio.current_task().cancel()
                            await asyncio.sleep(0)

            reader = asyncio.create_task(read())
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            assert stream.finish_reason == "cancelled" and len(stream.token_ids) >= 10
            assert stream.text and stream.text == engine.decode(stream.token_ids), (stream.text, stream.token_ids)

    run(main())


def test_leaving_a_stream_early_frees_the_engine(tiny, baseline):
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            async with engine.generate(PROMPT, max_new_tokens=30) as stream:
                async for _ in stream:
                    break
            assert stream.finish_reason == "cancelled"
            assert_engine_clean(engine)
            return await asyncio.wait_for(engine.complete(PROMPT, max_new_tokens=6), timeout=30)

    assert run(main()).token_ids == baseline(PROMPT, 6)


def test_closing_the_engine_ends_queued_and_running_requests(tiny):
    async def main():
        engine = await Engine.from_pretrained(tiny, OFFLOADED)
        started = asyncio.Event()

        async def consume(prompt):
            async for _ in engine.generate(prompt, max_new_tokens=200):
                started.set()

        tasks = [asyncio.create_task(consume(PROMPT)), asyncio.create_task(consume([1, 2]))]
        await started.wait()
        idle = engine.generate([9, 9], max_new_tokens=5)  # queued, never iterated yet
        await engine.aclose()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(outcome, RequestCancelled) for outcome in outcomes), outcomes
        with pytest.raises(RequestCancelled, match="closed"):
            await anext(idle)
        with pytest.raises(RequestCancelled, match="closed"):
            engine.generate(PROMPT)

    run(main())


def test_sync_engine(tiny, baseline):
    threads_before = threading.active_count()
    with SyncEngine(tiny, OFFLOADED) as engine:
        assert engine.complete(PROMPT, max_new_tokens=6).token_ids == baseline(PROMPT, 6)
        pieces = engine.generate("hello", max_new_tokens=30)
        next(pieces)
        pieces.close()  # ends the request: the engine takes the next one
        streamed = [t for piece in engine.generate(PROMPT, max_new_tokens=6) for t in piece.token_ids]
        assert streamed == baseline(PROMPT, 6)
        # the tokenizer as Engine's: a text prompt's ids are the request's, and decode gives its text back
        result = engine.complete("hello", max_new_tokens=4)
        assert engine.encode("hello") == result.prompt_ids and engine.decode(result.token_ids) == result.text
        assert engine.encode([3, 1, 4]) == [3, 1, 4]
        with pytest.raises(PromptError, match="cannot decode token ids"):
            engine.decode([10**6])
    assert threading.active_count() == threads_before


def test_a_loader_used_as_an_engine_says_to_await_it(tiny):
    """A forgotten `await` on from_pretrained read as "'EngineLoader' object has no attribute 'complete'"; nothing loads."""
    from specter.api import ENGINE_ATTRIBUTES

    async def public_attributes():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            return {name for name in vars(engine) if not name.startswith("_")}

    assert run(public_attributes()) == ENGINE_ATTRIBUTES  # every name an Engine has that its class does not
    loader = Engine.from_pretrained(tiny, OFFLOADED)
    for name in ("complete", "generate", "encode", "aclose", "tokenizer", "runtime"):
        with pytest.raises(AttributeError, match=f"returns a loader, not an Engine, so it has no '{name}': await it"):
            getattr(loader, name)
    with pytest.raises(AttributeError, match="'EngineLoader' object has no attribute 'nonsense'"):
        loader.nonsense  # noqa: B018
    assert not hasattr(loader, "_private") and loader._engine is None


def test_package_exports():
    assert specter.Engine is Engine and specter.SyncEngine is SyncEngine
    assert {"Engine", "Result", "Piece", "Tokenizer", "EngineConfig", "GenerationConfig"} <= set(specter.__all__)
    with pytest.raises(AttributeError):
        specter.NotAThing  # noqa: B018


def test_chat_messages_go_through_the_template(tiny, tmp_path):
    directory = shutil.copytree(tiny, tmp_path / "m")
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": template}))

    async def main():
        async with Engine.from_pretrained(directory, OFFLOADED) as engine:
            messages = [{"role": "user", "content": "hello"}]
            chat = await engine.complete(messages, max_new_tokens=4)
            text = await engine.complete("user: hello\nassistant:", max_new_tokens=4)
            return chat, text

    chat, text = run(main())
    assert chat.prompt_ids == text.prompt_ids and chat.token_ids == text.token_ids


def test_leaving_a_bare_async_for_early_does_not_hang_the_next_request(tiny, baseline):
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            stream = engine.generate(PROMPT, max_new_tokens=30)
            async for _ in stream:  # no `async with`: the stream still holds the engine after the break
                break
            with capture_logs() as logs:
                async with asyncio.timeout(60):  # the same task asks again: the abandoned stream is closed
                    second = await engine.complete(PROMPT, max_new_tokens=6)
            assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == ["stream.abandoned"]
            assert stream.finish_reason == "cancelled"
            with pytest.raises(RequestCancelled, match="loop was left early"):
                await anext(stream)
            assert_engine_clean(engine)

            async def leave_early():
                async for _ in engine.generate([1, 2], max_new_tokens=30):  # unreferenced once the task ends
                    break

            await asyncio.create_task(leave_early())
            async with asyncio.timeout(60):  # another task: the collector closes the dropped stream
                third = await engine.complete(PROMPT, max_new_tokens=6)
            return second, third

    second, third = run(main())
    assert second.token_ids == third.token_ids == baseline(PROMPT, 6)


def test_a_reader_between_pieces_keeps_its_turn(tiny, baseline):
    """The reclaim must not take the engine from a live reader in another task that is merely slow."""
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            first_piece, release = asyncio.Event(), asyncio.Event()

            async def slow_reader():
                async with engine.generate(PROMPT, max_new_tokens=8) as stream:
                    async for _ in stream:
                        first_piece.set()
                        await release.wait()
                return stream.result

            reader = asyncio.create_task(slow_reader())
            await first_piece.wait()
            other = asyncio.create_task(engine.complete([1, 2], max_new_tokens=4))
            await asyncio.sleep(0.2)
            assert not other.done()
            release.set()
            return await reader, await other

    slow, other = run(main())
    assert slow.token_ids == baseline(PROMPT, 8) and other.token_ids == baseline([1, 2], 4)


def test_sync_engine_closes_when_dropped_and_on_close(tiny):
    engine = SyncEngine(tiny, OFFLOADED)
    thread, runtime = engine._thread, engine.engine.runtime
    engine.complete(PROMPT, max_new_tokens=2)
    del engine  # never closed: the finalizer releases the engine and stops the thread
    assert not thread.is_alive() and runtime._closed
    engine = SyncEngine(tiny, OFFLOADED)
    engine.close()
    engine.close()  # idempotent
    assert not engine._thread.is_alive() and engine.engine.runtime._closed


def test_the_readme_one_liner_exits_cleanly(tmp_path):
    import subprocess
    import sys

    code = 'from specter import SyncEngine; print(SyncEngine("tiny").complete("hello", max_new_tokens=4).text != "")'
    marker = ("import atexit, threading; atexit.register(lambda: print('loop-threads', "
              "sum(t.name == 'specter-sync-loop' for t in threading.enumerate())))")
    env = {"SPECTER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(specter.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-W", "error", "-c", f"{marker}\n{code}"], capture_output=True, text=True,
                            env=env, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "loop-threads", "0"] and result.stderr == ""


def test_threads_are_set_once_at_load(tiny):
    import torch

    from specter.build import default_threads

    before = torch.get_num_threads()
    try:
        async def load(config):
            async with Engine.from_pretrained(tiny, config):
                return torch.get_num_threads()

        assert run(load(EngineConfig(device="cpu", threads=3))) == 3
        assert run(load(EngineConfig(device="cpu"))) == default_threads(torch.device("cpu"))
        assert default_threads(torch.device("cuda")) == 1
    finally:
        torch.set_num_threads(before)


def test_generation_configs_eos_replaces_config_jsons_as_in_transformers(tiny, tmp_path, baseline):
    """transformers' generate stops at generation_config.json's eos ids alone when the file names any; config.json's
    id stopped Specter too (the union), cutting the text early where the two files disagree."""
    free_run = baseline(PROMPT, 16)
    early = free_run[2]
    late = next(token for token in free_run[3:] if token not in free_run[:3])
    directory = shutil.copytree(tiny, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"eos_token_id": early}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [late]}))

    async def main():
        async with Engine.from_pretrained(directory, OFFLOADED) as engine:
            with_both = await engine.complete(PROMPT, max_new_tokens=16)
        (directory / "generation_config.json").write_text(json.dumps({"do_sample": False}))
        async with Engine.from_pretrained(directory, OFFLOADED) as engine:
            config_only = await engine.complete(PROMPT, max_new_tokens=16)
        return with_both, config_only

    with_both, config_only = run(main())
    assert with_both.token_ids == free_run[: free_run.index(late) + 1] and with_both.finish_reason == "stop"
    assert config_only.token_ids == free_run[: free_run.index(early) + 1] and config_only.finish_reason == "stop"


@pytest.mark.parametrize("k", [0, 4])
def test_logits_that_turn_non_finite_mid_stream_end_the_request_with_an_error(tmp_path, k):
    """A float16 model whose activations overflow a few tokens in: plain decoding (and speculation alike) emitted token
    0 forever, finish_reason 'length', since an argmax over NaN is 0. Now the request fails naming the position and
    bfloat16, and the engine serves the next one."""
    import torch

    from specter.config import DraftConfig
    from specter.errors import CheckpointError
    from tests.hf_models import hf_model, save_hf

    model = hf_model("mixtral", seed=7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "experts" in name and ("down" in name or "w2" in name):
                parameter.mul_(30000.0)
    path = save_hf(model, tmp_path / "overflows")
    config = EngineConfig(device="cpu", dtype="float16", max_context=64, draft=DraftConfig(k=k, k_max=k, quant="int8"))
    with SyncEngine(path, config) as engine:
        with pytest.raises(CheckpointError, match=r"logits at position \d+ are not finite.*bfloat16"):
            engine.complete([1, 2, 3], max_new_tokens=40)
        short = engine.complete([1, 2, 3], max_new_tokens=3)  # before the overflow: served, and its tokens are real
        assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_non_finite_logits_in_a_later_row_of_an_accepted_run_end_the_request(tiny, monkeypatch):
    """Every verify row whose token a round commits is checked, not only the first: NaN in row 1 (the token after an
    accepted d1) ends the request naming that row's position."""
    import torch

    from specter.config import DraftConfig
    from specter.engine import Runtime
    from specter.errors import CheckpointError

    verify, starts = Runtime._verify, []

    async def nan_in_row_1(self, block, start):
        logits = (await verify(self, block, start)).clone()
        if logits.shape[0] > 1:
            logits[1] = float("nan")
            starts.append(start)
        return logits

    monkeypatch.setattr(Runtime, "_verify", nan_in_row_1)

    async def main():
        config = EngineConfig(device="cpu", residents=2, max_context=96, lookahead="fixed",
                              draft=DraftConfig(k=3, quant="int8"))
        async with await Runtime.load(tiny, config) as runtime:
            with pytest.raises(CheckpointError, match=r"logits at position \d+ are not finite") as caught:
                await runtime.complete_ids(PROMPT, GenerationConfig(max_new_tokens=40))
            return str(caught.value)

    message = run(main())
    assert starts and f"position {starts[-1] + 2} " in message, starts  # row 1 produces the token at start + 2


# ---- the checkpoint's text files, read as a user's mistakes are: named, and nothing held --------------------------
def _tiny_copy(tiny, tmp_path, name="m") -> Path:
    return shutil.copytree(tiny, tmp_path / name)


def test_tokenizer_files_that_are_not_utf8_are_named_or_ignored(tiny, tmp_path):
    """A chat template that is not UTF-8 is the checkpoint's error, named (it was a bare UnicodeDecodeError); a
    generation_config.json that is not, advisory as a broken one is, is ignored (it failed after every weight loaded)."""
    from specter.errors import CheckpointError

    template = _tiny_copy(tiny, tmp_path, "template")
    (template / "chat_template.jinja").write_bytes(b"{{ messages }}\xff")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja: not UTF-8 text .*save the template as UTF-8"):
        specter.Tokenizer.from_dir(template)
    generation = _tiny_copy(tiny, tmp_path, "generation")
    (generation / "generation_config.json").write_bytes(b'{"eos_token_id": 3\xff}')
    with SyncEngine(generation, OFFLOADED) as engine:
        assert engine.engine.eos_token_ids == set(engine.engine.spec.eos_token_ids)


@pytest.mark.parametrize("named", [[-1], [3, -1], [10**9], -2])
def test_generation_config_eos_ids_outside_the_vocabulary_are_ignored_and_said(tiny, tmp_path, named, capsys):
    """generation_config.json's eos ids replace config.json's; one that no sampling can produce (-1, past the
    vocabulary) was kept, so a file naming only -1 meant the text never stopped at an end-of-sequence. The advisory
    file is not refused (a broken one never stops a load): its impossible ids are dropped, with a warning naming them."""
    from specter.api import checkpoint_eos
    from specter.build import CheckpointWeights
    from specter.model.checkpoint import Checkpoint

    directory = _tiny_copy(tiny, tmp_path)
    spec = CheckpointWeights(Checkpoint(directory)).spec
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": named}))
    kept = [token for token in (named if isinstance(named, list) else [named]) if 0 <= token < spec.vocab_size]
    assert checkpoint_eos(directory, spec) == (tuple(kept) or tuple(sorted(spec.eos_token_ids)))
    err = capsys.readouterr().err
    assert "checkpoint.eos_outside_vocabulary" in err and "generation_config.json" in err, err


@pytest.mark.parametrize(("content", "event"), [
    (b'{"eos_token_id": [2, 3', "checkpoint.generation_config_unreadable"),
    (b'[2, 3]', "checkpoint.generation_config_unreadable"),
    (b'{"eos_token_id": "x"}', "checkpoint.eos_not_token_ids"),
    (b'{"eos_token_id": [2, "x"]}', "checkpoint.eos_not_token_ids"),
    (b"[" * 100_000 + b"]" * 100_000, "checkpoint.generation_config_unreadable"),  # nested too deeply to parse
])
def test_a_generation_config_whose_eos_ids_cannot_be_read_is_said(tiny, tmp_path, content, event, capsys):
    """A broken or mistyped generation_config.json was dropped without a word, its end-of-turn ids with it (the text
    then runs past the turn's end): the load goes on, with a warning naming the file."""
    from specter.api import checkpoint_eos
    from specter.build import CheckpointWeights
    from specter.model.checkpoint import Checkpoint

    directory = _tiny_copy(tiny, tmp_path)
    spec = CheckpointWeights(Checkpoint(directory)).spec
    (directory / "generation_config.json").write_bytes(content)
    kept = checkpoint_eos(directory, spec)
    assert kept == ((2,) if content == b'{"eos_token_id": [2, "x"]}' else tuple(sorted(spec.eos_token_ids)))
    err = capsys.readouterr().err
    assert event in err and "generation_config.json" in err, err


def test_a_load_that_fails_after_the_weights_releases_them(tiny, monkeypatch):
    """Whatever fails between the runtime's load and the engine's start closes the runtime: on CUDA its device memory
    and pinned pool would otherwise wait for the garbage collector."""
    from specter import api
    from specter.engine import Runtime

    closed = []
    real_close = Runtime.aclose

    async def aclose(self):
        closed.append(self)
        await real_close(self)

    def broken(directory, spec):
        raise OSError("disk gone")

    monkeypatch.setattr(Runtime, "aclose", aclose)
    monkeypatch.setattr(api, "checkpoint_eos", broken)
    with pytest.raises(OSError, match="disk gone"):
        run(Engine.load(tiny, OFFLOADED))
    assert len(closed) == 1


def test_stop_strings_without_a_tokenizer_are_refused_not_ignored(tiny, tmp_path):
    """Stop strings match the generated text; without tokenizer.json there is none, and they silently never matched."""
    from specter.errors import PromptError

    ids_only = _tiny_copy(tiny, tmp_path)
    (ids_only / "tokenizer.json").unlink()
    with SyncEngine(ids_only, OFFLOADED) as engine:
        with pytest.raises(PromptError, match="stop strings need the checkpoint's tokenizer.json.*stop_token_ids"):
            engine.complete(PROMPT, max_new_tokens=4, stop_strings=["a"])
        assert len(engine.complete(PROMPT, max_new_tokens=4, temperature=0).token_ids) == 4  # and it keeps serving


def test_a_tokenizer_beyond_the_models_vocabulary_is_named_not_the_text(tiny, tmp_path):
    """Text whose tokens the model has no rows for: the tokenizer and checkpoint do not match (the message blamed the
    prompt's ids, which the user never typed)."""
    from specter.errors import PromptError

    directory = _tiny_copy(tiny, tmp_path)
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": vocab, "content": "<extra>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    with SyncEngine(directory, OFFLOADED) as engine:
        assert engine.complete("hello", max_new_tokens=2, temperature=0).token_ids  # its own tokens are fine
        with pytest.raises(PromptError, match=rf"gave token ids \[{vocab}\] for this text, beyond the model's "
                                              rf"vocabulary 0\.\.{vocab - 1}.*does not match"):
            engine.complete("hello <extra>", max_new_tokens=2)


def test_a_tokenizer_config_nested_too_deeply_is_named(tiny, tmp_path):
    from specter.errors import CheckpointError

    directory = _tiny_copy(tiny, tmp_path)
    (directory / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: not valid JSON \(nested too deeply"):
        specter.Tokenizer.from_dir(directory)


def test_a_template_that_writes_a_lone_surrogate_is_named(tiny, tmp_path):
    from specter.errors import PromptError

    directory = _tiny_copy(tiny, tmp_path)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": "\udcff{{ messages[0]['content'] }}"}))
    tokenizer = specter.Tokenizer.from_dir(directory)
    with pytest.raises(PromptError, match=r"rendered text that is not valid Unicode .*U\+DCFF.*from the template itself"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_token_ids_from_numpy_or_torch_are_ids_and_bools_or_floats_are_not(tiny):
    """A vector, or a list of its scalars (`list(array)`), is the same prompt as its ints; bools and floats, even whole
    ones, are refused by type."""
    import numpy as np
    import torch

    from specter.errors import PromptError

    with SyncEngine(tiny, OFFLOADED) as engine:
        expected = engine.complete(PROMPT, max_new_tokens=3, temperature=0).token_ids
        for prompt in (np.array(PROMPT), torch.tensor(PROMPT), list(np.array(PROMPT)), list(torch.tensor(PROMPT)),
                       [np.int32(token) for token in PROMPT]):
            assert engine.complete(prompt, max_new_tokens=3, temperature=0).token_ids == expected, type(prompt)
        for bad, named in (([1, True], "bool"), ([np.float32(1.0)], "float32"), ([torch.tensor(True)], "Tensor"),
                           ([1.0], "float")):
            with pytest.raises(PromptError, match=f"a list of int token ids.*{named}"):
                engine.complete(bad, max_new_tokens=1)


@pytest.mark.parametrize("how", ["raises", "cancelled"])
def test_a_reader_that_fails_between_pieces_frees_the_engine_though_its_task_is_kept(tiny, baseline, how):
    """A task reading a bare `async for` that raised in its body, or was cancelled between pieces (a client gone
    during a send), ended; `gather(..., return_exceptions=True)` kept the task, its traceback the frame, the frame the
    stream: no collection freed the turn, and every later request waited for good, in silence."""
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            got_one = asyncio.Event()

            async def reader():
                stream = engine.generate(PROMPT, max_new_tokens=30)
                async for _ in stream:
                    got_one.set()
                    if how == "raises":
                        raise ValueError("a bug in the reader")
                    await asyncio.sleep(3600)  # cancelled here, between pieces

            task = asyncio.create_task(reader())
            await got_one.wait()
            if how == "cancelled":
                task.cancel()
            with capture_logs() as logs:
                async with asyncio.timeout(60):
                    kept, second = await asyncio.gather(task, engine.complete(PROMPT, max_new_tokens=6),
                                                        return_exceptions=True)
            assert isinstance(kept, ValueError if how == "raises" else asyncio.CancelledError)
            assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == ["stream.abandoned"]
            assert_engine_clean(engine)
            return second

    assert run(main()).token_ids == baseline(PROMPT, 6)


async def read_in_a_task(stream) -> tuple[asyncio.Task, list[int]]:
    """`stream` read to its end by a task of its own, returned once that reader is inside its next piece (after one)."""
    read: list[int] = []

    async def reader():
        async for piece in stream:
            read.extend(piece.token_ids)

    task = asyncio.create_task(reader())
    while not read or stream._consumer is None:
        await asyncio.sleep(0)
    return task, read


def test_aclose_from_another_task_stops_the_running_request(tiny, baseline):
    """A stop button: aclose() from a task other than the reader's raised 'aclose(): asynchronous generator is
    already running' and the request ran on to max_new_tokens."""
    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            stream = engine.generate(PROMPT, max_new_tokens=300)
            task, read = await read_in_a_task(stream)
            async with asyncio.timeout(60):
                await stream.aclose()
                with pytest.raises(RequestCancelled, match="closed by aclose\\(\\) from another task"):
                    await task
            assert stream.finish_reason == "cancelled" and 0 < len(read) < 300
            with pytest.raises(RequestCancelled):
                await anext(stream)
            assert_engine_clean(engine)
            async with asyncio.timeout(60):
                return await engine.complete(PROMPT, max_new_tokens=6)

    assert run(main()).token_ids == baseline(PROMPT, 6)


@pytest.mark.parametrize("second", ["aclose", "engine close"])
def test_two_closers_at_once_both_return_and_the_reader_gets_request_cancelled(tiny, second):
    """A stop pressed twice (or a stop beside the engine's close) cancelled the reader twice: CancelledError ended its
    whole task, and the first closer waited for good on an event the second had replaced."""
    async def main():
        engine = await Engine.from_pretrained(tiny, OFFLOADED)
        stream = engine.generate(PROMPT, max_new_tokens=300)
        task, _ = await read_in_a_task(stream)
        closers = [asyncio.create_task(stream.aclose()),
                   asyncio.create_task(stream.aclose() if second == "aclose" else engine.aclose())]
        async with asyncio.timeout(30):
            await asyncio.gather(*closers)
            outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        await engine.aclose()
        return outcome

    outcome = run(main())
    assert isinstance(outcome, RequestCancelled), repr(outcome)


def test_a_second_reader_of_one_stream_is_refused_and_leaves_it_whole(tiny, baseline):
    """The stray second read's error marked the stream 'error' and cleared its reader while the first still read it:
    the engine's close then raised 'already running' and never released the runtime, on every later aclose too."""
    from specter.errors import StreamBusy

    async def main():
        engine = await Engine.from_pretrained(tiny, OFFLOADED)
        stream = engine.generate(PROMPT, max_new_tokens=40)
        task, first = await read_in_a_task(stream)
        with pytest.raises(StreamBusy, match="being read by another task"):
            await anext(stream)
        async with asyncio.timeout(60):
            await task
        assert stream.finish_reason == "length"
        await engine.aclose()
        return engine, first

    engine, first = run(main())
    assert first == baseline(PROMPT, 40) and engine.runtime._closed  # released: its device memory and threads


def test_a_request_waiting_behind_a_stream_nobody_reads_is_said_once(tiny, baseline, monkeypatch):
    """A stream held between pieces by a live task (or a failed thread's traceback, which no one can close) made the
    next request wait without a word."""
    import specter.api

    monkeypatch.setattr(specter.api, "IDLE_HOLDER_WARN_S", 0.2)

    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            stream = engine.generate(PROMPT, max_new_tokens=30)
            release = asyncio.Event()

            async def holder():
                async for _ in stream:
                    await release.wait()  # between pieces, alive: its reader may yet come back
                    break
                await stream.aclose()

            task = asyncio.create_task(holder())
            while not stream.token_ids:
                await asyncio.sleep(0.001)
            with capture_logs() as logs:
                waiting = asyncio.create_task(engine.complete(PROMPT, max_new_tokens=6))
                await asyncio.sleep(0.6)
                assert not waiting.done()
                release.set()
                async with asyncio.timeout(60):
                    await task
                    second = await waiting
            warnings = [entry for entry in logs if entry["log_level"] == "warning"]
            assert [entry["event"] for entry in warnings] == ["engine.waiting_on_idle_stream"]
            assert warnings[0]["holder_new_tokens"] == len(stream.token_ids)

            # a request that stops waiting (its task cancelled) takes its timer along: nobody waits, nothing is said
            held = engine.generate(PROMPT, max_new_tokens=30)
            await anext(held)
            with capture_logs() as logs:
                gone = asyncio.create_task(engine.complete(PROMPT, max_new_tokens=6))
                await asyncio.sleep(0.05)
                gone.cancel()
                await asyncio.sleep(0.5)
            assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == []
            await held.aclose()
            return second

    assert run(main()).token_ids == baseline(PROMPT, 6)


@pytest.mark.parametrize("overrides, says", [
    ({"seed": True}, "seed.*must be a number, not bool True"),
    ({"max_new_tokens": "3"}, "max_new_tokens.*must be a number, not str '3'"),
    ({"temperature": "0.5"}, "temperature.*must be a number, not str"),
    ({"stop_token_ids": [-1]}, "token ids are integers from 0; element 0 is -1"),
    ({"stop_token_ids": [4, True]}, "element 1 is True"),
    ({"stop_token_ids": [99999]}, r"stop_token_ids \[99999\] are beyond this model's vocabulary of \d+ ids"),
    ({"stop_token_ids": "numpy negative"}, r"element 1 is np.int64\(-2\)"),
    ({"seed": "numpy bool"}, "seed.*must be a number, not bool"),
    ({"stop_strings": ["\n", ""]}, "stop_strings.*stop string 1 is empty"),
])
def test_a_generation_setting_of_the_wrong_kind_is_refused_not_guessed(tiny, overrides, says):
    """pydantic's lax mode read seed=True as 1 and max_new_tokens='3' as 3; a stop id of -1 or past the vocabulary was
    taken and could never stop anything, and an empty stop string was dropped unsaid."""
    from specter.errors import SpecterError

    import numpy as np

    numpy_values = {"numpy negative": np.array([3, -2]), "numpy bool": np.bool_(True)}
    overrides = {key: numpy_values.get(value, value) if isinstance(value, str) else value
                 for key, value in overrides.items()}

    async def main():
        async with Engine.from_pretrained(tiny, OFFLOADED) as engine:
            with pytest.raises(SpecterError, match=says):
                engine.generate(PROMPT, **overrides)
            ids = engine.generate(PROMPT, stop_token_ids=(token for token in [5, 6])).generation.stop_token_ids
            assert ids == (5, 6)  # an iterator's ids, not the spent iterator's ()
            return (await engine.complete(PROMPT, max_new_tokens=3, seed=np_int(7))).token_ids

    def np_int(value):
        import numpy as np

        return np.int64(value)  # numpy's ints stay numbers

    assert len(run(main())) == 3


def test_a_stop_string_completed_by_the_last_flush_finishes_as_stop(tiny):
    """The last token left a character incomplete; the final flush wrote it as U+FFFD and found the stop string there,
    cutting the text, but the request finished as "length" (by max_new_tokens) where one token more said "stop"."""
    prompt, stop = [5, 17, 300, 42], " token\ufffd"
    with SyncEngine(tiny, OFFLOADED) as engine:
        full = engine.complete(prompt, max_new_tokens=17)
        if stop not in full.text:
            pytest.skip("tiny's text for this prompt no longer holds the stop string")
        cut = engine.complete(prompt, max_new_tokens=17, stop_strings=[stop])
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop", (cut.text, cut.finish_reason)


def test_decoding_an_id_past_the_models_vocabulary_is_refused(tiny):
    """The tokenizer drops an id it does not know without a word: Engine.decode([vocab_size]) returned ''."""
    with SyncEngine(tiny, OFFLOADED) as engine:
        vocab = engine.engine.spec.vocab_size
        assert engine.engine.decode([1, 2]) == engine.engine.tokenizer.decode([1, 2])
        with pytest.raises(PromptError, match=f"cannot decode token ids \\[{vocab}\\]: this model's ids are 0..{vocab - 1}"):
            engine.engine.decode([1, vocab])


def test_importing_specter_keeps_an_applications_structlog_configuration():
    """An application that configured structlog (JSON to stdout, its own level) before importing Specter kept it no
    longer: the import's first logger replaced it with Specter's quiet console default, which dropped the
    application's info events and moved the rest to stderr."""
    import subprocess
    import sys
    from pathlib import Path

    script = """
import logging, sys
import structlog
structlog.configure(processors=[structlog.processors.JSONRenderer()],
                    wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
                    logger_factory=structlog.PrintLoggerFactory(file=sys.stdout))
structlog.get_logger("app").info("before", x=1)
import specter.api, specter.server.app, specter.bench.cli
structlog.get_logger("app").info("after", x=2)
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ['{"x": 1, "event": "before"}', '{"x": 2, "event": "after"}'], done.stdout
