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
 * Frames. A 32-byte header, then its payload. MSG opens message `seq` (numbered per sender and
 * receiver) with its tag, its length and the length of the first part, which follows; PART carries
 * bytes [offset, offset + len) of a message already opened, on another stream. MSG headers travel on
 * stream 0 in order, so matching follows MPI's rules: receives match in post order, by source and tag
 * or their wildcards, and messages of one sender are matched in the order it sent them.
 *
 * docs/architecture.md says how connections are trusted, messages read (into the receive's buffer
 * where one waits), progress made and failures reported; docs/hosts.md what a peer's goodbye changes.
 * A channel's requests and sockets are touched only under its mutex; a thread sleeping in poll is
 * woken through an eventfd when another completes its request.
 *
 * Files, one concern each, static functions of one translation unit: tcp_wire.h (frames, limits,
 * types), tcp_match.h (matching), tcp_instream.h and tcp_outstream.h (the two directions of a
 * stream), tcp_accept.h (hellos), tcp_poll.h (progress and failure); this file is the interface
 * pyx/tcp_transport.pxi calls. Error codes come from errors.h, the engine's one list. */
#ifndef ENGINE_TCP_H
#define ENGINE_TCP_H

#include "tcp_poll.h"

/* ---- a fork ----
 * A process forked from this one (a DataLoader's worker, multiprocessing's fork, os.fork) gets a copy
 * of every descriptor and none of the threads. A child's copy of a connection keeps it open after this
 * process dies, so the peers would not see the rank end until the child did; and the child's exit, or
 * its use of the channel, would write into the parent's connections between or inside its frames. So
 * the child closes its copies as it starts, and its copy of every channel refuses every message, as
 * after a goodbye, saying none. The channels' locks are held across the fork, so the child copies each
 * between two updates. */

/* Closes every descriptor of the channel (its peers' connections, pending accepts, the listening socket,
 * the eventfd): in this process only, nothing is said on them. Freeing the channel and a forked child's
 * copy of it both end this way. */
static void tcp_close_descriptors(eng_tcp *t) {
  if (t->peers != NULL)
    for (int q = 0; q < t->size; q++) tcp_close_peer(t, &t->peers[q]);
  for (int i = 0; i < t->npending; i++) close(t->pending[i].fd);
  t->npending = 0;
  if (t->listen_fd >= 0) close(t->listen_fd);
  if (t->wake_fd >= 0) close(t->wake_fd);
  t->listen_fd = t->wake_fd = -1;
}

static pthread_mutex_t tcp_live_lock = PTHREAD_MUTEX_INITIALIZER;
static eng_tcp *tcp_live_head = NULL;

static void tcp_fork_prepare(void) {
  pthread_mutex_lock(&tcp_live_lock);
  for (eng_tcp *t = tcp_live_head; t != NULL; t = t->next_live) pthread_mutex_lock(&t->lock);
}

static void tcp_fork_parent(void) {
  for (eng_tcp *t = tcp_live_head; t != NULL; t = t->next_live) pthread_mutex_unlock(&t->lock);
  pthread_mutex_unlock(&tcp_live_lock);
}

static void tcp_fork_child(void) {
  for (eng_tcp *t = tcp_live_head; t != NULL; t = t->next_live) {
    tcp_close_descriptors(t);
    t->said_bye = 1;
    pthread_mutex_unlock(&t->lock);
  }
  pthread_mutex_unlock(&tcp_live_lock);
}

static void tcp_fork_handlers(void) { (void)pthread_atfork(tcp_fork_prepare, tcp_fork_parent, tcp_fork_child); }

static void tcp_live_add(eng_tcp *t) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, tcp_fork_handlers);
  pthread_mutex_lock(&tcp_live_lock);
  t->next_live = tcp_live_head;
  if (tcp_live_head != NULL) tcp_live_head->prev_live = t;
  tcp_live_head = t;
  t->live = 1;
  pthread_mutex_unlock(&tcp_live_lock);
}

static void tcp_live_remove(eng_tcp *t) {
  if (!t->live) return;
  pthread_mutex_lock(&tcp_live_lock);
  if (t->prev_live != NULL) t->prev_live->next_live = t->next_live;
  else tcp_live_head = t->next_live;
  if (t->next_live != NULL) t->next_live->prev_live = t->prev_live;
  t->live = 0;
  pthread_mutex_unlock(&tcp_live_lock);
}

/* ---- the interface ---- */

static void eng_tcp_free(eng_tcp *t);

/* A channel of rank `rank` of `size`, listening on listen_fd (taken over only when this succeeds).
 * NULL: *err is ENOMEM or eventfd's errno, and listen_fd is still the caller's. */
static eng_tcp *eng_tcp_new(int rank, int size, int channel, int nstreams, int fail_any, int ordered, size_t split_min,
                            size_t eager_max, const unsigned char *token, int listen_fd, int *err) {
  eng_tcp *t = (eng_tcp *)calloc(1, sizeof(eng_tcp));
  *err = ENOMEM;
  if (t == NULL) return NULL;
  t->rank = rank;
  t->size = t->whole_size = size;
  t->channel = channel;
  t->nstreams = nstreams < 1 ? 1 : nstreams > ENG_TCP_MAX_STREAMS ? ENG_TCP_MAX_STREAMS : nstreams;
  t->fail_any = fail_any;
  t->ordered = ordered;
  t->split_min = split_min;
  t->eager_max = eager_max;
  memcpy(t->token, token, 16);
  t->listen_fd = t->wake_fd = -1;   /* so that a failure below closes nothing it did not open */
  t->dead_peer = t->other_peer = -1;
  pthread_mutex_init(&t->lock, NULL);
  t->peers = (tcp_peer *)calloc((size_t)size, sizeof(tcp_peer));
  t->sink = (char *)malloc(ENG_TCP_SINK);
  if (t->peers != NULL)
    for (int q = 0; q < size; q++)
      for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) t->peers[q].out[s].fd = t->peers[q].in[s].fd = -1;
  if (t->peers != NULL && t->sink != NULL) {
    t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    *err = t->wake_fd < 0 ? errno : 0;
  }
  if (*err) {
    eng_tcp_free(t);
    return NULL;
  }
  t->listen_fd = listen_fd;
  tcp_live_add(t);
  return t;
}

/* This rank leaves: a BYE header on every connection whose stream is between frames, then every
 * connection closed, and what was still under way fails (the group is gone). The peers then fail
 * only what involves this rank, not everything (fail_any), as they would for a crash; unless `broken`
 * is TCP_LEFT_BROKEN - 1 (its header's a): the group failed here or was aborted, so no collective of it
 * can end well, and the peers' fail as for a crash (a rank waiting on a third one would wait for the
 * timeout). But where it broke between calls (`between`: a mismatch the ranks' signatures showed, an
 * abort while no call ran), every call this rank began had ended here, having sent all it owed: the
 * goodbye says how many (its b), and a peer still in one of those finishes it, failing from its next
 * (tcp_ended_there). TCP_LEFT_TIMED_OUT - 1: its call timed out here, which tells the peers nothing of
 * their own calls: only what involves this rank fails, and a peer waiting on another comes to its own
 * verdict. */
static void eng_tcp_goodbye(eng_tcp *t, int broken, int lost_rank, int between) {
  tcp_hdr bye;
  if (t == NULL || t->peers == NULL) return;
  pthread_mutex_lock(&t->lock);
  if (t->said_bye) {
    pthread_mutex_unlock(&t->lock);
    return;
  }
  t->said_bye = 1;
  /* Where the group broke over a lost rank (lost_rank: the one whose loss broke it, which another
   * channel of the group may have seen first; else the first peer that failed here: its process or
   * link gone, or a peer's goodbye naming one), the goodbye names it (seq: that rank + 1), so that a
   * peer which hears of the failure from this rank first still names the rank that was lost. A stage
   * of a hierarchy names it in the whole group's numbering (eng_tcp_set_whole): a stage's goodbye
   * then names a rank lost in another stage of that group too. */
  uint64_t lost = 0;
  int me = tcp_whole(t, t->rank), first = 0;
  if (broken == TCP_LEFT_BROKEN - 1 && lost_rank >= 0 && lost_rank < t->whole_size && lost_rank != me)
    lost = (uint64_t)lost_rank + 1;
  else if (broken == TCP_LEFT_BROKEN - 1 && t->dead_peer >= 0)
    lost = t->dead_code == ENG_ERR_PEER_DEAD ? (uint64_t)tcp_whole(t, t->dead_peer) + 1
                                             : (uint64_t)t->peers[t->dead_peer].bye_lost;
  /* Where it broke over a peer's goodbye that lost no rank (that peer aborted the group, or a call
   * failed there), the goodbye names that peer, or the one it followed (tag: that rank + 1): a peer
   * that hears this rank first names the rank that gave the group up first, not this one. */
  if (broken == TCP_LEFT_BROKEN - 1 && !lost && t->dead_peer >= 0 && t->dead_code == ENG_ERR_PEER_LEFT &&
      t->peers[t->dead_peer].departed == TCP_LEFT_BROKEN)
    first = t->peers[t->dead_peer].bye_first ? t->peers[t->dead_peer].bye_first : tcp_whole(t, t->dead_peer) + 1;
  tcp_hdr_set(&bye, ENG_TCP_BYE, first, lost, broken >= 0 && broken < TCP_LEFT_TIMED_OUT ? broken : 0,
              broken == TCP_LEFT_BROKEN - 1 && between ? t->calls + 1 : 0);
  for (int q = 0; q < t->size; q++) {
    tcp_peer *p = &t->peers[q];
    if (q == t->rank || p->dead) continue;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) {
      tcp_out *o = &p->out[s];
      if (o->fd >= 0 && !o->connecting && o->hello_done == ENG_TCP_HELLO && o->head == NULL)
        (void)!send(o->fd, &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (p->in[s].fd >= 0) {   /* (back on a connection the peer made: with its proof) */
        unsigned char back[ENG_TCP_BACK];
        memcpy(back, &bye, ENG_TCP_HDR);
        tcp_back_proof(t->token, &bye, (uint32_t)t->rank, (uint32_t)q, (uint32_t)t->channel, (uint32_t)s,
                       back + ENG_TCP_HDR);
        (void)!send(p->in[s].fd, back, sizeof back, MSG_DONTWAIT | MSG_NOSIGNAL);
      }
    }
    tcp_peer_failed(t, q, ENG_ERR_PEER_LEFT, 0);
  }
  for (int i = 0; i < t->npending; i++) close(t->pending[i].fd);
  t->npending = 0;
  pthread_mutex_unlock(&t->lock);
}

static void eng_tcp_free(eng_tcp *t) {
  if (t == NULL) return;
  /* The goodbye fails every other peer, which empties its queues, and a failed peer's never fill
   * again (it takes no send, nothing of it is read); none are filled for this rank itself. */
  eng_tcp_goodbye(t, 0, -1, 0);
  tcp_live_remove(t);
  tcp_close_descriptors(t);
  if (t->peers != NULL) {
    for (int q = 0; q < t->size; q++)
      for (int s = 0; s < ENG_TCP_MAX_STREAMS; s++) free(t->peers[q].in[s].stage);
    free(t->peers);
  }
  while (t->unexp_head != NULL) {
    tcp_in *m = t->unexp_head;
    t->unexp_head = m->next;
    free(m->buf);
    free(m);
  }
  free(t->pfd);
  free(t->pwhat);
  free(t->sink);
  free(t->whole);
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

/* A message to this rank itself, complete at once: a posted receive copies it from the sender's
 * buffer; otherwise it is kept in a copy, since the send completes now. Called with the lock held. */
static int tcp_self_send(eng_tcp *t, const void *buf, size_t n, int tag) {
  tcp_in *m = (tcp_in *)calloc(1, sizeof(tcp_in));
  if (m == NULL) return ENG_ERR_NOMEM;
  tcp_req *r = tcp_match_posted(t, t->rank, tag);
  m->owns = r == NULL;
  m->buf = m->owns ? (char *)malloc(n ? n : 1) : (char *)buf;
  if (m->owns && m->buf == NULL) {
    free(m);
    return ENG_ERR_NOMEM;
  }
  if (m->owns && n) memcpy(m->buf, buf, n);
  m->complete = 1;
  m->peer = t->rank;
  m->tag = tag;
  m->total = m->arrived = n;
  if (r != NULL) tcp_bind(t, r, m);
  else tcp_push_unexpected(t, m);
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
  if (r == NULL) return ENG_ERR_NOMEM;
  pthread_mutex_lock(&t->lock);
  tcp_peer *p = &t->peers[peer];
  int rc = 0;
  if (peer == t->rank) {
    rc = tcp_self_send(t, buf, n, tag);
    r->state = TCP_DONE;
    goto out;
  }
  if (p->dead || p->closing || t->said_bye) {
    rc = t->said_bye ? ENG_ERR_PEER_LEFT : tcp_end_code(p);
    goto out;
  }
  rc = tcp_start_connect(t, peer);
  if (rc) {
    tcp_peer_failed(t, peer, ENG_ERR_CONNECT, rc);
    rc = ENG_ERR_CONNECT;
    goto out;
  }
  {
    int parts = (n >= t->split_min && t->nstreams > 1) ? t->nstreams : 1;
    size_t step = (size_t)tcp_part_step(n, parts);
    if (step == 0) {   /* (fewer bytes than streams: one frame, as an empty part reads as a malformed stream) */
      parts = 1;
      step = n;
    }
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
        rc = ENG_ERR_NOMEM;
        goto out;
      }
      if (s == 0) tcp_hdr_set(&it->hdr, ENG_TCP_MSG, tag, seq, n, len);
      else tcp_hdr_set(&it->hdr, ENG_TCP_PART, tag, seq, off, len);
      it->data = (const char *)buf + off;
      it->len = len;
      it->req = r;
      items[k++] = it;
    }
    r->items = r->frames = (size_t)k;
    r->state = TCP_ACTIVE;
    for (int j = 0; j < k; j++) TCP_PUSH(p->out[j].head, p->out[j].tail, items[j]);
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

/* The call now running on an ordered channel: its tag base (call_tags.h), 0 for none. */
static void eng_tcp_set_call(eng_tcp *t, int base) {
  pthread_mutex_lock(&t->lock);
  t->call = base;
  t->calls++;
  pthread_mutex_unlock(&t->lock);
}

/* Posts a receive (peer or tag -1: any). */
static int eng_tcp_irecv(eng_tcp *t, void *buf, size_t n, int peer, int tag, tcp_req **out, int *err_peer) {
  *out = NULL;
  *err_peer = peer;
  tcp_req *r = tcp_new_req(TCP_RECV, buf, n, peer, tag);
  if (r == NULL) return ENG_ERR_NOMEM;
  pthread_mutex_lock(&t->lock);
  tcp_in *m = t->unexp_head;
  while (m != NULL && !tcp_matches(r, m->peer, m->tag)) m = m->next;
  int gone = peer >= 0 ? t->peers[peer].dead : tcp_none_left(t, err_peer);   /* (any rank: none left to send) */
  if (m != NULL && t->other_peer < 0) {
    tcp_unlink_unexpected(t, m);
    tcp_bind(t, r, m);
  } else if (gone || t->said_bye || t->other_peer >= 0 || tcp_out_of_order(t, peer)) {
    int rc = t->said_bye ? ENG_ERR_PEER_LEFT : t->other_peer >= 0 ? ENG_ERR_OTHER_CALL : gone;
    if (rc == ENG_ERR_OTHER_CALL) *err_peer = t->other_peer;
    pthread_mutex_unlock(&t->lock);
    free(r);
    return rc;
  } else {
    TCP_PUSH(t->posted_head, t->posted_tail, r);
    /* Waiting on a peer not yet connected: connect to it, so its end is noticed if it dies. */
    if (peer >= 0 && peer != t->rank && !t->peers[peer].nout && t->peers[peer].has_addr) {
      int rc = tcp_start_connect(t, peer);
      if (rc) tcp_refused(t, peer, rc);
    }
  }
  *out = r;
  pthread_mutex_unlock(&t->lock);
  return 0;
}

/* Progress, then whether r is done; a done request is freed and its status and error returned. */
static int eng_tcp_test(eng_tcp *t, tcp_req *r, int *done, int *src, int *tag, size_t *nbytes, int *err_peer) {
  int rc = 0, failing;
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
  } else if (t->fail_any && (failing = tcp_failing_peer(t)) >= 0) {
    rc = t->peers[failing].dead;
    *err_peer = failing;
  } else if (t->other_peer >= 0) {
    rc = ENG_ERR_OTHER_CALL;
    *err_peer = t->other_peer;
  } else if (t->sys_errno == ENOMEM || t->sys_errno == EMFILE || t->sys_errno == ENFILE) {
    rc = ENG_ERR_NOMEM;   /* (out of descriptors: a peer's connection waits unaccepted, the listener ever ready) */
    *err_peer = -1;
  }
  pthread_mutex_unlock(&t->lock);
  return rc;
}

/* Progress, unless another thread holds the channel (it is making progress itself), without waiting;
 * returns whether messages are still in flight: sends not yet written, receives posted, messages
 * arriving (2 where bytes moved just now, as Transport.in_flight says). Nothing wakes a wait on another
 * channel when this one's sockets are ready, so that wait calls this again soon while it says so. */
static int eng_tcp_nudge(eng_tcp *t) {
  if (pthread_mutex_trylock(&t->lock) != 0) return 1;
  uint64_t moved = t->moved;
  tcp_progress(t);
  int busy = t->posted_head != NULL;
  for (int q = 0; q < t->size && !busy; q++) {
    busy = t->peers[q].arriving != NULL;
    for (int s = 0; s < ENG_TCP_MAX_STREAMS && !busy; s++) busy = t->peers[q].out[s].head != NULL;
  }
  if (busy && t->moved != moved) busy = 2;
  pthread_mutex_unlock(&t->lock);
  return busy;
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
  uint32_t wakes = t->wakes;
  pthread_mutex_unlock(&t->lock);
  ppoll(mine, (nfds_t)n, ENG_TIMEOUT(seconds), NULL);
  free(mine);
  pthread_mutex_lock(&t->lock);
  t->sleepers--;
  if (t->wakes != wakes && --t->unwoken <= 0) {   /* every sleeper of the last write is up */
    uint64_t drain;
    if (read(t->wake_fd, &drain, sizeof drain) < 0) drain = 0;
  }
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
    else if (r->in != NULL) tcp_unbind(t, r, r->in);
    free(r);
  } else {
    tcp_peer *p = &t->peers[r->peer];
    int started = r->items < r->frames;   /* (a frame written whole has left its queue) */
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
      tcp_peer_failed(t, r->peer, ENG_ERR_NOMEM, ENOMEM);   /* drops every item of it, r's included */
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
static int eng_tcp_peers_connected(eng_tcp *t) { /* peers this rank made its streams to (lazily: once used) */
  int n = 0;
  pthread_mutex_lock(&t->lock);
  for (int q = 0; q < t->size; q++) n += t->peers[q].nout > 0;
  pthread_mutex_unlock(&t->lock);
  return n;
}
static int eng_tcp_bye_lost(eng_tcp *t, int peer) { return t->peers[peer].bye_lost - 1; }
static int eng_tcp_bye_first(eng_tcp *t, int peer) { return t->peers[peer].bye_first - 1; }
static int eng_tcp_whole(eng_tcp *t, int q) { return tcp_whole(t, q); }

/* A stage of a hierarchy: ranks[q] (t->size entries, malloc'd; t owns them now) is rank q's rank in
 * the group it serves, of whole_size ranks, the numbering in which a goodbye names a lost rank. */
static void eng_tcp_set_whole(eng_tcp *t, int whole_size, int *ranks) {
  pthread_mutex_lock(&t->lock);
  free(t->whole);
  t->whole = ranks;
  t->whole_size = whole_size;
  pthread_mutex_unlock(&t->lock);
}

/* The peers lost to this rank, into lost (t->size entries); returns their count: those whose
 * connection ended without a goodbye (its process exited, or the link to it is cut). Moves the channel
 * first unless a thread waits on it (that wait moves it), so a peer that died while it idled is seen. */
static int eng_tcp_lost(eng_tcp *t, int waited_on, int *lost) {
  int n = 0;
  if (!waited_on) (void)eng_tcp_nudge(t);
  pthread_mutex_lock(&t->lock);
  for (int q = 0; q < t->size; q++)
    if (q != t->rank && t->peers[q].dead == ENG_ERR_PEER_DEAD) lost[n++] = q;
  pthread_mutex_unlock(&t->lock);
  return n;
}

/* Starts every connection of this rank (the mesh: made when the group is). */
static int eng_tcp_connect_all(eng_tcp *t) {
  int rc = 0;
  pthread_mutex_lock(&t->lock);
  for (int q = 0; q < t->size && !rc; q++)
    if (q != t->rank && !t->peers[q].dead) {
      rc = tcp_start_connect(t, q);
      if (rc) {   /* (an errno: the peer keeps it, eng_tcp_peer_errno; the caller gets the engine's code) */
        tcp_peer_failed(t, q, ENG_ERR_CONNECT, rc);
        rc = ENG_ERR_CONNECT;
      }
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
