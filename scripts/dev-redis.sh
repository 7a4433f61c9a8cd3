#!/usr/bin/env bash
# A real Redis server for development and tests (the shared tier of the embedding
# cache, `pipeline run --cache redis://...`): Debian's redis-server on 127.0.0.1:6390,
# configured as a cache (no persistence, allkeys-lru under a memory cap). Data and
# logs live outside the repo.
#
#   scripts/dev-redis.sh start|stop|status|restart|wipe|url
#
# The server binary: $REDIS_SERVER, else `redis-server` on PATH, else Debian's
# package unpacked (not installed) under the cache directory: `apt-get download` of
# redis-tools and the libraries it needs, then `dpkg -x` (an `apt-get update` first
# when the package lists are empty and this runs as root). Nothing system-wide is
# installed or started.
#
# `url` prints the --cache URL of this server:  pipeline run --cache "$(scripts/dev-redis.sh url)"
#
# Environment (all optional): PIPELINE_REDIS_PORT (6390), PIPELINE_REDIS_MAXMEMORY
# (256mb), PIPELINE_REDIS_HOME (where the unpacked binary, data and logs go),
# PIPELINE_REDIS_START_TIMEOUT_S (20), REDIS_SERVER (a redis-server binary to use).
set -euo pipefail

PORT="${PIPELINE_REDIS_PORT:-6390}"
MAXMEMORY="${PIPELINE_REDIS_MAXMEMORY:-256mb}"
ROOT="${PIPELINE_REDIS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/embedding-pipeline}"
CACHE="$ROOT/redis-$PORT"
UNPACKED="$ROOT/redis-bin"
DATA="$CACHE/data"
LOG="$CACHE/redis.log"
PIDFILE="$CACHE/redis.pid"
START_TIMEOUT_S="${PIPELINE_REDIS_START_TIMEOUT_S:-20}"
# redis-server is redis-tools' redis-check-rdb under another name (it reads argv[0]);
# the libraries a minimal Debian lacks come unpacked beside it.
PACKAGES=(redis-tools libjemalloc2 liblzf1 libatomic1)

die() { echo "dev-redis: $*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

# PING over bash's /dev/tcp: no redis-cli needed.
pong() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$PORT" || exit 1
    printf 'PING\r\n' >&3
    IFS= read -r -t 2 line <&3 || exit 1
    [[ "$line" == +PONG* ]]
  ) 2>/dev/null
}

# The pid file's process, if it is still this server: a pid file left by an earlier
# machine or boot may name a process that now is something else entirely.
running_pid() {
  [[ -f "$PIDFILE" ]] || return 1
  local pid; pid="$(cat "$PIDFILE")"
  kill -0 "$pid" 2>/dev/null || return 1
  if [[ -r "/proc/$pid/cmdline" ]]; then
    tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "redis-server.*:$PORT" || return 1
  fi
  echo "$pid"
}

lib_dirs() {
  local dirs=() d
  for d in "$UNPACKED"/usr/lib/*-linux-gnu "$UNPACKED"/lib/*-linux-gnu; do
    [[ -d "$d" ]] && dirs+=("$d")
  done
  local IFS=:; echo "${dirs[*]}"
}

# Prints the redis-server to run, unpacking Debian's package first if there is none.
server_binary() {
  if [[ -n "${REDIS_SERVER:-}" ]]; then
    [[ -x "$REDIS_SERVER" ]] || die "REDIS_SERVER=$REDIS_SERVER is not an executable"
    echo "$REDIS_SERVER"; return 0
  fi
  if command -v redis-server >/dev/null; then command -v redis-server; return 0; fi
  [[ -x "$UNPACKED/usr/bin/redis-server" ]] || unpack
  echo "$UNPACKED/usr/bin/redis-server"
}

unpack() {
  command -v apt-get >/dev/null && command -v dpkg >/dev/null \
    || die "no redis-server on PATH and no apt-get/dpkg to fetch Debian's; install Redis 6+ or set REDIS_SERVER=/path/to/redis-server"
  local work; work="$(mktemp -d)"
  echo "dev-redis: fetching Debian's ${PACKAGES[*]} (apt-get download) into $UNPACKED" >&2
  if ! (cd "$work" && apt-get download -q "${PACKAGES[@]}" >/dev/null 2>"$work/err"); then
    if [[ "$(id -u)" == 0 ]]; then
      echo "dev-redis: apt-get download failed ($(tail -n 1 "$work/err")); running apt-get update first" >&2
      apt-get update -q >/dev/null || die "apt-get update failed"
      (cd "$work" && apt-get download -q "${PACKAGES[@]}" >/dev/null 2>"$work/err") \
        || die "apt-get download ${PACKAGES[*]} failed: $(tail -n 3 "$work/err")"
    else
      die "apt-get download ${PACKAGES[*]} failed: $(tail -n 3 "$work/err"); run 'apt-get update' as root, or install redis-server"
    fi
  fi
  rm -rf "$UNPACKED.partial"; mkdir -p "$UNPACKED.partial"
  local deb
  for deb in "$work"/*.deb; do dpkg -x "$deb" "$UNPACKED.partial"; done
  [[ -e "$UNPACKED.partial/usr/bin/redis-check-rdb" ]] || die "redis-tools held no redis-check-rdb"
  ln -sf redis-check-rdb "$UNPACKED.partial/usr/bin/redis-server"
  rm -rf "$UNPACKED" "$work"; mv "$UNPACKED.partial" "$UNPACKED"
  local missing
  missing="$(LD_LIBRARY_PATH="$(lib_dirs)" ldd "$UNPACKED/usr/bin/redis-server" 2>/dev/null | grep 'not found' || true)"
  [[ -z "$missing" ]] || die "the unpacked redis-server lacks libraries: $missing"
}

write_config() {
  mkdir -p "$DATA"
  cat > "$CACHE/redis.conf" <<CONF
bind 127.0.0.1
port $PORT
protected-mode yes
daemonize no
dir $DATA
logfile $LOG
# A cache: nothing persisted, least recently used keys evicted under the cap.
save ""
appendonly no
maxmemory $MAXMEMORY
maxmemory-policy allkeys-lru
CONF
}

start() {
  local pid bin
  if pid="$(running_pid)"; then
    wait_ready "$pid"
    echo "dev-redis: already running (pid $pid) on redis://127.0.0.1:$PORT"
    return 0
  fi
  port_open && die "127.0.0.1:$PORT is taken by another process; stop it or set PIPELINE_REDIS_PORT"
  bin="$(server_binary)"
  write_config
  : > "$LOG"
  LD_LIBRARY_PATH="$(lib_dirs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    nohup "$bin" "$CACHE/redis.conf" > "$CACHE/stdout.log" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  wait_ready "$!"
  echo "dev-redis: Redis $(LD_LIBRARY_PATH="$(lib_dirs)" "$bin" --version 2>/dev/null | awk '{print $3}' | sed 's/^v=//') ready on redis://127.0.0.1:$PORT (pid $(cat "$PIDFILE"), log $LOG)"
}

wait_ready() {
  local pid="$1" deadline=$((SECONDS + START_TIMEOUT_S))
  until pong; do
    kill -0 "$pid" 2>/dev/null || { tail -n 20 "$CACHE/stdout.log" "$LOG" >&2 2>/dev/null; die "redis-server exited during start-up (log: $LOG)"; }
    (( SECONDS < deadline )) || die "redis-server did not answer PING on 127.0.0.1:$PORT within ${START_TIMEOUT_S}s (last log line: $(tail -n 1 "$LOG" 2>/dev/null); log: $LOG)"
    sleep 0.2
  done
}

stop() {
  local pid
  if ! pid="$(running_pid)"; then
    rm -f "$PIDFILE"; echo "dev-redis: not running"; return 0
  fi
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$PIDFILE"
  echo "dev-redis: stopped (pid $pid)"
}

status() {
  local pid
  if pid="$(running_pid)" && pong; then
    echo "dev-redis: running (pid $pid) on redis://127.0.0.1:$PORT, maxmemory $MAXMEMORY, log $LOG"
  else
    echo "dev-redis: not running"; return 3
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart) stop; start ;;
  wipe) stop; rm -rf "$DATA" "$LOG" "$CACHE/stdout.log" "$CACHE/redis.conf"; rmdir "$CACHE" 2>/dev/null || true; echo "dev-redis: data removed ($CACHE)" ;;
  url) echo "redis://127.0.0.1:$PORT/0" ;;
  -h|--help) echo "usage: $0 start|stop|status|restart|wipe|url"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0" ;;
  *) echo "usage: $0 start|stop|status|restart|wipe|url" >&2; exit 2 ;;
esac
