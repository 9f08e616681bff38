/* The sidecar bridge into a stock vLLM server (see vllm.h). */
#include "server/vllm.h"

#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yajl/yajl_gen.h>
#include <yajl/yajl_tree.h>

#include "common/log.h"
#include "server/publish.h"

#define MAX_KEEP 16

struct wtx__vllm {
  wtx_store *store;
  char *url, *dir, *mode;
  int disk, keep;
  int64_t timeout_ms;
  pthread_mutex_t mu; /* one publish at a time; the kept directories */
  char kept[MAX_KEEP][256];
  int n_kept;
  /* The trainer paused generation (Pause, not yet Resumed): a reload
   * pauses around itself but must leave it paused. */
  atomic_int held;
};

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_start(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

int wtx__vllm_create(wtx_store *store, const wtx__vllm_config *cfg, wtx__vllm **out,
                     char *err, size_t errlen) {
  *out = NULL;
  const char *mode = cfg->pause_mode ? cfg->pause_mode : "wait";
  if (strncmp(cfg->url, "http://", 7) != 0 && strncmp(cfg->url, "https://", 8) != 0) {
    snprintf(err, errlen, "vllm_url: '%s' is not an http:// or https:// URL", cfg->url);
    return WTX_EINVAL;
  }
  if (strcmp(mode, "abort") && strcmp(mode, "wait") && strcmp(mode, "keep")) {
    snprintf(err, errlen, "vllm_pause_mode: '%s' is not abort, wait or keep", mode);
    return WTX_EINVAL;
  }
  struct stat st;
  if (cfg->dir == NULL || stat(cfg->dir, &st) != 0 || !S_ISDIR(st.st_mode) ||
      access(cfg->dir, W_OK) != 0) {
    snprintf(err, errlen, "vllm_dir: '%s' is not a writable directory",
             cfg->dir ? cfg->dir : "(none)");
    return WTX_EINVAL;
  }
  pthread_once(&curl_once, curl_start);
  wtx__vllm *b = calloc(1, sizeof *b);
  if (b == NULL) return WTX_ENOMEM;
  b->store = store;
  b->url = strdup(cfg->url);
  b->dir = strdup(cfg->dir);
  b->mode = strdup(mode);
  b->disk = cfg->disk;
  b->keep = cfg->keep > 0 && cfg->keep <= MAX_KEEP ? cfg->keep : 2;
  b->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : WTX_DEFAULT_TIMEOUT_MS;
  pthread_mutex_init(&b->mu, NULL);
  if (b->url == NULL || b->dir == NULL || b->mode == NULL) {
    wtx__vllm_destroy(b);
    return WTX_ENOMEM;
  }
  size_t n = strlen(b->url);
  while (n > 0 && b->url[n - 1] == '/') b->url[--n] = '\0';
  *out = b;
  return 0;
}

void wtx__vllm_destroy(wtx__vllm *b) {
  if (b == NULL) return;
  pthread_mutex_destroy(&b->mu);
  free(b->url);
  free(b->dir);
  free(b->mode);
  free(b);
}

/* ---- HTTP ---- */

typedef struct reply {
  char body[512]; /* the start of the answer, for messages */
  size_t len;
} reply;

static size_t on_body(char *p, size_t size, size_t n, void *arg) {
  reply *r = arg;
  size_t k = size * n, room = sizeof r->body - 1 - r->len;
  memcpy(r->body + r->len, p, k < room ? k : room);
  r->len += k < room ? k : room;
  r->body[r->len] = '\0';
  return size * n;
}

/* METHOD url+path with a JSON body (NULL: none); the answer's start in r.
 * 0 for a 2xx answer; otherwise err names the route and why. */
static int http(wtx__vllm *b, const char *path, const char *json, reply *r, char *err,
                size_t errlen) {
  char url[2048];
  snprintf(url, sizeof url, "%s%s", b->url, path);
  CURL *h = curl_easy_init();
  if (h == NULL) return WTX_ENOMEM;
  struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
  memset(r, 0, sizeof *r);
  curl_easy_setopt(h, CURLOPT_URL, url);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)b->timeout_ms);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, r);
  if (json != NULL) {
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, json);
  }
  CURLcode e = curl_easy_perform(h);
  long status = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  curl_slist_free_all(hdr);
  curl_easy_cleanup(h);
  if (e == CURLE_OPERATION_TIMEDOUT) {
    snprintf(err, errlen, "vLLM %s: no answer within %lld ms", path, (long long)b->timeout_ms);
    return WTX_ETIMEDOUT;
  }
  if (e != CURLE_OK) {
    snprintf(err, errlen, "vLLM %s: %s", path, curl_easy_strerror(e));
    return WTX_EUNAVAIL;
  }
  if (status < 200 || status > 299) {
    snprintf(err, errlen, "vLLM %s answered %ld: %.300s", path, status, r->body);
    return WTX_EABORTED;
  }
  return 0;
}

static void gen_str(yajl_gen g, const char *s) {
  yajl_gen_string(g, (const unsigned char *)s, strlen(s));
}

/* {k1: v1, nest: {k2: v2}}, either part left out when its first key is
 * NULL; strings escaped by yajl. malloc'd, NULL when out of memory. */
static char *json_doc(const char *k1, const char *v1, const char *nest, const char *k2,
                      const char *v2) {
  yajl_gen g = yajl_gen_alloc(NULL);
  if (g == NULL) return NULL;
  yajl_gen_map_open(g);
  if (k1 != NULL) {
    gen_str(g, k1);
    gen_str(g, v1);
  }
  if (nest != NULL) {
    gen_str(g, nest);
    yajl_gen_map_open(g);
    gen_str(g, k2);
    gen_str(g, v2);
    yajl_gen_map_close(g);
  }
  yajl_gen_map_close(g);
  const unsigned char *buf;
  size_t len;
  char *out = NULL;
  if (yajl_gen_get_buf(g, &buf, &len) == yajl_gen_status_ok && (out = malloc(len + 1)) != NULL) {
    memcpy(out, buf, len);
    out[len] = '\0';
  }
  yajl_gen_free(g);
  return out;
}

/* ---- the version directory ---- */

/* The directory name of a version: the label when it is a plain file name,
 * else "gen-<generation>". */
static void dir_name(const char *version, uint64_t generation, char *out, size_t len) {
  if (!wtx__file_name(version, out, len))
    snprintf(out, len, "gen-%llu", (unsigned long long)generation);
}

static void remove_dir(const char *path) {
  char file[4400];
  snprintf(file, sizeof file, "%s/model.safetensors", path);
  unlink(file);
  rmdir(path);
}

/* Writes view as DIR/name/model.safetensors, atomically (a temporary
 * directory renamed into place). */
static int write_version(wtx__vllm *b, const wtx_store_view *v, const char *name, char *err,
                         size_t errlen) {
  char tmp[4200], final[4200], file[4400];
  snprintf(tmp, sizeof tmp, "%s/.tmp-%s-%d", b->dir, name, (int)getpid());
  snprintf(final, sizeof final, "%s/%s", b->dir, name);
  snprintf(file, sizeof file, "%s/model.safetensors", tmp);
  remove_dir(tmp);
  if (mkdir(tmp, 0755) != 0) {
    snprintf(err, errlen, "vllm_dir: cannot create %s: %s", tmp, strerror(errno));
    return WTX_EIO;
  }
  int rc = wtx__write_view(v, file, err, errlen);
  if (rc == 0) {
    remove_dir(final); /* the same label published again */
    if (rename(tmp, final) != 0) {
      snprintf(err, errlen, "vllm_dir: cannot rename %s: %s", tmp, strerror(errno));
      rc = WTX_EIO;
    }
  }
  if (rc != 0) remove_dir(tmp);
  return rc;
}

/* Remembers name as written and removes the directories beyond keep. */
static void keep_newest(wtx__vllm *b, const char *name) {
  for (int i = 0; i < b->n_kept; i++)
    if (strcmp(b->kept[i], name) == 0) return;
  if (b->n_kept == b->keep) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", b->dir, b->kept[0]);
    remove_dir(path);
    memmove(b->kept[0], b->kept[1], sizeof b->kept[0] * (size_t)(b->n_kept - 1));
    b->n_kept--;
  }
  snprintf(b->kept[b->n_kept++], sizeof b->kept[0], "%s", name);
}

/* ---- the load ---- */

static int load_dev(wtx__vllm *b, const char *path, const char *version, char *err,
                    size_t errlen) {
  reply r;
  char route[64];
  snprintf(route, sizeof route, "/pause?mode=%s", b->mode);
  int rc = http(b, route, "{}", &r, err, errlen);
  if (rc != 0) return rc;
  char *body = json_doc("method", "reload_weights", "kwargs", "weights_path", path);
  char *vbody = json_doc("new_version", version, NULL, NULL, NULL);
  rc = body != NULL && vbody != NULL ? 0 : WTX_ENOMEM;
  if (rc == 0) rc = http(b, "/collective_rpc", body, &r, err, errlen);
  if (rc == 0) rc = http(b, "/update_weight_version", vbody, &r, err, errlen);
  free(body);
  free(vbody);
  char why[512];
  if (!atomic_load(&b->held) && http(b, "/resume", "{}", &r, why, sizeof why) != 0 && rc == 0) {
    snprintf(err, errlen, "%s", why);
    rc = WTX_EABORTED;
  }
  return rc;
}

static int load_disk(wtx__vllm *b, const char *path, const char *version, char *err,
                     size_t errlen) {
  reply r;
  char *body = json_doc(NULL, NULL, "update_info", "weights_path", path);
  char *fbody = json_doc("weight_version", version, NULL, NULL, NULL);
  int rc = body != NULL && fbody != NULL ? 0 : WTX_ENOMEM;
  if (rc == 0) rc = http(b, "/start_weight_update", "{}", &r, err, errlen);
  if (rc == 0) rc = http(b, "/update_weights", body, &r, err, errlen);
  if (rc == 0) rc = http(b, "/finish_weight_update", fbody, &r, err, errlen);
  free(body);
  free(fbody);
  return rc;
}

int wtx__vllm_publish(wtx__vllm *b, char *err, size_t errlen) {
  wtx_store_view v;
  wtx_store_acquire(b->store, WTX_TARGET_MAIN, &v);
  if (v.n_params == 0) {
    /* The first version undone: nothing to hand vLLM, which keeps what it
     * loaded (its own checkpoint, or that version if it took it). */
    wtx_store_release(b->store, &v);
    snprintf(err, errlen, "there is no version before the first to load again: vLLM keeps "
             "the weights it has");
    return WTX_ESTATE;
  }
  char name[256], path[4200];
  dir_name(v.version, v.generation, name, sizeof name);
  snprintf(path, sizeof path, "%s/%s", b->dir, name);
  pthread_mutex_lock(&b->mu);
  int rc = write_version(b, &v, name, err, errlen);
  if (rc == 0) keep_newest(b, name);
  if (rc == 0)
    rc = b->disk ? load_disk(b, path, v.version, err, errlen)
                 : load_dev(b, path, v.version, err, errlen);
  pthread_mutex_unlock(&b->mu);
  char q[600];
  if (rc == 0)
    wtx__log(WTX__LOG_INFO, "event=vllm_loaded version=%s dir=%s",
            wtx__log_quote(v.version, q, sizeof q), path);
  else
    wtx__log(WTX__LOG_WARN, "event=vllm_failed reason=%s", wtx__log_quote(err, q, sizeof q));
  wtx_store_release(b->store, &v);
  return rc;
}

/* Whether vLLM says it is paused (GET /is_paused): 1 or 0, or was when it
 * does not say. */
static int is_paused(wtx__vllm *b, int was) {
  reply r;
  char err[600];
  if (http(b, "/is_paused", NULL, &r, err, sizeof err) != 0) return was;
  yajl_val tree = yajl_tree_parse(r.body, NULL, 0);
  const char *key[] = {"is_paused", NULL};
  yajl_val v = tree != NULL ? yajl_tree_get(tree, key, yajl_t_any) : NULL;
  int paused = v != NULL && YAJL_IS_TRUE(v) ? 1 : v != NULL && YAJL_IS_FALSE(v) ? 0 : was;
  yajl_tree_free(tree);
  return paused;
}

/* POSTs route; the state vLLM is in afterwards (see vllm.h). */
static int pause_or_resume(wtx__vllm *b, const char *route, int want, int was) {
  reply r;
  char err[600], q[700];
  int rc = http(b, route, "{}", &r, err, sizeof err);
  if (rc == 0) return want;
  wtx__log(WTX__LOG_WARN, "event=%s reason=%s", want ? "vllm_pause_failed" : "vllm_resume_failed",
          wtx__log_quote(err, q, sizeof q));
  /* A vLLM too slow to answer would be as slow to answer this. */
  return rc == WTX_ETIMEDOUT ? was : is_paused(b, was);
}

int wtx__vllm_pause(wtx__vllm *b, int wait_for_inflight, int was) {
  char route[64];
  snprintf(route, sizeof route, "/pause?mode=%s", wait_for_inflight ? "wait" : "abort");
  int paused = pause_or_resume(b, route, 1, was);
  atomic_store(&b->held, paused);
  return paused;
}

int wtx__vllm_resume(wtx__vllm *b, int was) {
  int paused = pause_or_resume(b, "/resume", 0, was);
  atomic_store(&b->held, paused);
  return paused;
}

int wtx__vllm_serving(wtx__vllm *b, char *out, size_t len) {
  reply r;
  char err[600];
  int rc = http(b, "/weight_info", NULL, &r, err, sizeof err);
  if (rc != 0) return rc;
  yajl_val tree = yajl_tree_parse(r.body, NULL, 0);
  const char *key[] = {"weight_version", NULL};
  yajl_val v = tree != NULL ? yajl_tree_get(tree, key, yajl_t_string) : NULL;
  snprintf(out, len, "%s", v != NULL ? YAJL_GET_STRING(v) : "");
  yajl_tree_free(tree);
  return v != NULL ? 0 : WTX_EPROTO;
}
