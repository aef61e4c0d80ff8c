/*
 * memload: memory traffic beside a driver restore, and a probe of what the
 * CPUs share (bench/gpu/contend.sh: the warm wake of a model's weights).
 *
 * The driver's restore copies host memory to the GPU at 9-10 GB/s alone and
 * 4-7 GB/s while gpusnap's page server fills the process beside it. This
 * program makes that kind of traffic from another process, with nothing of
 * userfaultfd, so a run can tell memory contention from anything else.
 *
 *   memload load THREADS MODE [GBPS [CPULIST]]
 *       THREADS threads move memory until SIGTERM/SIGINT, then print one JSON
 *       line: {"mode","threads","gb","secs","gbps"}. MODE:
 *         copy  memcpy 4 MiB blocks from a 512 MiB source to a 512 MiB target
 *         fill  what the page server's fill does per byte: memcpy a 4 MiB
 *               block of the source into a 4 MiB buffer (its pread), then the
 *               buffer into the target (its UFFDIO_COPY)
 *         read  sum the source (the verify's hashing, without the hash)
 *         spin  arithmetic in registers, no memory traffic: busy cores
 *               alone (a package's power and turbo budget, which the
 *               fill's and the verify's threads also spend); GBPS then
 *               paces nothing, and gb counts 4 MiB-sized passes
 *       GBPS (0 = unpaced): the threads together move at most that many GB/s
 *       (each a share, in 4 MiB steps). CPULIST ("4-11", "0,2,5"): each
 *       thread pinned to one CPU of the list, in turn.
 *   memload probe [MEASURE_CPU]
 *       one thread on MEASURE_CPU (default 0) copies alone for 0.3 s, then
 *       with one copying thread on each other CPU in turn (a sibling on the
 *       same physical core slows it most), then with 1, 2, 4, 8 and all other
 *       CPUs copying; a JSON line each: {"probe","cpus","gbps"}.
 *
 * Written by hand: a few lines of C that run anywhere the GPU machine has a
 * compiler; no crate or tool there does this.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define BLOCK (4UL << 20)
#define SPAN (512UL << 20)

static atomic_int stop_flag;
static atomic_ullong moved;
static atomic_int ready; /* threads whose buffers are touched */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *big(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    memset(p, 0x5a, n); /* touched: no page faults while measuring */
    return p;
}

static void pin(int cpu)
{
    cpu_set_t set;
    if (cpu < 0)
        return;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof(set), &set);
}

enum mode { COPY, FILL, READ, SPIN };

struct worker {
    pthread_t t;
    enum mode mode;
    int cpu;
    double rate; /* bytes per second for this thread; 0 = unpaced */
    uint64_t sink;
    atomic_ullong done; /* bytes moved by this thread */
    atomic_int *until; /* stops when *until != 0 */
};

static void *run(void *arg)
{
    struct worker *w = arg;
    char *src, *dst, *buf = NULL;
    size_t off = 0;
    uint64_t done = 0, sum = 0;
    double t0;

    pin(w->cpu);
    src = w->mode == SPIN ? NULL : big(SPAN);
    dst = w->mode == READ || w->mode == SPIN ? NULL : big(SPAN);
    if (w->mode == FILL)
        buf = big(BLOCK);
    atomic_fetch_add(&ready, 1);
    t0 = now();
    while (!atomic_load_explicit(w->until, memory_order_relaxed)) {
        switch (w->mode) {
        case COPY:
            memcpy(dst + off, src + off, BLOCK);
            break;
        case FILL:
            memcpy(buf, src + off, BLOCK);
            memcpy(dst + off, buf, BLOCK);
            break;
        case SPIN: {
            /* About as long as a 4 MiB copy, in registers only. */
            uint64_t x = sum | 1;
            for (int i = 0; i < 1 << 20; i++)
                x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            sum ^= x;
            break;
        }
        case READ: {
            const uint64_t *p = (const uint64_t *)(src + off);
            for (size_t i = 0; i < BLOCK / 8; i += 8)
                sum += p[i] ^ p[i + 1] ^ p[i + 2] ^ p[i + 3] ^ p[i + 4] ^ p[i + 5] ^ p[i + 6] ^ p[i + 7];
            break;
        }
        }
        off = (off + BLOCK) % SPAN;
        done += BLOCK;
        atomic_fetch_add_explicit(&w->done, BLOCK, memory_order_relaxed);
        atomic_fetch_add_explicit(&moved, BLOCK, memory_order_relaxed);
        if (w->rate > 0) {
            double due = t0 + done / w->rate, t = now();
            if (due > t) {
                struct timespec ts = {(time_t)(due - t), (long)((due - t - (time_t)(due - t)) * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
    }
    w->sink = sum;
    if (src)
        munmap(src, SPAN);
    if (dst)
        munmap(dst, SPAN);
    if (buf)
        munmap(buf, BLOCK);
    return NULL;
}

static void on_signal(int sig)
{
    (void)sig;
    atomic_store(&stop_flag, 1);
}

static int parse_cpus(const char *s, int *out, int max)
{
    int n = 0;
    while (s && *s && n < max) {
        char *end;
        long a = strtol(s, &end, 10), b = a;
        if (end == s)
            break;
        if (*end == '-')
            b = strtol(end + 1, &end, 10);
        for (long c = a; c <= b && n < max; c++)
            out[n++] = (int)c;
        s = *end == ',' ? end + 1 : end;
        if (*end != ',')
            break;
    }
    return n;
}

static int load(int argc, char **argv)
{
    int threads = argc > 2 ? atoi(argv[2]) : 0;
    const char *m = argc > 3 ? argv[3] : "copy";
    double gbps = argc > 4 ? atof(argv[4]) : 0;
    int cpus[1024], ncpus = argc > 5 ? parse_cpus(argv[5], cpus, 1024) : 0;
    enum mode mode = !strcmp(m, "fill") ? FILL : !strcmp(m, "read") ? READ : !strcmp(m, "spin") ? SPIN : COPY;
    struct worker *w;
    double t0, t1;
    struct sigaction sa = {0};

    if (threads < 1 || threads > 512 || (strcmp(m, "copy") && strcmp(m, "fill") && strcmp(m, "read") && strcmp(m, "spin"))) {
        fprintf(stderr, "usage: memload load THREADS copy|fill|read|spin [GBPS [CPULIST]]\n");
        return 2;
    }
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    w = calloc(threads, sizeof(*w));
    for (int i = 0; i < threads; i++) {
        w[i].mode = mode;
        w[i].cpu = ncpus ? cpus[i % ncpus] : -1;
        w[i].rate = gbps > 0 ? gbps * 1e9 / threads : 0;
        w[i].until = &stop_flag;
        pthread_create(&w[i].t, NULL, run, &w[i]);
    }
    while (atomic_load(&ready) < threads && !atomic_load(&stop_flag))
        usleep(1000);
    t0 = now(); /* from when every thread moves: the buffers are touched */
    atomic_store(&moved, 0);
    while (!atomic_load(&stop_flag))
        pause();
    for (int i = 0; i < threads; i++)
        pthread_join(w[i].t, NULL);
    t1 = now();
    printf("{\"mode\":\"%s\",\"threads\":%d,\"paced_gbps\":%.2f,\"gb\":%.3f,\"secs\":%.3f,\"gbps\":%.3f}\n", m,
           threads, gbps, atomic_load(&moved) / 1e9, t1 - t0, atomic_load(&moved) / 1e9 / (t1 - t0));
    return 0;
}

/* One measuring thread's copy rate (GB/s) on MCPU while LOADERS copying
 * threads run, one on each of CPUS. */
static double measure(int mcpu, const int *cpus, int loaders)
{
    atomic_int until = 0, mstop = 0;
    struct worker *w = calloc(loaders ? loaders : 1, sizeof(*w));
    struct worker me = {.mode = COPY, .cpu = mcpu, .until = &mstop};
    uint64_t d0;
    double t0, secs;

    for (int i = 0; i < loaders; i++) {
        w[i].mode = COPY;
        w[i].cpu = cpus[i];
        w[i].until = &until;
        pthread_create(&w[i].t, NULL, run, &w[i]);
    }
    atomic_store(&ready, 0);
    pthread_create(&me.t, NULL, run, &me);
    while (atomic_load(&ready) < loaders + 1)
        usleep(1000); /* everyone's buffers touched */
    usleep(50000);
    d0 = atomic_load(&me.done);
    t0 = now();
    usleep(300000);
    secs = now() - t0;
    d0 = atomic_load(&me.done) - d0;
    atomic_store(&mstop, 1);
    atomic_store(&until, 1);
    pthread_join(me.t, NULL);
    for (int i = 0; i < loaders; i++)
        pthread_join(w[i].t, NULL);
    free(w);
    return d0 / 1e9 / secs;
}

static int probe(int argc, char **argv)
{
    int mcpu = argc > 2 ? atoi(argv[2]) : 0;
    int n = (int)sysconf(_SC_NPROCESSORS_ONLN), others[1024], k = 0;
    static const int counts[] = {1, 2, 4, 8};

    for (int c = 0; c < n && k < 1024; c++)
        if (c != mcpu)
            others[k++] = c;
    printf("{\"probe\":\"alone\",\"measure_cpu\":%d,\"loaders\":0,\"gbps\":%.3f}\n", mcpu, measure(mcpu, NULL, 0));
    fflush(stdout);
    for (int i = 0; i < k; i++) {
        printf("{\"probe\":\"beside\",\"measure_cpu\":%d,\"loader_cpu\":%d,\"loaders\":1,\"gbps\":%.3f}\n", mcpu,
               others[i], measure(mcpu, &others[i], 1));
        fflush(stdout);
    }
    for (size_t j = 0; j < sizeof(counts) / sizeof(counts[0]); j++) {
        if (counts[j] > k)
            break;
        printf("{\"probe\":\"many\",\"measure_cpu\":%d,\"loaders\":%d,\"gbps\":%.3f}\n", mcpu, counts[j],
               measure(mcpu, others, counts[j]));
        fflush(stdout);
    }
    printf("{\"probe\":\"many\",\"measure_cpu\":%d,\"loaders\":%d,\"gbps\":%.3f}\n", mcpu, k, measure(mcpu, others, k));
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1 && !strcmp(argv[1], "load"))
        return load(argc, argv);
    if (argc > 1 && !strcmp(argv[1], "probe"))
        return probe(argc, argv);
    fprintf(stderr, "usage: memload load THREADS copy|fill|read|spin [GBPS [CPULIST]] | memload probe [CPU]\n");
    return 2;
}
