/* wtx trainer engine: one weight sync = start, every chunk, finish
 * (see wtx/client.h). Chunks come from wtx_chunks_plan, the same cut the
 * workers expect; packing chunk c+1 overlaps the transfer of chunk c when
 * the session has two buffers or more. */
#include <grpc/status.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/delta.h"
#include "client/engine.h"
#include "client/fanout.h"
#include "client/source.h"
#include "common/clock.h"
#include "common/copy.h"
#include "common/hash.h"
#include "common/layout.h"
#include "common/patch.h"
#include "transport/transport.h"

struct wtx_trainer {
  uint32_t rank;
  wtx_client *client;
  wtx_source *source;
  const wtx_trainer_transport *tt;
  wtx_trainer_args args;
  char data_address[300];
  void *self;  /* the transport's trainer half */
  int ready;   /* sessions initialized and in step */
  /* The source's table as of the last sync (its metadata() is fixed for
   * the source's life), and what depends on nothing else: the chunk plan,
   * the table's identity, per-tensor checksums' room. Computed again only
   * when metadata() answers another array or count. */
  const wtx_tensor_meta *metas;
  size_t n;
  wtx_chunk *chunks;
  size_t n_chunks;
  uint64_t total;
  uint64_t table_xxh3;
  uint64_t *xxh3;
  /* Where each tensor lies in its parameter (NULL: every one whole), for
   * the ParamMeta of a sync to tensor-parallel workers. */
  Wtx__V1__TensorPart *const *parts;
  /* Set when the workers are tensor-parallel: every sync goes through it
   * (sharded.c), and the fields above are unused. */
  wtx__sharded *sh;
  /* Set when the trainer's ranks each send what they own (many.c): every
   * sync goes through it. */
  wtx__many *many;
  int sums_sent; /* the last sync landed with checksums: t->xxh3 holds them */
  int delta;     /* wtx_trainer_config.delta */
  /* A delta's sync prepared, not yet published (wtx__trainer_send_prepared):
   * 0 none, 1 hashed, 2 hashed and diffed; wtx__trainer_landed settles it. */
  int dk_prepared;
  wtx__delta dk; /* with delta: what the replicas serve, and the sync's subset */
  wtx__delta cp; /* the caller's patches of the last wtx_trainer_send_patches */
  char full_reason[1600]; /* wtx_send_result.full_reason */
  char err[1600];
};

static int fail(wtx_trainer *t, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(wtx_trainer *t, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->err, sizeof t->err, fmt, ap);
  va_end(ap);
  return rc;
}

const char *wtx_trainer_last_error(const wtx_trainer *t) { return t->err; }

int wtx__trainer_fail(wtx_trainer *t, int rc, const char *msg) { return fail(t, rc, "%s", msg); }

void wtx__trainer_set_parts(wtx_trainer *t, Wtx__V1__TensorPart *const *parts) {
  t->parts = parts;
}

/* ---- rendezvous ---- */

/* Before a collective rendezvous, where every member blocks until all have
 * joined, every replica must answer: an unreachable one then fails at once,
 * by name, instead of after everyone's timeout. */
static int probe_replicas(wtx_trainer *t, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t ws = 0;
    int rc = wtx_client_world_size(t->client, i, &ws);
    if (rc != 0) return fail(t, rc, "%s", wtx_client_last_error(t->client));
    if (ws != 1)
      return fail(t, WTX_EINVAL, "%s: worker %zu (%s) reports %u ranks; each "
                  "endpoint must host one rank", t->tt->name, i,
                  wtx_client_target(t->client, i), ws);
  }
  return 0;
}

/* Starts InitWeightTransferEngine on worker i: the shared wire parameters
 * and the backend's member for that worker. */
static int init_start(wtx_trainer *t, size_t i, char **addrs) {
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  Wtx__V1__PackingParams pk;
  wtx_wire_params_to_init(&t->args.wire, &pk, &ii);
  int rc = t->tt->init_info(t->self, i, (const char *const *)addrs, &ii);
  if (rc != 0)
    return fail(t, rc, "%s: no init info for worker %zu (worker %zu reported no "
                "data address)", t->tt->name, i, i ? i - 1 : 0);
  rc = wtx__client_init_start(t->client, i, &ii);
  return rc != 0 ? fail(t, rc, "%s", wtx_client_last_error(t->client)) : 0;
}

/* Workers one after the other (a chain learns each one's address), then
 * the trainer connects. */
static int init_in_order(wtx_trainer *t, size_t n, char **addrs) {
  char err[600] = "";
  for (size_t i = 0; i < n; i++) {
    int rc = init_start(t, i, addrs);
    Wtx__V1__InitWeightTransferEngineResponse *resp = NULL;
    if (rc == 0 && (rc = wtx__client_init_wait(t->client, i, &resp)) != 0)
      fail(t, rc, "%s", wtx_client_last_error(t->client));
    if (rc != 0) return rc;
    addrs[i] = strdup(resp->data_address);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    if (addrs[i] == NULL) return fail(t, WTX_ENOMEM, "out of memory");
  }
  if (t->tt->connect == NULL) return 0;
  int rc = t->tt->connect(t->self, (const char *const *)addrs, err, sizeof err);
  return rc != 0 ? fail(t, rc, "%s", err) : 0;
}

/* Every worker's init in flight, then the trainer's half of the collective,
 * then every answer. A worker's failure is the cause of the collective's,
 * so it is the one reported. */
static int init_collective(wtx_trainer *t, size_t n) {
  int rc = probe_replicas(t, n);
  size_t started = 0;
  for (; rc == 0 && started < n; started++)
    if ((rc = init_start(t, started, NULL)) != 0) break;
  char err[600] = "";
  int crc = rc == 0 && t->tt->connect != NULL
                ? t->tt->connect(t->self, NULL, err, sizeof err) : 0;
  int wrc = 0;
  for (size_t i = 0; i < started; i++) {
    int e = wtx__client_init_wait(t->client, i, NULL);
    if (e != 0 && wrc == 0) wrc = fail(t, e, "%s", wtx_client_last_error(t->client));
  }
  if (rc == 0 && wrc != 0) rc = wrc;
  if (rc == 0 && crc != 0) rc = fail(t, crc, "%s", err);
  return rc;
}

/* Creates the trainer half and initializes every replica. */
static int rendezvous(wtx_trainer *t) {
  if (t->self != NULL) t->tt->destroy(t->self);
  t->self = NULL;
  t->ready = 0;
  size_t n = wtx_client_size(t->client);
  t->args.n_workers = n;
  char err[600] = "";
  /* Direct receive: every worker's region holds one update's stream. */
  int rc = t->args.direct ? wtx_source_total_bytes(t->source, &t->args.stream_bytes) : 0;
  if (rc != 0) return fail(t, rc, "source: no metadata");
  rc = t->tt->create(&t->args, &t->self, err, sizeof err);
  if (rc != 0) return fail(t, rc, "%s", err);
  char **addrs = calloc(n, sizeof *addrs);
  if (addrs == NULL) return fail(t, WTX_ENOMEM, "out of memory");
  rc = t->tt->collective_init ? init_collective(t, n) : init_in_order(t, n, addrs);
  for (size_t i = 0; i < n; i++) free(addrs[i]);
  free(addrs);
  if (rc == 0) t->ready = 1;
  return rc;
}

/* Whether each chunk is a call through a caller's control plane (vLLM's
 * HTTP routes): milliseconds a chunk, not microseconds, so fewer, larger
 * chunks pay there, whatever the backend prefers. */
static int through_control(const wtx_trainer *t) {
  return t->client != NULL && wtx__client_is_control(t->client);
}

/* The buffer asked for when the config leaves it at 0 (0: the protocol's
 * default): the backend's size per worker times the workers, at most the
 * protocol's default (the protocol's through a control plane). A rank
 * other than 0 may have no client: it sends nothing, and one worker's
 * worth stands in. */
static uint64_t default_buffer(const wtx_trainer *t) {
  if (through_control(t)) return WTX_DEFAULT_BUFFER_SIZE;
  size_t workers = t->client != NULL ? wtx_client_size(t->client) : 1;
  uint64_t all = t->tt->default_buffer_per_worker * workers;
  return all < WTX_DEFAULT_BUFFER_SIZE ? all : WTX_DEFAULT_BUFFER_SIZE;
}

/* The wire parameters cfg asks for, checked as a worker checks them. */
static int resolve_config(wtx_trainer *t, const wtx_trainer_config *cfg, char *err,
                          size_t errlen) {
  const char *name = cfg->backend != NULL ? cfg->backend : "shm";
  if ((t->tt = wtx_trainer_transport_find(name)) == NULL) {
    char names[256];
    wtx_trainer_transport_names(names, sizeof names);
    snprintf(err, errlen, "backend: '%s' is not available on the trainer "
             "(registered: %s)", name, names);
    return WTX_EINVAL;
  }
  Wtx__V1__PackingParams pk = WTX__V1__PACKING_PARAMS__INIT;
  pk.packed = !cfg->unpacked;
  pk.buffer_size_bytes = cfg->buffer_size ? cfg->buffer_size : default_buffer(t);
  pk.num_buffers = cfg->num_buffers        ? cfg->num_buffers
                   : through_control(t) ? WTX_DEFAULT_NUM_BUFFERS
                                        : t->tt->default_num_buffers;
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  ii.packing = &pk;
  ii.checksum = (Wtx__V1__ChecksumAlgorithm)cfg->checksum;
  ii.timeout_ms = cfg->timeout_ms;
  int rc = wtx_wire_params_from_init(&ii, t->tt->default_checksum, &t->args.wire,
                                     err, errlen);
  if (rc != 0) return rc;
  snprintf(t->data_address, sizeof t->data_address, "%s",
           cfg->data_address ? cfg->data_address : "");
  t->args.data_address = t->data_address[0] ? t->data_address : NULL;
  t->args.direct = cfg->direct != 0;
  if (cfg->delta < WTX_DELTA_OFF || cfg->delta > WTX_DELTA_PATCHES) {
    snprintf(err, errlen, "delta: %d, must be WTX_DELTA_OFF (0), _TENSORS (1) or _PATCHES (2)",
             cfg->delta);
    return WTX_EINVAL;
  }
  t->delta = cfg->delta;
  int gpu = t->tt->put_device != NULL;
  if (t->delta && gpu &&
      t->args.wire.checksum != WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64) {
    snprintf(err, errlen, "delta: on %s it needs checksum XXH3_64: the hash pass reads "
             "each tensor on the host, which only a checksummed sync copies there", name);
    return WTX_ENOTSUP;
  }
  return 0;
}

/* Tensors per chunk, at most. The protocol takes up to WTX_MAX_CHUNK_PARAMS
 * (a checkpoint of 100k tiny tensors fits one buffer, so without a cap its
 * one chunk would be refused), and smaller chunks let the worker check and
 * stage one while the trainer packs the next. */
#define CHUNK_PARAMS 8192

/* The source's table (metas, n) as the trainer's: the chunk plan, the same
 * cut the workers expect, and the table's identity, unless it is the table
 * already held. */
static int trainer_table(wtx_trainer *t, const wtx_tensor_meta *metas, size_t n) {
  if (t->chunks != NULL && metas == t->metas && n == t->n) return 0;
  free(t->chunks);
  t->chunks = NULL;
  t->n_chunks = 0;
  t->total = 0;
  uint64_t *xxh3 = realloc(t->xxh3, n * sizeof *xxh3);
  if (xxh3 != NULL) t->xxh3 = xxh3;
  uint64_t *sizes = xxh3 != NULL ? malloc(n * sizeof *sizes) : NULL;
  if (sizes == NULL) return fail(t, WTX_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++) sizes[i] = metas[i].nbytes;
  int rc = wtx_chunks_plan(sizes, n, t->args.wire.buffer_size, CHUNK_PARAMS,
                           t->args.wire.packed, &t->chunks, &t->n_chunks);
  free(sizes);
  if (rc != 0) return fail(t, rc, "cannot plan chunks");
  for (size_t k = 0; k < t->n_chunks; k++) t->total += t->chunks[k].bytes;
  t->table_xxh3 = wtx__layout_xxh3(metas, n);
  t->metas = metas;
  t->n = n;
  return 0;
}

/* The source's table, which must have a parameter. */
static int source_table(wtx_trainer *t, const wtx_tensor_meta **metas, size_t *n) {
  int rc = wtx_source_metadata(t->source, metas, n);
  if (rc != 0) return fail(t, rc, "source: metadata() failed");
  return *n == 0 ? fail(t, WTX_EINVAL, "source: no parameters") : 0;
}

/* The source's table, for the sync about to run (computed at init). */
static int trainer_metadata(wtx_trainer *t) {
  const wtx_tensor_meta *metas;
  size_t n;
  int rc = source_table(t, &metas, &n);
  return rc != 0 ? rc : trainer_table(t, metas, n);
}

/* A trainer whose syncs all go through sharded.c (sh) or many.c (many),
 * which it owns from now on, even when it cannot be made. */
static int wrapper(const wtx_trainer_config *cfg, wtx_client *client, wtx_source *source,
                   wtx__sharded *sh, wtx__many *many, wtx_trainer **out) {
  wtx_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) {
    wtx__sharded_destroy(sh);
    wtx__many_destroy(many);
    return WTX_ENOMEM;
  }
  t->rank = cfg->rank;
  t->client = client;
  t->source = source;
  t->sh = sh;
  t->many = many;
  *out = t;
  return 0;
}

/* A trainer of many senders: every sync goes through many.c. */
static int many_init(const wtx_trainer_config *cfg, wtx_client *client, wtx_source *source,
                     wtx_trainer **out, char *err, size_t errlen) {
  wtx__many *many = NULL;
  wtx_transports_register_builtin();
  int rc = wtx__many_create(cfg, client, source, &many, err, errlen);
  return rc != 0 ? rc : wrapper(cfg, client, source, NULL, many, out);
}

int wtx_trainer_init(const wtx_trainer_config *cfg, wtx_client *client,
                     wtx_source *source, wtx_trainer **out, char *err,
                     size_t errlen) {
  wtx__sharded *sh = NULL;
  *out = NULL;
  if (cfg != NULL && cfg->world > 1) return many_init(cfg, client, source, out, err, errlen);
  if (cfg != NULL && cfg->rank == 0 && client != NULL && source != NULL) {
    int rc = wtx__sharded_create(cfg, client, source, &sh, err, errlen);
    if (rc != 0) return rc;
  }
  if (sh == NULL) return wtx__trainer_init_plain(cfg, client, source, out, err, errlen);
  return wrapper(cfg, client, source, sh, NULL, out);
}

int wtx__trainer_init_plain(const wtx_trainer_config *cfg, wtx_client *client,
                            wtx_source *source, wtx_trainer **out, char *err,
                            size_t errlen) {
  *out = NULL;
  if (cfg == NULL || source == NULL || (cfg->rank == 0 && client == NULL)) {
    snprintf(err, errlen, "trainer_init: a config, a source and (on rank 0) a "
             "client are required");
    return WTX_EINVAL;
  }
  wtx_transports_register_builtin();
  wtx_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) return WTX_ENOMEM;
  t->rank = cfg->rank;
  t->client = client;
  t->source = source;
  int rc = resolve_config(t, cfg, err, errlen);
  if (rc == 0 && t->rank == 0 && (rc = rendezvous(t)) != 0)
    snprintf(err, errlen, "%s", t->err);
  /* Every sync uses the table's plan and identity: made once, here (a
   * source that cannot answer yet is asked again by the first sync). */
  if (rc == 0 && t->rank == 0 && trainer_metadata(t) != 0) t->err[0] = '\0';
  if (rc != 0) {
    wtx_trainer_shutdown(t);
    return rc;
  }
  *out = t;
  return 0;
}

void wtx_trainer_shutdown(wtx_trainer *t) {
  if (t == NULL) return;
  wtx__sharded_destroy(t->sh);
  wtx__many_destroy(t->many);
  if (t->self != NULL) t->tt->destroy(t->self);
  free(t->chunks);
  free(t->xxh3);
  wtx__delta_free(&t->dk);
  wtx__delta_free(&t->cp);
  free(t);
}

/* ---- one sync ---- */

/* The source's pass, checked against its metadata as it goes. */
typedef struct cursor {
  wtx_trainer *t;
  const wtx_tensor_meta *metas; /* the trainer's whole table */
  size_t n;
  /* The sync's tensor j is the table's map[j] (a delta's subset; NULL:
   * the whole table). The tensors between are pulled and checked, not
   * read. */
  const size_t *map;
  /* With map: the sync's tensor j travels as patch[j] (NULL: whole),
   * whose bytes are at src[j] (sync_table). */
  Wtx__V1__Patch *const *patch;
  const uint8_t *const *src;
  int no_source;  /* the caller's patches: metas are theirs, no pass */
  uint64_t *xxh3; /* where each sent tensor's checksum goes (NULL: nowhere) */
  void *iter;
  size_t next;          /* the table index the iteration yields next */
  size_t i;             /* tensor held (d valid) */
  wtx__tensor_data d;   /* where tensor i is */
  int have;             /* d holds tensor i */
  int host_copy;        /* device tensors are needed on the host too */
  XXH3_state_t *h;
} cursor;

static int cursor_pull(cursor *c, size_t i);

/* Makes table tensor i the one held: pulls the iteration up to it, each
 * tensor checked against metadata(). Never backwards. */
static int cursor_get(cursor *c, size_t i) {
  while (!(c->have && c->i == i)) {
    int rc = cursor_pull(c, c->next);
    if (rc != 0) return rc;
  }
  return 0;
}

/* Pulls the iteration's next tensor, i, and checks it against
 * metadata()[i]. */
static int cursor_pull(cursor *c, size_t i) {
  wtx_tensor_meta m;
  wtx__tensor_data d;
  int r = wtx__source_next(c->t->source, c->iter, c->host_copy, &m, &d);
  if (r < 0) return fail(c->t, r, "source: iteration failed at parameter %zu: %s",
                         i, wtx_strerror(r));
  if (r == 0)
    return fail(c->t, WTX_EINVAL, "source: iteration ended after %zu parameters, "
                "metadata() lists %zu (first missing: '%s')", i, c->n,
                c->metas[i].name);
  const wtx_tensor_meta *want = &c->metas[i];
  /* A table source names its tensors with metadata()'s own strings. */
  if ((m.name != want->name && strcmp(m.name, want->name) != 0) ||
      !wtx_tensor_meta_same_layout(&m, want)) {
    char a[300], b[300];
    wtx_tensor_meta_str(&m, a, sizeof a);
    wtx_tensor_meta_str(want, b, sizeof b);
    return fail(c->t, WTX_EINVAL, "source: parameter %zu of the iteration is '%s' "
                "%s but metadata() says '%s' %s (nothing of it was sent)", i, m.name,
                a, want->name, b);
  }
  c->i = i;
  c->next = i + 1;
  c->d = d;
  c->have = 1;
  return 0;
}

/* After the last tensor, the iteration must end too (a delta's skipped
 * tail is pulled first). */
static int cursor_end(cursor *c) {
  wtx_tensor_meta m;
  const uint8_t *data;
  int rc = c->n > 0 ? cursor_get(c, c->n - 1) : 0;
  if (rc != 0) return rc;
  int r = wtx_source_next(c->t->source, c->iter, &m, &data);
  if (r == 1)
    return fail(c->t, WTX_EINVAL, "source: iteration yields '%s' after the %zu "
                "parameters metadata() lists", m.name, c->n);
  return r < 0 ? fail(c->t, r, "source: iteration failed at its end") : 0;
}

/* A tensor of at most this many bytes, taken whole in one piece, is copied
 * and then hashed at once from L1: XXH3's streaming state (its reset,
 * update and digest) costs more than such a tensor's bytes. Larger ones
 * are hashed while they are copied (wtx__copy_hash). */
#define ONE_MAX ((size_t)16 << 10)

/* Where a chunk's bytes go: into buf; or, for a backend that sends from
 * the caller's memory (iov not NULL), named in iov in order, each piece in
 * place when the source says it stays put and else copied into buf. A
 * device tensor's bytes go to the backend's put_device when it has one
 * (tt, self, k: the backend and buffer k). */
typedef struct pack_out {
  uint8_t *buf;
  struct iovec *iov;
  size_t n_iov;
  const wtx_trainer_transport *tt;
  void *self;
  uint32_t k;
} pack_out;

/* Names k bytes at src in out->iov (one piece with the last when adjacent). */
static void name_piece(pack_out *out, const uint8_t *src, size_t k) {
  struct iovec *last = out->n_iov > 0 ? &out->iov[out->n_iov - 1] : NULL;
  if (last != NULL && (const uint8_t *)last->iov_base + last->iov_len == src)
    last->iov_len += k;
  else
    out->iov[out->n_iov++] = (struct iovec){.iov_base = (void *)src, .iov_len = k};
}

/* Takes bytes [off, +k) of the tensor d into out, at byte used of the
 * chunk, hashing them into h (may be NULL: then d.host may be NULL too). */
static int take(pack_out *out, uint64_t used, const wtx__tensor_data *d, uint64_t off,
                size_t k, XXH3_state_t *h) {
  if (d->device != NULL && out->tt->put_device != NULL) {
    if (h != NULL) XXH3_64bits_update(h, d->host + off, k); /* its host copy */
    return out->tt->put_device(out->self, out->k, used, (const uint8_t *)d->device + off, k);
  }
  const uint8_t *src = d->host + off;
  if (out->iov == NULL || !d->stays) {
    wtx__copy_hash(out->buf + used, src, k, h, 0); /* the workers read it next */
    src = out->buf + used;
  } else if (h != NULL) {
    XXH3_64bits_update(h, src, k);
  }
  if (out->iov != NULL && k > 0) name_piece(out, src, k);
  return 0;
}

/* Takes chunk ch's bytes into out, hashing whole tensors (verify); fills
 * sums with the checksums of the tensors ending in the chunk and, when not
 * NULL, ends with where in the chunk each of them ends. */
static int pack(cursor *c, const wtx_chunk *ch, pack_out *out, uint64_t *sums,
                uint64_t *ends, size_t *n_sums, int verify) {
  uint64_t off = ch->first_offset, used = 0;
  *n_sums = 0;
  out->n_iov = 0;
  for (size_t j = ch->first; j <= ch->last; j++) {
    size_t i = c->map != NULL ? c->map[j] : j;
    int rc = c->no_source ? 0 : cursor_get(c, i);
    if (rc != 0) return rc;
    /* What travels: the tensor, or its patch (made by the delta's diff). */
    const wtx__tensor_data *td = &c->d;
    uint64_t size = c->metas[i].nbytes;
    wtx__tensor_data pd;
    if (c->patch != NULL && c->patch[j] != NULL) {
      pd = (wtx__tensor_data){.host = c->src[j], .stays = 1};
      td = &pd;
      size = wtx__patch_bytes(c->patch[j]->index_dtype, c->patch[j]->count,
                              wtx_dtype_size(c->metas[i].dtype));
    }
    uint64_t k = size - off;
    if (k > ch->bytes - used) k = ch->bytes - used;
    int one = verify && off == 0 && k == size && k <= ONE_MAX;
    if (off == 0 && verify && !one) XXH3_64bits_reset(c->h);
    rc = take(out, used, td, off, (size_t)k, verify && !one ? c->h : NULL);
    if (rc != 0) return fail(c->t, rc, "%s: cannot take '%s' from device memory",
                             c->t->tt->name, c->metas[i].name);
    used += k;
    if (off + k == size) {
      uint64_t d = !verify ? 0 : one ? XXH3_64bits(td->host, k) : XXH3_64bits_digest(c->h);
      if (c->xxh3 != NULL) c->xxh3[i] = d;
      if (ends != NULL) ends[*n_sums] = used;
      sums[(*n_sums)++] = d;
    }
    off = 0;
  }
  return 0;
}

/* A rank that does not send still runs the source's pass (each yield may be
 * a collective every rank must join), checked like the sender's. */
static int iterate_only(wtx_trainer *t, const wtx_tensor_meta *metas, size_t n) {
  /* Nothing is read: device tensors are not copied to the host. */
  cursor c = {.t = t, .metas = metas, .n = n, .host_copy = 0};
  int rc = wtx_source_open(t->source, &c.iter);
  if (rc != 0) return fail(t, rc, "source: cannot start a pass");
  for (size_t i = 0; i < n && rc == 0; i++) rc = cursor_get(&c, i);
  if (rc == 0) rc = cursor_end(&c);
  wtx_source_close(t->source, c.iter);
  return rc;
}

/* Everything one sync holds beyond the trainer's table and plan (t->metas,
 * t->chunks): the pass over the source, the per-buffer checksums and the
 * ParamMeta messages of every tensor. */
/* What one sync sends: the trainer's whole table, or a delta's subset of
 * it, with its chunk plan. */
typedef struct sync_table {
  const wtx_tensor_meta *metas; /* the n tensors sent, in order */
  size_t n;
  const size_t *map; /* tensor j is the table's map[j]; NULL: the whole table */
  /* With map: tensor j travels as patch[j] (NULL: whole), its bytes at
   * src[j] (wtx.v1.Patch). */
  Wtx__V1__Patch *const *patch;
  const uint8_t *const *src;
  const wtx_chunk *chunks;
  size_t n_chunks;
  uint64_t total;
} sync_table;

typedef struct sync_state {
  wtx_trainer *t;
  const wtx_send_options *o;
  sync_table tb;
  int delta;    /* tb is a delta's (its start named the bases) */
  int fell_back; /* a delta was refused, and the whole table is sent */
  int hashed;   /* the delta's hash pass ran (t->hashes) */
  int diffed;   /* and made this sync's patches (WTX_DELTA_PATCHES) */
  int caller;   /* the caller's patches (wtx_trainer_send_patches), no source */
  int whole;    /* a delta's base was refused: the whole table this time */
  cursor c;
  int opened;
  int verify;
  uint32_t nb;
  uint64_t *sums;   /* nb rows of (max params per chunk + 1) */
  size_t *n_sums;   /* per buffer */
  size_t sums_row;
  /* When the backend hashes while it sends (hashes_in_stream, checksums
   * on; else NULL): where each buffer's tensors end (rows like sums). The
   * chunk posted (one at a time) is told through posted. */
  uint64_t *ends;
  wtx_chunk_sums posted;
  /* Sending in place (the backend has post_iov): per buffer, the chunk's
   * pieces (rows of sums_row), in the source's memory where it stays put,
   * else in the buffer. */
  int in_place;
  pack_out *outs;   /* per buffer */
  struct iovec *iov;
  Wtx__V1__ParamMeta *pm;
  Wtx__V1__ParamMeta **pmp;
  size_t pm_built; /* pm[0..pm_built) are filled (sync_params) */
  /* Every worker holds our parameter table (the last sync's): chunks name
   * their tensors by position in it instead of sending them. */
  uint64_t table;
  Wtx__V1__ParamRange range;
} sync_state;

/* Frees what sync_buffers and sync_messages made and ends the source's
 * pass; the plan stays. */
static void sync_release(sync_state *s) {
  if (s->opened) wtx_source_close(s->t->source, s->c.iter);
  s->opened = 0;
  if (s->c.h != NULL) XXH3_freeState(s->c.h);
  s->c.h = NULL;
  free(s->sums);
  free(s->n_sums);
  free(s->ends);
  free(s->outs);
  free(s->iov);
  free(s->pm);
  free(s->pmp);
  s->sums = s->ends = NULL;
  s->n_sums = NULL;
  s->outs = NULL;
  s->iov = NULL;
  s->pm = NULL;
  s->pmp = NULL;
  s->pm_built = 0;
}

/* Step 1: the buffers of the sync and the source's pass (while the
 * workers answer start). */
static int sync_buffers(sync_state *s) {
  wtx_trainer *t = s->t;
  s->verify = t->args.wire.checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  s->nb = t->args.wire.num_buffers ? t->args.wire.num_buffers : 1;
  size_t max_params = 0;
  for (size_t k = 0; k < s->tb.n_chunks; k++)
    if (s->tb.chunks[k].last - s->tb.chunks[k].first + 1 > max_params)
      max_params = s->tb.chunks[k].last - s->tb.chunks[k].first + 1;
  s->sums_row = max_params + 1;
  s->sums = calloc(s->nb * s->sums_row, sizeof *s->sums);
  s->n_sums = calloc(s->nb, sizeof *s->n_sums);
  s->in_place = t->tt->post_iov != NULL;
  s->outs = calloc(s->nb, sizeof *s->outs);
  s->iov = s->in_place ? calloc(s->nb * s->sums_row, sizeof *s->iov) : NULL;
  if (s->outs == NULL || (s->in_place && s->iov == NULL))
    return fail(t, WTX_ENOMEM, "out of memory");
  if (s->verify && s->in_place && t->tt->hashes_in_stream &&
      (s->ends = calloc(s->nb * s->sums_row, sizeof *s->ends)) == NULL)
    return fail(t, WTX_ENOMEM, "out of memory");
  for (uint32_t b = 0; b < s->nb; b++)
    s->outs[b] = (pack_out){.buf = t->tt->buffer(t->self, b),
                            .iov = s->in_place ? &s->iov[b * s->sums_row] : NULL,
                            .tt = t->tt, .self = t->self, .k = b};
  /* Device tensors go device to device where the backend can take them;
   * hashing them (checksums on) needs their bytes on the host as well. */
  int host_copy = t->tt->put_device == NULL || s->verify;
  s->c = (cursor){.t = t, .metas = t->metas, .n = t->n, .map = s->tb.map,
                  .patch = s->tb.patch, .src = s->tb.src, .host_copy = host_copy,
                  .xxh3 = t->xxh3, .h = XXH3_createState()};
  if (s->caller) /* the caller's patches: no source, nothing to record */
    s->c = (cursor){.t = t, .metas = s->tb.metas, .n = s->tb.n, .patch = s->tb.patch,
                    .src = s->tb.src, .no_source = 1, .h = s->c.h};
  if (!s->sums || !s->n_sums || !s->c.h) return fail(t, WTX_ENOMEM, "out of memory");
  if (s->caller) return 0;
  int rc = wtx_source_open(t->source, &s->c.iter);
  if (rc != 0) return fail(t, rc, "source: cannot start a pass");
  s->opened = 1;
  return 0;
}

/* Step 3, once every worker has answered start: chunks name their tensors
 * by position when every worker holds our table, else they carry every
 * tensor's ParamMeta (filled chunk by chunk: sync_params). */
static int sync_messages(sync_state *s) {
  s->table = wtx__client_table(s->t->client);
  if (s->table != s->t->table_xxh3) s->table = 0;
  if (s->tb.map != NULL || s->caller) s->table = 0; /* a subset: its tensors by name */
  const sync_table *tb = &s->tb;
  s->pm = calloc(s->table ? 1 : tb->n, sizeof *s->pm);
  s->pmp = calloc(s->table ? 1 : tb->n, sizeof *s->pmp);
  s->pm_built = 0;
  if (!s->pm || !s->pmp) return fail(s->t, WTX_ENOMEM, "out of memory");
  return 0;
}

/* The ParamMeta of tensors up to last, filled as the chunks need them, not
 * all at once before the first: with calls ahead of their turn the next
 * chunk's are filled while the workers take this one (at 40k tensors,
 * megabytes of fresh memory). */
static void sync_params(sync_state *s, size_t last) {
  const sync_table *tb = &s->tb;
  for (size_t i = s->pm_built; i <= last && i < tb->n; i++) {
    wtx__v1__param_meta__init(&s->pm[i]);
    s->pm[i].name = (char *)tb->metas[i].name;
    s->pm[i].dtype = (Wtx__V1__DType)tb->metas[i].dtype;
    s->pm[i].n_shape = tb->metas[i].ndim;
    s->pm[i].shape = (uint64_t *)tb->metas[i].shape;
    s->pm[i].part = s->t->parts != NULL ? s->t->parts[tb->map ? tb->map[i] : i] : NULL;
    s->pm[i].patch = tb->patch != NULL ? tb->patch[i] : NULL;
    s->pmp[i] = &s->pm[i];
    s->pm_built = i + 1;
  }
}

/* Packs chunk k into its buffer (k mod the number of buffers); a backend
 * that hashes while it sends gets the tensors' ends instead of hashes. */
static int sync_pack(sync_state *s, size_t k) {
  uint32_t b = (uint32_t)(k % s->nb);
  uint64_t *ends = s->ends != NULL ? &s->ends[b * s->sums_row] : NULL;
  return pack(&s->c, &s->tb.chunks[k], &s->outs[b], &s->sums[b * s->sums_row], ends,
              &s->n_sums[b], s->verify && ends == NULL);
}

/* The checksums the backend computed while it sent chunk k (complete
 * returned 0): the sync's record of them. */
static void sync_took_sums(sync_state *s, size_t k) {
  if (s->caller) return;
  /* The tensors ending in a chunk are its first ones, in order. */
  for (size_t j = 0; j < s->posted.n; j++) {
    size_t at = s->tb.chunks[k].first + j;
    s->t->xxh3[s->tb.map != NULL ? s->tb.map[at] : at] = s->posted.out[j];
  }
}

/* The UpdateInfo of chunk k, packed in buffer b; the backend adds its part. */
static int sync_update_info(sync_state *s, size_t k, Wtx__V1__UpdateInfo *ui) {
  uint32_t b = (uint32_t)(k % s->nb);
  const wtx_chunk *ch = &s->tb.chunks[k];
  if (s->table != 0) {
    wtx__v1__param_range__init(&s->range);
    s->range.table_xxh3 = s->table;
    s->range.first = (uint32_t)ch->first;
    s->range.count = (uint32_t)(ch->last - ch->first + 1);
    ui->layout = &s->range;
  } else {
    sync_params(s, ch->last);
    ui->params = &s->pmp[ch->first];
    ui->n_params = ch->last - ch->first + 1;
  }
  ui->first_param_offset = ch->first_offset;
  ui->chunk_bytes = ch->bytes;
  if (s->verify && s->ends == NULL) {
    ui->xxh3_64 = &s->sums[b * s->sums_row];
    ui->n_xxh3_64 = s->n_sums[b];
  }
  char err[400] = "";
  int rc = s->t->tt->prepare(s->t->self, b, ch, ui, err, sizeof err);
  return rc != 0 ? fail(s->t, rc, "%s: cannot prepare chunk %zu%s%s", s->t->tt->name, k,
                        err[0] ? ": " : "", err)
                 : 0;
}

static int refused(void *client) { return wtx__client_update_refused(client); }

/* Step 4, per chunk: every replica's UpdateWeights in flight, the bytes
 * over the data plane, the next chunk packed meanwhile (with two buffers or
 * more), then every answer. Chunk k is already packed. */
static int sync_chunk(sync_state *s, size_t k) {
  wtx_trainer *t = s->t;
  const wtx_trainer_transport *tt = t->tt;
  uint32_t b = (uint32_t)(k % s->nb);
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  int rc = sync_update_info(s, k, &ui);
  if (rc != 0) return rc;
  if ((rc = wtx__client_update_start(t->client, &ui)) != 0) {
    fail(t, rc, "%s", wtx_client_last_error(t->client));
    wtx__client_update_wait(t->client);
    return rc;
  }
  char err[600] = "";
  const pack_out *out = &s->outs[b];
  wtx_chunk_sums *cs = NULL;
  if (s->ends != NULL) {
    s->posted = (wtx_chunk_sums){.ends = &s->ends[b * s->sums_row], .n = s->n_sums[b],
                                 .out = &s->sums[b * s->sums_row]};
    cs = &s->posted;
  }
  int drc = s->in_place ? tt->post_iov(t->self, b, &s->tb.chunks[k], out->iov, out->n_iov, cs)
            : tt->post != NULL ? tt->post(t->self, b, &s->tb.chunks[k]) : 0;
  if (drc != 0) snprintf(err, sizeof err, "%s: cannot send chunk %zu", tt->name, k);
  int packed_next = drc == 0 && k + 1 < s->tb.n_chunks && s->nb > 1;
  if (packed_next) rc = sync_pack(s, k + 1);
  /* A worker that refused the chunk never takes its part of a collective:
   * the wait for it ends as soon as the refusal is in. */
  wtx_stop stop = {.poll = refused, .arg = t->client};
  if (drc == 0 && tt->complete != NULL) drc = tt->complete(t->self, b, &stop, err, sizeof err);
  int crc = wtx__client_update_wait(t->client);
  /* A worker's refusal is the cause of a data-plane failure it provokes
   * (it drops the stream, it skips a collective), so the workers' error
   * comes first, then the data plane's, then the source's. */
  if (crc != 0)
    return fail(t, crc, "%s%s%s", wtx_client_last_error(t->client),
                drc ? "; data plane: " : "", drc ? err : "");
  if (drc != 0) return fail(t, drc, "%s", err);
  if (rc != 0) return rc;
  if (cs != NULL) sync_took_sums(s, k);
  /* One buffer: the next chunk is packed once this one has arrived. */
  return !packed_next && k + 1 < s->tb.n_chunks ? sync_pack(s, k + 1) : 0;
}

/* Whether chunks go out as ordered calls (sync_chunk_ordered): every
 * worker takes them, and the backend is done with a buffer once the
 * chunk's call is answered (it moves no bytes itself: shm), with a buffer
 * for each of the two calls in flight and one to pack the next into. */
static int sync_ordered(const sync_state *s) {
  const wtx_trainer_transport *tt = s->t->tt;
  return s->nb >= 3 && tt->post == NULL && tt->post_iov == NULL && tt->complete == NULL &&
         wtx__client_ordered(s->t->client);
}

/* Step 4, per chunk, as ordered calls: chunk k's UpdateWeights goes out
 * while chunk k - 1's is still in flight, so that the workers check and
 * stage one while the next is packed, sent and decoded; then chunk k - 1's
 * answer (its buffer is free), then chunk k + 1 is packed. Chunk k is
 * already packed. On failure no call is left in flight, and the error is
 * the earliest chunk's: a chunk that fails ends the update, which ends
 * the calls after it. */
static int sync_chunk_ordered(sync_state *s, size_t k) {
  wtx_trainer *t = s->t;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  int rc = sync_update_info(s, k, &ui), src = 0;
  if (rc == 0) src = wtx__client_update_start_next(t->client, &ui, (uint32_t)(k + 1));
  int in_flight = rc == 0 && src == 0; /* chunk k's calls */
  int erc = wtx__client_update_wait_earlier(t->client);
  if (erc != 0) rc = fail(t, erc, "%s", wtx_client_last_error(t->client));
  else if (src != 0) rc = fail(t, src, "%s", wtx_client_last_error(t->client));
  if (rc == 0 && k + 1 < s->tb.n_chunks) rc = sync_pack(s, k + 1);
  if (rc != 0 && in_flight) wtx__client_update_wait(t->client);
  return rc;
}

/* Whether the last failure of a start says a worker may not know our
 * session: NOT_FOUND (it restarted, or another trainer initialized it), or
 * UNAVAILABLE (it restarted, and the call went out on the connection to
 * the process that is gone: every worker's start leaves at once, so a
 * channel may not have seen the disconnect yet). */
static int session_lost(const wtx_client *c) {
  int code = wtx_client_last_status(c);
  return code == GRPC_STATUS_NOT_FOUND || code == GRPC_STATUS_UNAVAILABLE;
}

/* ---- delta syncs (client/delta.h) ---- */

/* The hash pass: every tensor of the table read once, on the host, into
 * t->dk.hashes. A tensor that stays put until the pass ends is hashed at
 * its end, with the others like it, on several threads; one whose bytes
 * the next one may replace (a reused buffer, a gather) is hashed at once. */
static int delta_hashes(wtx_trainer *t, void **iter) {
  cursor c = {.t = t, .metas = t->metas, .n = t->n, .host_copy = 1};
  int rc = wtx_source_open(t->source, &c.iter);
  if (rc != 0) return fail(t, rc, "source: cannot start a pass");
  for (size_t i = 0; i < t->n && rc == 0; i++) {
    t->dk.at[i] = NULL;
    if ((rc = cursor_get(&c, i)) != 0) break;
    if (c.d.host == NULL && t->metas[i].nbytes > 0)
      rc = fail(t, WTX_ENOTSUP, "delta: '%s' cannot be read on the host to hash it",
                t->metas[i].name);
    else if (c.d.stays && c.d.host != NULL)
      t->dk.at[i] = c.d.host;
    else
      t->dk.hashes[i] = XXH3_64bits(c.d.host, t->metas[i].nbytes);
  }
  if (rc == 0) rc = cursor_end(&c);
  if (rc == 0) wtx__delta_hash(t->dk.at, t->metas, t->n, t->dk.hashes);
  if (rc == 0 && iter != NULL) {
    *iter = c.iter; /* open: the diff reads the tensors that stay put */
    return 0;
  }
  wtx_source_close(t->source, c.iter);
  return rc;
}

/* The hash pass's tensors still open at iter: with patches, each changed
 * one compared with what the workers serve (wtx__delta_diff); then the
 * pass ends. */
static int delta_patches(sync_state *s, void *iter) {
  wtx_trainer *t = s->t;
  int rc = 0;
  int make = s->delta && wtx__client_patches(t->client);
  s->diffed = t->delta == WTX_DELTA_PATCHES;
  if (s->diffed && (rc = wtx__delta_diff(&t->dk, t->metas, t->args.wire.buffer_size, make,
                                         !s->delta)) != 0)
    fail(t, rc, "delta: cannot make patches (a host copy of the model is kept)");
  wtx_source_close(t->source, iter);
  return rc;
}

/* Names every replica's version as the base of this sync's start, when
 * what each serves is known: 1 when it did, 0 (full_reason says why) when
 * the sync must send the whole table. */
static int delta_bases(sync_state *s) {
  wtx_trainer *t = s->t;
  if (s->whole) return 0; /* full_reason says why already */
  if (s->o->target == WTX_TARGET_DRAFT) {
    snprintf(t->full_reason, sizeof t->full_reason, "delta: the draft model takes whole "
             "syncs only");
    return 0;
  }
  if (!t->dk.valid && wtx__delta_learn(&t->dk, t->client, t->metas) != 0) {
    snprintf(t->full_reason, sizeof t->full_reason, "delta: what the workers serve is not "
             "known: %s", wtx_client_last_error(t->client));
    return 0;
  }
  /* The record stands for the versions it was made at, a failed sync
   * after it or not: those are the bases. */
  size_t n = wtx_client_size(t->client);
  const char **bases = n == t->dk.n_based ? calloc(n, sizeof *bases) : NULL;
  if (bases == NULL) return 0;
  size_t i = 0;
  while (i < n && (bases[i] = t->dk.based[i])[0] != '\0') i++;
  if (i < n)
    snprintf(t->full_reason, sizeof t->full_reason, "delta: worker %zu (%s) serves no "
             "version yet", i, wtx_client_target(t->client, i));
  int ok = i == n && wtx__client_set_bases(t->client, bases) == 0;
  free(bases);
  return ok;
}

/* Steps 1-3 of a delta sync: the start, naming each replica's base, in
 * flight during the hash pass; then the subset whose hashes changed (or,
 * when a replica refused its base, the whole table). */
static int delta_begin(sync_state *s, int *lost) {
  wtx_trainer *t = s->t;
  if (wtx__delta_reserve(&t->dk, t->n) != 0) return fail(t, WTX_ENOMEM, "out of memory");
  s->delta = delta_bases(s);
  wtx__client_start_begin(t->client, s->o->target, t->n);
  void *iter = NULL;
  int rc = s->hashed ? 0 : delta_hashes(t, &iter);
  s->hashed = rc == 0;
  int src = wtx__client_start_end(t->client);
  int refused = src != 0 && s->delta &&
                wtx_client_last_status(t->client) == GRPC_STATUS_FAILED_PRECONDITION;
  /* A caller's control plane takes the base after its start; any failure
   * of that call (its engine's refusal comes back as text) sends whole. */
  if (src == 0 && s->delta && (src = wtx__client_send_base(t->client)) != 0) refused = 1;
  if (refused) {
    /* A replica serves another version than its base: the start is made
     * again, as a lost one is (sync_run), this time for the whole table. */
    snprintf(t->full_reason, sizeof t->full_reason, "%s", wtx_client_last_error(t->client));
    t->dk.valid = 0;
    s->delta = 0;
    s->whole = 1;
  }
  *lost = src != 0 && (refused || session_lost(t->client));
  if (iter != NULL && (rc = delta_patches(s, iter)) != 0 && src == 0) return rc;
  if (src != 0) return fail(t, src, "%s", wtx_client_last_error(t->client));
  if (rc != 0) return rc;
  if (s->delta) {
    rc = wtx__delta_plan(&t->dk, t->metas, t->args.wire.buffer_size, CHUNK_PARAMS,
                         t->args.wire.packed, s->diffed && wtx__client_patches(t->client));
    if (rc != 0) return fail(t, rc, "delta: cannot plan chunks");
  }
  /* Every tensor changed, none patched: the whole table's plan, named by
   * position. */
  if (s->delta && (t->dk.m < t->n || t->dk.total != t->total)) {
    s->tb = (sync_table){.metas = t->dk.metas, .n = t->dk.m, .map = t->dk.map,
                         .patch = t->dk.patch, .src = t->dk.src,
                         .chunks = t->dk.chunks, .n_chunks = t->dk.n_chunks,
                         .total = t->dk.total};
  }
  rc = sync_buffers(s);
  if (rc == 0 && s->tb.n_chunks > 0) rc = sync_pack(s, 0);
  return rc != 0 ? rc : sync_messages(s);
}

/* ---- the caller's patches (wtx_trainer_send_patches) ---- */

/* Names each replica's version as the base of the caller's patches: what
 * this trainer last saw there, or (never seen) what it serves now. */
static int caller_bases(wtx_trainer *t) {
  size_t n = wtx_client_size(t->client);
  const char **bases = calloc(n, sizeof *bases);
  if (bases == NULL) return fail(t, WTX_ENOMEM, "out of memory");
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    wtx_weight_info info = {0};
    int unseen = wtx__client_serves(t->client, i)[0] == '\0';
    /* A caller's control plane cannot be asked what it serves. */
    if (unseen && wtx__client_is_control(t->client))
      rc = fail(t, WTX_ESTATE, "patches: this trainer has not seen what the engine behind "
                "the caller's control plane serves (it cannot be asked); send the whole "
                "model first, naming its version");
    else if (unseen && (rc = wtx_client_weight_info(t->client, i, 0, &info)) != 0)
      fail(t, rc, "%s", wtx_client_last_error(t->client));
    wtx_weight_info_free(&info);
    if (rc == 0 && (bases[i] = wtx__client_serves(t->client, i))[0] == '\0')
      rc = fail(t, WTX_ESTATE, "patches: worker %zu (%s) serves no version to apply them "
                "to; send the whole model first", i, wtx_client_target(t->client, i));
  }
  if (rc == 0) rc = wtx__client_set_bases(t->client, bases);
  free(bases);
  return rc;
}

/* Steps 1-3 of the caller's patches: the start naming each base, then the
 * first chunk; every replica must take patches. */
static int caller_begin(sync_state *s, int *lost) {
  wtx_trainer *t = s->t;
  int rc = caller_bases(t);
  if (rc != 0) return rc;
  wtx__client_start_begin(t->client, s->o->target, s->tb.n);
  rc = sync_buffers(s);
  if (rc == 0 && s->tb.n_chunks > 0) rc = sync_pack(s, 0);
  int src = wtx__client_start_end(t->client);
  /* A caller's control plane takes the base after its start. */
  if (src == 0 && (src = wtx__client_send_base(t->client)) != 0)
    return fail(t, WTX_ESTATE, "%s", wtx_client_last_error(t->client));
  if (src != 0) {
    *lost = session_lost(t->client);
    int stale = wtx_client_last_status(t->client) == GRPC_STATUS_FAILED_PRECONDITION;
    return fail(t, stale ? WTX_ESTATE : src, "%s", wtx_client_last_error(t->client));
  }
  if (rc == 0 && s->tb.n > 0 && !wtx__client_patches(t->client))
    rc = fail(t, WTX_ENOTSUP, "patches: a worker takes whole tensors only (its model cannot "
              "read its tensors back, or stages on the GPU)");
  return rc != 0 ? rc : sync_messages(s);
}

/* Steps 1-3: every worker's start in flight while the buffers and the
 * first chunk are readied (a round trip hidden behind work that does not
 * need its answer), then the chunks' messages. *lost: the start failed
 * because a worker may no longer know our session. */
static int delta_begin(sync_state *s, int *lost);
static int caller_begin(sync_state *s, int *lost);

static int sync_begin(sync_state *s, int *lost) {
  wtx_trainer *t = s->t;
  *lost = 0;
  int rc = !t->ready ? rendezvous(t) : 0;
  if (rc != 0) return rc;
  if (s->caller) return caller_begin(s, lost);
  if (t->delta) return delta_begin(s, lost);
  wtx__client_start_begin(t->client, s->o->target, t->n);
  rc = sync_buffers(s);
  if (rc == 0 && s->tb.n_chunks > 0) rc = sync_pack(s, 0);
  int src = wtx__client_start_end(t->client);
  if (src != 0) {
    *lost = session_lost(t->client);
    return fail(t, src, "%s", wtx_client_last_error(t->client));
  }
  return rc != 0 ? rc : sync_messages(s);
}

/* Steps 1-5 on rank 0: start, every chunk, finish (with commit 0: every
 * replica prepared, not published). */
static int sync_run(sync_state *s, int commit, char *version, size_t vlen) {
  wtx_trainer *t = s->t;
  int lost = 0;
  int rc = sync_begin(s, &lost);
  /* A worker restarted since the last sync no longer knows the session,
   * or refused a delta's base: every update opened is aborted (which ends
   * a tcp stream), one new rendezvous (a restarted worker's buffers are
   * new), then start again. Twice at most: a restarted worker serves no
   * version, so the delta's next start may be refused in turn. */
  for (int again = 0; lost && again < 2; again++) {
    wtx__client_abort(t->client, "re-initializing: a worker lost its session or refused "
                      "the delta's base");
    t->ready = 0;
    t->err[0] = '\0';
    sync_release(s);
    rc = sync_begin(s, &lost);
  }
  uint64_t done = 0;
  int ordered = rc == 0 && sync_ordered(s);
  for (size_t k = 0; rc == 0 && k < s->tb.n_chunks; k++) {
    if ((rc = ordered ? sync_chunk_ordered(s, k) : sync_chunk(s, k)) != 0) break;
    if (ordered && k == 0) continue; /* chunk k - 1's answer is in */
    done += s->tb.chunks[ordered ? k - 1 : k].bytes;
    if (s->o->progress != NULL) s->o->progress(s->o->progress_arg, done, s->tb.total);
  }
  if (rc == 0 && ordered && s->tb.n_chunks > 0) { /* the last chunk's answer */
    if ((rc = wtx__client_update_wait(t->client)) != 0)
      fail(t, rc, "%s", wtx_client_last_error(t->client));
    done = s->tb.total;
    if (rc == 0 && s->o->progress != NULL) s->o->progress(s->o->progress_arg, done, done);
  }
  if (rc == 0 && !s->caller) rc = cursor_end(&s->c);
  if (rc == 0 && (rc = commit ? wtx__client_finish(t->client, s->o->version, version, vlen)
                              : wtx__client_prepare(t->client, s->o->version)) != 0)
    fail(t, rc, "%s", wtx_client_last_error(t->client));
  return rc;
}

/* A delta-enabled sync landed: every replica serves the hash pass's
 * hashes now (once published), which are also every tensor's checksum. */
static void delta_landed(wtx_trainer *t, const sync_state *s, int commit) {
  memcpy(t->xxh3, t->dk.hashes, t->n * sizeof *t->xxh3);
  int to_main = s->o->target != WTX_TARGET_DRAFT;
  if (commit && to_main) {
    wtx__delta_landed(&t->dk, s->diffed, t->client);
  } else if (to_main) {
    /* Prepared, not published: the record stands for what the replicas
     * serve until the caller says it published (wtx__trainer_landed). */
    t->dk_prepared = 1 + s->diffed;
  } else {
    wtx__delta_failed(&t->dk);
  }
  if (s->delta) t->full_reason[0] = '\0';
  else if (t->full_reason[0] == '\0')
    snprintf(t->full_reason, sizeof t->full_reason, "delta: no earlier sync to compare with");
}

static void send_result(wtx_trainer *t, const sync_state *s, wtx_send_result *result,
                        double seconds, uint64_t control0, const char *version) {
  const sync_table *tb = &s->tb;
  *result = (wtx_send_result){.bytes = tb->total, .params = tb->n, .chunks = tb->n_chunks,
                              .seconds = seconds,
                              .xxh3 = s->verify || s->hashed ? t->xxh3 : NULL,
                              .direct = t->tt->direct != NULL && t->tt->direct(t->self),
                              .control_bytes = wtx__client_update_bytes(t->client) - control0,
                              .delta = s->delta,
                              .skipped_params = s->caller ? 0 : t->n - tb->n,
                              .skipped_bytes = s->caller ? 0 : t->total - tb->total,
                              .full_reason = t->delta && !s->delta ? t->full_reason : NULL};
  if (s->caller) result->xxh3 = NULL; /* the source's table's, not these */
  for (size_t j = 0; tb->patch != NULL && j < tb->n; j++) {
    if (tb->patch[j] == NULL) continue;
    result->patched_params++;
    result->patched_whole_bytes += tb->metas[j].nbytes;
  }
  snprintf(result->version, sizeof result->version, "%s", version);
}

/* One sync on rank 0, published (commit) or prepared. */
static int send_run(wtx_trainer *t, const wtx_send_options *o, int commit,
                    wtx_send_result *result) {
  double t0 = wtx__clock_s();
  int rc = trainer_metadata(t);
  if (rc != 0) return rc;
  uint64_t control0 = wtx__client_update_bytes(t->client);
  sync_state s = {.t = t, .o = o,
                  .tb = {.metas = t->metas, .n = t->n, .chunks = t->chunks,
                         .n_chunks = t->n_chunks, .total = t->total}};
  char version[WTX_MAX_VERSION_BYTES + 1] = "";
  t->sums_sent = 0;
  t->full_reason[0] = '\0';
  rc = sync_run(&s, commit, version, sizeof version);
  t->sums_sent = rc == 0 && s.verify;
  if (rc != 0) {
    /* Keep every replica's previous weights; a broken stream means the
     * sessions must be initialized again. The record of what they served
     * stands: the next delta names those versions as its bases, and a
     * replica that serves another (an undo that did not reach it) refuses
     * it, so the whole table goes. */
    wtx__delta_failed(&t->dk);
    wtx__trainer_abort(t, t->err);
  } else {
    if (t->delta && s.hashed) delta_landed(t, &s, commit);
    if (result != NULL) send_result(t, &s, result, wtx__clock_s() - t0, control0, version);
  }
  sync_release(&s);
  return rc;
}

static int check_version(wtx_trainer *t, const wtx_send_options *o) {
  if (o->version == NULL || strlen(o->version) <= WTX_MAX_VERSION_BYTES) return 0;
  return fail(t, WTX_EINVAL, "version: %zu bytes, at most %d", strlen(o->version),
              WTX_MAX_VERSION_BYTES);
}

int wtx_trainer_send_weights(wtx_trainer *t, const wtx_send_options *opts,
                             wtx_send_result *result) {
  wtx_send_options o = WTX_SEND_OPTIONS_INIT;
  if (opts != NULL) o = *opts;
  t->err[0] = '\0';
  int rc = check_version(t, &o);
  if (rc != 0) return rc;
  if (t->sh != NULL) return wtx__sharded_send(t->sh, &o, result, t->err, sizeof t->err);
  if (t->many != NULL) return wtx__many_send(t->many, &o, result, t->err, sizeof t->err);
  if (t->rank != 0) {
    const wtx_tensor_meta *metas;
    size_t n;
    rc = source_table(t, &metas, &n);
    /* A delta sync is two passes on rank 0: the hash pass, then the send. */
    if (rc == 0 && t->delta) rc = iterate_only(t, metas, n);
    return rc != 0 ? rc : iterate_only(t, metas, n);
  }
  return send_run(t, &o, 1, result);
}

/* One sync of the caller's patches on rank 0, published (commit) or
 * prepared. map: each patch's tensor in t's table, which names its part
 * (tensor-parallel groups); NULL: the patches name whole tensors. */
static int patches_run(wtx_trainer *t, const wtx_patch *patches, size_t n, const size_t *map,
                       const wtx_send_options *o, int commit, wtx_send_result *result) {
  double t0 = wtx__clock_s();
  char why[1400] = "";
  int rc = wtx__delta_caller(&t->cp, patches, n, t->args.wire.buffer_size, CHUNK_PARAMS,
                             t->args.wire.packed, why, sizeof why);
  if (rc != 0) return fail(t, rc, "%s", why[0] ? why : wtx_strerror(rc));
  uint64_t control0 = wtx__client_update_bytes(t->client);
  sync_state s = {.t = t, .o = o, .caller = 1, .delta = 1,
                  .tb = {.metas = t->cp.metas, .n = n, .map = map, .patch = t->cp.patch,
                         .src = t->cp.src, .chunks = t->cp.chunks,
                         .n_chunks = t->cp.n_chunks, .total = t->cp.total}};
  char version[WTX_MAX_VERSION_BYTES + 1] = "";
  rc = sync_run(&s, commit, version, sizeof version);
  /* Whatever happened, this trainer's own record of what they serve is
   * not theirs any more. */
  wtx__delta_forget(&t->dk);
  t->sums_sent = 0;
  if (rc != 0) wtx__trainer_abort(t, t->err);
  else if (result != NULL) send_result(t, &s, result, wtx__clock_s() - t0, control0, version);
  sync_release(&s);
  return rc;
}

int wtx_trainer_send_patches(wtx_trainer *t, const wtx_patch *patches, size_t n,
                             const wtx_send_options *opts, wtx_send_result *result) {
  wtx_send_options o = WTX_SEND_OPTIONS_INIT;
  if (opts != NULL) o = *opts;
  t->err[0] = '\0';
  if (result != NULL) *result = (wtx_send_result){0};
  int rc = check_version(t, &o);
  if (rc != 0) return rc;
  if (t->many != NULL)
    return wtx__many_send_patches(t->many, patches, n, &o, result, t->err, sizeof t->err);
  if (t->sh != NULL)
    return wtx__sharded_send_patches(t->sh, patches, n, &o, result, t->err, sizeof t->err);
  if (t->rank != 0 || n == 0) return 0;
  return patches_run(t, patches, n, NULL, &o, 1, result);
}

int wtx__trainer_patches_prepared(wtx_trainer *t, const wtx_patch *patches, size_t n,
                                  const size_t *map, const wtx_send_options *opts,
                                  wtx_send_result *result) {
  t->err[0] = '\0';
  if (result != NULL) *result = (wtx_send_result){0};
  return patches_run(t, patches, n, map, opts, 0, result);
}

int wtx_trainer_verify(wtx_trainer *t) {
  t->err[0] = '\0';
  if (t->sh != NULL) return wtx__sharded_verify(t->sh, t->err, sizeof t->err);
  if (t->many != NULL)
    return fail(t, WTX_ENOTSUP, "verify: with many senders no rank sees a whole tensor, "
                "and the workers keep no whole-tensor checksums to compare");
  if (!t->sums_sent)
    return fail(t, WTX_ESTATE, "verify: this trainer has sent no sync with checksums");
  int rc = wtx_client_verify(t->client, t->source, t->xxh3);
  return rc != 0 ? fail(t, rc, "%s", wtx_client_last_error(t->client)) : 0;
}

int wtx__trainer_send_prepared(wtx_trainer *t, const wtx_send_options *opts,
                               wtx_send_result *result) {
  t->err[0] = '\0';
  int rc = check_version(t, opts);
  return rc != 0 ? rc : send_run(t, opts, 0, result);
}

void wtx__trainer_landed(wtx_trainer *t, int published) {
  if (t->dk_prepared == 0) return;
  if (published) wtx__delta_landed(&t->dk, t->dk_prepared == 2, t->client);
  else wtx__delta_failed(&t->dk);
  t->dk_prepared = 0;
}

void wtx__trainer_abort(wtx_trainer *t, const char *reason) {
  wtx__client_abort(t->client, reason);
  t->ready = 0;
}
