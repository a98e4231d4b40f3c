/* The TCP transport's incoming streams: frames parsed (every length checked) and read into their receives. */
#ifndef ENGINE_TCP_INSTREAM_H
#define ENGINE_TCP_INSTREAM_H

#include "tcp_match.h"

/* The MSG header in->h: match it, buffer it, or hold it (returns 0: stays held). */
static int tcp_open_message(eng_tcp *t, int peer, tcp_instream *in) {
  tcp_peer *p = &t->peers[peer];
  tcp_hdr *h = &in->h;
  tcp_req *r = tcp_match_posted(t, peer, h->tag);
  tcp_in *m;
  if (r == NULL) tcp_unmatched(t, peer, h->tag);
  if (r == NULL && h->a > t->eager_max && !tcp_must_read(t, peer)) return 0;
  m = (tcp_in *)calloc(1, sizeof(tcp_in));
  if (m == NULL) {
    if (r != NULL) tcp_finish_req(t, r, ENG_ERR_NOMEM, peer);
    tcp_peer_failed(t, peer, ENG_ERR_NOMEM, 0);
    return 1;
  }
  m->peer = peer;
  m->tag = h->tag;
  m->seq = h->seq;
  m->total = (size_t)h->a;
  m->claimed = (size_t)h->b;
  m->step = (size_t)h->b;
  m->parts = 1;
  if (r != NULL) tcp_bind(t, r, m);
  else {
    m->buf = (char *)malloc(m->total ? m->total : 1);
    if (m->buf == NULL) {
      free(m);
      tcp_peer_failed(t, peer, ENG_ERR_NOMEM, 0);
      return 1;
    }
    m->owns = 1;
    tcp_push_unexpected(t, m);
  }
  p->recv_seq = h->seq + 1;   /* numbers only grow (a send withdrawn before any byte went leaves a gap) */
  m->pnext = p->arriving;     /* every message under way, so a failure finds them all */
  p->arriving = m;
  in->msg = m;
  in->off = 0;
  in->left = (size_t)h->b;
  in->state = IN_BODY;
  return 1;
}

/* The PART header in->h: find its message (returns 0: its MSG header is not read yet). */
static int tcp_open_part(eng_tcp *t, int peer, tcp_instream *in) {
  tcp_peer *p = &t->peers[peer];
  tcp_hdr *h = &in->h;
  tcp_in *m = p->arriving;
  while (m != NULL && m->seq != h->seq) m = m->pnext;
  if (m == NULL) {
    if (h->seq >= p->recv_seq) return 0;
    return tcp_corrupt(t, peer), 1;
  }
  /* Stream s carries the part at s * step, once, as long as the step, or the rest on the last stream or
   * where the step would pass the end (the sender's split, tcp.h): parts that overlap or repeat would
   * let the message complete with bytes nobody sent (a reused buffer's, the receive's).
   * (claimed, not arrived: a part still arriving on another stream must not be counted twice, or the
   * message would complete, and be freed, under it) */
  size_t s = (size_t)(in - p->in);
  if (h->a > m->total || h->b > m->total - h->a || h->b > m->total - m->claimed || m->step == 0 ||
      h->a != s * m->step || (m->parts >> s) & 1u ||
      h->b != ((int)s == p->nin - 1 || m->step > m->total - h->a ? m->total - h->a : m->step))
    return tcp_corrupt(t, peer), 1;
  m->claimed += (size_t)h->b;
  m->parts |= 1u << s;
  in->msg = m;
  in->off = (size_t)h->a;
  in->left = (size_t)h->b;
  in->state = IN_BODY;
  return 1;
}

/* n bytes of the current body have arrived (already placed). */
static void tcp_body_advance(eng_tcp *t, int peer, tcp_instream *in, size_t n) {
  tcp_in *m = in->msg;
  in->off += n;
  in->left -= n;
  m->arrived += n;
  if (in->left == 0) {
    in->state = IN_HDR;
    in->msg = NULL;
    if (m->arrived == m->total) {
      tcp_unlink_arriving(&t->peers[peer], m);
      tcp_complete_in(t, m);
    }
  }
}

static inline char *tcp_body_dest(eng_tcp *t, tcp_instream *in, size_t *cap) {
  tcp_in *m = in->msg;
  if (m->buf == NULL) {
    *cap = in->left < ENG_TCP_SINK ? in->left : ENG_TCP_SINK;
    return t->sink;
  }
  *cap = in->left;
  return m->buf + in->off;
}

static int tcp_parse_header(eng_tcp *t, int peer, tcp_instream *in) {
  tcp_hdr *h = &in->h;
  memcpy(h, in->stage + in->rpos, sizeof *h);
  in->rpos += ENG_TCP_HDR;
  if (h->tag < 0) return tcp_corrupt(t, peer);
  if (h->kind == ENG_TCP_MSG) {
    /* (a peer of one stream carries every byte on it: a message saying the rest comes elsewhere never ends;
     * nor does one of several whose first frame is empty, as no part can follow it; a first frame split
     * otherwise than the sender's split would have a message buffered whole for a few bytes sent; a
     * number at uint64's top would make the next one expected 0, and every number after it pass) */
    if (h->a > ENG_TCP_MAX_MESSAGE || h->b > h->a || h->seq < t->peers[peer].recv_seq || h->seq == UINT64_MAX ||
        in != &t->peers[peer].in[0] || (h->b == 0 && h->a != 0) ||
        (h->b != h->a && h->b != tcp_part_step(h->a, t->peers[peer].nin)))
      return tcp_corrupt(t, peer);
    return 0;
  }
  if (h->kind == ENG_TCP_PART) {
    if (h->b == 0 || in == &t->peers[peer].in[0]) return tcp_corrupt(t, peer);
    return 0;
  }
  if (h->kind == ENG_TCP_BYE) {
    if (!tcp_bye_ok(h)) return tcp_corrupt(t, peer);
    tcp_bye_read(t, &t->peers[peer], h);
    return 0;
  }
  return tcp_corrupt(t, peer);
}

/* How a peer whose connection closed ended: in order (it said goodbye) or not. */
static inline int tcp_end_code(const tcp_peer *p) {
  return p->dead ? p->dead : p->departed ? ENG_ERR_PEER_LEFT : ENG_ERR_PEER_DEAD;
}

enum { TCP_READ_AGAIN, TCP_READ_NONE, TCP_READ_EOF, TCP_READ_DATA };

/* What a nonblocking read of peer's stream returned (got): interrupted (read again), nothing now or
 * the peer failed (recorded), its end, or data (heard from it now). */
static int tcp_read_outcome(eng_tcp *t, int peer, ssize_t got) {
  if (got < 0) {
    if (errno == EINTR) return TCP_READ_AGAIN;
    /* (a reset: only after this rank's own goodbye, which left that peer's data unread) */
    if (errno != EAGAIN && errno != EWOULDBLOCK) tcp_peer_failed(t, peer, tcp_end_code(&t->peers[peer]), errno);
    return TCP_READ_NONE;
  }
  if (got == 0) return TCP_READ_EOF;
  t->peers[peer].heard = eng_now();
  t->moved++;
  return TCP_READ_DATA;
}

/* Reads what one incoming stream has (until it would block, or a message must wait). A read that
 * returned less than it asked for emptied the socket: no second read just to hear EAGAIN. */
static void tcp_in_progress(eng_tcp *t, int peer, tcp_instream *in) {
  tcp_peer *p = &t->peers[peer];
  int more = 1;
  for (;;) {
    if (in->fd < 0 || p->dead) return;
    if (in->state == IN_BODY) {
      size_t avail = in->wpos - in->rpos, cap;
      if (avail) {
        size_t n = avail < in->left ? avail : in->left;
        char *dst = tcp_body_dest(t, in, &cap);
        if (n > cap) n = cap;
        if (in->msg->buf != NULL) memcpy(dst, in->stage + in->rpos, n);
        in->rpos += n;
        tcp_body_advance(t, peer, in, n);
        continue;
      }
      if (!more) return;
      struct iovec iov[2];
      iov[0].iov_base = tcp_body_dest(t, in, &cap);
      iov[0].iov_len = cap;
      iov[1].iov_base = in->stage;
      iov[1].iov_len = ENG_TCP_STAGE;
      in->rpos = in->wpos = 0;
      struct msghdr mh;
      memset(&mh, 0, sizeof mh);
      mh.msg_iov = iov;
      mh.msg_iovlen = 2;
      ssize_t got = recvmsg(in->fd, &mh, MSG_DONTWAIT);
      int outcome = tcp_read_outcome(t, peer, got);
      if (outcome == TCP_READ_AGAIN) continue;
      if (outcome == TCP_READ_NONE) return;
      if (outcome == TCP_READ_EOF) goto eof;
      more = (size_t)got == cap + ENG_TCP_STAGE;
      size_t first = (size_t)got < cap ? (size_t)got : cap;
      in->wpos = (size_t)got - first;
      tcp_body_advance(t, peer, in, first);
      continue;
    }
    if (in->state == IN_HELD) {
      if (!tcp_open_message(t, peer, in)) return;
      if (in->state == IN_BODY && in->left == 0) tcp_body_advance(t, peer, in, 0);
      continue;
    }
    if (in->state == IN_WAIT) {
      if (!tcp_open_part(t, peer, in)) return;
      continue;
    }
    /* IN_HDR */
    if (in->wpos - in->rpos >= ENG_TCP_HDR) {
      if (tcp_parse_header(t, peer, in)) return;
      if (in->h.kind != ENG_TCP_BYE) in->state = in->h.kind == ENG_TCP_MSG ? IN_HELD : IN_WAIT;
      continue;
    }
    if (in->rpos) {
      memmove(in->stage, in->stage + in->rpos, in->wpos - in->rpos);
      in->wpos -= in->rpos;
      in->rpos = 0;
    }
    if (!more) return;
    size_t want = ENG_TCP_STAGE - in->wpos;
    ssize_t got = recv(in->fd, in->stage + in->wpos, want, MSG_DONTWAIT);
    int outcome = tcp_read_outcome(t, peer, got);
    if (outcome == TCP_READ_AGAIN) continue;
    if (outcome == TCP_READ_NONE) return;
    if (outcome == TCP_READ_EOF) goto eof;
    more = (size_t)got == want;
    in->wpos += (size_t)got;
  }
eof:
  /* The peer closed this stream: what it sent is all read. Mid-message or mid-header it is gone. */
  close(in->fd);
  in->fd = -1;
  in->eof = 1;
  p->closing = 1;
  if (in->state != IN_HDR || in->wpos != in->rpos) tcp_peer_failed(t, peer, ENG_ERR_PEER_DEAD, 0);
}

#endif
