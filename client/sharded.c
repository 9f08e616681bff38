/* A sync to tensor-parallel workers (engine.h): each worker receives only
 * its parts of the model.
 *
 * Workers that hold the same parts (the replicas of one tensor-parallel
 * rank) form a group, and each group gets an engine of its own over a
 * source of those parts, so the data plane, the chunk plan and the checks
 * are the ones every sync uses. The groups run at once, one thread each,
 * fed from one pass over the trainer's source: the pass advances to the
 * next tensor when every group has taken what it needs of the current one
 * (a tensor may be a collective all ranks join, so it is yielded once).
 * A group may read its parts more than once in a sync (a delta's hash pass,
 * then its send): each of its reads is a round of the shared pass, which
 * starts the source's iteration again once no group still reads the round
 * before, so every group of a round sees the same iteration and the other
 * ranks' collectives stay in step. Every group prepares before any
 * publishes; a failure anywhere aborts them all. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/delta.h"
#include "client/engine.h"
#include "client/fanout.h"
#include "client/source.h"
#include "common/clock.h"
#include "common/patch.h"
#include "common/strmap.h"
#include "transport/plan.h"

#define NONE SIZE_MAX

/* ---- one pass over the trainer's source, shared by the groups ---- */

typedef struct shared_pass {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  wtx_source *source;
  const wtx_tensor_meta *metas;
  size_t n;
  void *iter;
  size_t pos;            /* the tensor held (NONE before the first) */
  wtx__tensor_data data; /* where it is */
  int advancing;         /* a group is pulling the next tensor */
  int rc;                /* the pass failed: every group stops */
  char err[600];
  size_t *want;          /* per group: the tensor it waits for, NONE when done */
  uint32_t round;        /* the iteration under way: 1 is the sync's first */
  uint32_t *in_round;    /* per group: the round it reads (0: none yet) */
  uint8_t *left;         /* per group: its sync is over, it reads no more */
  int switching;         /* a group is starting the next round */
  size_t groups;
  int64_t wait_ms;       /* bound on waiting for the other groups */
} shared_pass;

/* Whether no group still reads the tensor held, nor may join the round
 * and read it (a group between two rounds of its own). */
static int all_past(const shared_pass *sp) {
  for (size_t g = 0; g < sp->groups; g++) {
    if (sp->left[g]) continue;
    if (sp->in_round[g] < sp->round) return 0;
    if (sp->in_round[g] == sp->round && sp->pos != NONE && sp->want[g] <= sp->pos) return 0;
  }
  return 1;
}

/* Whether the round may end: every group that stays has read and closed
 * it, or waits for the next. */
static int round_over(const shared_pass *sp) {
  for (size_t g = 0; g < sp->groups; g++) {
    if (sp->left[g]) continue;
    if (sp->in_round[g] < sp->round) return 0;
    if (sp->in_round[g] == sp->round && sp->want[g] != NONE) return 0;
  }
  return 1;
}

/* Pulls the next tensor of the pass, outside the lock, and checks it
 * against the source's metadata. Caller holds mu; returns holding it. */
static void advance(shared_pass *sp) {
  size_t i = sp->pos == NONE ? 0 : sp->pos + 1;
  sp->advancing = 1;
  pthread_mutex_unlock(&sp->mu);
  wtx_tensor_meta m;
  wtx__tensor_data d;
  int r = i < sp->n ? wtx__source_next(sp->source, sp->iter, 1, &m, &d) : 0;
  pthread_mutex_lock(&sp->mu);
  sp->advancing = 0;
  if (r <= 0) {
    sp->rc = r < 0 ? r : WTX_EINVAL;
    snprintf(sp->err, sizeof sp->err, "source: iteration %s at parameter %zu",
             r < 0 ? "failed" : "ended early", i);
  } else if (strcmp(m.name, sp->metas[i].name) != 0 ||
             !wtx_tensor_meta_same_layout(&m, &sp->metas[i])) {
    sp->rc = WTX_EINVAL;
    snprintf(sp->err, sizeof sp->err, "source: parameter %zu is '%s' in the iteration but "
             "'%s' in metadata(), or its dtype or shape differ", i, m.name, sp->metas[i].name);
  } else {
    sp->pos = i;
    sp->data = d;
  }
  pthread_cond_broadcast(&sp->cv);
}

/* The rest of the iteration (each yield may be a collective the other
 * ranks join), which must then end. Caller holds mu; returns holding it. */
static void end_iteration(shared_pass *sp) {
  while (sp->rc == 0 && (sp->pos == NONE ? 0 : sp->pos + 1) < sp->n) advance(sp);
  if (sp->rc != 0) return;
  sp->advancing = 1;
  pthread_mutex_unlock(&sp->mu);
  wtx_tensor_meta m;
  wtx__tensor_data d;
  int r = wtx__source_next(sp->source, sp->iter, 0, &m, &d);
  pthread_mutex_lock(&sp->mu);
  sp->advancing = 0;
  if (r != 0) {
    sp->rc = WTX_EINVAL;
    snprintf(sp->err, sizeof sp->err, "source: iteration goes on past the %zu parameters "
             "of metadata()", sp->n);
  }
}

/* The next round: this iteration ended, the source's next begun. Caller
 * holds mu; returns holding it. */
static void next_round(shared_pass *sp) {
  sp->switching = 1;
  end_iteration(sp);
  if (sp->rc == 0) {
    pthread_mutex_unlock(&sp->mu);
    wtx_source_close(sp->source, sp->iter);
    int rc = wtx_source_open(sp->source, &sp->iter);
    pthread_mutex_lock(&sp->mu);
    if (rc != 0) {
      sp->iter = NULL;
      sp->rc = rc;
      snprintf(sp->err, sizeof sp->err, "source: cannot start pass %u", sp->round + 1);
    }
  }
  sp->pos = NONE;
  sp->round++;
  sp->switching = 0;
  pthread_cond_broadcast(&sp->cv);
}

/* Group g's turn at tensor i (i ascending per group): *out valid until g
 * asks for another or is done. */
static int pass_get(shared_pass *sp, size_t g, size_t i, wtx__tensor_data *out, char *err,
                    size_t errlen) {
  struct timespec until;
  wtx__clock_deadline(&until, sp->wait_ms);
  pthread_mutex_lock(&sp->mu);
  sp->want[g] = i;
  pthread_cond_broadcast(&sp->cv);
  int rc = 0;
  uint32_t r = sp->in_round[g];
  while (sp->rc == 0 && (sp->round < r || sp->pos == NONE || sp->pos < i)) {
    int idle = !sp->advancing && !sp->switching;
    if (idle && sp->round < r && round_over(sp)) {
      next_round(sp);
    } else if (idle && sp->round == r && all_past(sp)) {
      advance(sp);
    } else if (pthread_cond_timedwait(&sp->cv, &sp->mu, &until) == ETIMEDOUT) {
      rc = WTX_ETIMEDOUT;
      snprintf(err, errlen, "another group of workers did not move past parameter %zu "
               "within %lld ms", sp->pos, (long long)sp->wait_ms);
      break;
    }
  }
  if (rc == 0 && sp->rc != 0) {
    rc = sp->rc;
    snprintf(err, errlen, "%s", sp->err);
  } else if (rc == 0) {
    *out = sp->data; /* pos == i: parts of one tensor come together */
  }
  pthread_mutex_unlock(&sp->mu);
  return rc;
}

/* Group g begins a round of its own: it reads from the first tensor. */
static void pass_open(shared_pass *sp, size_t g) {
  pthread_mutex_lock(&sp->mu);
  sp->in_round[g]++;
  sp->want[g] = 0;
  pthread_cond_broadcast(&sp->cv);
  pthread_mutex_unlock(&sp->mu);
}

/* Group g has closed its round (leaving: and its sync is over). */
static void pass_done(shared_pass *sp, size_t g, int leaving) {
  pthread_mutex_lock(&sp->mu);
  sp->want[g] = NONE;
  sp->left[g] |= (uint8_t)leaving;
  pthread_cond_broadcast(&sp->cv);
  pthread_mutex_unlock(&sp->mu);
}

/* After every group: the rest of the last round's iteration. */
static int pass_finish(shared_pass *sp, char *err, size_t errlen) {
  pthread_mutex_lock(&sp->mu);
  end_iteration(sp);
  int rc = sp->rc;
  if (rc != 0) snprintf(err, errlen, "%s", sp->err);
  pthread_mutex_unlock(&sp->mu);
  return rc;
}

/* ---- a group's source: its parts of each tensor ---- */

typedef struct part_src {
  shared_pass *sp;
  size_t g;
  size_t n;
  wtx_tensor_meta *metas; /* each part as a tensor: the parameter's name, the part's shape */
  uint32_t *param;        /* its parameter */
  wtx_box *box;           /* where it lies there */
  /* Its ParamMeta.part (NULL when whole), the messages and their
   * full_shape and offset arrays. */
  Wtx__V1__TensorPart **parts, *part_msgs;
  uint64_t *pool;
  wtx_tensor_meta *full;  /* the parameters (the trainer source's metadata) */
  uint8_t *scratch;       /* a part gathered from strided rows */
  size_t next;
  char err[600];
} part_src;

static int part_metadata(void *self, const wtx_tensor_meta **metas, size_t *n) {
  part_src *p = self;
  *metas = p->metas;
  *n = p->n;
  return 0;
}

static int part_open(void *self, void **iter) {
  part_src *p = self;
  p->next = 0;
  pass_open(p->sp, p->g);
  *iter = p;
  return 0;
}

static int part_next(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data) {
  part_src *p = self;
  (void)iter;
  if (p->next == p->n) return 0;
  size_t k = p->next++;
  wtx__tensor_data d;
  int rc = pass_get(p->sp, p->g, p->param[k], &d, p->err, sizeof p->err);
  if (rc != 0) return rc;
  *meta = p->metas[k];
  const wtx_tensor_meta *f = &p->full[p->param[k]];
  size_t elsize = wtx_dtype_size(f->dtype);
  wtx_box whole;
  wtx_box_whole(f, &whole);
  uint64_t at;
  if (wtx_box_contiguous(&whole, &p->box[k], &at)) { /* rows of it: sent from where they are */
    *data = d.host + at * elsize;
    return d.stays ? 2 : 1;
  }
  wtx_box_copy(p->scratch, NULL, d.host, &whole, &p->box[k], elsize);
  *data = p->scratch;
  return 1;
}

static void part_close(void *self, void *iter) {
  part_src *p = self;
  (void)iter;
  pass_done(p->sp, p->g, 0);
}

static void part_destroy(void *self) {
  part_src *p = self;
  free(p->metas);
  free(p->param);
  free(p->box);
  free(p->parts);
  free(p->part_msgs);
  free(p->pool);
  free(p->scratch);
  free(p);
}

static const wtx_source_ops part_ops = {
    .version = WTX_SOURCE_OPS_VERSION,
    .name = "parts",
    .metadata = part_metadata,
    .open = part_open,
    .next = part_next,
    .close = part_close,
    .destroy = part_destroy,
};

/* Part k's ParamMeta.part: f's shape, the part's first element. */
static void part_msg(part_src *p, size_t k, const wtx_tensor_meta *f) {
  uint64_t *shape = &p->pool[2 * WTX_MAX_DIMS * k], *offset = shape + WTX_MAX_DIMS;
  memcpy(shape, f->shape, f->ndim * sizeof *shape);
  memcpy(offset, p->box[k].lo, f->ndim * sizeof *offset);
  Wtx__V1__TensorPart *m = &p->part_msgs[k];
  wtx__v1__tensor_part__init(m);
  m->n_full_shape = m->n_offset = f->ndim;
  m->full_shape = shape;
  m->offset = offset;
  p->parts[k] = m;
}

/* The source of the parts slices[0..n) name (params index full). */
static int part_src_create(shared_pass *sp, size_t g, const wtx_tensor_meta *full,
                           const wtx_slice *slices, size_t n, wtx_source **out,
                           part_src **self, char *err, size_t errlen) {
  part_src *p = calloc(1, sizeof *p);
  int rc = WTX_ENOMEM;
  if (p == NULL) return rc;
  *p = (part_src){.sp = sp, .g = g, .n = n, .full = (wtx_tensor_meta *)full};
  p->metas = calloc(n + 1, sizeof *p->metas);
  p->param = calloc(n + 1, sizeof *p->param);
  p->box = calloc(n + 1, sizeof *p->box);
  p->parts = calloc(n + 1, sizeof *p->parts);
  p->part_msgs = calloc(n + 1, sizeof *p->part_msgs);
  p->pool = calloc(2 * WTX_MAX_DIMS * (n + 1), sizeof *p->pool);
  if (!p->metas || !p->param || !p->box || !p->parts || !p->part_msgs || !p->pool) goto fail;
  uint64_t most = 0;
  for (size_t k = 0; k < n; k++) {
    const wtx_tensor_meta *f = &full[slices[k].param];
    p->param[k] = slices[k].param;
    wtx_slice_box(f, &slices[k], &p->box[k]);
    rc = wtx_tensor_meta_set(&p->metas[k], f->name, f->dtype, p->box[k].len, f->ndim, err,
                             errlen);
    if (rc != 0) goto fail;
    if (p->metas[k].nbytes > most) most = p->metas[k].nbytes;
    if (slices[k].dim != WTX_SLICE_WHOLE) part_msg(p, k, f);
  }
  rc = WTX_ENOMEM;
  if ((p->scratch = malloc(most + 1)) == NULL) goto fail;
  rc = wtx_source_create(&part_ops, p, out);
  if (rc == 0) {
    *self = p;
    return 0;
  }
fail:
  part_destroy(p);
  return rc;
}

/* ---- the groups ---- */

typedef struct group {
  size_t *which;     /* the user's replicas in it */
  size_t n_which;
  wtx_slice *slices; /* their parts (params index the source's metadata) */
  size_t n_slices;
  uint32_t tp_rank, tp_size;
  wtx_client *client;
  wtx_source *source;
  part_src *parts_src; /* source's state: its parts' messages, why its pass failed */
  wtx_trainer *t;
  /* one sync */
  pthread_t thread;
  const wtx_send_options *o;
  wtx_send_result res;
  int rc;
  struct wtx__sharded *sh;
  size_t ix;
} group;

struct wtx__sharded {
  group *g;
  size_t n;
  shared_pass sp;
  wtx_source *source;
  /* progress summed over the groups */
  pthread_mutex_t mu;
  uint64_t done, total;
  const wtx_send_options *o;
  wtx__strmap *names; /* the source's parameters by name (the caller's patches) */
};

int wtx__replica_slices(const Wtx__V1__ShardSpec *spec, const wtx_tensor_meta *metas,
                          size_t n, size_t i, wtx_slice **out, size_t *n_out, char *err,
                          size_t errlen) {
  /* No rules: rank 0 of 1, every tensor whole. */
  size_t nr = spec != NULL ? spec->n_rules : 0;
  wtx_shard_rule *rules = calloc(nr + 1, sizeof *rules);
  if (rules == NULL) return WTX_ENOMEM;
  for (size_t k = 0; k < nr; k++)
    rules[k] = (wtx_shard_rule){.pattern = spec->rules[k]->pattern,
                                .kind = (wtx_shard_kind)spec->rules[k]->kind,
                                .dim = spec->rules[k]->dim, .unit = spec->rules[k]->unit};
  char why[600];
  int rc = wtx_shard_slices(metas, n, rules, nr, spec ? spec->tp_rank : 0,
                            spec ? spec->tp_size : 1, out, n_out, why, sizeof why);
  if (rc != 0) snprintf(err, errlen, "worker %zu's shard rules: %s", i, why);
  free(rules);
  return rc;
}

static int same_slices(const group *gr, const wtx_slice *s, size_t n) {
  return gr->n_slices == n && memcmp(gr->slices, s, n * sizeof *s) == 0;
}

/* Puts replica i, holding slices s (taken), in its group. */
static int join_group(wtx__sharded *sh, size_t i, const Wtx__V1__ShardSpec *spec, wtx_slice *s,
                      size_t n) {
  size_t g = 0;
  while (g < sh->n && !same_slices(&sh->g[g], s, n)) g++;
  group *gr = &sh->g[g];
  if (g == sh->n) {
    sh->n++;
    *gr = (group){.slices = s, .n_slices = n, .tp_rank = spec ? spec->tp_rank : 0,
                  .tp_size = spec ? spec->tp_size : 1, .sh = sh, .ix = g};
    s = NULL;
  }
  free(s);
  size_t *w = realloc(gr->which, (gr->n_which + 1) * sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  gr->which = w;
  gr->which[gr->n_which++] = i;
  return 0;
}

/* The tcp address group g's trainer listens on: the configured one, its
 * port moved up by g when it is fixed (each group has a listener). */
static void group_address(const char *base, size_t g, char *out, size_t len) {
  const char *colon = base != NULL ? strrchr(base, ':') : NULL;
  long port = colon != NULL ? strtol(colon + 1, NULL, 10) : 0;
  if (base == NULL || colon == NULL || port == 0) {
    snprintf(out, len, "%s", base != NULL ? base : "");
    return;
  }
  snprintf(out, len, "%.*s:%ld", (int)(colon - base), base, port + (long)g);
}

/* Group g's client, source and engine (its replicas' rendezvous). */
static int group_open(wtx__sharded *sh, size_t g, const wtx_trainer_config *cfg,
                      wtx_client *client, const wtx_tensor_meta *full, char *err,
                      size_t errlen) {
  group *gr = &sh->g[g];
  int rc = part_src_create(&sh->sp, g, full, gr->slices, gr->n_slices, &gr->source,
                           &gr->parts_src, err, errlen);
  if (rc == 0) rc = wtx__client_subset(client, gr->which, gr->n_which, &gr->client);
  if (rc != 0) {
    if (err[0] == '\0') snprintf(err, errlen, "%s", wtx_strerror(rc));
    return rc;
  }
  char addr[300];
  group_address(cfg->data_address, g, addr, sizeof addr);
  wtx_trainer_config c = *cfg;
  c.data_address = addr[0] ? addr : NULL;
  char why[1400] = "";
  rc = wtx__trainer_init_plain(&c, gr->client, gr->source, &gr->t, why, sizeof why);
  if (rc != 0) {
    snprintf(err, errlen, "tensor-parallel rank %u of %u: %s", gr->tp_rank, gr->tp_size, why);
    return rc;
  }
  wtx__trainer_set_parts(gr->t, gr->parts_src->parts);
  return 0;
}

static int pass_init(wtx__sharded *sh, wtx_source *source, const wtx_tensor_meta *metas,
                     size_t n, const wtx_trainer_config *cfg) {
  shared_pass *sp = &sh->sp;
  pthread_mutex_init(&sp->mu, NULL);
  wtx__clock_cond_init(&sp->cv);
  sp->source = source;
  sp->metas = metas;
  sp->n = n;
  sp->groups = sh->n;
  /* A group waits for the slowest while it packs and sends a chunk, each
   * step bounded by the data plane's timeout. */
  sp->wait_ms = 2 * (int64_t)(cfg->timeout_ms ? cfg->timeout_ms : WTX_DEFAULT_TIMEOUT_MS);
  sp->want = calloc(sh->n + 1, sizeof *sp->want);
  sp->in_round = calloc(sh->n + 1, sizeof *sp->in_round);
  sp->left = calloc(sh->n + 1, sizeof *sp->left);
  return sp->want != NULL && sp->in_round != NULL && sp->left != NULL ? 0 : WTX_ENOMEM;
}

/* Every replica's shard spec, asked of all at once; *any 0 when none
 * announces one. */
static int read_specs(wtx_client *client, Wtx__V1__ShardSpec **specs, int *any, char *err,
                      size_t errlen) {
  *any = 0;
  int rc = wtx__client_shards(client, specs);
  if (rc != 0) snprintf(err, errlen, "%s", wtx_client_last_error(client));
  for (size_t i = 0; rc == 0 && i < wtx_client_size(client); i++) *any |= specs[i] != NULL;
  return rc;
}

static int make_groups(wtx__sharded *sh, wtx_client *client, Wtx__V1__ShardSpec **specs,
                       const wtx_tensor_meta *metas, size_t n, char *err, size_t errlen) {
  for (size_t i = 0; i < wtx_client_size(client); i++) {
    wtx_slice *s;
    size_t k;
    const Wtx__V1__ShardSpec *spec = specs[i];
    int rc = wtx__replica_slices(spec, metas, n, i, &s, &k, err, errlen);
    if (rc == 0) rc = join_group(sh, i, spec, s, k);
    if (rc != 0) return rc;
  }
  return 0;
}

int wtx__sharded_create(const wtx_trainer_config *cfg, wtx_client *client, wtx_source *source,
                        wtx__sharded **out, char *err, size_t errlen) {
  *out = NULL;
  size_t r = wtx_client_size(client), n = 0;
  const wtx_tensor_meta *metas = NULL;
  Wtx__V1__ShardSpec **info = calloc(r + 1, sizeof *info);
  wtx__sharded *sh = calloc(1, sizeof *sh);
  if (info == NULL || sh == NULL || (sh->g = calloc(r + 1, sizeof *sh->g)) == NULL) {
    free(info);
    if (sh != NULL) free(sh->g);
    free(sh);
    snprintf(err, errlen, "out of memory");
    return WTX_ENOMEM;
  }
  int any = 0, rc = read_specs(client, info, &any, err, errlen);
  if (rc == 0 && any && (rc = wtx_source_metadata(source, &metas, &n)) != 0)
    snprintf(err, errlen, "source: metadata() failed");
  if (rc == 0 && any) rc = make_groups(sh, client, info, metas, n, err, errlen);
  if (rc == 0 && any) rc = pass_init(sh, source, metas, n, cfg);
  pthread_mutex_init(&sh->mu, NULL);
  for (size_t g = 0; rc == 0 && any && g < sh->n; g++)
    rc = group_open(sh, g, cfg, client, metas, err, errlen);
  for (size_t i = 0; info != NULL && i < r; i++)
    if (info[i] != NULL) protobuf_c_message_free_unpacked(&info[i]->base, NULL);
  free(info);
  sh->source = source;
  if (rc != 0 || !any) {
    wtx__sharded_destroy(sh);
    return rc;
  }
  *out = sh;
  return 0;
}

void wtx__sharded_destroy(wtx__sharded *sh) {
  if (sh == NULL) return;
  for (size_t g = 0; sh->g != NULL && g < sh->n; g++) {
    group *gr = &sh->g[g];
    wtx_trainer_shutdown(gr->t);
    if (gr->source != NULL) wtx_source_destroy(gr->source);
    if (gr->client != NULL) wtx_client_destroy(gr->client);
    free(gr->which);
    free(gr->slices);
  }
  if (sh->sp.want != NULL) {
    pthread_mutex_destroy(&sh->sp.mu);
    pthread_cond_destroy(&sh->sp.cv);
  }
  free(sh->sp.want);
  free(sh->sp.in_round);
  free(sh->sp.left);
  wtx__strmap_destroy(sh->names);
  pthread_mutex_destroy(&sh->mu);
  free(sh->g);
  free(sh);
}

/* ---- one sync ---- */

static void group_progress(void *arg, uint64_t done, uint64_t total) {
  group *gr = arg;
  wtx__sharded *sh = gr->sh;
  (void)total;
  /* The caller's callback sees one sum at a time, from whichever group's
   * thread, never two calls at once. */
  pthread_mutex_lock(&sh->mu);
  sh->done += done - gr->res.bytes; /* res.bytes holds the group's last figure meanwhile */
  gr->res.bytes = done;
  sh->o->progress(sh->o->progress_arg, sh->done, sh->total);
  pthread_mutex_unlock(&sh->mu);
}

static void *run_group(void *arg) {
  group *gr = arg;
  wtx_send_options o = *gr->sh->o;
  if (o.progress != NULL) {
    o.progress = group_progress;
    o.progress_arg = gr;
  }
  gr->res = (wtx_send_result){0};
  gr->parts_src->err[0] = '\0';
  gr->rc = wtx__trainer_send_prepared(gr->t, &o, &gr->res);
  pass_done(&gr->sh->sp, gr->ix, 1);
  return NULL;
}

/* Group g's failure: its engine's message, and why its pass failed. */
static int group_failure(const group *gr, char *err, size_t errlen) {
  const char *why = gr->parts_src->err;
  snprintf(err, errlen, "tensor-parallel rank %u of %u: %s%s%s%s", gr->tp_rank, gr->tp_size,
           wtx_trainer_last_error(gr->t), why[0] ? " (" : "", why, why[0] ? ")" : "");
  return gr->rc;
}

/* The first group that failed, into err; when it failed waiting for
 * another group, that group's own failure follows (the stuck worker). */
static int first_failure(wtx__sharded *sh, char *err, size_t errlen) {
  const group *first = NULL, *cause = NULL;
  for (size_t g = 0; g < sh->n; g++) {
    const group *gr = &sh->g[g];
    if (gr->rc == 0) continue;
    if (first == NULL) first = gr;
    if (cause == NULL && gr->parts_src->err[0] == '\0') cause = gr;
  }
  if (first == NULL) return 0;
  int rc = group_failure(first, err, errlen);
  size_t used = strlen(err);
  if (cause != NULL && cause != first && used + 32 < errlen) {
    snprintf(err + used, errlen - used, "; it waited for ");
    used = strlen(err);
    group_failure(cause, err + used, errlen - used);
  }
  return rc;
}

static void abort_all(wtx__sharded *sh, const char *why) {
  for (size_t g = 0; g < sh->n; g++)
    if (sh->g[g].rc == 0) wtx__trainer_abort(sh->g[g].t, why);
}

/* Every group's sync to prepared, at once, from one pass. */
static int run_groups(wtx__sharded *sh, char *err, size_t errlen) {
  shared_pass *sp = &sh->sp;
  int rc = wtx_source_open(sh->source, &sp->iter);
  if (rc != 0) {
    snprintf(err, errlen, "source: cannot start a pass");
    return rc;
  }
  sp->pos = NONE;
  sp->rc = 0;
  sp->round = 1;
  for (size_t g = 0; g < sh->n; g++) {
    sp->want[g] = NONE;
    sp->in_round[g] = 0;
    sp->left[g] = 0;
  }
  size_t started = 0;
  for (; started < sh->n; started++)
    if (pthread_create(&sh->g[started].thread, NULL, run_group, &sh->g[started]) != 0) break;
  for (size_t g = started; g < sh->n; g++) {
    sh->g[g].rc = WTX_ENOMEM;
    wtx__trainer_fail(sh->g[g].t, WTX_ENOMEM, "cannot start a thread");
    pass_done(sp, g, 1);
  }
  for (size_t g = 0; g < started; g++) pthread_join(sh->g[g].thread, NULL);
  rc = first_failure(sh, err, errlen);
  if (rc == 0) rc = pass_finish(sp, err, errlen);
  if (sp->iter != NULL) wtx_source_close(sh->source, sp->iter);
  if (rc != 0) abort_all(sh, err);
  return rc;
}

/* Every group's prepared update published, or none (each group is its
 * own client: wtx__client_commit_all). */
static int commit_groups(wtx__sharded *sh, const char *version, char *label, size_t len,
                         char *err, size_t errlen) {
  wtx_client **cs = malloc(sh->n * sizeof *cs);
  if (cs == NULL) return WTX_ENOMEM;
  for (size_t g = 0; g < sh->n; g++) cs[g] = sh->g[g].client;
  size_t bad = 0;
  char why[1400];
  int rc = wtx__client_commit_all(cs, sh->n, version, label, len, &bad, why, sizeof why);
  if (rc != 0)
    snprintf(err, errlen, "tensor-parallel rank %u of %u: %s", sh->g[bad].tp_rank,
             sh->g[bad].tp_size, why);
  free(cs);
  return rc;
}

/* The groups' results as one: a delta when every group's was, else the
 * first group's reason for sending whole tensors. */
static wtx_send_result sum_results(const wtx__sharded *sh) {
  wtx_send_result sum = {.delta = sh->n > 0};
  for (size_t g = 0; g < sh->n; g++) {
    const wtx_send_result *r = &sh->g[g].res;
    sum.bytes += r->bytes;
    sum.params += r->params;
    sum.chunks += r->chunks;
    sum.control_bytes += r->control_bytes;
    sum.delta &= r->delta;
    sum.skipped_params += r->skipped_params;
    sum.skipped_bytes += r->skipped_bytes;
    sum.patched_params += r->patched_params;
    sum.patched_whole_bytes += r->patched_whole_bytes;
    if (sum.full_reason == NULL) sum.full_reason = r->full_reason;
  }
  return sum;
}

/* After every group prepared (rc 0): every group published, or none;
 * every group's delta record settled with the outcome (a group that
 * prepared in a sync another group failed published nothing); the groups'
 * results as one into result, t0 when the sync began. */
static int publish_groups(wtx__sharded *sh, int rc, const wtx_send_options *o, double t0,
                          wtx_send_result *result, char *err, size_t errlen) {
  char version[WTX_MAX_VERSION_BYTES + 1] = "";
  if (rc == 0) rc = commit_groups(sh, o->version, version, sizeof version, err, errlen);
  for (size_t g = 0; g < sh->n; g++) wtx__trainer_landed(sh->g[g].t, rc == 0);
  if (rc != 0 || result == NULL) return rc;
  *result = sum_results(sh);
  result->seconds = wtx__clock_s() - t0;
  snprintf(result->version, sizeof result->version, "%s", version);
  return 0;
}

int wtx__sharded_send(wtx__sharded *sh, const wtx_send_options *o, wtx_send_result *result,
                      char *err, size_t errlen) {
  double t0 = wtx__clock_s();
  sh->o = o;
  sh->done = 0;
  sh->total = 0;
  for (size_t g = 0; g < sh->n; g++)
    for (size_t k = 0; k < sh->g[g].n_slices; k++) {
      wtx_tensor_meta f = sh->sp.metas[sh->g[g].slices[k].param];
      wtx_box b;
      wtx_slice_box(&f, &sh->g[g].slices[k], &b);
      sh->total += wtx_box_elements(&b) * wtx_dtype_size(f.dtype);
    }
  int rc = run_groups(sh, err, errlen);
  return publish_groups(sh, rc, o, t0, result, err, errlen);
}

/* ---- the caller's patches ---- */

/* A group's share of the caller's patches: per patch it gets any of, its
 * elements in the part (indices in the part's row-major order, values
 * copied), and the part's place in the group's table. */
typedef struct group_patches {
  wtx_patch *p;
  size_t *map; /* per patch: its part in the group's table */
  size_t n;
  uint8_t *pool; /* every patch's indices (int64) and values, one after another */
} group_patches;

static void group_patches_free(group_patches *gp) {
  free(gp->p);
  free(gp->map);
  free(gp->pool);
  *gp = (group_patches){0};
}

/* Patch p (checked: indices strictly increasing, in bounds) cut to the
 * part k of group gr: into q, its indices and values written at *pool.
 * 0 elements: q->count 0. */
static void patch_in_part(const group *gr, size_t k, const wtx_patch *p, wtx_patch *q,
                          uint8_t *pool) {
  const part_src *ps = gr->parts_src;
  const wtx_tensor_meta *full = &ps->full[ps->param[k]];
  int64_t *idx = (int64_t *)(void *)pool;
  uint8_t *val = pool + p->count * sizeof *idx;
  uint64_t m = wtx__patch_cut(full->shape, full->ndim, ps->box[k].lo, ps->box[k].len,
                              p->index_dtype, p->count, p->indices, p->values,
                              wtx_dtype_size(p->dtype), idx, val);
  *q = (wtx_patch){.name = p->name, .dtype = p->dtype, .shape = ps->metas[k].shape,
                   .ndim = ps->metas[k].ndim, .index_dtype = WTX_DTYPE_INT64, .count = m,
                   .indices = idx, .values = val};
}

/* The pool's room for patch p's cut: its indices as int64, its values,
 * to the next 8 bytes (the next cut's indices start aligned). */
static uint64_t cut_room(const wtx_patch *p) {
  return (p->count * (8 + wtx_dtype_size(p->dtype)) + 7) & ~(uint64_t)7;
}

/* The part of parameter param in group gr's table, or NONE: its slices
 * are in metadata order, at most one a parameter (wtx_shard_slices). */
static size_t part_of(const group *gr, size_t param) {
  size_t lo = 0, hi = gr->n_slices;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (gr->slices[mid].param < param) lo = mid + 1;
    else hi = mid;
  }
  return lo < gr->n_slices && gr->slices[lo].param == param ? lo : NONE;
}

/* Group gr's share of the n patches, param[j] patch j's parameter. */
static int share_patches(const group *gr, const wtx_patch *p, const size_t *param, size_t n,
                         group_patches *gp) {
  uint64_t room = 0;
  for (size_t j = 0; j < n; j++) room += cut_room(&p[j]);
  gp->p = calloc(n + 1, sizeof *gp->p);
  gp->map = calloc(n + 1, sizeof *gp->map);
  gp->pool = malloc(room + 8);
  if (gp->p == NULL || gp->map == NULL || gp->pool == NULL) return WTX_ENOMEM;
  uint64_t used = 0;
  for (size_t j = 0; j < n; j++) {
    size_t k = part_of(gr, param[j]);
    if (k == NONE) continue;
    wtx_patch *q = &gp->p[gp->n];
    patch_in_part(gr, k, &p[j], q, gp->pool + used);
    used += cut_room(&p[j]);
    if (q->count > 0) gp->map[gp->n++] = k;
  }
  return 0;
}

/* Group g's share of the patches prepared on its replicas. */
static int group_patch(group *gr, const wtx_patch *p, const size_t *param, size_t n,
                       const wtx_send_options *o) {
  group_patches gp = {0};
  int rc = share_patches(gr, p, param, n, &gp);
  if (rc != 0) rc = wtx__trainer_fail(gr->t, rc, "out of memory");
  else rc = wtx__trainer_patches_prepared(gr->t, gp.p, gp.n, gp.map, o, &gr->res);
  group_patches_free(&gp);
  return rc;
}

int wtx__sharded_send_patches(wtx__sharded *sh, const wtx_patch *patches, size_t n,
                              const wtx_send_options *o, wtx_send_result *result, char *err,
                              size_t errlen) {
  if (n == 0) return 0;
  double t0 = wtx__clock_s();
  size_t *param = calloc(n, sizeof *param);
  int rc = param != NULL ? 0 : WTX_ENOMEM;
  if (rc != 0) snprintf(err, errlen, "out of memory");
  if (rc == 0 && sh->names == NULL)
    rc = wtx__delta_names(sh->sp.metas, sh->sp.n, &sh->names);
  if (rc != 0) snprintf(err, errlen, "out of memory");
  for (size_t j = 0; rc == 0 && j < n; j++)
    rc = wtx__delta_patch_param(sh->names, sh->sp.metas, &patches[j], j, &param[j], err, errlen);
  /* Every group prepares the new version, even one none of whose parts
   * changed, so that all publish it or none. */
  size_t g = 0;
  for (; rc == 0 && g < sh->n; g++)
    rc = sh->g[g].rc = group_patch(&sh->g[g], patches, param, n, o);
  free(param);
  if (rc != 0 && g > 0) { /* group g - 1 failed; those before it prepared */
    group_failure(&sh->g[g - 1], err, errlen);
    for (size_t b = 0; b + 1 < g; b++) wtx__trainer_abort(sh->g[b].t, err);
  }
  return publish_groups(sh, rc, o, t0, result, err, errlen);
}

int wtx__sharded_verify(wtx__sharded *sh, char *err, size_t errlen) {
  for (size_t g = 0; g < sh->n; g++) {
    int rc = wtx_trainer_verify(sh->g[g].t);
    if (rc == 0) continue;
    snprintf(err, errlen, "tensor-parallel rank %u of %u: %s", sh->g[g].tp_rank,
             sh->g[g].tp_size, wtx_trainer_last_error(sh->g[g].t));
    return rc;
  }
  return 0;
}
