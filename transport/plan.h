/* The sharded transfer plan: which trainer rank sends which bytes of which
 * tensor to which worker, made once from what each side holds.
 *
 * A trainer spread over many ranks (FSDP, tensor or expert parallel, a
 * pipeline's stages) owns each parameter in pieces; an inference worker
 * running tensor-parallel holds slices of it. Sending every byte through one
 * rank to every worker caps a sync at one link and makes each worker stage
 * the whole model. The plan instead pairs every byte a worker holds with one
 * rank that owns it, so each rank sends only what it owns and each worker
 * receives only its slices (resharding in flight: any trainer layout to any
 * worker layout).
 *
 * The inputs follow vLLM's ParamMeta (distributed/weight_transfer/base.py):
 *  - a parameter's owners are trainer ranks laid out row-major on a mesh;
 *    each mesh axis either replicates the tensor or shards one of its dims
 *    the way torch.chunk splits (pieces of ceil(n / k); trailing pieces may
 *    be short or empty), outer axis first when two axes shard one dim;
 *  - a worker declares, per parameter, nothing, all of it, or slices
 *    [start, start + length) of one dim (the whole extent of the others):
 *    a column-parallel rank's Shard(0) slice, a row-parallel rank's Shard(1)
 *    slice, the q, k and v slices a fused qkv parameter loads, the whole
 *    tensors of the experts it hosts.
 *
 * The plan is a pure function of those inputs: every trainer rank and every
 * worker computes the same one, and the digest proves it (wtx_plan_digest).
 * A piece is the box where one owner's part meets one worker slice; its
 * bytes travel packed, row-major within the box (wtx_box_copy gathers them
 * from the owner's local tensor and scatters them into the worker's slice).
 * Where several ranks own the same bytes (a Replicate axis), the plan gives
 * each piece to the candidate furthest below its fair share (the bytes of
 * every piece it could send, split evenly among that piece's candidates),
 * largest pieces first, so no rank sends more than its fair share plus about
 * one piece.
 *
 * Everything is checked before a plan exists, and a refusal names the
 * parameter: owners out of range or twice, a mesh that does not cover its
 * owners, a placement past the tensor's dims, a parameter with no owner, a
 * slice out of range, slices of one worker that overlap. */
#ifndef WTX_TRANSPORT_PLAN_H
#define WTX_TRANSPORT_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/error.h"
#include "wtx/source.h"
#include "wtx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most trainer ranks and most workers one plan spans. */
#define WTX_MAX_PLAN_RANKS 65536
#define WTX_MAX_PLAN_WORKERS 65536

/* wtx_ownership (wtx/source.h): which trainer ranks own a parameter; the
 * plan borrows each for the call that takes it. */

/* Part of a parameter a worker holds. */
#define WTX_SLICE_WHOLE (-1)
typedef struct wtx_slice {
  uint32_t param; /* index into the plan's metadata */
  /* WTX_SLICE_WHOLE: all of it (start and length unused); else the dim
   * sliced: [start, start + length) of it, 1 <= length. */
  int32_t dim;
  uint64_t start, length;
} wtx_slice;

/* A box of a tensor: [lo[d], lo[d] + len[d]) along each of ndim dims. */
typedef struct wtx_box {
  size_t ndim;
  uint64_t lo[WTX_MAX_DIMS], len[WTX_MAX_DIMS];
} wtx_box;

/* Elements of a box (1 for a scalar's). */
uint64_t wtx_box_elements(const wtx_box *b);
/* The box of the whole of m. */
void wtx_box_whole(const wtx_tensor_meta *m, wtx_box *out);
/* 1 when a and b are the same box. */
int wtx_box_equal(const wtx_box *a, const wtx_box *b);
/* Whether part's elements are one contiguous run in a row-major tensor
 * holding box outer (every dim after part's first of more than one entry
 * is whole in outer): 1 with *elem, the run's first element's offset in
 * outer; else 0. part lies in outer. */
int wtx_box_contiguous(const wtx_box *outer, const wtx_box *part, uint64_t *elem);

/* torch.chunk(n, k)'s piece i: [*start, *start + *len), empty (len 0) past
 * the pieces torch.chunk makes. k >= 1. */
void wtx_chunk_range(uint64_t n, uint32_t k, uint32_t i, uint64_t *start,
                     uint64_t *len);

/* A mesh's axes (one when mesh_ndim is 0: the owners in a row) and the
 * size of axis a. */
static inline size_t wtx__mesh_axes(const wtx_ownership *o) {
  return o->mesh_ndim > 0 ? o->mesh_ndim : 1;
}
static inline uint32_t wtx__mesh_axis(const wtx_ownership *o, size_t a) {
  return o->mesh_ndim > 0 ? o->mesh_shape[a] : (uint32_t)o->n_owners;
}

/* Checks o for m against n_ranks trainer ranks: WTX_EINVAL naming the
 * parameter and the field otherwise (an orphan, an owner out of range or
 * twice, a mesh whose product is not the owners' count, a placement past
 * the tensor's dims or below WTX_PLACEMENT_REPLICATE). */
int wtx_ownership_check(const wtx_tensor_meta *m, const wtx_ownership *o,
                        uint32_t n_ranks, char *err, size_t errlen);

/* The box the owner at position pos (0 <= pos < n_owners; a rank when
 * owners is NULL) holds of m, under a checked ownership. */
void wtx_ownership_box(const wtx_tensor_meta *m, const wtx_ownership *o,
                       size_t pos, wtx_box *out);

/* The box trainer rank holds of m under a checked ownership o (NULL, or
 * owners NULL: every rank, the whole tensor): 1 with *out when rank is one
 * of its owners (the box may be empty: torch.chunk's trailing pieces), 0
 * when it is not. */
int wtx_ownership_rank_box(const wtx_tensor_meta *m, const wtx_ownership *o, uint32_t rank,
                           wtx_box *out);

/* The box a slice covers of m (a checked slice). */
void wtx_slice_box(const wtx_tensor_meta *m, const wtx_slice *s, wtx_box *out);

/* Copies the elements of box part from src, a row-major tensor holding box
 * src_box, into dst, a row-major tensor holding box dst_box; part lies in
 * both. elsize bytes per element. src_box or dst_box NULL: packed, a
 * row-major tensor holding exactly part (the wire's form of a piece). */
void wtx_box_copy(void *dst, const wtx_box *dst_box, const void *src,
                  const wtx_box *src_box, const wtx_box *part, size_t elsize);
/* The runs wtx_box_copy copies, one call of fn each, in row-major order:
 * each contiguous run of part's elements, its first element's offset (in
 * elements) in a and in b (row-major tensors holding boxes a and b; NULL:
 * packed, holding exactly part) and its length; merged outwards over the
 * dims part spans whole in both. Stops at fn's first non-zero answer and
 * returns it. For copies that are not memcpy (into device memory). */
int wtx_box_runs(const wtx_box *a, const wtx_box *b, const wtx_box *part,
                 int (*fn)(void *arg, uint64_t in_a, uint64_t in_b, uint64_t n), void *arg);
/* Marks part's elements in bits, one bit per element of a row-major tensor
 * holding box outer (part lies in it; bits has room for them all):
 * WTX_EEXIST, with nothing marked, when any was marked already. A worker
 * receiving a tensor in boxes (UpdateInfo.box) marks each as it comes, so
 * none overlaps another and, once their bytes add up, they cover it. */
int wtx_box_mark(uint64_t *bits, const wtx_box *outer, const wtx_box *part);
/* Cuts box b (elsize bytes an element) into boxes of at most max bytes
 * (one element where one is more), in row-major order, so that each is
 * one run of b's packed bytes and follows the one before: along b's first
 * dim of more than one entry, as many whole slabs as fit; where one slab
 * is over max, each slab is cut so along the next dim. Calls fn for each
 * (part lies in b), stopping at its first non-zero answer, which it
 * returns. How many senders cut a piece that travels as boxes into
 * chunks (UpdateInfo.box). */
int wtx_box_cut(const wtx_box *b, size_t elsize, uint64_t max,
                int (*fn)(void *arg, const wtx_box *part), void *arg);

/* What a plan is made from; every pointer is borrowed for the call. */
typedef struct wtx_plan_input {
  const wtx_tensor_meta *metas; /* the parameters, in metadata order */
  /* n entries, one per parameter; NULL: every rank owns every parameter. */
  const wtx_ownership *owners;
  size_t n;
  uint32_t n_ranks;   /* trainer ranks, 1..WTX_MAX_PLAN_RANKS */
  uint32_t n_workers; /* 1..WTX_MAX_PLAN_WORKERS */
  /* Per worker w: needs[w][0..n_needs[w]), in any order (a parameter a
   * worker names in no slice is not sent to it). */
  const wtx_slice *const *needs;
  const size_t *n_needs;
} wtx_plan_input;

/* One piece: the bytes of the box where the part of param owned by the
 * owner at position owner meets slice slice of worker (an index into
 * needs[worker]), sent by rank. */
typedef struct wtx_piece {
  uint32_t param, owner, rank, worker, slice;
} wtx_piece;

typedef struct wtx_plan wtx_plan;

/* Checks in and makes its plan. On error (WTX_EINVAL naming the parameter
 * or worker, WTX_ENOMEM) err says why and nothing is made. *out is the
 * caller's until wtx_plan_destroy; it borrows nothing of in. */
int wtx_plan_make(const wtx_plan_input *in, wtx_plan **out, char *err,
                  size_t errlen);
void wtx_plan_destroy(wtx_plan *p);

/* Every piece, sorted by rank, then worker, then param, then slice: a
 * rank's sends to one worker are one run, in metadata order, which is the
 * order its bytes take on that link. Owned by p. */
size_t wtx_plan_pieces(const wtx_plan *p, const wtx_piece **pieces);
/* The pieces rank sends: [*first, *first + *n) of wtx_plan_pieces. */
void wtx_plan_rank_pieces(const wtx_plan *p, uint32_t rank, size_t *first,
                          size_t *n);
/* The pieces worker receives, as indices into wtx_plan_pieces, sorted by
 * rank, then param, then slice; *idx owned by p. */
void wtx_plan_worker_pieces(const wtx_plan *p, uint32_t worker,
                            const uint32_t **idx, size_t *n);
/* A piece's box in the full tensor, and its bytes. */
void wtx_plan_piece_box(const wtx_plan *p, const wtx_piece *piece, wtx_box *out);
uint64_t wtx_plan_piece_bytes(const wtx_plan *p, const wtx_piece *piece);
/* Bytes rank sends, and bytes worker receives, in all. */
uint64_t wtx_plan_rank_bytes(const wtx_plan *p, uint32_t rank);
uint64_t wtx_plan_worker_bytes(const wtx_plan *p, uint32_t worker);
/* The plan's identity: XXH3-64 over its inputs (the parameter table's
 * identity, every ownership, every worker's slices) and every piece. Two
 * sides with the same digest move the same bytes the same way. */
uint64_t wtx_plan_digest(const wtx_plan *p);

/* What ranks whose plan digests differ compare to find where: each
 * parameter's XXH3-64 of its name, dtype, shape and ownership (own may be
 * NULL: every rank owns every parameter), n of them into out. WTX_ENOMEM. */
int wtx_plan_param_digests(const wtx_tensor_meta *metas, const wtx_ownership *own, size_t n,
                           uint64_t *out);
/* Parameter m with ownership o (NULL: every rank) in words, into buf:
 * "'name' BF16 [4096, 1024], owners [0, 1, 2, 3] mesh [4] placements [0]"
 * (a placement is a tensor dim, or R for replicated); cut to len. */
void wtx_plan_param_describe(const wtx_tensor_meta *m, const wtx_ownership *o, char *buf,
                             size_t len);

/* ---- a tensor-parallel worker's slices, from rules ---- */

typedef enum wtx_shard_kind {
  WTX_SHARD_WHOLE = 0,  /* the whole tensor (replicated over the TP ranks) */
  WTX_SHARD_DIM = 1,    /* a torch.chunk slice of dim, in units */
  WTX_SHARD_EXPERT = 2, /* whole, on the rank that hosts its expert */
  WTX_SHARD_SKIP = 3,   /* nothing */
} wtx_shard_kind;

/* One rule: parameters whose name matches pattern (fnmatch(3), no flags)
 * are held as kind says (wtx.v1.ShardRule, whose values these are).
 * WTX_SHARD_DIM splits dim in units of unit entries (a head's rows; 0 or 1:
 * single entries): with U units and tp_size ranks, rank r holds
 * torch.chunk(U, tp_size)'s piece r when U >= tp_size, else the one unit
 * r * U / tp_size (ranks share it, as vLLM replicates KV heads when there
 * are fewer than ranks). WTX_SHARD_EXPERT takes the expert's index from the
 * number after "experts." in the name; with E experts (unit when set, else
 * the largest index the rule matches in the metadata, plus one) rank r
 * hosts torch.chunk(E, tp_size)'s piece r, as vLLM's expert parallelism
 * does. A parameter no rule matches is held whole. */
typedef struct wtx_shard_rule {
  const char *pattern;
  wtx_shard_kind kind;
  uint32_t dim;
  uint64_t unit;
} wtx_shard_rule;

/* What tp_rank of tp_size holds of m under rules (first match wins): 1
 * with *out set (param 0), 0 when it holds nothing of m, or WTX_EINVAL
 * naming the parameter (a dim past its dims, a dim not divisible into
 * units, an expert rule on a name without "experts.N" or an expert past
 * the count, a rule of a kind not in wtx_shard_kind) or tp_rank/tp_size. experts: E for expert rules without a
 * count (0: such a rule is an error). */
int wtx_shard_slice_of(const wtx_tensor_meta *m, const wtx_shard_rule *rules, size_t n_rules,
                       uint32_t tp_rank, uint32_t tp_size, uint64_t experts, wtx_slice *out,
                       char *err, size_t errlen);

/* wtx_shard_slice_of over metas[0..n), each slice's param its index in
 * metas, E for count-less expert rules found in metas: *out (malloc'd, the
 * caller frees it) gets *n_out slices, in metadata order. */
int wtx_shard_slices(const wtx_tensor_meta *metas, size_t n,
                     const wtx_shard_rule *rules, size_t n_rules,
                     uint32_t tp_rank, uint32_t tp_size, wtx_slice **out,
                     size_t *n_out, char *err, size_t errlen);

/* Checks rules for a worker that decides each tensor alone (the session):
 * tp_rank below tp_size, and every expert rule with its expert count.
 * WTX_EINVAL naming the rule otherwise. */
int wtx_shard_rules_check(const wtx_shard_rule *rules, size_t n_rules, uint32_t tp_rank,
                          uint32_t tp_size, char *err, size_t errlen);

/* Parses a rule file: one rule a line, "PATTERN KIND", KIND one of
 * "whole", "skip", "expert", "expert E", "dim D" or "dim D unit U"; blank
 * lines and lines starting with # are skipped. *rules (malloc'd, patterns
 * inside the same block) is the caller's to free(). WTX_EINVAL naming the
 * line. */
int wtx_shard_rules_parse(const char *text, wtx_shard_rule **rules,
                          size_t *n_rules, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_PLAN_H */
