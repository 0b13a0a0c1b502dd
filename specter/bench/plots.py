"""PNG plots of a results payload (matplotlib, headless): TPOT, speedups, acceptance, recall by layer, link sweep."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from specter.bench.report import accepted_histogram, is_number
from specter.experts.transfer import LINK_PRESETS

NATIVE_GBPS = LINK_PRESETS["gen5"]  # 'native' (no emulation) is plotted as the GPU machine's PCIe Gen5 link


PLOT_FILES = ("tpot_by_system.png", "speedup.png", "acceptance.png", "accepted_length_hist.png", "recall_by_layer.png",
              "tpot_vs_link.png")
"""Every plot a run may write, in `write_plots`' order."""


def remove_plots(out: Path) -> None:
    """Delete the plots an earlier run left in `out`: a run that draws fewer (other systems, a stop, --no-plots) must
    not leave them beside results they do not show."""
    for name in PLOT_FILES:
        (out / name).unlink(missing_ok=True)


def write_plots(payload: dict, out: Path) -> list[str]:
    """Write every plot the data allows (any other of PLOT_FILES in `out` is removed); returns the names written."""
    import matplotlib

    matplotlib.use("Agg")
    # The plots draw one sampling mode: greedy where it ran (the protocol's), else the first there is.
    modes = [row.get("sampling") or "greedy" for row in payload["summary"]]
    mode = "greedy" if "greedy" in modes or not modes else modes[0]
    summary = [row for row in payload["summary"] if (row.get("sampling") or "greedy") == mode]
    runs = [run for run in payload["runs"] if (run.get("sampling") or "greedy") == mode]
    written = []
    remove_plots(out)
    drawers = (_tpot_by_system, _speedups, _acceptance, _accepted_lengths, _recall_by_layer, _tpot_vs_link)
    for name, plot in zip(PLOT_FILES, drawers, strict=True):
        figure = plot(summary, runs)
        if figure is not None:
            figure.tight_layout()
            figure.savefig(out / name, dpi=120, bbox_inches="tight")  # "tight": the legends sit outside the axes
            written.append(name)
            import matplotlib.pyplot as plt

            plt.close(figure)
    return written


def _cells(summary: list[dict]) -> list[tuple[str, str, str]]:
    return sorted({(r["model"], r["setting"], r["link"]) for r in summary if r["setting"] != "all"})


def _systems(summary: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["system"] for r in summary))


def link_label(link: str) -> str:
    """'0.25' -> '0.25 GB/s', 'gen4' -> 'gen4 (25 GB/s)': every link with its unit."""
    gbps = link_gbps(link)
    if gbps is None:
        return link
    return f"{gbps:g} GB/s" if is_number(link) else f"{link} ({gbps:g} GB/s)"


def cell_label(model: str, setting: str, link: str) -> str:
    """One bar group's label: the model, its memory setting in words, the link with its unit."""
    setting = setting.replace("residents=", "") + " resident experts/layer" if setting.startswith("residents=") else setting
    return f"{model}\n{setting}\n{link_label(link)}" if link != "-" else f"{model}\n{setting}"


def _legend_outside(ax) -> None:
    """The legend right of the axes, so it never hides a bar or a line."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _integer_axis(axis) -> None:
    """Counts (layers, accepted drafts, rounds) get whole-number ticks only."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _bars(ax, groups: list[str], series: dict[str, list[float | None]]) -> None:
    """One bar per group and series; a value that is None (a cell that did not run, a baseline not in the run) gets
    no bar, and a series with none no place in the legend: a bar at 0 would read as a measured TPOT or speedup of 0."""
    series = {label: values for label, values in series.items() if any(v is not None for v in values)}
    width = 0.8 / max(1, len(series))
    for index, (label, values) in enumerate(series.items()):
        drawn = [(g + index * width, v) for g, v in enumerate(values) if v is not None]
        ax.bar([x for x, _ in drawn], [v for _, v in drawn], width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, fontsize=7)
    ax.set_xlabel("model, memory setting, host link (GB/s)")
    if series:
        _legend_outside(ax)


def _tpot_by_system(summary: list[dict], runs: list[dict]):
    import matplotlib.pyplot as plt

    cells = _cells(summary)
    if not cells:
        return None
    by_key = {(r["model"], r["setting"], r["link"], r["system"]): r for r in summary}
    resident = {r["model"]: r["tpot_ms"] for r in summary if r["system"] == "resident"}
    systems = [s for s in _systems(summary) if s != "resident"]
    series = {s: [by_key.get((*cell, s), {}).get("tpot_ms") for cell in cells] for s in systems}
    if resident:
        series["resident"] = [resident.get(cell[0]) for cell in cells]
    figure, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
    _bars(ax, [cell_label(*cell) for cell in cells], series)
    ax.set_ylabel("TPOT (ms, lower is better)")
    ax.set_title("Time per output token by system")
    return figure


def _speedups(summary: list[dict], runs: list[dict]):
    import matplotlib.pyplot as plt

    rows = [r for r in summary if r["system"] == "specter"]
    if not rows:
        return None
    baselines = ["x_ondemand", "x_gate-prefetch", "x_specmoeoff", "x_exact-prefetch", "x_resident"]
    figure, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    _bars(ax, [cell_label(r["model"], r["setting"], r["link"]) for r in rows], {b[2:]: [r.get(b) for r in rows] for b in baselines})
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("specter speedup (x; baseline TPOT / specter TPOT)")
    ax.set_title("Speedup of specter over each baseline")
    return figure


def _acceptance(summary: list[dict], runs: list[dict]):
    import matplotlib.pyplot as plt

    rows = [r for r in summary if r.get("acceptance") is not None]
    if not rows:
        return None
    cells = sorted({(r["model"], r["setting"], r["link"]) for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by_key = {(r["model"], r["setting"], r["link"], r["system"]): r for r in rows}
    figure, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
    _bars(ax, [cell_label(*c) for c in cells], {s: [by_key.get((*c, s), {}).get("acceptance") for c in cells] for s in systems})
    ax.set_ylim(0, 1)
    ax.set_ylabel("acceptance (fraction of drafted tokens)")
    ax.set_title("Draft acceptance")
    return figure


def _accepted_lengths(summary: list[dict], runs: list[dict]):
    import matplotlib.pyplot as plt

    per_system = defaultdict(list)
    for run in runs:
        if run.get("accepted_length_histogram"):
            per_system[run["system"]].append(run)
    if not per_system:
        return None
    figure, axes = plt.subplots(1, len(per_system), figsize=(3.2 * len(per_system), 3), squeeze=False)
    for ax, (system, system_runs) in zip(axes[0], per_system.items()):
        histogram = accepted_histogram(system_runs)
        ax.bar(list(histogram), list(histogram.values()))
        ax.set_title(system, fontsize=9)
        ax.set_xlabel("accepted drafts per round")
        _integer_axis(ax.xaxis)
        _integer_axis(ax.yaxis)
    axes[0][0].set_ylabel("rounds")
    return figure


def _recall_by_layer(summary: list[dict], runs: list[dict]):
    import matplotlib.pyplot as plt

    lines: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for run in runs:
        if run["system"] in ("specter", "specmoeoff") and run.get("recall_by_layer"):
            for layer, (hits, total) in run["recall_by_layer"].items():
                entry = lines[f"{run['model']} {run['setting']} {run['system']}"][int(layer)]
                entry[0] += hits
                entry[1] += total
    if not lines:
        return None
    figure, ax = plt.subplots(figsize=(7, 4))
    for label, layers in lines.items():
        order = sorted(layers)
        ax.plot(order, [layers[l][0] / layers[l][1] if layers[l][1] else 0.0 for l in order], marker="o", label=label)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("MoE layer (index)")
    _integer_axis(ax.xaxis)
    ax.set_ylabel("window recall (fraction)")
    ax.set_title("Draft-predicted experts that verify used, by layer")
    _legend_outside(ax)
    return figure


def link_gbps(link: str) -> float | None:
    if link == "native":
        return NATIVE_GBPS
    try:
        return LINK_PRESETS.get(link) or float(link)
    except ValueError:
        return None


def _tpot_vs_link(summary: list[dict], runs: list[dict]):
    import matplotlib.pyplot as plt

    links = {r["link"] for r in summary if link_gbps(r["link"]) is not None}
    if len(links) < 2:
        return None
    panels = sorted({(r["model"], r["setting"]) for r in summary if r["setting"] != "all"})
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (model, setting) in zip(axes[0], panels):
        for system in _systems(summary):
            points = sorted((link_gbps(r["link"]), r["tpot_ms"]) for r in summary
                            if r["model"] == model and r["setting"] == setting and r["system"] == system and link_gbps(r["link"]))
            if points:
                ax.plot(*zip(*points), marker="o", label=system)
        measured = sorted({link_gbps(r["link"]) for r in summary if r["model"] == model and link_gbps(r["link"])})
        ax.set_xscale("log")  # links span decades (0.02 GB/s emulated to 55 GB/s native); ticks where measured
        ax.set_xticks(measured, [f"{gbps:g}" for gbps in measured])
        ax.minorticks_off()
        ax.set_xlabel("host link bandwidth (GB/s)")
        ax.set_title(cell_label(model, setting, "-").replace("\n", ", "), fontsize=9)
    axes[0][0].set_ylabel("TPOT (ms, lower is better)")
    _legend_outside(axes[0][-1])
    return figure
