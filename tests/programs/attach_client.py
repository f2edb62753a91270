"""A client process for the daemon tests: attach, then answer commands read from stdin.

Prints one JSON line per command: `digest` (sha256 of every tensor's bytes, by name),
`rss` (kB before and after the attach), `write` (try to change a shared weight).
"""

from __future__ import annotations

import hashlib
import json
import sys


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def digest(tensors: dict) -> str:  # type: ignore[type-arg]
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(__import__("torch").uint8).numpy().data)
    return h.hexdigest()


def main() -> None:
    import torch  # noqa: F401  (imported before measuring, so its pages are not counted)

    from cachedaemon.client import attach_state_dict

    before = rss_kb()
    tensors = attach_state_dict(sys.argv[1])
    after = rss_kb()
    print(
        json.dumps({"attached": len(tensors), "rss_before_kb": before, "rss_after_kb": after}),
        flush=True,
    )
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "digest":
            print(json.dumps({"digest": digest(tensors), "rss_kb": rss_kb()}), flush=True)
        elif cmd == "write":
            name = sorted(tensors)[0]
            tensors[name].add_(1)  # faults: the mapping is read-only
            print(json.dumps({"wrote": name}), flush=True)
        elif cmd == "exit":
            return


if __name__ == "__main__":
    main()
