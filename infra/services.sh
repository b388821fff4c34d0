# Process bookkeeping shared by the local services' scripts (infra/s3, infra/prefect); sourced by their common.sh,
# which first sets DIR (the state directory) and defines cmdline_tag SERVICE (what identifies our process).
# shellcheck shell=bash

# Print the pid of service $1 if its pid file names a live process of ours (zombies have an empty cmdline).
our_pid() {
    local file=$DIR/run/$1.pid pid cmdline
    [ -f "$file" ] || return 1
    pid=$(<"$file")
    case $pid in '' | *[!0-9]*) return 1 ;; esac
    # 2> before <: it also quiets the redirection's own error when the process is gone
    cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") || return 1
    [[ "$cmdline " == *"$(cmdline_tag "$1")"* ]] || return 1
    echo "$pid"
}

# One start.sh/stop.sh at a time per state directory.
lock_state_dir() {
    mkdir -p "$DIR"
    exec 9>"$DIR/.lock"
    flock -w 120 9 || { echo "another start.sh/stop.sh holds $DIR/.lock" >&2; exit 1; }
}
