/* A rank's team: the calling thread and n - 1 helper threads that split one kernel call of a blocking
 * collective (a reduction over the peers' slots, a copy in or out) into slices, one per thread, as
 * DeepSpeed's and vLLM's CPU allreduces do with OpenMP. A single thread's memory bandwidth caps a large
 * reduction far below a socket's; the rank's idle cores lift it.
 *
 * The caller posts a job by bumping `gen`, runs slice 0 itself and waits until every helper has
 * counted itself `done`. Helpers spin for the next job (a collective's steps follow each other within
 * microseconds) as long as the group's waits spin (`spin`), then sleep on `gen` (a futex). Every
 * helper acknowledges every job, so none can read a job that was already replaced. A job is pure
 * memory work with no wait on a peer: a team never blocks a collective's timeout or abort. Plain C;
 * the caller holds no GIL. */
#ifndef ENGINE_TEAM_H
#define ENGINE_TEAM_H

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include "shm.h"
#include "kernels.h"

#define ENG_TEAM_SLICE_MIN 16384 /* bytes: a thread's least slice by default; smaller jobs use fewer threads */
#define ENG_TEAM_MAX_THREADS 1024 /* a team's most threads, the caller's included (more is a typo, not a CPU) */

enum { ENG_JOB_REDUCE = 1, ENG_JOB_COPY = 2 };

/* Where a user (Numba) kernel that raised counts it (user_ops.pxi): the counter of the call this thread runs
 * for, NULL outside one. A helper takes its caller's with each job, so a raise in a helper's slice counts
 * for the call whose slice it was, and never for a call another thread runs meanwhile. */
static __thread uint64_t *eng_raise_counter;

/* Makes c this thread's raise counter; returns the one it replaces, which the call puts back at its end
 * (a reduce_into inside a user's callback, say, leaves the outer call's count whole). */
static inline uint64_t *eng_raise_counter_swap(uint64_t *c) {
  uint64_t *was = eng_raise_counter;
  eng_raise_counter = c;
  return was;
}

typedef struct {
  int kind;
  uint64_t *raises;        /* the caller's raise counter, for the helpers' slices */
  int parts;               /* threads that take a slice (the rest only acknowledge) */
  double spin;             /* seconds a helper spins for the next job after this one (the team's spin) */
  /* ENG_JOB_REDUCE: dst1 (and dst2) = the reduction of srcs[0..nsrc), n elements (eng_reduce_many) */
  eng_reduce_fn fn;
  char *dst1, *dst2;
  const void *const *srcs;
  int nsrc;
  size_t n, itemsize;
  int dtype;
  double divisor;
  /* ENG_JOB_COPY: n bytes from src to dst */
  char *dst;
  const char *src;
} eng_job;

struct eng_team;
typedef struct {
  struct eng_team *team;
  int index;
  const void **srcs;       /* this thread's slice of a reduction's source pointers */
} eng_helper;

typedef struct eng_team {
  int n;                   /* threads running, the caller's included; 1: no helpers */
  int slots;               /* helpers allocated */
  int maxsrc;              /* the most sources a reduction may have (the group size) */
  size_t slice_min;        /* bytes: a thread's least slice (tests make it a cache line to reach the helpers) */
  double spin;             /* seconds a helper (and the caller's join) spins before sleeping (yielding); the
                              caller's to set: a helper reads it from each job it acknowledges */
  pid_t pid;               /* the process that started the helpers (a forked child has none) */
  uint64_t shared;         /* jobs split over the helpers (the caller's to read: whether they had work) */
  uint32_t gen, done, stop;
  eng_job job;
  pthread_t *tids;
  eng_helper *helpers;     /* n of them; [0] is the caller's */
} eng_team;

/* Slice i of `parts` over n items, in whole cache lines of `itemsize`-byte items. */
static inline void eng_slice(size_t n, size_t itemsize, int parts, int i, size_t *lo, size_t *len) {
  const size_t unit = itemsize >= 64 ? 1 : 64 / itemsize;
  const size_t units = (n + unit - 1) / unit;
  const size_t per = (units + (size_t)parts - 1) / (size_t)parts * unit;
  size_t a = per * (size_t)i, b = a + per;
  if (a > n) a = n;
  if (b > n) b = n;
  *lo = a;
  *len = b - a;
}

static void eng_job_slice(const eng_job *j, eng_helper *h) {
  size_t lo, len;
  if (h->index >= j->parts) return;
  if (j->kind == ENG_JOB_COPY) {
    eng_slice(j->n, 1, j->parts, h->index, &lo, &len);
    if (len) memcpy(j->dst + lo, j->src + lo, len);
    return;
  }
  eng_slice(j->n, j->itemsize, j->parts, h->index, &lo, &len);
  if (!len) return;
  const size_t b = lo * j->itemsize;
  for (int k = 0; k < j->nsrc; k++) h->srcs[k] = (const char *)j->srcs[k] + b;
  eng_reduce_many(j->fn, j->dst1 + b, j->dst2 ? j->dst2 + b : NULL, h->srcs, j->nsrc, len, j->itemsize, j->dtype,
                  j->divisor);
}

static void *eng_team_main(void *arg) {
  eng_helper *h = (eng_helper *)arg;
  eng_team *t = h->team;
  uint32_t seen = 0;
  double spin = t->spin; /* set before the thread started */
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to the process's own threads */
  for (;;) {
    const double spin_until = eng_now() + spin;
    uint32_t g;
    while ((g = eng_load32(&t->gen)) == seen) {
      if (eng_now() < spin_until) eng_cpu_relax();
      else eng_futex_wait(&t->gen, seen, 0.1);
    }
    seen = g;
    if (eng_load32(&t->stop)) return NULL;
    eng_raise_counter = t->job.raises;
    eng_job_slice(&t->job, h);
    eng_raise_counter = NULL;
    spin = t->job.spin; /* read before done: the caller may then replace the job */
    eng_add32(&t->done);
  }
}

/* Stops and joins the helpers, frees the team (safe on one partly started). */
static void eng_team_stop(eng_team *t) {
  if (t->n > 1 && t->pid == getpid()) {
    eng_store32(&t->stop, 1);
    eng_add32(&t->gen);
    eng_futex_wake(&t->gen);
    for (int i = 1; i < t->n; i++) pthread_join(t->tids[i], NULL);
  }
  for (int i = 0; i < t->slots; i++) free(t->helpers[i].srcs);
  free(t->helpers);
  free(t->tids);
  memset(t, 0, sizeof(*t));
}

/* Starts n - 1 helpers for reductions of up to maxsrc sources, spinning `spin` seconds between jobs.
 * Returns 0, or an errno, having stopped and freed whatever it started (no team: the caller runs alone). */
static int eng_team_start(eng_team *t, int n, int maxsrc, double spin) {
  int rc = 0;
  memset(t, 0, sizeof(*t));
  if (n < 1 || n > ENG_TEAM_MAX_THREADS) return EINVAL;
  t->n = 1;
  t->maxsrc = maxsrc;
  t->slice_min = ENG_TEAM_SLICE_MIN;
  t->spin = spin;
  t->pid = getpid();
  t->helpers = (eng_helper *)calloc((size_t)n, sizeof(eng_helper));
  t->tids = (pthread_t *)calloc((size_t)n, sizeof(pthread_t));
  if (t->helpers == NULL || t->tids == NULL) rc = ENOMEM;
  else t->slots = n;
  for (int i = 0; i < t->slots && !rc; i++) {
    t->helpers[i].team = t;
    t->helpers[i].index = i;
    t->helpers[i].srcs = (const void **)calloc((size_t)maxsrc, sizeof(void *));
    if (t->helpers[i].srcs == NULL) rc = ENOMEM;
  }
  for (int i = 1; i < n && !rc; i++) {
    rc = pthread_create(&t->tids[i], NULL, eng_team_main, &t->helpers[i]);
    if (!rc) t->n = i + 1;
  }
  if (rc) eng_team_stop(t);
  return rc;
}

/* The whole job in the calling thread. */
static inline void eng_job_whole(const eng_job *j) {
  if (j->kind == ENG_JOB_COPY) memcpy(j->dst, j->src, j->n);
  else eng_reduce_many(j->fn, j->dst1, j->dst2, j->srcs, j->nsrc, j->n, j->itemsize, j->dtype, j->divisor);
}

/* Runs job over the team (alone where it is too small to split, or in a forked child). */
static void eng_team_run(eng_team *t, eng_job *job) {
  const size_t bytes = job->kind == ENG_JOB_COPY ? job->n : job->n * job->itemsize;
  const size_t parts = bytes / (t->slice_min ? t->slice_min : 1);
  if (t->n < 2 || parts < 2 || t->pid != getpid()) {
    eng_job_whole(job);
    return;
  }
  job->parts = parts < (size_t)t->n ? (int)parts : t->n;
  t->shared++;
  job->spin = t->spin;
  job->raises = eng_raise_counter;
  t->job = *job;
  eng_store32(&t->done, 0);
  eng_add32(&t->gen); /* seq_cst: the job above is visible to a helper that sees the new gen */
  eng_futex_wake(&t->gen);
  eng_job_slice(&t->job, &t->helpers[0]);
  const double spin_until = eng_now() + t->spin;
  while (eng_load32(&t->done) < (uint32_t)(t->n - 1)) {
    if (eng_now() < spin_until) eng_cpu_relax();
    else eng_yield(); /* a helper without a core of its own needs this one */
  }
}

/* The two jobs, as calls; t NULL: in the caller alone. */
static inline void eng_team_reduce(eng_team *t, eng_reduce_fn fn, void *dst1, void *dst2, const void *const *srcs,
                                   int nsrc, size_t n, size_t itemsize, int dtype, double divisor) {
  eng_job j = {.kind = ENG_JOB_REDUCE, .fn = fn, .dst1 = (char *)dst1, .dst2 = (char *)dst2, .srcs = srcs,
               .nsrc = nsrc, .n = n, .itemsize = itemsize, .dtype = dtype, .divisor = divisor};
  if (t == NULL) eng_job_whole(&j);
  else eng_team_run(t, &j);
}

static inline void eng_team_copy(eng_team *t, void *dst, const void *src, size_t bytes) {
  eng_job j = {.kind = ENG_JOB_COPY, .dst = (char *)dst, .src = (const char *)src, .n = bytes};
  if (t == NULL) eng_job_whole(&j);
  else eng_team_run(t, &j);
}

#endif
