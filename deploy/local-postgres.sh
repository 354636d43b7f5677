#!/usr/bin/env bash
# The PostgreSQL of the tests: make sure the machine's local server on 127.0.0.1:5432 is up and print a test
# database URL for it. Used by `make test` (and so by CI).
# - The server answers, or it is Debian's PostgreSQL and starts (pg_ctlcluster): prints the URL.
# - PostgreSQL is installed but does not answer or start: says why and what to do on stderr, exits 1.
# - No PostgreSQL installed: a warning on stderr, prints nothing, exits 0 (the PostgreSQL tests then skip,
#   each with its reason), except where PostgreSQL is required (CI set, or PELT_REQUIRE_POSTGRES=1): exits 1.
set -u
host=127.0.0.1
port=5432
url="postgresql+psycopg://postgres@$host:$port/test"
alternative="or set PELT_TEST_DATABASE_URL to a server of yours (postgresql+psycopg://USER@HOST:PORT/DATABASE)"

fail() {
  echo "deploy/local-postgres.sh: $*" >&2
  exit 1
}

answers() {
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -q -h "$host" -p "$port"
  else  # no client tools: is anything listening there? (the tests then check that it is PostgreSQL)
    (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null
  fi
}

if answers; then
  echo "$url"
  exit 0
fi

# Debian's PostgreSQL (postgresql-common): the cluster that listens on $port, e.g. "15 main"
cluster=""
if command -v pg_lsclusters >/dev/null 2>&1; then
  cluster="$(pg_lsclusters --no-header 2>/dev/null | awk -v port="$port" '$3 == port { print $1, $2; exit }')"
fi
if [ -n "$cluster" ]; then
  read -r version name <<<"$cluster"
  started="$(pg_ctlcluster --skip-systemctl-redirect "$version" "$name" start 2>&1)"
  if [ $? = 0 ] || pg_ctlcluster "$version" "$name" status >/dev/null 2>&1; then # started, or already starting
    for _ in $(seq 1 30); do
      if answers; then
        echo "$url"
        exit 0
      fi
      sleep 1
    done
    started="started, but nothing answers on $host:$port within 30 s"
  fi
  fail "PostgreSQL cluster $cluster is installed but did not start: ${started:-no message}
Start it (as root: pg_ctlcluster $cluster start; its log is under /var/log/postgresql/), $alternative."
fi
if command -v postgres >/dev/null 2>&1 || command -v pg_ctl >/dev/null 2>&1 || command -v pg_lsclusters >/dev/null 2>&1; then
  fail "PostgreSQL is installed but nothing answers on $host:$port, and this script starts only a Debian cluster
(pg_ctlcluster) on port $port, which this machine does not have. Start your server on $host:$port, $alternative."
fi

missing="no PostgreSQL is installed here (install it as root: apt-get install -y postgresql), $alternative"
case "${CI:-}" in "" | 0 | false) ci="" ;; *) ci=1 ;; esac
if [ -n "$ci" ] || [ "${PELT_REQUIRE_POSTGRES:-}" = 1 ]; then
  fail "$missing. PostgreSQL is required here (CI or PELT_REQUIRE_POSTGRES=1 is set)."
fi
echo "deploy/local-postgres.sh: warning: $missing. The PostgreSQL tests will skip." >&2
