/* A sync from many trainer ranks (engine.h, wtx_trainer_config.world): every
 * rank sends the bytes it owns straight to the workers that hold them, on a
 * plan made once at init, over tcp's many senders (transport/tcp_rank.h):
 * the bytes on the socket (tcp), through a ring in shared memory (shm) or
 * into the worker's receive region on its GPU (cuda_ipc); or by ncclSend in
 * one communicator of ranks and workers (transport/nccl_rank.h).
 *
 * Each worker's stream is its parts of the model in metadata order, begun
 * at a tensor of its own so the workers start on different ranks' links
 * (stream_start), and wrapped round. The plan (transport/plan.h)
 * cuts each part into pieces, one per owning rank; a piece must be one
 * contiguous run of the worker's part (a trainer sharding the dim a worker
 * slices, or an outer one), so the stream is a sequence of runs, each from
 * one rank, and a chunk never spans two ranks. Every rank computes the same
 * streams from the same inputs, which rank 0 checks at init before any
 * worker's session starts (wtx__tcp_rank_check names the first parameter
 * where a rank differs). Rank 0 drives the workers' sessions: per
 * chunk it sends UpdateWeights naming the chunk's sender, and the worker
 * reads that sender's connection; the senders write their chunks in stream
 * order, each ahead of the worker's reading as far as its socket allows.
 * So rank 0 moves no byte it does not own, and no rank waits on another
 * but through the workers. All workers prepare before any publishes; a
 * failure anywhere (a rank that dies closes its connections, and its
 * worker's UpdateWeights fails at once) aborts every worker's update. */
#include <grpc/status.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/engine.h"
#include "client/fanout.h"
#include "client/delta.h"
#include "client/source.h"
#include "common/clock.h"
#include "common/layout.h"
#include "common/patch.h"
#include "transport/nccl_rank.h"
#include "transport/plan.h"
#include "transport/tcp_frame.h"
#include "transport/tcp_rank.h"
#include "transport/transport.h"
#include "xxhash.h"

/* How a piece may travel as a patch (wtx__many.pform). */
enum { PATCH_NONE, PATCH_WHOLE, PATCH_SPAN, PATCH_BOX };

/* A seg's patch: the caller's (wtx__many_send_patches), at carena + off. */
enum { SEG_CALLER = 2 };

/* A run of a worker's stream: bytes [off, off + len) of piece `piece`
 * (packed, row-major in its box), landing in worker tensor `tensor`: as
 * the next run of the tensor's bytes, or, where box is not 0, as box
 * boxes[box - 1] of it (UpdateInfo.box); with patch, the bytes of this
 * sync's patch of the piece (the whole tensor, or a span of it); with
 * SEG_CALLER, the caller's patch of the tensor (piece unused). */
typedef struct seg {
  uint32_t piece, tensor, box, patch;
  uint64_t off, len;
} seg;

/* A chunk: segs [seg0, seg0 + nseg), all from rank `sender`, touching
 * worker tensors [first, first + count); or one seg that is a box. */
typedef struct mchunk {
  uint32_t sender, box;
  size_t first, count, seg0, nseg;
  uint64_t first_offset, bytes;
  uint64_t stream_offset; /* the bytes of the worker's stream before it */
} mchunk;

/* One worker's stream and the ParamMeta of its tensors. */
typedef struct wstream {
  size_t nt;
  uint32_t *param; /* per tensor: the parameter it is a part of */
  uint64_t table; /* the tensors' table (wtx__layout_xxh3), as the worker keeps it */
  Wtx__V1__ParamMeta *pm;
  Wtx__V1__ParamMeta **pmp;
  Wtx__V1__TensorPart *part;
  uint64_t *dims; /* storage of pm's shapes and part's full shapes and offsets */
  seg *segs;
  size_t nseg;
  wtx_box *boxes; /* in the worker's tensor's coordinates */
  size_t nboxes, boxcap;
  mchunk *chunks;
  size_t nchunks;
  uint64_t bytes; /* the stream's, in all */
  seg *runs; /* the runs the chunks were cut from (stream_segs'), for a delta's cut */
  size_t nruns;
  /* This sync's chunks: the stream's (whole), or a delta's of the tensors
   * it sends (owned: segs, chunks and, by chunk's first, the tensors'
   * ParamMeta). */
  const mchunk *vchunks;
  size_t nvchunks;
  const seg *vsegs;
  Wtx__V1__ParamMeta **vpmp;
  seg *dsegs;
  mchunk *dchunks;
  Wtx__V1__ParamMeta **dpmp;
  Wtx__V1__ParamMeta *dpm; /* a delta's patched tensors: their ParamMeta, */
  Wtx__V1__Patch *dpatch;  /* with the patch */
  Wtx__V1__PatchSpan *dspan, **dspanp; /* and its spans (a tensor several runs feed) */
  Wtx__V1__Box *dbox; /* a span's box (a tensor fed in boxes), */
  uint64_t *dboxdims; /* its offset and shape, 2 * WTX_MAX_DIMS a span */
} wstream;

struct wtx__many {
  uint32_t rank, world;
  /* Set by the first of a sync's jobs to fail: rank 0's calls still
   * waiting for a worker's answer end then, rather than when that worker
   * times out the bytes this sync will no longer send. */
  atomic_int failed;
  /* Another rank over tcp whose connections stood at the sync's start: it
   * sends at once, and this sync's go is read once its bytes are out (or
   * before a delta's ask). */
  int go_due;
  wtx_client *client;
  size_t n_workers;
  wtx_client **one; /* rank 0: a client of each worker alone */
  wtx_source *source;
  const wtx_tensor_meta *metas;
  size_t n;
  const wtx_ownership *own;
  wtx_plan *plan;
  wstream *ws;
  wtx__tcp_rank *tcp; /* tcp: the workers' connections; nccl: rank 0's link */
  /* nccl: the bytes go by ncclSend in one communicator of every rank and
   * worker, which rank 0 names in the go it sends each sync on its links
   * (links[r], rank 0 only) under a new generation whenever it made one. */
  int nccl;
  int shm; /* tcp's protocol, each sender's bytes through the worker's ring */
  int ipc; /* tcp's protocol, each sender's bytes into the worker's GPU region */
  wtx__nccl_rank *gpu;
  int *links;
  uint64_t generation;
  uint8_t id[WTX__NCCL_ID_BYTES];
  wtx_wire_params wire;
  uint8_t token[64];
  size_t token_len;
  char **addrs; /* world data addresses */
  int ready;    /* rank 0: the workers' sessions are initialized */
  /* What this rank owns of each parameter, worked out once at init:
   * owns[i] whether it is an owner, mine[i] its box. */
  uint8_t *owns;
  wtx_box *mine;
  uint64_t *param_digests; /* to find where another rank's plan differs */
  wtx__tcp_params params;  /* what this rank's tcp half knows of its plan and mode */
  /* Deltas (docs/data-plane.md, "Deltas with many senders"): each rank
   * hashes the pieces it sends (ph, this sync's; sent, what the workers
   * hold of them where sent_ok: the version rank 0 names as the base);
   * rank 0 asks every rank which changed (changed: a bit per piece of the
   * plan), and tells each the decision: whether every worker takes a
   * delta, then per worker a bit per tensor of its stream, the tensors
   * this sync sends. Syncs are numbered by rank 0 (seq, in the ask); a
   * rank's ph is of sync pending_seq and waits (pending) until an ask
   * names the last sync that landed (landed_seq, 0: none): sent once that
   * is its sync, dropped otherwise. On rank 0, based[w] is the version
   * that sync left on worker w: what every rank's record describes there,
   * through failed syncs after it, and the base a delta names. */
  int delta;
  size_t my_first, my_n;
  uint64_t *ph, *sent;
  int sent_ok, pending;
  uint8_t *changed, *theirs;
  size_t changed_len;
  uint8_t *decision;
  size_t decision_len;
  uint64_t seq, pending_seq, landed_seq;
  char (*based)[WTX_MAX_VERSION_BYTES + 1];
  /* Patches (WTX_DELTA_PATCHES): any piece (pform[p]: the whole worker
   * tensor, a span of one other runs feed too, or a box of one fed in
   * boxes) may travel as a patch of the piece, which its rank
   * makes from prev, its copy of the piece as the workers hold it (this
   * rank's k-th piece at prev_off[k], valid where prev_ok[k]; written
   * this sync where pend[k], valid once it lands). This sync's patch of
   * the rank's k-th piece: pmine[k] elements (0: none) at parena +
   * poff[k]; offered to rank 0 in the answer, whose decision sets
   * pcount[p], the patch piece p travels as (0: whole), and, on rank 0,
   * presult[p], its XXH3-64 once applied. Record buffers: answer (this
   * rank's), theirs_cap and decision_cap bytes at most. */
  int patches;
  uint8_t *pform, *prev, *prev_ok, *pend, *parena, *answer;
  uint64_t *prev_off, *pmine, *poff, *pcount, *presult;
  uint64_t parena_cap;
  size_t answer_len, theirs_cap, decision_cap, decided_len;
  uint8_t *full; /* rank 0, this sync: worker w takes the whole stream */
  char full_reason[512];
  /* The caller's patches (wtx__many_send_patches), rank 0 alone: each
   * worker's part of them in wire form at carena (carena_cap bytes);
   * names, the parameters by name, made at the first. Once they land no
   * rank's record of what the workers hold stands: rank 0 forgets its
   * own, and `forget` tells the others with the next delta's ask. */
  uint8_t *carena;
  uint64_t carena_cap;
  wtx__strmap *names;
  int forget;
  /* this sync: where this rank's part of each parameter is */
  const uint8_t **local;
  uint8_t **copies; /* parts the source did not keep (freed after the sync) */
  void *iter;       /* the sync's pass, open until its bytes are sent */
};

/* ---- the streams: a pure function of the plan ---- */

/* Worker w's tensor k: its part of parameter s->param, as ParamMeta. */
static void part_meta(wtx__many *m, wstream *st, size_t k, const wtx_slice *s) {
  const wtx_tensor_meta *full = &m->metas[s->param];
  wtx_box b;
  wtx_slice_box(full, s, &b);
  uint64_t *d = &st->dims[k * 3 * WTX_MAX_DIMS];
  Wtx__V1__ParamMeta *pm = &st->pm[k];
  wtx__v1__param_meta__init(pm);
  pm->name = (char *)full->name;
  pm->dtype = full->dtype;
  pm->n_shape = full->ndim;
  pm->shape = d;
  memcpy(d, b.len, full->ndim * sizeof *d);
  st->pmp[k] = pm;
  if (s->dim == WTX_SLICE_WHOLE) return;
  Wtx__V1__TensorPart *pt = &st->part[k];
  wtx__v1__tensor_part__init(pt);
  pt->n_full_shape = pt->n_offset = full->ndim;
  pt->full_shape = memcpy(d + WTX_MAX_DIMS, full->shape, full->ndim * sizeof *d);
  pt->offset = memcpy(d + 2 * WTX_MAX_DIMS, b.lo, full->ndim * sizeof *d);
  pm->part = pt;
}

/* A stream's order: by tensor; then runs by their place in it, boxes by
 * piece (a rank's in a row), each piece's in order. Every rank sorts the
 * same segs the same way. */
static int seg_order(const void *a, const void *b) {
  const seg *x = a, *y = b;
  if (x->tensor != y->tensor) return x->tensor < y->tensor ? -1 : 1;
  if (x->box != 0 && x->piece != y->piece) return x->piece < y->piece ? -1 : 1;
  if (x->off != y->off) return x->off < y->off ? -1 : 1;
  return x->piece < y->piece ? -1 : x->piece > y->piece;
}

/* Appends a box of the piece cut.proto is of, and its seg. */
typedef struct cut_arg {
  wstream *st;
  size_t *cap, es;
  seg proto;
  uint64_t off; /* the bytes of the piece's boxes so far */
} cut_arg;

/* Appends s to st's segs (room for *cap of them). */
static int seg_push(wstream *st, size_t *cap, seg s) {
  if (st->nseg == *cap) {
    seg *sg = realloc(st->segs, 2 * *cap * sizeof *sg);
    if (sg == NULL) return WTX_ENOMEM;
    st->segs = sg;
    *cap *= 2;
  }
  st->segs[st->nseg++] = s;
  return 0;
}

static int add_box(void *arg, const wtx_box *part) {
  cut_arg *a = arg;
  wstream *st = a->st;
  if (st->nboxes == st->boxcap) {
    size_t cap = st->boxcap ? 2 * st->boxcap : 64;
    wtx_box *bx = realloc(st->boxes, cap * sizeof *bx);
    if (bx == NULL) return WTX_ENOMEM;
    st->boxes = bx;
    st->boxcap = cap;
  }
  st->boxes[st->nboxes++] = *part;
  seg s = a->proto;
  s.box = (uint32_t)st->nboxes;
  s.off = a->off;
  s.len = wtx_box_elements(part) * a->es;
  a->off += s.len;
  return seg_push(st, a->cap, s);
}

/* Whether each of worker w's tensors (its slices sl, n_sl of them) comes
 * in boxes: where any of its pieces is not one run of it. *out: n_sl
 * flags, the caller's to free. */
static int boxed_tensors(wtx__many *m, const wtx_slice *sl, size_t n_sl, const uint32_t *idx,
                         size_t n, uint8_t **out) {
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  if ((*out = calloc(n_sl ? n_sl : 1, 1)) == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    const wtx_piece *p = &pieces[idx[i]];
    wtx_box part, box;
    uint64_t elem;
    wtx_slice_box(&m->metas[p->param], &sl[p->slice], &part);
    wtx_plan_piece_box(m->plan, p, &box);
    if (!wtx_box_contiguous(&part, &box, &elem)) (*out)[p->slice] = 1;
  }
  return 0;
}

/* Worker w's pieces as segs of its stream, in stream order (slice k is
 * the stream's tensor pos[k]). A piece that
 * is one run of the worker's part is one seg; a tensor with any piece
 * that is not comes in boxes, a piece's cut to fit a chunk each (each one
 * run of the piece's packed bytes, in order: wtx_box_cut), which
 * the worker scatters into its staging (many_staging: unless it refuses). */
static int stream_segs(wtx__many *m, uint32_t w, wstream *st, const wtx_slice *sl,
                       size_t n_sl, const uint32_t *pos) {
  const wtx_piece *pieces;
  const uint32_t *idx;
  size_t n, cap;
  uint8_t *boxed = NULL;
  wtx_plan_pieces(m->plan, &pieces);
  wtx_plan_worker_pieces(m->plan, w, &idx, &n);
  cap = n ? n : 1;
  st->segs = calloc(cap, sizeof *st->segs);
  int rc = st->segs != NULL ? boxed_tensors(m, sl, n_sl, idx, n, &boxed) : WTX_ENOMEM;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const wtx_piece *p = &pieces[idx[i]];
    const wtx_tensor_meta *full = &m->metas[p->param];
    size_t es = wtx_dtype_size(full->dtype);
    wtx_box part, box;
    uint64_t elem = 0;
    wtx_slice_box(full, &sl[p->slice], &part);
    wtx_plan_piece_box(m->plan, p, &box);
    seg proto = {.piece = idx[i], .tensor = pos[p->slice],
                 .len = wtx_plan_piece_bytes(m->plan, p)};
    if (!boxed[p->slice]) {
      wtx_box_contiguous(&part, &box, &elem);
      proto.off = elem * es;
      rc = seg_push(st, &cap, proto);
      continue;
    }
    for (size_t d = 0; d < box.ndim; d++) box.lo[d] -= part.lo[d];
    cut_arg a = {st, &cap, es, proto, 0};
    rc = wtx_box_cut(&box, es, m->wire.buffer_size, add_box, &a);
  }
  free(boxed);
  if (rc == 0) qsort(st->segs, st->nseg, sizeof *st->segs, seg_order);
  return rc;
}

/* Appends bytes [from, from + len) of run s to the open chunk c, as out's
 * next seg. */
static void chunk_add(mchunk *c, const seg *s, uint64_t from, uint64_t len, seg *out,
                      size_t *nout) {
  if (c->nseg == 0) {
    c->first = s->tensor;
    c->first_offset = s->box != 0 ? 0 : s->off + from;
  }
  c->count = s->tensor - c->first + 1;
  c->bytes += len;
  c->box = s->box;
  /* A run's off was its place in the tensor, a box's already in its piece. */
  out[(*nout)++] = (seg){.piece = s->piece, .tensor = s->tensor, .box = s->box,
                         .patch = s->patch, .off = s->box != 0 ? s->off + from : from,
                         .len = len};
  c->nseg++;
}

/* Whether run s (from sender) cannot join chunk c: a box is a chunk of
 * its own, and a patch lies within one chunk (it is at most max). */
static int chunk_full(const mchunk *c, uint32_t sender, const seg *s, uint64_t max) {
  return c == NULL || c->sender != sender || c->bytes == max || c->box != 0 || s->box != 0 ||
         (s->patch && c->bytes + s->len > max) ||
         s->tensor - c->first + 1 > WTX_MAX_CHUNK_PARAMS;
}

/* Bytes on the wire of a patch of count elements of piece p. */
static uint64_t patch_wire(const wtx__many *m, uint32_t p, uint64_t count) {
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  size_t es = wtx_dtype_size(m->metas[pieces[p].param].dtype);
  uint64_t elems = wtx_plan_piece_bytes(m->plan, &pieces[p]) / es;
  return wtx__patch_bytes(wtx__patch_index_dtype(elems), count, es);
}

/* Whether a patch record may name piece p with count elements: a piece
 * of the plan (pform: patches are on), 1..its elements, within a
 * buffer. */
static int patch_ok(const wtx__many *m, uint32_t p, uint64_t count) {
  const wtx_piece *pieces;
  size_t np = wtx_plan_pieces(m->plan, &pieces);
  if (p >= np || m->pform[p] == PATCH_NONE || count == 0) return 0;
  size_t es = wtx_dtype_size(m->metas[pieces[p].param].dtype);
  return count <= wtx_plan_piece_bytes(m->plan, &pieces[p]) / es &&
         patch_wire(m, p, count) <= m->wire.buffer_size;
}

/* The end of the runs of the tensor runs[i] is of (runs in stream order,
 * n in all, each tensor's together): the first run past i of another. */
static size_t runs_end(const seg *runs, size_t n, size_t i) {
  size_t j = i + 1;
  while (j < n && runs[j].tensor == runs[i].tensor) j++;
  return j;
}

/* Whether any run of the tensor runs[i] begins travels as a patch: of its
 * piece with pcount[piece]. */
static int tensor_patched(const seg *runs, size_t n, size_t i, const uint64_t *pcount) {
  for (size_t j = i, end = runs_end(runs, n, i); pcount != NULL && j < end; j++)
    if (pcount[runs[j].piece] > 0) return 1;
  return 0;
}

/* A seg that stands for a tensor of no bytes: no plan piece has it. */
#define NO_PIECE UINT32_MAX

/* Tensor t, of no bytes (no piece, so no run), as a seg of none in the
 * chunk open where it falls when it may ride there, else in a new chunk
 * from sender at the stream's bytes so far: every tensor of a stream is
 * then in a chunk, and that chunk's sender hashes its empty span as the
 * worker counts it. Returns the chunk it went in. */
static mchunk *add_empty(mchunk *c, mchunk *ch, size_t *nc, uint32_t t, uint32_t sender,
                         seg *out, size_t *nout) {
  if (c == NULL || c->box != 0 || t - c->first + 1 > WTX_MAX_CHUNK_PARAMS) {
    uint64_t at = c != NULL ? c->stream_offset + c->bytes : 0;
    c = &ch[(*nc)++];
    *c = (mchunk){.sender = sender, .seg0 = *nout, .stream_offset = at};
  }
  seg e = {.piece = NO_PIECE, .tensor = t};
  chunk_add(c, &e, 0, 0, out, nout);
  return c;
}

/* Cuts runs (n, in stream order) into chunks: a chunk ends where the
 * sender changes, at max bytes, or at WTX_MAX_CHUNK_PARAMS tensors. Only
 * the runs of tensors sub names (sub[k]: tensor k's place among those
 * sent, UINT32_MAX: not sent; NULL: every tensor, in place) are kept, and
 * a run of a piece with pcount[piece] (pcount may be NULL) is its patch
 * instead; the other runs of a patched tensor are not sent (a patch of
 * spans: their bytes are the base's). The runs become the chunks' segs
 * (off: into the piece, or its patch); *bytes: the stream's. nt (with sub
 * NULL): the stream's tensors, those with no run (no bytes) each in a
 * chunk of its own place (add_empty); 0: none added. */
static int cut_chunks(const wtx__many *m, const seg *runs, size_t n, const uint32_t *sub,
                      const uint64_t *pcount, uint64_t max, size_t nt, seg **segs,
                      size_t *nseg, mchunk **chunks, size_t *nchunks, uint64_t *bytes) {
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  /* A run yields at most len / max + 2 segs: the rest of an open chunk,
   * whole chunks, and a start of one. */
  size_t cap = 1 + 2 * nt, nout = 0;
  for (size_t i = 0; i < n; i++) cap += runs[i].len / max + 2;
  seg *out = malloc(cap * sizeof *out);
  mchunk *ch = calloc(cap, sizeof *ch);
  if (out == NULL || ch == NULL) {
    free(out);
    free(ch);
    return WTX_ENOMEM;
  }
  mchunk *c = NULL;
  size_t nc = 0;
  int patched = 0;
  uint64_t wire = 0; /* a patched tensor's bytes on the wire so far */
  uint32_t next = 0; /* with nt: the first tensor not in a chunk yet */
  for (size_t i = 0; i < n; i++) {
    seg s = runs[i];
    for (; nt > 0 && next < s.tensor; next++)
      c = add_empty(c, ch, &nc, next, pieces[s.piece].rank, out, &nout);
    if (nt > 0 && s.tensor >= next) next = s.tensor + 1;
    if (i == 0 || runs[i].tensor != runs[i - 1].tensor) {
      patched = tensor_patched(runs, n, i, pcount);
      wire = 0;
    }
    if (sub != NULL && (s.tensor = sub[s.tensor]) == UINT32_MAX) continue;
    if (patched && pcount[s.piece] == 0) continue;
    /* A piece of a tensor fed in boxes is several runs: its patch is one. */
    if (patched && i > 0 && runs[i - 1].tensor == runs[i].tensor &&
        runs[i - 1].piece == runs[i].piece)
      continue;
    if (patched) {
      s = (seg){.piece = s.piece, .tensor = s.tensor, .patch = 1, .off = wire,
                .len = patch_wire(m, s.piece, pcount[s.piece])};
      wire += s.len;
    }
    uint32_t sender = pieces[s.piece].rank;
    for (uint64_t done = 0; done < s.len;) {
      if (chunk_full(c, sender, &s, max)) {
        uint64_t at = c != NULL ? c->stream_offset + c->bytes : 0;
        c = &ch[nc++];
        *c = (mchunk){.sender = sender, .seg0 = nout, .stream_offset = at};
      }
      uint64_t k = s.len - done < max - c->bytes ? s.len - done : max - c->bytes;
      chunk_add(c, &s, done, k, out, &nout);
      done += k;
    }
  }
  for (; next < nt; next++) c = add_empty(c, ch, &nc, next, c != NULL ? c->sender : 0, out, &nout);
  *segs = out;
  *nseg = nout;
  *chunks = ch;
  *nchunks = nc;
  *bytes = c != NULL ? c->stream_offset + c->bytes : 0;
  return 0;
}

/* Cuts the stream's runs into its chunks (the runs are kept). */
static int stream_chunks(wtx__many *m, wstream *st, uint64_t max) {
  st->runs = st->segs;
  st->nruns = st->nseg;
  st->segs = NULL;
  return cut_chunks(m, st->runs, st->nruns, NULL, NULL, max, st->nt, &st->segs, &st->nseg,
                    &st->chunks, &st->nchunks, &st->bytes);
}

/* The stream's table as a worker records it once the update lands: its
 * tensors in order, as their ParamMeta say. A later sync to a worker that
 * announces it names tensors by position (UpdateInfo.layout). */
static int stream_table(wstream *st) {
  wtx_tensor_meta *t = calloc(st->nt + 1, sizeof *t);
  if (t == NULL) return WTX_ENOMEM;
  char why[256];
  for (size_t k = 0; k < st->nt; k++) {
    const Wtx__V1__ParamMeta *pm = &st->pm[k];
    wtx_tensor_meta_set(&t[k], pm->name, pm->dtype, pm->shape, pm->n_shape, why, sizeof why);
  }
  st->table = wtx__layout_xxh3(t, st->nt);
  free(t);
  return 0;
}

/* Where worker w's stream begins: at its first slice that rank w % world
 * sends a piece of (0 when none). Every worker reads its stream in
 * order, and a rank can send only so far ahead of that reading (the
 * workers' read-ahead); were every stream in metadata order, the workers
 * would all read the first ranks' tensors first, one link carrying every
 * worker's bytes while the others wait (a pipeline's stages own runs of
 * layers). Begun at different ranks, the links carry one worker each. */
static size_t stream_start(const wtx__many *m, uint32_t w) {
  const wtx_piece *pieces;
  const uint32_t *idx;
  size_t n, start = SIZE_MAX;
  wtx_plan_pieces(m->plan, &pieces);
  wtx_plan_worker_pieces(m->plan, w, &idx, &n);
  for (size_t i = 0; i < n; i++)
    if (pieces[idx[i]].rank == w % m->world && pieces[idx[i]].slice < start)
      start = pieces[idx[i]].slice;
  return start == SIZE_MAX ? 0 : start;
}

/* Worker w's stream: its tensors (slices sl, n_sl of them, metadata order
 * from stream_start's on, then those before it), their ParamMeta, and its
 * chunks. */
static int stream_make(wtx__many *m, uint32_t w, const wtx_slice *sl, size_t n_sl) {
  wstream *st = &m->ws[w];
  st->nt = n_sl;
  st->pm = calloc(n_sl + 1, sizeof *st->pm);
  st->pmp = calloc(n_sl + 1, sizeof *st->pmp);
  st->part = calloc(n_sl + 1, sizeof *st->part);
  st->param = calloc(n_sl + 1, sizeof *st->param);
  st->dims = calloc((n_sl + 1) * 3 * WTX_MAX_DIMS, sizeof *st->dims);
  uint32_t *pos = calloc(n_sl + 1, sizeof *pos);
  int rc = st->pm && st->pmp && st->part && st->param && st->dims && pos ? 0 : WTX_ENOMEM;
  size_t start = rc == 0 ? stream_start(m, w) : 0;
  for (size_t k = 0; rc == 0 && k < n_sl; k++) {
    pos[k] = (uint32_t)((k + n_sl - start) % n_sl);
    st->param[pos[k]] = sl[k].param;
    part_meta(m, st, pos[k], &sl[k]);
  }
  if (rc == 0) rc = stream_table(st);
  if (rc == 0) rc = stream_segs(m, w, st, sl, n_sl, pos);
  free(pos);
  return rc != 0 ? rc : stream_chunks(m, st, m->wire.buffer_size);
}

/* A delta's view of the stream (view_some's). */
static void view_free(wstream *st) {
  free(st->dpmp);
  free(st->dsegs);
  free(st->dchunks);
  free(st->dpm);
  free(st->dpatch);
  free(st->dspan);
  free(st->dspanp);
  free(st->dbox);
  free(st->dboxdims);
  st->dbox = NULL;
  st->dboxdims = NULL;
  st->dpmp = NULL;
  st->dsegs = NULL;
  st->dchunks = NULL;
  st->dpm = NULL;
  st->dpatch = NULL;
  st->dspan = NULL;
  st->dspanp = NULL;
}

static void stream_free(wstream *st) {
  free(st->param);
  free(st->pm);
  free(st->pmp);
  free(st->part);
  free(st->dims);
  free(st->segs);
  free(st->runs);
  free(st->boxes);
  free(st->chunks);
  view_free(st);
}
/* ---- the rendezvous ---- */

/* Ends the sync's pass and frees its copies. */
static void pass_release(wtx__many *m) {
  if (m->iter != NULL) wtx_source_close(m->source, m->iter);
  m->iter = NULL;
  for (size_t i = 0; i < m->n; i++) {
    free(m->copies[i]);
    m->copies[i] = NULL;
    m->local[i] = NULL;
  }
}

void wtx__many_destroy(wtx__many *m) {
  if (m == NULL) return;
  if (m->local != NULL && m->copies != NULL) pass_release(m);
  for (size_t w = 0; m->ws != NULL && w < m->n_workers; w++) stream_free(&m->ws[w]);
  for (size_t w = 0; m->one != NULL && w < m->n_workers; w++) wtx_client_destroy(m->one[w]);
  for (uint32_t r = 0; m->addrs != NULL && r < m->world; r++) free(m->addrs[r]);
  wtx__tcp_rank_destroy(m->tcp);
  wtx__nccl_rank_destroy(m->gpu);
  for (uint32_t r = 0; m->links != NULL && r < m->world; r++)
    if (m->links[r] >= 0) close(m->links[r]);
  free(m->links);
  wtx_plan_destroy(m->plan);
  free(m->ws);
  free(m->one);
  free(m->addrs);
  free(m->local);
  free(m->copies);
  free(m->owns);
  free(m->mine);
  free(m->param_digests);
  free(m->ph);
  free(m->sent);
  free(m->changed);
  free(m->theirs);
  free(m->decision);
  free(m->full);
  free(m->based);
  free(m->pform);
  free(m->prev);
  free(m->prev_ok);
  free(m->pend);
  free(m->parena);
  free(m->carena);
  wtx__strmap_destroy(m->names);
  free(m->answer);
  free(m->prev_off);
  free(m->pmine);
  free(m->poff);
  free(m->pcount);
  free(m->presult);
  free(m);
}

/* The config's fields for many senders, checked and copied. */
static int many_config(wtx__many *m, const wtx_trainer_config *cfg, char *err, size_t errlen) {
  const char *tok = cfg->session_token;
  size_t tl = tok != NULL ? strlen(tok) : 0;
  m->nccl = cfg->backend != NULL && strcmp(cfg->backend, "nccl") == 0;
  m->delta = cfg->delta == WTX_DELTA_TENSORS || cfg->delta == WTX_DELTA_PATCHES;
  m->patches = cfg->delta == WTX_DELTA_PATCHES;
  m->shm = cfg->backend != NULL && strcmp(cfg->backend, "shm") == 0;
  m->ipc = cfg->backend != NULL && strcmp(cfg->backend, "cuda_ipc") == 0;
  if (cfg->backend != NULL && strcmp(cfg->backend, "tcp") != 0 && !m->nccl && !m->shm &&
      !m->ipc) {
    snprintf(err, errlen, "trainer_init: world %u: many senders run over tcp, shm, cuda_ipc "
             "or nccl, not %s", cfg->world, cfg->backend);
    return WTX_EINVAL;
  }
  if (cfg->rank >= cfg->world || cfg->rank_addresses == NULL || tl < 16 || tl > 64) {
    snprintf(err, errlen, "trainer_init: world %u needs rank below it (%u), rank_addresses "
             "(one per rank) and a session_token of 16..64 bytes (%zu)", cfg->world,
             cfg->rank, tl);
    return WTX_EINVAL;
  }
  m->token_len = tl;
  memcpy(m->token, tok, tl);
  m->addrs = calloc(cfg->world, sizeof *m->addrs);
  for (uint32_t r = 0; m->addrs != NULL && r < cfg->world; r++)
    if ((m->addrs[r] = strdup(cfg->rank_addresses[r])) == NULL) return WTX_ENOMEM;
  if (m->addrs == NULL) return WTX_ENOMEM;
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  Wtx__V1__PackingParams pk = WTX__V1__PACKING_PARAMS__INIT;
  pk.packed = 1;
  pk.buffer_size_bytes = cfg->buffer_size ? cfg->buffer_size : WTX_DEFAULT_BUFFER_SIZE;
  pk.num_buffers = 1;
  ii.packing = &pk;
  ii.checksum = (Wtx__V1__ChecksumAlgorithm)cfg->checksum;
  ii.timeout_ms = cfg->timeout_ms;
  int rc = wtx_wire_params_from_init(&ii, m->nccl ? WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE
                                                  : WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64,
                                     &m->wire, err, errlen);
  return rc;
}

/* Every worker's parts, then the plan over them (refusing an orphan, an
 * ownership past the world, ... by name), then the workers' streams. */
static int many_plan(wtx__many *m, char *err, size_t errlen) {
  size_t nw = m->n_workers;
  Wtx__V1__ShardSpec **specs = calloc(nw, sizeof *specs);
  wtx_slice **needs = calloc(nw, sizeof *needs);
  size_t *n_needs = calloc(nw, sizeof *n_needs);
  int rc = specs && needs && n_needs ? wtx__client_shards(m->client, specs) : WTX_ENOMEM;
  if (rc != 0 && rc != WTX_ENOMEM) snprintf(err, errlen, "%s", wtx_client_last_error(m->client));
  for (size_t w = 0; rc == 0 && w < nw; w++)
    rc = wtx__replica_slices(specs[w], m->metas, m->n, w, &needs[w], &n_needs[w], err, errlen);
  if (rc == 0) {
    wtx_plan_input in = {.metas = m->metas, .owners = m->own, .n = m->n, .n_ranks = m->world,
                         .n_workers = (uint32_t)nw, .needs = (const wtx_slice *const *)needs,
                         .n_needs = n_needs};
    rc = wtx_plan_make(&in, &m->plan, err, errlen);
  }
  for (size_t w = 0; rc == 0 && w < nw; w++)
    rc = stream_make(m, (uint32_t)w, needs[w], n_needs[w]);
  for (size_t w = 0; w < nw; w++) {
    if (specs != NULL && specs[w] != NULL) protobuf_c_message_free_unpacked(&specs[w]->base, NULL);
    if (needs != NULL) free(needs[w]);
  }
  free(specs);
  free(needs);
  free(n_needs);
  return rc;
}

static int many_check(wtx__many *m, char *err, size_t errlen);
static int many_go(wtx__many *m, char *err, size_t errlen);
static int delta_open(wtx__many *m);

/* Rank 0: worker w's session, as its init answered, against its stream:
 * a worker that refuses boxes must get none (its session would refuse the
 * first). */
static int many_staging(const wtx__many *m, size_t w,
                        const Wtx__V1__InitWeightTransferEngineResponse *resp, char *err,
                        size_t errlen) {
  const wstream *st = &m->ws[w];
  if (!resp->refuses_boxes || st->nboxes == 0) return 0;
  const seg *s = st->segs;
  while (s->box == 0) s++;
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  snprintf(err, errlen, "many senders: '%s' reaches worker %zu (%s) in boxes (rank %u's piece "
           "is not one run of the worker's part: the trainer shards a dim inside the one the "
           "worker keeps), and that worker's model adopts tensors in place on its GPU, where "
           "boxes cannot be scattered; one that stages them takes boxes", st->pm[s->tensor].name, w,
           wtx_client_target(m->client, w), pieces[s->piece].rank);
  return WTX_ENOTSUP;
}

/* Rank 0: every worker's session, connected to every rank (tcp), or
 * joined with every rank in a new communicator (nccl). */
static int many_sessions(wtx__many *m, char *err, size_t errlen) {
  int rc = 0;
  size_t started = 0;
  if (m->nccl && (rc = wtx__nccl_rank_new_id(m->gpu, m->id, err, errlen)) == 0) {
    m->generation++;
    rc = many_go(m, err, errlen); /* the ranks join as the workers do */
  }
  while (rc == 0 && started < m->n_workers) {
    Wtx__V1__TcpInitInfo ti = WTX__V1__TCP_INIT_INFO__INIT;
    Wtx__V1__NcclInitInfo ni = WTX__V1__NCCL_INIT_INFO__INIT;
    Wtx__V1__PackingParams pk;
    Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
    wtx_wire_params_to_init(&m->wire, &pk, &ii);
    ti.upstream_address = m->addrs[0];
    ti.n_sender_addresses = m->world - 1;
    ti.sender_addresses = &m->addrs[1];
    ti.data_token = (ProtobufCBinaryData){m->token_len, m->token};
    ti.checksum_trailer = 1;
    ti.worker_index = (uint32_t)started;
    ti.plan_digest = wtx_plan_digest(m->plan);
    ti.shm_ring = m->shm;
    /* cuda_ipc: the worker's stream lands in a region of its size (one
     * byte for a worker with no parts: it still shows each rank a region) */
    uint64_t stream = m->ws[started].bytes;
    ti.cuda_region_bytes = !m->ipc ? 0 : stream > 0 ? stream : 1;
    /* shm: the same in host memory, which a worker makes only where its
     * model reads tensors in place (else rings) */
    ti.shm_region_bytes = !m->shm ? 0 : stream > 0 ? stream : 1;
    ni.unique_id = (ProtobufCBinaryData){sizeof m->id, m->id};
    ni.world_size = m->world + (uint32_t)m->n_workers;
    ni.rank_offset = m->world + (uint32_t)started;
    ni.senders = m->world;
    ii.backend_case = m->nccl ? WTX__V1__INIT_INFO__BACKEND_NCCL : WTX__V1__INIT_INFO__BACKEND_TCP;
    if (m->nccl) ii.nccl = &ni; /* one member of the backend oneof */
    else ii.tcp = &ti;
    rc = wtx__client_init_start(m->one[started], 0, &ii);
    if (rc != 0) snprintf(err, errlen, "%s", wtx_client_last_error(m->one[started]));
    started += rc == 0; /* every call in flight is waited for */
  }
  int arc = rc != 0 ? 0
            : m->nccl ? wtx__nccl_rank_join(m->gpu, m->id, (int)(m->world + m->n_workers), 0,
                                            err, errlen)
                      : wtx__tcp_rank_accept(m->tcp, err, errlen);
  for (size_t w = 0; w < started; w++) {
    Wtx__V1__InitWeightTransferEngineResponse *resp = NULL;
    int wrc = wtx__client_init_wait(m->one[w], 0, &resp);
    if (wrc != 0 && rc == 0) {
      rc = wrc;
      snprintf(err, errlen, "%s", wtx_client_last_error(m->one[w]));
    }
    if (wrc == 0 && rc == 0) rc = many_staging(m, w, resp, err, errlen);
    if (resp != NULL) protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  if (rc == 0) rc = arc;
  m->ready = rc == 0;
  return rc;
}

/* Rank 0: a client of each worker alone, for its chunks' calls. */
static int many_clients(wtx__many *m) {
  m->one = calloc(m->n_workers, sizeof *m->one);
  if (m->one == NULL) return WTX_ENOMEM;
  for (size_t w = 0; w < m->n_workers; w++) {
    int rc = wtx__client_subset(m->client, &w, 1, &m->one[w]);
    if (rc != 0) return rc;
  }
  return 0;
}

/* What this rank owns of each parameter (owns, mine). */
static int many_mine(wtx__many *m) {
  m->owns = malloc(m->n + 1);
  m->mine = malloc((m->n + 1) * sizeof *m->mine);
  if (m->owns == NULL || m->mine == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < m->n; i++)
    m->owns[i] = (uint8_t)wtx_ownership_rank_box(&m->metas[i], m->own ? &m->own[i] : NULL,
                                                 m->rank, &m->mine[i]);
  return 0;
}

static void describe_param(void *arg, size_t i, char *buf, size_t len) {
  const wtx__many *m = arg;
  wtx_plan_param_describe(&m->metas[i], m->own != NULL ? &m->own[i] : NULL, buf, len);
}

/* Rank 0: every other rank planned this sync as rank 0 did, or the init
 * fails naming the first parameter where one differs, before any worker's
 * session starts; the check stays open as that rank's link (made again
 * when the rank is gone). */
static int many_check(wtx__many *m, char *err, size_t errlen) {
  int rc = 0;
  for (uint32_t r = 1; rc == 0 && r < m->world; r++) {
    if (m->links[r] >= 0 && !wtx__tcp_link_alive(m->links[r])) {
      close(m->links[r]); /* that rank is gone: link its successor */
      m->links[r] = -1;
    }
    if (m->links[r] < 0)
      rc = wtx__tcp_rank_check(m->addrs[r], r, m->token, m->token_len, wtx_plan_digest(m->plan),
                               &m->params, m->wire.timeout_ms, &m->links[r], err,
                               errlen);
  }
  return rc;
}

/* Rank 0: the sync's go to every other rank, on links checked (and made
 * again) first; with nccl it names the communicator. A link that fails is
 * closed, and the next sync makes a new session. */
static int many_go(wtx__many *m, char *err, size_t errlen) {
  int rc = many_check(m, err, errlen);
  for (uint32_t r = 1; rc == 0 && r < m->world; r++) {
    rc = wtx__tcp_link_go(m->links[r], m->generation, m->nccl ? m->id : NULL,
                          m->nccl ? sizeof m->id : 0, m->wire.timeout_ms, err, errlen);
    if (rc != 0) {
      close(m->links[r]);
      m->links[r] = -1;
    }
  }
  return rc;
}

/* Another rank: rank 0's go for this sync (payload: cap bytes at most,
 * *len of them), on its link, linked again when it is down. A link that
 * closes before the go is an earlier sync's, closed when that sync failed
 * there: rank 0 links again for this one, within the timeout. So once the
 * go is in, the link closing means this sync failed on rank 0. */
static int take_go(wtx__many *m, uint64_t *gen, uint8_t *payload, size_t cap, size_t *len,
                   char *err, size_t errlen) {
  int64_t until = wtx__clock_ms() + m->wire.timeout_ms;
  for (;;) {
    int rc = wtx__tcp_rank_accept_link(m->tcp, err, errlen);
    if (rc == 0) rc = wtx__tcp_rank_go(m->tcp, gen, payload, cap, len, err, errlen);
    if (rc != WTX_EIO || wtx__clock_ms() >= until) return rc;
  }
}

/* Another rank over tcp, its connections standing at the sync's start:
 * this sync's go, which rank 0 sent at its start. The link closed instead
 * means rank 0 failed the sync before the bytes moved. */
static int read_go(wtx__many *m, char *err, size_t errlen) {
  if (!m->go_due) return 0;
  m->go_due = 0;
  uint64_t gen = 0;
  size_t len = 0;
  int rc = wtx__tcp_rank_go(m->tcp, &gen, NULL, 0, &len, err, errlen);
  if (rc == WTX_EIO)
    snprintf(err, errlen, "tcp: rank 0 ended this sync (it closed its link to this rank "
             "before the sync's go)");
  return rc;
}

/* Another rank over tcp, once its bytes are out: the watch many_connect
 * began ends, *ended 1 when rank 0 closed the link meanwhile. That close
 * is this rank's error where it cut the rank's own work short (a wait it
 * cancelled); where every byte was out the rank's part stands, as another
 * rank's result says (rank 0 failed the sync after it, or landed it and
 * shut down before this rank looked). */
static int watch_end(wtx__many *m, int rc, int *ended, char *err, size_t errlen) {
  *ended = wtx__tcp_rank_unwatch(m->tcp);
  if (!*ended || rc != WTX_ECANCELED) return rc;
  snprintf(err, errlen, "tcp: rank 0 ended this sync (it closed its link to this rank)");
  return WTX_EABORTED;
}

/* Another rank, nccl: rank 0's go, and the communicator it names joined
 * when it is a new one (or this rank's failed). */
static int many_take_go(wtx__many *m, char *err, size_t errlen) {
  uint64_t gen = 0;
  size_t len = 0;
  int rc = take_go(m, &gen, m->id, sizeof m->id, &len, err, errlen);
  if (rc == 0 && len != sizeof m->id) {
    snprintf(err, errlen, "nccl: rank 0's go carries %zu bytes, not a communicator id", len);
    rc = WTX_EPROTO;
  }
  if (rc != 0 || (gen == m->generation && wtx__nccl_rank_ready(m->gpu))) return rc;
  if (gen == m->generation) {
    /* Its communicator cannot be joined twice: this sync fails, so rank 0's
     * does too, and rank 0 makes a new one for the next. */
    snprintf(err, errlen, "nccl: this rank's communicator failed in an earlier sync, and rank "
             "0 still names it (generation %llu)", (unsigned long long)gen);
    return WTX_ESTATE;
  }
  m->generation = gen;
  return wtx__nccl_rank_join(m->gpu, m->id, (int)(m->world + m->n_workers), (int)m->rank, err,
                             errlen);
}

/* nccl: this rank's GPU side, and on rank 0 its links (none yet). */
static int many_nccl_open(wtx__many *m, char *err, size_t errlen) {
  return wtx__nccl_rank_open(m->wire.buffer_size, m->wire.timeout_ms, &m->gpu, err, errlen);
}

static int many_open(wtx__many *m, const wtx_trainer_config *cfg, char *err, size_t errlen) {
  int rc = many_config(m, cfg, err, errlen);
  if (rc == 0) rc = wtx_source_metadata(m->source, &m->metas, &m->n);
  size_t n_own = 0;
  if (rc == 0) rc = wtx_source_ownership(m->source, &m->own, &n_own);
  if (rc == 0 && m->own != NULL && n_own != m->n) {
    snprintf(err, errlen, "trainer_init: the source's ownership has %zu entries, its "
             "metadata %zu", n_own, m->n);
    rc = WTX_EINVAL;
  }
  if (rc == 0) rc = many_plan(m, err, errlen);
  if (rc == 0) rc = many_mine(m);
  m->local = rc == 0 ? calloc(m->n + 1, sizeof *m->local) : NULL;
  m->copies = m->local != NULL ? calloc(m->n + 1, sizeof *m->copies) : NULL;
  if (rc == 0 && m->copies == NULL) rc = WTX_ENOMEM;
  if (rc == 0 && (m->param_digests = malloc((m->n + 1) * sizeof *m->param_digests)) == NULL)
    rc = WTX_ENOMEM;
  if (rc == 0) rc = wtx_plan_param_digests(m->metas, m->own, m->n, m->param_digests);
  /* A link from rank 0 to every other rank: nccl's go, a delta's exchange,
   * and rank 0's word that a sync failed (it closes the link), which ends
   * a rank's wait for workers that will not come (rank 0's own port takes
   * only workers). */
  m->params = (wtx__tcp_params){m->param_digests, m->n, describe_param, m,
                                m->nccl || m->rank != 0, m->shm, m->ipc};
  char bound[300];
  if (rc == 0)
    rc = wtx__tcp_rank_listen(m->addrs[m->rank], m->token, m->token_len,
                              wtx_plan_digest(m->plan), &m->params, m->nccl ? 0 : m->n_workers,
                              m->wire.timeout_ms, &m->tcp, bound, sizeof bound, err, errlen);
  if (rc == 0 && m->rank == 0 &&
      (m->links = malloc(m->world * sizeof *m->links)) == NULL)
    rc = WTX_ENOMEM;
  for (uint32_t r = 0; m->links != NULL && r < m->world; r++) m->links[r] = -1;
  if (rc == 0 && m->delta) rc = delta_open(m);
  if (rc == 0 && m->nccl) rc = many_nccl_open(m, err, errlen);
  if (rc == 0 && m->rank == 0) rc = many_check(m, err, errlen);
  /* nccl: every sync starts with a go, which names the communicator; the
   * first sync's makes it, so the sessions start then, not here. */
  if (rc == 0 && m->rank == 0 && (rc = many_clients(m)) == 0 && !m->nccl)
    rc = many_sessions(m, err, errlen);
  if (rc == 0 && m->rank != 0) rc = wtx__tcp_rank_accept(m->tcp, err, errlen);
  return rc;
}

int wtx__many_create(const wtx_trainer_config *cfg, wtx_client *client, wtx_source *source,
                     wtx__many **out, char *err, size_t errlen) {
  *out = NULL;
  if (client == NULL || source == NULL || wtx_client_size(client) == 0) {
    snprintf(err, errlen, "trainer_init: many senders need a client of the workers and a "
             "source on every rank");
    return WTX_EINVAL;
  }
  wtx__many *m = calloc(1, sizeof *m);
  if (m == NULL) return WTX_ENOMEM;
  m->rank = cfg->rank;
  m->world = cfg->world;
  m->client = client;
  m->n_workers = wtx_client_size(client);
  m->source = source;
  m->ws = calloc(m->n_workers, sizeof *m->ws);
  int rc = m->ws != NULL ? many_open(m, cfg, err, errlen) : WTX_ENOMEM;
  if (rc != 0) {
    if (rc == WTX_ENOMEM && err[0] == '\0') snprintf(err, errlen, "trainer_init: out of memory");
    wtx__many_destroy(m);
    return rc;
  }
  *out = m;
  return 0;
}

/* ---- one sync ---- */

/* A yielded tensor against this rank's part of parameter i. */
static int check_yield(const wtx__many *m, size_t i, const wtx_tensor_meta *got, char *err,
                       size_t errlen) {
  const wtx_box *box = &m->mine[i];
  int owns = m->owns[i];
  int same = owns && got->dtype == m->metas[i].dtype && got->ndim == box->ndim;
  for (size_t d = 0; same && d < box->ndim; d++) same = got->shape[d] == box->len[d];
  if (same) return 0;
  snprintf(err, errlen, "rank %u's pass: '%s' is not this rank's part of it (%s)", m->rank,
           got->name, owns ? "dtype or shape differ from its ownership's box"
                           : "the ownership gives this rank none of it");
  return WTX_EINVAL;
}


/* One pass over this rank's source: where its part of each parameter is
 * (local[i]), kept until the sync ends (copied when the source keeps it
 * only until its next call). Every part the rank owns must come. */
static int many_pass(wtx__many *m, char *err, size_t errlen) {
  void *iter = NULL;
  int rc = wtx_source_open(m->source, &iter);
  for (size_t i = 0; rc == 0;) {
    wtx_tensor_meta meta;
    wtx__tensor_data d;
    int r = wtx__source_next(m->source, iter, 1, &meta, &d);
    if (r <= 0) {
      rc = r;
      break;
    }
    while (i < m->n && strcmp(m->metas[i].name, meta.name) != 0) i++;
    if (i == m->n) {
      snprintf(err, errlen, "rank %u's pass: '%s' is not in the metadata, or out of its "
               "order", m->rank, meta.name);
      rc = WTX_EINVAL;
    } else if ((rc = check_yield(m, i, &meta, err, errlen)) == 0 && !d.stays) {
      if ((m->copies[i] = malloc(meta.nbytes)) == NULL) rc = WTX_ENOMEM;
      else memcpy(m->copies[i], d.host, meta.nbytes);
    }
    if (rc == 0) m->local[i] = m->copies[i] != NULL ? m->copies[i] : d.host;
    i++;
  }
  m->iter = iter; /* what the pass yielded stays valid until it is closed */
  for (size_t i = 0; rc == 0 && i < m->n; i++)
    if (m->local[i] == NULL && m->owns[i] && wtx_box_elements(&m->mine[i]) > 0) {
      snprintf(err, errlen, "rank %u's pass did not yield its part of '%s'", m->rank,
               m->metas[i].name);
      rc = WTX_EINVAL;
    }
  return rc;
}

/* What one worker's thread does in a sync. */
typedef struct wjob {
  wtx__many *m;
  uint32_t w;
  int control; /* rank 0's UpdateWeights calls, else this rank's bytes */
  int rc;
  uint64_t bytes;
  size_t chunks;
  char err[800];
} wjob;

/* Pieces gathered from this rank's part (those not one run of it), each
 * in a buffer of its own: a chunk's iov points into every one its segs
 * use until the chunk is sent, so one buffer for all would hand the chunk
 * the last piece's bytes in place of the others'. */
typedef struct gathered {
  struct gathered_piece {
    uint8_t *buf;
    uint32_t piece;
  } *v;
  size_t n, cap;
} gathered;

/* Frees every buffer but the last gathered, which the next chunk may go
 * on with (a piece's segs are consecutive in a stream); all with all. */
static void gathered_drop(gathered *g, int all) {
  size_t keep = !all && g->n > 0;
  for (size_t i = 0; i + keep < g->n; i++) free(g->v[i].buf);
  if (keep) g->v[0] = g->v[g->n - 1];
  g->n = keep;
  if (!all) return;
  free(g->v);
  *g = (gathered){0};
}

/* Where piece p's packed bytes are: in this rank's part when they are one
 * run of it, else gathered into a buffer of g (the one it has when the
 * seg before was of p). */
static const uint8_t *piece_bytes(wtx__many *m, uint32_t p, gathered *g) {
  if (g->n > 0 && g->v[g->n - 1].piece == p) return g->v[g->n - 1].buf;
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  uint32_t i = pieces[p].param;
  size_t es = wtx_dtype_size(m->metas[i].dtype);
  const wtx_box *own = &m->mine[i];
  wtx_box box;
  uint64_t elem;
  wtx_plan_piece_box(m->plan, &pieces[p], &box);
  const uint8_t *local = m->local[i];
  if (wtx_box_contiguous(own, &box, &elem)) return local + elem * es;
  if (g->n == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 8;
    struct gathered_piece *v = realloc(g->v, cap * sizeof *v);
    if (v == NULL) return NULL;
    g->v = v;
    g->cap = cap;
  }
  uint8_t *buf = malloc(wtx_box_elements(&box) * es);
  if (buf == NULL) return NULL;
  wtx_box_copy(buf, NULL, local, own, &box, es);
  g->v[g->n++] = (struct gathered_piece){buf, p};
  return buf;
}

/* Chunk c's bytes to worker j->w: its segs as iov, the spans' ends. */
static int send_chunk(wjob *j, const wstream *st, const mchunk *c, struct iovec *iov,
                      uint64_t *ends, gathered *g) {
  size_t n_ends = 0, n_iov = 0;
  uint64_t at = 0;
  for (size_t k = 0; k < c->nseg; k++) {
    const seg *s = &st->vsegs[c->seg0 + k];
    if (k > 0 && s->tensor != st->vsegs[c->seg0 + k - 1].tensor) ends[n_ends++] = at;
    if (s->len == 0) continue; /* a tensor of no bytes: an empty span */
    const uint8_t *p = s->patch == SEG_CALLER ? j->m->carena
                       : s->patch ? j->m->parena + j->m->poff[s->piece - j->m->my_first]
                                  : piece_bytes(j->m, s->piece, g);
    if (p == NULL) return WTX_ENOMEM;
    iov[n_iov++] = (struct iovec){(void *)(p + s->off), s->len};
    at += s->len;
  }
  ends[n_ends++] = at;
  int sums = j->m->wire.checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  if (j->m->nccl) /* worker w is NCCL rank world + w */
    return wtx__nccl_rank_send(j->m->gpu, (int)(j->m->world + j->w), iov, n_iov, c->bytes,
                               ends, n_ends, sums, j->err, sizeof j->err);
  return wtx__tcp_rank_chunk(j->m->tcp, j->w, c->stream_offset, c->first_offset, c->bytes, iov,
                             n_iov, ends, n_ends, sums, j->err, sizeof j->err);
}

/* This rank's chunks, in stream order: to worker j->w (tcp: a job per
 * worker, each on its own connection); or with nccl to every worker in
 * the one order all ranks and workers share, chunk index first, then
 * worker: every rank's sends and every worker's receives are then in the
 * same order, so no send waits on one that waits on it. */
static int send_data(wjob *j) {
  wtx__many *m = j->m;
  size_t w0 = m->nccl ? 0 : j->w, w1 = m->nccl ? m->n_workers : j->w + 1, most = 1, rounds = 0;
  for (size_t w = w0; w < w1; w++) {
    const wstream *st = &m->ws[w];
    rounds = st->nvchunks > rounds ? st->nvchunks : rounds;
    for (size_t i = 0; i < st->nvchunks; i++)
      if (st->vchunks[i].nseg > most) most = st->vchunks[i].nseg;
  }
  struct iovec *iov = malloc(most * sizeof *iov);
  uint64_t *ends = malloc((most + 1) * sizeof *ends);
  gathered g = {0};
  int rc = iov != NULL && ends != NULL ? 0 : WTX_ENOMEM;
  for (size_t i = 0; rc == 0 && i < rounds; i++)
    for (size_t w = w0; rc == 0 && w < w1; w++) {
      const wstream *st = &m->ws[w];
      if (i >= st->nvchunks || st->vchunks[i].sender != m->rank) continue;
      const mchunk *c = &st->vchunks[i];
      j->w = (uint32_t)w;
      rc = send_chunk(j, st, c, iov, ends, &g);
      gathered_drop(&g, 0);
      j->bytes += rc == 0 ? c->bytes : 0;
      j->chunks += rc == 0;
    }
  free(iov);
  free(ends);
  gathered_drop(&g, 1);
  return rc;
}

/* b as the wire's Box, in out (its arrays lo and len). */
static Wtx__V1__Box *box_msg(const wtx_box *b, Wtx__V1__Box *out, uint64_t *lo, uint64_t *len) {
  memcpy(lo, b->lo, b->ndim * sizeof *lo);
  memcpy(len, b->len, b->ndim * sizeof *len);
  out->n_offset = out->n_shape = b->ndim;
  out->offset = lo;
  out->shape = len;
  return out;
}

/* Chunks rank 0 names in one UpdateWeights at most, where the worker takes
 * several (wtx__client_batches): many senders' chunks never span two
 * senders, so a tensor every rank feeds is a chunk per rank, and each call
 * is a round trip. A call carries no more than one chunk may: its bytes
 * (BATCH_BYTES), within the call's deadline, and the tensors its
 * ParamMeta name (WTX_MAX_CHUNK_PARAMS), within a worker's message limit;
 * a chunk at either alone goes alone, as before. */
enum { BATCH_CHUNKS = 64 };
#define BATCH_BYTES ((uint64_t)64 << 20)

/* One chunk's UpdateInfo and what it points to. */
typedef struct info_slot {
  Wtx__V1__UpdateInfo ui;
  Wtx__V1__TcpUpdateInfo tu;
  Wtx__V1__NcclUpdateInfo nu;
  Wtx__V1__ParamRange range;
  Wtx__V1__Box bx;
  uint64_t lo[WTX_MAX_DIMS], len[WTX_MAX_DIMS];
} info_slot;

/* Chunk c of st as UpdateInfo, in o: after the first sync the worker
 * holds this stream's table, and chunks name their tensors by position
 * (by_range), with no per-tensor metadata (a delta's sends some of them:
 * by their ParamMeta). */
static Wtx__V1__UpdateInfo *chunk_info(const wtx__many *m, const wstream *st, const mchunk *c,
                                       int by_range, info_slot *o) {
  wtx__v1__update_info__init(&o->ui);
  wtx__v1__tcp_update_info__init(&o->tu);
  wtx__v1__nccl_update_info__init(&o->nu);
  wtx__v1__param_range__init(&o->range);
  wtx__v1__box__init(&o->bx);
  Wtx__V1__UpdateInfo *ui = &o->ui;
  ui->backend_case = m->nccl ? WTX__V1__UPDATE_INFO__BACKEND_NCCL : WTX__V1__UPDATE_INFO__BACKEND_TCP;
  if (m->nccl) ui->nccl = &o->nu;
  else ui->tcp = &o->tu;
  o->tu.sender = o->nu.sender = c->sender;
  o->range.table_xxh3 = st->table;
  o->range.first = (uint32_t)c->first;
  o->range.count = (uint32_t)c->count;
  ui->layout = by_range ? &o->range : NULL;
  ui->params = by_range ? NULL : &st->vpmp[c->first];
  ui->n_params = by_range ? 0 : c->count;
  ui->first_param_offset = c->first_offset;
  ui->chunk_bytes = c->bytes;
  ui->box = c->box != 0 ? box_msg(&st->boxes[c->box - 1], &o->bx, o->lo, o->len) : NULL;
  return ui;
}

/* Rank 0: one UpdateWeights of chunks [i, i + n) of st to worker j->w. */
static int control_call(wjob *j, const wstream *st, const Wtx__V1__UpdateInfo **uis, size_t i,
                        size_t n) {
  wtx_client *one = j->m->one[j->w];
  wtx_stop stop = {.flag = &j->m->failed};
  int rc = wtx__client_update_start_batch(one, uis, n);
  int wrc = wtx__client_update_wait_stop(one, &stop);
  rc = rc != 0 ? rc : wrc;
  if (rc == WTX_ECANCELED)
    snprintf(j->err, sizeof j->err, "worker %u: its chunk%s %zu-%zu cancelled: another part "
             "of the sync failed", j->w, n > 1 ? "s" : "", i, i + n - 1);
  else if (rc != 0 && n == 1)
    snprintf(j->err, sizeof j->err, "%s (chunk %zu of %zu, from rank %u)",
             wtx_client_last_error(one), i, st->nvchunks, st->vchunks[i].sender);
  else if (rc != 0) /* the worker's error names the chunk: then[k] is chunk i + 1 + k */
    snprintf(j->err, sizeof j->err, "%s (chunks %zu-%zu of %zu in one call)",
             wtx_client_last_error(one), i, i + n - 1, st->nvchunks);
  return rc;
}

/* Rank 0: every chunk's UpdateWeights to one worker, in stream order,
 * several to a call where it takes them. */
static int send_control(wjob *j) {
  const wstream *st = &j->m->ws[j->w];
  wtx_client *one = j->m->one[j->w];
  int whole = st->vchunks == st->chunks;
  int by_range = whole && st->table != 0 && wtx__client_table(one) == st->table;
  size_t most = wtx__client_batches(one) ? BATCH_CHUNKS : 1;
  info_slot *slots = malloc(most * sizeof *slots);
  const Wtx__V1__UpdateInfo **uis = malloc(most * sizeof *uis);
  int rc = slots != NULL && uis != NULL ? 0 : WTX_ENOMEM;
  for (size_t i = 0, n = 0; rc == 0 && i < st->nvchunks; i += n) {
    uint64_t bytes = 0;
    size_t params = 0;
    for (n = 0; n < most && i + n < st->nvchunks; n++) {
      const mchunk *c = &st->vchunks[i + n];
      size_t named = by_range ? 0 : c->count;
      if (n > 0 && (bytes + c->bytes > BATCH_BYTES || params + named > WTX_MAX_CHUNK_PARAMS))
        break;
      bytes += c->bytes;
      params += named;
      uis[n] = chunk_info(j->m, st, c, by_range, &slots[n]);
    }
    rc = control_call(j, st, uis, i, n);
  }
  free(slots);
  free(uis);
  return rc;
}

static void *run_job(void *arg) {
  wjob *j = arg;
  j->rc = j->control ? send_control(j) : send_data(j);
  /* Once one worker's part fails the sync is lost: end the rest now. */
  if (j->rc != 0) atomic_store(&j->m->failed, 1);
  if (j->rc != 0) wtx__tcp_rank_cancel(j->m->tcp);
  if (j->rc != 0 && j->m->gpu != NULL) wtx__nccl_rank_cancel(j->m->gpu);
  return NULL;
}

/* Runs the sync's jobs, one thread each; the first failure into err. */
static int run_jobs(wtx__many *m, wjob *jobs, size_t n, char *err, size_t errlen) {
  pthread_t *th = calloc(n, sizeof *th);
  if (th == NULL) return WTX_ENOMEM;
  atomic_store(&m->failed, 0);
  size_t started = 0;
  for (; started < n; started++)
    if (pthread_create(&th[started], NULL, run_job, &jobs[started]) != 0) break;
  for (size_t i = 0; i < started; i++) pthread_join(th[i], NULL);
  free(th);
  int rc = started == n ? 0 : WTX_ENOMEM;
  /* The telling failure: a worker's refusal over the data plane's echo of
   * it, and either over a call cancelled because of them. */
  for (int pass = 0; pass < 3 && rc == 0; pass++)
    for (size_t i = 0; i < n && rc == 0; i++)
      if (jobs[i].rc != 0 && (pass == 2 || jobs[i].rc != WTX_ECANCELED) &&
          (pass >= 1 || jobs[i].control)) {
        rc = jobs[i].rc;
        snprintf(err, errlen, "%s", jobs[i].err);
      }
  return rc;
}

/* ---- deltas (docs/data-plane.md, "Deltas with many senders") ---- */

/* Rank 0's ask (WTX__TCP_ASK_BYTES): this sync's number, the last that
 * landed on every worker (what each rank hashed for it is what the
 * workers hold), and its flags: whether the caller's patches landed since
 * (nothing a rank hashed stands). */
enum { ASK_FORGET = 2 };

/* Bit k of bits. */
static int bit(const uint8_t *bits, size_t k) { return (bits[k / 8] >> (k % 8)) & 1; }
static void set_bit(uint8_t *bits, size_t k) { bits[k / 8] |= (uint8_t)(1u << (k % 8)); }

/* The decision's bits for worker w's tensors (after its first byte: 1
 * when every worker takes a delta). */
static uint8_t *decision_of(const wtx__many *m, size_t w) {
  size_t at = 1;
  for (size_t v = 0; v < w; v++) at += (m->ws[v].nt + 7) / 8;
  return m->decision + at;
}

/* Marks in pform how each piece feeding st may travel as a patch: of
 * the tensor it feeds alone, of its span of one that other runs feed
 * too, or of its box of one that comes in boxes. */
static int patch_forms(wtx__many *m, const wstream *st) {
  uint32_t *runs = calloc(st->nt + 1, sizeof *runs);
  uint8_t *boxed = calloc(st->nt + 1, 1);
  int rc = runs != NULL && boxed != NULL ? 0 : WTX_ENOMEM;
  for (size_t i = 0; rc == 0 && i < st->nruns; i++) {
    runs[st->runs[i].tensor]++;
    boxed[st->runs[i].tensor] |= st->runs[i].box != 0;
  }
  for (size_t i = 0; rc == 0 && i < st->nruns; i++) {
    uint32_t t = st->runs[i].tensor;
    m->pform[st->runs[i].piece] = boxed[t] ? PATCH_BOX : runs[t] == 1 ? PATCH_WHOLE : PATCH_SPAN;
  }
  free(runs);
  free(boxed);
  return rc;
}

/* The patches' state: which pieces may travel as patches, and room for
 * this rank's copies of its own (prev: their bytes, as much memory as
 * they are) and for the records of the exchange. */
static int patches_open(wtx__many *m) {
  const wtx_piece *pieces;
  size_t np = wtx_plan_pieces(m->plan, &pieces), n = m->my_n + 1, nform = 0, mine = 0;
  m->pform = calloc(np + 1, 1);
  m->pcount = calloc(np + 1, sizeof *m->pcount);
  m->presult = calloc(np + 1, sizeof *m->presult);
  m->prev_off = calloc(n, sizeof *m->prev_off);
  m->pmine = calloc(n, sizeof *m->pmine);
  m->poff = calloc(n, sizeof *m->poff);
  m->prev_ok = calloc(n, 1);
  m->pend = calloc(n, 1);
  if (!m->pform || !m->pcount || !m->presult || !m->prev_off || !m->pmine || !m->poff ||
      !m->prev_ok || !m->pend)
    return WTX_ENOMEM;
  int rc = 0;
  for (size_t w = 0; rc == 0 && w < m->n_workers; w++) rc = patch_forms(m, &m->ws[w]);
  uint64_t total = 0;
  for (size_t p = 0; p < np; p++) nform += m->pform[p] != PATCH_NONE;
  for (size_t k = 0; k < m->my_n; k++) {
    m->prev_off[k] = total;
    if (m->pform[m->my_first + k] == PATCH_NONE) continue;
    total += wtx_plan_piece_bytes(m->plan, &pieces[m->my_first + k]);
    mine++;
  }
  /* Any rank offers at most its pieces that may be patches; a decision
   * takes some. */
  m->theirs_cap = m->decision_cap = nform * WTX__TCP_PATCH_BYTES;
  m->answer = malloc(m->changed_len + mine * WTX__TCP_PATCH_BYTES + 1);
  m->prev = malloc(total ? total : 1);
  return rc == 0 && (m->answer == NULL || m->prev == NULL) ? WTX_ENOMEM : rc;
}

/* The delta's state, sized by the plan. */
static int delta_open(wtx__many *m) {
  const wtx_piece *pieces;
  size_t np = wtx_plan_pieces(m->plan, &pieces);
  wtx_plan_rank_pieces(m->plan, m->rank, &m->my_first, &m->my_n);
  m->changed_len = (np + 7) / 8;
  m->decision_len = 1;
  for (size_t w = 0; w < m->n_workers; w++) m->decision_len += (m->ws[w].nt + 7) / 8;
  m->ph = calloc(m->my_n + 1, sizeof *m->ph);
  m->sent = calloc(m->my_n + 1, sizeof *m->sent);
  m->changed = calloc(m->changed_len + 1, 1);
  int rc = m->patches ? patches_open(m) : 0;
  m->theirs_cap += m->changed_len;
  m->decision_cap += m->decision_len;
  m->theirs = calloc(m->theirs_cap + 1, 1);
  m->decision = calloc(m->decision_cap, 1);
  m->full = calloc(m->n_workers + 1, 1);
  m->based = calloc(m->n_workers + 1, sizeof *m->based);
  if (rc == 0 && !(m->ph && m->sent && m->changed && m->theirs && m->decision && m->full &&
                   m->based))
    rc = WTX_ENOMEM;
  return rc;
}

/* This sync's view of worker w's stream: all of it. */
static void view_whole(wstream *st) {
  st->vchunks = st->chunks;
  st->nvchunks = st->nchunks;
  st->vsegs = st->segs;
  st->vpmp = st->pmp;
}

/* The decision's patches of st's tensors: patched[k], how many runs of
 * tensor k travel as patches this sync (0: it travels whole); how many
 * tensors are patched, and *spans, the patches that are spans. */
static size_t stream_patches(const wtx__many *m, const wstream *st, uint32_t *patched,
                             size_t *spans) {
  size_t n = 0;
  *spans = 0;
  for (size_t i = 0; m->patches && i < st->nruns; i++)
    if (m->pcount[st->runs[i].piece] > 0) {
      n += patched[st->runs[i].tensor]++ == 0;
      *spans += m->pform[st->runs[i].piece] != PATCH_WHOLE; /* a box's boxes: a bound */
    }
  return n;
}

/* Piece p's box in st's tensor k (its part of the parameter), as the
 * wire's Box in out, its offset and shape at dims. */
static Wtx__V1__Box *span_box(const wtx__many *m, const wstream *st, size_t k, uint32_t p,
                              Wtx__V1__Box *out, uint64_t *dims) {
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  wtx_box b;
  wtx_plan_piece_box(m->plan, &pieces[p], &b);
  const Wtx__V1__TensorPart *part = st->pm[k].part;
  for (size_t d = 0; part != NULL && d < b.ndim; d++) b.lo[d] -= part->offset[d];
  wtx__v1__box__init(out);
  return box_msg(&b, out, dims, dims + WTX_MAX_DIMS);
}

/* The ParamMeta of st's tensor k, whose runs are st->runs[i0, i1), as
 * this sync's patch of it: a copy of its own with the patch, into pm and
 * pt; of spans (from st->dspan at *used), one per piece that travels,
 * where several feed it (a piece of a tensor fed in boxes: of its box,
 * whatever boxes it was cut into). */
static Wtx__V1__ParamMeta *patch_meta(const wtx__many *m, wstream *st, size_t k, size_t i0,
                                      size_t i1, Wtx__V1__ParamMeta *pm, Wtx__V1__Patch *pt,
                                      size_t *used) {
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  size_t es = wtx_dtype_size(m->metas[pieces[st->runs[i0].piece].param].dtype);
  wtx__v1__patch__init(pt);
  *pm = st->pm[k];
  pm->patch = pt;
  pt->spans = &st->dspanp[*used];
  for (size_t i = i0; i < i1; i++) {
    uint32_t p = st->runs[i].piece;
    uint64_t elements = wtx_plan_piece_bytes(m->plan, &pieces[p]) / es;
    if (m->pform[p] == PATCH_WHOLE) {
      pt->index_dtype = (Wtx__V1__DType)wtx__patch_index_dtype(elements);
      pt->count = m->pcount[p];
      pt->result_xxh3 = m->presult[p];
      return pm;
    }
    if (m->pcount[p] == 0) continue; /* unchanged: the base's bytes stand */
    if (i > i0 && st->runs[i - 1].piece == p) continue; /* a box's later boxes */
    Wtx__V1__PatchSpan *sp = &st->dspan[*used];
    wtx__v1__patch_span__init(sp);
    sp->first = m->pform[p] == PATCH_BOX ? 0 : st->runs[i].off / es;
    if (m->pform[p] == PATCH_BOX)
      sp->box = span_box(m, st, k, p, &st->dbox[*used],
                         &st->dboxdims[*used * 2 * WTX_MAX_DIMS]);
    sp->elements = elements;
    sp->index_dtype = (Wtx__V1__DType)wtx__patch_index_dtype(elements);
    sp->count = m->pcount[p];
    sp->result_xxh3 = m->presult[p];
    st->dspanp[(*used)++] = sp;
    pt->n_spans++;
  }
  return pm;
}

/* This sync's view of st: the tensors sel marks (a bit each), cut into
 * chunks as the whole stream is (a patched one as its patch), named by
 * their ParamMeta. */
static int view_some(const wtx__many *m, wstream *st, const uint8_t *sel) {
  size_t kept = 0, nspans = 0, used = 0;
  for (size_t k = 0; k < st->nt; k++) kept += bit(sel, k);
  uint32_t *sub = malloc((st->nt + 1) * sizeof *sub);
  uint32_t *patched = calloc(st->nt + 1, sizeof *patched);
  size_t np = sub != NULL && patched != NULL ? stream_patches(m, st, patched, &nspans) : 0;
  if (sub != NULL && patched != NULL && kept == st->nt && np == 0) {
    free(sub);
    free(patched);
    view_whole(st);
    return 0;
  }
  view_free(st);
  st->dpmp = calloc(kept + 1, sizeof *st->dpmp);
  st->dpm = calloc(np + 1, sizeof *st->dpm);
  st->dpatch = calloc(np + 1, sizeof *st->dpatch);
  st->dspan = calloc(nspans + 1, sizeof *st->dspan);
  st->dspanp = calloc(nspans + 1, sizeof *st->dspanp);
  st->dbox = calloc(nspans + 1, sizeof *st->dbox);
  st->dboxdims = calloc((nspans + 1) * 2 * WTX_MAX_DIMS, sizeof *st->dboxdims);
  if (sub == NULL || patched == NULL || st->dpmp == NULL || st->dpm == NULL ||
      st->dpatch == NULL || st->dspan == NULL || st->dspanp == NULL || st->dbox == NULL ||
      st->dboxdims == NULL) {
    free(sub);
    free(patched);
    return WTX_ENOMEM;
  }
  for (size_t k = 0, j = 0, q = 0, i1 = 0; k < st->nt; k++) {
    size_t i0 = i1; /* tensor k's runs: [i0, i1) */
    while (i1 < st->nruns && st->runs[i1].tensor == k) i1++;
    sub[k] = bit(sel, k) ? (uint32_t)j : UINT32_MAX;
    if (!bit(sel, k)) continue;
    st->dpmp[j++] = patched[k] == 0 ? &st->pm[k]
                                     : patch_meta(m, st, k, i0, i1, &st->dpm[q],
                                                  &st->dpatch[q], &used);
    q += patched[k] != 0;
  }
  free(patched);
  size_t nseg = 0, nch = 0;
  uint64_t bytes = 0;
  int rc = cut_chunks(m, st->runs, st->nruns, sub, m->patches ? m->pcount : NULL,
                      m->wire.buffer_size, 0, &st->dsegs, &nseg, &st->dchunks, &nch, &bytes);
  free(sub);
  if (rc != 0) return rc;
  st->vchunks = st->dchunks;
  st->nvchunks = nch;
  st->vsegs = st->dsegs;
  st->vpmp = st->dpmp;
  return 0;
}

/* A sync's outcome reaches this rank: what it hashed is what the workers
 * hold once it landed, and not otherwise. */
static void delta_settle(wtx__many *m, int landed) {
  for (size_t k = 0; m->patches && k < m->my_n; k++) {
    m->prev_ok[k] |= (uint8_t)(m->pend[k] && m->pending && landed);
    m->pend[k] = 0;
  }
  if (m->pending && landed) {
    memcpy(m->sent, m->ph, m->my_n * sizeof *m->sent);
    m->sent_ok = 1;
  }
  m->pending = 0;
}

/* What this rank knew the workers hold no longer stands: its next delta
 * sends each of its pieces whole. */
static void many_forget(wtx__many *m) {
  if (!m->delta) return;
  m->sent_ok = 0;
  m->pending = 0;
  if (m->prev_ok != NULL) memset(m->prev_ok, 0, m->my_n);
  if (m->pend != NULL) memset(m->pend, 0, m->my_n);
}

/* This rank's k-th piece, cur (len bytes of dtype), one run of its
 * tensor: when it changed since prev, which holds it as the workers
 * do, its patch of prev where that is fewer bytes and fits a buffer (at
 * parena + *used); then prev becomes it (by the patch: what changed is
 * written), valid once the sync lands. */
static int patch_piece(wtx__many *m, size_t k, const uint8_t *cur, uint64_t len, int dtype,
                       int changed, uint64_t *used) {
  uint8_t *prev = m->prev + m->prev_off[k];
  wtx_tensor_meta flat = {.dtype = dtype, .ndim = 1,
                          .shape = {len / wtx_dtype_size(dtype)}, .nbytes = len};
  m->pmine[k] = 0;
  m->poff[k] = *used;
  if (!changed && m->prev_ok[k]) return 0;
  int rc = changed && m->prev_ok[k]
               ? wtx__delta_patch(cur, prev, &flat, m->wire.buffer_size, &m->parena,
                                  &m->parena_cap, used, &m->pmine[k])
               : 0;
  if (rc == 0 && m->pmine[k] == 0) memcpy(prev, cur, len);
  m->prev_ok[k] = 0;
  m->pend[k] = 1;
  return rc;
}

/* This rank's pieces hashed, and marked in changed where they differ from
 * what the workers hold (all of them, when that is not known). */
static int delta_hash(wtx__many *m) {
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  gathered g = {0};
  uint64_t used = 0;
  int rc = 0;
  memset(m->changed, 0, m->changed_len);
  for (size_t k = 0; rc == 0 && k < m->my_n; k++) {
    uint32_t p = (uint32_t)(m->my_first + k);
    uint64_t len = wtx_plan_piece_bytes(m->plan, &pieces[p]);
    const uint8_t *b = piece_bytes(m, p, &g);
    if (b == NULL) {
      rc = WTX_ENOMEM;
      break;
    }
    m->ph[k] = XXH3_64bits(b, len);
    int changed = !m->sent_ok || m->ph[k] != m->sent[k];
    if (changed) set_bit(m->changed, p);
    if (m->patches && m->pform[p] != PATCH_NONE)
      rc = patch_piece(m, k, b, len, m->metas[pieces[p].param].dtype, changed, &used);
    gathered_drop(&g, 0);
  }
  gathered_drop(&g, 1);
  m->pending = 1;
  return rc;
}

/* This rank's answer: its changes, then an offer per patch it made. */
static size_t delta_answer(wtx__many *m) {
  memcpy(m->answer, m->changed, m->changed_len);
  size_t at = m->changed_len;
  for (size_t k = 0; m->patches && k < m->my_n; k++)
    if (m->pmine[k] > 0) {
      wtx__tcp_patch_encode(m->answer + at, (uint32_t)(m->my_first + k), m->pmine[k], m->ph[k]);
      at += WTX__TCP_PATCH_BYTES;
    }
  return at;
}

/* Rank 0: the offers of rank r (n records at rec) into pcount and
 * presult; one of a piece r does not send, or larger than a buffer, is
 * WTX_EPROTO. */
static int take_offers(wtx__many *m, uint32_t r, const uint8_t *rec, size_t n, char *err,
                       size_t errlen) {
  size_t first, count;
  wtx_plan_rank_pieces(m->plan, r, &first, &count);
  for (size_t i = 0; i < n; i++, rec += WTX__TCP_PATCH_BYTES) {
    uint32_t p;
    uint64_t c, sum;
    if (wtx__tcp_patch_decode(rec, &p, &c, &sum) != 0 || p < first || p >= first + count ||
        !patch_ok(m, p, c)) {
      snprintf(err, errlen, "delta: a patch offered of a piece this rank does not send, or "
               "larger than a buffer");
      return WTX_EPROTO;
    }
    m->pcount[p] = c;
    m->presult[p] = sum;
  }
  return 0;
}

/* Appends to err which rank a failure of the exchange was with. */
static void name_rank(const wtx__many *m, uint32_t r, char *err, size_t errlen) {
  size_t n = strlen(err);
  if (n + 1 < errlen) snprintf(err + n, errlen - n, " (rank %u at %s)", r, m->addrs[r]);
}

/* Rank 0: this sync landed on every worker's main model; what each
 * serves now is what every rank's record of it describes. */
static void mark_based(wtx__many *m) {
  m->landed_seq = m->seq;
  for (size_t w = 0; w < m->n_workers; w++)
    snprintf(m->based[w], sizeof m->based[w], "%s", wtx__client_serves(m->one[w], 0));
}

/* Rank 0, a delta: worker w's next start names as its base the version
 * this trainer's last landed sync left there, when there is one; else w
 * takes the whole stream (full[w], and full_reason says why). */
static int delta_base(wtx__many *m, size_t w, int target) {
  const char *base = target != WTX_TARGET_DRAFT ? m->based[w] : "";
  m->full[w] = base[0] == '\0';
  if (m->full[w] && m->full_reason[0] == '\0')
    snprintf(m->full_reason, sizeof m->full_reason, "delta: %s",
             target == WTX_TARGET_DRAFT ? "the draft model takes whole syncs only"
             : "no sync of this trainer has landed there yet");
  return m->full[w] ? 0 : wtx__client_set_bases(m->one[w], &base);
}

/* Rank 0, a delta whose start worker w refused (wrc): when it serves
 * another version than its base, it takes the whole stream, started
 * again. */
static int delta_refused(wtx__many *m, size_t w, int target, int wrc) {
  if (wrc == 0 || m->full[w] ||
      wtx_client_last_status(m->one[w]) != GRPC_STATUS_FAILED_PRECONDITION)
    return wrc;
  snprintf(m->full_reason, sizeof m->full_reason, "%s", wtx_client_last_error(m->one[w]));
  m->full[w] = 1;
  wtx__client_start_begin(m->one[w], target, 0);
  return wtx__client_start_end(m->one[w]);
}

/* Rank 0: worker w's tensor that several runs feed (st->runs[i0, i1))
 * travels as a patch of spans (of boxes, for a tensor fed in boxes) when
 * w takes them and every run that changed was offered as a patch (the
 * others' bytes stay the base's); else each run whole, its offer
 * dropped. */
static void decide_spans(wtx__many *m, size_t w, size_t i0, size_t i1) {
  const seg *runs = m->ws[w].runs;
  int spans = m->pform[runs[i0].piece] == PATCH_BOX ? wtx__client_patch_boxes(m->one[w])
                                                    : wtx__client_patch_spans(m->one[w]);
  for (size_t i = i0; spans && i < i1; i++)
    spans = !bit(m->changed, runs[i].piece) || m->pcount[runs[i].piece] > 0;
  for (size_t i = i0; !spans && i < i1; i++) m->pcount[runs[i].piece] = 0;
}

/* Rank 0: which offered patches this sync sends (to a worker that takes
 * patches and a delta), as records after the decision's bits. */
static void decide_patches(wtx__many *m) {
  const wtx_piece *pieces;
  size_t np = wtx_plan_pieces(m->plan, &pieces);
  m->decided_len = m->decision_len;
  for (size_t w = 0; w < m->n_workers; w++) {
    const wstream *st = &m->ws[w];
    for (size_t i0 = 0, i1; i0 < st->nruns; i0 = i1) {
      i1 = runs_end(st->runs, st->nruns, i0);
      int form = m->pform[st->runs[i0].piece];
      if (form == PATCH_SPAN || form == PATCH_BOX) decide_spans(m, w, i0, i1);
    }
  }
  for (size_t p = 0; p < np; p++) {
    uint32_t w = pieces[p].worker;
    if (m->pcount[p] > 0 && (m->full[w] || !wtx__client_patches(m->one[w]))) m->pcount[p] = 0;
    if (m->pcount[p] == 0) continue;
    wtx__tcp_patch_encode(m->decision + m->decided_len, (uint32_t)p, m->pcount[p],
                          m->presult[p]);
    m->decided_len += WTX__TCP_PATCH_BYTES;
  }
}

/* Rank 0: every rank's changes and offers gathered (its own in changed
 * and pmine). */
static int delta_gather(wtx__many *m, char *err, size_t errlen) {
  const wtx_piece *pieces;
  size_t np = wtx_plan_pieces(m->plan, &pieces);
  uint8_t ask[WTX__TCP_ASK_BYTES];
  wtx__tcp_ask_encode(ask, (uint8_t)(m->forget ? ASK_FORGET : 0), ++m->seq, m->landed_seq);
  int rc = 0;
  uint32_t r = 1;
  for (; rc == 0 && r < m->world; r += rc == 0)
    rc = wtx__tcp_link_ask(m->links[r], ask, sizeof ask, m->wire.timeout_ms, err, errlen);
  if (rc == 0) m->forget = 0; /* every rank was told */
  /* Rank 0 settled its own record when its last sync ended. */
  if (rc == 0 && (rc = delta_hash(m)) != 0) return rc;
  if (m->patches) {
    memset(m->pcount, 0, np * sizeof *m->pcount);
    size_t n = delta_answer(m);
    rc = take_offers(m, 0, m->answer + m->changed_len,
                     (n - m->changed_len) / WTX__TCP_PATCH_BYTES, err, errlen);
  }
  for (r = rc == 0 ? 1 : r; rc == 0 && r < m->world; r += rc == 0) {
    size_t n = 0;
    rc = wtx__tcp_link_answer(m->links[r], m->theirs, m->changed_len, m->theirs_cap, &n,
                              m->wire.timeout_ms, err, errlen);
    if (rc == 0 && (n - m->changed_len) % WTX__TCP_PATCH_BYTES != 0) {
      snprintf(err, errlen, "delta: a rank's answer is not its changes and whole offers");
      rc = WTX_EPROTO;
    }
    if (rc == 0)
      rc = take_offers(m, r, m->theirs + m->changed_len,
                       (n - m->changed_len) / WTX__TCP_PATCH_BYTES, err, errlen);
    for (size_t i = 0; rc == 0 && i < m->changed_len; i++) m->changed[i] |= m->theirs[i];
  }
  if (rc != 0) name_rank(m, r, err, errlen);
  return rc;
}

/* Rank 0: every rank's changes gathered, and the sync's decision made and
 * told to every rank: worker w is sent every tensor (m->full[w]) or those
 * a changed piece feeds, and which of them travel as patches. */
static int delta_decide(wtx__many *m, char *err, size_t errlen) {
  int rc = delta_gather(m, err, errlen);
  if (rc != 0) return rc;
  uint32_t r;
  memset(m->decision, 0, m->decision_len);
  m->decision[0] = 1;
  for (size_t w = 0; w < m->n_workers; w++) m->decision[0] &= (uint8_t)!m->full[w];
  for (size_t w = 0; w < m->n_workers; w++) {
    const wstream *st = &m->ws[w];
    uint8_t *sel = decision_of(m, w);
    for (size_t k = 0; m->full[w] && k < st->nt; k++) set_bit(sel, k);
    for (size_t i = 0; !m->full[w] && i < st->nruns; i++)
      if (bit(m->changed, st->runs[i].piece)) set_bit(sel, st->runs[i].tensor);
  }
  m->decided_len = m->decision_len;
  if (m->patches) decide_patches(m);
  for (r = 1; rc == 0 && r < m->world; r += rc == 0)
    rc = wtx__tcp_link_tell(m->links[r], m->decision, m->decided_len, m->wire.timeout_ms, err,
                            errlen);
  if (rc != 0) name_rank(m, r, err, errlen);
  return rc;
}

/* Another rank: the decision's patches (its records after the bits) into
 * pcount; each must be of a piece of the plan, and of this rank's, the
 * patch it offered. */
static int follow_patches(wtx__many *m, size_t dlen, char *err, size_t errlen) {
  const wtx_piece *pieces;
  size_t np = wtx_plan_pieces(m->plan, &pieces);
  int ok = (dlen - m->decision_len) % WTX__TCP_PATCH_BYTES == 0;
  memset(m->pcount, 0, np * sizeof *m->pcount);
  for (size_t i = m->decision_len; ok && i < dlen; i += WTX__TCP_PATCH_BYTES) {
    uint32_t p;
    uint64_t c, sum;
    ok = wtx__tcp_patch_decode(m->decision + i, &p, &c, &sum) == 0 && patch_ok(m, p, c);
    int mine = ok && p >= m->my_first && p < m->my_first + m->my_n;
    if (mine && m->pmine[p - m->my_first] != c) ok = 0;
    if (ok) m->pcount[p] = c;
  }
  if (ok) return 0;
  snprintf(err, errlen, "delta: rank 0's decision names a patch no rank offered");
  return WTX_EPROTO;
}

/* Another rank: rank 0's ask (which sync landed last), this rank's
 * changes, and the decision. */
static int delta_follow(wtx__many *m, char *err, size_t errlen) {
  uint8_t ask[WTX__TCP_ASK_BYTES], flags = 0;
  uint64_t seq = 0, landed = 0;
  int rc = read_go(m, err, errlen); /* the ask follows the go */
  if (rc == 0) rc = wtx__tcp_rank_asked(m->tcp, ask, sizeof ask, err, errlen);
  if (rc == 0 && wtx__tcp_ask_decode(ask, &flags, &seq, &landed) != 0) {
    snprintf(err, errlen, "delta: rank 0's ask is not one");
    rc = WTX_EPROTO;
  }
  if (rc == 0) {
    delta_settle(m, m->pending_seq == landed);
    if (flags & ASK_FORGET) many_forget(m);
    /* What this rank hashes from here on is this sync's, even if the
     * pass fails partway; without an ask read, what it holds stays the
     * sync's it last answered. */
    m->pending_seq = seq;
    rc = delta_hash(m);
  }
  size_t dlen = 0;
  if (rc == 0 && m->patches)
    rc = wtx__tcp_rank_answer(m->tcp, m->answer, delta_answer(m), m->decision, m->decision_len,
                              m->decision_cap, &dlen, err, errlen);
  else if (rc == 0)
    rc = wtx__tcp_rank_answer(m->tcp, m->changed, m->changed_len, m->decision, m->decision_len,
                              m->decision_len, &dlen, err, errlen);
  if (rc == 0 && m->patches) rc = follow_patches(m, dlen, err, errlen);
  return rc;
}

/* This sync's view of every worker's stream: the decision's tensors. */
static int delta_views(wtx__many *m, wtx_send_result *r) {
  const wtx_piece *pieces;
  wtx_plan_pieces(m->plan, &pieces);
  uint8_t *params = calloc(m->n + 1, 1);
  int rc = params != NULL ? 0 : WTX_ENOMEM;
  int all;
  for (size_t w = 0; rc == 0 && w < m->n_workers; w++) {
    wstream *st = &m->ws[w];
    const uint8_t *sel = decision_of(m, w);
    rc = view_some(m, st, sel);
    for (size_t i = 0; rc == 0 && i < st->nruns; i++)
      if (bit(sel, st->runs[i].tensor)) params[pieces[st->runs[i].piece].param] = 1;
  }
  size_t sent = 0;
  for (size_t i = 0; rc == 0 && i < m->n; i++) sent += params[i];
  all = !(m->decision[0] & 1);
  if (all && m->rank != 0)
    snprintf(m->full_reason, sizeof m->full_reason, "delta: a worker takes the whole stream "
             "(rank 0's result says why)");
  free(params);
  for (size_t k = 0; rc == 0 && m->patches && k < m->my_n; k++)
    if (m->pcount[m->my_first + k] > 0) {
      r->patched_params++;
      r->patched_whole_bytes += wtx_plan_piece_bytes(m->plan, &pieces[m->my_first + k]);
    }
  r->params = sent;
  r->skipped_params = m->n - sent;
  r->delta = !all;
  r->full_reason = all ? m->full_reason : NULL;
  return rc;
}

/* The connections this sync needs: rank 0 initializes the workers'
 * sessions again after a failed sync (they connect to every rank anew);
 * the other ranks take those connections when theirs were closed. */
static int many_connect(wtx__many *m, char *err, size_t errlen) {
  if (m->gpu != NULL) wtx__nccl_rank_rearm(m->gpu);
  if (m->nccl && m->rank != 0) return many_take_go(m, err, errlen);
  if (m->rank == 0) {
    /* nccl: a go each sync; a link that fails it makes a new session. */
    if (m->ready && m->nccl && wtx__nccl_rank_ready(m->gpu) && many_go(m, err, errlen) == 0)
      return 0;
    /* tcp: a go each sync too, on every rank's link (one that died made
     * again); one that fails fails the sync, and the next starts over. */
    if (m->ready && !m->nccl) return many_go(m, err, errlen);
    wtx__tcp_rank_reset(m->tcp);
    int rc = !m->nccl ? many_go(m, err, errlen) : 0;
    return rc != 0 ? rc : many_sessions(m, err, errlen);
  }
  /* tcp: a rank whose connections stand sends at once (ahead of rank 0
   * where the workers' read-ahead lets it) and reads the go later
   * (read_go); one whose connections closed reads the go first, which
   * tells a link rank 0 closed after an earlier sync from one it closes
   * in this one, then takes the workers' new connections. Either way the
   * link is watched until the bytes are out (watch_end). */
  if (wtx__tcp_rank_connected(m->tcp) && wtx__tcp_rank_linked(m->tcp)) {
    m->go_due = 1;
    return wtx__tcp_rank_watch(m->tcp);
  }
  uint64_t gen = 0;
  size_t len = 0;
  int rc = take_go(m, &gen, NULL, 0, &len, err, errlen);
  int again = rc == 0 && !wtx__tcp_rank_connected(m->tcp);
  /* The reset spends any cancel, so it comes before the watch: the watch
   * may cancel at once, rank 0 closing the link as soon as a worker
   * refuses its start, and a reset after would swallow that. */
  if (again) wtx__tcp_rank_reset(m->tcp);
  if (rc == 0) rc = wtx__tcp_rank_watch(m->tcp); /* a close from now on is this sync's */
  return rc != 0 || !again ? rc : wtx__tcp_rank_accept(m->tcp, err, errlen);
}

/* The sync's threads: per worker, this rank's bytes, and on rank 0 the
 * calls that receive them. */
static int many_move(wtx__many *m, wtx_send_result *r, char *err, size_t errlen) {
  /* tcp: a data job per worker; nccl: one for all, in the shared order */
  size_t nw = m->n_workers, nd = m->nccl ? 1 : nw, n = m->rank == 0 ? nd + nw : nd;
  wjob *jobs = calloc(n, sizeof *jobs);
  if (jobs == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < n; i++)
    jobs[i] = (wjob){.m = m, .w = (uint32_t)(i < nd ? i : i - nd), .control = i >= nd};
  int rc = run_jobs(m, jobs, n, err, errlen);
  for (size_t i = 0; i < nd; i++) {
    r->bytes += jobs[i].bytes;
    r->chunks += jobs[i].chunks;
  }
  free(jobs);
  return rc;
}

/* Rank 0: an update started on every worker (each its own client, whose
 * session it holds); with deltas, on the base delta_base names, a worker
 * refusing it started again for the whole stream. */
static int many_start(wtx__many *m, int target, char *err, size_t errlen) {
  if (m->delta) m->full_reason[0] = '\0';
  for (size_t w = 0; m->delta && w < m->n_workers; w++)
    if (delta_base(m, w, target) != 0) return WTX_ENOMEM;
  for (size_t w = 0; w < m->n_workers; w++) wtx__client_start_begin(m->one[w], target, 0);
  int rc = 0;
  for (size_t w = 0; w < m->n_workers; w++) {
    int wrc = wtx__client_start_end(m->one[w]);
    if (m->delta) wrc = delta_refused(m, w, target, wrc);
    if (wrc != 0 && rc == 0) {
      rc = wrc;
      snprintf(err, errlen, "%s", wtx_client_last_error(m->one[w]));
    }
  }
  return rc;
}

/* Rank 0: every worker prepared, then every one published. */
static int many_publish(wtx__many *m, const wtx_send_options *o, wtx_send_result *r,
                        char *err, size_t errlen) {
  const char *v = o->version != NULL ? o->version : "";
  int rc = 0;
  size_t w = 0;
  for (; rc == 0 && w < m->n_workers; w++) rc = wtx__client_prepare(m->one[w], v);
  if (rc != 0) {
    snprintf(err, errlen, "%s", wtx_client_last_error(m->one[w - 1]));
    return rc;
  }
  return wtx__client_commit_all(m->one, m->n_workers, v, r->version, sizeof r->version, NULL,
                                err, errlen);
}

/* Rank 0: every worker's update aborted, its previous weights staying. */
static void many_abort(wtx__many *m, const char *reason) {
  for (size_t w = 0; w < m->n_workers; w++) wtx__client_abort(m->one[w], reason);
}

/* A sync failed before its bytes were all out: every worker keeps its
 * previous weights (rank 0 aborts their updates), and the next sync starts
 * over, with new sessions and connections. */
static void many_reset(wtx__many *m, const char *err) {
  if (m->rank == 0) many_abort(m, err);
  if (m->rank == 0) m->ready = 0;
  wtx__tcp_rank_reset(m->tcp);
  /* A rank waiting on its link (for this sync's exchange, or for
   * workers that will not come) fails now; so does rank 0 waiting for
   * this rank's answer. */
  for (uint32_t k = 1; m->links != NULL && k < m->world; k++)
    if (m->links[k] >= 0) {
      close(m->links[k]);
      m->links[k] = -1;
    }
  if (m->rank != 0) wtx__tcp_rank_unlink(m->tcp);
  m->go_due = 0; /* it went with the link */
}

/* Rank 0: the UpdateInfo bytes sent to the workers so far (0 elsewhere). */
static uint64_t many_control_bytes(const wtx__many *m) {
  uint64_t n = 0;
  for (size_t w = 0; m->one != NULL && w < m->n_workers; w++)
    n += wtx__client_update_bytes(m->one[w]);
  return n;
}

int wtx__many_send(wtx__many *m, const wtx_send_options *opts, wtx_send_result *result,
                   char *err, size_t errlen) {
  wtx_send_result r = {0};
  int64_t t0 = wtx__clock_ms();
  uint64_t control0 = many_control_bytes(m);
  int rc = many_connect(m, err, errlen);
  if (rc == 0 && m->rank == 0) rc = many_start(m, opts->target, err, errlen);
  if (rc == 0) rc = many_pass(m, err, errlen);
  if (rc == 0 && m->delta)
    rc = m->rank == 0 ? delta_decide(m, err, errlen) : delta_follow(m, err, errlen);
  if (rc == 0 && m->delta) rc = delta_views(m, &r);
  for (size_t w = 0; !m->delta && w < m->n_workers; w++) view_whole(&m->ws[w]);
  if (rc == 0) rc = many_move(m, &r, err, errlen);
  int ended = 0;
  if (m->rank != 0 && !m->nccl) rc = watch_end(m, rc, &ended, err, errlen);
  if (rc == 0 && m->rank != 0) rc = read_go(m, err, errlen);
  int moved = rc == 0;
  if (rc == 0 && m->rank == 0) rc = many_publish(m, opts, &r, err, errlen);
  /* Whether what every worker serves is what the ranks hashed this sync:
   * not after a failure, nor after a sync of the draft model. */
  if (m->rank == 0 && m->delta) {
    int landed = rc == 0 && opts->target != WTX_TARGET_DRAFT;
    if (landed) mark_based(m);
    delta_settle(m, landed);
  }
  pass_release(m);
  if (rc != 0 && !moved) {
    many_reset(m, err);
  } else if (rc == 0 && ended) {
    /* The link rank 0 closed, and this sync's connections, are done with
     * (the close's cancel is spent with them): the next sync takes new
     * ones after its go. */
    wtx__tcp_rank_reset(m->tcp);
    wtx__tcp_rank_unlink(m->tcp);
    m->go_due = 0;
  }
  /* A failed publish was undone on every worker (many_publish), and every
   * byte had moved: the sessions and connections stand, and the other
   * ranks, whose part succeeded, keep them for the next sync. A worker
   * that lost its session fails that sync's start, which starts over. */
  if (!m->delta) r.params = m->n;
  r.seconds = (double)(wtx__clock_ms() - t0) / 1000.0;
  r.control_bytes = many_control_bytes(m) - control0;
  if (rc == 0 && opts->progress != NULL) opts->progress(opts->progress_arg, r.bytes, r.bytes);
  if (result != NULL) *result = r;
  return rc;
}

/* ---- the caller's patches (wtx__many_send_patches) ---- */

/* Rank 0: whether the caller's patches may go now. They go on the
 * workers' sessions and connections as they stand, which only a sync of
 * every rank makes, and apply to the version each worker serves, which
 * this trainer must have seen. */
static int caller_ready(wtx__many *m, int target, char *err, size_t errlen) {
  if (target == WTX_TARGET_DRAFT) {
    snprintf(err, errlen, "patches: the draft model takes whole syncs only");
    return WTX_EINVAL;
  }
  if (!m->ready || (m->nccl && !wtx__nccl_rank_ready(m->gpu))) {
    snprintf(err, errlen, "patches: with many senders rank 0 sends them over the workers' "
             "sessions, which only a sync of every rank makes; none stands (no sync yet, or "
             "the last one failed): send one first");
    return WTX_ESTATE;
  }
  for (size_t w = 0; w < m->n_workers; w++)
    if (wtx__client_serves(m->one[w], 0)[0] == '\0') {
      snprintf(err, errlen, "patches: worker %zu (%s) serves no version this trainer saw, "
               "for them to apply to: send the whole model", w,
               wtx_client_target(m->client, w));
      return WTX_ESTATE;
    }
  return 0;
}

/* Patch p (patches[j], checked whole) cut to worker w's tensor k, a part
 * of its parameter: the elements there, as a patch of the part, in wire
 * form at carena + *used (grown as needed), described by pt; *len its
 * bytes (0: none falls in the part). tmp: room for p's cut. */
static int caller_cut(wtx__many *m, size_t w, size_t k, const wtx_patch *p, size_t j,
                      uint8_t *tmp, uint64_t *used, uint64_t *len, Wtx__V1__Patch *pt,
                      char *err, size_t errlen) {
  const Wtx__V1__ParamMeta *pm = &m->ws[w].pm[k];
  const wtx_tensor_meta *full = &m->metas[m->ws[w].param[k]];
  size_t es = wtx_dtype_size(full->dtype);
  uint64_t lo[WTX_MAX_DIMS] = {0}, elements = 1;
  for (size_t d = 0; d < full->ndim; d++) {
    lo[d] = pm->part != NULL ? pm->part->offset[d] : 0;
    elements *= pm->shape[d];
  }
  int64_t *idx = (int64_t *)(void *)tmp;
  uint8_t *val = tmp + p->count * sizeof *idx;
  uint64_t c = wtx__patch_cut(full->shape, full->ndim, lo, pm->shape, p->index_dtype, p->count,
                              p->indices, p->values, es, idx, val);
  *len = 0;
  if (c == 0) return 0;
  int idt = wtx__patch_index_dtype(elements);
  size_t isz = wtx__patch_index_size(idt);
  uint64_t bytes = wtx__patch_bytes(idt, c, es);
  if (bytes > m->wire.buffer_size) {
    snprintf(err, errlen, "patches[%zu]: the part of '%s' worker %zu (%s) holds is %llu bytes "
             "as a patch, more than a buffer (%llu): send the tensor whole", j, full->name, w,
             wtx_client_target(m->client, w), (unsigned long long)bytes,
             (unsigned long long)m->wire.buffer_size);
    return WTX_ETOOBIG;
  }
  if (*used + bytes > m->carena_cap) {
    uint64_t cap = 2 * (*used + bytes);
    uint8_t *a = realloc(m->carena, cap);
    if (a == NULL) return WTX_ENOMEM;
    m->carena = a;
    m->carena_cap = cap;
  }
  uint8_t *out = m->carena + *used;
  for (uint64_t e = 0; e < c; e++) {
    if (isz == 4) {
      uint32_t v = (uint32_t)idx[e];
      memcpy(out + e * 4, &v, 4);
    } else {
      memcpy(out + e * 8, &idx[e], 8);
    }
  }
  memcpy(out + c * isz, val, c * es);
  wtx__v1__patch__init(pt);
  pt->index_dtype = (Wtx__V1__DType)idt;
  pt->count = c;
  *used += bytes;
  *len = bytes;
  return 0;
}

/* Worker w's view of this sync: each of its tensors the patches touch
 * (pidx[i]: the patch of parameter i, or SIZE_MAX), as its ParamMeta with
 * the patch of its part, in chunks of whole patches, all from rank 0. */
static int caller_view(wtx__many *m, size_t w, const wtx_patch *patches, const size_t *pidx,
                       uint8_t *tmp, uint64_t *used, char *err, size_t errlen) {
  wstream *st = &m->ws[w];
  size_t n = 0, q = 0, nc = 0;
  for (size_t k = 0; k < st->nt; k++) n += pidx[st->param[k]] != SIZE_MAX;
  view_free(st);
  st->dpmp = calloc(n + 1, sizeof *st->dpmp);
  st->dpm = calloc(n + 1, sizeof *st->dpm);
  st->dpatch = calloc(n + 1, sizeof *st->dpatch);
  st->dsegs = calloc(n + 1, sizeof *st->dsegs);
  st->dchunks = calloc(n + 1, sizeof *st->dchunks);
  int rc = st->dpmp && st->dpm && st->dpatch && st->dsegs && st->dchunks ? 0 : WTX_ENOMEM;
  mchunk *c = NULL;
  for (size_t k = 0; rc == 0 && k < st->nt; k++) {
    size_t j = pidx[st->param[k]];
    uint64_t len = 0;
    if (j == SIZE_MAX) continue;
    rc = caller_cut(m, w, k, &patches[j], j, tmp, used, &len, &st->dpatch[q], err, errlen);
    if (rc != 0 || len == 0) continue;
    st->dpm[q] = st->pm[k];
    st->dpm[q].patch = &st->dpatch[q];
    st->dpmp[q] = &st->dpm[q];
    st->dsegs[q] = (seg){.tensor = (uint32_t)q, .patch = SEG_CALLER, .off = *used - len,
                         .len = len};
    if (c == NULL || c->bytes + len > m->wire.buffer_size ||
        q - c->first + 1 > WTX_MAX_CHUNK_PARAMS) {
      uint64_t at = c != NULL ? c->stream_offset + c->bytes : 0;
      c = &st->dchunks[nc++];
      *c = (mchunk){.sender = 0, .first = q, .seg0 = q, .stream_offset = at};
    }
    c->count = q - c->first + 1;
    c->nseg++;
    c->bytes += len;
    q++;
  }
  st->vchunks = st->dchunks;
  st->nvchunks = nc;
  st->vsegs = st->dsegs;
  st->vpmp = st->dpmp;
  return rc;
}

/* Rank 0: the caller's patches checked whole against the source's table
 * (before any byte moves), then every worker's view of them; *params, how
 * many tensors they patch. */
static int caller_views(wtx__many *m, const wtx_patch *patches, size_t n, size_t *params,
                        char *err, size_t errlen) {
  size_t *pidx = malloc((m->n + 1) * sizeof *pidx);
  uint64_t room = 0, used = 0;
  int rc = pidx != NULL ? 0 : WTX_ENOMEM;
  if (rc == 0 && m->names == NULL) rc = wtx__delta_names(m->metas, m->n, &m->names);
  if (rc != 0) snprintf(err, errlen, "out of memory");
  for (size_t i = 0; rc == 0 && i < m->n; i++) pidx[i] = SIZE_MAX;
  for (size_t j = 0; rc == 0 && j < n; j++) {
    size_t i;
    rc = wtx__delta_patch_param(m->names, m->metas, &patches[j], j, &i, err, errlen);
    if (rc == 0 && pidx[i] != SIZE_MAX) {
      snprintf(err, errlen, "patches: '%s' is patched twice; merge its patches into one",
               m->metas[i].name);
      rc = WTX_EINVAL;
    }
    if (rc != 0) break;
    pidx[i] = j;
    uint64_t r = patches[j].count * (sizeof(int64_t) + wtx_dtype_size(patches[j].dtype));
    room = r > room ? r : room;
  }
  *params = n;
  uint8_t *tmp = rc == 0 ? malloc(room + 8) : NULL;
  if (rc == 0 && tmp == NULL) rc = WTX_ENOMEM;
  for (size_t w = 0; rc == 0 && w < m->n_workers; w++)
    rc = caller_view(m, w, patches, pidx, tmp, &used, err, errlen);
  if (rc == WTX_ENOMEM) snprintf(err, errlen, "out of memory");
  free(tmp);
  free(pidx);
  return rc;
}

/* Rank 0: every worker's update started on the version it serves, each
 * of them one that takes patches. */
static int caller_start(wtx__many *m, int target, char *err, size_t errlen) {
  int rc = 0;
  for (size_t w = 0; rc == 0 && w < m->n_workers; w++) {
    const char *base = wtx__client_serves(m->one[w], 0);
    rc = wtx__client_set_bases(m->one[w], &base);
  }
  if (rc != 0) return rc;
  for (size_t w = 0; w < m->n_workers; w++)
    wtx__client_start_begin(m->one[w], target, 0);
  for (size_t w = 0; w < m->n_workers; w++) { /* every begin is ended */
    int wrc = wtx__client_start_end(m->one[w]);
    if (wrc != 0 && rc == 0) {
      int stale = wtx_client_last_status(m->one[w]) == GRPC_STATUS_FAILED_PRECONDITION;
      rc = stale ? WTX_ESTATE : wrc;
      snprintf(err, errlen, "%s", wtx_client_last_error(m->one[w]));
    }
  }
  for (size_t w = 0; rc == 0 && w < m->n_workers; w++)
    if (m->ws[w].nvchunks > 0 && !wtx__client_patches(m->one[w])) {
      snprintf(err, errlen, "patches: worker %zu (%s) takes whole tensors only (its model "
               "cannot read its tensors back, or stages on the GPU)", w,
               wtx_client_target(m->client, w));
      rc = WTX_ENOTSUP;
    }
  return rc;
}

int wtx__many_send_patches(wtx__many *m, const wtx_patch *patches, size_t n,
                           const wtx_send_options *o, wtx_send_result *result, char *err,
                           size_t errlen) {
  wtx_send_result r = {0};
  if (m->rank != 0 || n == 0) return 0;
  int64_t t0 = wtx__clock_ms();
  uint64_t control0 = many_control_bytes(m);
  size_t params = 0;
  int rc = caller_ready(m, o->target, err, errlen);
  if (rc == 0) rc = caller_views(m, patches, n, &params, err, errlen);
  int checked = rc == 0;
  if (rc == 0) rc = caller_start(m, o->target, err, errlen);
  if (rc == 0 && m->gpu != NULL) wtx__nccl_rank_rearm(m->gpu);
  if (rc == 0) rc = many_move(m, &r, err, errlen);
  int moved = rc == 0;
  if (rc == 0) rc = many_publish(m, o, &r, err, errlen);
  if (rc == 0) {
    many_forget(m);
    m->forget = m->delta;
    /* No rank's record stands, so the next delta sends every piece; its
     * base is the version the patches published. */
    for (size_t w = 0; m->delta && w < m->n_workers; w++)
      if (m->based[w][0] != '\0')
        snprintf(m->based[w], sizeof m->based[w], "%s", wtx__client_serves(m->one[w], 0));
  }
  /* A refusal before any start leaves the sessions as they were. */
  if (rc != 0 && checked && !moved) many_reset(m, err);
  for (size_t w = 0; w < m->n_workers; w++) {
    view_free(&m->ws[w]);
    view_whole(&m->ws[w]);
  }
  r.delta = 1;
  r.params = r.patched_params = params;
  r.skipped_params = m->n - params;
  r.seconds = (double)(wtx__clock_ms() - t0) / 1000.0;
  r.control_bytes = many_control_bytes(m) - control0;
  if (rc == 0 && o->progress != NULL) o->progress(o->progress_arg, r.bytes, r.bytes);
  if (result != NULL) *result = r;
  return rc;
}
