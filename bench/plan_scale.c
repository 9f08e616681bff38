/* The sharded transfer planner (transport/plan.h) at real scale, on CPU:
 * the parameter tables of two published MoE checkpoints, a trainer that
 * owns them FSDP x EP, and tensor-parallel inference replicas that load
 * them, planned five times each. The figures say whether the plan can be
 * made per sync (under a second), whether it spreads the sends evenly over
 * the trainer ranks (busiest within 5 % of the mean), and what a sync
 * would take on one NIC per rank against today's design, where rank 0
 * sends the whole model to every worker.
 *
 *  qwen3-235b  Qwen3-235B-A22B (config.json values): 64 trainer ranks,
 *              dense FSDP 64, experts EP 8 x FSDP 8; 8 replicas x TP8.
 *  kimi-k2     Kimi-K2 (DeepSeek-V3 shape, MLA): 256 trainer ranks, dense
 *              FSDP 256, experts EP 32 x FSDP 8; 8 replicas x TP16. Dense
 *              and shared-expert MLPs are TP-sharded as vLLM's
 *              Column/RowParallelLinear do (gate/up dim 0, down dim 1).
 * Both bf16 (Kimi's e_score_correction_bias is fp32, as published).
 *
 * usage: plan_scale [--model qwen3-235b|kimi-k2|all] [--link-gbit N]
 *                   [--backend-gbit N] [--json FILE]
 * Exits 1 only on a real error (a plan refused, out of memory, a plan whose
 * bytes are not its workers' slices, a digest that changes between runs of
 * the same input), 2 on bad usage; a missed goal is printed, not an exit. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#include <yajl/yajl_gen.h>

#include "common/clock.h"
#include "transport/plan.h"
#include "wtx/error.h"
#include "wtx/tensor.h"

#define RUNS 5
#define PLAN_GOAL_S 1.0
#define BALANCE_GOAL 1.05
/* Pieces under this size: how fragmented a plan is, which every per-piece
 * cost (a header on the wire, a copy call) multiplies. */
#define SMALL_PIECE (64 << 10)

/* ---- parameter tables ---- */

typedef struct model {
  wtx_tensor_meta *metas; /* names malloc'd, one each */
  int32_t *expert;        /* routed expert index; -1 for everything else */
  size_t n, cap;
  uint32_t experts;       /* routed experts per layer */
  uint64_t elements, bytes;
} model;

/* A parameter's name after its prefix, and its shape (d1 0: 1-D). */
typedef struct pshape {
  const char *suffix;
  uint64_t d0, d1;
  int dtype; /* 0: bf16 */
} pshape;

static int add(model *m, const char *prefix, const pshape *p, int32_t expert) {
  if (m->n == m->cap) {
    size_t cap = m->cap ? m->cap * 2 : 4096;
    wtx_tensor_meta *metas = realloc(m->metas, cap * sizeof *metas);
    if (metas != NULL) m->metas = metas;
    int32_t *ex = realloc(m->expert, cap * sizeof *ex);
    if (ex != NULL) m->expert = ex;
    if (metas == NULL || ex == NULL) return WTX_ENOMEM;
    m->cap = cap;
  }
  char name[256], err[256];
  snprintf(name, sizeof name, "%s%s", prefix, p->suffix);
  char *copy = strdup(name);
  if (copy == NULL) return WTX_ENOMEM;
  uint64_t shape[2] = {p->d0, p->d1};
  int dtype = p->dtype ? p->dtype : WTX_DTYPE_BFLOAT16;
  wtx_tensor_meta *t = &m->metas[m->n];
  int rc = wtx_tensor_meta_set(t, copy, dtype, shape, p->d1 ? 2 : 1, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "plan_scale: %s: %s\n", name, err);
    free(copy);
    return rc;
  }
  m->expert[m->n++] = expert;
  m->elements += t->nbytes / wtx_dtype_size(dtype);
  m->bytes += t->nbytes;
  return 0;
}

static int add_all(model *m, const char *prefix, const pshape *p, size_t n, int32_t expert) {
  for (size_t i = 0; i < n; i++) {
    int rc = add(m, prefix, &p[i], expert);
    if (rc != 0) return rc;
  }
  return 0;
}

/* Routed experts 0..n of a layer: gate and up [inter, hidden], down
 * [hidden, inter]. */
static int add_experts(model *m, unsigned layer, uint32_t n, uint64_t hidden, uint64_t inter) {
  const pshape e[] = {{"gate_proj.weight", inter, hidden, 0},
                      {"up_proj.weight", inter, hidden, 0},
                      {"down_proj.weight", hidden, inter, 0}};
  char prefix[96];
  m->experts = n;
  for (uint32_t x = 0; x < n; x++) {
    snprintf(prefix, sizeof prefix, "model.layers.%u.mlp.experts.%u.", layer, x);
    int rc = add_all(m, prefix, e, 3, (int32_t)x);
    if (rc != 0) return rc;
  }
  return 0;
}

static void model_free(model *m) {
  for (size_t i = 0; i < m->n; i++) free((char *)m->metas[i].name);
  free(m->metas);
  free(m->expert);
}

/* Qwen3-235B-A22B's config.json. */
static const struct {
  uint64_t hidden, layers, heads, kv_heads, head_dim, moe_inter, experts, vocab;
} QWEN3 = {4096, 94, 64, 4, 128, 1536, 128, 151936};

static int qwen3_params(model *m) {
  uint64_t h = QWEN3.hidden, q = QWEN3.heads * QWEN3.head_dim;
  uint64_t kv = QWEN3.kv_heads * QWEN3.head_dim;
  const pshape layer[] = {
      {"self_attn.q_proj.weight", q, h, 0},  {"self_attn.k_proj.weight", kv, h, 0},
      {"self_attn.v_proj.weight", kv, h, 0}, {"self_attn.o_proj.weight", h, q, 0},
      {"self_attn.q_norm.weight", QWEN3.head_dim, 0, 0},
      {"self_attn.k_norm.weight", QWEN3.head_dim, 0, 0},
      {"input_layernorm.weight", h, 0, 0},   {"post_attention_layernorm.weight", h, 0, 0},
      {"mlp.gate.weight", QWEN3.experts, h, 0}};
  const pshape embed = {"embed_tokens.weight", QWEN3.vocab, h, 0};
  const pshape norm = {"norm.weight", h, 0, 0}, head = {"lm_head.weight", QWEN3.vocab, h, 0};
  int rc = add(m, "model.", &embed, -1);
  char prefix[64];
  for (unsigned l = 0; l < QWEN3.layers && rc == 0; l++) {
    snprintf(prefix, sizeof prefix, "model.layers.%u.", l);
    rc = add_all(m, prefix, layer, sizeof layer / sizeof layer[0], -1);
    if (rc == 0) rc = add_experts(m, l, (uint32_t)QWEN3.experts, h, QWEN3.moe_inter);
  }
  if (rc == 0) rc = add(m, "model.", &norm, -1);
  return rc != 0 ? rc : add(m, "", &head, -1);
}

/* Kimi-K2's config.json (DeepSeek-V3 architecture, 64 heads). */
static const struct {
  uint64_t hidden, layers, dense_layers, inter, experts, moe_inter, shared, vocab;
  uint64_t heads, q_lora, kv_lora, nope, rope, v_head;
} KIMI = {7168, 61, 1, 18432, 384, 2048, 1, 163840, 64, 1536, 512, 128, 64, 128};

/* Attention (MLA) and the two layer norms. */
static int kimi_attention(model *m, const char *prefix) {
  uint64_t h = KIMI.hidden;
  const pshape a[] = {
      {"self_attn.q_a_proj.weight", KIMI.q_lora, h, 0},
      {"self_attn.q_a_layernorm.weight", KIMI.q_lora, 0, 0},
      {"self_attn.q_b_proj.weight", KIMI.heads * (KIMI.nope + KIMI.rope), KIMI.q_lora, 0},
      {"self_attn.kv_a_proj_with_mqa.weight", KIMI.kv_lora + KIMI.rope, h, 0},
      {"self_attn.kv_a_layernorm.weight", KIMI.kv_lora, 0, 0},
      {"self_attn.kv_b_proj.weight", KIMI.heads * (KIMI.nope + KIMI.v_head), KIMI.kv_lora, 0},
      {"self_attn.o_proj.weight", h, KIMI.heads * KIMI.v_head, 0},
      {"input_layernorm.weight", h, 0, 0},
      {"post_attention_layernorm.weight", h, 0, 0}};
  return add_all(m, prefix, a, sizeof a / sizeof a[0], -1);
}

/* A layer's MLP: dense for the first dense_layers, else the router, the
 * shared expert and the routed experts. */
static int kimi_mlp(model *m, const char *prefix, unsigned l) {
  uint64_t h = KIMI.hidden, sh = KIMI.moe_inter * KIMI.shared;
  const pshape dense[] = {{"mlp.gate_proj.weight", KIMI.inter, h, 0},
                          {"mlp.up_proj.weight", KIMI.inter, h, 0},
                          {"mlp.down_proj.weight", h, KIMI.inter, 0}};
  const pshape moe[] = {{"mlp.gate.weight", KIMI.experts, h, 0},
                        {"mlp.gate.e_score_correction_bias", KIMI.experts, 0, WTX_DTYPE_FLOAT32},
                        {"mlp.shared_experts.gate_proj.weight", sh, h, 0},
                        {"mlp.shared_experts.up_proj.weight", sh, h, 0},
                        {"mlp.shared_experts.down_proj.weight", h, sh, 0}};
  if (l < KIMI.dense_layers) return add_all(m, prefix, dense, 3, -1);
  int rc = add_all(m, prefix, moe, sizeof moe / sizeof moe[0], -1);
  return rc != 0 ? rc : add_experts(m, l, (uint32_t)KIMI.experts, h, KIMI.moe_inter);
}

static int kimi_params(model *m) {
  const pshape embed = {"embed_tokens.weight", KIMI.vocab, KIMI.hidden, 0};
  const pshape norm = {"norm.weight", KIMI.hidden, 0, 0};
  const pshape head = {"lm_head.weight", KIMI.vocab, KIMI.hidden, 0};
  int rc = add(m, "model.", &embed, -1);
  char prefix[64];
  for (unsigned l = 0; l < KIMI.layers && rc == 0; l++) {
    snprintf(prefix, sizeof prefix, "model.layers.%u.", l);
    rc = kimi_attention(m, prefix);
    if (rc == 0) rc = kimi_mlp(m, prefix, l);
  }
  if (rc == 0) rc = add(m, "model.", &norm, -1);
  return rc != 0 ? rc : add(m, "", &head, -1);
}

/* ---- layouts ---- */

typedef struct layout {
  const char *id, *flag, *title;
  int (*params)(model *m);
  uint32_t ranks, ep, fsdp; /* dense: FSDP over ranks; experts: ep x fsdp */
  uint32_t replicas, tp;    /* workers: replica * tp + tp_rank */
  const char *rules;        /* wtx_shard_rules_parse; first match wins */
} layout;

/* The expert rule comes first: most parameters are experts, so most names
 * stop at the first fnmatch. */
static const layout LAYOUTS[] = {
    {"qwen3_235b", "qwen3-235b", "Qwen3-235B-A22B bf16", qwen3_params, 64, 8, 8, 8, 8,
     "*.experts.* expert\n"
     "*.self_attn.q_proj.weight dim 0 unit 128\n"
     "*.self_attn.k_proj.weight dim 0 unit 128\n"
     "*.self_attn.v_proj.weight dim 0 unit 128\n"
     "*.self_attn.o_proj.weight dim 1 unit 128\n"
     "model.embed_tokens.weight dim 0\n"
     "lm_head.weight dim 0\n"},
    {"kimi_k2", "kimi-k2", "Kimi-K2 (DeepSeek-V3 shape, MLA) bf16", kimi_params, 256, 32, 8, 8,
     16,
     "*.experts.* expert\n"
     "*.self_attn.q_b_proj.weight dim 0 unit 192\n"
     "*.self_attn.kv_b_proj.weight dim 0 unit 256\n"
     "*.self_attn.o_proj.weight dim 1 unit 128\n"
     "*.mlp.gate_proj.weight dim 0\n"
     "*.mlp.up_proj.weight dim 0\n"
     "*.mlp.down_proj.weight dim 1\n"
     "*.shared_experts.gate_proj.weight dim 0\n"
     "*.shared_experts.up_proj.weight dim 0\n"
     "*.shared_experts.down_proj.weight dim 1\n"
     "model.embed_tokens.weight dim 0\n"
     "lm_head.weight dim 0\n"},
};

static const int32_t SHARD0 = 0;

/* Dense parameters: Shard(0) over every rank; expert e: Shard(0) over the
 * fsdp ranks of its EP group, e / (experts / ep). The owners point into one
 * array of every rank, since each group's ranks are consecutive. */
static int ownerships(const layout *l, const model *m, uint32_t **ranks, wtx_ownership **own) {
  *ranks = malloc(l->ranks * sizeof **ranks);
  *own = calloc(m->n, sizeof **own);
  if (*ranks == NULL || *own == NULL) return WTX_ENOMEM;
  for (uint32_t r = 0; r < l->ranks; r++) (*ranks)[r] = r;
  uint32_t per_group = m->experts / l->ep;
  for (size_t i = 0; i < m->n; i++) {
    wtx_ownership *o = &(*own)[i];
    o->placements = &SHARD0;
    o->owners = *ranks;
    o->n_owners = l->ranks;
    if (m->expert[i] < 0) continue;
    o->owners = *ranks + (uint32_t)m->expert[i] / per_group * l->fsdp;
    o->n_owners = l->fsdp;
  }
  return 0;
}

/* ---- worker slices ---- */

/* Every replica's tp_rank t holds the same slices: made once per t. */
typedef struct needs {
  wtx_slice **tp;      /* tp[t]: wtx_shard_slices' */
  size_t *n_tp;
  uint64_t *tp_bytes;  /* bytes tp[t] covers */
  const wtx_slice **by_worker;
  size_t *n_by_worker, total;
  double made_s;
} needs;

static uint64_t slices_bytes(const model *m, const wtx_slice *s, size_t n) {
  uint64_t bytes = 0;
  for (size_t k = 0; k < n; k++) {
    wtx_box b;
    wtx_slice_box(&m->metas[s[k].param], &s[k], &b);
    bytes += wtx_box_elements(&b) * wtx_dtype_size(m->metas[s[k].param].dtype);
  }
  return bytes;
}

static int make_needs(const layout *l, const model *m, needs *nd) {
  uint32_t workers = l->replicas * l->tp;
  wtx_shard_rule *rules = NULL;
  size_t n_rules;
  char err[512];
  nd->tp = calloc(l->tp, sizeof *nd->tp);
  nd->n_tp = calloc(l->tp, sizeof *nd->n_tp);
  nd->tp_bytes = calloc(l->tp, sizeof *nd->tp_bytes);
  nd->by_worker = calloc(workers, sizeof *nd->by_worker);
  nd->n_by_worker = calloc(workers, sizeof *nd->n_by_worker);
  if (!nd->tp || !nd->n_tp || !nd->tp_bytes || !nd->by_worker || !nd->n_by_worker)
    return WTX_ENOMEM;
  double t0 = wtx__clock_s();
  int rc = wtx_shard_rules_parse(l->rules, &rules, &n_rules, err, sizeof err);
  for (uint32_t t = 0; t < l->tp && rc == 0; t++) {
    rc = wtx_shard_slices(m->metas, m->n, rules, n_rules, t, l->tp, &nd->tp[t], &nd->n_tp[t],
                          err, sizeof err);
    if (rc == 0) nd->tp_bytes[t] = slices_bytes(m, nd->tp[t], nd->n_tp[t]);
  }
  nd->made_s = wtx__clock_s() - t0;
  free(rules);
  if (rc != 0) {
    fprintf(stderr, "plan_scale: %s: worker slices: %s\n", l->flag, err);
    return rc;
  }
  for (uint32_t w = 0; w < workers; w++) {
    nd->by_worker[w] = nd->tp[w % l->tp];
    nd->n_by_worker[w] = nd->n_tp[w % l->tp];
    nd->total += nd->n_by_worker[w];
  }
  return 0;
}

static void needs_free(const layout *l, needs *nd) {
  for (uint32_t t = 0; nd->tp != NULL && t < l->tp; t++) free(nd->tp[t]);
  free(nd->tp);
  free(nd->n_tp);
  free(nd->tp_bytes);
  free(nd->by_worker);
  free(nd->n_by_worker);
}

/* ---- planning and its figures ---- */

typedef struct figures {
  double runs[RUNS], best, median;
  size_t pieces, small;   /* small: pieces under SMALL_PIECE bytes */
  uint64_t small_bytes, digest;
  int digest_stable, bytes_ok;
  uint64_t rank_max, rank_sum, worker_max, worker_sum;
  uint32_t rank_busiest, worker_busiest;
  double peak_rss_gib;
} figures;

static int by_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Makes the plan RUNS times, freeing each but the last (*out). */
static int time_plans(const wtx_plan_input *in, const char *flag, figures *f, wtx_plan **out) {
  char err[512];
  *out = NULL;
  f->digest_stable = 1;
  for (int k = 0; k < RUNS; k++) {
    wtx_plan_destroy(*out);
    double t0 = wtx__clock_s();
    int rc = wtx_plan_make(in, out, err, sizeof err);
    f->runs[k] = wtx__clock_s() - t0;
    if (rc != 0) {
      fprintf(stderr, "plan_scale: %s: plan refused (%s): %s\n", flag, wtx_strerror(rc), err);
      printf("plan: refused after %.3f s (%s): %s\n", f->runs[k], wtx_strerror(rc), err);
      return rc;
    }
    uint64_t d = wtx_plan_digest(*out);
    if (k > 0 && d != f->digest) f->digest_stable = 0;
    f->digest = d;
  }
  double sorted[RUNS];
  memcpy(sorted, f->runs, sizeof sorted);
  qsort(sorted, RUNS, sizeof sorted[0], by_double);
  f->best = sorted[0];
  f->median = sorted[RUNS / 2];
  return 0;
}

static void measure(const wtx_plan *p, const layout *l, const needs *nd, figures *f) {
  const wtx_piece *pieces;
  f->pieces = wtx_plan_pieces(p, &pieces);
  for (size_t i = 0; i < f->pieces; i++) {
    uint64_t b = wtx_plan_piece_bytes(p, &pieces[i]);
    f->small += b < SMALL_PIECE;
    f->small_bytes += b < SMALL_PIECE ? b : 0;
  }
  for (uint32_t r = 0; r < l->ranks; r++) {
    uint64_t b = wtx_plan_rank_bytes(p, r);
    f->rank_sum += b;
    if (b > f->rank_max) {
      f->rank_max = b;
      f->rank_busiest = r;
    }
  }
  /* Each worker must receive exactly the bytes its slices cover: every
   * byte once, none twice. */
  f->bytes_ok = 1;
  for (uint32_t w = 0; w < l->replicas * l->tp; w++) {
    uint64_t b = wtx_plan_worker_bytes(p, w);
    f->worker_sum += b;
    if (b > f->worker_max) {
      f->worker_max = b;
      f->worker_busiest = w;
    }
    if (b != nd->tp_bytes[w % l->tp]) f->bytes_ok = 0;
  }
  if (f->worker_sum != f->rank_sum) f->bytes_ok = 0;
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  f->peak_rss_gib = (double)ru.ru_maxrss / (1 << 20); /* KiB on Linux */
}

/* ---- output ---- */

typedef struct opts {
  const char *model, *json;
  double link_gbit, backend_gbit; /* backend 0: not given */
} opts;

/* The figures as one flat JSON object (yajl's generator), keys prefixed
 * by the model's id; g NULL: no --json. */
typedef struct json {
  yajl_gen g;
  const char *prefix;
} json;

static void jkey(json *j, const char *key) {
  char k[128];
  snprintf(k, sizeof k, "%s%s%s", j->prefix ? j->prefix : "", j->prefix ? "_" : "", key);
  yajl_gen_string(j->g, (const unsigned char *)k, strlen(k));
}

static void jnum(json *j, const char *key, double v) {
  if (j->g == NULL) return;
  jkey(j, key);
  yajl_gen_double(j->g, v);
}

static void ju64(json *j, const char *key, uint64_t v) {
  if (j->g == NULL) return;
  jkey(j, key);
  yajl_gen_integer(j->g, (long long)v); /* counts and bytes, all below 2^63 */
}

static void jstr(json *j, const char *key, const char *s) {
  if (j->g == NULL) return;
  jkey(j, key);
  yajl_gen_string(j->g, (const unsigned char *)s, strlen(s));
}

/* Writes the object to path: 0, or -1 when the file cannot be written. */
static int json_write(json *j, const char *path) {
  const unsigned char *buf;
  size_t len;
  yajl_gen_map_close(j->g);
  yajl_gen_get_buf(j->g, &buf, &len);
  FILE *f = fopen(path, "w");
  int ok = f != NULL && fwrite(buf, 1, len, f) == len && fputc('\n', f) != EOF;
  if (f != NULL && fclose(f) != 0) ok = 0;
  if (!ok) perror(path);
  return ok ? 0 : -1;
}

static const char *goal(int met) { return met ? "goal met" : "goal NOT met"; }

static double gb(uint64_t bytes) { return (double)bytes / 1e9; }

static void print_model(const layout *l, const model *m, const needs *nd, json *j) {
  uint32_t workers = l->replicas * l->tp;
  printf("plan_scale: %s | trainer %u ranks: dense FSDP %u Shard(0), experts EP %u x FSDP %u "
         "Shard(0) | workers %u replicas x TP%u = %u\n",
         l->title, l->ranks, l->ranks, l->ep, l->fsdp, l->replicas, l->tp, workers);
  printf("params: %zu tensors, %.2f B parameters, %.2f GB (%" PRIu64 " bytes)\n", m->n,
         (double)m->elements / 1e9, gb(m->bytes), m->bytes);
  printf("slices: %zu over %u workers, made in %.3f s (not in the plan time)\n", nd->total,
         workers, nd->made_s);
  jstr(j, "model", l->title);
  ju64(j, "ranks", l->ranks);
  ju64(j, "workers", workers);
  ju64(j, "tensors", m->n);
  ju64(j, "parameters", m->elements);
  ju64(j, "model_bytes", m->bytes);
  ju64(j, "slices", nd->total);
  jnum(j, "slices_s", nd->made_s);
}

static void print_plan(const layout *l, const figures *f, json *j) {
  double rank_ideal = (double)f->rank_sum / l->ranks;
  double worker_ideal = (double)f->worker_sum / (l->replicas * l->tp);
  double rank_ratio = f->rank_max / rank_ideal, worker_ratio = f->worker_max / worker_ideal;
  char hex[17];
  snprintf(hex, sizeof hex, "%016" PRIx64, f->digest);
  printf("plan time: best %.3f s, median %.3f s of %d (goal < %.0f s: %s)\n", f->best,
         f->median, RUNS, PLAN_GOAL_S, goal(f->best < PLAN_GOAL_S));
  printf("pieces: %zu (%zu under %d KiB, %.1f %%, carrying %.3f GB)\n", f->pieces, f->small,
         SMALL_PIECE >> 10, 100.0 * f->small / (f->pieces ? f->pieces : 1), gb(f->small_bytes));
  printf("digest: %s (%s)\n", hex,
         f->digest_stable ? "the same in every run" : "CHANGED between runs");
  printf("bytes: %s (%.2f GB sent in all)\n",
         f->bytes_ok ? "every worker receives exactly its slices' bytes"
                     : "MISMATCH: workers' bytes differ from their slices'",
         gb(f->rank_sum));
  printf("trainer balance: busiest rank %u sends %.3f GB, ideal %.3f GB, ratio %.4f "
         "(goal <= %.2f: %s)\n", f->rank_busiest, gb(f->rank_max), rank_ideal / 1e9,
         rank_ratio, BALANCE_GOAL, goal(rank_ratio <= BALANCE_GOAL));
  printf("worker balance: busiest worker %u receives %.3f GB, ideal %.3f GB, ratio %.4f\n",
         f->worker_busiest, gb(f->worker_max), worker_ideal / 1e9, worker_ratio);
  printf("memory: peak RSS %.2f GiB of %.1f GiB physical\n", f->peak_rss_gib,
         (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE) / (1 << 30));
  jnum(j, "plan_best_s", f->best);
  jnum(j, "plan_median_s", f->median);
  ju64(j, "plan_goal_met", f->best < PLAN_GOAL_S);
  ju64(j, "pieces", f->pieces);
  ju64(j, "small_pieces", f->small);
  ju64(j, "small_pieces_bytes", f->small_bytes);
  jstr(j, "digest", hex);
  ju64(j, "digest_stable", f->digest_stable);
  ju64(j, "bytes_ok", f->bytes_ok);
  ju64(j, "rank_max_bytes", f->rank_max);
  jnum(j, "rank_ideal_bytes", rank_ideal);
  jnum(j, "rank_ratio", rank_ratio);
  ju64(j, "balance_goal_met", rank_ratio <= BALANCE_GOAL);
  ju64(j, "worker_max_bytes", f->worker_max);
  jnum(j, "worker_ideal_bytes", worker_ideal);
  jnum(j, "worker_ratio", worker_ratio);
  jnum(j, "peak_rss_gib", f->peak_rss_gib);
}

/* A sync is as slow as its busiest link: a trainer rank's sends or a
 * worker's receives, each on one NIC. Today rank 0 sends the whole model
 * to every worker over its one link. */
static void print_projection(const layout *l, const model *m, const figures *f,
                             const opts *o, json *j) {
  double rate = o->link_gbit;
  if (o->backend_gbit > 0 && o->backend_gbit < rate) rate = o->backend_gbit;
  int rank_side = f->rank_max >= f->worker_max;
  uint64_t link = rank_side ? f->rank_max : f->worker_max;
  uint32_t workers = l->replicas * l->tp;
  uint64_t rank0 = (uint64_t)workers * m->bytes;
  double bps = rate * 1e9 / 8, sharded_s = link / bps, rank0_s = rank0 / bps;
  char backend[64] = "no --backend-gbit";
  if (o->backend_gbit > 0) snprintf(backend, sizeof backend, "--backend-gbit %g", o->backend_gbit);
  printf("rate: %g Gbit/s per link (--link-gbit %g, %s)\n", rate, o->link_gbit, backend);
  printf("sharded sync: %.2f s (busiest link: %s %u, %.3f GB)\n", sharded_s,
         rank_side ? "trainer rank" : "worker", rank_side ? f->rank_busiest : f->worker_busiest,
         gb(link));
  printf("rank-0 sync: %.1f s (%u workers x %.2f GB through rank 0's one link), %.0fx the "
         "sharded\n", rank0_s, workers, gb(m->bytes), rank0_s / sharded_s);
  jnum(j, "rate_gbit", rate);
  jnum(j, "link_gbit", o->link_gbit);
  jnum(j, "backend_gbit", o->backend_gbit);
  ju64(j, "busiest_link_bytes", link);
  jnum(j, "sharded_sync_s", sharded_s);
  ju64(j, "rank0_bytes", rank0);
  jnum(j, "rank0_sync_s", rank0_s);
}

/* ---- one model ---- */

static int run_model(const layout *l, const opts *o, json *j) {
  model m = {0};
  needs nd = {0};
  figures f = {0};
  uint32_t *ranks = NULL;
  wtx_ownership *own = NULL;
  wtx_plan *plan = NULL;
  wtx_plan_input in = {0};
  int rc = l->params(&m);
  if (rc == 0) rc = ownerships(l, &m, &ranks, &own);
  if (rc == 0) rc = make_needs(l, &m, &nd);
  if (rc != 0) goto fail;
  j->prefix = l->id;
  print_model(l, &m, &nd, j);
  fflush(stdout); /* the plan may take long, or fail for memory */
  in = (wtx_plan_input){.metas = m.metas, .owners = own, .n = m.n, .n_ranks = l->ranks,
                        .n_workers = l->replicas * l->tp, .needs = nd.by_worker,
                        .n_needs = nd.n_by_worker};
  if ((rc = time_plans(&in, l->flag, &f, &plan)) != 0) goto fail;
  measure(plan, l, &nd, &f);
  print_plan(l, &f, j);
  print_projection(l, &m, &f, o, j);
  if (!f.bytes_ok || !f.digest_stable) rc = WTX_EINVAL; /* a wrong plan */
fail:
  if (rc == WTX_ENOMEM) printf("out of memory planning %s\n", l->title);
  wtx_plan_destroy(plan);
  needs_free(l, &nd);
  free(own);
  free(ranks);
  model_free(&m);
  return rc;
}

static int parse_args(int argc, char **argv, opts *o) {
  *o = (opts){.model = "all", .link_gbit = 400};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    char *end = NULL;
    if (v == NULL) return -1;
    if (strcmp(a, "--model") == 0) o->model = v;
    else if (strcmp(a, "--json") == 0) o->json = v;
    else if (strcmp(a, "--link-gbit") == 0) o->link_gbit = strtod(v, &end);
    else if (strcmp(a, "--backend-gbit") == 0) o->backend_gbit = strtod(v, &end);
    else return -1;
    if (end != NULL && (*end != '\0' || end == v)) return -1;
    i++;
  }
  return o->link_gbit > 0 && o->backend_gbit >= 0 ? 0 : -1;
}

int main(int argc, char **argv) {
  opts o;
  if (parse_args(argc, argv, &o) != 0) {
    fprintf(stderr, "usage: plan_scale [--model qwen3-235b|kimi-k2|all] [--link-gbit N] "
                    "[--backend-gbit N] [--json FILE]\n");
    return 2;
  }
  json j = {0};
  if (o.json != NULL) {
    if ((j.g = yajl_gen_alloc(NULL)) == NULL) return 1;
    yajl_gen_config(j.g, yajl_gen_beautify, 1);
    yajl_gen_map_open(j.g);
  }
  int rc = 0, ran = 0;
  for (size_t i = 0; i < sizeof LAYOUTS / sizeof LAYOUTS[0]; i++) {
    if (strcmp(o.model, "all") != 0 && strcmp(o.model, LAYOUTS[i].flag) != 0) continue;
    if (ran++ > 0) printf("\n");
    if (run_model(&LAYOUTS[i], &o, &j) != 0) rc = 1;
  }
  if (j.g != NULL) {
    if (json_write(&j, o.json) != 0) rc = 1;
    yajl_gen_free(j.g);
  }
  if (ran == 0) fprintf(stderr, "plan_scale: no model '%s'\n", o.model);
  return ran == 0 ? 2 : rc;
}
