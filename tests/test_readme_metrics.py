"""README.md's metrics table names every family the server's and a gateway's /metrics write,
with the type they write, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.gateway import Gateway
from llmgw.gateway.app import GatewayConfig
from llmgw.gateway.routing.table import RoutingTable
from llmgw.server.state.kvblocks import KvBlocksStats
from llmgw.server.wire.metrics import render_server_metrics

README = Path(__file__).parents[1] / "README.md"
_ROW = re.compile(r"^\| `(llmgw_[^`]+)` \| (\w+) \|")
_BRACES = re.compile(r"\{([^}]+)\}")


def _documented() -> dict[str, str]:
    """Family → type from the table; ``a_{x,y}_total`` stands for ``a_x_total``, ``a_y_total``."""
    out: dict[str, str] = {}
    for line in README.read_text().splitlines():
        row = _ROW.match(line)
        if row is None:
            continue
        name, kind = row.groups()
        braces = _BRACES.search(name)
        parts = braces.group(1).split(",") if braces else [""]
        for part in parts:
            expanded = _BRACES.sub(part, name, count=1) if braces else name
            assert expanded not in out, f"{expanded} documented twice"
            out[expanded] = kind
    return out


def _written(text: str) -> dict[str, str]:
    return {
        line.split(" ")[2]: line.split(" ")[3]
        for line in text.splitlines()
        if line.startswith("# TYPE ")
    }


def test_every_family_is_in_the_readme_table_with_its_type() -> None:
    store = KvBlocksStats(replicas=0, blocks=0, deltas=0, stored=0, removed=0, resets=0,
                          malformed=0, ignored=0, drops=0, watchers=0)  # fmt: skip
    server = render_server_metrics(
        agents_connected=0, engines=[], replica_of=lambda n, s: "", follow_refused=0, store=store
    ).decode()
    gateway = Gateway(RoutingTable([]), GatewayConfig(port=0)).metrics.render({}).decode()
    written = {**_written(server), **_written(gateway)}
    assert len(written) == len(_written(server)) + len(_written(gateway))  # no name in both
    assert _documented() == written
