#!/usr/bin/env bash
# Stop the Prefect server and worker started by start.sh: only the processes named by its pid files (and their
# children: a flow run in progress is interrupted, and Prefect marks it crashed). The database in the state
# directory stays, so deployments, schedules and run history survive.
# Finds them by DREAMGYM_PREFECT_DIR (same default as start.sh).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"

if [ ! -d "$DIR/run" ]; then
    echo "stop.sh: nothing at $DIR" >&2
    exit 0
fi
lock_state_dir
stop_services
