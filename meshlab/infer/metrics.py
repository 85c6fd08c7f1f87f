"""The server's /metrics: Prometheus exposition through prometheus_client, one registry per server.

Counters and gauges are read from the engine at scrape time (its `stats`, the scheduler's queues and
page pool), so the engine thread keeps no second count and a scrape never waits for a step. Per-request
latencies and sizes are histograms, observed once when a request's answer is done: a dashboard takes
p50/p99 over any window from their buckets (`histogram_quantile`), and several servers' buckets add up,
which a mean over the last requests could not do. Names follow Prometheus' conventions (base units,
`_total` counters) under the `meshlab_` prefix.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: TTFT spans a cached prompt's ~1 ms on a GPU to minutes queued under overload; a token's
# time ~1 ms (batch 1) to seconds (a CPU, or steps shared with long prompts).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
                1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

# (name, help, the engine stats key) of the counters kept by the engine
ENGINE_COUNTERS = (
    ("requests_finished", "Requests finished (stopped, at their length, or aborted).", "requests_finished"),
    ("prompt_tokens", "Prompt tokens of the requests admitted.", "prompt_tokens"),
    ("generated_tokens", "Tokens generated.", "generated_tokens"),
    ("prompt_tokens_computed", "Prompt tokens fed through the model (those not taken from the prefix cache).",
     "prefill_tokens"),
    ("prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the prefix cache.", "prefix_hit_tokens"),
    ("engine_steps", "Model steps run (a decode call of n steps counts n).", "steps"),
    ("device_calls", "Programs dispatched to the device.", "device_calls"),
    ("chained_calls", "Decode calls dispatched before the call before was read back.", "chained_calls"),
    ("overlapped_calls", "Steps dispatched before the step before was read back.", "overlapped_calls"),
    ("preemptions", "Times a running request gave its pages back to be recomputed later.", "preemptions"),
    ("compiles", "Programs compiled while serving (0 after a full warmup).", "compiles"),
    ("prompt_tokens_scored", "Prompt positions whose logprobs were computed (echo with logprobs).", "scored_tokens"),
    ("guided_requests", "Requests held to a grammar (response_format, tools).", "guided_requests"),
    ("spec_decode_draft_tokens", "Draft tokens checked by speculative steps (prompt lookup).", "spec_drafted"),
    ("spec_decode_accepted_tokens", "Draft tokens kept: each is a step saved.", "spec_accepted"),
)


class ServerMetrics:
    """The metrics of one `Server` (meshlab/infer/server.py): `observe(request_metrics)` when a request's
    answer is done, `text()` for GET /metrics."""

    def __init__(self, server):
        self.registry = CollectorRegistry(auto_describe=True)
        hist = lambda name, doc, buckets: Histogram(f"meshlab_{name}", doc, buckets=buckets,  # noqa: E731
                                                    registry=self.registry)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to the first generated token.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time between a request's tokens after its first.",
                         TPOT_BUCKETS)
        self.latency = hist("e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.output_len = hist("request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS)
        self.registry.register(_EngineCollector(server))

    def observe(self, m: dict) -> None:
        """One finished request's `Request.metrics`."""
        if m["ttft_s"] is not None:
            self.ttft.observe(m["ttft_s"])
        if m["tpot_s"] is not None:
            self.tpot.observe(m["tpot_s"])
        if m["latency_s"] is not None:
            self.latency.observe(m["latency_s"])
        self.prompt_len.observe(m["prompt_tokens"])
        self.output_len.observe(m["output_tokens"])

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class _EngineCollector:
    """The engine's and the server's counts, read at each scrape."""

    def __init__(self, server):
        self.server = server

    def describe(self):
        return []           # the families are known at collect time only; nothing to check at register

    def collect(self):
        srv, stats, sched = self.server, self.server.engine.stats, self.server.engine.sched
        counters = [(name, doc, stats[key]) for name, doc, key in ENGINE_COUNTERS] + [
            ("http_requests_rejected", "HTTP requests refused with 429 or 503 (limits).", srv.counts["rejected"]),
            ("requests_aborted", "Requests aborted by a client that went away.", srv.counts["aborted"]),
            ("prompt_tokens_score_cached", "Prompt positions whose scores came from the score store.",
             sched.counts["stored_scores"]),
            ("prefix_waits", "Admissions put off while the next prompt page was being computed by another request.",
             sched.counts["prefix_waits"]),
            ("prefix_cache_evictions", "Cached pages evicted to make room.", sched.pool.evictions)]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"meshlab_{name}", doc, value=value)
        pool = sched.pool
        gauges = [
            ("requests_running", "Requests holding a row.", len(sched.running())),
            ("requests_waiting", "Requests queued for a row or pages.", len(sched.waiting)),
            ("free_cache_pages", "KV pages no request holds (fresh, or cached and evictable).", pool.available),
            ("cache_pages", "KV pages in the pool.", pool.total),
            ("kv_cache_usage", "Fraction of the KV pages held by requests.", pool.held),
            ("prefix_cache_pages", "KV pages holding prompt content the prefix cache can hand out.", len(pool.key_of)),
            ("http_requests_inflight", "HTTP generation requests being answered.", srv.inflight),
            ("generation_tokens_per_second", "Generated tokens over the engine's busy time.",
             stats["generated_tokens"] / stats["busy_s"] if stats["busy_s"] else 0.0)]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"meshlab_{name}", doc, value=value)


class StatsLog:
    """A line every `interval` seconds while the server works (vLLM's periodic stats): prompt and
    generation throughput since the last line, requests running and waiting, the KV pages in use and
    the prefix cache's share of the prompt tokens. Called from the engine thread between steps; quiet
    while nothing happens."""

    def __init__(self, engine, interval: float, write):
        self.engine, self.interval, self.write = engine, interval, write
        self.t, self.last = None, None

    def maybe_log(self, now: float) -> None:
        if self.interval <= 0 or (self.t is not None and now - self.t < self.interval):
            return
        st = {k: self.engine.stats[k] for k in ("prompt_tokens", "generated_tokens", "prefill_tokens",
                                                  "prefix_hit_tokens", "preemptions")}
        if self.t is not None and st != self.last:
            self.write(stats_line(st, self.last, now - self.t, self.engine.sched))
        self.t, self.last = now, st


def stats_line(st: dict, before: dict, seconds: float, sched) -> str:
    """One StatsLog line from two snapshots of the engine's counters `seconds` apart."""
    grew = {k: st[k] - before[k] for k in st}
    hits, fed = grew["prefix_hit_tokens"], grew["prefill_tokens"]
    return (f"meshlab: prompt {grew['prompt_tokens'] / seconds:,.1f} tok/s (computed {fed / seconds:,.1f}), generation "
            f"{grew['generated_tokens'] / seconds:,.1f} tok/s; {len(sched.running())} running, {len(sched.waiting)} "
            f"waiting, {grew['preemptions']} preempted; KV cache {sched.pool.held:.1%} used; prefix "
            f"cache {hits / (hits + fed) if hits + fed else 0:.0%} of prompt tokens")
