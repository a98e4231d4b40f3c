/* What the shared-memory transport needs from the OS and the CPU: acquire/release atomics, a pause,
 * clocks, the segment (memfd: it has no name, so nothing can be left behind), and peer liveness.
 * Plain C, every function GIL-free. */
#ifndef ENGINE_SHM_H
#define ENGINE_SHM_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* ---- atomics: the only synchronisation between ranks (no locks, no system calls) ---- */

static inline uint64_t eng_load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint64_t eng_load_relaxed(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void eng_store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static inline uint32_t eng_load32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void eng_store32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static inline void eng_add32(uint32_t *p) { __atomic_fetch_add(p, 1, __ATOMIC_SEQ_CST); }
static inline void eng_sub32(uint32_t *p) { __atomic_fetch_sub(p, 1, __ATOMIC_SEQ_CST); }
/* *p from `expected` to `desired`, if it still holds `expected`; whether it did. */
static inline int eng_cas64(uint64_t *p, uint64_t expected, uint64_t desired) {
  return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
/* A full fence: a store before it is visible before any load after it (Dekker: see ring/doze). */
static inline void eng_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline void eng_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline double eng_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A relative timeout of `seconds` (a variable), for nanosleep, a futex wait or ppoll: a compound literal, alive
 * to the end of the caller's block. */
#define ENG_TIMEOUT(seconds) (&(struct timespec){(time_t)(seconds), (long)(((seconds) - (double)(time_t)(seconds)) * 1e9)})

static inline void eng_sleep(double seconds) { nanosleep(ENG_TIMEOUT(seconds), NULL); }

static inline void eng_yield(void) { sched_yield(); }

/* ---- sleeping on a word of the segment (futexes work across processes on shared mappings) ---- */

#include <linux/futex.h>
#include <limits.h>

/* Sleeps while *addr == val, at most `seconds`; returns at once if *addr changed. */
static inline void eng_futex_wait(uint32_t *addr, uint32_t val, double seconds) {
  syscall(SYS_futex, addr, FUTEX_WAIT, val, ENG_TIMEOUT(seconds), NULL, 0);
}

static inline void eng_futex_wake(uint32_t *addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

/* ---- the segment ---- */

/* Creates an anonymous, owner-only shared file of `size` bytes and maps it. Returns 0 or an errno. */
static int eng_seg_create(size_t size, int *fd_out, void **base_out) {
#ifdef SYS_memfd_create
  int fd = (int)syscall(SYS_memfd_create, "engine-shm", 1u /* MFD_CLOEXEC */);
#else
  int fd = -1;
  errno = ENOSYS;
#endif
  if (fd < 0) return errno;
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)size) != 0) {
    int e = errno;
    close(fd);
    return e;
  }
  void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int e = errno;
    close(fd);
    return e;
  }
  *fd_out = fd;
  *base_out = base;
  return 0;
}

enum { ENG_ATTACH_OWNER = -2, ENG_ATTACH_MODE = -3, ENG_ATTACH_SIZE = -4, ENG_ATTACH_KIND = -5 };

/* Opens the creator's segment through /proc/<pid>/fd/<fd> (only a process of the same user may), checks
 * that it is a regular file (a descriptor from the store may name a device or a pipe), ours,
 * owner-only and of the agreed size, and maps it. Returns 0, an errno, or ENG_ATTACH_*. */
static int eng_seg_attach(int pid, int fd, size_t size, void **base_out) {
  char path[64];
  struct stat st;
  snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
  /* Looked at first without opening it for I/O (O_PATH: a device's open has effects), then the same
   * file, once checked, opened through this process's own descriptor of it. */
  int look = open(path, O_PATH | O_CLOEXEC);
  if (look < 0) return errno;
  if (fstat(look, &st) != 0) {
    int e = errno;
    close(look);
    return e;
  }
  int bad = !S_ISREG(st.st_mode) ? ENG_ATTACH_KIND
          : st.st_uid != geteuid() ? ENG_ATTACH_OWNER
          : (st.st_mode & 077) != 0 ? ENG_ATTACH_MODE
          : (size_t)st.st_size != size ? ENG_ATTACH_SIZE : 0;
  if (bad) {
    close(look);
    return bad;
  }
  snprintf(path, sizeof path, "/proc/self/fd/%d", look);
  int f = open(path, O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  int e = f < 0 ? errno : 0;
  close(look);
  if (f < 0) return e;
  void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  e = base == MAP_FAILED ? errno : 0;
  close(f);
  if (e) return e;
  *base_out = base;
  return 0;
}

/* Faults in [addr, addr + size) of a shared mapping for writing, from the calling process: a rank
 * populating its own slots places their pages on its NUMA node (first touch), before any peer reads
 * them, and the group's first collective takes no page faults. Without MADV_POPULATE_WRITE (Linux
 * < 5.14) the pages stay lazy; the owner's first write (every slot is written first by its owner)
 * places them the same way. */
static inline void eng_seg_populate(void *addr, size_t size) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  (void)madvise(addr, size, MADV_POPULATE_WRITE);
}

static inline void eng_seg_unmap(void *base, size_t size) {
  if (base != NULL) munmap(base, size);
}

static inline void eng_close(int fd) {
  if (fd >= 0) close(fd);
}

/* Fills buf with n random bytes (the segment's token). Returns 0 or an errno. */
static int eng_random(void *buf, size_t n) {
  char *p = (char *)buf;
  while (n) {
#ifdef SYS_getrandom
    long got = syscall(SYS_getrandom, p, n, 0);
#else
    long got = -1;
    errno = ENOSYS;
#endif
    if (got < 0) {
      if (errno == EINTR) continue;
      int f = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
      if (f < 0) return errno;
      got = read(f, p, n);
      close(f);
      if (got <= 0) return EIO;
    }
    p += got;
    n -= (size_t)got;
  }
  return 0;
}

/* ---- single copy between processes (cross-memory attach) ---- */

#include <sys/uio.h>

/* A word every process can read in its peers to learn whether process_vm_readv is allowed here. */
static volatile uint64_t eng_cma_probe_word = 0x45424f5250414d43ULL; /* "CMAPROBE" */

static inline uintptr_t eng_cma_probe_addr(void) { return (uintptr_t)&eng_cma_probe_word; }
static inline uint64_t eng_cma_probe_value(void) { return eng_cma_probe_word; }

/* Copies n bytes between `local` here and `remote` in process pid: from remote (write 0,
 * process_vm_readv) or to it (write 1, process_vm_writev; the same permission). Returns 0 or an errno
 * (EPERM: not allowed, ESRCH: the process is gone, EFAULT: the range is not mapped there). */
static int eng_cma_copy(int pid, void *local, uintptr_t remote, size_t n, int write) {
  char *l = (char *)local;
  while (n) {
    struct iovec lv = {l, n}, rv = {(void *)remote, n};
    ssize_t done = write ? process_vm_writev(pid, &lv, 1, &rv, 1, 0) : process_vm_readv(pid, &lv, 1, &rv, 1, 0);
    if (done < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (done == 0) return EFAULT;
    l += done;
    remote += (size_t)done;
    n -= (size_t)done;
  }
  return 0;
}

/* ---- peer liveness ---- */

/* A pidfd for pid (readable once the process has exited, even before it is reaped), or -1. */
static int eng_pidfd_open(int pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0);
#else
  (void)pid;
  return -1;
#endif
}

/* 1 while the process lives, 0 once it has exited. */
static int eng_pid_alive(int pidfd, int pid) {
  if (pidfd >= 0) {
    struct pollfd p = {pidfd, POLLIN, 0};
    return poll(&p, 1, 0) == 0;
  }
  return kill(pid, 0) == 0 || errno != ESRCH;
}

#endif
