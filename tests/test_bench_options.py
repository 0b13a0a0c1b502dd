"""Options of `python -m specter.bench` that ran an empty or pooled matrix, or failed after the work, and figures drawn
where nothing was measured. CPU, the built-in tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from specter.bench import cli, protocol
from specter.bench.plots import PLOT_FILES

BASE = ["--no-progress", "--no-plots", "--no-hf"]
SMALL = ["--max-new-tokens", "4", "--warmup-tokens", "2", "--link", "1", "--repeats", "1"]


@pytest.fixture
def no_cells(monkeypatch):
    """A refused run never reaches the matrix; one that does fails here at once instead of running cells."""
    def run_matrix(*args, **kwargs):
        raise AssertionError("the matrix ran: the input was not refused before the work")

    monkeypatch.setattr(cli, "run_matrix", run_matrix)


def refused(argv, out, capsys) -> str:
    """Run the bench on `argv` into `out`; assert exit 2 and one `error:` line on stderr; the line."""
    code = cli.main([*BASE, *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_before_anything_runs(tmp_path, capsys, no_cells):
    # every part was skipped with a note, and the run exited 0 with no results
    err = refused(["--device", "cuda"], tmp_path / "out", capsys)
    assert "CUDA is not available" in err and not (tmp_path / "out").exists()


def test_k_max_zero_with_a_system_that_drafts_is_refused(tmp_path, capsys, no_cells):
    # the shared runtime was built without a draft: the whole offloaded part, ondemand too, was skipped, exit 0
    err = refused(["--k-max", "0", "--systems", "ondemand,specter"], tmp_path / "out", capsys)
    assert "--k-max 0" in err and "specter" in err and "ondemand" not in err
    plain = cli.options_from_args(cli.build_parser().parse_args(["--k-max", "0", "--systems", "ondemand"]))
    assert plain.k_max == 0


def test_k_zero_still_runs_the_systems_that_choose_their_own_depth(tmp_path):
    """--k is the depth of specter-fixed and exact-prefetch; at 0 the runtime was built without a draft, so specter
    (the roofline's depth) and every other offloaded cell were skipped and the run exited 0."""
    out = tmp_path / "out"
    assert cli.main([*BASE, *SMALL, "--k", "0", "--systems", "ondemand,specter,specter-fixed", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [(cell["system"], cell["status"]) for cell in results["cells"]] == [
        ("ondemand", "ok"), ("specter", "ok"), ("specter-fixed", "ok")]
    assert all(row["tokens_equal"] for row in results["summary"])


def test_a_value_given_twice_names_its_cells_once():
    """`--link 1,1` ran each cell twice and pooled both measurements into one summary row (twice the runs)."""
    args = cli.build_parser().parse_args(["--link", "1,0.5,1", "--systems", "ondemand,specter,ondemand",
                                          "--residents", "6,4,6", "--sampling", "greedy,greedy"])
    assert (args.link, args.systems, args.residents) == (["1", "0.5"], ["ondemand", "specter"], [6, 4])
    options = cli.options_from_args(args)
    assert options.links == ["1", "0.5"] and options.systems == ["ondemand", "specter"]
    budgets = cli.build_parser().parse_args(["--budget", "1GiB,1024MiB,2GiB"]).budget
    assert budgets == [2**30, 2**31]


def test_two_models_of_one_label_are_refused(tmp_path, capsys, no_cells):
    # their records were filed under one label and pooled into one row per cell
    err = refused(["--model", "tiny", "--model", "tiny"], tmp_path / "out", capsys)
    assert "two models are labelled tiny" in err


def test_layers_without_a_synthetic_shape_is_refused(tmp_path, capsys, no_cells):
    # it was dropped without a word: the run benched tiny whole under its plain label
    err = refused(["--layers", "2"], tmp_path / "out", capsys)
    assert "--layers 2" in err and "tiny" in err


@pytest.mark.parametrize("name", ["results.json", "results.md", "speedup.png"])
def test_a_folder_where_the_bench_writes_a_file_is_refused_before_the_work(name, tmp_path, capsys, no_cells):
    # results.json as a folder: a traceback and exit 1 (the status of tokens that differ) at the first write; a plot's
    # name: the same after the whole matrix had run
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    err = refused([], out, capsys)
    assert str(out / name) in err and "is a folder" in err


def test_a_merge_into_a_folder_of_an_earlier_run_leaves_none_of_its_plots(tmp_path):
    part = tmp_path / "part"
    assert cli.main([*BASE, *SMALL, "--model", "tiny", "--systems", "resident", "--out", str(part)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    for name in PLOT_FILES:
        (out / name).write_bytes(b"an earlier run's plot")
    assert cli.main(["--merge", str(part), "--no-plots", "--out", str(out)]) == 0
    assert not [name for name in PLOT_FILES if (out / name).exists()]
    assert json.loads((out / "results.json").read_text())["complete"] is True


def test_a_plot_draws_no_bar_where_nothing_was_measured():
    """A baseline not in the run had a zero-height speedup bar and a legend entry, and a cell that did not run (time
    budget) a TPOT bar at 0 ms."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specter.bench import plots

    summary = [{"model": "tiny", "setting": "residents=6", "link": link, "system": system, "tpot_ms": tpot,
                "x_ondemand": x, "x_resident": None} for link, system, tpot, x in (
        ("0.02", "ondemand", 80.0, 1.0), ("0.02", "specter", 40.0, 2.0), ("0.1", "ondemand", 20.0, 1.0))]
    speedup = plots._speedups(summary, [])
    labels = [text.get_text() for text in speedup.axes[0].get_legend().get_texts()]
    assert labels == ["ondemand"]
    tpot = plots._tpot_by_system(summary, [])
    heights = sorted(patch.get_height() for patch in tpot.axes[0].patches)
    assert heights == [20.0, 40.0, 80.0]  # specter at 0.1 GB/s did not run: no bar
    plt.close(speedup)
    plt.close(tpot)


def test_the_progress_bar_counts_the_cells_the_matrix_runs():
    # it counted the resident system among the offloaded cells: the quick matrix's bar ended at 5 of 7
    args = cli.build_parser().parse_args(["--no-hf"])
    targets, _notes = cli.targets_from_args(args)
    options = cli.options_from_args(args)
    bench = protocol.ModelBench(targets[0], options, None)
    try:
        assert bench.bar.total == 1 + len(options.links) * 2
    finally:
        bench.bar.close()
