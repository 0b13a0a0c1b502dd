"""Results: the machine description, per-cell summaries with speedups, JSON, Markdown and the terminal table."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import tempfile
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BASELINES = ("ondemand", "gate-prefetch", "specmoeoff", "exact-prefetch", "resident")
"""Speedups are reported over each of these (their TPOT / this system's TPOT, same model, setting, link and sampling);
`exact-prefetch` means the fastest of its variants. It is no floor (see `exact_prefetch_flags`)."""

CELL_FIELDS = ("model", "setting", "link", "system")
"""What names one cell of the matrix (its status in `cells`, a planned cell in `partial.remaining`)."""

SAME_SCHEDULE = {"specter-fixed": "exact-prefetch", "specter": "exact-prefetch-specter", "ondemand": "exact-prefetch-k0",
                 "gate-prefetch": "exact-prefetch-k0", "scout-k0": "exact-prefetch-k0"}
"""A system -> the exact-prefetch variant that verifies the same rounds (same depths, tokens and routes) as it does."""

COLUMNS = (
    ("model", "model"), ("setting", "setting"), ("link", "link"), ("sampling", "sampling"), ("system", "system"),
    ("tpot_ms", "TPOT ms"), ("ttft_ms", "TTFT ms"), ("x_ondemand", "x ondemand"), ("x_specmoeoff", "x specmoeoff"),
    ("x_exact-prefetch", "x exact"), ("acceptance", "accept"), ("accepted_length", "acc len"), ("window_recall", "recall"),
    ("hit_rate", "hit rate"), ("h2d_mb_per_token", "H2D MB/tok"), ("h2d_decode_mb_per_token", "decode MB/tok"),
    ("floor_decode_mb_per_token", "floor MB/tok"), ("stall_ms_per_token", "stall ms/tok"),
    ("routing_wait_ms_per_token", "routing wait ms/tok"), ("copy_busy", "copy busy"), ("peak_gib", "peak GiB"), ("tokens_equal", "= baseline"),
)


def machine(argv: Sequence[str]) -> dict[str, Any]:
    """What the numbers were measured on, and how they were asked for (`argv`: the bench's arguments)."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(arg) for arg in ["python", "-m", "specter.bench", *argv]),
        "python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": _git_commit(), "source_digest": source_digest(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "gpu_count": torch.cuda.device_count()}
    else:
        info["gpu"] = None
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    """HEAD, with '-dirty' when the working tree differs from it (a copied tree may carry a stale HEAD)."""
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest() -> str:
    """sha256 (16 hex digits) of the engine's Python sources: identifies the code that ran, commit or not."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for folder in ("specter", "policies", "backends"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---- summaries ----------------------------------------------------------------------------------------

def sampling_of(record: dict[str, Any]) -> str:
    """A record's or row's sampling mode (results written before sampled runs existed were all greedy)."""
    return record.get("sampling") or "greedy"


def cell_key(record: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """What one summary row pools: (model, setting, link, sampling, system)."""
    return (record["model"], record["setting"], record["link"], sampling_of(record), record["system"])


def summarize(records: Sequence[dict[str, Any]], apart: set[str] | None = None) -> list[dict[str, Any]]:
    """One row per (model, setting, link, sampling, system): medians of time, pooled ratios, and speedups; `apart`
    gets the "system and baseline" pairs whose speedup is left out because a merge's different parts ran them."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[cell_key(record)].append(record)
    rows = [_row(key, runs) for key, runs in groups.items()]
    found = _add_speedups(rows)
    if apart is not None:
        apart |= found
    return rows


RATIO_DECIMALS = 4
"""A speedup's decimals in the summary, and in the closing line before it prints two: the table prints three
significant figures of the stored ratio, and one rounded to three decimals first (1.6648 to 1.665) printed 1.67 where
the line said 1.66x."""


def reading(summary: Sequence[dict[str, Any]], system: str = "specter", baseline: str = "ondemand") -> str | None:
    """The matrix in one line: `system`'s median TPOT against `baseline`'s in every cell that ran both.

    e.g. "specter vs ondemand (tiny, 6 resident experts/layer): 2.10x lower TPOT at 0.05 GB/s (20.1 vs 42.2 ms), ...".
    None when no cell has both systems.
    """
    by_key = {cell_key(r): r for r in summary}
    parts: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (model, setting, link, sampling, name), row in by_key.items():
        other = by_key.get((model, setting, link, sampling, baseline))
        if name != system or other is None or not row["tpot_ms"]:
            continue
        ratio = round(other["tpot_ms"] / row["tpot_ms"], RATIO_DECIMALS)  # as the table's column: one number, one rounding
        change = f"{ratio:.2f}x lower TPOT" if ratio >= 1 else f"{1 / ratio:.2f}x higher TPOT"
        unit = " GB/s" if is_number(link) else ""
        mode = f", {sampling}" if sampling != "greedy" else ""
        parts[(model, setting)].append(f"{change} at {link}{unit}{mode} ({row['tpot_ms']:.3g} vs {other['tpot_ms']:.3g} ms)")
    if not parts:
        return None
    cells = [f"({model}, {setting.replace('residents=', '')} resident experts/layer): " if setting.startswith("residents=")
             else f"({model}, {setting}): " for model, setting in parts]
    return f"{system} vs {baseline} " + "; ".join(cell + ", ".join(found) for cell, found in zip(cells, parts.values()))


def exact_prefetch_flags(summary: Sequence[dict[str, Any]]) -> list[str]:
    """Cells below the bytes floor of their own rounds (which must never happen), and cells where a system beats
    exact-prefetch: fewer decode bytes per token than the variant that verifies the
    same rounds (SAME_SCHEDULE), or a lower TPOT than the fastest variant. exact-prefetch knows every future route
    but is no floor: with fewer slots than a verify's experts per layer it runs a rolling window in which Belady
    cannot tell an expert this round already used from one it still needs (both are next used "this round"), and its
    prefetch names the round's lowest expert ids, not the first needed. The flags keep that visible."""
    by_key = {cell_key(r): r for r in summary}
    flags = []
    for (model, setting, link, sampling, system), row in by_key.items():
        where = f"{model} {setting} {link} {sampling}: {system}"
        floor, moved = row.get("floor_decode_mb_per_token"), row.get("h2d_decode_mb_per_token")
        if floor is not None and moved is not None and moved < floor:
            flags.append(f"{where} moved {moved} decode MB/token, below the bytes floor of its own rounds ({floor}): "
                         "the floor or the byte accounting is wrong")
        partner = by_key.get((model, setting, link, sampling, SAME_SCHEDULE.get(system, "")))
        mine, theirs = row.get("h2d_decode_mb_per_token"), partner and partner.get("h2d_decode_mb_per_token")
        if mine is not None and theirs is not None and mine < theirs:
            flags.append(f"{where} moves fewer decode bytes ({mine} MB/token) than {partner['system']} ({theirs}) on the same "
                         "rounds: exact-prefetch is no floor on bytes")
        if not system.startswith("exact-prefetch") and (row.get("x_exact-prefetch") or 0) > 1:
            flags.append(f"{where} is faster than every exact-prefetch variant ({row['x_exact-prefetch']}x): exact-prefetch "
                         "is no floor on time")
    return flags


def is_number(text: str) -> bool:
    """Whether a link name is a plain GB/s figure ('0.25') rather than a preset ('gen4')."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _row(key: tuple, runs: list[dict]) -> dict[str, Any]:
    model, setting, link, sampling, system = key
    part = runs[0].get("part")  # a merge's part (one process); a cell's runs are all one part's
    tokens = sum(r["new_tokens"] for r in runs) or 1
    drafted = sum(r.get("drafted", 0) for r in runs)
    recall_total = sum(r.get("recall_total", 0) for r in runs)
    hits = sum(r["hits"] for r in runs)
    lookups = hits + sum(r["misses"] for r in runs)
    histogram = accepted_histogram(runs)
    rounds = sum(histogram.values())
    predictor = [r["predictor_recall"] for r in runs if r.get("predictor_recall") is not None]
    scout_total = sum(r.get("scout_recall_total", 0) for r in runs)
    copy_window = sum(r.get("copy_window_s", 0.0) for r in runs)
    return {
        "model": model, "setting": setting, "link": link, "sampling": sampling, "system": system, "runs": len(runs),
        **({"part": part} if part is not None else {}),
        "slots": runs[0].get("slots"), "extra_slots": runs[0].get("extra_slots"),
        "tpot_ms": round(1e3 * statistics.median(r["tpot_s"] for r in runs), 3),
        "tpot_ms_mean": round(1e3 * statistics.fmean(r["tpot_s"] for r in runs), 3),
        "ttft_ms": round(1e3 * statistics.median(r["ttft_s"] for r in runs), 3),
        "acceptance": round(sum(r.get("accepted", 0) for r in runs) / drafted, 4) if drafted else None,
        "accepted_length": round(sum((n + 1) * c for n, c in histogram.items()) / rounds, 3) if rounds else None,
        "window_recall": round(sum(r.get("recall_hits", 0) for r in runs) / recall_total, 4) if recall_total else None,
        "predictor_recall": round(statistics.fmean(predictor), 4) if predictor else None,
        "scout_recall": round(sum(r.get("scout_recall_hits", 0) for r in runs) / scout_total, 4) if scout_total else None,
        "hit_rate": round(hits / lookups, 4) if lookups else None,
        "h2d_mb_per_token": round(sum(r["h2d_bytes"] for r in runs) / tokens / 1e6, 3),
        "h2d_decode_mb_per_token": decode_mb_per_token(runs),
        "floor_decode_mb_per_token": floor_mb_per_token(runs),
        "stall_ms_per_token": _decode_per_token(runs, "stall_s", "stall_prefill_s", scale=1e3),  # with TPOT
        "routing_wait_ms_per_token": _decode_per_token(runs, "routing_wait_s", "routing_wait_prefill_s", scale=1e3),
        "host_wait_ms_per_token": _decode_per_token(runs, "host_wait_s", "host_wait_prefill_s", scale=1e3),
        "copy_busy": round(sum(r.get("copy_busy_s", 0.0) for r in runs) / copy_window, 4) if copy_window else None,
        "copy_idle": _copy_idle(runs, copy_window),
        "pump_gaps": _pump_gaps(runs),
        "peak_gib": _gpu_gib(runs, "peak_gpu_bytes"),
        "peak_allocated_gib": _gpu_gib(runs, "peak_gpu_allocated_bytes"),
        "peak_inactive_split_gib": _gpu_gib(runs, "peak_gpu_inactive_split_bytes", less_draft=False),
        "planned_gib": _gpu_gib(runs, "planned_gpu_bytes"),
        "host_threads": runs[0].get("host_threads"),
        "host_kernel": (runs[0].get("placement") or {}).get("host_kernel"),
        "host_experts_placed": max((r.get("host_experts_placed", 0) for r in runs), default=0),
        "host_per_token": _decode_per_token(runs, "host_computed_experts", "host_prefill_experts"),
        "host_ms_per_token": _decode_per_token(runs, "host_compute_s", "host_prefill_s", scale=1e3),
        "host_share": _host_share(runs),
        "host_expert_ms": _host_expert_ms(runs),
        "host_expert_ms_calibrated": _calibrated_host_ms(runs[0].get("placement")),  # the first run's, as `placement`
        "host_job_ms_calibrated": _ms((runs[0].get("placement") or {}).get("host_s_per_job")),
        "host_hidden": _host_hidden(runs),
        "tokens_equal": all(r["tokens_equal"] for r in runs),
        "accepted_length_histogram": {str(n): c for n, c in sorted(histogram.items())},
        "depth_histogram": ({str(k): c for k, c in sorted(_counts(runs, "depth_histogram").items())}
                            if all("depth_histogram" in r for r in runs) else None),  # None: runs from before it was kept
        "placement": runs[0].get("placement"),
    }


def _decode_per_token(runs: Sequence[dict], total: str, prefill: str, scale: float = 1.0) -> float | None:
    """A request total (`total`: host experts, or seconds times `scale`) per token after the first, the prompt's
    forward's share (`prefill`) left out as decode MB/token leaves out its bytes: what goes with TPOT. None for runs
    recorded before the prompt's share was kept apart."""
    if any(prefill not in r for r in runs):
        return None
    tokens = _decode_tokens(runs)
    return round(scale * sum(r.get(total, 0) - r[prefill] for r in runs) / tokens, 3) if tokens else None


def _host_share(runs: Sequence[dict]) -> float | None:
    """Of the experts a forward did not find on the device (device-path misses and host computations), the share the
    host computed: the placement's measured split between the two paths (None without either)."""
    host = sum(r.get("host_computed_experts", 0) for r in runs)
    total = host + sum(r["misses"] for r in runs)
    return round(host / total, 4) if total else None


def _host_expert_ms(runs: Sequence[dict]) -> float | None:
    """Milliseconds one host-path expert took on the host thread, averaged over the cell's (None without any): beside
    the calibration's, whether the host path ran slower beside the link (a split placement) than alone (`all`)."""
    host = sum(r.get("host_computed_experts", 0) for r in runs)
    return round(1e3 * sum(r.get("host_compute_s", 0.0) for r in runs) / host, 3) if host else None


def _ms(seconds: float | None) -> float | None:
    return round(1e3 * seconds, 3) if seconds is not None else None


def _calibrated_host_ms(decision: dict | None) -> float | None:
    """Milliseconds of one host expert as the placement's calibration measured it (one block of row_bucket rows, the
    cost model's figure per use), beside `host_expert_ms`, what the cell's host path then took (None: not placed or
    not measured)."""
    by_rows = (decision or {}).get("host_s_per_expert_by_rows") or {}
    return _ms(by_rows.get(str(decision.get("row_bucket"))) if by_rows else None)


def _host_hidden(runs: Sequence[dict]) -> float | None:
    """Share of the host path's seconds that ran beside the device path (`VerifyRecord.host_hidden_s`; None without
    host work): 0 when the two paths ran one after the other."""
    seconds = sum(r.get("host_compute_s", 0.0) for r in runs)
    return round(sum(r.get("host_hidden_s", 0.0) for r in runs) / seconds, 4) if seconds > 0 else None


def accepted_histogram(runs: Sequence[dict]) -> Counter:
    return _counts(runs, "accepted_length_histogram")


def _counts(runs: Sequence[dict], key: str) -> Counter:
    """The runs' histograms under `key` (str keys, as JSON holds them) summed, keyed by int."""
    histogram: Counter = Counter()
    for run in runs:
        histogram.update({int(n): c for n, c in (run.get(key) or {}).items()})
    return histogram


def _gpu_gib(runs: list[dict], key: str, less_draft: bool = True) -> float | None:
    """The cell's own GPU bytes under `key` in GiB, the most of its runs (the allocator's peak reserve, its live
    tensors' peak, its split blocks' peak, or the plan's device bytes), less a shared runtime's draft its system does
    not use (`less_draft`)."""
    peaks = [r[key] - ((r.get("unused_draft_bytes") or 0) if less_draft else 0) for r in runs if r.get(key) is not None]
    return round(max(peaks) / 2**30, 2) if peaks else None


def _add_speedups(rows: list[dict]) -> set[str]:
    """Each row's `x_BASELINE` columns, where one process measured both rows (a merge's part, `merge`); returns the
    "system and baseline" pairs left out because different parts ran them."""
    by_cell = {cell_key(r): r for r in rows}
    resident = {(r["model"], sampling_of(r)): r for r in rows if r["system"] == "resident"}
    apart = set()
    for row in rows:
        mode = sampling_of(row)
        for baseline in BASELINES:
            if baseline == "exact-prefetch":  # the fastest of its variants (k as specter-fixed's, specter's, k=0)
                exact = [r for r in rows if r["system"].startswith("exact-prefetch") and r["model"] == row["model"]
                         and r["setting"] == row["setting"] and r["link"] == row["link"] and sampling_of(r) == mode]
                same = [r for r in exact if r.get("part") == row.get("part")]
                other = min(same or exact, key=lambda r: r["tpot_ms"], default=None)
            else:
                other = (resident.get((row["model"], mode)) if baseline == "resident"
                         else by_cell.get((row["model"], row["setting"], row["link"], mode, baseline)))
            if other is not None and other.get("part") != row.get("part"):
                apart.add(f"{row['system']} and {other['system']}")
                other = None
            ok = other is not None and other["tpot_ms"] > 0 and row["tpot_ms"] > 0
            row[f"x_{baseline}"] = round(other["tpot_ms"] / row["tpot_ms"], RATIO_DECIMALS) if ok else None
    return apart


# ---- merging ----------------------------------------------------------------------------------------------

def merge(directories: Sequence[Path]) -> dict[str, Any]:
    """One payload from several bench outputs (each a directory with results.json), for a matrix that had
    to run in parts (one GPU call per model, say). Their cells must not overlap: a row pools its runs, and
    runs of different sessions are not one measurement. Speedups are recomputed within each model, setting
    and link, so they still compare systems of the same run when each part holds whole cells."""
    from specter.errors import ConfigError
    from specter.paths import json_value

    if not directories:
        raise ConfigError("--merge needs at least one results directory")
    payloads, owner = [], {}
    for index, directory in enumerate(directories):
        # a results.json named for its folder (a natural slip: it is the file merged) is taken as its folder
        path = Path(directory) if Path(directory).name == "results.json" and Path(directory).is_file() else Path(directory) / "results.json"
        try:
            payload = json_value(path.read_text())
            runs = _checked_payload(payload)
        except FileNotFoundError:
            raise ConfigError(f"--merge: {path} does not exist; pass directories written by python -m specter.bench") from None
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"--merge: {path} is not a bench results file ({error})") from None
        except OSError as error:  # a file where the folder should be, a folder named results.json, no permission
            raise ConfigError(f"--merge: {path} cannot be read ({error.strerror or error}); pass the folder of a bench "
                              "output, which holds results.json") from None
        for run in runs:
            key = cell_key(run)
            if owner.setdefault(key, index) != index:
                raise ConfigError(f"--merge: cell {' '.join(key)} is in both {directories[owner[key]]} and {directory}; "
                                  "merge runs of disjoint cells")
        payloads.append(payload)
    # Each run is tagged with its part: a speedup compares two systems' rows only where one process measured both
    # (`_add_speedups`); a part's systems beside another part's would compare two processes, even two machines.
    runs = [run | {"part": index} for index, payload in enumerate(payloads) for run in payload["runs"]]
    parts = [{"directory": str(d), "date": p["machine"].get("date"), "command": p["machine"].get("command"),
              "git_commit": p["machine"].get("git_commit"), "source_digest": p["machine"].get("source_digest"),
              "max_new_tokens": p["options"].get("max_new_tokens"), "quant": p["options"].get("quant", "int4"),
              "placement_profile": p["options"].get("placement_profile"), "repeats": p["options"].get("repeats"),
              "self_profile_tokens": p["options"].get("self_profile_tokens"),
              "k": p["options"].get("k"), "sampling": p["options"].get("sampling"),
              "complete": is_complete(p)} for d, p in zip(directories, payloads)]
    machine = dict(payloads[0]["machine"])
    machine["command"] = " && ".join(str(part["command"]) for part in parts)
    notes = list(dict.fromkeys(note for payload in payloads for note in payload.get("notes", [])))
    if len({part["max_new_tokens"] for part in parts}) > 1:
        notes.append(f"merged parts differ in new tokens per request: {[part['max_new_tokens'] for part in parts]}")
    if len({part["quant"] for part in parts}) > 1:
        notes.append(f"merged parts differ in the draft's expert format: {[part['quant'] for part in parts]}")
    if len({part["placement_profile"] for part in parts}) > 1:  # the options kept are the first part's
        notes.append(f"merged parts placed from different routing traces: {[part['placement_profile'] for part in parts]}")
    for field, what in (("repeats", "requests per prompt"), ("k", "fixed draft depth (--k)"), ("sampling", "sampling modes"),
                        ("warmup_tokens", "warm-up tokens"), ("k_max", "deepest draft (--k-max)"),
                        ("row_bucket", "verify row bucket"), ("threads", "torch threads"), ("tuning", "tuning (--tune)"),
                        ("self_profile_tokens", "tokens of the engine's own routing trace (--self-profile-tokens)")):
        values = [payload["options"].get(field) for payload in payloads]
        if len({json.dumps(value, sort_keys=True) for value in values}) > 1:  # the protocol line is the first part's
            shown = values if field != "tuning" else [f"part {index}" for index in range(len(values))]
            notes.append(f"merged parts differ in {what}: {shown}")
    machines = [(payload["machine"].get("gpu"), payload["machine"].get("cpu")) for payload in payloads]
    if len(set(machines)) > 1:  # the header names the first part's machine
        notes.append(f"merged parts ran on different machines (GPU, CPU): {list(dict.fromkeys(machines))}")
    if len({part["source_digest"] for part in parts}) > 1:
        notes.append("merged parts ran different engine sources (see merged_from)")
    cells = [cell for payload in payloads for cell in payload.get("cells", [])]
    ran = {tuple(cell.get(field) for field in CELL_FIELDS) for cell in cells if cell.get("status") == "ok"}
    # A cell one part skipped (time budget, no room) and another ran: the run stands, the skip and its note go.
    cells = [cell for cell in cells
             if cell.get("status") == "ok" or tuple(cell.get(field) for field in CELL_FIELDS) not in ran]
    notes = [note for note in notes if not any(f"{' '.join(map(str, key))}: skipped" in note for key in ran)]
    ended = {tuple(cell.get(field) for field in CELL_FIELDS) for cell in cells}
    # the hf-accelerate baseline keeps records only, no cell: a part whose records hold it has run it
    ended |= {tuple(run.get(field) for field in CELL_FIELDS) for run in runs}
    remaining = []  # a partial part's cells that no part ended (another part may have run the rest)
    for directory, payload in zip(directories, payloads):
        if is_complete(payload):
            continue
        part = payload.get("partial") or {}
        notes.append(f"merged part {directory} is partial ({part.get('reason', 'no reason recorded')}): "
                     f"{len(part.get('remaining') or [])} of its planned cells had not ended")
        remaining += [cell for cell in part.get("remaining") or [] if tuple(cell.get(field) for field in CELL_FIELDS) not in ended]
    apart: set[str] = set()
    try:
        summary = summarize(runs, apart)
    except (KeyError, TypeError, ValueError) as error:  # a run of the right key but not a measurement
        raise ConfigError(f"--merge: a run of {', '.join(map(str, directories))} is not a bench measurement (field {error}); "
                          "merge results.json files as python -m specter.bench wrote them") from None
    notes += [flag for flag in exact_prefetch_flags(summary) if flag not in notes]  # cells that met only in the merge
    if apart:
        notes.append(f"no x column compares systems run in different parts (processes): {', '.join(sorted(apart))} ran apart, "
                     "so their ratio is left out; run them in one call to compare them")
    merged = {"machine": machine, "options": payloads[0]["options"], "args": payloads[0].get("args", {}),
              "models": list({model.get("label", model.get("name")): model  # one entry per model, the last part's
                              for payload in payloads for model in payload.get("models", [])}.values()),
              "cells": cells, "summary": summary,
              "runs": runs, "notes": notes, "elapsed_s": round(sum(p.get("elapsed_s", 0.0) for p in payloads), 1),
              "merged_from": parts, "complete": not remaining}
    if remaining:
        merged["partial"] = {"reason": "merged from partial parts whose cells no other part ran", "remaining": remaining}
    return merged


def _checked_payload(payload: Any) -> list[dict[str, Any]]:
    """A results.json's runs, once its parts `merge` reads have the types it reads them as (else a KeyError or
    TypeError naming what is wrong, which `merge` reports with the file's name)."""
    if not isinstance(payload, dict):
        raise TypeError(f"a JSON {type(payload).__name__}, not an object")
    if not isinstance(payload.get("machine"), dict) or not isinstance(payload.get("options"), dict):
        raise KeyError("machine and options")  # a stub with runs alone is no bench output either
    for field in ("runs", "cells", "notes", "models"):
        if not isinstance(payload.get(field, []), list):
            raise TypeError(f"{field} is a {type(payload[field]).__name__}, not a list")
    runs = payload["runs"]
    for field, entries, keys in (("runs", runs, ("model", "setting", "link", "system")), ("cells", payload.get("cells", []), CELL_FIELDS),
                                 ("models", payload.get("models", []), ())):
        for number, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise TypeError(f"{field}[{number}] is {json.dumps(entry)[:40]}, not an object")
            if missing := [key for key in keys if not isinstance(entry.get(key), str)]:
                raise KeyError(f"{field}[{number}] has no {', '.join(missing)}")
    return runs


def _copy_idle(runs: Sequence[dict], copy_window: float) -> dict[str, float] | None:
    """The copy stream's idle time by cause as shares of the verify windows (bench --copy-gaps), else None."""
    causes: dict[str, float] = defaultdict(float)
    for run in runs:
        for cause, seconds in (run.get("copy_idle_s") or {}).items():
            causes[cause] += seconds
    return {cause: round(seconds / copy_window, 4) for cause, seconds in causes.items()} if causes and copy_window else None


def decode_mb_per_token(runs: Sequence[dict]) -> float | None:
    """H2D MB per token after the first (the prompt's loads left out: the bytes that go with TPOT); None for runs
    recorded before the prefill's bytes were kept apart."""
    if any("h2d_prefill_bytes" not in r for r in runs):
        return None
    tokens = _decode_tokens(runs)
    return round(sum(r["h2d_bytes"] - r["h2d_prefill_bytes"] for r in runs) / tokens / 1e6, 3) if tokens else None


def _decode_tokens(runs: Sequence[dict]) -> int:
    """The runs' tokens after their first (the prompt's forward makes the first): what TPOT divides."""
    return sum(max(0, r["new_tokens"] - 1) for r in runs)


def floor_mb_per_token(runs: Sequence[dict]) -> float | None:
    """The bytes floor of the rounds these runs verified (systems.decode_floor_loads), per token after the first, as
    decode MB/token is; None where a run has no floor (resident, HF, results from before it was kept)."""
    if any(r.get("h2d_decode_floor_bytes") is None for r in runs):
        return None
    tokens = _decode_tokens(runs)
    return round(sum(r["h2d_decode_floor_bytes"] for r in runs) / tokens / 1e6, 3) if tokens else None


def _pump_gaps(runs: Sequence[dict]) -> dict[str, float] | None:
    """The gaps a late prefetch chunk ended (bench --copy-gaps): how many, the share where the pump had waited for
    room, and the median / 90th percentile of the lag from that room to the issue, in ms; None without any."""
    gaps = [gap for run in runs for gap in run.get("pump_gaps") or []]
    if not gaps:
        return None
    lags = sorted(lag for _late, lag in gaps if lag is not None)
    lates = sorted(late for late, _lag in gaps)

    def pick(values: list[float], q: float) -> float | None:
        return round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 3) if values else None

    return {"gaps": len(gaps), "waited_for_room": round(len(lags) / len(gaps), 3), "late_p50_ms": pick(lates, 0.5),
            "lag_p50_ms": pick(lags, 0.5), "lag_p90_ms": pick(lags, 0.9)}


# ---- writing ----------------------------------------------------------------------------------------------

def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(payload, indent=1, default=str))


def write_text(path: Path, text: str) -> None:
    """Replace the file at `path` whole: write a temporary file beside it, then rename it over (atomic on one file
    system), so a process killed mid-write leaves the previous version, never a torn one."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _cell_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table_lines(rows: Sequence[dict], columns=COLUMNS, markdown: bool = False) -> list[str]:
    header = [title for _, title in columns]
    body = [[_cell_text(row.get(key)) for key, _ in columns] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return lines + ["| " + " | ".join(cells) + " |" for cells in body]
    widths = [max(len(h), *(len(cells[i]) for cells in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*cells) for cells in body]


SHORT_COLUMNS = (("model", "model"), ("setting", "setting"), ("link", "link"), ("sampling", "sampling"), ("system", "system"), ("tpot_ms", "TPOT ms"),
                 ("x_ondemand", "x ondemand"), ("x_specmoeoff", "x specmoeoff"), ("x_exact-prefetch", "x exact"),
                 ("acceptance", "accept"), ("window_recall", "recall"), ("copy_busy", "copy busy"), ("tokens_equal", "= baseline"))


def host_path_lines(summary: Sequence[dict], markdown: bool = False) -> list[str]:
    """The placement's decisions, its host threads and the measured split, one row per cell that placed (cpu-experts,
    hybrids), with host experts or not."""
    rows = [row for row in summary if row.get("host_experts_placed") or row.get("host_threads")]
    if not rows:
        return []
    columns = (("model", "model"), ("setting", "setting"), ("link", "link"), ("sampling", "sampling"), ("system", "system"),
               ("host_threads", "host threads"), ("host_kernel", "host kernel"), ("host_experts_placed", "host experts placed"),
               ("host_share", "host share of non-resident uses"),
               ("host_per_token", "host experts/token"), ("host_ms_per_token", "host ms/token"),
               ("host_expert_ms", "ms per host expert"),
               ("host_expert_ms_calibrated", "calibrated ms (1st run)"), ("host_job_ms_calibrated", "+ ms per job"),
               ("host_hidden", "host hidden"), ("host_wait_ms_per_token", "host wait ms/token"),
               ("routing_wait_ms_per_token", "routing wait ms/token"), ("h2d_decode_mb_per_token", "decode MB/token"),
               ("tpot_ms", "TPOT ms"))
    return ["", "Host path: the host kernel the calibration chose, the placement's host experts (layer, expert pairs), "
            "the share of the experts not on the device that the host computed (the rest were copied), the host experts "
            "and host milliseconds per token after the first (the prompt's left out, as decode MB/token), one host "
            "expert's time on the host thread and as "
            "the placement's calibration measured it (what one more expert adds to a job, and each job's fixed part), the share of the host's time that ran beside the device path "
            "(copies, device experts), and per token after the first the milliseconds the verify waited for host jobs "
            "once their layer's device path was launched and for the layers' routing reads (the device layer by layer); "
            "results.json's `placement` has the cost model's inputs and predictions. A row "
            "pooled from several runs (bench --merge) shows the first run's calibration and `placement`:", ""] + table_lines(
                rows, columns, markdown=markdown)


def copy_idle_lines(summary: Sequence[dict], markdown: bool = False) -> list[str]:
    """The copy stream's idle time in verify windows by cause, one row per cell measured with --copy-gaps."""
    from specter.metrics import IDLE_CAUSES

    rows = [dict(row, **{f"idle_{cause}": row["copy_idle"].get(cause) for cause in IDLE_CAUSES})
            for row in summary if row.get("copy_idle")]
    if not rows:
        return []
    columns = (("model", "model"), ("setting", "setting"), ("link", "link"), ("system", "system"), ("copy_busy", "copy busy"),
               *((f"idle_{cause}", f"idle: {cause}") for cause in IDLE_CAUSES))
    lines = ["", "Copy stream idle in verify windows, share of the windows by cause (--copy-gaps):", ""] + table_lines(
        rows, columns, markdown=markdown)
    pumped = [dict(row, **{f"pump_{key}": value for key, value in row["pump_gaps"].items()}) for row in rows if row.get("pump_gaps")]
    if pumped:
        columns = (("model", "model"), ("setting", "setting"), ("link", "link"), ("system", "system"),
                   ("pump_gaps", "gaps"), ("pump_waited_for_room", "waited for room"), ("pump_late_p50_ms", "late p50 ms"),
                   ("pump_lag_p50_ms", "room to issue p50 ms"), ("pump_lag_p90_ms", "p90 ms"))
        lines += ["", "Gaps a late prefetch chunk ended (the pump's): did it wait for room, and how long after room appeared "
                  "did it issue:", ""] + table_lines(pumped, columns, markdown=markdown)
    return lines


def _profile_text(payload: dict[str, Any]) -> str:
    """The protocol line's word on the routing trace `auto` placed from: bench --placement-profile's, else the engine's
    own where a cell placed from it; nothing without either. A merge keeps the first part's options, so its parts'
    own traces are named (a trace is of one model, and a matrix of several models merges parts that each had their
    own), and a part without one is said to have placed from the engine's own where a cell did."""
    parts = payload.get("merged_from") or [payload["options"]]
    profiles = list(dict.fromkeys(part.get("placement_profile") for part in parts))
    own = any((cell.get("placement") or {}).get("profile") == "own" for cell in payload.get("cells", []))
    # the parts that could have: no trace given, and own traces not turned off (0); older results lack the count
    tokens = sorted({part.get("self_profile_tokens") for part in parts if not part.get("placement_profile")} - {None, 0})
    own_text = (f"the engine's own routing trace ({'/'.join(map(str, tokens)) + ' tokens of its text' if tokens else 'its text'}, "
                "recorded once per model)")
    if profiles == [None]:
        return f"; the speculating hybrids placed from {own_text}" if own else ""
    if len(profiles) == 1:
        return f"; placement from the routing trace `{profiles[0]}`"
    none = f"none ({'the speculating hybrids from ' + own_text if own else 'uniform routing'})"
    return "; placement from the merged parts' routing traces: " + ", ".join(
        f"`{profile}`" if profile else none for profile in profiles)


def _sampling_text(options: dict[str, Any]) -> str:
    from specter.bench.protocol import SAMPLING_MODES

    modes = options.get("sampling") or ["greedy"]
    return " and ".join(mode if mode == "greedy" else f"seeded sampling ({', '.join(f'{k} {v}' for k, v in SAMPLING_MODES[mode].items())}, "
                        "a fixed seed per prompt)" for mode in modes)


REALISM_COLUMNS = (("model", "model"), ("loss", "held-out loss"), ("greedy_repeat", "greedy 4-gram repeat"),
                   ("sampled_repeat", "sampled 4-gram repeat"), ("entropy", "entropy (mean)"), ("min_entropy", "entropy (min)"),
                   ("overlap", "overlap"), ("reuse8", "reuse8"), ("draft_match", "draft match"),
                   ("acceptance_greedy", "accept greedy"), ("acceptance_sampled", "accept sampled"), ("flags", "flags"))


def realism_row(label: str, realism: dict[str, Any]) -> dict[str, Any]:
    """One model's realism report (bench --realism) as a row of REALISM_COLUMNS."""
    mean, draft, repetition = realism["routing"]["mean"], realism["draft"], realism["repetition"]
    return {"model": label, "loss": realism["held_out"]["loss"], "greedy_repeat": repetition["greedy_4gram_repeat"],
            "sampled_repeat": repetition["sampled_4gram_repeat"], "entropy": mean.get("entropy"),
            "min_entropy": realism["routing"]["min_entropy"], "overlap": mean.get("overlap"), "reuse8": mean.get("reuse8"),
            "draft_match": mean.get("draft_match"), "acceptance_greedy": draft["acceptance_greedy"],
            "acceptance_sampled": draft["acceptance_sampled"], "flags": len(realism["flags"])}


def realism_lines(models: Sequence[dict[str, Any]]) -> list[str]:
    rows = [realism_row(model["label"], model["realism"]) for model in models if model.get("realism")]
    if not rows:
        return []
    return ["", "Realism of each checkpoint (--realism; specter.bench.realism: routing means over MoE layers on the "
            "greedy sequences, flags in results.json):", ""] + table_lines(rows, REALISM_COLUMNS, markdown=True)


def partial_lines(payload: dict[str, Any]) -> list[str]:
    """A partial run's warning and the cells it did not end (results.json `complete` false); none when complete."""
    if is_complete(payload):
        return []
    partial = payload.get("partial") or {}
    remaining = partial.get("remaining") or []
    lines = [f"**Partial results** ({partial.get('reason', 'no reason recorded')}): {len(remaining)} planned cell(s) "
             "had not ended" + (":" if remaining else "."), ""]
    if remaining:
        lines += [f"- {' '.join(str(cell.get(field, '?')) for field in ('model', 'setting', 'link', 'system'))}"
                  for cell in remaining] + [""]
    return lines


def is_complete(payload: dict[str, Any]) -> bool:
    """Whether a results payload is of a run that ended (files from before the marker existed were written only then)."""
    return payload.get("complete", True) is not False


def markdown_report(payload: dict[str, Any]) -> str:
    """The Markdown page: machine, command, date, the summary table and the notes."""
    info = payload["machine"]
    lines = [
        "# Specter benchmark results", "",
        f"- date: {info['date']}", f"- command: `{info['command']}`",
        f"- machine: {info.get('gpu') or 'no GPU'}; CPU {info['cpu']} ({info['cpu_count']} threads); torch {info['torch']}, CUDA {info['cuda']}",
        f"- commit: {info.get('git_commit')} (sources {info.get('source_digest')})",
        f"- protocol: batch 1, {_sampling_text(payload['options'])}, {payload['options']['max_new_tokens']} new tokens, {payload['options']['repeats']} repeat(s), "
        f"16-token prompts, warm-up excluded, cache restored per prompt; TPOT = median over requests; "
        f"draft experts {payload['options'].get('quant', 'int4')}{_profile_text(payload)}", "",
    ]
    lines += partial_lines(payload)
    lines += table_lines(payload["summary"], markdown=True)
    lines += copy_idle_lines(payload["summary"], markdown=True)
    lines += host_path_lines(payload["summary"], markdown=True)
    lines += realism_lines(payload.get("models", []))
    if payload.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in payload["notes"]]
    lines += ["", "Columns: x S = TPOT of S / TPOT of this row (same model, setting, link); accept = accepted drafts / drafted; "
              "recall = window recall |draft-predicted ∩ used| / |used|; copy busy = share of transfer-bound verify time "
              "(verify start to its last copy's landing, verifies that waited on a copy) the copy stream was busy; "
              "peak GiB = max reserved GPU memory during the cell, less the draft's bytes where the bench's shared "
              "runtime holds a draft the system does not use; = baseline: tokens equal to the target-only run."]
    return "\n".join(lines) + "\n"
