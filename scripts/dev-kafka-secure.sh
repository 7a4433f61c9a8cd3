#!/usr/bin/env bash
# A second single-node Apache Kafka broker (KRaft) with every kind of security
# listener, for trying and testing secured clusters. It runs from the jars that
# scripts/dev-kafka.sh fetched (the same Kafka release), with its own data, logs,
# ports and a private CA made at first start (openssl), all outside the repo.
#
#   scripts/dev-kafka-secure.sh start|stop|status|restart|wipe|env
#
# Listeners (PIPELINE_KAFKA_SECURE_PORT, default 9192, and the next ones):
#   9192 PLAINTEXT       (also the brokers' own listener)
#   9193 SASL_PLAINTEXT  SCRAM-SHA-512 and PLAIN
#   9194 SSL             server certificate from the private CA, for "localhost" only
#   9195 SSL             client certificate required (mutual TLS)
#   9196 SASL_SSL        SCRAM-SHA-512 and PLAIN over TLS
#   9197 the KRaft controller
# Users: alice (SCRAM-SHA-512 and PLAIN; super user), mallory (SCRAM-SHA-512 and
# PLAIN; no ACLs, so authenticated but refused everything). The mutual-TLS client
# is CN=pipeline-client (super user).
#
# `env` prints export lines naming the ports, users, passwords and files
# (CA, client certificate and keys, another CA that signed nothing of this broker):
#   eval "$(scripts/dev-kafka-secure.sh env)"
# These passwords are for this throw-away development broker only.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
POM="$HERE/kafka/pom.xml"
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM")"
KAFKA_HOME="${PIPELINE_KAFKA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/embedding-pipeline/kafka-$KAFKA_VERSION}"
LIBS="$KAFKA_HOME/libs"
BASE="${PIPELINE_KAFKA_SECURE_PORT:-9192}"
CACHE="${PIPELINE_KAFKA_SECURE_HOME:-$KAFKA_HOME/secure-$BASE}"
TLS="$CACHE/tls"

PLAIN_PORT=$BASE
SASL_PORT=$((BASE + 1))
SSL_PORT=$((BASE + 2))
MTLS_PORT=$((BASE + 3))
SASL_SSL_PORT=$((BASE + 4))
CONTROLLER_PORT=$((BASE + 5))

SASL_USER=alice
PASSWORD=alice-dev-pw-7c1e
DENIED_USER=mallory
DENIED_PASSWORD=mallory-dev-pw-2b9d
STORE_PASSWORD=broker-store-pw-41fa
KEY_PASSWORD=client-key-pw-5d03

NAME=dev-kafka-secure HEAP_MIN=128m HEAP=512m
ready_port() { echo "$SASL_SSL_PORT"; }
# shellcheck source=kafka/broker.sh
source "$HERE/kafka/broker.sh"

fetch() {
  [[ -f "$LIBS/.complete" ]] && return 0
  "$HERE/dev-kafka.sh" classpath >/dev/null
}

# The private CA, the broker's keystore (PKCS12), a client certificate with a plain
# and an encrypted key, and a second CA that signed nothing here ("untrusted").
make_tls() {
  [[ -f "$TLS/.complete" ]] && return 0
  command -v openssl >/dev/null || die "openssl is needed to make the private CA"
  rm -rf "$TLS"; mkdir -p "$TLS"
  (
    cd "$TLS"
    local days=3650
    openssl req -x509 -newkey rsa:2048 -nodes -days $days -subj "/CN=pipeline-dev-ca" \
      -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -x509 -newkey rsa:2048 -nodes -days $days -subj "/CN=some-other-ca" \
      -keyout other-ca.key -out other-ca.pem 2>/dev/null
    # The broker's certificate names localhost only: 127.0.0.1 is a host name mismatch.
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
      -keyout broker.key -out broker.csr 2>/dev/null
    printf 'subjectAltName=DNS:localhost\n' > broker.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
      -days $days -extfile broker.ext -out broker.pem 2>/dev/null
    openssl pkcs12 -export -in broker.pem -inkey broker.key -certfile ca.pem -name broker \
      -out broker.p12 -passout "pass:$STORE_PASSWORD"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=pipeline-client" \
      -keyout client.key -out client.csr 2>/dev/null
    openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
      -days $days -out client.pem 2>/dev/null
    openssl pkey -in client.key -aes256 -passout "pass:$KEY_PASSWORD" -out client-encrypted.key
    # A client the broker does not trust: signed by the other CA.
    openssl req -newkey rsa:2048 -nodes -subj "/CN=stranger" \
      -keyout stranger.key -out stranger.csr 2>/dev/null
    openssl x509 -req -in stranger.csr -CA other-ca.pem -CAkey other-ca.key -CAcreateserial \
      -days $days -out stranger.pem 2>/dev/null
    rm -f ./*.csr ./*.srl broker.ext
  ) || die "making the private CA in $TLS failed"
  chmod 600 "$TLS"/*.key "$TLS"/*.p12
  touch "$TLS/.complete"
}

jaas() {
  local login="$1" users=""
  if [[ "$login" == plain ]]; then
    users="user_$SASL_USER=\"$PASSWORD\" user_$DENIED_USER=\"$DENIED_PASSWORD\""
    echo "org.apache.kafka.common.security.plain.PlainLoginModule required $users;"
  else
    echo "org.apache.kafka.common.security.scram.ScramLoginModule required;"
  fi
}

write_config() {
  write_log_config
  local listener
  {
    common_properties
    cat <<PROPS
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=INTERNAL://127.0.0.1:$PLAIN_PORT,SASL://127.0.0.1:$SASL_PORT,TLS://127.0.0.1:$SSL_PORT,MTLS://127.0.0.1:$MTLS_PORT,SASLTLS://127.0.0.1:$SASL_SSL_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=INTERNAL://127.0.0.1:$PLAIN_PORT,SASL://127.0.0.1:$SASL_PORT,TLS://localhost:$SSL_PORT,MTLS://localhost:$MTLS_PORT,SASLTLS://localhost:$SASL_SSL_PORT
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,SASL:SASL_PLAINTEXT,TLS:SSL,MTLS:SSL,SASLTLS:SASL_SSL
# ACLs: the broker itself (PLAINTEXT and SSL without a client certificate are
# ANONYMOUS), alice and the mutual-TLS client may do anything; mallory nothing.
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:ANONYMOUS;User:$SASL_USER;User:CN=pipeline-client
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS/broker.p12
ssl.keystore.password=$STORE_PASSWORD
ssl.key.password=$STORE_PASSWORD
ssl.truststore.type=PEM
ssl.truststore.location=$TLS/ca.pem
ssl.client.auth=none
listener.name.mtls.ssl.client.auth=required
sasl.enabled.mechanisms=SCRAM-SHA-512,PLAIN
PROPS
    for listener in sasl sasltls; do
      echo "listener.name.$listener.plain.sasl.jaas.config=$(jaas plain)"
      echo "listener.name.$listener.scram-sha-512.sasl.jaas.config=$(jaas scram)"
    done
  } > "$CACHE/server.properties"
  chmod 600 "$CACHE/server.properties"
}

# SCRAM credentials go into the metadata log at format time (KRaft has no ZooKeeper
# to hold them); PLAIN users are in the listeners' JAAS lines above.
format_scram() {
  format_storage \
      --add-scram "SCRAM-SHA-512=[name=$SASL_USER,password=$PASSWORD]" \
      --add-scram "SCRAM-SHA-512=[name=$DENIED_USER,password=$DENIED_PASSWORD]"
}

start() {
  if pid="$(running_pid)"; then
    wait_ready "$pid"
    echo "dev-kafka-secure: already running (pid $pid) on 127.0.0.1:$PLAIN_PORT-$SASL_SSL_PORT"
    return 0
  fi
  local port
  for port in $PLAIN_PORT $SASL_PORT $SSL_PORT $MTLS_PORT $SASL_SSL_PORT $CONTROLLER_PORT; do
    port_open "$port" && die "127.0.0.1:$port is taken by another process; stop it or set PIPELINE_KAFKA_SECURE_PORT"
  done
  command -v java >/dev/null || die "Java 17+ is needed to run Kafka $KAFKA_VERSION; install it and retry"
  fetch
  make_tls
  write_config
  format_scram
  launch
  echo "dev-kafka-secure: Apache Kafka $KAFKA_VERSION ready on 127.0.0.1:$PLAIN_PORT-$SASL_SSL_PORT (pid $(cat "$PIDFILE"), logs in $LOGS)"
}

status() {
  local pid
  if pid="$(running_pid)" && port_open "$SASL_SSL_PORT"; then
    echo "dev-kafka-secure: running (pid $pid) on 127.0.0.1:$PLAIN_PORT-$SASL_SSL_PORT, Apache Kafka $KAFKA_VERSION, data in $DATA"
  else
    echo "dev-kafka-secure: not running"; return 3
  fi
}

print_env() {
  cat <<ENV
export SECURE_KAFKA_PLAINTEXT=127.0.0.1:$PLAIN_PORT
export SECURE_KAFKA_SASL_PLAINTEXT=127.0.0.1:$SASL_PORT
export SECURE_KAFKA_SSL=localhost:$SSL_PORT
export SECURE_KAFKA_MTLS=localhost:$MTLS_PORT
export SECURE_KAFKA_SASL_SSL=localhost:$SASL_SSL_PORT
export SECURE_KAFKA_USER=$SASL_USER
export SECURE_KAFKA_PASSWORD=$PASSWORD
export SECURE_KAFKA_DENIED_USER=$DENIED_USER
export SECURE_KAFKA_DENIED_PASSWORD=$DENIED_PASSWORD
export SECURE_KAFKA_CA=$TLS/ca.pem
export SECURE_KAFKA_OTHER_CA=$TLS/other-ca.pem
export SECURE_KAFKA_CLIENT_CERT=$TLS/client.pem
export SECURE_KAFKA_CLIENT_KEY=$TLS/client.key
export SECURE_KAFKA_CLIENT_ENCRYPTED_KEY=$TLS/client-encrypted.key
export SECURE_KAFKA_CLIENT_KEY_PASSWORD=$KEY_PASSWORD
export SECURE_KAFKA_STRANGER_CERT=$TLS/stranger.pem
export SECURE_KAFKA_STRANGER_KEY=$TLS/stranger.key
ENV
}

[[ "${1:-}" =~ ^(status|env|-h|--help)$ ]] || take_lock
case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart) stop; start ;;
  wipe) stop; rm -rf "$DATA" "$LOGS" "$TLS"; echo "dev-kafka-secure: data and certificates removed" ;;
  env) print_env ;;
  -h|--help) echo "usage: $0 start|stop|status|restart|wipe|env"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0" ;;
  *) echo "usage: $0 start|stop|status|restart|wipe|env" >&2; exit 2 ;;
esac
