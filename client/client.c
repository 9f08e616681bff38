/* Trainer library: fan-out client and the shm push. */
#include "client/client.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "wtx/v1/weight_transfer.grpc-c.h"

struct wtx_client {
  wtx_rpc_channel **ch;
  size_t n;
  char err[1400];
};

static void seterr(wtx_client *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void seterr(wtx_client *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err, sizeof c->err, fmt, ap);
  va_end(ap);
}

int wtx_client_create(const char *const *targets, size_t n, wtx_client **out) {
  *out = NULL;
  if (n == 0) return WTX_EINVAL;
  wtx_client *c = calloc(1, sizeof *c);
  if (c == NULL) return WTX_ENOMEM;
  c->ch = calloc(n, sizeof *c->ch);
  if (c->ch == NULL) {
    free(c);
    return WTX_ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    int rc = wtx_rpc_channel_create(targets[i], NULL, &c->ch[i]);
    if (rc != 0) {
      c->n = i;
      wtx_client_destroy(c);
      return rc;
    }
  }
  c->n = n;
  *out = c;
  return 0;
}

void wtx_client_destroy(wtx_client *c) {
  if (c == NULL) return;
  for (size_t i = 0; i < c->n; i++) wtx_rpc_channel_destroy(c->ch[i]);
  free(c->ch);
  free(c);
}

const char *wtx_client_last_error(const wtx_client *c) { return c->err; }

/* ---- synthetic model ---- */

static void add(wtx_synth_param *p, size_t *n, const char *name, uint64_t a,
                uint64_t b) {
  wtx_synth_param *q = &p[(*n)++];
  memset(q, 0, sizeof *q);
  snprintf(q->name, sizeof q->name, "%s", name);
  q->dtype = WTX_DTYPE_BFLOAT16;
  q->shape[0] = a;
  q->shape[1] = b;
  q->ndim = b ? 2 : 1;
  q->nbytes = a * (b ? b : 1) * 2;
}

int wtx_synth_layout(uint64_t total_bytes, wtx_synth_param **out, size_t *n) {
  /* hidden h, vocab 4h, per layer 12 h^2 params: pick layers then h. */
  uint64_t h = 256;
  while (12 * (h * 2) * (h * 2) * 2 * 8 <= total_bytes && h < 8192) h *= 2;
  uint64_t per_layer = (12 * h * h + 2 * h) * 2;
  uint64_t embed = 4 * h * h * 2;
  uint64_t layers = total_bytes > embed ? (total_bytes - embed) / per_layer : 1;
  if (layers == 0) layers = 1;
  if (layers > 4096) layers = 4096;
  wtx_synth_param *p = calloc(layers * 9 + 3, sizeof *p);
  if (p == NULL) return WTX_ENOMEM;
  size_t k = 0;
  add(p, &k, "model.embed_tokens.weight", 4 * h, h);
  char name[128];
  static const char *const proj[] = {"self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj", "self_attn.o_proj"};
  for (uint64_t l = 0; l < layers; l++) {
    for (int j = 0; j < 4; j++) {
      snprintf(name, sizeof name, "model.layers.%llu.%s.weight",
               (unsigned long long)l, proj[j]);
      add(p, &k, name, h, h);
    }
    snprintf(name, sizeof name, "model.layers.%llu.mlp.up_proj.weight",
             (unsigned long long)l);
    add(p, &k, name, 4 * h, h);
    snprintf(name, sizeof name, "model.layers.%llu.mlp.down_proj.weight",
             (unsigned long long)l);
    add(p, &k, name, h, 4 * h);
    snprintf(name, sizeof name, "model.layers.%llu.input_layernorm.weight",
             (unsigned long long)l);
    add(p, &k, name, h, 0);
    snprintf(name, sizeof name,
             "model.layers.%llu.post_attention_layernorm.weight",
             (unsigned long long)l);
    add(p, &k, name, h, 0);
  }
  add(p, &k, "model.norm.weight", h, 0);
  *out = p;
  *n = k;
  return 0;
}

static uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/* Writes bytes [off, off+len) of a tensor's deterministic content. */
static void synth_fill(uint64_t seed, uint8_t *dst, uint64_t off, size_t len) {
  size_t i = 0;
  /* Head up to a word boundary, whole words, then the tail. */
  while (i < len && (off + i) % 8 != 0) {
    uint64_t v = splitmix(seed ^ ((off + i) / 8));
    dst[i] = (uint8_t)(v >> (8 * ((off + i) % 8)));
    i++;
  }
  for (; i + 8 <= len; i += 8) {
    uint64_t v = splitmix(seed ^ ((off + i) / 8));
    memcpy(dst + i, &v, 8); /* little-endian, as the byte loop below */
  }
  while (i < len) {
    uint64_t v = splitmix(seed ^ ((off + i) / 8));
    dst[i] = (uint8_t)(v >> (8 * ((off + i) % 8)));
    i++;
  }
}

/* ---- fan-out ---- */

typedef struct replica {
  char session_id[64];
  uint64_t update_id;
} replica;

static void abort_all(wtx_client *c, replica *r, const char *why) {
  for (size_t i = 0; i < c->n; i++) {
    Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = r[i].session_id;
    req.reason = (char *)why;
    Wtx__V1__AbortWeightUpdateResponse *resp = NULL;
    wtx_rpc_status st;
    wtx_rpc_call_options o = WTX_RPC_CALL_OPTIONS_INIT;
    o.timeout_ms = 5000;
    if (wtx__v1__weight_transfer__abort_weight_update__call(c->ch[i], &req, &resp,
                                                             &o, &st) == 0)
      protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
}

int wtx_client_push_shm(wtx_client *c, wtx_synth_param *params, size_t n,
                        const wtx_push_options *opts) {
  wtx_push_options o = WTX_PUSH_OPTIONS_INIT;
  if (opts != NULL) o = *opts;
  if (o.buffer_size == 0) o.buffer_size = UINT64_C(64) << 20;
  if (o.timeout_ms == 0) o.timeout_ms = 300000;
  wtx_rpc_call_options co = WTX_RPC_CALL_OPTIONS_INIT;
  co.timeout_ms = o.timeout_ms;
  replica *r = calloc(c->n, sizeof *r);
  if (r == NULL) return WTX_ENOMEM;
  wtx_rpc_status st;
  int rc = 0;

  /* init */
  Wtx__V1__PackingParams pk = WTX__V1__PACKING_PARAMS__INIT;
  pk.packed = 1;
  pk.buffer_size_bytes = o.buffer_size;
  pk.num_buffers = 1;
  Wtx__V1__ShmInitInfo shm = WTX__V1__SHM_INIT_INFO__INIT;
  shm.packing = &pk;
  shm.checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  ii.backend_case = WTX__V1__INIT_INFO__BACKEND_SHM;
  ii.shm = &shm;
  Wtx__V1__InitWeightTransferEngineRequest ireq =
      WTX__V1__INIT_WEIGHT_TRANSFER_ENGINE_REQUEST__INIT;
  ireq.init_info = &ii;
  for (size_t i = 0; i < c->n && rc == 0; i++) {
    Wtx__V1__InitWeightTransferEngineResponse *resp = NULL;
    rc = wtx__v1__weight_transfer__init_weight_transfer_engine__call(
        c->ch[i], &ireq, &resp, &co, &st);
    if (rc != 0) {
      seterr(c, "worker %s: InitWeightTransferEngine: %s: %s",
             wtx_rpc_channel_target(c->ch[i]), wtx_rpc_code_name(st.code), st.message);
    } else {
      snprintf(r[i].session_id, sizeof r[i].session_id, "%s", resp->session_id);
      protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
  }
  /* start */
  for (size_t i = 0; i < c->n && rc == 0; i++) {
    Wtx__V1__StartWeightUpdateRequest req = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = r[i].session_id;
    Wtx__V1__StartWeightUpdateResponse *resp = NULL;
    rc = wtx__v1__weight_transfer__start_weight_update__call(c->ch[i], &req, &resp,
                                                              &co, &st);
    if (rc != 0) {
      seterr(c, "worker %s: StartWeightUpdate: %s: %s",
             wtx_rpc_channel_target(c->ch[i]), wtx_rpc_code_name(st.code), st.message);
    } else {
      r[i].update_id = resp->update_id;
      protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
  }
  if (rc != 0) {
    free(r);
    return rc;
  }

  /* the shared-memory buffer */
  char region[64];
  snprintf(region, sizeof region, "/wtx-%d-%lx", (int)getpid(), (long)time(NULL));
  int fd = shm_open(region, O_RDWR | O_CREAT | O_EXCL, 0600);
  uint8_t *buf = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, (off_t)o.buffer_size) == 0)
    buf = mmap(NULL, o.buffer_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (buf == MAP_FAILED) {
    seterr(c, "cannot create shared memory %s of %llu bytes", region,
           (unsigned long long)o.buffer_size);
    if (fd >= 0) {
      close(fd);
      shm_unlink(region);
    }
    abort_all(c, r, "trainer: no shared memory");
    free(r);
    return WTX_EIO;
  }

  XXH3_state_t *h = XXH3_createState();
  Wtx__V1__ParamMeta *pm = calloc(n, sizeof *pm);
  Wtx__V1__ParamMeta **pmp = calloc(n, sizeof *pmp);
  uint64_t *sums = calloc(n, sizeof *sums);
  if (h == NULL || pm == NULL || pmp == NULL || sums == NULL) rc = WTX_ENOMEM;
  uint64_t total = 0, done = 0;
  for (size_t i = 0; i < n; i++) {
    total += params[i].nbytes;
    wtx__v1__param_meta__init(&pm[i]);
    pm[i].name = params[i].name;
    pm[i].dtype = (Wtx__V1__DType)params[i].dtype;
    pm[i].n_shape = params[i].ndim;
    pm[i].shape = params[i].shape;
    pmp[i] = &pm[i];
  }
  size_t ti = 0;          /* tensor being written */
  uint64_t tpos = 0;      /* bytes of it written */
  wtx_rpc_pending **pend = calloc(c->n, sizeof *pend);
  if (pend == NULL) rc = WTX_ENOMEM;
  while (rc == 0 && ti < n) {
    size_t first = ti;
    uint64_t first_off = tpos;
    size_t n_sums = 0;
    uint64_t used = 0;
    while (ti < n && used < o.buffer_size) {
      uint64_t seed = o.seed ^ XXH3_64bits(params[ti].name, strlen(params[ti].name));
      if (tpos == 0) XXH3_64bits_reset(h);
      uint64_t k = params[ti].nbytes - tpos;
      if (k > o.buffer_size - used) k = o.buffer_size - used;
      synth_fill(seed, buf + used, tpos, (size_t)k);
      XXH3_64bits_update(h, buf + used, (size_t)k);
      used += k;
      tpos += k;
      if (tpos == params[ti].nbytes) {
        params[ti].xxh3 = sums[n_sums++] = XXH3_64bits_digest(h);
        ti++;
        tpos = 0;
      }
      if (used == o.buffer_size) break;
    }
    size_t last = tpos > 0 ? ti : ti - 1; /* inclusive */
    Wtx__V1__ShmUpdateInfo su = WTX__V1__SHM_UPDATE_INFO__INIT;
    su.region = region;
    su.offset = 0;
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.chunk_bytes = used;
    ui.first_param_offset = first_off;
    ui.xxh3_64 = sums;
    ui.n_xxh3_64 = n_sums;
    ui.params = &pmp[first];
    ui.n_params = last - first + 1;
    ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_SHM;
    ui.shm = &su;
    for (size_t i = 0; i < c->n; i++) {
      Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
      req.session_id = r[i].session_id;
      req.update_id = r[i].update_id;
      req.update_info = &ui;
      int e = wtx__v1__weight_transfer__update_weights__start(c->ch[i], &req,
                                                               &co, &pend[i]);
      if (e != 0 && rc == 0) {
        rc = e;
        seterr(c, "worker %s: UpdateWeights: cannot start the call: %s",
               wtx_rpc_channel_target(c->ch[i]), wtx_strerror(e));
      }
    }
    /* Every started call is waited for, even after a failure. */
    for (size_t i = 0; i < c->n; i++) {
      if (pend[i] == NULL) continue;
      Wtx__V1__UpdateWeightsResponse *resp = NULL;
      int e = wtx__v1__weight_transfer__update_weights__wait(pend[i], &resp, &st);
      if (e != 0 && rc == 0) {
        rc = e;
        seterr(c, "worker %s: UpdateWeights: %s: %s",
               wtx_rpc_channel_target(c->ch[i]), wtx_rpc_code_name(st.code),
               st.message);
      }
      if (resp != NULL) protobuf_c_message_free_unpacked(&resp->base, NULL);
      pend[i] = NULL;
    }
    done += used;
    if (o.progress != NULL) o.progress(o.progress_arg, done, total);
  }
  /* finish */
  for (size_t i = 0; i < c->n && rc == 0; i++) {
    Wtx__V1__FinishWeightUpdateRequest req = WTX__V1__FINISH_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = r[i].session_id;
    req.update_id = r[i].update_id;
    req.weight_version = (char *)(o.version ? o.version : "");
    Wtx__V1__FinishWeightUpdateResponse *resp = NULL;
    rc = wtx__v1__weight_transfer__finish_weight_update__call(c->ch[i], &req, &resp,
                                                               &co, &st);
    if (rc != 0)
      seterr(c, "worker %s: FinishWeightUpdate: %s: %s",
             wtx_rpc_channel_target(c->ch[i]), wtx_rpc_code_name(st.code), st.message);
    else
      protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  if (rc != 0) abort_all(c, r, c->err);
  munmap(buf, o.buffer_size);
  close(fd);
  shm_unlink(region);
  XXH3_freeState(h);
  free(pend);
  free(pm);
  free(pmp);
  free(sums);
  free(r);
  return rc;
}

int wtx_client_verify(wtx_client *c, const wtx_synth_param *params, size_t n) {
  for (size_t i = 0; i < c->n; i++) {
    Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
    req.include_params = 1;
    Wtx__V1__GetWeightInfoResponse *resp = NULL;
    wtx_rpc_status st;
    int rc = wtx__v1__weight_transfer__get_weight_info__call(c->ch[i], &req, &resp,
                                                              NULL, &st);
    if (rc != 0) {
      seterr(c, "worker %s: GetWeightInfo: %s: %s", wtx_rpc_channel_target(c->ch[i]),
             wtx_rpc_code_name(st.code), st.message);
      return rc;
    }
    rc = 0;
    if (resp->n_params != n) {
      seterr(c, "worker %s holds %zu parameters, the trainer sent %zu",
             wtx_rpc_channel_target(c->ch[i]), resp->n_params, n);
      rc = WTX_ECHECKSUM;
    }
    for (size_t j = 0; rc == 0 && j < n; j++) {
      const Wtx__V1__ParamInfo *p = resp->params[j];
      if (strcmp(p->meta->name, params[j].name) != 0 || p->xxh3_64 != params[j].xxh3) {
        seterr(c, "worker %s: '%s' xxh3 %016llx, the trainer sent %016llx",
               wtx_rpc_channel_target(c->ch[i]), p->meta->name,
               (unsigned long long)p->xxh3_64, (unsigned long long)params[j].xxh3);
        rc = WTX_ECHECKSUM;
      }
    }
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    if (rc != 0) return rc;
  }
  return 0;
}
