"""What the supervisor, the engines and the chaos suite agree on, in one place.

Environment variables, command-template placeholders, the agent and control messages and
the ready-file format. Imports only the standard library and msgspec: no torch, no engine,
no supervisor internals.
"""
