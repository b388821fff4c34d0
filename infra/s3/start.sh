#!/usr/bin/env bash
# Start a real S3-compatible object store on 127.0.0.1: OpenStack Swift with its s3api middleware, for the
# tests and for users without cloud S3. Idempotent: a healthy running store is left alone.
#
#   eval "$(infra/s3/start.sh)"      # status goes to stderr; stdout is the export line for the AWS_* variables
#   infra/s3/stop.sh [--purge]       # stop; --purge also deletes the stored data
#
# Environment:
#   DREAMGYM_S3_PORT     S3 endpoint port (default 9000); PORT+1..PORT+4 are used internally
#   DREAMGYM_S3_DIR      state: configs, rings, data, logs, pid files (default ${TMPDIR:-/tmp}/dreamgym-s3)
#   DREAMGYM_S3_BUCKET   optional bucket to create once the store is up
#   DREAMGYM_S3_TIMEOUT  seconds to wait for the store to become healthy (default 60)
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"
TIMEOUT=${DREAMGYM_S3_TIMEOUT:-60}
BUCKET=${DREAMGYM_S3_BUCKET:-}
RUN_USER=$(id -un)
COMMANDS="swift-ring-builder swift-proxy-server swift-account-server swift-container-server swift-object-server
memcached"
PACKAGES=(swift swift-proxy swift-account swift-container swift-object memcached)

say() { echo "start.sh: $*" >&2; }

install_packages() {
    local cmd missing=""
    for cmd in $COMMANDS; do command -v "$cmd" >/dev/null || missing="$missing $cmd"; done
    [ -z "$missing" ] && return 0
    say "missing:$missing"
    "$HERE/../install-debian-packages.sh" "${PACKAGES[@]}"
}

# Something accepts connections on 127.0.0.1:$1.
port_busy() { (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Healthy: the object and container servers listen (ListBuckets alone never reaches them) and an
# authenticated S3 ListBuckets succeeds through proxy, s3api, tempauth, memcached and the account server.
healthy() {
    # shellcheck disable=SC2086
    port_busy "$OBJECT_PORT" && port_busy "$CONTAINER_PORT" &&
        $SWIFT_PYTHON "$HERE/s3check.py" "$ENDPOINT" "$ACCESS_KEY" "$SECRET_KEY" 2>/dev/null
}

print_env() {
    if [ -n "$BUCKET" ]; then
        # shellcheck disable=SC2086
        $SWIFT_PYTHON "$HERE/s3check.py" "$ENDPOINT" "$ACCESS_KEY" "$SECRET_KEY" "$BUCKET" ||
            { say "could not create bucket '$BUCKET'; see $DIR/log/proxy.log"; exit 1; }
        say "bucket '$BUCKET' ready"
    fi
    echo "export AWS_ENDPOINT_URL=$ENDPOINT AWS_ACCESS_KEY_ID=$ACCESS_KEY" \
        "AWS_SECRET_ACCESS_KEY=$SECRET_KEY AWS_DEFAULT_REGION=us-east-1"
}

write_configs() {
    mkdir -p "$DIR/etc" "$DIR/devices/sdb1" "$DIR/cache" "$DIR/run" "$DIR/log"
    touch "$MARKER"
    # Hash prefix/suffix place objects on disk: fixed, so a restarted store finds its data again.
    cat >"$DIR/etc/swift.conf" <<CONF
[swift-hash]
swift_hash_path_prefix = dreamgym
swift_hash_path_suffix = dreamgym-local

[storage-policy:0]
name = Policy-0
default = yes
CONF
    # Every server names its own swift_dir and devices, so /etc/swift is never read or written.
    # workers = 0: one process per server, so the pid file names exactly what runs.
    local kind port
    for kind in account container object; do
        port=${kind^^}_PORT  # ACCOUNT_PORT, ...
        port=${!port}
        cat >"$DIR/etc/$kind-server.conf" <<CONF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $port
workers = 0
user = $RUN_USER
swift_dir = $DIR/etc
devices = $DIR/devices
mount_check = false
recon_cache_path = $DIR/cache
log_level = INFO

[pipeline:main]
pipeline = healthcheck $kind-server

[app:$kind-server]
use = egg:swift#$kind
conn_timeout = 10
node_timeout = 60

[filter:healthcheck]
use = egg:swift#healthcheck
CONF
    done
    cat >"$DIR/etc/proxy-server.conf" <<CONF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $PORT
workers = 0
user = $RUN_USER
swift_dir = $DIR/etc
log_level = INFO

[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth copy slo dlo versioned_writes symlink proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true
# One process per server on a loaded machine: Swift's defaults (0.5 s to connect, a node shunned for 60 s after 10
# errors) turn a busy moment into minutes of 503 SlowDown, since there is no other replica to ask.
conn_timeout = 10
node_timeout = 60
error_suppression_interval = 1

[filter:s3api]
use = egg:swift#s3api
location = us-east-1

[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = $SECRET_KEY .admin

[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:$MEMCACHED_PORT

[filter:catch_errors]
use = egg:swift#catch_errors
[filter:gatekeeper]
use = egg:swift#gatekeeper
[filter:healthcheck]
use = egg:swift#healthcheck
[filter:proxy-logging]
use = egg:swift#proxy_logging
[filter:listing_formats]
use = egg:swift#listing_formats
[filter:copy]
use = egg:swift#copy
[filter:slo]
use = egg:swift#slo
[filter:dlo]
use = egg:swift#dlo
[filter:versioned_writes]
use = egg:swift#versioned_writes
[filter:symlink]
use = egg:swift#symlink
CONF
}

# One device, one replica, 2^8 partitions (make_rings.py). Rebuilt only when the ports changed: where an
# object lives on disk depends on its hash, not on the ring, so the data stays readable.
build_rings() {
    local ports="$ACCOUNT_PORT $CONTAINER_PORT $OBJECT_PORT"
    if [ -f "$DIR/etc/object.ring.gz" ] && [ "$(cat "$DIR/etc/ring-ports" 2>/dev/null)" = "$ports" ]; then
        return 0
    fi
    say "building rings"
    # shellcheck disable=SC2086  # the interpreter may be "/usr/bin/env python3"
    $SWIFT_PYTHON "$HERE/make_rings.py" "$DIR/etc" $ports >"$DIR/log/rings.log" 2>&1 || {
        say "building the rings failed:"
        tail -20 "$DIR/log/rings.log" >&2
        exit 1
    }
    echo "$ports" >"$DIR/etc/ring-ports"
}

launch() {  # name command...
    local name=$1; shift
    echo "--- $(date -u +%FT%TZ) start: $*" >>"$DIR/log/$name.log"
    # setsid: own session, so a Ctrl-C or a test runner's process group never reaches the store.
    # 9>&-: the state-dir lock must not be inherited, or the store would hold it for its whole life.
    setsid "$@" </dev/null >>"$DIR/log/$name.log" 2>&1 9>&- &
    echo $! >"$DIR/run/$name.pid"
}

fail() {
    say "$1"
    local name
    for name in $SERVICES; do
        echo "----- last lines of $DIR/log/$name.log -----" >&2
        tail -15 "$DIR/log/$name.log" >&2 2>/dev/null || true
    done
    stop_services
    exit 1
}

install_packages
# Swift's own interpreter, from a Swift script's #! line (/usr/bin/python3 on Debian); the probe is stdlib only.
read -r SWIFT_PYTHON <"$(command -v swift-ring-builder)"
SWIFT_PYTHON=${SWIFT_PYTHON#\#!}
lock_state_dir

running=0
for name in $SERVICES; do our_pid "$name" >/dev/null && running=$((running + 1)); done
if [ $running -gt 0 ] && [ "$(cat "$DIR/run/port" 2>/dev/null)" != "$PORT" ]; then
    say "the store in $DIR runs on port $(cat "$DIR/run/port" 2>/dev/null); moving it to $PORT"
    stop_services
    running=0
fi
if [ $running -eq 5 ] && healthy; then
    say "already running at $ENDPOINT (state: $DIR)"
    print_env
    exit 0
fi
if [ $running -gt 0 ]; then
    say "found a partial or unhealthy store ($running/5 processes); restarting it"
    stop_services
fi

for port in $PORT $ACCOUNT_PORT $CONTAINER_PORT $OBJECT_PORT $MEMCACHED_PORT; do
    if port_busy "$port"; then
        say "port $port is already in use; pick another DREAMGYM_S3_PORT (the store uses PORT..PORT+4)"
        exit 1
    fi
done

write_configs
build_rings
echo "$PORT" >"$DIR/run/port"
launch memcached memcached -l 127.0.0.1 -p "$MEMCACHED_PORT" -U 0 -m 64 -u "$RUN_USER"
for kind in account container object proxy; do
    # shellcheck disable=SC2086
    launch "$kind" $SWIFT_PYTHON "$HERE/swift_server.py" "$DIR/etc" "$(command -v "swift-$kind-server")" \
        "$DIR/etc/$kind-server.conf" --verbose
done

say "waiting for $ENDPOINT (up to ${TIMEOUT}s)"
deadline=$((SECONDS + TIMEOUT))
until healthy; do
    for name in $SERVICES; do
        our_pid "$name" >/dev/null || fail "$name exited during startup"
    done
    ((SECONDS < deadline)) || fail "store not healthy after ${TIMEOUT}s"
    sleep 0.5
done
say "running at $ENDPOINT (state: $DIR, logs: $DIR/log)"
print_env
