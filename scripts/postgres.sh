#!/usr/bin/env bash
# Starts (once) a throwaway PostgreSQL server for the test suite and prints the line
#   export LIGHTNING_PARO_TEST_PG_URL='postgresql://...'
# Usage: eval "$(bash scripts/postgres.sh)"     (idempotent: reuses a running server)
#        bash scripts/postgres.sh stop           (stops it and deletes its data)
# The server listens on a unix socket in its own temporary directory only (no TCP listener), trusts
# local connections, and keeps its data in that directory. Debian's postgresql package is installed
# with apt-get when no server binaries are found.
set -euo pipefail

PG_DIR=${LIGHTNING_PARO_PG_DIR:-${TMPDIR:-/tmp}/lightning-paro-pg-$(id -u)}
DATA="$PG_DIR/data"
LOG="$PG_DIR/server.log"

find_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/pg_ctl" ] && [ -x "$d/initdb" ]; then echo "$d"; return 0; fi
  done
  if command -v pg_ctl >/dev/null && command -v initdb >/dev/null; then dirname "$(command -v pg_ctl)"; return 0; fi
  return 1
}

BIN=$(find_bindir || true)
if [ -z "$BIN" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "postgres.sh: PostgreSQL server binaries not found; install Debian's 'postgresql' package (needs root)." >&2
    exit 1
  fi
  echo "postgres.sh: installing Debian's postgresql package" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q postgresql >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null; }
  BIN=$(find_bindir) || { echo "postgres.sh: postgresql installed but pg_ctl/initdb not found" >&2; exit 1; }
fi

# PostgreSQL refuses to run as root: run it as the 'postgres' system user then.
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --home-dir "$PG_DIR" --shell /bin/false postgres
  AS=(runuser -u postgres --)
  DBUSER=postgres
else
  AS=()
  DBUSER=$(id -un)
fi

if [ "${1:-}" = stop ]; then
  if [ -f "$DATA/postmaster.pid" ]; then "${AS[@]}" "$BIN/pg_ctl" -D "$DATA" -m immediate -w stop >/dev/null 2>&1 || true; fi
  rm -rf "$PG_DIR"
  exit 0
fi

mkdir -p "$PG_DIR"
chmod 700 "$PG_DIR"
if [ "$(id -u)" = 0 ]; then chown postgres "$PG_DIR"; fi

if [ ! -f "$DATA/PG_VERSION" ]; then
  rm -rf "$DATA"
  "${AS[@]}" "$BIN/initdb" -D "$DATA" -U "$DBUSER" --auth=trust --no-sync -E UTF8 >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; exit 1; }
fi

if ! "${AS[@]}" "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
  rm -f "$DATA/postmaster.pid"
  # listen_addresses='' : no TCP socket at all, only the unix socket in $PG_DIR
  "${AS[@]}" "$BIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 \
    -o "-c listen_addresses='' -c unix_socket_directories='$PG_DIR' -c fsync=off -c max_connections=200" \
    start >/dev/null || { tail -n 20 "$LOG" >&2; exit 1; }
fi

echo "export LIGHTNING_PARO_TEST_PG_URL='postgresql://$DBUSER@/postgres?host=$PG_DIR'"
