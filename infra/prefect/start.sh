#!/usr/bin/env bash
# Start a local Prefect server on 127.0.0.1 and a process worker for the pipeline's work pool, in the background.
# Idempotent: a running, healthy pair is left alone.
#
#   eval "$(infra/prefect/start.sh)"   # status goes to stderr; stdout is `export PREFECT_API_URL=...`
#   infra/prefect/stop.sh              # stop both (the database, with deployments and run history, stays)
#
# Environment:
#   DREAMGYM_PREFECT_PORT     server port (default 4200); the UI is at http://127.0.0.1:PORT
#   DREAMGYM_PREFECT_DIR      state: PREFECT_HOME (database), logs, pid files
#                             (default ${XDG_STATE_HOME:-~/.local/state}/dreamgym/prefect)
#   DREAMGYM_PREFECT_POOL     work pool the worker polls (default: prefect.work_pool in params.yaml)
#   DREAMGYM_PREFECT_WORKER   0: start the server only
#   DREAMGYM_PREFECT_TIMEOUT  seconds to wait for the API and the worker (default 120)
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"
TIMEOUT=${DREAMGYM_PREFECT_TIMEOUT:-120}
WITH_WORKER=${DREAMGYM_PREFECT_WORKER:-1}

say() { echo "start.sh: $*" >&2; }

[ -x "$PREFECT" ] || { say "$PREFECT not found: run \`make setup\` (or set DREAMGYM_VENV_BIN)"; exit 1; }
# params.yaml is the single source of the pool's name; the env var is for a second, separate worker.
POOL=${DREAMGYM_PREFECT_POOL:-$("$VENV_BIN/python" -c \
    'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["prefect"]["work_pool"])' "$REPO/params.yaml")}

# Only this server's settings: a PREFECT_API_URL or profile of the caller must not leak into the server or worker.
export PREFECT_HOME=$DIR/home PREFECT_API_URL=$API_URL PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export PREFECT_UI_API_URL=$API_URL PREFECT_PROFILES_PATH=$DIR/home/profiles.toml
# Flow runs of the worker find the venv's dvc and dreamgym first, as `make run` does.
export PATH=$VENV_BIN:$PATH

api_healthy() { curl -fsS --max-time 3 "$API_URL/health" >/dev/null 2>&1; }

# The worker is up once the server lists it as ONLINE in its pool (it has created the pool and sent a heartbeat).
worker_online() {
    curl -fsS --max-time 3 -X POST -H 'Content-Type: application/json' \
        -d '{"workers": {"status": {"any_": ["ONLINE"]}}}' \
        "$API_URL/work_pools/$POOL/workers/filter" 2>/dev/null | grep -q '"status":"ONLINE"'
}

launch() {  # name command...
    local name=$1; shift
    echo "--- $(date -u +%FT%TZ) start: $*" >>"$DIR/log/$name.log"
    # setsid: its own process group, so a Ctrl-C in this terminal or a test runner never reaches it and stop.sh
    # can end the whole group. env --default-signal=INT: a background job starts with SIGINT ignored, and the
    # worker stops gracefully only by sending itself SIGINT on SIGTERM. 9>&-: the state-dir lock stays here.
    setsid env --default-signal=INT "$@" </dev/null >>"$DIR/log/$name.log" 2>&1 9>&- &
    echo $! >"$DIR/run/$name.pid"
}

fail() {
    say "$1"
    local name
    for name in $SERVICES; do
        [ -f "$DIR/log/$name.log" ] || continue
        echo "----- last lines of $DIR/log/$name.log -----" >&2
        tail -20 "$DIR/log/$name.log" >&2
    done
    stop_services
    exit 1
}

wait_for() {  # what test-command
    local what=$1; shift
    local deadline=$((SECONDS + TIMEOUT)) name
    say "waiting for $what (up to ${TIMEOUT}s)"
    until "$@"; do
        for name in $SERVICES; do
            [ -f "$DIR/run/$name.pid" ] || continue
            our_pid "$name" >/dev/null || fail "$name exited during startup"
        done
        ((SECONDS < deadline)) || fail "$what not ready after ${TIMEOUT}s"
        sleep 0.5
    done
}

lock_state_dir
mkdir -p "$DIR/home" "$DIR/run" "$DIR/log"

if our_pid server >/dev/null && [ "$(cat "$DIR/run/port" 2>/dev/null)" != "$PORT" ]; then
    say "the server in $DIR runs on port $(cat "$DIR/run/port"); moving it to $PORT"
    stop_services
fi
if our_pid server >/dev/null && api_healthy && { [ "$WITH_WORKER" = 0 ] || our_pid worker >/dev/null; }; then
    say "already running at $API_URL (state: $DIR)"
    echo "export PREFECT_API_URL=$API_URL"
    exit 0
fi
if our_pid server >/dev/null || our_pid worker >/dev/null; then
    say "found a partial or unhealthy server/worker; restarting"
    stop_services
fi
if (echo >"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
    say "port $PORT is already in use; pick another DREAMGYM_PREFECT_PORT"
    exit 1
fi

echo "$PORT" >"$DIR/run/port"
launch server "$PREFECT" server start --host 127.0.0.1 --port "$PORT" --analytics-off
wait_for "the API at $API_URL" api_healthy
if [ "$WITH_WORKER" != 0 ]; then
    # --type process: the pool is created on first start if `dreamgym deploy` has not created it yet.
    launch worker "$PREFECT" worker start --pool "$POOL" --type process --name "dreamgym-$(hostname)-$PORT"
    wait_for "a process worker in pool '$POOL'" worker_online
fi
say "running at $API_URL, UI http://127.0.0.1:$PORT (state: $DIR, logs: $DIR/log)"
echo "export PREFECT_API_URL=$API_URL"
