/* Delta syncs (docs/data-plane.md, "Delta updates"): what every replica
 * serves of a trainer's table, tensor by tensor, and the subset of the
 * table a sync must send. The trainer engine (engine.c) hashes its source
 * once per sync and sends only the tensors whose XXH3-64 differs from what
 * the replicas serve; each start names the version the delta applies to,
 * so a replica serving anything else refuses it and the engine sends the
 * whole table instead. Internal. */
#ifndef WTX_CLIENT_DELTA_H
#define WTX_CLIENT_DELTA_H

#include "common/strmap.h"
#include "transport/transport.h"
#include "wtx/client.h"
#include "wtx/v1/types.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__delta {
  size_t n; /* the table's tensors */
  /* Per tensor: the XXH3-64 every replica serves, where ok[i]; valid:
   * they describe the versions in based (the last sync that landed, or
   * wtx__delta_learn, saw replica r serve based[r]). A failed sync leaves
   * them standing: a delta names based[r] as replica r's base, so a
   * replica that serves anything else refuses it before a byte moves. */
  uint64_t *known;
  uint8_t *ok;
  int valid;
  char (*based)[WTX_MAX_VERSION_BYTES + 1];
  size_t n_based;
  uint64_t *hashes; /* this sync's: every tensor's XXH3-64 (the hash pass) */
  /* The hash pass's tensors that stay put until it ends, hashed together
   * at its end (wtx__delta_hash): where; NULL: hashed as it went. */
  const uint8_t **at;
  /* The subset to send: metas[0..m) are the table's map[0..m), in order,
   * planned into chunks as the whole table is; patch[j] (NULL: whole) and
   * its bytes src[j] for a tensor sent as a patch. */
  wtx_tensor_meta *metas;
  size_t *map, m;
  Wtx__V1__Patch **patch;
  const uint8_t **src;
  wtx_chunk *chunks;
  size_t n_chunks;
  uint64_t total;
  /* Patches (WTX_DELTA_PATCHES): prev holds each tensor as the workers
   * serve it where prev_ok (at prev_off[i]); pending: copied this sync,
   * served once it lands. This sync's patches are in arena: tensor i's
   * at patch_off[i], patch_len[i] bytes (0: sent whole), described by
   * patches[i]. */
  uint8_t *prev;
  uint64_t *prev_off;
  uint8_t *prev_ok, *pending;
  uint8_t *arena;
  uint64_t arena_cap;
  uint64_t *patch_off, *patch_len;
  Wtx__V1__Patch *patches;
} wtx__delta;

/* Room for a table of n tensors; a table of another size is not known. */
int wtx__delta_reserve(wtx__delta *d, size_t n);
void wtx__delta_free(wtx__delta *d);
/* Asks every replica of c what it serves (GetWeightInfo, with every
 * parameter) and keeps, per tensor of metas, the XXH3-64 that all of them
 * report under its name, dtype and shape; a tensor any one lacks, holds
 * otherwise or published without checksums is not known. A replica that
 * does not answer leaves nothing known (the sync then sends the whole
 * table, and reports that replica). */
int wtx__delta_learn(wtx__delta *d, wtx_client *c, const wtx_tensor_meta *metas);
/* Makes the patches of this sync (make), once the hash pass has run with
 * its pass still open (at[i] valid): each changed tensor that prev holds
 * is compared with it and sent as a patch when that is fewer bytes than
 * the tensor and at most max_bytes (a buffer). Every changed tensor at
 * hand (all: every one, for a sync of the whole table), and every one
 * prev lacks, is then copied into prev, pending until the sync lands. The
 * first call makes prev (the model's size). */
int wtx__delta_diff(wtx__delta *d, const wtx_tensor_meta *metas, uint64_t max_bytes, int make,
                    int all);
/* The tensors of metas whose hash differs from the known one (or is not
 * known), planned with the whole table's buffer size and packing (with
 * patches: a patched tensor by this sync's patch, wtx__delta_diff's). */
int wtx__delta_plan(wtx__delta *d, const wtx_tensor_meta *metas, uint64_t buffer_size,
                    size_t max_params, int packed, int patches);
/* cur as a patch of prev (m: their dtype and bytes) where that is fewer
 * bytes than m->nbytes and at most max_bytes: its wire form at *arena +
 * *used (the arena, *cap bytes, grown as needed; *used advanced), its
 * element count in *count, and prev patched into cur. *count 0: no such
 * patch (send cur whole), nothing written. */
int wtx__delta_patch(const uint8_t *cur, uint8_t *prev, const wtx_tensor_meta *m,
                     uint64_t max_bytes, uint8_t **arena, uint64_t *cap, uint64_t *used,
                     uint64_t *count);
/* out[i] = XXH3-64 of metas[i].nbytes bytes at at[i], for each i with
 * at[i] not NULL, on a few threads (tensors are spread over them, each
 * hashed whole). */
void wtx__delta_hash(const uint8_t *const *at, const wtx_tensor_meta *metas, size_t n,
                     uint64_t *out);
/* The sync landed on every replica of c: they serve hashes now, at the
 * versions c saw them publish (and prev, when diffed: the sync ran
 * wtx__delta_diff). */
void wtx__delta_landed(wtx__delta *d, int diffed, const wtx_client *c);
/* The sync failed: what it copied into prev is not what they serve; the
 * record of what they served before it stands (valid, with based). */
void wtx__delta_failed(wtx__delta *d);
/* Another sync (the caller's patches) changed what they serve: nothing of
 * it is known any more. */
void wtx__delta_forget(wtx__delta *d);
/* The caller's patch p checked as every replica checks it, in two calls.
 * Without wire: *m set from p (name, dtype, shape), the patch's header
 * checked (index dtype, count, indices and values given) and *bytes its
 * wire size. Then with wire (room for *bytes): its wire form written
 * there, indices then values, and every index checked (below the element
 * count, above the one before). 0, or WTX_EINVAL with why saying which
 * (never echoing values). */
int wtx__delta_check_patch(const wtx_patch *p, wtx_tensor_meta *m, uint8_t *wire,
                           uint64_t *bytes, char *why, size_t len);
/* The caller's n patches as d's subset (a table of their own): each
 * checked as a worker checks it (err names the first that does not, or
 * one larger than buffer_size) and copied, indices then values, into the
 * arena; then planned, each within one chunk. */
int wtx__delta_caller(wtx__delta *d, const wtx_patch *p, size_t n, uint64_t buffer_size,
                      size_t max_params, int packed, char *err, size_t errlen);
/* A map of the n names of metas to their places, into *out (the caller's,
 * wtx__strmap_destroy): to find the tensor each of the caller's patches
 * names. */
int wtx__delta_names(const wtx_tensor_meta *metas, size_t n, wtx__strmap **out);
/* The caller's patch p (patches[j]) against the table metas (names: its
 * map): its tensor's place in *param, and the patch checked whole as a
 * single sender's replicas check it (a name the table lacks, another dtype
 * or shape, a bound, an index repeated or out of order) before any part of
 * it is cut for a worker's slices. 0, or WTX_EINVAL / WTX_ENOMEM with err
 * naming patches[j]. */
int wtx__delta_patch_param(const wtx__strmap *names, const wtx_tensor_meta *metas,
                           const wtx_patch *p, size_t j, size_t *param, char *err,
                           size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_DELTA_H */
