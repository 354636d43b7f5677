#!/usr/bin/env bash
# Make sure the machine's local PostgreSQL is up and print a test database URL for it.
# Used by `make test` (and so by CI). Prints nothing if no local PostgreSQL is installed,
# in which case the PostgreSQL half of the registry tests is skipped with a reason.
set -u
if ! command -v pg_isready >/dev/null 2>&1; then exit 0; fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  if [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start >&2 || true
    for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
  fi
fi
if pg_isready -q -h 127.0.0.1 -p 5432; then
  echo "postgresql+psycopg://postgres@127.0.0.1:5432/test"
fi
