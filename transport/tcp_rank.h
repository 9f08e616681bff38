/* A trainer rank's half of tcp's many senders (TcpInitInfo.sender_addresses,
 * docs/data-plane.md "tcp with many senders"): the rank listens on its data
 * port, takes one connection from each worker it feeds (the who record after
 * the hello says which), and writes on each the chunks the plan gives it,
 * each followed by one checksum per tensor span, since no rank sees a whole
 * tensor. Internal to wtx (client/many.c). */
#ifndef WTX_TRANSPORT_TCP_RANK_H
#define WTX_TRANSPORT_TCP_RANK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__tcp_rank wtx__tcp_rank;

/* What a rank's plan is made of, to find where two ranks' plans differ:
 * each parameter's digest (wtx_plan_param_digests), and the parameter in
 * words (wtx_plan_param_describe). The arrays outlive the rank. */
typedef struct wtx__tcp_params {
  const uint64_t *digests;
  size_t n;
  void (*describe)(void *arg, size_t i, char *buf, size_t len);
  void *arg;
  /* 1: rank 0's check stays open as its link to this rank, which every
   * sync starts with a go on (wtx__tcp_rank_go); accept then waits for it
   * too. A backend whose workers never connect to the ranks (nccl) has
   * only the link. */
  int link;
  /* 1: every worker is on this host and sends a ring in shared memory
   * after the who record (TcpInitInfo.shm_ring); chunks go through it. */
  int shm_ring;
  /* 1: every worker is on this node and sends a receive region on its GPU
   * (TcpInitInfo.cuda_region_bytes); chunks' bytes go there. */
  int cuda_region;
} wtx__tcp_params;

/* Listens on addr ("host:port"; port 0: one the system picks) for
 * n_workers workers presenting token (16..64 bytes, copied) and rank 0's
 * plan, which must be plan_digest (this rank's); bound receives the
 * address listened on. Every later wait is bounded by timeout_ms. *out is
 * the caller's until destroy. */
int wtx__tcp_rank_listen(const char *addr, const uint8_t *token, size_t token_len,
                         uint64_t plan_digest, const wtx__tcp_params *params,
                         size_t n_workers, uint32_t timeout_ms, wtx__tcp_rank **out,
                         char *bound, size_t blen, char *err, size_t errlen);
/* Rank 0, at init, before any worker's session: whether the rank at addr
 * (which may not listen yet: asked again until timeout_ms) planned as this
 * one did. Where not, WTX_EINVAL, and err names the first parameter that
 * differs as each rank sees it (or says their parameters agree and their
 * views of the workers differ); that rank's accept fails the same way. */
int wtx__tcp_rank_check(const char *addr, uint32_t rank, const uint8_t *token, size_t token_len,
                        uint64_t plan_digest, const wtx__tcp_params *params,
                        uint32_t timeout_ms, int *link, char *err, size_t errlen);
/* Rank 0: whether link is still open at the rank's end (a rank that
 * died closed it). Never blocks. */
int wtx__tcp_link_alive(int link);
/* Rank 0: a sync's go on link (the fd wtx__tcp_rank_check gave when the
 * rank asked for a link): the session's generation and a payload of len
 * bytes (at most 1024), within timeout_ms. */
int wtx__tcp_link_go(int link, uint64_t generation, const uint8_t *payload, size_t len,
                     uint32_t timeout_ms, char *err, size_t errlen);
/* Another rank: waits (bounded, cancellable) for rank 0's next go;
 * payload receives *len bytes, at most cap. On failure the link is closed,
 * and accept waits for rank 0 to link again. */
int wtx__tcp_rank_go(wtx__tcp_rank *r, uint64_t *generation, uint8_t *payload, size_t cap,
                     size_t *len, char *err, size_t errlen);
/* A delta sync's exchange (the link as for the go). Rank 0: ask sends
 * the rank its ask (len bytes), answer reads what the rank changed (at
 * least min and at most cap bytes, *len of them), tell sends it the sync's
 * decision. Another rank: asked waits for rank 0's ask (len bytes);
 * answer sends what it changed (mine, len bytes), then waits for the
 * decision (dmin to dcap bytes, *dlen of them). A record of another size
 * is WTX_EPROTO. On a rank, a failure closes its link, as the go's does.
 * Every wait is bounded by the timeout (and, on a rank, cancellable). */
int wtx__tcp_link_ask(int link, const uint8_t *ask, size_t len, uint32_t timeout_ms, char *err,
                      size_t errlen);
int wtx__tcp_link_answer(int link, uint8_t *answer, size_t min, size_t cap, size_t *len,
                         uint32_t timeout_ms, char *err, size_t errlen);
int wtx__tcp_link_tell(int link, const uint8_t *decision, size_t len, uint32_t timeout_ms,
                       char *err, size_t errlen);
int wtx__tcp_rank_asked(wtx__tcp_rank *r, uint8_t *ask, size_t len, char *err, size_t errlen);
int wtx__tcp_rank_answer(wtx__tcp_rank *r, const uint8_t *mine, size_t len, uint8_t *decision,
                         size_t dmin, size_t dcap, size_t *dlen, char *err, size_t errlen);
/* Whether rank 0's link to this rank is up: open here, and not closed by
 * rank 0 as far as this rank has heard. Never blocks. */
int wtx__tcp_rank_linked(const wtx__tcp_rank *r);
/* During a sync, once its go is read or due: a thread that ends every
 * wait of this rank at once (as wtx__tcp_rank_cancel does) when rank 0
 * closes its link, which it does when it fails the sync before the bytes
 * moved: accept stops waiting for workers that will not come, sends for
 * workers that will not read. The link must stay the one watched until
 * unwatch. Nothing happens without a link. unwatch ends the thread and
 * answers 1 when the link closed meanwhile (a cancel then stands until
 * wtx__tcp_rank_reset spends it), else 0 (also when none ran). */
int wtx__tcp_rank_watch(wtx__tcp_rank *r);
int wtx__tcp_rank_unwatch(wtx__tcp_rank *r);
/* Closes rank 0's link to this rank: rank 0, waiting on it, learns at once
 * that this rank's sync failed (it links again for the next). */
void wtx__tcp_rank_unlink(wtx__tcp_rank *r);
/* Accepts a connection from every worker not connected, within the
 * timeout, answering each with this rank's plan digest; a peer without the
 * token, or naming a worker out of range or connected already, is dropped.
 * A worker bringing another plan of rank 0's fails it (WTX_EINVAL), as
 * does rank 0's check finding the plans differ (err says where). */
int wtx__tcp_rank_accept(wtx__tcp_rank *r, char *err, size_t errlen);
/* The same until rank 0's link is up (at once when it is); a worker that
 * connects meanwhile is taken as accept takes it. */
int wtx__tcp_rank_accept_link(wtx__tcp_rank *r, char *err, size_t errlen);
/* Whether every worker's connection is still open (a worker whose update
 * was aborted closes it: its next session connects again). Never blocks. */
int wtx__tcp_rank_connected(wtx__tcp_rank *r);
/* Closes every connection, for workers that will connect again. */
void wtx__tcp_rank_reset(wtx__tcp_rank *r);
/* One chunk to worker w, on its connection's next sequence number (its
 * bytes at stream_offset of the worker's stream, where they go into the
 * worker's receive region when it sent one): the
 * header, the n pieces of iov (bytes in all), then, when sums is set, the
 * trailer with the XXH3-64 of each span [ends[i-1], ends[i]) of the chunk
 * (ends[-1] is 0; ends[n_ends-1] is bytes). Calls for distinct w may run
 * at once. */
int wtx__tcp_rank_chunk(wtx__tcp_rank *r, size_t w, uint64_t stream_offset,
                        uint64_t first_offset, uint64_t bytes, const struct iovec *iov,
                        size_t n, const uint64_t *ends, size_t n_ends, int sums, char *err,
                        size_t errlen);
/* From any thread: every accept or chunk running now returns at once. */
void wtx__tcp_rank_cancel(wtx__tcp_rank *r);
void wtx__tcp_rank_destroy(wtx__tcp_rank *r);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_TCP_RANK_H */
