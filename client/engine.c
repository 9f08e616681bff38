/* wtx trainer engine: one weight sync = start, every chunk, finish
 * (see client.h). Chunks come from wtx_chunks_plan, the same cut the
 * workers expect; packing chunk c+1 overlaps the transfer of chunk c when
 * the session has two buffers or more. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#include "common/clock.h"
#include "client/client.h"
#include "transport/transport.h"

struct wtx_trainer {
  uint32_t rank;
  wtx_client *client;
  wtx_source *source;
  Wtx__V1__InitInfo *tmpl; /* a copy of the init info */
  const wtx_trainer_transport *tt;
  wtx_wire_params wire;
  void *self;  /* the transport's trainer half */
  int ready;   /* sessions initialized and in step */
  uint64_t *xxh3;
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

/* Creates the trainer half and initializes every replica, in order. */
static int rendezvous(wtx_trainer *t) {
  if (t->self != NULL) t->tt->destroy(t->self);
  t->self = NULL;
  t->ready = 0;
  size_t n = wtx_client_size(t->client);
  char err[600] = "";
  int rc = t->tt->create(t->tmpl, &t->wire, n, &t->self, err, sizeof err);
  if (rc != 0) return fail(t, rc, "%s", err);
  char **addrs = calloc(n, sizeof *addrs);
  if (addrs == NULL) return fail(t, WTX_ENOMEM, "out of memory");
  int collective = t->tt->collective_init;
  size_t started = 0;
  /* Before a collective rendezvous, where every member blocks until all
   * have joined, make sure every replica answers: an unreachable one then
   * fails at once, by name, instead of after everyone's timeout. */
  for (size_t i = 0; collective && i < n && rc == 0; i++) {
    uint32_t ws = 0;
    rc = wtx_client_world_size(t->client, i, &ws);
    if (rc != 0)
      fail(t, rc, "%s", wtx_client_last_error(t->client));
    else if (ws != 1)
      rc = fail(t, WTX_EINVAL, "%s: worker %zu (%s) reports %u ranks; each "
                "endpoint must host one rank", t->tt->name, i,
                wtx_client_target(t->client, i), ws);
  }
  for (size_t i = 0; i < n && rc == 0; i++) {
    const Wtx__V1__InitInfo *info = NULL;
    rc = t->tt->init_info(t->self, i, (const char *const *)addrs, &info);
    if (rc != 0) {
      fail(t, rc, "%s: no init info for worker %zu (worker %zu reported no "
           "data address)", t->tt->name, i, i ? i - 1 : 0);
      break;
    }
    if ((rc = wtx_client_init_start(t->client, i, info)) != 0) {
      fail(t, rc, "%s", wtx_client_last_error(t->client));
      break;
    }
    started = i + 1;
    if (collective) continue; /* all in flight, then the trainer joins */
    Wtx__V1__InitWeightTransferEngineResponse *resp = NULL;
    rc = wtx_client_init_wait(t->client, i, &resp);
    if (rc != 0) {
      fail(t, rc, "%s", wtx_client_last_error(t->client));
      break;
    }
    addrs[i] = strdup(resp->data_address);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    if (addrs[i] == NULL) rc = fail(t, WTX_ENOMEM, "out of memory");
  }
  if (collective) {
    /* The trainer's half of the collective, then every worker's answer. A
     * worker's failure is the cause of the collective's, so it is the one
     * reported. */
    int crc = 0;
    if (rc == 0 && t->tt->connect != NULL)
      crc = t->tt->connect(t->self, NULL, err, sizeof err);
    int wrc = 0;
    for (size_t i = 0; i < started; i++) {
      int e = wtx_client_init_wait(t->client, i, NULL);
      if (e != 0 && wrc == 0) {
        wrc = e;
        fail(t, e, "%s", wtx_client_last_error(t->client));
      }
    }
    if (rc == 0 && wrc != 0) rc = wrc;
    if (rc == 0 && crc != 0) rc = fail(t, crc, "%s", err);
  }
  if (rc == 0 && !collective && t->tt->connect != NULL &&
      (rc = t->tt->connect(t->self, (const char *const *)addrs, err, sizeof err)) != 0)
    fail(t, rc, "%s", err);
  for (size_t i = 0; i < n; i++) free(addrs[i]);
  free(addrs);
  if (rc == 0) t->ready = 1;
  return rc;
}

int wtx_trainer_init(const wtx_trainer_init_info *info, wtx_client *client,
                     wtx_source *source, wtx_trainer **out, char *err,
                     size_t errlen) {
  *out = NULL;
  if (info == NULL || info->init == NULL || source == NULL ||
      (info->rank == 0 && client == NULL)) {
    snprintf(err, errlen, "trainer_init: init info, source and (on rank 0) a "
             "client are required");
    return WTX_EINVAL;
  }
  wtx_transports_register_builtin();
  wtx_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) return WTX_ENOMEM;
  t->rank = info->rank;
  t->client = client;
  t->source = source;
  int rc = wtx_wire_params_from_init(info->init, &t->wire, err, errlen);
  const char *name = wtx_init_backend_name(info->init);
  if (rc == 0 && (t->tt = wtx_trainer_transport_find(name)) == NULL) {
    char names[256];
    wtx_trainer_transport_names(names, sizeof names);
    snprintf(err, errlen, "init_info: backend '%s' is not available on the "
             "trainer (registered: %s)", name, names);
    rc = WTX_EINVAL;
  }
  /* Keep a private copy: the caller's message may go away. */
  if (rc == 0) {
    size_t len = protobuf_c_message_get_packed_size(&info->init->base);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf != NULL) {
      protobuf_c_message_pack(&info->init->base, buf);
      t->tmpl = wtx__v1__init_info__unpack(NULL, len, buf);
      free(buf);
    }
    if (t->tmpl == NULL) rc = WTX_ENOMEM;
  }
  if (rc == 0 && t->rank == 0 && (rc = rendezvous(t)) != 0)
    snprintf(err, errlen, "%s", t->err);
  if (rc != 0) {
    wtx_trainer_shutdown(t);
    return rc;
  }
  *out = t;
  return 0;
}

void wtx_trainer_shutdown(wtx_trainer *t) {
  if (t == NULL) return;
  if (t->self != NULL) t->tt->destroy(t->self);
  if (t->tmpl != NULL) wtx__v1__init_info__free_unpacked(t->tmpl, NULL);
  free(t->xxh3);
  free(t);
}

/* ---- one sync ---- */

/* The source's pass, checked against its metadata as it goes. */
typedef struct cursor {
  wtx_trainer *t;
  const wtx_tensor_meta *metas;
  size_t n;
  void *iter;
  size_t i;             /* tensor held (data valid) */
  const uint8_t *data;
  int have;             /* data holds tensor i */
  XXH3_state_t *h;
} cursor;

static void meta_str(const wtx_tensor_meta *m, char *buf, size_t len) {
  size_t o = (size_t)snprintf(buf, len, "'%s' %s [", m->name, wtx_dtype_name(m->dtype));
  for (size_t d = 0; d < m->ndim && o < len; d++)
    o += (size_t)snprintf(buf + o, len - o, "%s%llu", d ? ", " : "",
                          (unsigned long long)m->shape[d]);
  if (o < len) snprintf(buf + o, len - o, "]");
}

/* Makes tensor i the one held: pulls it from the iteration and checks it
 * against metadata()[i]. */
static int cursor_get(cursor *c, size_t i) {
  if (c->have && c->i == i) return 0;
  wtx_tensor_meta m;
  const uint8_t *data = NULL;
  int r = wtx_source_next(c->t->source, c->iter, &m, &data);
  if (r < 0) return fail(c->t, r, "source: iteration failed at parameter %zu: %s",
                         i, wtx_strerror(r));
  if (r == 0)
    return fail(c->t, WTX_EINVAL, "source: iteration ended after %zu parameters, "
                "metadata() lists %zu (first missing: '%s')", i, c->n,
                c->metas[i].name);
  const wtx_tensor_meta *want = &c->metas[i];
  int same = strcmp(m.name, want->name) == 0 && m.dtype == want->dtype &&
             m.ndim == want->ndim && m.nbytes == want->nbytes;
  for (size_t d = 0; same && d < m.ndim; d++) same = m.shape[d] == want->shape[d];
  if (!same) {
    char a[600], b[600];
    meta_str(&m, a, sizeof a);
    meta_str(want, b, sizeof b);
    return fail(c->t, WTX_EINVAL, "source: parameter %zu of the iteration is %s "
                "but metadata() says %s (nothing of it was sent)", i, a, b);
  }
  c->i = i;
  c->data = data;
  c->have = 1;
  return 0;
}

/* After the last tensor, the iteration must end too. */
static int cursor_end(cursor *c) {
  wtx_tensor_meta m;
  const uint8_t *data;
  int r = wtx_source_next(c->t->source, c->iter, &m, &data);
  if (r == 1)
    return fail(c->t, WTX_EINVAL, "source: iteration yields '%s' after the %zu "
                "parameters metadata() lists", m.name, c->n);
  return r < 0 ? fail(c->t, r, "source: iteration failed at its end") : 0;
}

/* Copies chunk ch's bytes into buf, hashing whole tensors; fills sums with
 * the checksums of the tensors ending in the chunk. */
static int pack(cursor *c, const wtx_chunk *ch, uint8_t *buf, uint64_t *sums,
                size_t *n_sums, int verify) {
  uint64_t off = ch->first_offset, used = 0;
  *n_sums = 0;
  for (size_t i = ch->first; i <= ch->last; i++) {
    int rc = cursor_get(c, i);
    if (rc != 0) return rc;
    if (off == 0 && verify) XXH3_64bits_reset(c->h);
    uint64_t k = c->metas[i].nbytes - off;
    if (k > ch->bytes - used) k = ch->bytes - used;
    if (k > 0) {
      memcpy(buf + used, c->data + off, (size_t)k);
      if (verify) XXH3_64bits_update(c->h, c->data + off, (size_t)k);
    }
    used += k;
    if (off + k == c->metas[i].nbytes) {
      uint64_t d = verify ? XXH3_64bits_digest(c->h) : 0;
      c->t->xxh3[i] = d;
      sums[(*n_sums)++] = d;
    }
    off = 0;
  }
  return 0;
}

/* The checksums of the chunk packed in each buffer, for its UpdateInfo. */
typedef struct slot {
  uint64_t *sums;
  size_t n_sums;
} slot;

/* Packs chunk k into its buffer (k mod the number of buffers). */
static int pack_chunk(cursor *c, const wtx_chunk *chunks, size_t k, slot *slots,
                      uint32_t nb, int verify) {
  uint32_t b = (uint32_t)(k % nb);
  return pack(c, &chunks[k], c->t->tt->buffer(c->t->self, b), slots[b].sums,
              &slots[b].n_sums, verify);
}

/* A rank that does not send still runs the source's pass (each yield may be
 * a collective every rank must join), checked like the sender's. */
static int iterate_only(wtx_trainer *t, const wtx_tensor_meta *metas, size_t n) {
  cursor c = {.t = t, .metas = metas, .n = n};
  int rc = wtx_source_open(t->source, &c.iter);
  if (rc != 0) return fail(t, rc, "source: cannot start a pass");
  for (size_t i = 0; i < n && rc == 0; i++) rc = cursor_get(&c, i);
  if (rc == 0) rc = cursor_end(&c);
  wtx_source_close(t->source, c.iter);
  return rc;
}

int wtx_trainer_send_weights(wtx_trainer *t, const wtx_send_options *opts,
                             wtx_send_result *result) {
  wtx_send_options o = WTX_SEND_OPTIONS_INIT;
  if (opts != NULL) o = *opts;
  t->err[0] = '\0';
  const wtx_tensor_meta *metas;
  size_t n;
  int rc = wtx_source_metadata(t->source, &metas, &n);
  if (rc != 0) return fail(t, rc, "source: metadata() failed");
  if (n == 0) return fail(t, WTX_EINVAL, "source: no parameters");
  if (t->rank != 0) return iterate_only(t, metas, n);

  double t0 = wtx_clock_s();
  uint64_t *sizes = calloc(n, sizeof *sizes);
  uint64_t *xxh3 = realloc(t->xxh3, n * sizeof *xxh3);
  if (sizes == NULL || xxh3 == NULL) {
    free(sizes);
    if (xxh3 != NULL) t->xxh3 = xxh3;
    return fail(t, WTX_ENOMEM, "out of memory");
  }
  t->xxh3 = xxh3;
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) total += sizes[i] = metas[i].nbytes;
  wtx_chunk *chunks = NULL;
  size_t n_chunks = 0;
  rc = wtx_chunks_plan(sizes, n, t->wire.buffer_size, t->wire.packed, &chunks,
                       &n_chunks);
  free(sizes);
  if (rc != 0) return fail(t, rc, "cannot plan chunks");

  /* A session that failed before is out of step: initialize it again. */
  if (!t->ready) rc = rendezvous(t);
  if (rc == 0 && (rc = wtx_client_start(t->client, o.target)) != 0)
    fail(t, rc, "%s", wtx_client_last_error(t->client));

  cursor c = {.t = t, .metas = metas, .n = n, .h = XXH3_createState()};
  int opened = 0;
  if (rc == 0 && c.h == NULL) rc = fail(t, WTX_ENOMEM, "out of memory");
  if (rc == 0 && (rc = wtx_source_open(t->source, &c.iter)) != 0)
    fail(t, rc, "source: cannot start a pass");
  opened = rc == 0;
  int verify =
      t->wire.checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  uint32_t nb = t->wire.num_buffers ? t->wire.num_buffers : 1;
  /* Checksums and params of the chunks in flight, per buffer. */
  size_t max_params = 0;
  for (size_t k = 0; k < n_chunks; k++)
    if (chunks[k].last - chunks[k].first + 1 > max_params)
      max_params = chunks[k].last - chunks[k].first + 1;
  uint64_t *sums = calloc(nb * (max_params + 1), sizeof *sums);
  slot *slots = calloc(nb, sizeof *slots);
  Wtx__V1__ParamMeta *pm = calloc(n, sizeof *pm);
  Wtx__V1__ParamMeta **pmp = calloc(n, sizeof *pmp);
  if (rc == 0 && (sums == NULL || slots == NULL || pm == NULL || pmp == NULL))
    rc = fail(t, WTX_ENOMEM, "out of memory");
  for (uint32_t b = 0; rc == 0 && b < nb; b++) slots[b].sums = &sums[b * (max_params + 1)];
  for (size_t i = 0; rc == 0 && i < n; i++) {
    wtx__v1__param_meta__init(&pm[i]);
    pm[i].name = (char *)metas[i].name;
    pm[i].dtype = (Wtx__V1__DType)metas[i].dtype;
    pm[i].n_shape = metas[i].ndim;
    pm[i].shape = (uint64_t *)metas[i].shape;
    pmp[i] = &pm[i];
  }

  uint64_t done = 0;
  char err[600] = "";
  if (rc == 0 && n_chunks > 0) rc = pack_chunk(&c, chunks, 0, slots, nb, verify);
  for (size_t k = 0; rc == 0 && k < n_chunks; k++) {
    uint32_t b = (uint32_t)(k % nb);
    const wtx_chunk *ch = &chunks[k];
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.params = &pmp[ch->first];
    ui.n_params = ch->last - ch->first + 1;
    ui.first_param_offset = ch->first_offset;
    ui.chunk_bytes = ch->bytes;
    if (verify) {
      ui.xxh3_64 = slots[b].sums;
      ui.n_xxh3_64 = slots[b].n_sums;
    }
    rc = t->tt->prepare(t->self, b, ch, &ui);
    if (rc != 0) {
      fail(t, rc, "%s: cannot prepare chunk %zu", t->tt->name, k);
      break;
    }
    if ((rc = wtx_client_update_start(t->client, &ui)) != 0) {
      fail(t, rc, "%s", wtx_client_last_error(t->client));
      wtx_client_update_wait(t->client);
      break;
    }
    int prc = t->tt->post != NULL ? t->tt->post(t->self, b, ch) : 0;
    if (prc != 0) snprintf(err, sizeof err, "%s: cannot send chunk %zu", t->tt->name, k);
    /* Pack the next chunk while this one moves (another buffer). */
    int packed_next = 0;
    if (prc == 0 && k + 1 < n_chunks && nb > 1) {
      rc = pack_chunk(&c, chunks, k + 1, slots, nb, verify);
      packed_next = 1;
    }
    int drc = prc != 0 ? prc
              : t->tt->complete != NULL ? t->tt->complete(t->self, b, err, sizeof err)
                                        : 0;
    int crc = wtx_client_update_wait(t->client);
    /* A worker's refusal is the cause of a data-plane failure it provokes
     * (it drops the stream, it skips a collective), so the workers' error
     * comes first, then the data plane's, then the source's. */
    if (crc != 0)
      rc = fail(t, crc, "%s%s%s", wtx_client_last_error(t->client),
                drc ? "; data plane: " : "", drc ? err : "");
    else if (drc != 0)
      rc = fail(t, drc, "%s", err);
    if (rc != 0) break;
    done += ch->bytes;
    if (o.progress != NULL) o.progress(o.progress_arg, done, total);
    /* One buffer: the next chunk is packed once this one has arrived. */
    if (!packed_next && k + 1 < n_chunks) rc = pack_chunk(&c, chunks, k + 1, slots, nb, verify);
  }
  if (rc == 0) rc = cursor_end(&c);
  char *version = NULL;
  if (rc == 0 && (rc = wtx_client_finish(t->client, o.version, &version)) != 0)
    fail(t, rc, "%s", wtx_client_last_error(t->client));
  if (rc != 0 && t->client != NULL) {
    /* Keep every replica's previous weights; a broken stream means the
     * sessions must be initialized again. */
    wtx_client_abort(t->client, t->err);
    t->ready = 0;
  }
  if (opened) wtx_source_close(t->source, c.iter);
  if (c.h != NULL) XXH3_freeState(c.h);
  if (rc == 0 && result != NULL) {
    result->bytes = total;
    result->params = n;
    result->chunks = n_chunks;
    result->seconds = wtx_clock_s() - t0;
    snprintf(result->version, sizeof result->version, "%s", version ? version : "");
    result->xxh3 = verify ? t->xxh3 : NULL;
  }
  free(version);
  free(chunks);
  free(sums);
  free(slots);
  free(pm);
  free(pmp);
  return rc;
}
