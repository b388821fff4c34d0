# Shared by start.sh and stop.sh (sourced, not run): the state layout and how we recognise our own processes.
# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this

REPO=$(cd "$HERE/../.." && pwd)
PORT=${DREAMGYM_PREFECT_PORT:-4200}
# Default state outside /tmp: the database holds the deployments and their schedules, which must survive a reboot.
DIR=${DREAMGYM_PREFECT_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/dreamgym/prefect}
case $PORT in '' | *[!0-9]*) echo "DREAMGYM_PREFECT_PORT must be a port number, got '$PORT'" >&2; exit 1 ;; esac
if ((PORT < 1024 || PORT > 65535)); then echo "DREAMGYM_PREFECT_PORT=$PORT out of range 1024..65535" >&2; exit 1; fi
API_URL=http://127.0.0.1:$PORT/api
SERVICES="server worker"  # start order; stop goes in reverse (the worker first, so no run starts on a dying server)

# The venv that holds this project: its prefect, and its python for the worker's flow runs.
VENV_BIN=${DREAMGYM_VENV_BIN:-$REPO/.venv/bin}
PREFECT=$VENV_BIN/prefect

# A fragment of the command line that identifies our process: a recycled pid never matches it.
cmdline_tag() {
    case $1 in
        server) echo "server start --host 127.0.0.1 --port $(cat "$DIR/run/port" 2>/dev/null || echo "$PORT") " ;;
        worker) echo "worker start --pool " ;;
    esac
}

# our_pid, lock_state_dir
# shellcheck source=../services.sh
source "$HERE/../services.sh"

# SIGTERM the process group of each service (setsid made it a group leader: the server's uvicorn and the
# worker's flow-run subprocesses go with it), wait up to 15 s, then SIGKILL stragglers; drop the pid files.
stop_services() {
    local name pid waited
    for name in worker server; do
        pid=$(our_pid "$name") || continue
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        waited=0
        while our_pid "$name" >/dev/null; do
            if ((waited >= 150)); then
                echo "$name (pid $pid) ignored SIGTERM; sending SIGKILL" >&2
                kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
                sleep 0.2
                break
            fi
            sleep 0.1
            waited=$((waited + 1))
        done
        echo "stopped $name (pid $pid)" >&2
    done
    for name in $SERVICES; do rm -f "$DIR/run/$name.pid"; done
    rm -f "$DIR/run/port"
}
