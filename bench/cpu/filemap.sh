#!/usr/bin/env bash
# The mapped wake's premise on any Linux machine (docs/design/wake.md, "The mapped
# wake"): a reader that copies SIZE MiB out in 2 MiB pieces (the driver's
# restore reads its host copy so), then unmaps it, from
#   anon     anonymous memory filled first by pread (what a lazy wake's fill
#            makes: every byte copied in)
#   file     a private mapping of a file in the page cache, at a 2 MiB-aligned
#            address (its large folios mapped whole)
#   filepop  the same, MADV_POPULATE_READ before the read
#   filenoal the same 4 KiB off alignment (mapped 64 KiB per fault)
# The file is written in 32 MiB pieces and flushed (a warm map file). Prints
# a table; two rounds, the second shown.
# Usage: bench/cpu/filemap.sh [SIZE_MIB] (default 4096)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self filemap-cpu "$@"
SIZE=${1:-4096}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
cat >"$DIR/fm.c" <<'C'
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static char stage[2 << 20];
int main(int argc, char **argv) {
    size_t n = strtoull(argv[1], 0, 10) << 20, huge = 2 << 20;
    const char *mode = argv[2];
    int fd = open(argv[3], O_RDONLY);
    if (fd < 0) { perror("open"); return 1; }
    double t0 = now();
    char *p;
    if (!strcmp(mode, "anon")) {
        p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        for (size_t o = 0; o < n;) { ssize_t r = pread(fd, p + o, n - o > (64 << 20) ? (64 << 20) : n - o, o); if (r <= 0) return 1; o += r; }
    } else {
        char *r = mmap(0, n + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        p = (char *)(((unsigned long)r + huge - 1) & ~(huge - 1));
        if (!strcmp(mode, "filenoal")) p += 4096;
        if (mmap(p, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0) != p) { perror("mmap"); return 1; }
        if (!strcmp(mode, "filepop") && madvise(p, n, MADV_POPULATE_READ)) perror("madvise");
    }
    double t1 = now();
    unsigned long s = 0;
    for (size_t o = 0; o < n; o += sizeof stage) { memcpy(stage, p + o, sizeof stage); s += stage[7]; }
    double t2 = now();
    munmap(p, n);
    double t3 = now();
    printf("| %s | %.3f | %.3f (%.1f) | %.3f |\n", mode, t1 - t0, t2 - t1, n / 1e9 / (t2 - t1), t3 - t2);
    return s == 42;
}
C
cc -O2 -o "$DIR/fm" "$DIR/fm.c"
python3 - "$DIR/data" "$SIZE" <<'PY'
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
b = os.urandom(32 << 20)
for _ in range(int(sys.argv[2]) // 32):
    os.write(fd, b)
os.fdatasync(fd)
PY
echo "| source of $SIZE MiB | setup s | read s (GB/s) | unmap s |"
echo "|---|---|---|---|"
for round in 1 2; do
    for m in anon file filepop filenoal; do
        if [ "$round" = 2 ]; then "$DIR/fm" "$SIZE" "$m" "$DIR/data" || true; else "$DIR/fm" "$SIZE" "$m" "$DIR/data" >/dev/null || true; fi
    done
done
