/* The TCP transport's outgoing streams: queued frames written until the socket would block; connecting. */
#ifndef ENGINE_TCP_OUTSTREAM_H
#define ENGINE_TCP_OUTSTREAM_H

#include "tcp_wire.h"

/* ---- sending ---- */

static void tcp_item_done(eng_tcp *t, tcp_item *it) {
  tcp_req *r = it->req;
  free(it->owned);
  free(it);
  if (r != NULL && --r->items == 0) tcp_finish_req(t, r, 0, -1);
}

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
      tcp_refused(t, peer, err);
      return;
    }
    o->connecting = 0;
  }
  if (tcp_dropped_unproven(t, p, o)) {
    tcp_redial(t, peer, s);
    return;
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
      int err = errno, code = tcp_end_of(t, p, o);   /* (its goodbye, where it said one, read first) */
      if (tcp_reset_after_bye(p, err)) tcp_reads_no_more(t, peer);
      else tcp_peer_failed(t, peer, code, err);
      return;
    }
    size_t left = (size_t)w;
    t->moved += w > 0;
    if (o->hello_done < ENG_TCP_HELLO) {
      size_t k = ENG_TCP_HELLO - o->hello_done;
      if (k > left) k = left;
      o->hello_done += k;
      left -= k;
      if (o->hello_done == ENG_TCP_HELLO) o->redials = 0;   /* (the budget is for drops in a row) */
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

/* Opens stream s of the connection to peer, without waiting for it. Returns 0 or an errno. */
static int tcp_connect_stream(eng_tcp *t, int peer, int s) {
  tcp_peer *p = &t->peers[peer];
  tcp_out *o = &p->out[s];
  int fd = socket(p->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  tcp_sockopts(fd);
  o->fd = fd;
  o->hello.magic = ENG_TCP_MAGIC;
  o->hello.version = ENG_TCP_VERSION;
  o->hello.hdr = ENG_TCP_HDR;
  o->hello.from = (uint32_t)t->rank;
  o->hello.to = (uint32_t)peer;
  o->hello.channel = (uint32_t)t->channel;
  o->hello.stream = (uint32_t)s;
  o->hello.nstreams = (uint32_t)t->nstreams;
  o->hello.size = (uint32_t)t->size;
  tcp_hello_proof(t->token, &o->hello, o->hello.token);   /* (the token itself never goes) */
  o->hello_done = 0;
  if (connect(fd, (struct sockaddr *)&p->addr, p->addrlen) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) return errno;
    o->connecting = 1;
  }
  return 0;
}

/* Opens the connections to peer (nstreams of them), without waiting for them. */
static int tcp_start_connect(eng_tcp *t, int peer) {
  tcp_peer *p = &t->peers[peer];
  if (p->nout) return 0;
  if (!p->has_addr) return EINVAL;
  for (int s = 0; s < t->nstreams; s++) {
    int rc = tcp_connect_stream(t, peer, s);
    if (p->out[s].fd >= 0) p->nout = s + 1;
    if (rc) return rc;
  }
  return 0;
}

/* A connection to peer could not be made (err). Refused, by a peer that connected to this rank (it was
 * reachable, and its listener is gone: it left or ended), with nothing queued for it: what it sent is
 * still read, and its end fails what waits for it once read (closing), as when it closes a connection
 * this rank made. Else the connection failed (ENG_ERR_CONNECT). Its connections to this rank whose
 * hellos wait are read first: it may have connected, sent and left before this rank looked. */
static void tcp_refused(eng_tcp *t, int peer, int err) {
  tcp_peer *p = &t->peers[peer];
  int queued = tcp_queued_for(p);
  for (int i = 0; err == ECONNREFUSED && !queued && p->nin == 0 && i < t->npending;)
    if (!tcp_hello_progress(t, i)) i++;
  if (err != ECONNREFUSED || queued || p->nin == 0) {
    tcp_peer_failed(t, peer, ENG_ERR_CONNECT, err);
    return;
  }
  tcp_close_outs(p);
  p->closing = 1;
}

/* Whether a live peer closed a connection this rank has written no byte of its hello on (its end
 * came: no error pending, which the caller reports as it did; a peer that left or is leaving is not
 * connected to again). */
static int tcp_dropped_unproven(eng_tcp *t, tcp_peer *p, tcp_out *o) {
  if (o->hello_done || o->connecting || p->departed || p->closing || t->said_bye) return 0;
  struct pollfd q = {o->fd, POLLRDHUP, 0};
  if (poll(&q, 1, 0) <= 0) return 0;
  return (q.revents & POLLRDHUP) && !(q.revents & POLLERR);
}

/* The peer dropped stream s before its hello: a peer closes a connection that has not proved the
 * token within ENG_TCP_HELLO_SECONDS, and nothing wrote it while this rank was away from the engine
 * (lazy connections, no progress thread). What is queued goes on a new connection; a peer that keeps
 * dropping them, or whose listener is gone (refused), fails. */
static void tcp_redial(eng_tcp *t, int peer, int s) {
  tcp_out *o = &t->peers[peer].out[s];
  close(o->fd);
  o->fd = -1;
  o->connecting = 0;
  int rc = ++o->redials > ENG_TCP_MAX_REDIALS ? ECONNRESET : tcp_connect_stream(t, peer, s);
  if (rc) tcp_peer_failed(t, peer, ENG_ERR_CONNECT, rc);
}

#endif
