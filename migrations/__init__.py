"""Alembic migrations of the registry database (run them with `pelt db upgrade`)."""
