# What the fast-swap scripts (bench/gpu/fastswap.sh, fastswap-sanitizer.sh) share:
# waiting for a file, and asking a program of fastswap_status.py's protocol
# for the digest of its memory. Sourced, not run.

wait_file() { # FILE SECS: until FILE is not empty; 1 after SECS
    local end=$((SECONDS + $2))
    while [ ! -s "$1" ]; do
        [ $SECONDS -ge $end ] && return 1
        sleep 0.2
    done
}

digest() { # STATUS [SECS]: the program's digest now ("timeout" after SECS, 120)
    rm -f "$1.result"; touch "$1.check"
    wait_file "$1.result" "${2:-120}" || { echo timeout; return; }
    cat "$1.result"
}
