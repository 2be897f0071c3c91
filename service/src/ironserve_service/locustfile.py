"""The user of the load-and-chaos gate, run by `locust --locustfile` (chaos.py): chat completions on the
candidate with prompts sampled from the queries file, the wait time and timeout of the catalog's locust test.

Its settings arrive in the environment (chaos.locust_environment), as locust owns the command line.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from locust import HttpUser, between, task

CANARY_PROMPT = "ping"


def queries(path: str, sample: int) -> list[str]:
    """Up to `sample` non-empty lines of the queries file, drawn at random; the canary's prompt without one."""
    if not path:
        return [CANARY_PROMPT]
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no query")
    return random.sample(lines, min(sample, len(lines)))


WAIT_MIN, WAIT_MAX = (float(value) for value in os.environ["IRONSERVE_LOAD_WAIT"].split())
QUERIES = queries(os.environ["IRONSERVE_LOAD_QUERIES"], int(os.environ["IRONSERVE_LOAD_SAMPLE"]))


class ChatUser(HttpUser):
    wait_time = between(WAIT_MIN, WAIT_MAX)
    model = os.environ["IRONSERVE_LOAD_MODEL"]
    timeout_s = float(os.environ["IRONSERVE_LOAD_TIMEOUT_S"])
    max_tokens = int(os.environ["IRONSERVE_LOAD_MAX_TOKENS"])

    @task
    def chat(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": random.choice(QUERIES)}],
            "max_tokens": self.max_tokens,
        }
        with self.client.post(
            "/v1/chat/completions", json=body, timeout=self.timeout_s, catch_response=True, name="chat"
        ) as response:
            if response.status_code != 200 or '"choices"' not in response.text:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
