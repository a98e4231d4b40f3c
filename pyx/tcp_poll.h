/* The TCP transport's progress (one poll over every socket) and its failures (a peer gone, corrupt or left). */
#ifndef ENGINE_TCP_POLL_H
#define ENGINE_TCP_POLL_H

#include "tcp_instream.h"
#include "tcp_outstream.h"
#include "tcp_accept.h"

/* ---- failure ---- */

static int tcp_corrupt(eng_tcp *t, int peer) {
  tcp_peer_failed(t, peer, ENG_ERR_CORRUPT, 0);
  return 1;
}

static void tcp_close_peer(eng_tcp *t, tcp_peer *p) {
  for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
    if (p->out[s].fd >= 0) close(p->out[s].fd);
    p->out[s].fd = -1;
    if (p->in[s].fd >= 0) close(p->in[s].fd);
    p->in[s].fd = -1;
    p->in[s].state = IN_HDR;
    p->in[s].msg = NULL;
  }
  (void)t;
}

/* Whether no other rank is left to send to a receive from any rank (every other one's end came: it left
 * or died): the error code to end such a receive with, naming in *who the first rank that died, the
 * cause, else the last one failed; 0 while one is left (or the group is this rank alone). */
static int tcp_none_left(eng_tcp *t, int *who) {
  int last = -1;
  for (int q = 0; q < t->size; q++) {
    if (q == t->rank) continue;
    if (!t->peers[q].dead) return 0;
    last = q;
  }
  if (last < 0) return 0;
  for (int q = 0; q < t->size; q++)
    if (q != t->rank && t->peers[q].dead != ENG_ERR_PEER_LEFT) {
      *who = q;
      return t->peers[q].dead;
    }
  *who = last;
  return ENG_ERR_PEER_LEFT;
}

/* Every send queued for peer ends with error code (its connections are closed, or about to be). */
static void tcp_fail_sends(eng_tcp *t, int peer, int code) {
  tcp_peer *p = &t->peers[peer];
  for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
    tcp_out *o = &p->out[s];
    while (o->head != NULL) {
      tcp_item *it = o->head;
      tcp_req *r = it->req;
      o->head = it->next;
      free(it->owned);
      free(it);
      if (r != NULL && --r->items == 0) tcp_finish_req(t, r, code, peer);
      else if (r != NULL && !r->err) {
        r->err = code;
        r->err_peer = peer;
      }
    }
    o->tail = NULL;
  }
}

/* Peer left in order and reads nothing more (its end of a connection of this rank's came, or a reset:
 * it closed with data of ours unread): what is queued for it fails, what it sent is still read. */
static void tcp_reads_no_more(eng_tcp *t, int peer) {
  tcp_peer *p = &t->peers[peer];
  p->closing = 1;
  tcp_fail_sends(t, peer, tcp_end_code(p));
  tcp_close_outs(p);
}

/* peer failed (code, errno): every request involving it ends with that error. */
static void tcp_peer_failed(eng_tcp *t, int peer, int code, int err) {
  tcp_peer *p = &t->peers[peer];
  if (p->dead) return;
  p->dead = code;
  p->dead_errno = err;
  if (t->dead_peer < 0 && tcp_fails_all(p)) {
    t->dead_peer = peer;
    t->dead_code = code;
  }
  tcp_close_peer(t, p);
  tcp_fail_sends(t, peer, code);
  /* its messages still arriving */
  while (p->arriving != NULL) {
    tcp_in *m = p->arriving;
    p->arriving = m->pnext;
    if (m->req != NULL) {
      m->req->in = NULL;
      tcp_finish_req(t, m->req, code, peer);
      free(m);
    } else if (m->owns) {
      tcp_unlink_unexpected(t, m);
      free(m->buf);
      free(m);
    } else {
      free(m);
    }
  }
  /* receives posted for it */
  tcp_req *r = t->posted_head;
  while (r != NULL) {
    tcp_req *next = r->next;
    if (r->peer == peer) {
      tcp_unlink_posted(t, r);
      r->src = peer;
      tcp_finish_req(t, r, code, peer);
    }
    r = next;
  }
  /* receives from any rank, where none is left to send */
  int who = -1, none = tcp_none_left(t, &who);
  for (r = t->posted_head; none && r != NULL;) {
    tcp_req *next = r->next;
    if (r->peer < 0) {
      tcp_unlink_posted(t, r);
      r->src = who;
      tcp_finish_req(t, r, none, who);
    }
    r = next;
  }
  tcp_wake(t);
}

/* A closing peer whose every incoming stream has reached its end has nothing more to give; nor has one
 * whose other streams hold only parts of messages whose headers can't come: stream 0, which carries
 * every header, has ended (a part's stream is held, not read, until its header is in). */
static void tcp_check_closing(eng_tcp *t, int peer) {
  tcp_peer *p = &t->peers[peer];
  if (!p->closing || p->dead) return;
  for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++)
    if (p->in[s].fd >= 0 && !(p->in[s].state == IN_WAIT && p->in[0].eof)) return;
  tcp_peer_failed(t, peer, tcp_end_code(p), 0);
}


/* ---- progress ---- */

static int tcp_pfd_reserve(eng_tcp *t, size_t n) {
  if (n <= t->pcap) return 0;
  size_t cap = n * 2;
  struct pollfd *pfd = (struct pollfd *)realloc(t->pfd, cap * sizeof *pfd);
  if (pfd == NULL) return ENOMEM;
  t->pfd = pfd;
  int *what = (int *)realloc(t->pwhat, cap * sizeof *what);
  if (what == NULL) return ENOMEM;
  t->pwhat = what;
  t->pcap = cap;
  return 0;
}

static inline void tcp_pfd_add(eng_tcp *t, int *n, int fd, short events, int what) {
  t->pfd[*n].fd = fd;
  t->pfd[*n].events = events;
  t->pwhat[(*n)++] = what;
}

/* Fills t->pfd with what to watch; returns the count (or -1: out of memory). */
static int tcp_poll_set(eng_tcp *t, int with_wake) {
  size_t most = 2 + (size_t)t->npending + (size_t)t->size * 2 * ENG_TCP_MAX_STREAMS;
  if (tcp_pfd_reserve(t, most)) return -1;
  int n = 0;
  /* (with the pending table full, what waits to be accepted waits for a free entry, or for the oldest
   * entry's grace to pass: tcp_accept) */
  tcp_pfd_add(t, &n, t->listen_fd, t->npending < ENG_TCP_MAX_PENDING || tcp_pending_overdue(t) >= 0 ? POLLIN : 0,
              PF_LISTEN << 24);
  if (with_wake) tcp_pfd_add(t, &n, t->wake_fd, POLLIN, PF_WAKE << 24);
  for (int i = 0; i < t->npending; i++) tcp_pfd_add(t, &n, t->pending[i].fd, POLLIN, PF_PENDING << 24 | i);
  for (int q = 0; q < t->size; q++) {
    tcp_peer *p = &t->peers[q];
    if (p->dead) continue;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
      tcp_instream *in = &p->in[s];
      tcp_out *o = &p->out[s];
      int held = in->state == IN_HELD || in->state == IN_WAIT;
      int writing = o->connecting || o->head != NULL || o->hello_done < ENG_TCP_HELLO;
      /* A stream whose message waits for a receive is not read (nor watched: it would wake at once). */
      if (in->fd >= 0) tcp_pfd_add(t, &n, in->fd, held ? 0 : POLLIN, PF_IN << 24 | q << 4 | s);
      /* POLLIN on a sending socket: the peer closed it (it never writes to it). */
      if (o->fd >= 0) tcp_pfd_add(t, &n, o->fd, POLLIN | (writing ? POLLOUT : 0), PF_OUT << 24 | q << 4 | s);
    }
  }
  return n;
}

/* Readable: a sending socket carries nothing back but the peer's goodbye, then its end. */
static void tcp_out_closed(eng_tcp *t, int peer, int s) {
  tcp_peer *p = &t->peers[peer];
  tcp_out *o = &p->out[s];
  char extra;
  int full = o->back_got == ENG_TCP_BACK;
  if (o->fd < 0) return;   /* closed earlier in this round, with the peer's other streams */
  if (tcp_dropped_unproven(t, p, o)) {
    tcp_redial(t, peer, s);
    return;
  }
  ssize_t got = full ? recv(o->fd, &extra, 1, MSG_DONTWAIT)
                     : recv(o->fd, o->back + o->back_got, ENG_TCP_BACK - o->back_got, MSG_DONTWAIT);
  if (got == 0 || (got < 0 && full && tcp_reset_after_bye(p, errno))) {
    /* It will read nothing more (one that ended without its goodbye, with something queued for it, fails
     * at once; so does a goodbye cut short). */
    int queued = tcp_queued_for(p);
    if ((queued && !p->departed) || (o->back_got && !full)) {
      tcp_peer_failed(t, peer, queued ? tcp_end_code(p) : ENG_ERR_PEER_DEAD, 0);
      return;
    }
    tcp_reads_no_more(t, peer);
  } else if (got > 0) {
    if (full) {
      tcp_corrupt(t, peer);
      return;
    }
    o->back_got += (size_t)got;
    if (o->back_got == ENG_TCP_BACK && !tcp_back_bye(t, p, o)) tcp_corrupt(t, peer);
  } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ENOTCONN) {
    tcp_peer_failed(t, peer, o->connecting ? ENG_ERR_CONNECT : tcp_end_code(p), errno);
  }
}

/* The whole goodbye a sending socket carried back: where it is one, proved by the token, the peer's
 * departure is recorded and 1 returned; else 0 (nothing else ever comes back). */
static int tcp_back_bye(eng_tcp *t, tcp_peer *p, const tcp_out *o) {
  tcp_hdr h;
  unsigned char proof[16];
  memcpy(&h, o->back, sizeof h);
  tcp_back_proof(t->token, &h, (uint32_t)(p - t->peers), (uint32_t)t->rank, (uint32_t)t->channel,
                 (uint32_t)(o - p->out), proof);
  if (!tcp_same_proof(o->back + ENG_TCP_HDR, proof) || !tcp_bye_ok(&h)) return 0;
  tcp_bye_read(t, p, &h);
  return 1;
}

/* How a peer ended whose connection o failed under a send: a goodbye it sent back on o before it
 * closed is read first (a peer that gave the group up closes at once, and the send here may fail before
 * a poll saw the goodbye), so a departure is not named a crash. */
static int tcp_end_of(eng_tcp *t, tcp_peer *p, tcp_out *o) {
  while (!p->departed && o->fd >= 0 && o->back_got < ENG_TCP_BACK) {
    ssize_t got = recv(o->fd, o->back + o->back_got, ENG_TCP_BACK - o->back_got, MSG_DONTWAIT);
    if (got <= 0) break;
    o->back_got += (size_t)got;
  }
  if (!p->departed && o->back_got == ENG_TCP_BACK) (void)tcp_back_bye(t, p, o);
  return tcp_end_code(p);
}

/* One round: poll (timeout 0) and handle whatever is ready. Called with the lock held. */
static void tcp_progress(eng_tcp *t) {
  int n = tcp_poll_set(t, 0);
  if (n < 0) {
    t->sys_errno = ENOMEM;
    return;
  }
  int ready = poll(t->pfd, (nfds_t)n, 0);
  if (ready < 0) ready = 0;
  for (int i = 0; i < n && ready > 0; i++) {
    short rev = t->pfd[i].revents;
    if (!rev) continue;
    ready--;
    int kind = t->pwhat[i] >> 24, q = (t->pwhat[i] >> 4) & 0xfffff, s = t->pwhat[i] & 15;
    if (kind == PF_LISTEN) {
      tcp_accept(t);
    } else if (kind == PF_PENDING) {
      int k = t->pwhat[i] & 0xffffff;
      if (k < t->npending) t->pending[k].ready = 1;   /* (tcp_accept may have made room: entries moved) */
    } else if (kind == PF_IN) {
      if (rev & (POLLHUP | POLLERR)) t->peers[q].closing = 1;   /* (a held stream is watched for these only) */
      tcp_in_progress(t, q, &t->peers[q].in[s]);
    } else if (kind == PF_OUT) {
      if (rev & (POLLIN | POLLERR | POLLHUP)) {
        if (t->peers[q].out[s].connecting) tcp_out_progress(t, q, s);
        else tcp_out_closed(t, q, s);
      }
      if (rev & POLLOUT) tcp_out_progress(t, q, s);
    }
  }
  /* connections still proving themselves, those with something to read or past their deadline: an idle
   * one costs no read each round (strangers holding entries slowed every message). Entries move: walk by
   * index. */
  double now = t->npending ? eng_now() : 0.0;
  for (int i = 0; i < t->npending;) {
    tcp_pending *q = &t->pending[i];
    if (!q->ready && q->deadline > now) {
      i++;
      continue;
    }
    q->ready = 0;
    if (!tcp_hello_progress(t, i)) i++;
  }
  /* messages waiting for a receive (a receive may have been posted since), closing peers */
  for (int q = 0; q < t->size; q++) {
    tcp_peer *p = &t->peers[q];
    if (p->dead) continue;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++)
      if (p->in[s].fd >= 0 && (p->in[s].state == IN_HELD || p->in[s].state == IN_WAIT)) tcp_in_progress(t, q, &p->in[s]);
    if (p->closing) tcp_check_closing(t, q);
  }
}

#endif
