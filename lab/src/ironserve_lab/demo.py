"""The demo's last step (`python -m ironserve_lab.demo HOST`): one chat completion through a lab host's Envoy.

It uses the API key the deploy made on the host (`ironserve-service api-key`), read back over SSH for this one
call and never printed, as an admin would from their own machine. Prints the status, the colour that served it
and the usage; exits 1 unless the answer is a 200 with usage.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

from ironserve_service.router import parse_api_keys

from ironserve_lab import remote, state
from ironserve_lab.inventory import lab_groups
from ironserve_lab.state import LabHost
from roles import stack_config
from roles.inference.settings import API_KEYS_PATH

DEMO_CLIENT = "default"  # the client the deploy makes a key for on first deploy


def api_key(host: LabHost, client: str = DEMO_CLIENT) -> str:
    """`client`'s key in the host's keys file, read there over SSH."""
    source = f"{host.name}:{API_KEYS_PATH}"
    keys = dict(parse_api_keys(remote.run(host, f"cat {API_KEYS_PATH}"), source))
    if client not in keys:
        raise RuntimeError(f"{source}: no API key for client {client!r}")
    return keys[client]


def chat_completion(
    url: str, key: str, model: str, stream: bool = False, timeout_s: float = 120
) -> tuple[int, str, str]:
    """(status, colour that served it, body) of one short chat completion at `url` (Envoy's listener)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": stream}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.headers.get("x-ironserve-colour", ""), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, "", error.read().decode(errors="replace")


def listener_url(name: str) -> tuple[str, str]:
    """(Envoy's URL as a client outside the host reaches it, the served model's name) from the lab inventory's data
    for host `name`, validated as the deploy validated it."""
    containers, vms = lab_groups()
    data = dict(containers + vms)[name]
    config = stack_config(name, data)
    security, inference = config.security, config.inference
    swap = inference.service_settings(security.model_dir, security.group, security.slice).swap
    return f"http://{swap.listen_host}:{swap.listen_port}", inference.model_name


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ironserve_lab.demo HOST", file=sys.stderr)
        return 2
    host = state.load().host(argv[0])
    url, model = listener_url(host.name)
    status, colour, body = chat_completion(url, api_key(host), model)
    print(f"POST {url}/v1/chat/completions: HTTP {status}")
    try:
        usage = json.loads(body).get("usage") if status == 200 else None
    except ValueError:
        usage = None
    if not usage:
        print(f"demo: no completion with usage: {body[:500]}", file=sys.stderr)
        return 1
    print(f"served by colour: {colour or '(no x-ironserve-colour header)'}")
    print(f"usage: {', '.join(f'{name} {value}' for name, value in usage.items() if value is not None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
