/* The floor of a 2-rank two-shot allreduce on this machine: the engine's step protocol with nothing else.
 * Two threads of one process, each on its own core, stand for the two ranks: each has a private input
 * (reduced in place, as the benchmarks' in-place rows) and a half of one shared "segment"; per step,
 * exactly as pyx/shm_collectives.pxi moves the data:
 *   1. copy the block the peer reduces into its own half;                      (barrier)
 *   2. reduce its own block from its input and the peer's half, into its input and its own half;
 *                                                                              (barrier)
 *   3. copy the peer's reduced block from the peer's half into its input.      (barrier)
 * No processes, no syscalls, no Python, no checks: the time is what this data movement costs on these
 * cores and caches. bench/floor.py builds and runs it (python -m bench floor).
 *
 * usage: two_shot_floor BYTES STEP_BYTES ITERS ROUNDS -> "BYTES MEDIAN_US OK|WRONG" */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t count, step;           /* elements */
static int iters, rounds;
static float *input[2], *half[2];
static double seconds[2][64];
static atomic_int arrived, generation;

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ volatile("yield")
#else
#define cpu_relax() ((void)0)
#endif

static void barrier(void) {
    int g = atomic_load(&generation);
    if (atomic_fetch_add(&arrived, 1) == 1) {
        atomic_store(&arrived, 0);
        atomic_fetch_add(&generation, 1);
    } else {
        while (atomic_load(&generation) == g)
            cpu_relax();
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* out[i] = half_out[i] = a[i] + b[i], out possibly a or b (in place): whole vectors are loaded before
 * they are stored, so a compiler's overlap check can't send an in-place call to a scalar loop */
typedef float vec8 __attribute__((vector_size(32)));

static void reduce2(float *out, float *half_out, const float *a, const float *b, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        vec8 x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        x += y;
        memcpy(out + i, &x, sizeof x);
        memcpy(half_out + i, &x, sizeof x);
    }
    for (; i < n; i++)
        out[i] = half_out[i] = a[i] + b[i];
}

static void allreduce(int r) {
    for (size_t off = 0; off < count; off += step) {
        size_t n = count - off < step ? count - off : step;
        size_t lo = n / 2, mine = r ? lo : 0, theirs = r ? 0 : lo, mn = r ? n - lo : lo, tn = r ? lo : n - lo;
        float *in = input[r] + off, *own = half[r], *peer = half[1 - r];
        memcpy(own + theirs, in + theirs, tn * sizeof(float));
        barrier();
        if (r)                                          /* rank order 0, 1: the engine's bits */
            reduce2(in + mine, own + mine, peer + mine, in + mine, mn);
        else
            reduce2(in + mine, own + mine, in + mine, peer + mine, mn);
        barrier();
        memcpy(in + theirs, peer + theirs, tn * sizeof(float));
        barrier();
    }
}

static void *once(void *arg) {
    allreduce((int)(long)arg);
    return NULL;
}

static void *rank(void *arg) {
    int r = (int)(long)arg;
    cpu_set_t cores;
    CPU_ZERO(&cores);
    CPU_SET(r, &cores);
    sched_setaffinity(0, sizeof cores, &cores);   /* fails harmlessly on a 1-core machine */
    for (int k = 0; k < rounds; k++) {
        for (int i = 0; i < iters / 10 + 1; i++)  /* warm-up */
            allreduce(r);
        barrier();
        double t0 = now();
        for (int i = 0; i < iters; i++)
            allreduce(r);
        seconds[r][k] = (now() - t0) / iters;
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s BYTES STEP_BYTES ITERS ROUNDS\n", argv[0]);
        return 2;
    }
    count = strtoull(argv[1], NULL, 10) / sizeof(float);
    step = strtoull(argv[2], NULL, 10) / sizeof(float);
    iters = atoi(argv[3]);
    rounds = atoi(argv[4]);
    if (count < 2 || step < 2 || iters < 1 || rounds < 1 || rounds > 64) {
        fprintf(stderr, "BYTES and STEP_BYTES at least 8, ITERS at least 1, ROUNDS 1 to 64\n");
        return 2;
    }
    for (int r = 0; r < 2; r++) {
        input[r] = aligned_alloc(64, (count * sizeof(float) + 63) / 64 * 64);
        half[r] = aligned_alloc(64, (step * sizeof(float) + 63) / 64 * 64);
        if (!input[r] || !half[r])
            return 3;
        for (size_t i = 0; i < count; i++)
            input[r][i] = (float)(i % 4 + r + 1);
        memset(half[r], 0, step * sizeof(float));
    }
    /* one allreduce checked, then the timed ones (in place: the values grow, at the same speed) */
    pthread_t t[2];
    for (long r = 0; r < 2; r++)
        pthread_create(&t[r], NULL, once, (void *)r);
    for (int r = 0; r < 2; r++)
        pthread_join(t[r], NULL);
    int ok = 1;
    for (size_t i = 0; i < count; i++)
        ok &= input[0][i] == (float)(2 * (i % 4) + 3) && input[1][i] == input[0][i];
    for (long r = 0; r < 2; r++)
        pthread_create(&t[r], NULL, rank, (void *)r);
    for (int r = 0; r < 2; r++)
        pthread_join(t[r], NULL);
    double each[64];
    for (int k = 0; k < rounds; k++)   /* a round takes as long as its slower rank */
        each[k] = seconds[0][k] > seconds[1][k] ? seconds[0][k] : seconds[1][k];
    qsort(each, rounds, sizeof(double), by_value);
    printf("%zu %.2f %s\n", count * sizeof(float), each[rounds / 2] * 1e6, ok ? "OK" : "WRONG");
    return ok ? 0 : 1;
}
