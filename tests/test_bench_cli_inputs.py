"""Bad input to `python -m specter.bench` is a one-line error (exit 2) before anything loads or runs."""

from __future__ import annotations

import pytest

from specter.bench import cli

BASE = ["--no-progress", "--no-plots", "--no-hf", "--device", "cpu"]


@pytest.fixture
def no_cells(monkeypatch):
    """A refused run never reaches the matrix; one that does fails here at once instead of running cells."""
    def run_matrix(*args, **kwargs):
        raise AssertionError("the matrix ran: the input was not refused before the work")

    monkeypatch.setattr(cli, "run_matrix", run_matrix)


def refused(argv, tmp_path, capsys) -> str:
    """Run the bench on `argv`; assert exit 2, one `error:` line on stderr and no output folder; the line."""
    out = tmp_path / "out"
    code = cli.main([*BASE, *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    assert not out.exists()
    return err


@pytest.mark.parametrize("link", ["gen9", "0", "-1", "nan", "native2", ","])
def test_a_link_that_is_no_preset_nor_positive_gbps_is_refused(link, tmp_path, capsys, no_cells):
    err = refused([f"--link={link}"], tmp_path, capsys)
    assert err.startswith("error: --link"), err
    if link != ",":
        assert "is not a link preset" in err and "native" in err, err


def test_presets_native_and_gbps_figures_pass_the_link_check():
    args = cli.build_parser().parse_args(["--link", "gen4,GEN3,ddr4-desktop,native,0.25,32"])
    cli.check_args(args)


@pytest.mark.parametrize("residents", ["0", "-2", "4,0", ","])
def test_residents_below_one_are_refused_before_any_model_loads(residents, tmp_path, capsys, no_cells, monkeypatch):
    def no_targets(args):
        raise AssertionError("models were opened before --residents was checked")

    monkeypatch.setattr(cli, "targets_from_args", no_targets)
    err = refused([f"--residents={residents}"], tmp_path, capsys)
    assert err.startswith("error: --residents"), err


@pytest.mark.parametrize("residents", ["99", "17", "4,99"])
def test_residents_above_the_models_experts_are_refused(residents, tmp_path, capsys, no_cells):
    """tiny has 16 experts per MoE layer: 99 would run as 16, labelled residents=99."""
    err = refused(["--model", "tiny", "--residents", residents], tmp_path, capsys)
    assert err.startswith("error: --residents ") and "tiny has 16 experts per MoE layer" in err and "1..16" in err, err


def test_residents_up_to_the_models_experts_pass_below_its_top_k_too(tmp_path):
    """Fewer slots than tiny's top-2 is a rolling window the bench supports (the paper's Phi-3.5-MoE setting)."""
    args = cli.build_parser().parse_args(["--model", "tiny", "--residents", "1,2,16"])
    cli.check_args(args)
    targets, _notes = cli.targets_from_args(args)
    cli.check_residents(args.residents, targets)
    assert [setting.residents for setting in targets[0].settings] == [1, 2, 16]


@pytest.mark.parametrize("argv, message", [
    (["--k=-1"], "--k -1: expected a draft depth of 0..32"),
    (["--k", "33"], "--k 33: expected a draft depth of 0..32"),
    (["--k-max", "1000"], "--k-max 1000: expected a draft depth of 0..32"),
    (["--k-max=-1"], "--k-max -1: expected a draft depth of 0..32"),
    (["--k", "8", "--k-max", "2"], "--k 8 is above --k-max 2"),
    (["--max-new-tokens=-5"], "--max-new-tokens -5: expected 1 or more"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: expected 1 or more"),
    (["--warmup-tokens=-1"], "--warmup-tokens -1: expected 1 or more"),
    (["--warmup-tokens", "0"], "--warmup-tokens 0: expected 1 or more"),
    (["--prompts", "0"], "--prompts 0: expected 1 or more"),
    (["--repeats", "0"], "--repeats 0: expected 1 or more"),
    (["--systems", ","], "--systems: expected a comma-separated list"),
    (["--budget", ","], "--budget: expected a comma-separated list"),
    (["--budget", "1GiB", "--residents", "4"], "--residents and --budget both set"),
    (["--layers", "0"], "--layers 0: expected 1 or more"),
])
def test_bad_counts_and_depths_are_refused_before_anything_runs(argv, message, tmp_path, capsys, no_cells):
    err = refused(argv, tmp_path, capsys)
    assert err.startswith(f"error: {message}"), err


def test_counts_given_are_kept_and_defaults_fill_only_what_is_left_out():
    parse = cli.build_parser().parse_args
    given = cli.options_from_args(parse(["--max-new-tokens", "1", "--repeats", "1", "--warmup-tokens", "1"]))
    assert (given.max_new_tokens, given.repeats, given.warmup_tokens) == (1, 1, 1)
    quick = cli.options_from_args(parse([]))
    assert (quick.max_new_tokens, quick.repeats) == (32, cli.QUICK_REPEATS)


def test_k_max_left_out_follows_a_deeper_k_and_a_given_one_is_kept():
    parse = cli.build_parser().parse_args
    assert (cli.options_from_args(parse([])).k, cli.options_from_args(parse([])).k_max) == (4, 15)
    deep = parse(["--k", "20"])
    cli.check_args(deep)
    assert cli.options_from_args(deep).k_max == 20
    assert cli.options_from_args(parse(["--k", "2", "--k-max", "3"])).k_max == 3


@pytest.mark.parametrize("k_max, k", [("2", 2), ("0", 0), ("15", 4)])
def test_k_left_out_is_the_default_within_a_given_k_max(k_max, k):
    """--k-max 2 alone was refused as '--k 4 is above --k-max 2', naming a --k nobody typed."""
    # at 0, without the systems that draft: with them it is refused (test_bench_options)
    args = cli.build_parser().parse_args(["--k-max", k_max, *(["--systems", "ondemand"] if k_max == "0" else [])])
    cli.check_args(args)
    options = cli.options_from_args(args)
    assert (options.k, options.k_max) == (k, int(k_max))


@pytest.mark.parametrize("argv, fits", [(["--max-new-tokens", "100000"], "give --max-new-tokens 4057 or less"),
                                        (["--max-new-tokens", "4070", "--k-max", "32"], "give --max-new-tokens 4040 or less"),
                                        (["--realism", "--realism-tokens", "5000"], "give --realism-tokens 4080 or less")])
def test_requests_beyond_the_models_positions_are_refused_with_a_length_that_fits(argv, fits, tmp_path, capsys, no_cells):
    """tiny has 4096 positions: every part was skipped, the run exited 0 on 0 requests, and its note said to use
    --max-context, which the bench does not have."""
    err = refused(["--model", "tiny", *argv], tmp_path, capsys)
    assert "tiny has 4096 positions" in err and fits in err and "--max-context" not in err, err


def test_a_run_that_measured_nothing_exits_3_and_its_notes_name_the_benchs_own_options(tmp_path, capsys, monkeypatch):
    """Every part skipped (here: memory) exited 0, and the note's remedy named --max-context, which the bench lacks."""
    from specter.bench import protocol
    from specter.errors import MemoryShortError

    async def too_big(*args, **kwargs):
        raise MemoryShortError("this configuration needs about 87 GiB and the host's available memory is 21 GiB",
                               "lower max_context (--max-context; KV and workspace grow with it), or give residents or budget "
                               "(--residents, --budget)")

    monkeypatch.setattr(protocol.BenchRuntime, "build", too_big)
    out = tmp_path / "out"
    code = cli.main([*BASE, "--model", "tiny", "--systems", "resident,ondemand", "--max-new-tokens", "2",
                     "--warmup-tokens", "1", "--link", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == cli.NOTHING_MEASURED == 3, err
    assert "nothing was measured" in err and "--max-context" not in err and "--budget" not in err, err
    assert "resident part skipped: this configuration needs about 87 GiB" in err and "lower --max-new-tokens" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--threads", "10000"], "--threads 10000: expected 1..1024 torch threads"),
    (["--desktop-threads", "10000"], "--desktop-threads 10000: expected 1..1024 host threads"),
    (["--desktop-threads", "0"], "--desktop-threads 0: expected 1 or more host threads"),
    (["--realism", "--realism-tokens", "0"], "--realism-tokens 0: expected 1 or more"),
    (["--realism", "--realism-tokens=-3"], "--realism-tokens -3: expected 1 or more"),
])
def test_threads_beyond_the_engines_limits_and_no_realism_tokens_are_one_line_errors(argv, message, tmp_path, capsys,
                                                                                       no_cells):
    """--threads 10000 was a pydantic traceback (exit 1) at the first build; --desktop-threads 10000 ran for minutes."""
    err = refused(["--model", "tiny", *argv], tmp_path, capsys)
    assert err.startswith(f"error: {message}"), err


def test_the_thread_limits_are_engine_configs_own():
    from specter.config import EngineConfig

    assert cli._field_bounds(EngineConfig, "threads") == (1, EngineConfig.model_fields["threads"].metadata[-1].le)


@pytest.mark.parametrize("experts, top_k, residents", [(4, 2, 2), (6, 2, 3), (2, 1, 1), (6, 4, 4)])
def test_the_default_residents_are_lowered_below_a_checkpoints_few_experts_with_a_note(experts, top_k, residents,
                                                                                        monkeypatch):
    """A 4-expert checkpoint got cells labelled residents=6 (every expert resident), a 6-expert one compared nothing."""
    import dataclasses

    make = cli.checkpoint_target

    def few_experts(*args, **kwargs):
        target = make(*args, **kwargs)
        target.spec = dataclasses.replace(target.spec, num_experts=experts, top_k=top_k)
        return target

    monkeypatch.setattr(cli, "checkpoint_target", few_experts)
    targets, notes = cli.targets_from_args(cli.build_parser().parse_args(["--model", "tiny"]))
    assert [setting.residents for setting in targets[0].settings] == [residents]
    assert notes == [f"tiny: {experts} experts per MoE layer, so the default of 6 resident would keep every expert on "
                     f"the device; benched at {residents} (give --residents below {experts} to choose)"]
    given, _notes = cli.targets_from_args(cli.build_parser().parse_args(["--model", "tiny", "--residents", "16"]))
    assert [setting.residents for setting in given[0].settings] == [16]  # typed, and checked by check_residents


def test_the_default_residents_stay_where_the_checkpoint_has_more_experts():
    targets, notes = cli.targets_from_args(cli.build_parser().parse_args(["--model", "tiny"]))
    assert [setting.residents for setting in targets[0].settings] == [cli.QUICK_RESIDENTS] and notes == []


@pytest.mark.parametrize("given, kept", [("1,1.0", ["1"]), ("gen4,25,gen5", ["gen4", "gen5"]), ("0.5,native,native", ["0.5", "native"])])
def test_a_link_given_twice_in_two_spellings_is_measured_once(given, kept):
    """`--link 1,1.0` measured the same link twice under two labels (gen4 is 25 GB/s)."""
    args = cli.build_parser().parse_args(["--link", given])
    cli.check_args(args)
    assert args.link == kept


def test_a_comma_separated_model_says_to_repeat_the_option(tmp_path, capsys, no_cells):
    err = refused(["--model", "tiny,/nonexistent"], tmp_path, capsys)
    assert "--model tiny --model /nonexistent" in err and "repeat it" in err, err
