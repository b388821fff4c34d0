# Shared by start.sh and stop.sh (sourced, not run). Names the state layout and tracks our processes.
# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this

PORT=${DREAMGYM_S3_PORT:-9000}
DIR=${DREAMGYM_S3_DIR:-${TMPDIR:-/tmp}/dreamgym-s3}
case $PORT in '' | *[!0-9]*) echo "DREAMGYM_S3_PORT must be a port number, got '$PORT'" >&2; exit 1 ;; esac
if ((PORT < 1024 || PORT > 65530)); then
    echo "DREAMGYM_S3_PORT=$PORT out of range: the store needs PORT..PORT+4 within 1024..65535" >&2; exit 1
fi
# Internal ports are offsets from the public one: stores whose ports are 5 or more apart never collide.
ACCOUNT_PORT=$((PORT + 1)) CONTAINER_PORT=$((PORT + 2)) OBJECT_PORT=$((PORT + 3)) MEMCACHED_PORT=$((PORT + 4))
ENDPOINT=http://127.0.0.1:$PORT
# Throwaway credentials of a loopback-only development store (tempauth user test:tester).
ACCESS_KEY=test:tester SECRET_KEY=testing
# Start order; stop goes in reverse (proxy first, so no request reaches a half-stopped backend).
SERVICES="memcached account container object proxy"
MARKER=$DIR/.dreamgym-s3  # start.sh creates it; stop.sh --purge deletes only directories that carry it

# A fragment of the command line that identifies our process: a recycled pid never matches it. memcached's
# port comes from run/port, written at launch, so stop.sh finds it whatever DREAMGYM_S3_PORT says now.
cmdline_tag() {
    if [ "$1" = memcached ]; then
        echo "memcached -l 127.0.0.1 -p $(($(cat "$DIR/run/port" 2>/dev/null || echo 0) + 4)) "
    else
        echo "$DIR/etc/$1-server.conf "
    fi
}

# our_pid, lock_state_dir
# shellcheck source=../services.sh
source "$HERE/../services.sh"

# SIGTERM the processes named by our pid files, wait for them, SIGKILL stragglers, drop the pid files.
stop_services() {
    local name pid pids=() waited=0 services
    services=$(echo "$SERVICES" | tr ' ' '\n' | tac | tr '\n' ' ')
    for name in $services; do
        if pid=$(our_pid "$name"); then
            kill -TERM "$pid" 2>/dev/null && pids+=("$name:$pid")
        fi
    done
    for entry in "${pids[@]}"; do
        name=${entry%%:*}
        while our_pid "$name" >/dev/null; do
            if ((waited >= 100)); then  # 10 s
                echo "$name (pid ${entry#*:}) ignored SIGTERM; sending SIGKILL" >&2
                kill -KILL "${entry#*:}" 2>/dev/null || true
                sleep 0.2
                break
            fi
            sleep 0.1
            waited=$((waited + 1))
        done
        echo "stopped $name (pid ${entry#*:})" >&2
    done
    for name in $SERVICES; do rm -f "$DIR/run/$name.pid"; done
    rm -f "$DIR/run/port"
}
