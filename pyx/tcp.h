/* The TCP transport: one channel of a group, its connections, and MPI's matching rules over them.
 * Plain C, every function GIL-free; pyx/tcp_transport.pxi wraps it behind the transport seam.
 *
 * Connections. Every rank listens on one socket per channel (its address is exchanged through the
 * group's bootstrap: torch's store or MPI). A connection carries bytes one way only: rank a connects
 * to rank b to send to it, b connects to a to send back, so two ranks that both start talking never
 * race over who connects. A peer gets `nstreams` connections (several streams carry the parts of a
 * large message at once). Connections are made when a message first goes to a peer, or for every
 * peer at once when the group is made (eng_tcp_connect_all, the mesh).
 *
 * Trust. An accepted connection must first send a 48-byte hello proving the group's random token
 * (from the store); until then nothing it sends is parsed, and a connection whose hello is wrong,
 * late or a duplicate is closed. Every length read from the wire is checked before it is used.
 *
 * Frames. A 32-byte header, then its payload. MSG opens message `seq` (numbered per sender and
 * receiver) with its tag, its length and the length of the first part, which follows; PART carries
 * bytes [offset, offset + len) of a message already opened, on another stream. MSG headers travel on
 * stream 0 in order, so matching follows MPI's rules: receives match in post order, by source and tag
 * or their wildcards, and messages of one sender are matched in the order it sent them.
 *
 * Zero copy. Sends go from the user's buffer into the socket (sendmsg: header and payload in one
 * call). A message that matches a posted receive is read straight into its buffer (recvmsg: the rest
 * of the payload into the buffer, whatever follows into the stream's staging buffer). A message
 * nobody asked for yet is read into a buffer of its own if it is small (up to eager_max) or if a
 * posted receive waits behind it; a larger one is left in the kernel (TCP's flow control holds its
 * sender) until a receive matches it.
 *
 * Progress. Only inside the caller's test and wait (eng_tcp_test, eng_tcp_sleep: poll), under one
 * mutex per channel; a thread sleeping in poll is woken through an eventfd when another completes
 * its request.
 *
 * Leaving. A rank that destroys the group, or whose process ends normally, first writes a BYE header on
 * every connection it has, both ways (eng_tcp_goodbye), then closes them. A rank that finished its part
 * of a collective may leave while others still finish theirs: its goodbye tells them it left in
 * order, so only what still involves it fails.
 *
 * Failure. A peer that closes a connection is read to the end of what it sent; then every request that
 * involves it fails naming it. A peer that closed without its goodbye (it crashed, was killed, lost the
 * link) fails, on a channel marked fail_any (the engine's collectives), every request of the channel:
 * whoever waits on a third rank that waits on it would otherwise wait out the timeout. */
#ifndef ENGINE_TCP_H
#define ENGINE_TCP_H

#include "shm.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define ENG_TCP_HDR 32
#define ENG_TCP_HELLO 48
#define ENG_TCP_MAGIC 0x54474e45u           /* "ENGT" */
#define ENG_TCP_VERSION 1
#define ENG_TCP_MAX_STREAMS 16
#define ENG_TCP_STAGE (64u << 10)            /* staging buffer of each incoming stream */
#define ENG_TCP_SINK (256u << 10)            /* where discarded bytes are read to */
#define ENG_TCP_MAX_MESSAGE (1ULL << 48)
#define ENG_TCP_MAX_PENDING 64              /* connections not yet through their hello */
#define ENG_TCP_HELLO_SECONDS 30.0          /* how long one may take to send it */
#define ENG_TCP_IOV 64
#define ENG_TCP_PART_ALIGN 4096

/* The engine's error codes (pyx/engine/_core.pxd, ENG_ERR_*). */
#define ENG_TCP_ERR_PEER_DEAD 100001
#define ENG_TCP_ERR_CORRUPT 100003
#define ENG_TCP_ERR_TRUNCATE 100004
#define ENG_TCP_ERR_NOMEM 100005
#define ENG_TCP_ERR_CONNECT 100008
#define ENG_TCP_ERR_PEER_LEFT 100009


enum { ENG_TCP_MSG = 0x2147534d, ENG_TCP_PART = 0x54524150, ENG_TCP_BYE = 0x21455942 };  /* "MSG!", "PART", "BYE!" */
enum { TCP_SEND = 1, TCP_RECV = 2 };
enum { TCP_QUEUED = 0, TCP_ACTIVE = 1, TCP_DONE = 2 };
enum { IN_HDR = 0, IN_BODY = 1, IN_HELD = 2, IN_WAIT = 3 };
enum { PF_LISTEN = 1, PF_WAKE = 2, PF_PENDING = 3, PF_IN = 4, PF_OUT = 5 };

typedef struct {
  uint32_t kind;
  int32_t tag;
  uint64_t seq;
  uint64_t a;     /* MSG: the message's bytes; PART: the offset */
  uint64_t b;     /* payload bytes that follow this header */
} tcp_hdr;

typedef struct {
  uint32_t magic;
  uint16_t version, hdr;
  unsigned char token[16];
  uint32_t from, to, channel, stream, nstreams, size;
} tcp_hello;

typedef struct tcp_req tcp_req;
typedef struct tcp_in tcp_in;

struct tcp_req {
  int kind, peer, tag, state, err, err_peer;
  int orphan;               /* cancelled while under way: the transport frees it once done */
  char *buf;
  size_t len;
  size_t items;             /* send: frames not yet written whole */
  tcp_in *in;               /* receive: the message arriving into it */
  int src, rtag;            /* receive: its status */
  size_t nbytes;
  tcp_req *next;            /* posted receives, in post order */
};

struct tcp_in {
  int peer, tag;
  uint64_t seq;
  size_t total, arrived;
  char *buf;                /* where its bytes go; NULL: discarded */
  int owns;                 /* buf is the transport's (a message nobody asked for yet) */
  int complete;
  tcp_req *req;             /* the receive it completes (NULL: unexpected, or discarded) */
  tcp_in *next;             /* unexpected messages, in arrival order */
  tcp_in *pnext;            /* the peer's messages with parts still to come */
};

typedef struct tcp_item {
  tcp_hdr hdr;
  size_t hdr_done;
  const char *data;
  size_t len, done;
  char *owned;              /* a cancelled send's rest, copied */
  tcp_req *req;
  struct tcp_item *next;
} tcp_item;

typedef struct {
  int fd;                   /* -1: none */
  int connecting;
  size_t hello_done;        /* bytes of the hello written */
  tcp_hello hello;
  tcp_item *head, *tail;
  unsigned char back[ENG_TCP_HDR];  /* what the peer wrote back: its goodbye, or nothing */
  size_t back_got;
} tcp_out;

typedef struct {
  int fd;                   /* -1: none (yet, or closed) */
  int eof;                  /* the peer closed it */
  char *stage;
  size_t rpos, wpos;
  int state;
  tcp_hdr h;                /* IN_HELD, IN_WAIT: the header waiting for a receive / its message */
  tcp_in *msg;              /* IN_BODY: the next `left` bytes go to msg->buf + off */
  size_t off, left;
} tcp_instream;

typedef struct {
  struct sockaddr_storage addr;
  socklen_t addrlen;
  int has_addr;
  int nout;                 /* out-streams made (0 or the transport's nstreams) */
  int nin;                  /* in-streams it announced (0 until its first hello) */
  tcp_out out[ENG_TCP_MAX_STREAMS];
  tcp_instream in[ENG_TCP_MAX_STREAMS];
  uint64_t send_seq, recv_seq;
  tcp_in *arriving;
  int closing;              /* a connection of it closed: read what is left, then fail it */
  int departed;             /* it said goodbye: its end fails only what involves it */
  int dead;                 /* an ENG_TCP_ERR_* code once it failed */
  int dead_errno;
  double heard;             /* when bytes last came from it (its hello included); 0: never */
} tcp_peer;

typedef struct {
  int fd;
  double deadline;
  size_t got;
  unsigned char buf[ENG_TCP_HELLO];
} tcp_pending;

typedef struct eng_tcp {
  int rank, size, channel, nstreams, fail_any;
  size_t split_min, eager_max;
  unsigned char token[16];
  int listen_fd, wake_fd;
  pthread_mutex_t lock;
  tcp_peer *peers;
  tcp_req *posted_head, *posted_tail;
  tcp_in *unexp_head, *unexp_tail;
  tcp_pending pending[ENG_TCP_MAX_PENDING];
  int npending;
  uint32_t gen;             /* completions so far: the channel's doorbell (a sleeper compares it before sleeping) */
  int sleepers;
  struct pollfd *pfd;
  int *pwhat;               /* per pollfd: kind << 24 | peer << 4 | stream (or a pending index) */
  size_t pcap;
  char *sink;
  int dead_peer, dead_code; /* the first peer that failed */
  int rejected;             /* connections closed before or at their hello */
  int said_bye;             /* eng_tcp_goodbye ran: every connection is closed */
  int sys_errno;            /* the last system error outside any peer */
} eng_tcp;

/* ---- small helpers ---- */

static inline void tcp_hdr_set(tcp_hdr *h, uint32_t kind, int tag, uint64_t seq, uint64_t a, uint64_t b) {
  h->kind = kind;
  h->tag = tag;
  h->seq = seq;
  h->a = a;
  h->b = b;
}

static inline int tcp_cmp_token(const unsigned char *a, const unsigned char *b) {
  unsigned char d = 0;
  for (int i = 0; i < 16; i++) d |= a[i] ^ b[i];
  return d == 0;
}

static void tcp_sockopts(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static inline void tcp_wake(eng_tcp *t) {
  eng_add32(&t->gen);
  if (t->sleepers) {
    uint64_t one = 1;
    ssize_t w = write(t->wake_fd, &one, sizeof one);
    (void)w;
  }
}

static void tcp_finish_req(eng_tcp *t, tcp_req *r, int err, int err_peer) {
  if (r->state == TCP_DONE) return;
  r->state = TCP_DONE;
  if (err && !r->err) {
    r->err = err;
    r->err_peer = err_peer;
  }
  if (r->orphan) {
    free(r);
    return;
  }
  tcp_wake(t);
}

/* ---- messages arriving ---- */

static void tcp_unlink_unexpected(eng_tcp *t, tcp_in *m) {
  tcp_in *prev = NULL, *x = t->unexp_head;
  while (x != NULL && x != m) {
    prev = x;
    x = x->next;
  }
  if (x == NULL) return;
  if (prev == NULL) t->unexp_head = m->next;
  else prev->next = m->next;
  if (t->unexp_tail == m) t->unexp_tail = prev;
  m->next = NULL;
}

static void tcp_unlink_arriving(tcp_peer *p, tcp_in *m) {
  tcp_in **at = &p->arriving;
  while (*at != NULL && *at != m) at = &(*at)->pnext;
  if (*at == m) *at = m->pnext;
  m->pnext = NULL;
}

static int tcp_unlink_posted(eng_tcp *t, tcp_req *r) {
  tcp_req *prev = NULL, *x = t->posted_head;
  while (x != NULL && x != r) {
    prev = x;
    x = x->next;
  }
  if (x == NULL) return 0;
  if (prev == NULL) t->posted_head = r->next;
  else prev->next = r->next;
  if (t->posted_tail == r) t->posted_tail = prev;
  r->next = NULL;
  return 1;
}

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

/* Receive r takes message m (unexpected, complete or still arriving), which the caller unlinked. */
static void tcp_bind(eng_tcp *t, tcp_req *r, tcp_in *m) {
  r->src = m->peer;
  r->rtag = m->tag;
  r->nbytes = m->total;
  r->state = TCP_ACTIVE;
  if (m->total > r->len) {
    r->err = ENG_TCP_ERR_TRUNCATE;
    r->err_peer = m->peer;
    if (m->owns) free(m->buf);
    m->buf = NULL;
    m->owns = 0;
    if (m->complete) free(m);
    else m->req = NULL;           /* the rest is read and dropped */
    tcp_finish_req(t, r, 0, -1);
    return;
  }
  if (m->total) memcpy(r->buf, m->buf, m->total);   /* what arrived so far; the rest lands in r->buf */
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

/* Whether a message of peer's that nobody asked for must be read now (so that what follows it can
 * be): a posted receive could take messages of this peer, or the peer is closing. */
static int tcp_must_read(eng_tcp *t, int peer) {
  if (t->peers[peer].closing) return 1;
  for (tcp_req *r = t->posted_head; r != NULL; r = r->next)
    if (r->peer < 0 || r->peer == peer) return 1;
  return 0;
}

static int tcp_corrupt(eng_tcp *t, int peer);
static void tcp_peer_failed(eng_tcp *t, int peer, int code, int err);

/* The MSG header in->h: match it, buffer it, or hold it (returns 0: stays held). */
static int tcp_open_message(eng_tcp *t, int peer, tcp_instream *in) {
  tcp_peer *p = &t->peers[peer];
  tcp_hdr *h = &in->h;
  tcp_req *r = tcp_match_posted(t, peer, h->tag);
  tcp_in *m;
  if (r == NULL && h->a > t->eager_max && !tcp_must_read(t, peer)) return 0;
  m = (tcp_in *)calloc(1, sizeof(tcp_in));
  if (m == NULL) {
    if (r != NULL) tcp_finish_req(t, r, ENG_TCP_ERR_NOMEM, peer);
    tcp_peer_failed(t, peer, ENG_TCP_ERR_NOMEM, 0);
    return 1;
  }
  m->peer = peer;
  m->tag = h->tag;
  m->seq = h->seq;
  m->total = (size_t)h->a;
  if (r != NULL) {
    r->src = peer;
    r->rtag = h->tag;
    r->nbytes = m->total;
    r->state = TCP_ACTIVE;
    if (m->total > r->len) {
      r->err = ENG_TCP_ERR_TRUNCATE;
      r->err_peer = peer;
      tcp_finish_req(t, r, 0, -1);
    } else {
      m->buf = r->buf;
      m->req = r;
      r->in = m;
    }
  } else {
    m->buf = (char *)malloc(m->total ? m->total : 1);
    if (m->buf == NULL) {
      free(m);
      tcp_peer_failed(t, peer, ENG_TCP_ERR_NOMEM, 0);
      return 1;
    }
    m->owns = 1;
    if (t->unexp_tail == NULL) t->unexp_head = m;
    else t->unexp_tail->next = m;
    t->unexp_tail = m;
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
  if (h->a > m->total || h->b > m->total - h->a || h->b > m->total - m->arrived) return tcp_corrupt(t, peer), 1;
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
    if (h->a > ENG_TCP_MAX_MESSAGE || h->b > h->a || h->seq < t->peers[peer].recv_seq || in != &t->peers[peer].in[0])
      return tcp_corrupt(t, peer);
    return 0;
  }
  if (h->kind == ENG_TCP_PART) {
    if (h->b == 0 || in == &t->peers[peer].in[0]) return tcp_corrupt(t, peer);
    return 0;
  }
  if (h->kind == ENG_TCP_BYE) {
    if (h->a || h->b) return tcp_corrupt(t, peer);
    t->peers[peer].departed = 1;
    return 0;
  }
  return tcp_corrupt(t, peer);
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
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        tcp_peer_failed(t, peer, ENG_TCP_ERR_PEER_DEAD, errno);
        return;
      }
      if (got == 0) goto eof;
      p->heard = eng_now();
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
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      tcp_peer_failed(t, peer, ENG_TCP_ERR_PEER_DEAD, errno);
      return;
    }
    if (got == 0) goto eof;
    p->heard = eng_now();
    more = (size_t)got == want;
    in->wpos += (size_t)got;
  }
eof:
  /* The peer closed this stream: what it sent is all read. Mid-message or mid-header it is gone. */
  close(in->fd);
  in->fd = -1;
  in->eof = 1;
  p->closing = 1;
  if (in->state != IN_HDR || in->wpos != in->rpos) tcp_peer_failed(t, peer, ENG_TCP_ERR_PEER_DEAD, 0);
}

/* How a peer whose connection closed ended: in order (it said goodbye) or not. */
static inline int tcp_end_code(const tcp_peer *p) {
  return p->dead ? p->dead : p->departed ? ENG_TCP_ERR_PEER_LEFT : ENG_TCP_ERR_PEER_DEAD;
}

/* ---- sending ---- */

static void tcp_item_done(eng_tcp *t, tcp_item *it) {
  tcp_req *r = it->req;
  free(it->owned);
  free(it);
  if (r != NULL && --r->items == 0) tcp_finish_req(t, r, 0, -1);
}

static int tcp_start_connect(eng_tcp *t, int peer);

/* Writes what one outgoing stream has queued, until the socket would block. */
static void tcp_out_progress(eng_tcp *t, int peer, int s) {
  tcp_peer *p = &t->peers[peer];
  tcp_out *o = &p->out[s];
  if (o->fd < 0 || p->dead) return;
  if (o->connecting) {
    struct pollfd q = {o->fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    if (poll(&q, 1, 0) <= 0) return;
    if (getsockopt(o->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err) {
      tcp_peer_failed(t, peer, ENG_TCP_ERR_CONNECT, err);
      return;
    }
    o->connecting = 0;
  }
  for (;;) {
    struct iovec iov[ENG_TCP_IOV];
    int n = 0;
    size_t offered = 0;
    if (o->hello_done < ENG_TCP_HELLO) {
      iov[n].iov_base = (char *)&o->hello + o->hello_done;
      iov[n].iov_len = ENG_TCP_HELLO - o->hello_done;
      offered += iov[n++].iov_len;
    }
    for (tcp_item *it = o->head; it != NULL && n + 2 <= ENG_TCP_IOV; it = it->next) {
      if (it->hdr_done < ENG_TCP_HDR) {
        iov[n].iov_base = (char *)&it->hdr + it->hdr_done;
        iov[n].iov_len = ENG_TCP_HDR - it->hdr_done;
        offered += iov[n++].iov_len;
      }
      if (it->done < it->len) {
        iov[n].iov_base = (char *)it->data + it->done;
        iov[n].iov_len = it->len - it->done;
        offered += iov[n++].iov_len;
      }
    }
    if (n == 0) return;
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)n;
    ssize_t w = sendmsg(o->fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOTCONN) return;
      tcp_peer_failed(t, peer, ENG_TCP_ERR_PEER_DEAD, errno);
      return;
    }
    size_t left = (size_t)w;
    if (o->hello_done < ENG_TCP_HELLO) {
      size_t k = ENG_TCP_HELLO - o->hello_done;
      if (k > left) k = left;
      o->hello_done += k;
      left -= k;
    }
    while (o->head != NULL) {
      tcp_item *it = o->head;
      size_t k = ENG_TCP_HDR - it->hdr_done;
      if (k > left) k = left;
      it->hdr_done += k;
      left -= k;
      k = it->len - it->done;
      if (k > left) k = left;
      it->done += k;
      left -= k;
      if (it->hdr_done < ENG_TCP_HDR || it->done < it->len) break;
      o->head = it->next;
      if (o->head == NULL) o->tail = NULL;
      tcp_item_done(t, it);
    }
    if ((size_t)w < offered) return;   /* the socket is full */
  }
}

/* Opens the connections to peer (nstreams of them), without waiting for them. */
static int tcp_start_connect(eng_tcp *t, int peer) {
  tcp_peer *p = &t->peers[peer];
  if (p->nout) return 0;
  if (!p->has_addr) return EINVAL;
  for (int s = 0; s < t->nstreams; s++) {
    tcp_out *o = &p->out[s];
    int fd = socket(p->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return errno;
    tcp_sockopts(fd);
    o->fd = fd;
    o->hello.magic = ENG_TCP_MAGIC;
    o->hello.version = ENG_TCP_VERSION;
    o->hello.hdr = ENG_TCP_HDR;
    memcpy(o->hello.token, t->token, 16);
    o->hello.from = (uint32_t)t->rank;
    o->hello.to = (uint32_t)peer;
    o->hello.channel = (uint32_t)t->channel;
    o->hello.stream = (uint32_t)s;
    o->hello.nstreams = (uint32_t)t->nstreams;
    o->hello.size = (uint32_t)t->size;
    o->hello_done = 0;
    p->nout = s + 1;
    if (connect(fd, (struct sockaddr *)&p->addr, p->addrlen) != 0) {
      if (errno != EINPROGRESS && errno != EINTR) return errno;
      o->connecting = 1;
    }
  }
  return 0;
}

/* ---- failure ---- */

static int tcp_corrupt(eng_tcp *t, int peer) {
  tcp_peer_failed(t, peer, ENG_TCP_ERR_CORRUPT, 0);
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

/* peer failed (code, errno): every request involving it ends with that error. */
static void tcp_peer_failed(eng_tcp *t, int peer, int code, int err) {
  tcp_peer *p = &t->peers[peer];
  if (p->dead) return;
  p->dead = code;
  p->dead_errno = err;
  if (t->dead_peer < 0 && code != ENG_TCP_ERR_PEER_LEFT) {
    t->dead_peer = peer;
    t->dead_code = code;
  }
  tcp_close_peer(t, p);
  /* sends to it */
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
  tcp_wake(t);
}

/* A closing peer whose every incoming stream has reached its end has nothing more to give. */
static void tcp_check_closing(eng_tcp *t, int peer) {
  tcp_peer *p = &t->peers[peer];
  if (!p->closing || p->dead) return;
  for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++)
    if (p->in[s].fd >= 0) return;
  tcp_peer_failed(t, peer, tcp_end_code(p), 0);
}

/* ---- accepting ---- */

static void tcp_drop_pending(eng_tcp *t, int i, int rejected) {
  close(t->pending[i].fd);
  t->pending[i] = t->pending[--t->npending];
  t->rejected += rejected;
}

static void tcp_accept(eng_tcp *t) {
  for (;;) {
    int fd = accept4(t->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) t->sys_errno = errno;
      return;
    }
    if (t->npending >= ENG_TCP_MAX_PENDING) {
      close(fd);
      t->rejected++;
      continue;
    }
    tcp_sockopts(fd);
    tcp_pending *q = &t->pending[t->npending++];
    q->fd = fd;
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
    if (got < 0) {
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && eng_now() < q->deadline) return 0;
      tcp_drop_pending(t, i, 1);
      return 1;
    }
    if (got == 0) {
      tcp_drop_pending(t, i, 1);
      return 1;
    }
    q->got += (size_t)got;
    if (q->got == ENG_TCP_HELLO) break;
  }
  tcp_hello h;
  memcpy(&h, q->buf, sizeof h);
  int ok = h.magic == ENG_TCP_MAGIC && h.version == ENG_TCP_VERSION && h.hdr == ENG_TCP_HDR &&
           tcp_cmp_token(h.token, t->token) && h.to == (uint32_t)t->rank && h.from < (uint32_t)t->size &&
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
  tcp_drop_pending(t, i, 1);
  return 1;
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

/* Fills t->pfd with what to watch; returns the count (or -1: out of memory). */
static int tcp_poll_set(eng_tcp *t, int with_wake) {
  size_t most = 2 + (size_t)t->npending + (size_t)t->size * 2 * ENG_TCP_MAX_STREAMS;
  if (tcp_pfd_reserve(t, most)) return -1;
  int n = 0;
  t->pfd[n].fd = t->listen_fd;
  t->pfd[n].events = POLLIN;
  t->pwhat[n++] = PF_LISTEN << 24;
  if (with_wake) {
    t->pfd[n].fd = t->wake_fd;
    t->pfd[n].events = POLLIN;
    t->pwhat[n++] = PF_WAKE << 24;
  }
  for (int i = 0; i < t->npending; i++) {
    t->pfd[n].fd = t->pending[i].fd;
    t->pfd[n].events = POLLIN;
    t->pwhat[n++] = PF_PENDING << 24 | i;
  }
  for (int q = 0; q < t->size; q++) {
    tcp_peer *p = &t->peers[q];
    if (p->dead) continue;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
      tcp_instream *in = &p->in[s];
      if (in->fd >= 0) {
        /* A stream whose message waits for a receive is not read (nor watched: it would wake at once). */
        t->pfd[n].fd = in->fd;
        t->pfd[n].events = (in->state == IN_HELD || in->state == IN_WAIT) ? 0 : POLLIN;
        t->pwhat[n++] = PF_IN << 24 | q << 4 | s;
      }
      tcp_out *o = &p->out[s];
      if (o->fd >= 0) {
        /* POLLIN on a sending socket: the peer closed it (it never writes to it). */
        t->pfd[n].fd = o->fd;
        t->pfd[n].events = POLLIN | ((o->connecting || o->head != NULL || o->hello_done < ENG_TCP_HELLO) ? POLLOUT : 0);
        t->pwhat[n++] = PF_OUT << 24 | q << 4 | s;
      }
    }
  }
  return n;
}

/* Readable: a sending socket carries nothing back but the peer's goodbye, then its end. */
static void tcp_out_closed(eng_tcp *t, int peer, int s) {
  tcp_peer *p = &t->peers[peer];
  tcp_out *o = &p->out[s];
  char extra;
  int full = o->back_got == ENG_TCP_HDR;
  if (o->fd < 0) return;   /* closed earlier in this round, with the peer's other streams */
  ssize_t got = full ? recv(o->fd, &extra, 1, MSG_DONTWAIT)
                     : recv(o->fd, o->back + o->back_got, ENG_TCP_HDR - o->back_got, MSG_DONTWAIT);
  if (got == 0) {
    /* It will read nothing more: what is queued for it can't go; what it sent is still read. */
    int queued = 0;
    for (int k = 0; k < p->nout; k++) queued |= p->out[k].head != NULL;
    p->closing = 1;
    if (queued || (o->back_got && !full)) {
      tcp_peer_failed(t, peer, queued ? tcp_end_code(p) : ENG_TCP_ERR_PEER_DEAD, 0);
      return;
    }
    for (int k = 0; k < p->nout; k++) {
      if (p->out[k].fd >= 0) close(p->out[k].fd);
      p->out[k].fd = -1;
    }
  } else if (got > 0) {
    tcp_hdr h;
    if (full) {
      tcp_corrupt(t, peer);
      return;
    }
    o->back_got += (size_t)got;
    if (o->back_got < ENG_TCP_HDR) return;
    memcpy(&h, o->back, sizeof h);
    if (h.kind != ENG_TCP_BYE || h.a || h.b) tcp_corrupt(t, peer);
    else p->departed = 1;
  } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ENOTCONN) {
    tcp_peer_failed(t, peer, o->connecting ? ENG_TCP_ERR_CONNECT : ENG_TCP_ERR_PEER_DEAD, errno);
  }
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
  /* connections still proving themselves (pending entries move: walk by index) */
  for (int i = 0; i < t->npending;)
    if (!tcp_hello_progress(t, i)) i++;
  /* messages waiting for a receive (a receive may have been posted since), closing peers */
  for (int q = 0; q < t->size; q++) {
    tcp_peer *p = &t->peers[q];
    if (p->dead) continue;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++)
      if (p->in[s].fd >= 0 && (p->in[s].state == IN_HELD || p->in[s].state == IN_WAIT)) tcp_in_progress(t, q, &p->in[s]);
    if (p->closing) tcp_check_closing(t, q);
  }
}

/* ---- the interface ---- */

static void eng_tcp_free(eng_tcp *t);

/* A channel of rank `rank` of `size`, listening on listen_fd (taken over). NULL: out of memory. */
static eng_tcp *eng_tcp_new(int rank, int size, int channel, int nstreams, int fail_any, size_t split_min,
                            size_t eager_max, const unsigned char *token, int listen_fd) {
  eng_tcp *t = (eng_tcp *)calloc(1, sizeof(eng_tcp));
  if (t == NULL) return NULL;
  t->rank = rank;
  t->size = size;
  t->channel = channel;
  t->nstreams = nstreams < 1 ? 1 : nstreams > ENG_TCP_MAX_STREAMS ? ENG_TCP_MAX_STREAMS : nstreams;
  t->fail_any = fail_any;
  t->split_min = split_min;
  t->eager_max = eager_max;
  memcpy(t->token, token, 16);
  t->listen_fd = listen_fd;
  t->dead_peer = -1;
  t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  pthread_mutex_init(&t->lock, NULL);
  t->peers = (tcp_peer *)calloc((size_t)size, sizeof(tcp_peer));
  t->sink = (char *)malloc(ENG_TCP_SINK);
  if (t->peers == NULL || t->sink == NULL || t->wake_fd < 0) {
    eng_tcp_free(t);
    return NULL;
  }
  for (int q = 0; q < size; q++)
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
      t->peers[q].out[s].fd = -1;
      t->peers[q].in[s].fd = -1;
    }
  return t;
}

/* This rank leaves: a BYE header on every connection whose stream is between frames, then every
 * connection closed, and what was still under way fails (the group is gone). The peers then fail
 * only what involves this rank, not everything (fail_any), as they would for a crash. */
static void eng_tcp_goodbye(eng_tcp *t) {
  tcp_hdr bye;
  if (t == NULL || t->peers == NULL) return;
  pthread_mutex_lock(&t->lock);
  if (t->said_bye) {
    pthread_mutex_unlock(&t->lock);
    return;
  }
  t->said_bye = 1;
  tcp_hdr_set(&bye, ENG_TCP_BYE, 0, 0, 0, 0);
  for (int q = 0; q < t->size; q++) {
    tcp_peer *p = &t->peers[q];
    if (q == t->rank || p->dead) continue;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
      tcp_out *o = &p->out[s];
      if (o->fd >= 0 && !o->connecting && o->hello_done == ENG_TCP_HELLO && o->head == NULL)
        (void)!send(o->fd, &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (p->in[s].fd >= 0) (void)!send(p->in[s].fd, &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    tcp_peer_failed(t, q, ENG_TCP_ERR_PEER_LEFT, 0);
  }
  for (int i = 0; i < t->npending; i++) close(t->pending[i].fd);
  t->npending = 0;
  pthread_mutex_unlock(&t->lock);
}

static void eng_tcp_free(eng_tcp *t) {
  if (t == NULL) return;
  eng_tcp_goodbye(t);
  if (t->peers != NULL) {
    for (int q = 0; q < t->size; q++) {
      tcp_peer *p = &t->peers[q];
      tcp_close_peer(t, p);
      for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
        free(p->in[s].stage);
        tcp_item *it = p->out[s].head;
        while (it != NULL) {      /* only orphans are left (live requests hold the transport) */
          tcp_item *next = it->next;
          tcp_req *r = it->req;
          free(it->owned);
          free(it);
          if (r != NULL && --r->items == 0 && r->orphan) free(r);
          it = next;
        }
      }
      while (p->arriving != NULL) {
        tcp_in *m = p->arriving;
        p->arriving = m->pnext;
        if (!m->owns) free(m);    /* unexpected ones are freed below */
      }
    }
    free(t->peers);
  }
  while (t->unexp_head != NULL) {
    tcp_in *m = t->unexp_head;
    t->unexp_head = m->next;
    free(m->buf);
    free(m);
  }
  for (int i = 0; i < t->npending; i++) close(t->pending[i].fd);
  if (t->listen_fd >= 0) close(t->listen_fd);
  if (t->wake_fd >= 0) close(t->wake_fd);
  free(t->pfd);
  free(t->pwhat);
  free(t->sink);
  pthread_mutex_destroy(&t->lock);
  free(t);
}

/* Where peer listens: a numeric address (IPv4 or IPv6, "%scope" allowed) and a port. 0 or an EAI_* code. */
static int eng_tcp_set_peer(eng_tcp *t, int peer, const char *host, int port) {
  struct addrinfo hints, *res = NULL;
  char service[16];
  memset(&hints, 0, sizeof hints);
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  snprintf(service, sizeof service, "%d", port);
  int rc = getaddrinfo(host, service, &hints, &res);
  if (rc != 0) return rc;
  memcpy(&t->peers[peer].addr, res->ai_addr, res->ai_addrlen);
  t->peers[peer].addrlen = (socklen_t)res->ai_addrlen;
  t->peers[peer].has_addr = 1;
  freeaddrinfo(res);
  return 0;
}

/* A listening socket on host (numeric) and an ephemeral port. Returns 0 or an errno / EAI code (< 0). */
static int eng_tcp_listen(const char *host, int *fd_out, int *port_out) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  int rc = getaddrinfo(host, "0", &hints, &res);
  if (rc != 0) return rc < 0 ? rc : -rc;
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    rc = errno;
    freeaddrinfo(res);
    return rc;
  }
  if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
    rc = errno;
    close(fd);
    freeaddrinfo(res);
    return rc;
  }
  freeaddrinfo(res);
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) {
    rc = errno;
    close(fd);
    return rc;
  }
  *port_out = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
  *fd_out = fd;
  return 0;
}

/* Every interface address: "name family address\n" lines into out (at most cap bytes, NUL-terminated). */
static int eng_tcp_interfaces(char *out, size_t cap) {
  struct ifaddrs *all = NULL;
  size_t used = 0;
  if (cap == 0) return EINVAL;
  out[0] = 0;
  if (getifaddrs(&all) != 0) return errno;
  for (struct ifaddrs *a = all; a != NULL; a = a->ifa_next) {
    char addr[INET6_ADDRSTRLEN] = "";
    int fam;
    if (a->ifa_addr == NULL || !(a->ifa_flags & IFF_UP)) continue;
    fam = a->ifa_addr->sa_family;
    if (fam == AF_INET) inet_ntop(fam, &((struct sockaddr_in *)a->ifa_addr)->sin_addr, addr, sizeof addr);
    else if (fam == AF_INET6) inet_ntop(fam, &((struct sockaddr_in6 *)a->ifa_addr)->sin6_addr, addr, sizeof addr);
    else continue;
    int w = snprintf(out + used, cap - used, "%s %d %s\n", a->ifa_name, fam == AF_INET ? 4 : 6, addr);
    if (w < 0 || (size_t)w >= cap - used) break;
    used += (size_t)w;
  }
  freeifaddrs(all);
  return 0;
}

static void tcp_queue(tcp_out *o, tcp_item *it) {
  it->next = NULL;
  if (o->tail == NULL) o->head = it;
  else o->tail->next = it;
  o->tail = it;
}

/* A message to this rank itself: matched (or kept) at once. Called with the lock held. */
static int tcp_self_send(eng_tcp *t, const void *buf, size_t n, int tag) {
  tcp_req *r = tcp_match_posted(t, t->rank, tag);
  if (r != NULL) {
    r->src = t->rank;
    r->rtag = tag;
    r->nbytes = n;
    if (n > r->len) tcp_finish_req(t, r, ENG_TCP_ERR_TRUNCATE, t->rank);
    else {
      if (n) memcpy(r->buf, buf, n);
      tcp_finish_req(t, r, 0, -1);
    }
    return 0;
  }
  tcp_in *m = (tcp_in *)calloc(1, sizeof(tcp_in));
  if (m == NULL) return ENG_TCP_ERR_NOMEM;
  m->buf = (char *)malloc(n ? n : 1);
  if (m->buf == NULL) {
    free(m);
    return ENG_TCP_ERR_NOMEM;
  }
  if (n) memcpy(m->buf, buf, n);
  m->owns = 1;
  m->complete = 1;
  m->peer = t->rank;
  m->tag = tag;
  m->total = m->arrived = n;
  if (t->unexp_tail == NULL) t->unexp_head = m;
  else t->unexp_tail->next = m;
  t->unexp_tail = m;
  return 0;
}

/* A posted send or receive, nothing moved yet; NULL when out of memory. */
static tcp_req *tcp_new_req(int kind, const void *buf, size_t n, int peer, int tag) {
  tcp_req *r = (tcp_req *)calloc(1, sizeof(tcp_req));
  if (r == NULL) return NULL;
  r->kind = kind;
  r->peer = peer;
  r->tag = tag;
  r->buf = (char *)buf;
  r->len = n;
  r->err_peer = -1;
  return r;
}

/* Posts a send; *out is the request (NULL when it failed). Returns 0 or an error code (*err_peer set). */
static int eng_tcp_isend(eng_tcp *t, const void *buf, size_t n, int peer, int tag, tcp_req **out, int *err_peer) {
  *out = NULL;
  *err_peer = peer;
  tcp_req *r = tcp_new_req(TCP_SEND, buf, n, peer, tag);
  if (r == NULL) return ENG_TCP_ERR_NOMEM;
  pthread_mutex_lock(&t->lock);
  tcp_peer *p = &t->peers[peer];
  int rc = 0;
  if (peer == t->rank) {
    rc = tcp_self_send(t, buf, n, tag);
    r->state = TCP_DONE;
    goto out;
  }
  if (p->dead || p->closing || t->said_bye) {
    rc = t->said_bye ? ENG_TCP_ERR_PEER_LEFT : tcp_end_code(p);
    goto out;
  }
  rc = tcp_start_connect(t, peer);
  if (rc) {
    tcp_peer_failed(t, peer, ENG_TCP_ERR_CONNECT, rc);
    rc = ENG_TCP_ERR_CONNECT;
    goto out;
  }
  {
    int parts = (n >= t->split_min && t->nstreams > 1) ? t->nstreams : 1;
    size_t step = parts > 1 ? (n / (size_t)parts + ENG_TCP_PART_ALIGN - 1) / ENG_TCP_PART_ALIGN * ENG_TCP_PART_ALIGN : n;
    uint64_t seq = p->send_seq++;
    tcp_item *items[ENG_TCP_MAX_STREAMS];
    int k = 0;
    for (int s = 0; s < parts; s++) {
      size_t off = (size_t)s * step;
      if (s > 0 && off >= n) break;
      size_t len = s == parts - 1 || off + step > n ? n - off : step;
      tcp_item *it = (tcp_item *)calloc(1, sizeof(tcp_item));
      if (it == NULL) {
        for (int j = 0; j < k; j++) free(items[j]);
        p->send_seq--;
        rc = ENG_TCP_ERR_NOMEM;
        goto out;
      }
      if (s == 0) tcp_hdr_set(&it->hdr, ENG_TCP_MSG, tag, seq, n, len);
      else tcp_hdr_set(&it->hdr, ENG_TCP_PART, tag, seq, off, len);
      it->data = (const char *)buf + off;
      it->len = len;
      it->req = r;
      items[k++] = it;
    }
    r->items = (size_t)k;
    r->state = TCP_ACTIVE;
    for (int j = 0; j < k; j++) tcp_queue(&p->out[j], items[j]);
    for (int j = 0; j < k; j++) tcp_out_progress(t, peer, j);   /* a small message is usually out now */
  }
out:
  if (rc) {
    pthread_mutex_unlock(&t->lock);
    free(r);
    return rc;
  }
  *out = r;
  pthread_mutex_unlock(&t->lock);
  return 0;
}

/* Posts a receive (peer or tag -1: any). */
static int eng_tcp_irecv(eng_tcp *t, void *buf, size_t n, int peer, int tag, tcp_req **out, int *err_peer) {
  *out = NULL;
  *err_peer = peer;
  tcp_req *r = tcp_new_req(TCP_RECV, buf, n, peer, tag);
  if (r == NULL) return ENG_TCP_ERR_NOMEM;
  pthread_mutex_lock(&t->lock);
  tcp_in *m = t->unexp_head;
  while (m != NULL && !((peer < 0 || peer == m->peer) && (tag < 0 || tag == m->tag))) m = m->next;
  if (m != NULL) {
    tcp_unlink_unexpected(t, m);
    tcp_bind(t, r, m);
  } else if ((peer >= 0 && t->peers[peer].dead) || t->said_bye) {
    int rc = t->said_bye ? ENG_TCP_ERR_PEER_LEFT : t->peers[peer].dead;
    pthread_mutex_unlock(&t->lock);
    free(r);
    return rc;
  } else {
    r->next = NULL;
    if (t->posted_tail == NULL) t->posted_head = r;
    else t->posted_tail->next = r;
    t->posted_tail = r;
    /* Waiting on a peer not yet connected: connect to it, so its end is noticed if it dies. */
    if (peer >= 0 && peer != t->rank && !t->peers[peer].nout && t->peers[peer].has_addr) {
      int rc = tcp_start_connect(t, peer);
      if (rc) tcp_peer_failed(t, peer, ENG_TCP_ERR_CONNECT, rc);
    }
  }
  *out = r;
  pthread_mutex_unlock(&t->lock);
  return 0;
}

/* Progress, then whether r is done; a done request is freed and its status and error returned. */
static int eng_tcp_test(eng_tcp *t, tcp_req *r, int *done, int *src, int *tag, size_t *nbytes, int *err_peer) {
  int rc = 0;
  pthread_mutex_lock(&t->lock);
  tcp_progress(t);
  *done = r->state == TCP_DONE;
  if (*done) {
    if (src != NULL) {
      *src = r->src;
      *tag = r->rtag;
      *nbytes = r->nbytes;
    }
    rc = r->err;
    *err_peer = r->err_peer;
    free(r);
  } else if (t->fail_any && t->dead_peer >= 0) {
    rc = t->dead_code;
    *err_peer = t->dead_peer;
  } else if (t->sys_errno == ENOMEM) {
    rc = ENG_TCP_ERR_NOMEM;
    *err_peer = -1;
  }
  pthread_mutex_unlock(&t->lock);
  return rc;
}

/* Sleeps in poll until something happens on the channel, another thread completes a request, or
 * `seconds` pass; not at all if a request completed since `gen` (t->gen) was read. */
static void eng_tcp_sleep(eng_tcp *t, uint32_t gen, double seconds) {
  pthread_mutex_lock(&t->lock);
  if (t->gen != gen) {
    pthread_mutex_unlock(&t->lock);
    return;
  }
  int n = tcp_poll_set(t, 1);
  struct pollfd *mine = n > 0 ? (struct pollfd *)malloc((size_t)n * sizeof *mine) : NULL;
  if (mine == NULL) {
    pthread_mutex_unlock(&t->lock);
    eng_sleep(seconds < 1e-3 ? seconds : 1e-3);
    return;
  }
  memcpy(mine, t->pfd, (size_t)n * sizeof *mine);
  t->sleepers++;
  pthread_mutex_unlock(&t->lock);
  struct timespec ts;
  ts.tv_sec = (time_t)seconds;
  ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
  ppoll(mine, (nfds_t)n, &ts, NULL);
  free(mine);
  pthread_mutex_lock(&t->lock);
  t->sleepers--;
  uint64_t drain;
  if (read(t->wake_fd, &drain, sizeof drain) < 0) drain = 0;
  pthread_mutex_unlock(&t->lock);
}

/* Cancels r: afterwards the transport no longer touches its buffer. A send partly written keeps going
 * from a copy of its rest (the peer's stream stays in step); where that copy can't be made, the peer's
 * connections are closed instead (its requests fail: the collective that cancelled has failed anyway). */
static int eng_tcp_cancel(eng_tcp *t, tcp_req *r) {
  int kept = 0;
  pthread_mutex_lock(&t->lock);
  if (r->state == TCP_DONE) {
    free(r);
  } else if (r->kind == TCP_RECV) {
    if (r->state == TCP_QUEUED) tcp_unlink_posted(t, r);
    else if (r->in != NULL) {
      r->in->req = NULL;
      r->in->buf = NULL;          /* the rest of its bytes are read and dropped */
    }
    free(r);
  } else {
    tcp_peer *p = &t->peers[r->peer];
    int started = 0;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++)
      for (tcp_item *it = p->out[s].head; it != NULL; it = it->next)
        if (it->req == r && (it->hdr_done || it->done)) started = 1;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
      tcp_item *prev = NULL, *it = p->out[s].head;
      while (it != NULL) {
        tcp_item *next = it->next;
        if (it->req == r) {
          if (!started) {          /* nothing of it went out: withdraw it (its number is skipped) */
            if (prev == NULL) p->out[s].head = next;
            else prev->next = next;
            if (p->out[s].tail == it) p->out[s].tail = prev;
            free(it);
            it = next;
            continue;
          }
          if (it->owned == NULL && it->done < it->len) {
            char *rest = (char *)malloc(it->len - it->done);
            if (rest == NULL) kept = 1;
            else {
              memcpy(rest, it->data + it->done, it->len - it->done);
              it->owned = rest;
              it->data = rest - it->done;
            }
          }
        }
        prev = it;
        it = next;
      }
    }
    if (kept) {
      tcp_peer_failed(t, r->peer, ENG_TCP_ERR_NOMEM, ENOMEM);   /* drops every item of it, r's included */
      kept = 0;
    }
    if (started) {
      r->orphan = 1;
      if (r->state == TCP_DONE || r->items == 0) free(r);
    } else {
      free(r);
    }
  }
  pthread_mutex_unlock(&t->lock);
  return kept;
}

/* The peers this channel's unfinished requests wait on (a receive posted for one of them or taking its
 * message, a send not yet written whole to it), at most cap, into peers[], with how long each has been
 * silent in silent[] (seconds since bytes last came from it; -1: none ever did). Returns how many.
 * What a timeout reports, where the peers' own word (the store) may be out of reach. */
static int eng_tcp_waiting_on(eng_tcp *t, int *peers, double *silent, int cap) {
  int n = 0;
  double now = eng_now();
  pthread_mutex_lock(&t->lock);
  for (int q = 0; q < t->size && n < cap; q++) {
    tcp_peer *p = &t->peers[q];
    int waits = 0;
    if (q == t->rank) continue;
    for (tcp_req *r = t->posted_head; r != NULL && !waits; r = r->next) waits = r->peer == q;
    for (tcp_in *m = p->arriving; m != NULL && !waits; m = m->pnext) waits = m->req != NULL;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS && !waits; s++) waits = p->out[s].head != NULL;
    if (!waits) continue;
    peers[n] = q;
    silent[n++] = p->heard > 0 ? now - p->heard : -1;
  }
  pthread_mutex_unlock(&t->lock);
  return n;
}

/* Why peer failed: the errno of its connection's end (0: it closed it, or none). */
static int eng_tcp_peer_errno(eng_tcp *t, int peer) { return t->peers[peer].dead_errno; }

/* Whether peer said goodbye (it left the group in order). */
static int eng_tcp_departed(eng_tcp *t, int peer) { return t->peers[peer].departed; }

/* Starts every connection of this rank (the mesh: made when the group is). */
static int eng_tcp_connect_all(eng_tcp *t) {
  int rc = 0;
  pthread_mutex_lock(&t->lock);
  for (int q = 0; q < t->size && !rc; q++)
    if (q != t->rank && !t->peers[q].dead) {
      rc = tcp_start_connect(t, q);
      if (rc) tcp_peer_failed(t, q, ENG_TCP_ERR_CONNECT, rc);
    }
  pthread_mutex_unlock(&t->lock);
  return rc;
}

/* Progress; the first peer not yet connected both ways (-1: every one is), or a failed peer's code in *code. */
static int eng_tcp_mesh_missing(eng_tcp *t, int *code) {
  int missing = -1;
  pthread_mutex_lock(&t->lock);
  tcp_progress(t);
  *code = 0;
  for (int q = 0; q < t->size && missing < 0; q++) {
    tcp_peer *p = &t->peers[q];
    if (q == t->rank) continue;
    if (p->dead) {
      *code = p->dead;
      missing = q;
      break;
    }
    int ok = p->nin > 0 && p->nout == t->nstreams;
    for (int s = 0; ok && s < p->nout; s++) ok = !p->out[s].connecting && p->out[s].hello_done == ENG_TCP_HELLO;
    for (int s = 0; ok && s < p->nin; s++) ok = p->in[s].fd >= 0;
    if (!ok) missing = q;
  }
  pthread_mutex_unlock(&t->lock);
  return missing;
}

#endif
