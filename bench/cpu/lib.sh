# shellcheck shell=bash
# Helpers of the CPU bench scripts (bench/cpu/*.sh), sourced by them;
# not run on its own.

# record_self NAME ARGS...: runs the calling script again with ARGS, its
# output shown and, when it exits 0, recorded as a new numbered, dated file
# of bench/results (bench/record.sh), then exits with its status.
# Called from the repository root before the script does anything;
# BENCH_RECORD=0 runs the script without recording it.
record_self() {
    if [ "${BENCH_RECORD:-1}" = 0 ] || [ -n "${BENCH_RECORDING:-}" ]; then return 0; fi
    local name=$1 self tmp rc=0 cmd
    shift
    self=$PWD/bench/cpu/$(basename "$0")
    tmp=$(mktemp)
    BENCH_RECORDING=1 "$self" "$@" | tee "$tmp" || rc=$?
    if [ "$rc" = 0 ]; then
        # The settings the scripts read, then the command line.
        cmd=$(env | grep -E '^(REPS|NOFILE|SILENT|HALF|CONCURRENT|SECONDS_EACH|SIZE_[A-Z]+|[A-Z]+_(MIB|GIB|GBPS)|GBPS|SIZES|PROFILE|SWAPS|MIB)=' | sort | tr '\n' ' ' || true)
        BENCH_CMD="${cmd}bench/cpu/$(basename "$0")${*:+ $*}" bench/record.sh "$name" "$tmp" |
            sed 's/^/recorded in /' >&2 || rc=$?
    fi
    rm -f "$tmp"
    exit "$rc"
}

# now: the time, in seconds. secs A B: B - A, to the millisecond.
now() { printf '%s\n' "$EPOCHREALTIME"; }
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$1" "$2"; }
# gone PID: waits until PID has exited.
gone() { while [ -e "/proc/$1" ]; do sleep 0.05; done; }

# bench_setup TAG: builds gpusnap (release) and sets gs (its path), work (a
# fresh directory under /var/tmp, GPUSNAP_STATE_DIR in it), tsv (an empty
# file there for the runs) and holder (the pid of the process under test,
# empty for none); on exit the holder is killed and work removed.
bench_setup() {
    cargo build --release --quiet -p gpusnap
    # shellcheck disable=SC2034 # read by the sourcing script
    gs=$PWD/target/release/gpusnap
    work=$(mktemp -d "/var/tmp/gpusnap-$1.XXXXXX")
    export GPUSNAP_STATE_DIR=$work/state
    holder=
    trap bench_cleanup EXIT
    tsv=$work/runs.tsv
    : >"$tsv"
}

bench_cleanup() {
    if [ -n "$holder" ]; then kill -9 "$holder" 2>/dev/null || true; fi
    rm -rf -- "$work"
}

# abba A B: REPS runs of `one WAY REP` for each way, A then B in odd runs and
# B then A in even ones (neither way always goes first).
abba() {
    local rep way order
    for rep in $(seq 1 "$REPS"); do
        if ((rep % 2)); then order="$1 $2"; else order="$2 $1"; fi
        for way in $order; do one "$way" "$rep"; done
    done
}

# end_holder: kills the process under test and waits until it is gone.
end_holder() {
    kill -9 "$holder"
    gone "$holder"
    holder=
}

# agent_bench_setup TAG: for the agent benches against the fakes. Builds
# gpusnap for PROFILE (debug unless set; no build with SKIP_BUILD=1), sets
# GPUSNAP (unless set: target/$PROFILE/gpusnap) and work (a fresh directory
# /tmp/gpusnap-TAG.*, removed on exit unless KEEP=1) with the fakes in
# $work/lib. The scripts' Python imports bench/cpu/bench_agent.py.
agent_bench_setup() {
    PROFILE=${PROFILE:-debug}
    GPUSNAP=${GPUSNAP:-target/$PROFILE/gpusnap}
    if [ "${SKIP_BUILD:-0}" != 1 ]; then
        case $PROFILE in
            release) cargo build --release --quiet -p gpusnap ;;
            *) cargo build --quiet -p gpusnap ;;
        esac
    fi
    work=$(mktemp -d "/tmp/gpusnap-$1.XXXXXX")
    trap '[ "${KEEP:-0}" = 1 ] || rm -rf -- "$work"' EXIT
    PROFILE=$PROFILE scripts/fakes.sh "$work/lib" >/dev/null
}
