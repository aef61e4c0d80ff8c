# shellcheck shell=bash
# What the release scripts (package.sh, package-check.sh) share, sourced by
# them after setting SCRIPT_NAME (the prefix of their messages); not run on
# its own.

# log MSG: MSG on stderr, after the script's name.
log() { printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}
# Bad usage: exit 2, apart from the failures above.
usage() {
	log "error: $*"
	exit 2
}
# print_help: the script's header comment, for --help.
print_help() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
