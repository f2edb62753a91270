"""The supervisor's HTTP proxy in front of the engines: `router.Router` takes each request
and sends it to the primary that `supervisor.primary.PrimaryView` names, by the rules of
`routing` (its tries, headers, counts); a completion or chat completion goes through
`relay.StreamRelay` as a stream (`sse` events), kept by `migration.Stream` so a cut one
continues on the next primary (`cuts` says what becomes of a failed try), answered
through `answers`, its past kept warm on the next standby by `warming.Warmer`."""
