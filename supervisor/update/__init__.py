"""A rolling model update: `supervisor update --model DIR` builds the next version's pool
beside the one that serves, warms standbys on it, passes the primary's place to one of
them in one fenced, epoch-raising step, drains the old primary and frees the old pool
(docs/update.md). `spec` is its policy section, `checks` the refusals made before anything
changes, `generations` the cache daemons of each version, `rollout` the coordinator, `waits` what
it waits for before its switch, `smoke` the smoke request, and `cli` the commands."""
