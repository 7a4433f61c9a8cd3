# The life cycle of a development Kafka broker, sourced by scripts/dev-kafka.sh and
# scripts/dev-kafka-secure.sh (not run on its own). Before sourcing, set:
#   NAME      the script's name, for messages
#   CACHE     the broker's home (data, logs, pid file, configuration)
#   LIBS      the Kafka jars (scripts/dev-kafka.sh fetches them)
#   HEAP      the broker's -Xmx (its -Xms is an eighth of a gigabyte or a quarter)
# and define `ready_port`, the port whose answer (with the log's start line) means
# the broker is up. Each script writes its own server.properties; the settings every
# single-node development broker shares are `common_properties`.

DATA="$CACHE/data"
LOGS="$CACHE/logs"
PIDFILE="$CACHE/kafka.pid"
START_TIMEOUT_S="${PIPELINE_KAFKA_START_TIMEOUT_S:-120}"

die() { echo "$NAME: $*" >&2; exit 1; }

# One script at a time per broker: two starts at once (a setup script and a test run)
# would fetch and format the same storage together, and one of them fail.
take_lock() {
  command -v flock >/dev/null || return 0
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock -w 600 9 || die "another $NAME held $CACHE/.lock for 10 minutes"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

running_pid() {
  [[ -f "$PIDFILE" ]] || return 1
  local pid; pid="$(cat "$PIDFILE")"
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# A single node, no replication: what both brokers set alike.
common_properties() {
  cat <<PROPS
process.roles=broker,controller
node.id=1
controller.listener.names=CONTROLLER
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
}

write_log_config() {
  mkdir -p "$DATA" "$LOGS"
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
  java "-Xms${HEAP_MIN}" "-Xmx${HEAP}" -XX:+UseG1GC -Djava.awt.headless=true \
       -Dlog4j2.configurationFile="$CACHE/log4j2.properties" \
       -cp "$LIBS/*" "$@"
}

# format_storage [kafka-storage format options...]: once, on a fresh data directory.
format_storage() {
  [[ -f "$DATA/meta.properties" ]] && return 0
  local cluster_id
  cluster_id="$(java_run kafka.tools.StorageTool random-uuid)"
  java_run kafka.tools.StorageTool format -t "$cluster_id" -c "$CACHE/server.properties" "$@" \
      >/dev/null || die "formatting KRaft storage in $DATA failed"
}

# Starts the configured broker in the background and waits until it answers.
launch() {
  : > "$LOGS/server.log"
  nohup java "-Xms${HEAP_MIN}" "-Xmx${HEAP}" -XX:+UseG1GC -Djava.awt.headless=true \
       -Dlog4j2.configurationFile="$CACHE/log4j2.properties" \
       -cp "$LIBS/*" kafka.Kafka "$CACHE/server.properties" \
       > "$LOGS/stdout.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$PIDFILE"
  wait_ready "$!"
}

wait_ready() {
  local pid="$1" deadline=$((SECONDS + START_TIMEOUT_S))
  until port_open "$(ready_port)" && grep -q "Kafka Server started" "$LOGS/server.log" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$LOGS/stdout.log" "$LOGS/server.log" >&2; die "broker exited during start-up (logs in $LOGS)"; }
    (( SECONDS < deadline )) || die "broker did not answer on 127.0.0.1:$(ready_port) within ${START_TIMEOUT_S}s (logs in $LOGS)"
    sleep 0.5
  done
}

stop() {
  local pid
  if ! pid="$(running_pid)"; then
    rm -f "$PIDFILE"; echo "$NAME: not running"; return 0
  fi
  kill "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$PIDFILE"
  echo "$NAME: stopped (pid $pid)"
}
