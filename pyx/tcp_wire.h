/* The TCP transport's wire format (frames, the hello), its limits, its types and small helpers (pyx/tcp.h). */
#ifndef ENGINE_TCP_WIRE_H
#define ENGINE_TCP_WIRE_H

#include "shm.h"
#include "errors.h"
#include "call_tags.h"

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
#define ENG_TCP_VERSION 3
#define ENG_TCP_BACK (ENG_TCP_HDR + 16)     /* a goodbye written back on a connection the peer made, and its proof */
#define ENG_TCP_MAX_STREAMS 16
#define ENG_TCP_MAX_RANKS ((1 << 20) - 1)  /* the poll table's events name a rank in 20 bits */
#define ENG_TCP_STAGE (64u << 10)            /* staging buffer of each incoming stream */
#define ENG_TCP_SINK (256u << 10)            /* where discarded bytes are read to */
#define ENG_TCP_MAX_MESSAGE (1ULL << 48)
#define ENG_TCP_MAX_PENDING 64              /* connections not yet through their hello */
#define ENG_TCP_HELLO_SECONDS 30.0          /* how long one may take to send it */
#define ENG_TCP_FULL_GRACE 2.0              /* with the table full, one owing its hello this long makes room */
#define ENG_TCP_MAX_REDIALS 8               /* a stream's connections dropped before its hello, made again */
#define ENG_TCP_IOV 64
#define ENG_TCP_PART_ALIGN 4096

/* The bytes of each part of an n-byte message split over `parts` streams, the last taking the rest (0: too
 * few bytes to split, one frame carries them). The sender splits by it and the receiver checks the
 * first frame against it: a first part of any other length would have the receiver buffer the whole
 * message for a few bytes sent. */
static inline uint64_t tcp_part_step(uint64_t n, int parts) {
  return parts > 1 ? (n / (uint64_t)parts + ENG_TCP_PART_ALIGN - 1) / ENG_TCP_PART_ALIGN * ENG_TCP_PART_ALIGN : n;
}



enum { ENG_TCP_MSG = 0x2147534d, ENG_TCP_PART = 0x54524150, ENG_TCP_BYE = 0x21455942 };  /* "MSG!", "PART", "BYE!" */
/* A goodbye's kind (its header's a) is a peer's tcp_peer.departed less 1: it left in order (TCP_LEFT), its
 * group broke there (TCP_LEFT_BROKEN: a call failed there or it aborted the group), or its call timed
 * out there (TCP_LEFT_TIMED_OUT: it saw no failure, only a rank that did not come). */
enum { TCP_LEFT = 1, TCP_LEFT_BROKEN = 2, TCP_LEFT_TIMED_OUT = 3 };
enum { TCP_SEND = 1, TCP_RECV = 2 };
enum { TCP_QUEUED = 0, TCP_ACTIVE = 1, TCP_DONE = 2 };
enum { IN_HDR = 0, IN_BODY = 1, IN_HELD = 2, IN_WAIT = 3 };
enum { PF_LISTEN = 1, PF_WAKE = 2, PF_PENDING = 3, PF_IN = 4, PF_OUT = 5 };

typedef struct {
  uint32_t kind;
  int32_t tag;
  uint64_t seq;
  uint64_t a;     /* MSG: the message's bytes; PART: the offset */
  uint64_t b;     /* payload bytes that follow this header; BYE: tcp_peer.bye_ended */
} tcp_hdr;

/* A goodbye header, of one of the three kinds (only where the group broke, b counts calls). */
static inline int tcp_bye_ok(const tcp_hdr *h) {
  return h->kind == ENG_TCP_BYE && h->a <= TCP_LEFT_TIMED_OUT - 1 && (!h->b || h->a == TCP_LEFT_BROKEN - 1);
}

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
  size_t frames;            /* send: its frames (one per stream it was split over) */
  tcp_in *in;               /* receive: the message arriving into it */
  int src, rtag;            /* receive: its status */
  size_t nbytes;
  tcp_req *next;            /* posted receives, in post order */
};

struct tcp_in {
  int peer, tag;
  uint64_t seq;
  size_t total, arrived;
  size_t claimed;           /* bytes its MSG and PART headers so far said they carry (<= total) */
  size_t step;              /* its MSG's own bytes: stream s's part begins at s * step (the sender's split) */
  uint32_t parts;           /* the streams whose frame of it has come (bit s) */
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
  unsigned char back[ENG_TCP_BACK]; /* what the peer wrote back: its goodbye and proof, or nothing */
  size_t back_got;
  int redials;              /* connections made again after the peer dropped one before its hello */
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
  int departed;             /* it said goodbye (TCP_LEFT*): its end fails only what involves it, or, where its
                               group broke (TCP_LEFT_BROKEN), everything on a fail_any channel */
  int bye_lost;             /* the rank its goodbye said it lost (its process, or link, gone) + 1, or 0 */
  int bye_first;            /* the rank whose giving up its goodbye said it followed (an abort there) + 1, or 0 */
  uint64_t bye_ended;       /* where it gave the group up between calls: the calls it had begun (all ended) + 1;
                               0: within one, or not broken (tcp_ended_there) */
  int dead;                 /* an ENG_ERR_* code once it failed */
  int dead_errno;
  double heard;             /* when bytes last came from it (its hello included); 0: never */
} tcp_peer;

typedef struct {
  int fd;
  int ready;                 /* readable when last polled (or just accepted): its hello is read then */
  double deadline;
  size_t got;
  unsigned char buf[ENG_TCP_HELLO];
} tcp_pending;

typedef struct eng_tcp {
  int rank, size, channel, nstreams, fail_any, ordered;
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
  uint32_t wakes;           /* eventfd writes so far; a sleeper notes it when it lies down */
  int unwoken;              /* sleepers the last write must still wake: the eventfd is drained at 0 */
  uint64_t moved;           /* reads and writes that carried bytes: whether a nudge moved anything */
  struct pollfd *pfd;
  int *pwhat;               /* per pollfd: kind << 24 | peer << 4 | stream (or a pending index) */
  size_t pcap;
  char *sink;
  int dead_peer, dead_code; /* the first peer that failed */
  int call;                 /* ordered: the running call's tag base (call_tags.h), 0 for none */
  uint64_t calls;           /* the calls begun here (eng_tcp_set_call): every rank numbers them alike */
  int other_peer;           /* ordered: the first peer seen in another collective, or -1 */
  int rejected;             /* connections closed before or at their hello */
  int said_bye;             /* eng_tcp_goodbye ran: every connection is closed */
  int sys_errno;            /* the last system error outside any peer */
  int whole_size;           /* the ranks of the group whose numbering a goodbye's lost rank uses: a stage of a */
  int *whole;               /* hierarchy's, the group it serves (whole[q]: rank q's there); NULL: this one's */
  struct eng_tcp *next_live, *prev_live;  /* every live channel of the process, for a fork (tcp.h) */
  int live;
} eng_tcp;

/* A goodbye read from peer p (checked: tcp_bye_ok): how it left, the rank it lost where it names one
 * (its header's seq: that rank + 1, in the whole group's numbering, bounds-checked; anything else
 * names none), and the rank that gave the group up before it, where it names one (its tag, alike). */
static inline void tcp_bye_read(const eng_tcp *t, tcp_peer *p, const tcp_hdr *h) {
  p->departed = 1 + (int)h->a;
  p->bye_lost = h->seq >= 1 && h->seq <= (uint64_t)t->whole_size ? (int)h->seq : 0;
  p->bye_first = h->tag >= 1 && h->tag <= t->whole_size ? h->tag : 0;
  /* (at most the call running here: a goodbye can't spare a call not begun here, nor claim calls for good) */
  p->bye_ended = h->a != TCP_LEFT_BROKEN - 1 ? 0 : h->b < t->calls + 1 ? h->b : t->calls + 1;
}


/* Rank q of this group in the whole group's numbering (the one a goodbye's lost rank uses). */
static inline int tcp_whole(const eng_tcp *t, int q) { return t->whole != NULL && q >= 0 ? t->whole[q] : q; }


/* Functions one part calls in another (every part includes this file first, so any order works). */
static int tcp_corrupt(eng_tcp *t, int peer);
static void tcp_peer_failed(eng_tcp *t, int peer, int code, int err);
static void tcp_reads_no_more(eng_tcp *t, int peer);
static int tcp_start_connect(eng_tcp *t, int peer);
static void tcp_in_progress(eng_tcp *t, int peer, tcp_instream *in);
static void tcp_out_progress(eng_tcp *t, int peer, int s);
static int tcp_dropped_unproven(eng_tcp *t, tcp_peer *p, tcp_out *o);
static void tcp_redial(eng_tcp *t, int peer, int s);
static void tcp_refused(eng_tcp *t, int peer, int err);
static int tcp_hello_progress(eng_tcp *t, int i);
static void tcp_check_closing(eng_tcp *t, int peer);
static int tcp_end_of(eng_tcp *t, tcp_peer *p, tcp_out *o);
static int tcp_back_bye(eng_tcp *t, tcp_peer *p, const tcp_out *o);

/* ---- small helpers ---- */

static inline void tcp_hdr_set(tcp_hdr *h, uint32_t kind, int tag, uint64_t seq, uint64_t a, uint64_t b) {
  h->kind = kind;
  h->tag = tag;
  h->seq = seq;
  h->a = a;
  h->b = b;
}

/* Whether a failed peer's end fails every request on a fail_any channel: it was lost (its process or link),
 * or its group broke there; not one that only left in order. */
static inline int tcp_fails_all(const tcp_peer *p) {
  return p->dead && (p->dead != ENG_ERR_PEER_LEFT || p->departed == TCP_LEFT_BROKEN);
}

/* Whether error err of a connection to peer p is its end after its goodbye: a peer that left in order
 * with data of ours unread resets its connections instead of closing them. */
static inline int tcp_reset_after_bye(const tcp_peer *p, int err) {
  return p->departed && (err == ECONNRESET || err == EPIPE);
}

/* Whether peer q gave the group up between calls after the call running here had ended there (its
 * goodbye's count): it sent all it owed that call, which still ends here; the next one fails. */
static inline int tcp_ended_there(const eng_tcp *t, int q) {
  const tcp_peer *p = &t->peers[q];
  return p->dead == ENG_ERR_PEER_LEFT && p->departed == TCP_LEFT_BROKEN && p->bye_ended > t->calls;
}

/* The failed peer whose end fails every request on a fail_any channel (one lost, or one whose group
 * broke there): the first that failed, where its end reaches the running call (tcp_ended_there); else
 * another; -1: none. */
static inline int tcp_failing_peer(const eng_tcp *t) {
  if (t->dead_peer < 0 || !tcp_ended_there(t, t->dead_peer)) return t->dead_peer;
  for (int q = 0; q < t->size; q++)
    if (q != t->rank && tcp_fails_all(&t->peers[q]) && !tcp_ended_there(t, q)) return q;
  return -1;
}

/* Whether anything is queued for a peer on its outgoing streams. */
static inline int tcp_queued_for(const tcp_peer *p) {
  int queued = 0;
  for (int k = 0; k < p->nout; k++) queued |= p->out[k].head != NULL;
  return queued;
}

/* Closes a peer's outgoing streams: it reads nothing more (what it sent is still read). */
static inline void tcp_close_outs(tcp_peer *p) {
  for (int k = 0; k < p->nout; k++) {
    if (p->out[k].fd >= 0) close(p->out[k].fd);
    p->out[k].fd = -1;
    p->out[k].connecting = 0;
  }
}

/* Lists linked through ->next with a head and a tail: x appended, or x unlinked (nothing if it is not there). */
#define TCP_PUSH(head, tail, x) \
  do { (x)->next = NULL; if ((tail) == NULL) (head) = (x); else (tail)->next = (x); (tail) = (x); } while (0)
#define TCP_UNLINK(type, head, tail, x) \
  do { \
    type *prev_ = NULL, *at_ = (head); \
    while (at_ != NULL && at_ != (x)) prev_ = at_, at_ = at_->next; \
    if (at_ == NULL) break; \
    if (prev_ == NULL) (head) = (x)->next; \
    else prev_->next = (x)->next; \
    if ((tail) == (x)) (tail) = prev_; \
    (x)->next = NULL; \
  } while (0)

/* ---- proofs of the group's token: neither side of a connection sends the token itself, so whatever
 * listens at a peer's address (a process that took a departed rank's port) learns nothing it can use,
 * and a connection's bytes are parsed only once they proved it. ---- */

/* Whether two proofs are equal, in a time that does not depend on where they differ. */
static inline int tcp_same_proof(const unsigned char *a, const unsigned char *b) {
  unsigned char d = 0;
  for (int i = 0; i < 16; i++) d |= a[i] ^ b[i];
  return d == 0;
}

#define TCP_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define TCP_SIPROUND                                                                      \
  do {                                                                                    \
    v0 += v1; v1 = TCP_ROTL(v1, 13); v1 ^= v0; v0 = TCP_ROTL(v0, 32);                     \
    v2 += v3; v3 = TCP_ROTL(v3, 16); v3 ^= v2;                                            \
    v0 += v3; v3 = TCP_ROTL(v3, 21); v3 ^= v0;                                            \
    v2 += v1; v1 = TCP_ROTL(v1, 17); v1 ^= v2; v2 = TCP_ROTL(v2, 32);                     \
  } while (0)

static inline uint64_t tcp_le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* SipHash-2-4 with its 128-bit output (Aumasson and Bernstein's reference), keyed by the token. */
static void tcp_siphash128(const unsigned char key[16], const void *data, size_t len, unsigned char out[16]) {
  const unsigned char *m = (const unsigned char *)data;
  const uint64_t k0 = tcp_le64(key), k1 = tcp_le64(key + 8);
  uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1 ^ 0xee;
  uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
  size_t off = 0;
  for (; off + 8 <= len; off += 8) {
    const uint64_t w = tcp_le64(m + off);
    v3 ^= w;
    TCP_SIPROUND; TCP_SIPROUND;
    v0 ^= w;
  }
  uint64_t last = (uint64_t)len << 56;
  for (size_t i = 0; off + i < len; i++) last |= (uint64_t)m[off + i] << (8 * i);
  v3 ^= last;
  TCP_SIPROUND; TCP_SIPROUND;
  v0 ^= last;
  v2 ^= 0xee;
  TCP_SIPROUND; TCP_SIPROUND; TCP_SIPROUND; TCP_SIPROUND;
  uint64_t half = v0 ^ v1 ^ v2 ^ v3;
  for (int i = 0; i < 8; i++) out[i] = (unsigned char)(half >> (8 * i));
  v1 ^= 0xdd;
  TCP_SIPROUND; TCP_SIPROUND; TCP_SIPROUND; TCP_SIPROUND;
  half = v0 ^ v1 ^ v2 ^ v3;
  for (int i = 0; i < 8; i++) out[8 + i] = (unsigned char)(half >> (8 * i));
}

/* (the proofs hash these structs' bytes: no padding may be among them) */
_Static_assert(sizeof(tcp_hello) == ENG_TCP_HELLO && sizeof(tcp_hdr) == ENG_TCP_HDR, "wire structs are packed");

/* A hello's proof: its other fields, keyed by the token (it goes where the hello's token field is). */
static inline void tcp_hello_proof(const unsigned char token[16], const tcp_hello *h, unsigned char out[16]) {
  tcp_hello bare = *h;
  memset(bare.token, 0, sizeof bare.token);
  tcp_siphash128(token, &bare, sizeof bare, out);
}

/* A goodbye written back on stream `stream` of channel `channel` that rank `from` accepted from rank
 * `to`: its proof, which follows it (the hello proved the connecting side; this, the accepting one). */
static inline void tcp_back_proof(const unsigned char token[16], const tcp_hdr *bye, uint32_t from, uint32_t to,
                                  uint32_t channel, uint32_t stream, unsigned char out[16]) {
  unsigned char msg[ENG_TCP_HDR + 16];
  const uint32_t who[4] = {from, to, channel, stream};
  memcpy(msg, bye, ENG_TCP_HDR);
  memcpy(msg + ENG_TCP_HDR, who, sizeof who);
  tcp_siphash128(token, msg, sizeof msg, out);
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
    t->wakes++;
    t->unwoken = t->sleepers;   /* (the first to wake must not drain it under the others) */
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

#endif
