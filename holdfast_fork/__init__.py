"""holdfast's fork server: one process pays for an engine's imports, each engine is a fork.

The server (`holdfast_fork.server.Server`) serves the requests of
`holdfast_contract.forkserver` for any engine: it forks one child per `Spawn`, hands it the
request's fds, environment and working directory, and runs the program it was made with.
Each engine kind brings its own program and preloading: the reference engine's is
`python -m engine.forkserver`, vLLM's `python -m holdfast_vllm.forkserver`. Both import this
package; neither imports the other. Imports only the standard library, msgspec, structlog,
`holdfast_contract` and `cachedaemon.rundir` (no torch).
"""
