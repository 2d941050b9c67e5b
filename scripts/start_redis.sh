#!/usr/bin/env bash
# Starts a loopback Redis server for the KV store (tests and benchmarks), installing Debian's
# redis-server first if it is missing. Idempotent: a server already answering on PORT is kept.
# Usage: bash scripts/start_redis.sh PORT [DIR]   (DIR holds redis-PORT.pid/.log; default /tmp/vericache-redis)
#        bash scripts/start_redis.sh --install      (install only; the tests start their own servers)
#        bash scripts/start_redis.sh --stop PORT [DIR]
set -euo pipefail

install_redis() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
  command -v redis-server >/dev/null
}

case "${1:-}" in
  --install) install_redis; exit 0 ;;
  --stop)
    PORT=${2:?usage: start_redis.sh --stop PORT [DIR]}; DIR=${3:-/tmp/vericache-redis}
    PIDFILE="$DIR/redis-$PORT.pid"
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then kill "$(cat "$PIDFILE")"; fi
    rm -f "$PIDFILE"; exit 0 ;;
  ''|-*) echo "usage: $0 PORT [DIR] | --install | --stop PORT [DIR]" >&2; exit 2 ;;
esac

PORT=$1; DIR=${2:-/tmp/vericache-redis}
install_redis
mkdir -p "$DIR"
PIDFILE="$DIR/redis-$PORT.pid"
if [ "$(redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null || true)" = "PONG" ]; then
  echo "redis already running on 127.0.0.1:$PORT"; exit 0
fi
redis-server --port "$PORT" --bind 127.0.0.1 --daemonize yes --pidfile "$PIDFILE" \
  --logfile "$DIR/redis-$PORT.log" --dir "$DIR" --save "" --appendonly no \
  --maxmemory-policy noeviction
for _ in $(seq 50); do
  if [ "$(redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null || true)" = "PONG" ]; then
    echo "redis running on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"))"; exit 0
  fi
  sleep 0.1
done
echo "redis did not start on port $PORT; see $DIR/redis-$PORT.log" >&2
exit 1
