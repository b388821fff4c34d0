#!/usr/bin/env bash
# Install Debian packages that are missing (fast no-op when all are there). Output goes to stderr.
#   infra/install-debian-packages.sh              the project's list, infra/debian-packages.txt
#   infra/install-debian-packages.sh PKG...       just these
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if (($#)); then wanted=("$@"); else mapfile -t wanted < <(grep -v '^\s*#' "$here/debian-packages.txt" | awk 'NF {print $1}'); fi
missing=()
for package in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
((${#missing[@]} == 0)) && exit 0
command -v apt-get >/dev/null || { echo "missing packages: ${missing[*]}; install them with your package manager" >&2; exit 1; }
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else echo "need root to run: apt-get install -y --no-install-recommends ${missing[*]}" >&2; exit 1
  fi
}
echo "installing Debian packages: ${missing[*]}" >&2
# Package init scripts would start system-wide services (memcached, swift); policy-rc.d exit 101 forbids that.
policy=/usr/sbin/policy-rc.d created=""
if [ ! -e "$policy" ]; then
  as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod +x $policy" && created=1
fi
status=0
as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || status=$?
if [ $status -eq 0 ]; then
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || status=$?
fi
[ -n "$created" ] && as_root rm -f "$policy"
[ $status -eq 0 ] || { echo "apt-get failed (exit $status); see the output above" >&2; exit 1; }
