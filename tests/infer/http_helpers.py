"""HTTP helpers of the server tests (test_server*.py): a request and its parsed answer, an SSE stream's text,
a /metrics scrape."""
import http.client
import json


def call(srv, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, (json.loads(text) if ctype.startswith("application/json") else text)


def sse_text(payload: str, chat: bool):
    events = [line[6:] for line in payload.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    key = (lambda c: c["choices"][0]["delta"].get("content", "")) if chat else (lambda c: c["choices"][0]["text"])
    return "".join(key(c) for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def scrape(srv) -> dict:
    """GET /metrics parsed as Prometheus text: {sample name: value} (histogram buckets keyed by their `le`)."""
    from prometheus_client.parser import text_string_to_metric_families
    status, text = call(srv, "GET", "/metrics")
    assert status == 200
    return {s.name + (f"[{s.labels['le']}]" if "le" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
