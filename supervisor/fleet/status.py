"""`supervisor status --cluster`: every node of the cluster, asked through the health APIs.

This node's `GET /cluster` lists the nodes registered in etcd with their health API
addresses; each node's own `/cluster` then says its role, its epoch and its lease age. A
node that does not answer is shown as such (its registration alone is what etcd holds).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 2.0


def fetch(api: str) -> dict[str, Any] | str:
    """`/cluster` of the health API at `api`, or why it could not be read."""
    try:
        with urllib.request.urlopen(f"http://{api}/cluster", timeout=TIMEOUT_S) as r:
            body: dict[str, Any] = json.loads(r.read())
            return body
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}"
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def rows(api: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This node's view, and one row per registered node (its own view where it answered)."""
    here = fetch(api)
    if isinstance(here, str):
        raise ConnectionError(f"no health API at {api} ({here}); is `supervisor run` up?")
    if "cluster" not in here:
        raise LookupError(f"the supervisor at {api} runs no cluster (its policy has no cluster:)")
    out = []
    for n in here["nodes"]:
        view = here if n["node"] == here["node"] else fetch(n["api"]) if n["api"] else "no api"
        row = {"node": n["node"], "api": n["api"], "healthy": n["healthy"]}
        if isinstance(view, str):
            row |= {"role": n["role"], "epoch": None, "lease_age_s": None, "error": view}
        else:
            row |= {k: view[k] for k in ("role", "epoch", "cluster_epoch", "lease_age_s")}
        out.append(row)
    return here, out


def print_cluster(api: str, as_json: bool) -> int:
    try:
        here, nodes = rows(api)
    except (ConnectionError, LookupError) as e:
        print(f"supervisor: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"cluster": here["cluster"], "leader": here["leader"], "nodes": nodes}))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"cluster {here['cluster']}, leader {here['leader'] or '-'}")
    for col in ("node", "role", "healthy", "epoch", "lease age s", "api"):
        t.add_column(col)
    for n in nodes:
        age = "-" if n["lease_age_s"] is None else f"{n['lease_age_s']:.2f}"
        role = n["role"] + (f" ({n['error']})" if "error" in n else "")
        t.add_row(n["node"], role, str(n["healthy"]), str(n["epoch"] or "-"), age, n["api"])
    Console().print(t)
    return 0
