/* wtx weight sources: where a trainer's weights come from.
 *
 * A source has two channels that must agree element by element (as vLLM's
 * WeightSource):
 *  - metadata: name, dtype and full shape of every parameter, cheap, no data
 *    moved (for a sharded trainer: the global shape, no all-gather);
 *  - iteration: a fresh pass that yields fully materialized tensors, one at a
 *    time, in the same order (for a sharded trainer each yield may be a
 *    collective, so every trainer rank iterates in lockstep).
 * The trainer engine checks the agreement as it iterates and fails naming
 * the first mismatch before the tensor's bytes reach the wire.
 *
 * Built in: tensors in host memory, safetensors files (mmap), and a
 * synthetic GPT-style model for demos and benchmarks. Any other producer
 * (a framework's parameters) implements wtx_source_ops. */
#ifndef WTX_SOURCE_H
#define WTX_SOURCE_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/error.h"
#include "wtx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Placement of a mesh axis (wtx_ownership): replicated, or Shard(dim) for
 * dim >= 0. */
#define WTX_PLACEMENT_REPLICATE (-1)
/* Most axes a parameter's mesh may have. */
#define WTX_MAX_MESH_DIMS 8

/* Which trainer ranks own a parameter, and how (vLLM 0.33's ParamMeta
 * owners, mesh_shape and placements): the owners lie row-major on a mesh,
 * and each mesh axis either replicates the tensor or shards one of its dims
 * as torch.chunk splits, outer axis first when two axes shard one dim. All
 * arrays are borrowed (see where a wtx_ownership is taken). */
typedef struct wtx_ownership {
  /* Global trainer ranks in mesh order (row-major), distinct. NULL: every
   * rank owns the whole parameter (vLLM's owners=None). Non-NULL with
   * n_owners 0: no rank owns it, which a plan refuses by name. */
  const uint32_t *owners;
  size_t n_owners;
  /* The mesh over owners; NULL (mesh_ndim 0): one axis of n_owners. */
  const uint32_t *mesh_shape;
  size_t mesh_ndim;
  /* One per mesh axis: WTX_PLACEMENT_REPLICATE or a tensor dim. NULL:
   * replicated on every axis. */
  const int32_t *placements;
} wtx_ownership;

/* A source implementation. self is the implementation's state. */
/* What a source's next says of the tensor it yields (besides 0: the end,
 * and a negative WTX_E* code); the values are part of the ABI. */
enum {
  WTX_NEXT_TENSOR = 1, /* host memory, valid until the next call */
  WTX_NEXT_STAYS = 2,  /* host memory, valid and unchanged until close */
  WTX_NEXT_DEVICE = 3, /* CUDA device memory, as WTX_NEXT_STAYS */
};

/* The wtx_source_ops layout of this header: 1, every member below. */
#define WTX_SOURCE_OPS_VERSION 1u

typedef struct wtx_source_ops {
  /* WTX_SOURCE_OPS_VERSION as the source was built (0 is refused): the
   * library reads only the members that version has (SQLite's iVersion). */
  unsigned version;
  const char *name; /* "memory", "safetensors", "synthetic", ... */
  /* Every parameter, in iteration order; *metas is owned by self and stays
   * valid and unchanged until destroy. May compute and cache on the first
   * call. A trainer plans its syncs from this table once (the chunk cut,
   * the table's identity the workers know it by) and plans again only when
   * another array or count is answered: a source whose table changes
   * answers a new array, never the old one rewritten in place. */
  int (*metadata)(void *self, const wtx_tensor_meta **metas, size_t *n);
  /* Starts a fresh pass; *iter is the pass's state. */
  int (*open)(void *self, void **iter);
  /* The next tensor: WTX_NEXT_TENSOR with *meta and *data (host memory of
   * meta->nbytes, valid until the next call of next or close), 0 at the
   * end, or a negative WTX_E* code. WTX_NEXT_STAYS: as WTX_NEXT_TENSOR,
   * and *data stays valid and unchanged until close (the tensor's own
   * memory, not a copy the next call reuses): a backend may then send it
   * from there without copying it first (tcp). WTX_NEXT_DEVICE: as
   * WTX_NEXT_STAYS, but *data is CUDA device memory (any device of the
   * process; its producing work finished): the GPU backends copy it device
   * to device, the others through a host copy the engine makes. */
  int (*next)(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data);
  void (*close)(void *self, void *iter);
  void (*destroy)(void *self);
  /* Optional, in place of next (which may then be NULL), for a source
   * behind a binding whose every call is costly (Python's ctypes: one
   * callback cost more than a small tensor's whole sync): up to max next
   * tensors of the pass in one call. Returns how many it filled, 0 at the
   * end, or a negative WTX_E* code. For each k below that count: metas[k]
   * is the tensor's meta (an entry of the metadata table, or one self
   * keeps), data[k] its bytes, kinds[k] what next would have returned for
   * it (1, 2 or 3); all valid until the next call of next_batch or close
   * (and what next's 2 and 3 promise, until close). A batch whose tensors
   * are copies made for the pass should end at the first one, so that one
   * copy at a time is alive, as with next. The engine still takes the pass
   * one tensor at a time (wtx_source_next). */
  int (*next_batch)(void *self, void *iter, size_t max, const wtx_tensor_meta **metas,
                    const uint8_t **data, int *kinds);
  /* Optional, for a trainer spread over ranks (wtx_trainer_config.world):
   * how the ranks own each parameter, *owners one entry per metadata
   * entry, owned by self and unchanged until destroy. A source with it is
   * this rank's: metadata gives every parameter's full shape, and a pass
   * yields only the parameters this rank owns, each as this rank's part of
   * it (the box wtx_ownership gives it, row-major; meta.shape the part's),
   * in metadata order, and never a part of no elements. NULL: every rank
   * owns every parameter whole. */
  int (*ownership)(void *self, const wtx_ownership **owners, size_t *n);
} wtx_source_ops;

typedef struct wtx_source wtx_source;

/* Wraps an implementation; ops must outlive the source, self is destroyed
 * by wtx_source_destroy (ops->destroy). WTX_EINVAL without metadata, open,
 * close, and next or next_batch. */
int wtx_source_create(const wtx_source_ops *ops, void *self, wtx_source **out);
void wtx_source_destroy(wtx_source *s);
const char *wtx_source_name(const wtx_source *s);
int wtx_source_metadata(wtx_source *s, const wtx_tensor_meta **metas, size_t *n);
int wtx_source_open(wtx_source *s, void **iter);
/* ops->next, with 2 reported as 1; and 3 as 1 with *data a host copy
 * (valid until the next call; WTX_EUNAVAIL without a CUDA runtime). */
int wtx_source_next(wtx_source *s, void *iter, wtx_tensor_meta *meta,
                    const uint8_t **data);
void wtx_source_close(wtx_source *s, void *iter);
/* ops->ownership's answer; *owners NULL when the source has none. */
int wtx_source_ownership(wtx_source *s, const wtx_ownership **owners, size_t *n);
/* Sum of the parameters' bytes (from metadata). */
int wtx_source_total_bytes(wtx_source *s, uint64_t *out);

/* ---- built-in sources ---- */

/* A tensor in memory, for wtx_source_memory. */
typedef struct wtx_memory_tensor {
  const char *name;
  int dtype;
  const uint64_t *shape;
  size_t ndim;
  const void *data; /* dtype size x product(shape) bytes */
  /* 0: data is host memory. 1: data is CUDA device memory (any device of
   * the process: copies go by unified addressing), whose producing work
   * has finished (copies run on wtx's own stream: after
   * torch.cuda.synchronize(), say). The GPU backends copy it device to
   * device into their buffers; the others take a host copy when the pass
   * reaches it, one tensor at a time. */
  int device;
} wtx_memory_tensor;

/* Tensors already in memory: names and shapes are copied (and validated:
 * dtype known, ndim <= WTX_MAX_DIMS, names unique); the data is borrowed and
 * must stay valid and unchanged while a pass runs. Device tensors need the
 * CUDA runtime (loaded at run time, cuda/cuda.h): without it the
 * source is WTX_EUNAVAIL, saying why. err names the tensor. */
int wtx_source_memory(const wtx_memory_tensor *tensors, size_t n,
                      wtx_source **out, char *err, size_t errlen);

/* A trainer rank's tensors: tensors[i].shape is parameter i's full shape
 * and tensors[i].data this rank's part of it (row-major over the box
 * owners[i] gives rank; NULL where it owns no element of it). owners (n
 * entries) and what they point to are borrowed and must outlive the
 * source; the rest as wtx_source_memory. Refuses an ownership that is not
 * valid for rank (wtx_ownership.owners past a rank named, twice, a mesh
 * that does not cover the owners, a placement past the dims), naming the
 * tensor. */
int wtx_source_memory_owned(const wtx_memory_tensor *tensors, const wtx_ownership *owners,
                            size_t n, uint32_t rank, wtx_source **out, char *err,
                            size_t errlen);

/* One or more safetensors files, mapped read-only; parameters in file order,
 * then by data offset. A name in two files is an error naming both. */
int wtx_source_safetensors(const char *const *paths, size_t n, wtx_source **out,
                           char *err, size_t errlen);

/* A GPT-style stack of about total_bytes of bf16 parameters (embedding,
 * per layer q/k/v/o + MLP up/down + two norms, final norm), deterministic
 * content from seed, generated at the first pass and then held in memory
 * (total_bytes of it), as a trainer holds its weights. */
int wtx_source_synthetic(uint64_t total_bytes, uint64_t seed, wtx_source **out);

/* ---- layer grouping ---- */

/* The layer of a parameter: the outermost (first) numeric component of its
 * dotted name, e.g. 12 for "model.layers.12.mlp.up_proj.weight". 1 with
 * *layer set, 0 when the name has none (embeddings, final norm). */
int wtx_param_layer(const char *name, uint64_t *layer);

/* Groups consecutive parameters of the same layer: fills starts[] (indices
 * into metas where a group begins, at most n) and returns the group count.
 * Parameters without a layer form groups of their own kind the same way. */
size_t wtx_param_groups(const wtx_tensor_meta *metas, size_t n, size_t *starts);

#ifdef __cplusplus
}
#endif
#endif /* WTX_SOURCE_H */
