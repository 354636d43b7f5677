"""Registry tests: every database test runs on SQLite and on PostgreSQL (see conftest.py)."""
