/* A trainer rank's half of nccl's many senders (NcclInitInfo.senders,
 * docs/data-plane.md "nccl with many senders"): the rank joins the one
 * communicator of every trainer rank and every worker, and sends each
 * chunk the plan gives it to its worker with ncclSend, one at a time in
 * the order every rank and worker agree on, so no send waits on another
 * that waits on it. Internal to wtx (client/many.c). */
#ifndef WTX_TRANSPORT_NCCL_RANK_H
#define WTX_TRANSPORT_NCCL_RANK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WTX__NCCL_ID_BYTES 128

typedef struct wtx__nccl_rank wtx__nccl_rank;

/* Loads CUDA and NCCL on WTX_CUDA_DEVICE and makes a stream and a chunk
 * buffer of buffer_size bytes (pinned host and device); every later wait
 * is bounded by timeout_ms. *out is the caller's until destroy. */
int wtx__nccl_rank_open(uint64_t buffer_size, uint32_t timeout_ms, wtx__nccl_rank **out,
                        char *err, size_t errlen);
/* Rank 0: a fresh communicator id (WTX__NCCL_ID_BYTES) into id. */
int wtx__nccl_rank_new_id(wtx__nccl_rank *r, uint8_t *id, char *err, size_t errlen);
/* Joins communicator id as rank of nranks, dropping the one it had:
 * returns once every rank joined, within the timeout; cancel ends it. */
int wtx__nccl_rank_join(wtx__nccl_rank *r, const uint8_t *id, int nranks, int rank, char *err,
                        size_t errlen);
/* Whether a communicator is joined and has not failed. */
int wtx__nccl_rank_ready(const wtx__nccl_rank *r);
/* Sends the n pieces of iov (bytes in all, at most buffer_size) to NCCL
 * rank peer, then, when sums is set, the XXH3-64 of each span [ends[i-1],
 * ends[i]) of them (ends[-1] is 0; ends[n_ends-1] is bytes; at most
 * WTX_MAX_CHUNK_PARAMS) as a second send; and waits until the peer took
 * them (bounded; cancel ends it). A failure aborts the communicator: join
 * again before the next. */
int wtx__nccl_rank_send(wtx__nccl_rank *r, int peer, const struct iovec *iov, size_t n,
                        uint64_t bytes, const uint64_t *ends, size_t n_ends, int sums,
                        char *err, size_t errlen);
/* From any thread: a join or send running now ends (WTX_ECANCELED). */
void wtx__nccl_rank_cancel(wtx__nccl_rank *r);
/* Clears a cancel, for the next sync. */
void wtx__nccl_rank_rearm(wtx__nccl_rank *r);
void wtx__nccl_rank_destroy(wtx__nccl_rank *r);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_NCCL_RANK_H */
