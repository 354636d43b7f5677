#!/usr/bin/env bash
# Debian's Chromium for the web page's browser tests (tests/api/test_page.py drive it with Playwright's
# Python package, which never downloads a browser of its own). Used by `make test` (and so by CI).
# As root, with apt-get: installs the `chromium` package when /usr/bin/chromium is missing. Otherwise it
# only says how; the browser tests then skip with the same command in their reason. Where the browser is
# required (CI set, or PELT_REQUIRE_BROWSER=1, as .ci/run sets) it exits 1 instead, and the tests fail.
set -u
chromium="${PELT_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$chromium" ]; then exit 0; fi
case "${CI:-}" in "" | 0 | false) required="${PELT_REQUIRE_BROWSER:-}" ;; *) required=1 ;; esac
missing() {
  echo "$1" >&2
  if [ "$required" = 1 ]; then
    echo "the browser is required here (CI or PELT_REQUIRE_BROWSER=1 is set): stopping" >&2
    exit 1
  fi
  exit 0
}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the browser tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  if apt-get update -qq && apt-get install -y -qq chromium >/dev/null; then exit 0; fi
  missing "apt-get install chromium failed: the browser tests will skip"
fi
missing "no $chromium: the browser tests will skip (install it: sudo apt-get install -y chromium)"
