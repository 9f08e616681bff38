/* The sync client's typed calls of one weight update, for the trainer
 * engine (engine.c) and the client's tests: protobuf-c messages in, every
 * replica out. The public face of wtx_client is wtx/client.h. */
#ifndef WTX_CLIENT_FANOUT_H
#define WTX_CLIENT_FANOUT_H

#include "common/stop.h"
#include "wtx/client.h"
#include "wtx/v1/weight_transfer.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* InitWeightTransferEngine on replica i alone (a chain initializes in
 * order). On success the replica's session id is kept for the calls below;
 * *resp (may be NULL) receives the response, freed by the caller with
 * protobuf_c_message_free_unpacked. */
int wtx__client_init_one(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info,
                         Wtx__V1__InitWeightTransferEngineResponse **resp);
/* The same in two halves, so calls to several replicas can be in flight at
 * once (a collective rendezvous such as NCCL's): every started call must be
 * waited for. info is only read during start. */
int wtx__client_init_start(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info);
int wtx__client_init_wait(wtx_client *c, size_t i,
                          Wtx__V1__InitWeightTransferEngineResponse **resp);
/* StartWeightUpdate on every replica (target: wtx_target, 0: main). */
int wtx__client_start(wtx_client *c, int target);
/* The same in two halves: begin puts the call in flight on every replica
 * and returns at once, so the caller can ready its first chunk meanwhile;
 * end waits for every answer. Every begin must be ended, before any other
 * call on c. params: how many tensors the update will send (0: not said;
 * StartWeightUpdateRequest.expected_params). */
void wtx__client_start_begin(wtx_client *c, int target, size_t params);
int wtx__client_start_end(wtx_client *c);
/* The next start is a delta (StartWeightUpdateRequest.base_version):
 * bases[i] is the version replica i's delta applies to (wtx_client_size
 * entries, copied); NULL: an ordinary update. One start's: the start after
 * it is ordinary unless set again. A caller's control plane, whose start
 * carries no request, takes it after the start: wtx__client_send_base. */
int wtx__client_set_bases(wtx_client *c, const char *const *bases);
/* After a start with bases, on a caller's control plane: one update call
 * whose UpdateInfo carries only the base (UpdateInfo.base_version), which
 * the engine behind it starts its update against or refuses (that call's
 * error). 0 at once on gRPC workers, whose start carried it. */
int wtx__client_send_base(wtx_client *c);
/* 1 when c reaches its workers through a caller's control plane
 * (wtx_client_create_control), whose start carries no base version. */
int wtx__client_is_control(const wtx_client *c);
/* After a start: 1 when every replica said a delta may carry patches
 * (StartWeightUpdateResponse.patches). */
int wtx__client_patches(const wtx_client *c);
/* The same for patches of spans (StartWeightUpdateResponse.patch_spans). */
int wtx__client_patch_spans(const wtx_client *c);
/* The same for spans that are boxes (StartWeightUpdateResponse.patch_boxes). */
int wtx__client_patch_boxes(const wtx_client *c);
/* The version replica i serves as far as c saw: its last start's answer,
 * then what its Finish published or its undo returned to (on a caller's
 * control plane, which answers nothing: the version its last finish
 * named); "" when not known. Owned by c, valid until the next call on c. */
const char *wtx__client_serves(const wtx_client *c, size_t i);
/* After a start: the parameter table every replica announced
 * (StartWeightUpdateResponse.table_xxh3), or 0 when they differ or have
 * none. */
uint64_t wtx__client_table(const wtx_client *c);
/* 1 when a started UpdateWeights has already ended with an error (a worker
 * refused the chunk): a data-plane wait for that chunk is pointless. Never
 * blocks. */
int wtx__client_update_refused(wtx_client *c);
/* UpdateWeights on every replica: start returns once every call is in
 * flight (the data plane then moves the bytes), wait collects them all and
 * reports the most telling failure (a refusal over a broken stream). */
int wtx__client_update_start(wtx_client *c, const Wtx__V1__UpdateInfo *ui);
/* After a start: 1 when every replica takes several chunks in one
 * UpdateWeights (StartWeightUpdateResponse.chunk_batches), on gRPC. */
int wtx__client_batches(const wtx_client *c);
/* update_start of n chunks (ui[0..n), in stream order; n >= 1) in one call
 * on every replica: WTX_ENOTSUP for n > 1 where wtx__client_batches is 0.
 * Waited for with update_wait, as one chunk's call is. */
int wtx__client_update_start_batch(wtx_client *c, const Wtx__V1__UpdateInfo *const *ui,
                                   size_t n);
/* After a start: 1 when every replica takes an UpdateWeights sent before
 * the answer to the one before (StartWeightUpdateResponse.ordered_calls),
 * on gRPC. */
int wtx__client_ordered(const wtx_client *c);
/* update_start of the update's call_index-th call (from 1), while the call
 * before it may still be in flight: that one becomes the earlier call,
 * which update_wait_earlier collects (it must, before the next
 * update_start_next or any other call). WTX_ENOTSUP where
 * wtx__client_ordered is 0; WTX_ESTATE while an earlier call is still
 * uncollected. */
int wtx__client_update_start_next(wtx_client *c, const Wtx__V1__UpdateInfo *ui,
                                  uint32_t call_index);
/* update_wait for the earlier call update_start_next left in flight (0 at
 * once when there is none). */
int wtx__client_update_wait_earlier(wtx_client *c);
/* The packed UpdateInfo bytes update_start has sent so far, over every
 * replica: what the chunks cost the control plane (wtx_send_result.
 * control_bytes is a sync's share). */
uint64_t wtx__client_update_bytes(const wtx_client *c);
int wtx__client_update_wait(wtx_client *c);
/* update_wait that ends early when stop fires (the sync failed elsewhere:
 * another worker's part, the data plane): the calls still in flight after
 * a short grace, in which a worker that refused the chunk answers so, are
 * cancelled, and WTX_ECANCELED is returned when that is all that failed.
 * Over a caller's control plane, plain update_wait. */
int wtx__client_update_wait_stop(wtx_client *c, const wtx_stop *stop);
/* Publishes the update on every replica or on none: PrepareWeightUpdate on
 * every replica first (a failure returns before any replica publishes; the
 * caller then aborts them all), then FinishWeightUpdate on each, retried on
 * transient failures; a Finish that still fails undoes the update on every
 * replica (wtx__client_commit_all). Each phase is in flight on every replica at once.
 * version "" or NULL lets the workers number it. published (may be NULL)
 * receives replica 0's label. */
int wtx__client_finish(wtx_client *c, const char *version, char *published,
                       size_t publen);
/* The two phases of wtx__client_finish, for a trainer that publishes
 * several clients' updates together (a sharded sync: every group of
 * workers prepared before any publishes). commit takes the version
 * prepare was given. */
int wtx__client_prepare(wtx_client *c, const char *version);
int wtx__client_commit(wtx_client *c, const char *version, char *published, size_t publen);
/* commit over several clients' prepared updates, every replica of each or
 * none: FinishWeightUpdate client after client; after a failure, every
 * replica of every client is told to undo its update (AbortWeightUpdate
 * naming it: a replica that published it returns to the version it
 * replaced, a prepared one discards it). err (also the failing client's
 * last error) says what failed and where the undo left each replica;
 * *failed (may be NULL) is the failing client's index. A replica the undo
 * cannot reach keeps it pending: its client's next init or start of that
 * replica undoes it first, and fails while it still cannot. */
int wtx__client_commit_all(wtx_client *const *cs, size_t n, const char *version,
                           char *published, size_t publen, size_t *failed, char *err,
                           size_t errlen);
/* A client of replicas which[0..n) of c, sharing c's channels (c must
 * outlive it) and naming each worker by its number in c. *out is the
 * caller's until wtx_client_destroy. WTX_EINVAL for a caller's control
 * plane. */
int wtx__client_subset(wtx_client *c, const size_t *which, size_t n, wtx_client **out);
/* Every replica's shard spec (GetWeightInfoResponse.shard), asked of all
 * at once: specs[i] (wtx_client_size entries) is replica i's, NULL when it
 * has none, each the caller's (protobuf_c_message_free_unpacked). A
 * caller's control plane answers 0 with none. */
int wtx__client_shards(wtx_client *c, Wtx__V1__ShardSpec **specs);
/* AbortWeightUpdate on every replica with an open session (best effort:
 * all are tried; returns the first failure). */
int wtx__client_abort(wtx_client *c, const char *reason);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_FANOUT_H */
