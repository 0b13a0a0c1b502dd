"""EngineConfig.tuning: the measured knobs are validated fields that reach the parts they tune, and no module-level
switch or SPECTER_* toggle comes back (tuning knobs are typed, documented config fields)."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from specter.config import (CacheTuning, DraftConfig, EngineConfig, GenerationConfig, KernelTuning, MoETiles, RowTiles,
                            TransferTuning, TuningConfig, VerifyTuning, WaitTuning)
from specter.engine import Runtime
from specter.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


# ---- the fields ---------------------------------------------------------------------------------------------------
def test_the_defaults_are_the_adopted_settings():
    tuning = EngineConfig().tuning
    assert tuning.cache == CacheTuning(roll_hot_window=2, lead_relay=True)
    assert tuning.transfer == TransferTuning(max_chunks_in_flight=4, issue_marks=False)
    assert tuning.verify == VerifyTuning(lead_misses=2, routing_poll_s=3e-3)
    assert tuning.kernels.static_mla and tuning.kernels.positions_per_split == 128 and tuning.kernels.max_splits == 64
    assert all(getattr(tuning.kernels, name) for name in ("merge_in_launch", "decode_attention", "rope_writes_cache",
                                                          "router_and_gate", "packed_qkv", "packed_ffn_input",
                                                          "residual_addend", "row_kernels"))
    assert EngineConfig().cuda_graphs is True
    assert tuning.host.parallel_experts is False  # not yet measured on the H200's host
    assert tuning.kernels.exact_rowwise is False  # not yet measured on the H200


def test_the_kernels_tiles_default_to_the_measured_ones():
    """The one-row kernels' and the MoE kernels' tiles as they were measured best (the kernels' numerics depend on
    them: a changed default would change the draft's and the resident target's bits)."""
    kernels = EngineConfig().tuning.kernels
    assert kernels.row.model_dump() == dict(
        block_n=8, block_k=512, block_n_moe=16, block_k_moe=512, block_k_gate_up=1024, block_n_finish=4, words_gate_up=False,
        words_finish=True, warps_moe=8, warps_finish=4, block_k_shared=2048, evict_first=True, topk_in_router=True,
        num_warps=4, num_stages=3, block_n_residual=2, block_k_residual=1024, block_n_input=4, int8_gate_up=True,
        int8_finish=True, dp4a=True)
    assert kernels.moe.model_dump() == dict(
        block_n_gate_up=32, block_n_down=32, block_k=128, num_warps=4, num_stages=3, split_k_down=2, single_token_gemv=True,
        block_n_gemv=16, block_k_gemv=512, split_k_gemv_gate_up=4)
    assert kernels.resident == MoETiles(block_n_gate_up=16, block_n_down=16, block_k=128, num_warps=4, num_stages=3)


def test_cuda_graphs_and_static_mla_ignore_the_environment(monkeypatch):
    """The old toggles SPECTER_CUDA_GRAPHS and SPECTER_STATIC_MLA are gone: only the fields decide."""
    monkeypatch.setenv("SPECTER_CUDA_GRAPHS", "0")
    monkeypatch.setenv("SPECTER_STATIC_MLA", "0")
    assert EngineConfig().cuda_graphs and EngineConfig().tuning.kernels.static_mla


def _described_fields(model: type, where: str) -> list[tuple[str, object]]:
    """(dotted name, field) of every field under `model`, nested sections (kernels.row) included."""
    found = []
    for name, field in model.model_fields.items():
        found.append((f"{where}{name}", field))
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found += _described_fields(field.annotation, f"{where}{name}.")
    return found


HISTORY = re.compile(r"journal|session|\b20\d\d-\d\d-\d\d\b|git show|\b[0-9a-f]{7,40}\b", re.IGNORECASE)
"""What a diary leaves in a description: its name, a session, a date, a commit."""


def test_every_config_field_says_what_and_why_without_its_history():
    """A description is the field's documentation (`with_overrides`, the bench's --tune, the API docs): what it does,
    its range and why its default. How it was measured belongs in git history and docs/BENCHMARKS.md."""
    fields = _described_fields(TuningConfig, "")
    assert "kernels.row.block_k" in dict(fields) and "kernels.moe.split_k_down" in dict(fields)  # the nested tiles too
    for name, field in fields:
        if "." in name:  # a knob, not a section
            assert field.description and len(field.description) > 40, name
    for model in (EngineConfig, DraftConfig, GenerationConfig, TuningConfig):
        for name, field in _described_fields(model, ""):
            assert field.description, f"{model.__name__}.{name} has no description"
            assert not HISTORY.search(field.description), (f"{model.__name__}.{name}", HISTORY.search(field.description))
    for section in (TuningConfig, *(field.annotation for _, field in fields if isinstance(field.annotation, type))):
        assert not HISTORY.search(section.__doc__ or ""), section.__name__
    assert not (Path(__file__).parents[1] / "docs" / "journal.md").exists()


def test_the_history_scan_sees_a_diary():
    for text in ("(journal, Tenth session)", "measured 2026-11-30", "see git show 7950860", "commit 5121047"):
        assert HISTORY.search(text), text
    assert not HISTORY.search("Elements per K step of norm_linear: the tile sweep's best (default 512).")


@pytest.mark.parametrize("section, field, value, rule", [
    ("cache", "roll_hot_window", -1, "greater than or equal to 0"),
    ("cache", "lead_relay", "sometimes", "valid boolean"),
    ("transfer", "max_chunks_in_flight", 0, "greater than or equal to 1"),
    ("verify", "lead_misses", -2, "greater than or equal to 0"),
    ("verify", "routing_poll_s", 1.0, "less than or equal to 0.1"),
    ("kernels", "positions_per_split", 0, "greater than or equal to 1"),
    ("kernels", "max_splits", 0, "greater than or equal to 1"),
])
def test_a_bad_tuning_value_names_the_field(section, field, value, rule):
    with pytest.raises(ConfigError) as info:
        EngineConfig.build(tuning={section: {field: value}})
    message = str(info.value)
    assert f"EngineConfig.tuning.{section}.{field} = {value!r}" in message and rule in message


def test_an_unknown_tuning_field_is_refused():
    with pytest.raises(ConfigError, match="EngineConfig.tuning.cache.lead_rely"):
        EngineConfig.build(tuning={"cache": {"lead_rely": False}})


def test_overrides_set_fields_and_name_what_is_wrong():
    tuning = TuningConfig().with_overrides(["cache.lead_relay=false", "verify.lead_misses=0", "cache.roll_hot_window=null"])
    assert tuning.cache == CacheTuning(roll_hot_window=None, lead_relay=False) and tuning.verify.lead_misses == 0
    assert tuning.transfer == TransferTuning() and tuning.kernels == KernelTuning()
    with pytest.raises(ConfigError, match="cache.lead_relay"):  # the list of fields names the right one
        TuningConfig().with_overrides(["cache.lead_rleay=false"])
    with pytest.raises(ConfigError, match="TuningConfig.transfer.max_chunks_in_flight = 0"):
        TuningConfig().with_overrides(["transfer.max_chunks_in_flight=0"])
    with pytest.raises(ConfigError, match="TuningConfig.transfer.max_chunks_in_flight"):  # was a RecursionError
        TuningConfig().with_overrides(["transfer.max_chunks_in_flight=" + "[" * 100_000 + "]" * 100_000])


def test_nested_overrides_set_the_kernels_tiles():
    tuning = TuningConfig().with_overrides(["kernels.row.block_k=1024", "kernels.moe.split_k_down=1",
                                            "kernels.resident.num_warps=8", "kernels.row.int8_finish=false",
                                            "kernels.row_kernels=false"])
    assert tuning.kernels.row == RowTiles(block_k=1024, int8_finish=False)
    assert tuning.kernels.moe == MoETiles(split_k_down=1)
    assert tuning.kernels.resident == KernelTuning().resident.model_copy(update={"num_warps": 8})
    assert not tuning.kernels.row_kernels and tuning.cache == CacheTuning()
    assert TuningConfig().with_overrides(["kernels.row.block_k=1024"]).kernels.row.block_k == 1024  # from the defaults


@pytest.mark.parametrize("override, message", [
    ("kernels.row.blok_k=1024", "kernels.row has no 'blok_k'; expected SECTION.FIELD=VALUE with one of kernels.row.block_n, "
                                "kernels.row.block_k,"),
    ("kernels.rows.block_k=1024", "kernels has no 'rows'; expected SECTION.FIELD=VALUE with one of kernels.static_mla,"),
    ("kernels.row=1024", "kernels.row is a section; set one of its fields: kernels.row.block_n,"),
    ("kernels.row_kernels.block_k=1", "kernels.row_kernels is a field, not a section"),
    ("kernels.row.block_k", "expected SECTION.FIELD=VALUE"),
    ("nothing.block_k=1", "the tuning has no 'nothing'; expected SECTION.FIELD=VALUE with one of cache.FIELD,"),
    ("kernels.row.block_k=1000", "TuningConfig.kernels.row.block_k = 1000: 1000 is not a power of two"),
    ("kernels.moe.split_k_down=0", "TuningConfig.kernels.moe.split_k_down = 0: Input should be greater than or equal to 1"),
    ("kernels.row.int8_finish=maybe", "TuningConfig.kernels.row.int8_finish = 'maybe'"),
])
def test_a_bad_nested_override_says_what_is_wrong(override, message):
    with pytest.raises(ConfigError) as info:
        TuningConfig().with_overrides([override])
    assert message in str(info.value), str(info.value)


# ---- the fields reach the parts they tune -----------------------------------------------------------------------
def run_request(model, config: EngineConfig, spy=None) -> list[int]:
    async def go() -> list[int]:
        runtime = await Runtime.load(model, config)
        try:
            if spy is not None:
                spy(runtime)
            return (await runtime.complete_ids([3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=10))).tokens
        finally:
            await runtime.aclose()

    return asyncio.run(go())


def offloaded(tuning: TuningConfig) -> EngineConfig:
    """The segmented static verify on the CPU (where the lead runs), 2 slots per layer, a fixed depth of 3."""
    return EngineConfig(device="cpu", residents=2, static_verify=True, draft=DraftConfig(k=3), lookahead="fixed",
                        tuning=tuning)


def test_a_runtime_hands_its_tuning_to_the_cache_transfer_verify_and_model(tiny):
    tuning = TuningConfig(cache=CacheTuning(roll_hot_window=1, lead_relay=False),
                          transfer=TransferTuning(max_chunks_in_flight=3, issue_marks=True),
                          verify=VerifyTuning(lead_misses=1, routing_poll_s=0.0),
                          kernels=KernelTuning(positions_per_split=64), wait=WaitTuning(spin_s=1e-4, idle_s=2e-3))
    seen = {}

    def spy(runtime: Runtime) -> None:
        seen.update(cache=runtime.cache.tuning, transfer=runtime.cache.transfer.tuning, verify=runtime.experts.tuning,
                    kernels=runtime.model.kernels, draft=runtime.draft.model.kernels,
                    cap=runtime.cache.transfer.max_chunks_in_flight, wait=runtime.kernel.settings)

    run_request(tiny, offloaded(tuning), spy)
    assert seen == {"cache": tuning.cache, "transfer": tuning.transfer, "verify": tuning.verify, "kernels": tuning.kernels,
                    "draft": tuning.kernels, "cap": 3, "wait": tuning.wait}


def test_the_kernels_tiles_reach_the_draft_moe_and_the_resident_kernel(tiny, monkeypatch):
    """kernels.moe reaches the draft's fused MoE call (its tiles argument on every call), kernels.resident the segmented
    verify's resident kernel and kernels.row the draft model's one-row kernels (their launches: tests/test_rowfused.py)."""
    from specter import draft as draft_module

    tuning = TuningConfig().with_overrides(["kernels.moe.split_k_down=1", "kernels.moe.block_k_gemv=256",
                                            "kernels.resident.block_k=64", "kernels.row.block_n_moe=8"])
    given = []
    real = draft_module.fused_moe

    def fused_moe(x, ids, weights, qe, tiles=None, counts=None):
        given.append(tiles)
        return real(x, ids, weights, qe, tiles, counts=counts)

    monkeypatch.setattr(draft_module, "fused_moe", fused_moe)
    seen = {}

    def spy(runtime: Runtime) -> None:
        seen.update(draft=runtime.draft.experts.tiles, resident=runtime.segmented.tiles, row=runtime.draft.model.kernels.row)

    run_request(tiny, offloaded(tuning), spy)
    assert seen == {"draft": tuning.kernels.moe, "resident": tuning.kernels.resident, "row": tuning.kernels.row}
    assert given and all(tiles == MoETiles(split_k_down=1, block_k_gemv=256) for tiles in given)


def test_a_cache_built_without_the_relay_never_lends_a_slot(tiny):
    """With lead_relay off the lead never borrows from the layer before; on, the same request does (and the
    tokens are the same either way)."""
    def lends(relay: bool) -> tuple[list[int], list[bool]]:
        loans: list[bool] = []

        def spy(runtime: Runtime) -> None:
            lend = runtime.cache._lend

            def counted(donor: int, layer: int):
                slot = lend(donor, layer)
                loans.append(slot is not None)
                return slot

            runtime.cache._lend = counted

        tokens = run_request(tiny, offloaded(TuningConfig(cache=CacheTuning(lead_relay=relay))), spy)
        return tokens, loans

    tokens_off, loans_off = lends(False)
    tokens_on, loans_on = lends(True)
    assert loans_off == [], "a cache built with lead_relay=False asked a layer to lend a slot"
    assert any(loans_on), "the relay never lent a slot here: the request does not reach the path the test is about"
    assert tokens_off == tokens_on


@pytest.fixture(scope="module")
def default_tokens(tiny) -> list[int]:
    return run_request(tiny, offloaded(TuningConfig()))


@pytest.mark.parametrize("misses", [0, 1, 3])
def test_lead_misses_sets_how_many_predicted_misses_each_layer_starts(tiny, default_tokens, misses):
    """The verify passes VerifyTuning.lead_misses to ExpertCache.lead; 0 runs no lead at all."""
    counts: list[int] = []
    started: list[int] = []

    def spy(runtime: Runtime) -> None:
        lead = runtime.cache.lead

        def recorded(layer, likely, count, launch):
            counts.append(count)
            computed, loads = lead(layer, likely, count, launch)
            started.append(len(loads))
            return computed, loads

        runtime.cache.lead = recorded

    tokens = run_request(tiny, offloaded(TuningConfig(verify=VerifyTuning(lead_misses=misses))), spy)
    assert tokens == default_tokens  # the lead never changes the tokens
    if misses == 0:
        assert counts == [], "lead_misses=0 still ran a lead"
        return
    assert counts and set(counts) == {misses}
    assert max(started) <= misses and any(started), "no lead started a predicted miss"


# ---- no module-level switch comes back ----------------------------------------------------------------------------
ALLOWED_CONSTANTS = {
    # true constants: formats, unit tables, hardware figures, bounds that no A/B ever flipped
    # the trace format's version; the header's shape bounds (far above real models: DeepSeek-V3 58 x 256, Qwen3-235B 94
    # layers), an expert's bytes and a round's draft depth, so that a 200-byte file cannot make a replay allocate for ever
    "specter/trace.py": {"TRACE_VERSION", "MAX_LAYERS", "MAX_EXPERTS", "MAX_EXPERT_BYTES", "MAX_DRAFT_DEPTH"},
    "specter/builtin.py": {"VERSION"},  # the built-in checkpoints' version
    "specter/exits.py": {"BROKEN_PIPE_STATUS", "INTERRUPTED_STATUS", "ERROR_STATUS"},  # exit statuses: a contract
    "specter/experts/host.py": {"HOST_PATH_VERSION"},  # the host path's version in the stored cost figures' key
    "specter/calibrate.py": {"DEFAULT_PROMPTS", "DEFAULT_PROMPT_LEN", "DEFAULT_NEW_TOKENS"},  # calibrate_draft's defaults
    "specter/config.py": {"DEFAULT_OVERLAP", "DEFAULT_K", "MIN_LINK_GBPS", "MIN_CONTEXT"},  # DraftConfig.overlap=None's
    # depth on CUDA; k's default; the slowest link emulated, a bound on input (slower ones hang or overflow the link
    # clock); max_context's floor, a bound on input that config.json's positions are checked against too
    "specter/memory.py": {"ALLOCATOR_SLACK_BYTES", "CUDA_LIBRARY_BYTES", "DEFAULT_CONTEXT"},  # measured reserves; max_context's default
    "specter/bench/realism.py": {"BALANCED_ENTROPY", "NEW_TOKENS", "TEMPERATURE", "REUSE_WINDOW", "PROMPTS_PER_KIND"},  # the report's definition
    "specter/bench/stopping.py": {"STOP_GRACE_S"},  # how long a stopped bench may take to end before its watchdog ends it
    "specter/bench/widen.py": {"SHARD_BYTES"},  # the written checkpoint's shard size
    "specter/server/app.py": {"DEFAULT_COMPLETION_TOKENS"},  # OpenAI's default max_tokens
    "specter/server/cli.py": {"DRAIN_GRACE_S"},  # uvicorn's backstop after --drain-timeout, which ends requests itself
    # which tokenizer call encodes a text: the same ids either way; the prompt ids a detokenizer decodes after, a bound on
    # any decoder's look-back (the text is the same for any value above it), not a speed knob
    "specter/tokenizer.py": {"GIL_FREE_CHARS", "CONTEXT_TOKENS"},
    "specter/server/asgi.py": {"CLIENT_GONE"},  # the status counted for a hang-up
    "specter/server/protocol.py": {"MAX_STOP_STRINGS", "SEED_LIMIT"},  # request limits of the API
    "specter/replay.py": {"DEFAULT_LINK_GBPS"},  # the replay CLI's default link
    "specter/placement.py": {"OVERLAP", "SEQUENCE_TOKENS"},  # the cost model's default overlap, a measured property of
    # the machine that the policies take as a constructor option (Auto(overlap=...)), not a switch anyone flips at run
    # time; how many of a routing trace's tokens the load replays through each layer's slots, a bound on the load's
    # work that also bounds what the placement is decided from (its docstring says so), not a tuned knob
    "specter/experts/costs.py": {"REPEATS", "LINK_PROBE_BYTES"},  # the load-time calibration's definition (median of
    # 3, a probe of at most 64 MiB), not a tuned knob
    "specter/sampling.py": {"_MASK32", "MIN_SAMPLING_TEMPERATURE"},  # a bit mask of the noise hash; where dividing
    # float32 logits by the temperature would overflow, so its limit (greedy) is taken
    "specter/build.py": {"LARGE_CHECKPOINT_BYTES"},  # when loading shows progress on a terminal
    "specter/observers.py": {"MAX_DEFERRED_ROUNDS"},  # bounds the deferred copy-busy backlog (memory), never A/B'd
    "specter/kernel.py": {"_JOIN_TIMEOUT_S"},  # how long close() waits for a waiter thread
    # how long the exit waits for daemon threads' queued work, and how often that wait checks a thread still runs
    "specter/daemons.py": {"EXIT_SETTLE_S", "_POLL_S"},
    # when a policy call is logged as holding the loop, or a placement's load-time call the load (warnings, no behaviour)
    "specter/plugins.py": {"SLOW_CALL_S", "LOAD_SLOW_CALL_S"},
    # how often a blocked SyncEngine call checks its loop thread is alive; how long its close waits for tasks to unwind
    "specter/sync.py": {"LIVENESS_POLL_S", "UNWIND_S"},
    # a warning's patience, not a tuning knob: how long a request waits behind a stream nobody reads before it is said
    "specter/api.py": {"IDLE_HOLDER_WARN_S"},
    "specter/experts/pool.py": {"_MAX_SLAB_GROWTH"},  # pinned-slab allocation granularity
    "specter/experts/native.py": {"CHUNK", "CALL_ROWS"},  # bound the native kernel's scratch per job and per call; rows
    # and experts are independent, so they change no bit (tests/test_native_kernel.py) and no A/B ever weighed them
    "specter/experts/transfer.py": {"TIMER_SLACK_S"},  # the host-paced emulation's timer slack (uvloop's resolution)
    "specter/model/deepseek_v2.py": {"LORA_NORM_EPS"},  # the checkpoint's own RMSNorm epsilon
    "specter/model/spec.py": {"MAX_LAYERS"},  # a bound on config.json's layer count, far above any real model's
    "specter/model/transformer.py": {"PACK_ROWS"},  # packed tensors' row alignment for cuBLAS's tensor-core kernels
    "specter/quant/gptq.py": {"GPTQ_WORKING_BYTES"},  # GPTQ's working-memory bound
    "specter/quant/moe_triton.py": {"MAX_PAIRS", "BLOCK_M"},  # the kernels' compile-time shapes
    # the quick preset (CLI defaults, not engine knobs); two exit statuses (contracts)
    "specter/bench/cli.py": {"QUICK_RESIDENTS", "QUICK_REPEATS", "NOTHING_MEASURED", "CELLS_FAILED"},
    "specter/bench/protocol.py": {"PROMPT_TOKENS"},  # the measurement protocol
    "specter/bench/report.py": {"RATIO_DECIMALS"},  # how a speedup is stored, so that the table and the line agree
    "specter/bench/synthetic.py": {"DISTINCT_EXPERTS"},  # the synthetic models' routing
    "specter/bench/hf_baseline.py": {"MAX_TOKENS"},  # the baseline's length
}
ALLOWED_ENVIRONMENT = {"SPECTER_PLUGINS", "SPECTER_CACHE"}  # plus logging (SPECTER_LOG*, if any)


def _module_switches(path: Path) -> list[str]:
    """Module-level UPPER_CASE names bound to a bool, int, float or None (possibly negated), or to a configuration
    object (a call of a class named *Config, *Tiles or *Tuning: the kernels' default tiles were such), in `path`."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.UnaryOp):
            value = value.operand
        scalar = isinstance(value, ast.Constant) and (value.value is None or isinstance(value.value, (bool, int, float)))
        scalar |= isinstance(value, ast.BinOp) and all(isinstance(side, ast.Constant) for side in (value.left, value.right))
        scalar |= isinstance(value, ast.Call) and _called_name(value).endswith(("Config", "Tiles", "Tuning"))
        for target in targets:
            if scalar and isinstance(target, ast.Name) and target.id.lstrip("_").isupper():
                found.append(target.id)
    return found


def _called_name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def _global_swaps(path: Path, own: bool = True) -> list[str]:
    """Where `path` swaps a module-level UPPER_CASE name at run time: `module.NAME = ...`, `setattr(module, "NAME",
    ...)` or (`own`) `global NAME` (how benchmarks used to swap the kernels' default tiles)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            stored = [part for target in targets for part in ast.walk(target)
                      if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store)]
            found += [f"{path.name}:{node.lineno}: {ast.unparse(part)} =" for part in stored if part.attr.lstrip("_").isupper()]
        if isinstance(node, ast.Call) and _called_name(node) == "setattr" and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.lstrip("_").isupper():
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if own and isinstance(node, ast.Global):
            found += [f"{path.name}:{node.lineno}: global {name}" for name in node.names if name.lstrip("_").isupper()]
    return found


def _environment_reads(path: Path) -> list[str]:
    """String constants naming SPECTER_* variables (os.environ[...], .get(...), getenv, or a name bound to one)."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("SPECTER_")]


def test_no_module_level_switch_is_left_in_specter():
    offenders = []
    for path in sorted((ROOT / "specter").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        allowed = ALLOWED_CONSTANTS.get(relative, set())
        offenders += [f"{relative}: {name}" for name in _module_switches(path) if name not in allowed]
    assert offenders == [], ("module-level switches found; make each a field of EngineConfig.tuning (specter/config.py) "
                             f"or, if it is a true constant, add it to ALLOWED_CONSTANTS with why: {offenders}")


def test_no_module_global_is_swapped_at_run_time():
    """Tuning travels in EngineConfig.tuning, passed down at construction: neither the engine nor a benchmark swaps a
    module's default (the kernels' tiles were `rowfused.DEFAULT_CONFIG = ...`); a benchmark's own `global` is its own."""
    offenders = [swap for folder in ("specter", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))
                 for swap in _global_swaps(path, own=folder == "specter")]
    assert offenders == [], f"module-level names swapped at run time (make them EngineConfig.tuning fields): {offenders}"


def test_no_specter_environment_toggle_is_left_in_specter():
    offenders = []
    for path in sorted((ROOT / "specter").rglob("*.py")):
        names = [name for name in _environment_reads(path) if name not in ALLOWED_ENVIRONMENT and not name.startswith("SPECTER_LOG")]
        offenders += [f"{path.relative_to(ROOT).as_posix()}: {name}" for name in names]
    assert offenders == [], f"SPECTER_* environment toggles found (make them config fields): {offenders}"


def test_the_scan_finds_a_switch_and_a_toggle(tmp_path):
    """The scans above would see one: a module-level boolean, an annotated int, and an environment read."""
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nLEAD_RELAY = True\nWINDOW: int | None = 2\nRATE = -1e-3\n_PRIVATE = 4 * 4\n'
                      'NAME = "x"\nGRAPHS = os.environ.get("SPECTER_CUDA_GRAPHS", "1") != "0"\n'
                      'DEFAULT_CONFIG = RowConfig()\nTILES = config.MoETiles(block_k=64)\nWIRE = ConfigDict(strict=True)\n'
                      'rowfused.DEFAULT_CONFIG = RowConfig(block_k=1024)\nsetattr(moe_triton, "DEFAULT_CONFIG", TILES)\n'
                      'def swap():\n    global WINDOW\n    WINDOW = 3\n    runtime.model.kernels = None\n'
                      '    fused.MAX_SPLITS, x = 4, 5\n')
    assert _module_switches(sample) == ["LEAD_RELAY", "WINDOW", "RATE", "_PRIVATE", "DEFAULT_CONFIG", "TILES"]
    assert _environment_reads(sample) == ["SPECTER_CUDA_GRAPHS"]
    assert [swap.split(": ", 1)[1] for swap in _global_swaps(sample)] == [
        "rowfused.DEFAULT_CONFIG =", "setattr(moe_triton, 'DEFAULT_CONFIG', TILES)", "global WINDOW", "fused.MAX_SPLITS ="]
