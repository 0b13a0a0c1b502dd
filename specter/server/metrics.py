"""The server's Prometheus metrics, written in the text exposition format (version 0.0.4) by hand.

Hand-written rather than prometheus_client: one engine per process and a dozen series need no registry,
no multiprocess mode and no global state to reset between tests, and the format is a few lines of text.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping

from specter.metrics import RequestStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus histograms are."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name, self.help = name, help_text
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*map(_number, self.bounds), "+Inf"), self.counts):
            cumulative += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        return out + [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]


class ServerMetrics:
    """Totals over the server's life: latency histograms, the engine's speculation and transfer counters."""

    def __init__(self) -> None:
        self.ttft = Histogram("specter_time_to_first_token_seconds",
                              "Time from a request's arrival (queueing included) to its first token.", TTFT_BUCKETS)
        self.tpot = Histogram("specter_time_per_output_token_seconds",
                              "Mean time per token after the first, one observation per request.", TPOT_BUCKETS)
        self.queue_wait = Histogram("specter_queue_wait_seconds", "Time a request waited for the engine.", TTFT_BUCKETS)
        self.responses: Counter[tuple[str, str]] = Counter()  # (endpoint, HTTP status) -> count
        self.finished: Counter[str] = Counter()  # finish reason -> count
        self.prompt_tokens = self.new_tokens = self.drafted = self.accepted = 0
        self.hits = self.misses = self.h2d_bytes = 0
        self.stall_s = 0.0
        self.accepted_lengths: Counter[int] = Counter()

    def response(self, endpoint: str, status: int) -> None:
        self.responses[(endpoint, str(status))] += 1

    def request_done(self, stats: RequestStats | None, reason: str) -> None:
        """An admitted request ended (finished, cancelled or failed); `stats` when it reached the engine."""
        self.finished[reason] += 1
        if stats is None:
            return
        self.prompt_tokens += stats.prompt_tokens
        self.new_tokens += stats.new_tokens
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.accepted_lengths.update(stats.accepted_lengths)
        self.hits += stats.hits
        self.misses += stats.misses
        self.h2d_bytes += stats.h2d_bytes
        self.stall_s += stats.stall_s
        if stats.new_tokens > 1:
            self.tpot.observe(stats.tpot_s)

    def render(self, gauges: Mapping[str, tuple[str, float]]) -> str:
        """The exposition text; `gauges` are the live values (queue depth, running requests, ...) by name."""
        lines: list[str] = []
        for histogram in (self.ttft, self.tpot, self.queue_wait):
            lines += histogram.lines()
        lines += _family("specter_http_responses_total", "counter", "HTTP responses by endpoint and status code.",
                         {f'endpoint="{endpoint}",status="{status}"': n for (endpoint, status), n in sorted(self.responses.items())})
        lines += _family("specter_requests_finished_total", "counter", "Admitted requests by how they ended "
                         "(stop, length, cancelled, error).", {f'reason="{r}"': n for r, n in sorted(self.finished.items())})
        counters = {
            "specter_prompt_tokens_total": ("Prompt tokens of requests that held the engine.", self.prompt_tokens),
            "specter_generation_tokens_total": ("Tokens generated.", self.new_tokens),
            "specter_draft_tokens_total": ("Draft tokens proposed.", self.drafted),
            "specter_accepted_draft_tokens_total": ("Draft tokens the target accepted.", self.accepted),
            "specter_speculative_rounds_total": ("Decode rounds that verified drafts.", sum(self.accepted_lengths.values())),
            "specter_expert_hits_total": ("Expert uses served from the device cache.", self.hits),
            "specter_expert_misses_total": ("Expert uses that waited for an on-demand load.", self.misses),
            "specter_h2d_bytes_total": ("Bytes copied host to device.", self.h2d_bytes),
            "specter_stall_seconds_total": ("Time the verify waited for expert copies.", self.stall_s),
        }
        for name, (help_text, value) in counters.items():
            lines += _family(name, "counter", help_text, {"": value})
        for name, (help_text, value) in (self._ratios() | dict(gauges)).items():
            lines += _family(name, "gauge", help_text, {"": value})
        return "\n".join(lines) + "\n"

    def _ratios(self) -> dict[str, tuple[str, float]]:
        rounds = sum(self.accepted_lengths.values())
        committed = sum((n + 1) * c for n, c in self.accepted_lengths.items())
        uses = self.hits + self.misses
        return {
            "specter_acceptance_rate": ("Accepted over proposed draft tokens, server lifetime.",
                                        self.accepted / self.drafted if self.drafted else 0.0),
            "specter_mean_accepted_length": ("Tokens committed per speculative round, server lifetime.",
                                             committed / rounds if rounds else 0.0),
            "specter_expert_hit_rate": ("Expert uses served without a load, server lifetime (1 when all are resident).",
                                        self.hits / uses if uses else 1.0),
            "specter_h2d_bytes_per_token": ("Host-to-device bytes per generated token, server lifetime.",
                                            self.h2d_bytes / self.new_tokens if self.new_tokens else 0.0),
        }


def _family(name: str, kind: str, help_text: str, samples: Mapping[str, float]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples.items():
        lines.append(f"{name}{{{labels}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return lines


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
