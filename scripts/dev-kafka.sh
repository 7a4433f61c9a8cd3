#!/usr/bin/env bash
# A real single-node Apache Kafka broker (KRaft, combined broker+controller) for
# development and tests, on 127.0.0.1:9092. Jars are fetched once with Maven from
# scripts/kafka/pom.xml and cached outside the repo, with the data and the logs.
#
#   scripts/dev-kafka.sh start|stop|status|restart|wipe|classpath
#
# `classpath` prints the Java classpath of the cached jars (fetching them first if
# missing; Maven's output goes to stderr), for Java clients such as
# scripts/java/ForeignProducer.java:  java -cp "$(scripts/dev-kafka.sh classpath)" ...
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
POM="$HERE/kafka/pom.xml"
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM")"
CACHE="${PIPELINE_KAFKA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/embedding-pipeline/kafka-$KAFKA_VERSION}"
LIBS="$CACHE/libs"
PORT="${PIPELINE_KAFKA_PORT:-9092}"
CONTROLLER_PORT="${PIPELINE_KAFKA_CONTROLLER_PORT:-9093}"
NAME=dev-kafka HEAP_MIN=256m HEAP=1g
ready_port() { echo "$PORT"; }
# shellcheck source=kafka/broker.sh
source "$HERE/kafka/broker.sh"

fetch() {
  [[ -f "$LIBS/.complete" ]] && return 0
  command -v mvn >/dev/null || die "Maven (mvn) is needed to fetch Kafka $KAFKA_VERSION; install it and retry"
  command -v java >/dev/null || die "Java 17+ is needed to run Kafka $KAFKA_VERSION; install it and retry"
  echo "dev-kafka: fetching Apache Kafka $KAFKA_VERSION with Maven into $LIBS"
  rm -rf "$LIBS"; mkdir -p "$LIBS"
  mvn -q -B -f "$POM" dependency:copy-dependencies \
      -DoutputDirectory="$LIBS" -DincludeScope=runtime \
    || die "Maven could not fetch org.apache.kafka:kafka_2.13:$KAFKA_VERSION (is Maven Central reachable?)"
  touch "$LIBS/.complete"
}

write_config() {
  write_log_config
  {
    common_properties
    cat <<PROPS
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
PROPS
  } > "$CACHE/server.properties"
}

start() {
  if pid="$(running_pid)"; then
    wait_ready "$pid"
    echo "dev-kafka: already running (pid $pid) on 127.0.0.1:$PORT"
    return 0
  fi
  port_open "$PORT" && die "127.0.0.1:$PORT is taken by another process; stop it or set PIPELINE_KAFKA_PORT"
  fetch
  write_config
  format_storage
  launch
  echo "dev-kafka: Apache Kafka $KAFKA_VERSION ready on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), logs in $LOGS)"
}

status() {
  local pid
  if pid="$(running_pid)" && port_open "$PORT"; then
    echo "dev-kafka: running (pid $pid) on 127.0.0.1:$PORT, Apache Kafka $KAFKA_VERSION, data in $DATA"
  else
    echo "dev-kafka: not running"; return 3
  fi
}

[[ "${1:-}" =~ ^(status|-h|--help)$ ]] || take_lock
case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart) stop; start ;;
  wipe) stop; rm -rf "$DATA" "$LOGS"; echo "dev-kafka: data removed" ;;
  classpath) fetch >&2; echo "$LIBS/*" ;;
  -h|--help) echo "usage: $0 start|stop|status|restart|wipe|classpath"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0" ;;
  *) echo "usage: $0 start|stop|status|restart|wipe|classpath" >&2; exit 2 ;;
esac
