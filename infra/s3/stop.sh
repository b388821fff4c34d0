#!/usr/bin/env bash
# Stop the local S3 store started by start.sh: only the processes named by its pid files.
# Keeps the stored data unless --purge. Finds the store by DREAMGYM_S3_DIR (same default as start.sh).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"

purge=""
case ${1:-} in
    "") ;;
    --purge) purge=1 ;;
    *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
esac

if [ ! -d "$DIR" ]; then
    echo "stop.sh: nothing at $DIR" >&2
    exit 0
fi
lock_state_dir
stop_services
if [ -n "$purge" ]; then
    # Only a directory start.sh created: a mistyped DREAMGYM_S3_DIR must never cost someone their files.
    if [ -f "$MARKER" ]; then
        rm -rf "$DIR"
        echo "stop.sh: purged $DIR" >&2
    else
        echo "stop.sh: $DIR was not created by start.sh; not deleting it" >&2
        exit 1
    fi
fi
