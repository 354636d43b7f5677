"""A module that keeps a file open from its import on, as a library might (a preload in
tests/security/test_sandbox_warm.py: no forked child may inherit the descriptor)."""

HELD = open(__file__, "rb")  # noqa: SIM115 - held open on purpose, for as long as the process lives
