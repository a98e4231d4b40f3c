/* The TCP transport's accepted connections: nothing is parsed before a hello proves the group's token. */
#ifndef ENGINE_TCP_ACCEPT_H
#define ENGINE_TCP_ACCEPT_H

#include "tcp_wire.h"

/* ---- accepting ---- */

static int tcp_drop_pending(eng_tcp *t, int i) {
  close(t->pending[i].fd);
  t->pending[i] = t->pending[--t->npending];
  t->rejected++;
  return 1;
}

/* Where the pending table is full: the entry that has waited longest, once it has waited
 * ENG_TCP_FULL_GRACE without its whole hello; else -1. (A peer writes its hello in one send, so one
 * part of it still owing the rest that long is no peer: a stray client writing a few bytes held its
 * entry for the hello's 30 s.) */
static int tcp_pending_overdue(const eng_tcp *t) {
  if (t->npending < ENG_TCP_MAX_PENDING) return -1;
  int oldest = 0;
  for (int i = 1; i < t->npending; i++)
    if (t->pending[i].deadline < t->pending[oldest].deadline) oldest = i;
  return t->pending[oldest].deadline - ENG_TCP_HELLO_SECONDS + ENG_TCP_FULL_GRACE <= eng_now() ? oldest : -1;
}

static int tcp_hello_progress(eng_tcp *t, int i);

/* tcp_pending_overdue's entry, once what has come of its hello is read (one that goes through or is
 * dropped makes room itself), else -1. */
static int tcp_pending_evictable(eng_tcp *t) {
  int oldest = tcp_pending_overdue(t);
  return oldest < 0 || tcp_hello_progress(t, oldest) ? -1 : oldest;
}

/* Takes connections until the pending table is full. The rest wait in the listen backlog, not closed:
 * a group of more ranks (or streams) than the table holds connects all at once (mesh), and a peer
 * whose connection was closed after it wrote its hello would fail. Once the oldest entry has owed
 * its hello for ENG_TCP_FULL_GRACE, it makes room for the next: a stray client holding connections
 * open kept the group's out for ENG_TCP_HELLO_SECONDS, past its timeout (a rank that wrote none of
 * its hello, away from the engine, makes its connection again: tcp_redial). */
static void tcp_accept(eng_tcp *t) {
  for (;;) {
    int evict = -1;
    if (t->npending == ENG_TCP_MAX_PENDING && (evict = tcp_pending_evictable(t)) < 0 &&
        t->npending == ENG_TCP_MAX_PENDING)
      return;
    int fd = accept4(t->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && evict >= 0) {   /* (its descriptor is the one wanted) */
        tcp_drop_pending(t, evict);
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) t->sys_errno = errno;
      return;
    }
    /* (read once more before it goes: a hello that came meanwhile takes it through, narrowing the
     * window in which a peer whose hello is on its way is closed) */
    if (evict >= 0 && !tcp_hello_progress(t, evict)) tcp_drop_pending(t, evict);
    if (t->sys_errno == EMFILE || t->sys_errno == ENFILE) t->sys_errno = 0;   /* (descriptors again) */
    tcp_sockopts(fd);
    tcp_pending *q = &t->pending[t->npending++];
    q->fd = fd;
    q->ready = 1;
    q->got = 0;
    q->deadline = eng_now() + ENG_TCP_HELLO_SECONDS;
  }
}

/* Reads a pending connection's hello; a right one becomes an incoming stream, anything else is closed.
 * Returns 1 when the pending entry i was consumed (the caller must not advance its index). */
static int tcp_hello_progress(eng_tcp *t, int i) {
  tcp_pending *q = &t->pending[i];
  for (;;) {
    ssize_t got = recv(q->fd, q->buf + q->got, ENG_TCP_HELLO - q->got, MSG_DONTWAIT);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && eng_now() < q->deadline) return 0;
    if (got <= 0) return tcp_drop_pending(t, i);   /* an error, its end, or too late */
    q->got += (size_t)got;
    if (q->got == ENG_TCP_HELLO) break;
  }
  tcp_hello h;
  unsigned char proof[16];
  memcpy(&h, q->buf, sizeof h);
  tcp_hello_proof(t->token, &h, proof);
  int ok = h.magic == ENG_TCP_MAGIC && h.version == ENG_TCP_VERSION && h.hdr == ENG_TCP_HDR &&
           tcp_same_proof(h.token, proof) && h.to == (uint32_t)t->rank && h.from < (uint32_t)t->size &&
           h.from != (uint32_t)t->rank && h.channel == (uint32_t)t->channel && h.size == (uint32_t)t->size &&
           h.nstreams >= 1 && h.nstreams <= ENG_TCP_MAX_STREAMS && h.stream < h.nstreams;
  if (ok) {
    tcp_peer *p = &t->peers[h.from];
    tcp_instream *in = &p->in[h.stream];
    ok = !p->dead && in->fd < 0 && !in->eof && (p->nin == 0 || p->nin == (int)h.nstreams);
    if (ok && in->stage == NULL) {
      in->stage = (char *)malloc(ENG_TCP_STAGE);
      ok = in->stage != NULL;
    }
    if (ok) {
      in->fd = q->fd;
      in->rpos = in->wpos = 0;
      in->state = IN_HDR;
      p->nin = (int)h.nstreams;
      p->heard = eng_now();
      t->pending[i] = t->pending[--t->npending];
      return 1;
    }
  }
  return tcp_drop_pending(t, i);
}

#endif
