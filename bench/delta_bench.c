/* Delta syncs against full ones, in one run, to the workers named: a model
 * of TENSORS tensors of about SIZE bytes in all (random bytes), synced by a
 * trainer without delta (the best of its syncs 3-5, the steady state) and by
 * one with delta, which then syncs the same model again after each kind of
 * change below (each the best of three, every one a fresh change):
 *   none        nothing changed
 *   tensors5    5 % of the tensors changed (one byte each)
 *   elements1   1 % of the elements of every tensor changed
 * then the same again with patches (WTX_DELTA_PATCHES), after "# patches".
 * Each line: kind, seconds, bytes sent, tensors sent. A delta's time
 * includes its hash pass over the whole model.
 *
 * With RANK WORLD RANK_ADDRESSES, one of WORLD trainer ranks (a process
 * each, every one run with the same arguments but RANK; the session token
 * from WTX_SESSION_TOKEN): the tensors are split among the ranks in
 * contiguous runs, as a pipeline's stages own layers, each rank holding
 * and changing only its own, and a line's bytes are this rank's (the
 * seconds are its sync's: rank 0's is the whole sync's). With
 * DELTA_BENCH_LAYOUT=fsdp in the environment every tensor is Shard(0)
 * over all the ranks instead (FSDP), each rank holding and changing its
 * shard of each; with =rows, every tensor is [elements / 64, 64] and
 * Shard(1) over all the ranks (a row-parallel trainer's columns, which
 * whole replicas receive as boxes).
 *
 * usage: delta_bench WORKERS SIZE TENSORS BACKEND [RANK WORLD RANK_ADDRESSES]
 *   WORKERS  comma-separated host:port; SIZE bytes (K/M/G); BACKEND shm|tcp
 * Exits 1 on a failed sync, 2 on bad usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/plan.h"
#include "wtx/client.h"

typedef struct model {
  size_t n;
  uint64_t *shapes;
  uint8_t **data; /* NULL: another rank's tensor */
  char **names;
  wtx_memory_tensor *ts;
  uint32_t rank, world, *owner; /* owner[i]: the rank that holds tensor i */
  wtx_ownership *own;
  int fsdp;          /* every tensor Shard(0) over every rank */
  int rows;          /* every tensor [shapes[i] / COLS, COLS], Shard(1) over every rank */
  uint32_t *all;     /* fsdp, rows: the ranks, 0..world-1 */
  uint64_t *dims;    /* tensor i's shape: dims[2 * i], and dims[2 * i + 1] with rows */
  /* This rank's elements of tensor i: [lo, lo + len) of it, or with rows
   * of each row (held[i] elements in all). */
  uint64_t *lo, *len, *held;
} model;

enum { COLS = 64 };

/* Tensor i's owners, and the elements of it this rank holds. */
static void own_tensor(model *m, size_t i) {
  static const int32_t shard0[] = {0}, shard1[] = {1};
  size_t nd = m->rows ? 2 : 1;
  m->owner[i] = (uint32_t)(i * m->world / m->n);
  m->own[i] = m->fsdp || m->rows
                  ? (wtx_ownership){.owners = m->all, .n_owners = m->world,
                                    .placements = m->rows ? shard1 : shard0}
                  : (wtx_ownership){.owners = &m->owner[i], .n_owners = 1};
  wtx_tensor_meta meta;
  wtx_box mine;
  char why[256];
  wtx_tensor_meta_set(&meta, m->names[i], WTX_DTYPE_BFLOAT16, &m->dims[2 * i], nd, why,
                      sizeof why);
  m->lo[i] = m->len[i] = m->held[i] = 0;
  if (wtx_ownership_rank_box(&meta, &m->own[i], m->rank, &mine)) {
    m->lo[i] = mine.lo[nd - 1];
    m->len[i] = mine.len[nd - 1];
    m->held[i] = wtx_box_elements(&mine);
  }
}

static uint64_t rnd(uint64_t *x) {
  *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
  return *x;
}

static int make_model(model *m, uint64_t size, size_t n) {
  m->n = n;
  m->shapes = calloc(n, sizeof *m->shapes);
  m->data = calloc(n, sizeof *m->data);
  m->names = calloc(n, sizeof *m->names);
  m->ts = calloc(n, sizeof *m->ts);
  m->owner = calloc(n, sizeof *m->owner);
  m->own = calloc(n, sizeof *m->own);
  m->all = calloc(m->world, sizeof *m->all);
  m->lo = calloc(n, sizeof *m->lo);
  m->len = calloc(n, sizeof *m->len);
  m->held = calloc(n, sizeof *m->held);
  m->dims = calloc(2 * n, sizeof *m->dims);
  if (!m->shapes || !m->data || !m->names || !m->ts || !m->owner || !m->own || !m->all ||
      !m->lo || !m->len || !m->held || !m->dims)
    return -1;
  for (uint32_t r = 0; r < m->world; r++) m->all[r] = r;
  uint64_t x = 0x9e3779b97f4a7c15ULL, per = size / n / 2 > 0 ? size / n / 2 : 1;
  if (m->rows && per >= COLS) per -= per % COLS;
  for (size_t i = 0; i < n; i++) {
    m->shapes[i] = per; /* bf16 elements */
    m->dims[2 * i] = m->rows && per >= COLS ? per / COLS : per;
    m->dims[2 * i + 1] = m->rows && per >= COLS ? COLS : 1;
    if ((m->names[i] = malloc(64)) == NULL) return -1;
    snprintf(m->names[i], 64, "model.layers.%zu.w", i);
    own_tensor(m, i);
    uint64_t bytes = m->held[i] * 2;
    if (bytes > 0 && (m->data[i] = malloc(bytes)) == NULL) return -1;
    for (uint64_t k = 0; m->data[i] != NULL && k < bytes; k += 8) {
      uint64_t v = rnd(&x);
      memcpy(m->data[i] + k, &v, bytes - k < 8 ? bytes - k : 8);
    }
    m->ts[i] = (wtx_memory_tensor){m->names[i], WTX_DTYPE_BFLOAT16, &m->dims[2 * i],
                                   m->rows ? 2 : 1, m->data[i], 0};
  }
  return 0;
}

/* One sync; the best seconds of the kind so far in *best. */
static int sync_one(wtx_trainer *t, const char *kind, double *best, wtx_send_result *res) {
  if (wtx_trainer_send_weights(t, NULL, res) != 0) {
    fprintf(stderr, "delta_bench: %s: %s\n", kind, wtx_trainer_last_error(t));
    return -1;
  }
  if (*best == 0 || res->seconds < *best) *best = res->seconds;
  return 0;
}

static void report(const char *kind, double s, const wtx_send_result *r) {
  printf("%s %.6f %llu %zu%s%s\n", kind, s, (unsigned long long)r->bytes, r->params,
         r->full_reason ? " full: " : "", r->full_reason ? r->full_reason : "");
}

/* Element e of tensor i (flat), where this rank holds it, its low byte
 * flipped. */
static void flip(model *m, size_t i, uint64_t e) {
  uint64_t cols = m->rows ? m->dims[2 * i + 1] : m->shapes[i], r = e / cols, c = e % cols;
  if (c >= m->lo[i] && c - m->lo[i] < m->len[i])
    m->data[i][(r * m->len[i] + c - m->lo[i]) * 2] ^= 1;
}

/* Every rank draws the same numbers, and changes what it holds of them. */
static void change(model *m, int kind, uint64_t *x) {
  if (kind == 1) { /* 5 % of the tensors, their first element each */
    size_t k = m->n / 20 ? m->n / 20 : 1, at = rnd(x) % m->n;
    for (size_t j = 0; j < k; j++) flip(m, (at + j * 20) % m->n, 0);
  } else if (kind == 2) { /* 1 % of every tensor's elements */
    for (size_t i = 0; i < m->n; i++)
      for (uint64_t e = rnd(x) % 100; e < m->shapes[i]; e += 100) flip(m, i, e);
  }
}

static int run(wtx_client *c, wtx_source *src, model *m, const char *backend, int mode,
               const char *const *ranks) {
  static const char *const kinds[] = {"none", "tensors5", "elements1"};
  wtx_trainer_config cfg = WTX_TRAINER_CONFIG_INIT;
  cfg.backend = backend;
  cfg.rank = m->rank;
  cfg.world = m->world;
  cfg.rank_addresses = m->world > 1 ? ranks : NULL;
  cfg.session_token = getenv("WTX_SESSION_TOKEN");
  wtx_trainer *t = NULL;
  char err[1024];
  wtx_send_result res;
  double best = 0;
  if (wtx_trainer_init(&cfg, c, src, &t, err, sizeof err) != 0) goto fail;
  for (int k = 0; k < 5; k++) /* the best of syncs 3-5: the steady state */
    if (sync_one(t, "full", k >= 2 ? &best : &(double){0}, &res) != 0) goto fail;
  report("full", best, &res);
  wtx_trainer_shutdown(t);
  cfg.delta = mode;
  if (wtx_trainer_init(&cfg, c, src, &t, err, sizeof err) != 0) goto fail;
  if (sync_one(t, "first", &(double){0}, &res) != 0) goto fail;
  uint64_t x = 12345;
  for (int kind = 0; kind < 3; kind++) {
    best = 0;
    for (int r = 0; r < 3; r++) {
      change(m, kind, &x);
      if (sync_one(t, kinds[kind], &best, &res) != 0) goto fail;
    }
    report(kinds[kind], best, &res);
  }
  wtx_trainer_shutdown(t);
  return 0;
fail:
  if (t == NULL) fprintf(stderr, "delta_bench: init: %s\n", err);
  wtx_trainer_shutdown(t);
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 5 && argc != 8) {
    fprintf(stderr, "usage: delta_bench WORKERS SIZE TENSORS shm|tcp [RANK WORLD "
            "RANK_ADDRESSES]\n");
    return 2;
  }
  model m = {.rank = 0, .world = 1};
  const char *ranks[256];
  if (argc == 8) {
    m.rank = (uint32_t)strtoul(argv[5], NULL, 10);
    m.world = (uint32_t)strtoul(argv[6], NULL, 10);
    uint32_t k = 0;
    for (char *s = strtok(argv[7], ","); s != NULL && k < 256; s = strtok(NULL, ","))
      ranks[k++] = s;
    if (m.world < 2 || m.world != k || m.rank >= m.world) return 2;
    const char *layout = getenv("DELTA_BENCH_LAYOUT");
    m.fsdp = layout != NULL && strcmp(layout, "fsdp") == 0;
    m.rows = layout != NULL && strcmp(layout, "rows") == 0;
  }
  char *end;
  uint64_t size = strtoull(argv[2], &end, 10);
  size <<= *end == 'K' ? 10 : *end == 'M' ? 20 : *end == 'G' ? 30 : 0;
  size_t n = strtoul(argv[3], NULL, 10);
  const char *targets[64];
  size_t nw = 0;
  for (char *s = strtok(argv[1], ","); s != NULL && nw < 64; s = strtok(NULL, ","))
    targets[nw++] = s;
  wtx_client *c = NULL;
  wtx_source *src = NULL;
  char err[512];
  if (size == 0 || n == 0 || make_model(&m, size, n) != 0) return 2;
  if (wtx_client_create(targets, nw, NULL, &c, err, sizeof err) != 0 ||
      (m.world > 1 ? wtx_source_memory_owned(m.ts, m.own, n, m.rank, &src, err, sizeof err)
                   : wtx_source_memory(m.ts, n, &src, err, sizeof err)) != 0) {
    fprintf(stderr, "delta_bench: %s\n", err);
    return 1;
  }
  int rc = run(c, src, &m, argv[4], WTX_DELTA_TENSORS, ranks);
  if (rc == 0) {
    printf("# patches\n");
    rc = run(c, src, &m, argv[4], WTX_DELTA_PATCHES, ranks);
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
  return rc;
}
