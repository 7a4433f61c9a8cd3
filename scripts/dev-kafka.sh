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
DATA="$CACHE/data"
LOGS="$CACHE/logs"
PIDFILE="$CACHE/kafka.pid"
PORT="${PIPELINE_KAFKA_PORT:-9092}"
CONTROLLER_PORT="${PIPELINE_KAFKA_CONTROLLER_PORT:-9093}"
START_TIMEOUT_S="${PIPELINE_KAFKA_START_TIMEOUT_S:-120}"

die() { echo "dev-kafka: $*" >&2; exit 1; }

# One dev-kafka.sh at a time: two starts at once (a setup script and a test run)
# would fetch and format the same storage together, and one of them fail.
take_lock() {
  command -v flock >/dev/null || return 0
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock -w 600 9 || die "another dev-kafka.sh held $CACHE/.lock for 10 minutes"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

running_pid() {
  [[ -f "$PIDFILE" ]] || return 1
  local pid; pid="$(cat "$PIDFILE")"
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

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
  mkdir -p "$DATA" "$LOGS"
  cat > "$CACHE/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$DATA
num.partitions=1
# Topics are created explicitly (pipeline topics create), as on a production cluster.
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.retention.hours=24
PROPS
  cat > "$CACHE/log4j2.properties" <<PROPS
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = $LOGS/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
PROPS
}

java_run() {
  java -Xms256m -Xmx1g -XX:+UseG1GC -Djava.awt.headless=true \
       -Dlog4j2.configurationFile="$CACHE/log4j2.properties" \
       -cp "$LIBS/*" "$@"
}

format_storage() {
  [[ -f "$DATA/meta.properties" ]] && return 0
  local cluster_id
  cluster_id="$(java_run kafka.tools.StorageTool random-uuid)"
  java_run kafka.tools.StorageTool format -t "$cluster_id" -c "$CACHE/server.properties" >/dev/null \
    || die "formatting KRaft storage in $DATA failed"
}

start() {
  if pid="$(running_pid)"; then
    wait_ready "$pid"
    echo "dev-kafka: already running (pid $pid) on 127.0.0.1:$PORT"
    return 0
  fi
  port_open && die "127.0.0.1:$PORT is taken by another process; stop it or set PIPELINE_KAFKA_PORT"
  fetch
  write_config
  format_storage
  : > "$LOGS/server.log"
  nohup java -Xms256m -Xmx1g -XX:+UseG1GC -Djava.awt.headless=true \
       -Dlog4j2.configurationFile="$CACHE/log4j2.properties" \
       -cp "$LIBS/*" kafka.Kafka "$CACHE/server.properties" \
       > "$LOGS/stdout.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$PIDFILE"
  wait_ready "$!"
  echo "dev-kafka: Apache Kafka $KAFKA_VERSION ready on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), logs in $LOGS)"
}

wait_ready() {
  local pid="$1" deadline=$((SECONDS + START_TIMEOUT_S))
  until port_open && grep -q "Kafka Server started" "$LOGS/server.log" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$LOGS/stdout.log" "$LOGS/server.log" >&2; die "broker exited during start-up (logs in $LOGS)"; }
    (( SECONDS < deadline )) || die "broker did not answer on 127.0.0.1:$PORT within ${START_TIMEOUT_S}s (logs in $LOGS)"
    sleep 0.5
  done
}

stop() {
  local pid
  if ! pid="$(running_pid)"; then
    rm -f "$PIDFILE"; echo "dev-kafka: not running"; return 0
  fi
  kill "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$PIDFILE"
  echo "dev-kafka: stopped (pid $pid)"
}

status() {
  local pid
  if pid="$(running_pid)" && port_open; then
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
