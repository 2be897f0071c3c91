"""CoreDNS's Corefile: kubeadm's default for Kubernetes 1.31 with the site's forward targets, and a checker.

The text is kubeadm's CoreDNSConfigMap (kubernetes v1.31.4, cmd/kubeadm/app/phases/addons/dns/manifests.go),
the `{{ .DNSDomain }}` filled with kubernetes_dns_domain and `forward . /etc/resolv.conf` given the site's
resolvers (dns-corefile-forward). Kubernetes 1.32 added `disable success/denial <domain>` to its `cache 30`
(kubernetes/kubernetes#128359); 1.31's plain `cache 30` is kept, as the catalog's dns-corefile-cache asks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# kubeadm 1.31's Corefile; {domain} and {forward} are the only parts filled in.
KUBEADM_COREFILE = """\
.:53 {{
    errors
    health {{
       lameduck 5s
    }}
    ready
    kubernetes {domain} in-addr.arpa ip6.arpa {{
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }}
    prometheus :9153
    forward . {forward} {{
       max_concurrent 1000
    }}
    cache 30
    loop
    reload
    loadbalance
}}
"""


def corefile(dns_domain: str, forward: Iterable[str]) -> str:
    return KUBEADM_COREFILE.format(domain=dns_domain, forward=" ".join(forward))


@dataclass
class Directive:
    """One plugin line of a Corefile, with the directives of its `{ }` block."""

    name: str
    args: tuple[str, ...]
    block: list[Directive] = field(default_factory=list)


def parse(text: str) -> list[Directive]:
    """The server blocks of a Corefile (each a Directive named by its zones), comments dropped.

    Raises ValueError on unbalanced braces."""
    root = Directive("(root)", ())
    stack = [root]
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].replace("{", " { ").replace("}", " } ").split()
        line: list[str] = []
        for word in words:
            if word == "{":
                directive = Directive(line[0] if line else "", tuple(line[1:]))
                stack[-1].block.append(directive)
                stack.append(directive)
                line = []
            elif word == "}":
                if line:
                    stack[-1].block.append(Directive(line[0], tuple(line[1:])))
                    line = []
                if len(stack) == 1:
                    raise ValueError(f"line {number}: a closing brace without an opening one")
                stack.pop()
            else:
                line.append(word)
        if line:
            stack[-1].block.append(Directive(line[0], tuple(line[1:])))
    if len(stack) != 1:
        raise ValueError("a block is not closed")
    return root.block


def problems(text: str, dns_domain: str, forward: Iterable[str]) -> list[str]:
    """What the Corefile lacks of the catalog's dns-* entries: the kubernetes plugin for the cluster domain,
    `cache 30`, `reload` and `forward . <targets>`, all in the `.:53` server block."""
    try:
        blocks = parse(text)
    except ValueError as exc:
        return [f"Corefile: {exc}"]
    server = next((b for b in blocks if b.name in {".:53", "."}), None)
    if server is None:
        return ["Corefile: no `.:53` server block"]
    found = []
    plugins = {d.name: d for d in server.block}
    kubernetes = plugins.get("kubernetes")
    if kubernetes is None or kubernetes.args[:1] != (dns_domain,):
        found.append(f"Corefile: no `kubernetes {dns_domain} ...` plugin: Service names would not resolve")
    elif not {"in-addr.arpa", "ip6.arpa"} <= set(kubernetes.args):
        found.append("Corefile: the kubernetes plugin does not answer reverse zones (in-addr.arpa ip6.arpa)")
    if "cache" not in plugins or plugins["cache"].args != ("30",):
        found.append("Corefile: no `cache 30` (dns-corefile-cache)")
    if "reload" not in plugins:
        found.append("Corefile: no `reload` (dns-corefile-reload)")
    expected = (".", *forward)
    if "forward" not in plugins or plugins["forward"].args != expected:
        found.append(f"Corefile: no `forward {' '.join(expected)}` (dns-corefile-forward)")
    return found
