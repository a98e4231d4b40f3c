# A deadline at which the process writes why and exits, from a thread of its own: for the waits that
# hold the GIL and that nothing interrupts (MPI_Init inside mpi4py's import waits for every rank of
# the job to start MPI), where a Python thread or signal handler would never run.

cdef extern from *:
    """
    #include <errno.h>
    #include <pthread.h>
    #include <stdlib.h>
    #include <string.h>
    #include <time.h>
    #include <unistd.h>

    typedef struct {
      pthread_mutex_t lock;
      pthread_cond_t cond;
      int cancelled;
      struct timespec at;   /* CLOCK_REALTIME, as pthread_cond_timedwait reads it */
      char *why;
    } eng_deadline;

    static void *eng_deadline_run(void *arg) {
      eng_deadline *d = (eng_deadline *)arg;
      int fire = 0;
      pthread_mutex_lock(&d->lock);
      while (!d->cancelled)
        if (pthread_cond_timedwait(&d->cond, &d->lock, &d->at) == ETIMEDOUT) { fire = !d->cancelled; break; }
      pthread_mutex_unlock(&d->lock);
      if (fire) {
        size_t n = strlen(d->why), off = 0;
        while (off < n) { ssize_t w = write(2, d->why + off, n - off); if (w <= 0) break; off += (size_t)w; }
        _exit(1);
      }
      return NULL;
    }

    /* Starts the deadline's thread; NULL where it can't (then there is no deadline). */
    static eng_deadline *eng_deadline_start(double seconds, const char *why, pthread_t *thread) {
      eng_deadline *d = (eng_deadline *)calloc(1, sizeof *d);
      if (d == NULL || (d->why = strdup(why)) == NULL) { free(d); return NULL; }
      pthread_mutex_init(&d->lock, NULL);
      pthread_cond_init(&d->cond, NULL);
      clock_gettime(CLOCK_REALTIME, &d->at);
      if (seconds > 1e9) seconds = 1e9;
      d->at.tv_sec += (time_t)seconds;
      d->at.tv_nsec += (long)((seconds - (double)(time_t)seconds) * 1e9);
      if (d->at.tv_nsec >= 1000000000L) { d->at.tv_sec++; d->at.tv_nsec -= 1000000000L; }
      if (pthread_create(thread, NULL, eng_deadline_run, d) != 0) { free(d->why); free(d); return NULL; }
      return d;
    }

    static void eng_deadline_cancel(eng_deadline *d, pthread_t thread) {
      pthread_mutex_lock(&d->lock);
      d->cancelled = 1;
      pthread_cond_signal(&d->cond);
      pthread_mutex_unlock(&d->lock);
      pthread_join(thread, NULL);
      free(d->why);
      free(d);
    }
    """
    ctypedef struct eng_deadline:
        pass
    ctypedef unsigned long pthread_t
    eng_deadline *eng_deadline_start(double seconds, const char *why, pthread_t *thread) nogil
    void eng_deadline_cancel(eng_deadline *d, pthread_t thread) nogil


cdef class ExitDeadline:
    """At `seconds` from now, unless cancel() came first: writes `why` to stderr and ends the process
    (exit code 1, no clean-up: nothing the engine made exists yet where it is used), whatever holds
    the GIL. Under an MPI launcher the rank's exit ends the job."""
    cdef eng_deadline *d
    cdef pthread_t thread

    def __cinit__(self, double seconds, str why):
        self.d = eng_deadline_start(seconds, why.encode(), &self.thread)

    def cancel(self):
        if self.d != NULL:
            with nogil:
                eng_deadline_cancel(self.d, self.thread)
            self.d = NULL

    def __dealloc__(self):
        if self.d != NULL:
            eng_deadline_cancel(self.d, self.thread)
