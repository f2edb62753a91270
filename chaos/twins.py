"""Twins and versions: what the answers' token ids and labels prove.

Greedy answers of one prompt made by one model version are twins: the same token ids
(on an engine whose greedy tokens do not depend on the batch; see streams-twins.yaml).
The reference of a (prompt, version) is the most common whole answer no fault cut; an
answer unlike it was changed by something: a migration, the batch it shared, or another
version's tokens mixed into it. Two checkpoints of other weights give other answers, so
a stream labelled with one version that carries tokens of the other is unlike its twins.

Every answer must name the version that made it: the router's X-Holdfast-Model-Version,
and, of a collected answer, `system_fingerprint` with the same name (an engine that sets
its own fingerprint, vLLM, makes every collected answer count as unlabelled). And it
must be a version the router served (`/cluster`'s `version` as the suite read it): a
version that was rolled back before its switch never answers.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Collection, Sequence

from chaos.load import RequestRow

Twin = tuple[int, str]  # (twin prompt, model version)


def references(rows: Sequence[RequestRow]) -> dict[Twin, str]:
    """Per twin prompt and version, the token ids (digest) of its whole answers that no
    fault touched: the most common one, should they ever differ."""
    seen: dict[Twin, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in rows:
        if r.prompt >= 0 and r.digest and not r.migrated:
            seen[(r.prompt, r.version)][r.digest] += 1
    return {key: c.most_common(1)[0][0] for key, c in seen.items()}


def mismatched(row: RequestRow, twins: dict[Twin, str]) -> bool:
    """A whole answer whose tokens differ from its twins' (same prompt, same version)."""
    ref = twins.get((row.prompt, row.version))
    return bool(row.digest) and ref is not None and row.digest != ref


def alike(twins: dict[Twin, str]) -> int:
    """Twin prompts that two versions answered alike: for those, tokens of one version
    in the other's answer could not be told (0 for two checkpoints of other weights)."""
    by_prompt: dict[int, list[str]] = collections.defaultdict(list)
    for (prompt, _), digest in twins.items():
        by_prompt[prompt].append(digest)
    return sum(a == b for found in by_prompt.values() for a, b in itertools.combinations(found, 2))


def unlabelled(row: RequestRow) -> bool:
    """A successful answer that does not name its version: no header, or a collected one
    without a `system_fingerprint` equal to it."""
    if not row.ok:
        return False
    return not row.version or (not row.streamed and row.fingerprint != row.version)


def unserved(rows: Sequence[RequestRow], served: Collection[str]) -> int:
    """Successful answers labelled with a version the router never served."""
    return sum(1 for r in rows if r.ok and r.version and r.version not in served)


def versions(rows: Sequence[RequestRow]) -> int:
    """Model versions that made a successful answer."""
    return len({r.version for r in rows if r.ok and r.version})
