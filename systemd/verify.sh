#!/bin/sh
# Verify the systemd files: unit syntax and semantics (systemd-analyze verify), the
# sysusers.d and tmpfiles.d entries (applied to a throw-away root), and the sandbox's
# exposure score. Exits non-zero on any error or warning.
#
#   CI (Debian/Ubuntu):  apt-get install -y systemd && sh systemd/verify.sh
#
# No running systemd (PID 1) is needed: a container is fine.
# `systemd-analyze verify` requires ExecStart= binaries to exist, and reports parse errors
# (an unknown key, a bad value) as warnings while still exiting 0, so the units are
# copied to a temporary directory with /usr/bin/turnkeeper pointed at a stub, and any
# output at all counts as a failure.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
max_exposure=${MAX_EXPOSURE:-2.0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

printf '#!/bin/sh\nexit 0\n' >"$tmp/turnkeeper"
chmod +x "$tmp/turnkeeper"
for unit in turnkeeper.service turnkeeper.socket; do
    sed "s#/usr/bin/turnkeeper#$tmp/turnkeeper#g" "$here/$unit" >"$tmp/$unit"
done

status=0
echo "== systemd-analyze verify"
if ! out=$(systemd-analyze verify --man=no --generators=no \
        "$tmp/turnkeeper.service" "$tmp/turnkeeper.socket" 2>&1) || [ -n "$out" ]; then
    printf '%s\n' "$out" >&2
    status=1
fi

echo "== sysusers.d and tmpfiles.d (in a temporary root)"
mkdir -p "$tmp/root/etc"
if ! out=$(systemd-sysusers --root="$tmp/root" "$here/sysusers.d/turnkeeper.conf" 2>&1 &&
        grep -q '^turnkeeper:' "$tmp/root/etc/passwd" &&
        systemd-tmpfiles --root="$tmp/root" --create "$here/tmpfiles.d/turnkeeper.conf" 2>&1) ||
        ! [ -d "$tmp/root/run/turnkeeper" ]; then
    printf '%s\n' "$out" >&2
    status=1
fi

echo "== systemd-analyze security (exposure must stay <= $max_exposure)"
report=$(systemd-analyze security --offline=yes --no-pager "$tmp/turnkeeper.service" 2>&1) || {
    printf '%s\n' "$report" >&2
    status=1
}
exposure=$(printf '%s\n' "$report" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
echo "exposure: ${exposure:-unknown}"
if [ -z "$exposure" ] || ! awk -v e="$exposure" -v m="$max_exposure" 'BEGIN { exit !(e <= m) }'; then
    printf '%s\n' "$report" >&2
    status=1
fi

[ "$status" -eq 0 ] && echo "systemd files: OK"
exit "$status"
