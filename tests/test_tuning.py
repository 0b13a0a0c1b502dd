"""EngineConfig.tuning: the measured knobs are validated fields that reach the parts they tune, and no module-level
switch or SPECTER_* toggle comes back (DESIGN section 11)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from specter.config import (CacheTuning, DraftConfig, EngineConfig, GenerationConfig, KernelTuning, TransferTuning, TuningConfig,
                            VerifyTuning)
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


def test_cuda_graphs_and_static_mla_ignore_the_environment(monkeypatch):
    """The old toggles SPECTER_CUDA_GRAPHS and SPECTER_STATIC_MLA are gone: only the fields decide."""
    monkeypatch.setenv("SPECTER_CUDA_GRAPHS", "0")
    monkeypatch.setenv("SPECTER_STATIC_MLA", "0")
    assert EngineConfig().cuda_graphs and EngineConfig().tuning.kernels.static_mla


def test_every_tuning_field_is_described_with_where_it_was_measured():
    for section in TuningConfig.model_fields:
        model = TuningConfig.model_fields[section].annotation
        for name, field in model.model_fields.items():
            assert field.description and len(field.description) > 40, f"{section}.{name}"
            assert "journal" in field.description or "tests/" in field.description, f"{section}.{name}: say where it is recorded"


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
                          kernels=KernelTuning(positions_per_split=64))
    seen = {}

    def spy(runtime: Runtime) -> None:
        seen.update(cache=runtime.cache.tuning, transfer=runtime.cache.transfer.tuning, verify=runtime.experts.tuning,
                    kernels=runtime.model.kernels, draft=runtime.draft.model.kernels,
                    cap=runtime.cache.transfer.max_chunks_in_flight)

    run_request(tiny, offloaded(tuning), spy)
    assert seen == {"cache": tuning.cache, "transfer": tuning.transfer, "verify": tuning.verify, "kernels": tuning.kernels,
                    "draft": tuning.kernels, "cap": 3}


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
    "specter/trace.py": {"TRACE_VERSION"},  # the trace format's version
    "specter/builtin.py": {"VERSION"},  # the built-in checkpoints' version
    "specter/calibrate.py": {"DEFAULT_PROMPTS", "DEFAULT_PROMPT_LEN", "DEFAULT_NEW_TOKENS"},  # calibrate_draft's defaults
    "specter/config.py": {"DEFAULT_OVERLAP", "DEFAULT_K"},  # DraftConfig.overlap=None's depth on CUDA; k's default
    "specter/memory.py": {"ALLOCATOR_SLACK_BYTES", "CUDA_LIBRARY_BYTES", "DEFAULT_CONTEXT"},  # measured reserves; max_context's default
    "specter/bench/realism.py": {"BALANCED_ENTROPY", "NEW_TOKENS", "TEMPERATURE", "REUSE_WINDOW", "PROMPTS_PER_KIND"},  # the report's definition
    "specter/bench/widen.py": {"SHARD_BYTES"},  # the written checkpoint's shard size
    "specter/server/app.py": {"DEFAULT_COMPLETION_TOKENS"},  # OpenAI's default max_tokens
    "specter/server/asgi.py": {"CLIENT_GONE"},  # the status counted for a hang-up
    "specter/server/protocol.py": {"MAX_STOP_STRINGS", "SEED_LIMIT"},  # request limits of the API
    "specter/replay.py": {"DEFAULT_LINK_GBPS"},  # the replay CLI's default link
    "specter/sampling.py": {"_MASK32"},  # a bit mask of the noise hash
    "specter/build.py": {"LARGE_CHECKPOINT_BYTES"},  # when loading shows progress on a terminal
    "specter/observers.py": {"MAX_DEFERRED_ROUNDS"},  # bounds the deferred copy-busy backlog (memory), never A/B'd
    "specter/kernel.py": {"_JOIN_TIMEOUT_S"},  # how long close() waits for a waiter thread
    "specter/experts/pool.py": {"_MAX_SLAB_GROWTH"},  # pinned-slab allocation granularity
    "specter/experts/transfer.py": {"TIMER_SLACK_S"},  # the host-paced emulation's timer slack (uvloop's resolution)
    "specter/model/deepseek_v2.py": {"LORA_NORM_EPS"},  # the checkpoint's own RMSNorm epsilon
    "specter/model/transformer.py": {"PACK_ROWS"},  # packed tensors' row alignment for cuBLAS's tensor-core kernels
    "specter/quant/gptq.py": {"GPTQ_WORKING_BYTES"},  # GPTQ's working-memory bound
    "specter/quant/moe_triton.py": {"MAX_PAIRS", "BLOCK_M"},  # the kernels' compile-time shapes
    "specter/bench/cli.py": {"QUICK_RESIDENTS", "QUICK_REPEATS"},  # the quick preset (CLI defaults, not engine knobs)
    "specter/bench/protocol.py": {"PROMPT_TOKENS"},  # the measurement protocol (DESIGN section 8)
    "specter/bench/synthetic.py": {"DISTINCT_EXPERTS"},  # the synthetic models' routing
    "specter/bench/hf_baseline.py": {"MAX_TOKENS"},  # the baseline's length
}
ALLOWED_ENVIRONMENT = {"SPECTER_PLUGINS", "SPECTER_CACHE"}  # plus logging (SPECTER_LOG*, if any)


def _module_switches(path: Path) -> list[str]:
    """Module-level UPPER_CASE names bound to a bool, int, float or None (possibly negated), in `path`."""
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
        for target in targets:
            if scalar and isinstance(target, ast.Name) and target.id.lstrip("_").isupper():
                found.append(target.id)
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
                      'NAME = "x"\nGRAPHS = os.environ.get("SPECTER_CUDA_GRAPHS", "1") != "0"\n')
    assert _module_switches(sample) == ["LEAD_RELAY", "WINDOW", "RATE", "_PRIVATE"]
    assert _environment_reads(sample) == ["SPECTER_CUDA_GRAPHS"]
