/* MPI's matching over the TCP transport: posted receives, the unexpected queue, binding one to the other. */
#ifndef ENGINE_TCP_MATCH_H
#define ENGINE_TCP_MATCH_H

#include "tcp_wire.h"

/* ---- messages arriving ---- */

static void tcp_unlink_unexpected(eng_tcp *t, tcp_in *m) { TCP_UNLINK(tcp_in, t->unexp_head, t->unexp_tail, m); }

static void tcp_push_unexpected(eng_tcp *t, tcp_in *m) { TCP_PUSH(t->unexp_head, t->unexp_tail, m); }

static void tcp_unlink_arriving(tcp_peer *p, tcp_in *m) {
  tcp_in **at = &p->arriving;
  while (*at != NULL && *at != m) at = &(*at)->pnext;
  if (*at == m) *at = m->pnext;
  m->pnext = NULL;
}

static void tcp_unlink_posted(eng_tcp *t, tcp_req *r) { TCP_UNLINK(tcp_req, t->posted_head, t->posted_tail, r); }

static inline int tcp_matches(const tcp_req *r, int peer, int tag) {
  return (r->peer < 0 || r->peer == peer) && (r->tag < 0 || r->tag == tag);
}

static tcp_req *tcp_match_posted(eng_tcp *t, int peer, int tag) {
  tcp_req *r = t->posted_head;
  while (r != NULL && !tcp_matches(r, peer, tag)) r = r->next;
  if (r != NULL) tcp_unlink_posted(t, r);
  return r;
}

/* A whole message is in. */
static void tcp_complete_in(eng_tcp *t, tcp_in *m) {
  m->complete = 1;
  if (m->req != NULL) {
    tcp_req *r = m->req;
    r->in = NULL;
    tcp_finish_req(t, r, 0, -1);
    free(m);
  } else if (!m->owns) {   /* discarded (its receive was cancelled or too small) */
    free(m);
  }                        /* else: unexpected, waits in its list for a receive */
}

/* Receive r takes message m: an unexpected one (complete or still arriving) the caller unlinked, one
 * whose header was just read (nothing of it in a buffer: m->buf is NULL), or a send to this rank
 * itself (m->buf is the sender's). */
static void tcp_bind(eng_tcp *t, tcp_req *r, tcp_in *m) {
  r->src = m->peer;
  r->rtag = m->tag;
  r->nbytes = m->total;
  r->state = TCP_ACTIVE;
  if (m->total > r->len) {
    r->err = ENG_ERR_TRUNCATE;
    r->err_peer = m->peer;
    if (m->owns) free(m->buf);
    m->buf = NULL;
    m->owns = 0;
    if (m->complete) free(m);
    else m->req = NULL;           /* the rest is read and dropped */
    tcp_finish_req(t, r, 0, -1);
    return;
  }
  /* The whole buffer, not m->arrived bytes: parts on other streams may have filled any range of it.
   * The rest lands in r->buf. */
  if (m->buf != NULL && m->total) memcpy(r->buf, m->buf, m->total);
  if (m->owns) free(m->buf);
  m->owns = 0;
  m->buf = r->buf;
  if (m->complete) {
    free(m);
    tcp_finish_req(t, r, 0, -1);
  } else {
    m->req = r;
    r->in = m;
  }
}

/* Receive r, bound to message m still arriving, is cancelled (the caller frees r). m's bytes so far
 * move to a buffer of the transport's, and m goes to the next posted receive it matches, else among
 * the unexpected, before its sender's later messages: as MPI would match it, had r never been posted
 * (the next receive must not take the sender's next message in its place). Out of memory for the
 * copy, the peer fails, as where an unexpected message can't be buffered. */
static void tcp_unbind(eng_tcp *t, tcp_req *r, tcp_in *m) {
  char *own = (char *)malloc(m->total ? m->total : 1);
  r->in = NULL;
  m->req = NULL;
  if (own == NULL) {
    m->buf = NULL;
    tcp_peer_failed(t, m->peer, ENG_ERR_NOMEM, ENOMEM);
    return;
  }
  if (m->total) memcpy(own, m->buf, m->total);   /* (parts on other streams may have filled any range) */
  m->buf = own;
  m->owns = 1;
  tcp_req *next = tcp_match_posted(t, m->peer, m->tag);
  if (next != NULL) {
    tcp_bind(t, next, m);
    return;
  }
  tcp_in **at = &t->unexp_head;
  while (*at != NULL && !((*at)->peer == m->peer && (*at)->seq > m->seq)) at = &(*at)->next;
  m->next = *at;
  *at = m;
  if (m->next == NULL) t->unexp_tail = m;
}

/* Ordered channels (the algorithms': every rank runs the same collectives, whose receives each name
 * their peer and tag, posted in the order that peer sends): a message that no posted receive takes
 * shows its sender in another collective when a receive waits on that sender (its message came
 * first), or when its tag says so (call_tags.h). The ranks' calls differ: every request of the
 * channel fails naming that peer, at once instead of at the timeout. */
static void tcp_other_call_from(eng_tcp *t, int peer) {
  if (t->other_peer >= 0) return;
  t->other_peer = peer;
  tcp_wake(t);
}

/* Peer's message with this tag came, and no posted receive takes it. */
static void tcp_unmatched(eng_tcp *t, int peer, int tag) {
  int waited_on = 0;
  if (!t->ordered || peer == t->rank) return;
  for (tcp_req *r = t->posted_head; r != NULL && !waited_on; r = r->next) waited_on = r->peer == peer;
  if (waited_on || eng_other_call(t->call, tag)) tcp_other_call_from(t, peer);
}

/* A receive from peer is about to be posted, and no unexpected message matched it: whether one of
 * them shows another collective. */
static int tcp_out_of_order(eng_tcp *t, int peer) {
  if (!t->ordered) return 0;
  for (tcp_in *m = t->unexp_head; m != NULL && t->other_peer < 0; m = m->next)
    if (m->peer != t->rank && (m->peer == peer || eng_other_call(t->call, m->tag))) tcp_other_call_from(t, m->peer);
  return t->other_peer >= 0;
}

/* Whether a message of peer's that nobody asked for must be read now (so that what follows it can
 * be): a posted receive could take messages of this peer, or the peer is closing. */
static int tcp_must_read(eng_tcp *t, int peer) {
  if (t->peers[peer].closing) return 1;
  for (tcp_req *r = t->posted_head; r != NULL; r = r->next)
    if (r->peer < 0 || r->peer == peer) return 1;
  return 0;
}

#endif
