"""Checkpoints that are unreadable, inconsistent or numerically invalid fail with one clear SpecterError naming the
file and field, from the library and from the command line (`error: ...`, exit status 2), never a traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specter.builtin import BUILTIN
from specter.cli import main
from specter.errors import CheckpointError, PromptError, SpecterError
from specter.model.checkpoint import Checkpoint
from specter.model.spec import spec_from_config
from specter.tokenizer import Tokenizer, train_byte_level_bpe
from tests.hf_models import rewrite_config
from tests.test_families_extra import DEEPSEEK_V2_LITE, PHI_35_MOE

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def ck(tiny, tmp_path) -> Path:
    """A copy of the built-in checkpoint (config, weights, tokenizer) that a test may break."""
    return shutil.copytree(tiny, tmp_path / "ck")


def deny(monkeypatch, target: Path) -> None:
    """Make `target` (a file, or a directory and all it holds) unreadable, as chmod 000 does for a user who is not
    root: opening or stat-ing it raises PermissionError. Tests run as root, where chmod denies nothing."""
    real_open, real_stat, directory = Path.open, Path.stat, target.is_dir()

    def fake_open(self, *args, **kwargs):
        if self == target or target in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    def fake_stat(self, *args, **kwargs):  # a file's mode denies reading it, a directory's also looking inside
        if directory and target in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", fake_open)
    monkeypatch.setattr(Path, "stat", fake_stat)


def cli_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ---- unreadable files -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "."])
def test_unreadable_file_or_directory_says_permission_denied(name, ck, monkeypatch, capsys):
    target = ck / name if name != "." else ck
    deny(monkeypatch, target)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(ck)
    message = str(info.value)
    assert "permission denied" in message and "chmod" in message, message
    assert str(target if target.is_file() else target / "config.json") in message, message
    assert "corrupt" not in message and "No such file" not in message, message
    assert "permission denied" in cli_error(capsys, "info", str(ck))
    assert "permission denied" in cli_error(capsys, "generate", "--model", str(ck), "--max-new-tokens", "1")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "."])
def test_unreadable_tokenizer_files_say_permission_denied(name, ck, monkeypatch):
    target = ck / name if name != "." else ck
    deny(monkeypatch, target)
    with pytest.raises(CheckpointError, match="permission denied") as info:
        Tokenizer.from_dir(ck)
    assert "not valid JSON" not in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "."])
def test_chmod_000_says_permission_denied(name, ck):
    target = ck / name if name != "." else ck
    target.chmod(0)
    try:
        with pytest.raises(CheckpointError, match="permission denied"):
            Checkpoint(ck)
    finally:
        target.chmod(0o755)


# ---- config.json fields -------------------------------------------------------------------------------------
def tiny_config(**changes) -> dict:
    return {key: value for key, value in (BUILTIN["tiny"] | changes).items() if value is not None}


@pytest.mark.parametrize("changes,field", [
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id"),
    ({"eos_token_id": 2.5}, "eos_token_id"),
    ({"rope_theta": "x"}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": [1]}}, "rope_theta"),
    ({"rope_parameters": "default"}, "rope_parameters"),
    ({"rope_scaling": ["linear"]}, "rope_scaling"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}}, "factor"),
])
def test_wrongly_typed_fields_name_the_field(changes, field):
    with pytest.raises(CheckpointError, match=f"config field '{field}' = .* should be of type"):
        spec_from_config(tiny_config(**changes))


def test_eos_ids_are_read():
    assert spec_from_config(tiny_config(eos_token_id=[3, 4])).eos_token_ids == (3, 4)
    assert spec_from_config(tiny_config(eos_token_id=5)).eos_token_ids == (5,)
    vocab = BUILTIN["tiny"]["vocab_size"]
    assert spec_from_config(tiny_config(eos_token_id=[0, vocab - 1])).eos_token_ids == (0, vocab - 1)
    # many real configs say no eos: null, absent or an empty list, each as none
    assert spec_from_config(BUILTIN["tiny"] | {"eos_token_id": None}).eos_token_ids == ()
    assert spec_from_config(tiny_config(eos_token_id=None)).eos_token_ids == ()
    assert spec_from_config(tiny_config(eos_token_id=[])).eos_token_ids == ()


@pytest.mark.parametrize("eos", [-1, -2, 512, 10**30, [3, -1], [3, 512]])
def test_an_eos_id_outside_the_vocabulary_is_refused_naming_file_and_field(eos, ck, capsys):
    """An eos id of -1 or past the vocabulary loaded, and generation never stopped there: no such token is sampled."""
    assert BUILTIN["tiny"]["vocab_size"] == 512
    with pytest.raises(CheckpointError) as info:
        spec_from_config(tiny_config(eos_token_id=eos), "ck/config.json")
    message = str(info.value)
    assert message.startswith("ck/config.json: config field 'eos_token_id' = ") and repr(eos) in message, message
    assert "vocabulary of 512 (0 to 511)" in message and "or null for none" in message, message
    rewrite_config(ck, eos_token_id=eos)
    with pytest.raises(CheckpointError, match="config field 'eos_token_id'") as info:
        Checkpoint(ck)
    assert str(ck / "config.json") in str(info.value)
    assert "'eos_token_id'" in cli_error(capsys, "info", str(ck))


@pytest.mark.parametrize("field,value", [
    ("rope_theta", -1), ("rope_theta", 0), ("rms_norm_eps", -1), ("rms_norm_eps", 0), ("num_attention_heads", -4),
    ("max_position_embeddings", 0), ("hidden_size", 0), ("vocab_size", -1), ("num_hidden_layers", 0),
    ("num_key_value_heads", 0), ("num_experts", 0), ("num_experts_per_tok", 0), ("moe_intermediate_size", -8),
    ("intermediate_size", 0), ("shared_expert_intermediate_size", -1), ("head_dim", 0), ("rms_norm_eps", float("nan")),
    ("rope_theta", float("inf")), ("rope_theta", 10**400),  # 400 digits overflowed float(): a traceback
])
def test_out_of_range_fields_name_file_field_and_value(field, value):
    with pytest.raises(CheckpointError) as info:
        spec_from_config(tiny_config(**{field: value}), "ck/config.json")
    message = str(info.value)
    assert message.startswith("ck/config.json: ") and f"'{field}' = {value!r:.40}" in message, message


def test_fewer_positions_than_the_shortest_context_are_refused_when_read(ck, capsys):
    """max_position_embeddings 4 ran at a context of 4, below the engine's floor of 8, and left no --max-context to
    give (4 was refused as below 8, 8 as beyond the model's positions)."""
    with pytest.raises(CheckpointError, match=r"'max_position_embeddings' = 4 is less than 8, the shortest context"):
        spec_from_config(tiny_config(max_position_embeddings=4), "ck/config.json")
    assert spec_from_config(tiny_config(max_position_embeddings=8), "ck/config.json").max_position == 8
    rewrite_config(ck, max_position_embeddings=4)
    assert main(["generate", "--model", str(ck), "--device", "cpu", "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    assert "'max_position_embeddings' = 4 is less than 8" in capsys.readouterr().err


@pytest.mark.parametrize("scaling,fragment", [({"type": "linear", "factor": 0}, "'factor' = 0 must be positive"),
                                              ({"type": "linear"}, "'factor' is missing")])
def test_linear_rope_scaling_needs_a_positive_factor(scaling, fragment):
    with pytest.raises(CheckpointError, match=f"config.json \\(rope_scaling\\): config field {fragment}"):
        spec_from_config(tiny_config(rope_scaling=scaling))


def test_head_dim_implied_by_too_many_heads_is_refused():
    with pytest.raises(CheckpointError, match="head_dim 0"):
        spec_from_config(tiny_config(hidden_size=4, num_attention_heads=8, num_key_value_heads=8))


@pytest.mark.parametrize("base,field,value", [
    (PHI_35_MOE, "router_jitter_noise", -0.1), (PHI_35_MOE, "rms_norm_eps", 0), (PHI_35_MOE, "sliding_window", 0),
    (PHI_35_MOE, "original_max_position_embeddings", 0), (DEEPSEEK_V2_LITE, "kv_lora_rank", 0),
    (DEEPSEEK_V2_LITE, "qk_rope_head_dim", -2), (DEEPSEEK_V2_LITE, "v_head_dim", 0), (DEEPSEEK_V2_LITE, "n_routed_experts", 0),
    (DEEPSEEK_V2_LITE, "n_shared_experts", -1), (DEEPSEEK_V2_LITE, "q_lora_rank", 0), (DEEPSEEK_V2_LITE, "rope_theta", -1),
])
def test_family_readers_check_ranges_too(base, field, value):
    with pytest.raises(CheckpointError, match=f"'{field}' = {value!r}"):
        spec_from_config(base | {field: value})


def test_group_limited_gate_with_zero_groups_is_refused():
    with pytest.raises(CheckpointError, match="'n_group' = 0"):
        spec_from_config(DEEPSEEK_V2_LITE | {"topk_method": "group_limited_greedy", "n_group": 0})


def test_deepseek_yarn_with_zero_original_positions_is_refused():
    scaling = DEEPSEEK_V2_LITE["rope_scaling"] | {"original_max_position_embeddings": 0}
    with pytest.raises(CheckpointError, match="'original_max_position_embeddings' = 0"):
        spec_from_config(DEEPSEEK_V2_LITE | {"rope_scaling": scaling})


def test_phimoe_rope_factor_that_is_not_a_number_is_refused():
    scaling = PHI_35_MOE["rope_scaling"] | {"short_factor": ["x"] * 64}
    with pytest.raises(CheckpointError, match="short_factor"):
        spec_from_config(PHI_35_MOE | {"rope_scaling": scaling})


def test_negative_heads_from_the_command_line(ck, capsys):
    rewrite_config(ck, num_attention_heads=-4)
    assert "'num_attention_heads' = -4" in cli_error(capsys, "info", str(ck))


# ---- shard index and duplicate tensors ----------------------------------------------------------------------
@pytest.mark.parametrize("weight_map", [[1, 2], {"lm_head.weight": 1}, "model.safetensors"])
def test_malformed_weight_map(weight_map, ck, capsys):
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: malformed shard index"):
        Checkpoint(ck)
    assert "malformed shard index" in cli_error(capsys, "info", str(ck))


def test_tensor_in_two_files_without_an_index_is_refused(ck, capsys):
    save_file({"lm_head.weight": torch.zeros(512, 128)}, str(ck / "model_old.safetensors"))
    with pytest.raises(CheckpointError) as info:
        Checkpoint(ck)
    message = str(info.value)
    assert all(part in message for part in ("'lm_head.weight'", "model.safetensors", "model_old.safetensors", "index")), message
    assert "lm_head.weight" in cli_error(capsys, "info", str(ck))


def test_an_index_says_which_file_holds_a_duplicated_tensor(ck):
    from safetensors import safe_open

    save_file({"lm_head.weight": torch.zeros(512, 128), "extra.weight": torch.zeros(1)}, str(ck / "model_old.safetensors"))
    with safe_open(str(ck / "model.safetensors"), framework="pt") as handle:
        weight_map = dict.fromkeys(handle.keys(), "model.safetensors") | {"extra.weight": "model_old.safetensors"}
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    checkpoint = Checkpoint(ck)
    assert checkpoint.index["lm_head.weight"] == ck / "model.safetensors"
    assert checkpoint.tensor("lm_head.weight").abs().sum() > 0


# ---- chat templates -------------------------------------------------------------------------------------------
def with_template(ck: Path, template: str) -> Tokenizer:
    settings_file = ck / "tokenizer_config.json"
    settings_file.write_text(json.dumps(json.loads(settings_file.read_text()) | {"chat_template": template}))
    tokenizer = Tokenizer.from_dir(ck)
    assert tokenizer is not None
    return tokenizer


def test_chat_template_syntax_error_names_the_file(ck):
    tokenizer = with_template(ck, "{{ foo(")
    with pytest.raises(PromptError) as info:
        tokenizer.apply_chat_template(MESSAGES)
    message = str(info.value)
    assert "tokenizer_config.json" in message and "chat_template" in message and "line 1" in message, message


def test_chat_template_failing_while_rendering_is_a_prompt_error(ck):
    tokenizer = with_template(ck, "{{ messages[5].content }}")
    with pytest.raises(PromptError, match="tokenizer_config.json.*chat_template.*messages.*5"):
        tokenizer.apply_chat_template(MESSAGES)


def test_chat_template_jinja_file_is_named(ck):
    (ck / "chat_template.jinja").write_text("{{ 1 / 0 }}")
    tokenizer = Tokenizer.from_dir(ck)
    with pytest.raises(PromptError, match="chat_template.jinja.*ZeroDivisionError"):
        tokenizer.encode_chat(MESSAGES)


def test_broken_chat_template_from_the_command_line(ck, capsys):
    with_template(ck, "{{ foo(")
    message = cli_error(capsys, "generate", "--model", str(ck), "--chat", "--prompt", "hi", "--max-new-tokens", "1")
    assert "chat_template" in message


def test_template_that_refuses_still_says_why():
    tokenizer = Tokenizer(train_byte_level_bpe(["abc"], 300), chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(SpecterError, match="refused the messages: only user turns"):
        tokenizer.apply_chat_template(MESSAGES)


def test_tokenizer_config_that_is_not_an_object_is_refused(ck):
    (ck / "tokenizer_config.json").write_text("[]")
    with pytest.raises(CheckpointError, match="tokenizer_config.json.*object"):
        Tokenizer.from_dir(ck)
