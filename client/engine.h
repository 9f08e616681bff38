/* What the trainer engine (engine.c) offers the sharded sync (sharded.c)
 * beyond the public wtx_trainer API (wtx/client.h). Internal. */
#ifndef WTX_CLIENT_ENGINE_H
#define WTX_CLIENT_ENGINE_H

#include "transport/plan.h"
#include "wtx/client.h"
#include "wtx/v1/weight_transfer.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* wtx_trainer_init without looking for tensor-parallel workers: one stream
 * of source's tensors to every replica of client. */
int wtx__trainer_init_plain(const wtx_trainer_config *cfg, wtx_client *client,
                            wtx_source *source, wtx_trainer **out, char *err, size_t errlen);
/* parts[i] (NULL: the whole tensor) is where source tensor i lies in its
 * parameter: the first sync's ParamMeta carries it. parts (n of the
 * source's tensors) and what it points to outlive t. */
void wtx__trainer_set_parts(wtx_trainer *t, Wtx__V1__TensorPart *const *parts);
/* One sync up to publishing: start, every chunk, then every replica
 * prepared under version (NULL or "": the workers number it). On failure
 * every replica of t is aborted, as wtx_trainer_send_weights does. result
 * as wtx_trainer_send_weights's, less the version. */
int wtx__trainer_send_prepared(wtx_trainer *t, const wtx_send_options *opts,
                               wtx_send_result *result);
/* The caller's patches as wtx_trainer_send_patches sends them, prepared
 * on every replica but not published (n may be 0: the replicas still
 * prepare the new version). map[j]: patch j's tensor in t's source table,
 * whose part it names (wtx__trainer_set_parts); NULL: whole tensors. */
int wtx__trainer_patches_prepared(wtx_trainer *t, const wtx_patch *patches, size_t n,
                                  const size_t *map, const wtx_send_options *opts,
                                  wtx_send_result *result);
/* After wtx__trainer_send_prepared: whether its update was published on
 * every replica (1) or not (0), for a delta's record of what they serve. */
void wtx__trainer_landed(wtx_trainer *t, int published);
/* Aborts every replica's update (their previous weights stay); the next
 * sync initializes the sessions again. */
void wtx__trainer_abort(wtx_trainer *t, const char *reason);
/* t's source pass is checked and driven by t; wtx__trainer_fail records a
 * failure message on t (as wtx_trainer_last_error reports it). */
int wtx__trainer_fail(wtx_trainer *t, int rc, const char *msg);

/* ---- sharded.c: a sync to tensor-parallel workers ---- */

typedef struct wtx__sharded wtx__sharded;

/* Whether any replica of client announces shard rules (GetWeightInfo
 * .shard); if so, makes the sharded sync: one group per distinct set of
 * parts, each with its own engine over the group's replicas, fed from one
 * pass over source. *out NULL: no replica is sharded. */
int wtx__sharded_create(const wtx_trainer_config *cfg, wtx_client *client, wtx_source *source,
                        wtx__sharded **out, char *err, size_t errlen);
/* One sync to every group: all prepared, then all published; any failure
 * aborts every group. err receives the failure. */
int wtx__sharded_send(wtx__sharded *sh, const wtx_send_options *opts, wtx_send_result *result,
                      char *err, size_t errlen);
/* wtx_trainer_send_patches to tensor-parallel workers: each group gets the
 * elements of each patch that fall in its parts, indexed in the part. */
int wtx__sharded_send_patches(wtx__sharded *sh, const wtx_patch *patches, size_t n,
                              const wtx_send_options *opts, wtx_send_result *result,
                              char *err, size_t errlen);
/* wtx_trainer_verify of every group's engine; err names the group. */
int wtx__sharded_verify(wtx__sharded *sh, char *err, size_t errlen);
void wtx__sharded_destroy(wtx__sharded *sh);
/* Replica i's parts of metas[0..n), from the shard rules it announced
 * (spec NULL: every tensor whole): *out (malloc'd, the caller's) gets *n_out
 * slices in metadata order. */
int wtx__replica_slices(const Wtx__V1__ShardSpec *spec, const wtx_tensor_meta *metas, size_t n,
                        size_t i, wtx_slice **out, size_t *n_out, char *err, size_t errlen);

/* ---- many.c: a sync from many trainer ranks ---- */

typedef struct wtx__many wtx__many;

/* Every rank's part of the rendezvous (wtx_trainer_config.world > 1):
 * the plan from source's metadata and ownership and every worker's parts,
 * this rank's data port, and (rank 0) the workers' sessions. */
int wtx__many_create(const wtx_trainer_config *cfg, wtx_client *client, wtx_source *source,
                     wtx__many **out, char *err, size_t errlen);
/* One sync: every rank sends its chunks; rank 0 also drives the workers
 * and publishes on all or none. err receives the failure. */
int wtx__many_send(wtx__many *m, const wtx_send_options *opts, wtx_send_result *result,
                   char *err, size_t errlen);
/* wtx_trainer_send_patches with many senders: rank 0 alone sends the
 * caller's patches (as vLLM's sparse sender does), each worker the part
 * that falls in its tensors, over the sessions a sync of every rank made;
 * the other ranks' calls send nothing. Once they land every rank's next
 * delta sends its pieces whole (rank 0 tells the others with its ask). */
int wtx__many_send_patches(wtx__many *m, const wtx_patch *patches, size_t n,
                           const wtx_send_options *opts, wtx_send_result *result, char *err,
                           size_t errlen);
void wtx__many_destroy(wtx__many *m);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_ENGINE_H */
