"""The README's quick start as a contract: what it installs, what CI runs, and what `tiny` says it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def quiet_logs_after():
    """specter.cli.main binds the logs to the stderr of the moment (capsys's, closed after the test): rebind them."""
    yield
    from specter import log

    log.configure()


def quick_start_commands() -> list[str]:
    """The lines of the README's quick-start bash block."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the README's quick start has no bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def ci_script() -> list[str]:
    return [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_quick_start_and_ci_do_not_install_the_test_plugin():
    """A user following the README must not get dummy-* plug-ins in their errors and replay tables."""
    installs = [command for line in quick_start_commands() for command in line.split("&&") if "pip install" in command]
    installs += [line for line in ci_script() if "pip install" in line]
    assert any('".[test,bench]"' in command for command in installs), installs
    assert not [command for command in installs if "dummy_plugin" in command], installs


def test_ci_runs_exactly_the_readmes_install_and_test_commands():
    commands = quick_start_commands()
    readme_install = next(part.strip() for part in commands[0].split("&&") if "pip install" in part)
    readme_tests = [line for line in commands if line.startswith("python -m pytest")]
    assert readme_tests == ["python -m pytest -q"], commands
    ci = ci_script()
    assert [line for line in ci if "pytest" in line and not line.startswith("echo")] == readme_tests, ci
    # CI spells pip as `python -m pip` and quietens it; otherwise the same install
    assert _plain(readme_install) in [_plain(line) for line in ci], (readme_install, ci)


def _plain(command: str) -> str:
    return " ".join(word for word in command.split() if word != "-q").removeprefix("python -m ")


def test_the_quick_starts_generate_runs_the_offloaded_speculative_path(tiny, capsys):
    """The first command's generate, as the README spells it, exercises the main job: a draft, a verify and experts
    copied from host memory (with every expert resident there would be no traffic to show)."""
    from specter.cli import main

    generate = next(part.strip() for part in quick_start_commands()[0].split("&&") if " generate " in part)
    args = generate.split()
    assert args[:3] == ["python", "-m", "specter"], generate
    assert main(args[3:]) == 0
    stats = capsys.readouterr().err.strip().splitlines()[-1]
    tokens = int(re.search(r"\[(\d+) tokens", stats).group(1))
    hit_rate = int(re.search(r"hit rate (\d+)%", stats).group(1))
    moved = float(re.search(r"H2D ([\d.]+) MiB", stats).group(1))
    assert tokens == int(args[args.index("--max-new-tokens") + 1]), stats
    assert "acceptance" in stats and hit_rate < 100 and moved > 0, stats


def test_the_readme_names_every_error_the_api_raises():
    """A user catching Specter's errors finds each kind in the README (it named three of ten). Beside specter.errors'
    own, a trace's (`TraceError`, a placement_profile's) reaches the API; `PricingError` does not (the load re-raises
    it as the PluginError it wraps: build.pricing_context)."""
    from specter import errors, trace

    kinds = [value.__name__ for module in (errors, trace) for value in vars(module).values()
             if isinstance(value, type) and issubclass(value, errors.SpecterError)]
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(kinds) >= 10 and [kind for kind in kinds if f"`{kind}`" not in readme] == []


def test_the_readme_says_tiny_has_random_weights():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "random weights" in readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "## Run a real model" in readme


def test_generate_and_info_say_once_that_tiny_has_random_weights(tiny, capsys):
    from specter.cli import main

    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"]) == 0
    generated = capsys.readouterr()
    assert generated.err.count("random weights") == 1 and "gibberish" in generated.err
    assert "random weights" not in generated.out  # --json output stays one clean object
    assert main(["info", "tiny"]) == 0
    assert capsys.readouterr().err.count("random weights") == 1


def test_a_checkpoint_directory_gets_no_builtin_note(tiny, capsys):
    from specter.cli import main

    assert main(["info", str(tiny)]) == 0
    assert "random weights" not in capsys.readouterr().err


def test_the_architecture_page_stands_alone():
    """It refers to nothing a reader of the repository cannot open: no paths above it, no issue numbers."""
    page = (REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert "../shared" not in page and "DESIGN.md" not in page
    assert not re.search(r"\bissues? #?\d+", page, re.I), re.search(r"\bissues? #?\d+", page, re.I)
    for target in re.findall(r"\]\(([^)#]+)", page):
        if not target.startswith("http"):
            assert (REPO_ROOT / "docs" / target).resolve().is_relative_to(REPO_ROOT), target
            assert (REPO_ROOT / "docs" / target).exists(), target


def test_the_readmes_info_example_is_what_info_prints(tmp_path, capsys):
    """README's `info` block for Mixtral-8x7B and its Qwen1.5-MoE and 60/16 GiB figures, from the real shapes'
    configs beside an empty safetensors file (info reads headers only): a change of the planner must change them."""
    import json

    from safetensors.torch import save_file

    from specter.bench.synthetic import shape_config
    from specter.cli import main

    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"\$ python -m specter info \S+ --no-measure\n(.*?)\n```", readme, re.S)
    assert block, "README has no info example"
    expected = [line for line in block.group(1).splitlines()[1:] if not line.endswith("...")]  # the path is the user's

    def info(shape: str, *extra: str) -> str:
        folder = tmp_path / shape
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(shape_config(shape)))
        save_file({}, str(folder / "model.safetensors"))
        assert main(["info", str(folder), "--no-measure", *extra]) == 0
        return capsys.readouterr().out

    printed = info("mixtral-8x7b").splitlines()
    assert [line for line in expected if line not in printed] == []
    assert "minimum budget 11.47 GiB, full residency 33.12 GiB" in " ".join(readme.split())
    qwen = info("qwen1.5-moe-a2.7b")
    assert "minimum budget  11.47 GiB" in qwen and "full residency  33.12 GiB" in qwen
    assert "expert slots per layer 3 (4 in 10 of 32 layers) speculating" in info("mixtral-8x7b", "--budget", "60GiB")
    assert "expert slots per layer 15 (16 in 17 of 24 layers) speculating" in info("qwen1.5-moe-a2.7b", "--budget", "16GiB")
    assert "3 per layer and a fourth in 10 of its 32 layers" in readme
    assert "15 slots per\nlayer and a 16th in 17 of its 24 layers" in readme
