"""`specter info` refuses a checkpoint whose files do not match its config.json as a load refuses it (the same
message, exit status 2), from the safetensors headers alone, before anything is sized by config.json's numbers."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specter.cli import main
from specter.model.checkpoint import Checkpoint
from tests.hf_models import hf_model, rewrite_config, save_fused, save_hf

EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{which}.weight"  # Mixtral's per-expert names


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("ck") / "mixtral")


@pytest.fixture
def ck(mixtral, tmp_path) -> Path:
    """A copy of the Mixtral checkpoint (3 layers, 6 experts, hidden 32) that a test may break."""
    return shutil.copytree(mixtral, tmp_path / "ck")


def edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def error_line(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def drop(name: str):
    return lambda tensors: tensors.pop(name)


def narrow(name: str):
    def edit(tensors):
        tensors[name] = tensors[name][:, :5].contiguous()
    return edit


def to_int(name: str):
    def edit(tensors):
        tensors[name] = tensors[name].to(torch.int8)
    return edit


# (config.json changes, tensor edit, what the message names): each as the reviewer's ck/m_* checkpoints broke it;
# old `info` printed a report with exit status 0 for each
BROKEN = {
    "more layers than the files": ({"num_hidden_layers": 5}, None, "'model.layers.3.input_layernorm.weight' is missing"),
    "a missing expert": ({}, drop(EXPERT.format(layer=0, expert=3, which="w1")), "experts.3.w1.weight' is missing"),
    "an expert of another shape": ({}, narrow(EXPERT.format(layer=0, expert=2, which="w2")), "has shape [32, 5], expected [32, 48]"),
    "integer weights": ({}, to_int(EXPERT.format(layer=1, expert=1, which="w1")), "has dtype torch.int8, expected float32"),
    "a smaller vocabulary": ({"vocab_size": 10}, None, "'model.embed_tokens.weight' has shape [96, 32], expected [10, 32]"),
    "more experts than the files": ({"num_local_experts": 7}, None, "gate.weight' has shape [6, 32], expected [7, 32]"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_info_refuses_what_generate_refuses_with_its_message(case, ck, capsys):
    changes, edit, fragment = BROKEN[case]
    if changes:
        rewrite_config(ck, **changes)
    if edit is not None:
        edit_tensors(ck, edit)
    info = error_line(capsys, "info", str(ck), "--no-measure")
    assert fragment in info, info
    # generate with a cache, so that its memory check passes what it would (the message is the load's, not the plan's)
    assert info == error_line(capsys, "generate", "--model", str(ck), "--residents", "2", "--device", "cpu",
                              "--max-new-tokens", "1", "--prompt-ids", "1,2")


def test_a_hidden_size_the_files_do_not_have_is_refused(ck, capsys):
    """Old `info` printed "full residency 40532396669071360.00 GiB" with exit status 0 (generate refuses this one at
    its memory plan, before the load's check: a plan of 2**40 wide tensors fits no machine)."""
    rewrite_config(ck, hidden_size=2**40)
    info = error_line(capsys, "info", str(ck), "--no-measure")
    assert "'model.embed_tokens.weight' has shape [96, 32], expected [96, 1099511627776] from config.json" in info, info


def test_a_fused_checkpoint_is_checked_as_it_loads(tmp_path, capsys):
    model = hf_model("qwen3_moe")
    path = save_fused(model, tmp_path / "fused")
    assert main(["info", str(path), "--no-measure"]) == 0
    capsys.readouterr()
    fused = [name for name in load_file(str(path / "model.safetensors")) if name.endswith("experts.down_proj")]
    if not fused:
        pytest.skip("this transformers saves per-expert tensors")
    edit_tensors(path, lambda tensors: tensors.__setitem__(fused[0], tensors[fused[0]][:5].contiguous()))
    info = error_line(capsys, "info", str(path), "--no-measure")
    assert f"'{fused[0]}' has shape [5, " in info, info
    assert info == error_line(capsys, "generate", "--model", str(path), "--residents", "2", "--device", "cpu",
                              "--max-new-tokens", "1", "--prompt-ids", "1,2")


def _limited_memory() -> None:  # in the child: an absurd config is a MemoryError there, not the machine's OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("field,value,fragment", [
    ("num_local_experts", 10**9, "expected [1000000000, 32]"),  # was OOM-killed at 24 GB (a cost model over every expert)
    ("num_hidden_layers", 10**7, "'model.layers.3.input_layernorm.weight' is missing"),  # ran for minutes
])
def test_an_absurd_config_is_refused_quickly(field, value, fragment, ck, tmp_path):
    rewrite_config(ck, **{field: value})
    env = {"SPECTER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "specter", "info", str(ck), "--no-measure"], capture_output=True,
                            text=True, env=env, timeout=120, preexec_fn=_limited_memory)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr[-2000:]


def test_info_checks_the_headers_and_reads_no_tensor(mixtral, tmp_path, monkeypatch, capsys):
    """Every tensor of a sharded checkpoint is checked from its header; none is read (a real one's are tens of GB)."""
    sharded = save_hf(hf_model("mixtral"), tmp_path / "sharded", sharded=True)
    checked: list[str] = []
    real_check = Checkpoint.check

    def counting(self, name, shape=None):
        checked.append(name)
        return real_check(self, name, shape)

    def no_read(*args, **kwargs):
        raise AssertionError("info read a tensor's data")

    monkeypatch.setattr(Checkpoint, "check", counting)
    monkeypatch.setattr(Checkpoint, "tensor", no_read)
    for path in (mixtral, sharded):
        checked.clear()
        assert main(["info", str(path), "--no-measure"]) == 0, capsys.readouterr().err
        assert sorted(checked) == sorted(Checkpoint(path).index)  # every tensor, once (Mixtral's files hold no other)


def test_a_config_beside_an_empty_file_is_planned_and_said_unchecked(tmp_path, capsys):
    """Planning a model not downloaded (README's info example is made so): its figures, and a note that nothing was
    checked, since a load refuses the directory."""
    folder = tmp_path / "plan"
    folder.mkdir()
    shutil.copy(Path(save_hf(hf_model("mixtral"), tmp_path / "m")) / "config.json", folder / "config.json")
    save_file({}, str(folder / "model.safetensors"))
    assert main(["info", str(folder), "--no-measure"]) == 0
    captured = capsys.readouterr()
    assert "layers          3 (3 MoE), 6 experts" in captured.out
    assert "holds no tensors" in captured.err and "unchecked" in captured.err
