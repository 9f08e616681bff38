/* Publishing every finished version of the main weights as a safetensors
 * file (--publish-dir), off the gRPC threads: a finish only wakes the
 * publisher, which writes the newest version (an older one still queued is
 * skipped: readers want the latest) from a store view, so the bytes it
 * writes cannot change under it. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/safetensors.h"
#include "server/publish.h"

struct wtx__publisher {
  wtx_store *store;
  char *dir;
  int keep;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int pending, stop;
  uint64_t written_gen;
  char *written_version;
  char **files; /* written by us, oldest first, at most keep */
  size_t n_files;
};

int wtx__file_name(const char *version, char *out, size_t len) {
  size_t o = 0;
  int same = 1;
  for (const char *p = version; *p && o + 1 < len && o < 200; p++) {
    char c = *p;
    int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
             (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (o == 0 && c == '.') ok = 0; /* no hidden files */
    same &= ok;
    out[o++] = ok ? c : '_';
  }
  out[o] = '\0';
  return same && o > 0 && version[o] == '\0';
}

int wtx__write_view(const wtx_store_view *v, const char *path, char *err, size_t errlen) {
  wtx_st_tensor *ts = calloc(v->n_params ? v->n_params : 1, sizeof *ts);
  if (ts == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < v->n_params; i++)
    ts[i] = (wtx_st_tensor){v->params[i].meta, v->params[i].data};
  char gen[32];
  snprintf(gen, sizeof gen, "%llu", (unsigned long long)v->generation);
  const char *const meta[][2] = {
      {"format", "pt"}, {"wtx_version", v->version}, {"wtx_generation", gen}};
  int rc = wtx_st_write(path, ts, v->n_params, meta, 3, err, errlen);
  free(ts);
  return rc;
}

static int write_latest(const char *dir, const char *name) {
  char tmp[4200], path[4200];
  snprintf(tmp, sizeof tmp, "%s/.LATEST.tmp", dir);
  snprintf(path, sizeof path, "%s/LATEST", dir);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) return -1;
  int bad = fprintf(f, "%s\n", name) < 0 || fflush(f) != 0 || fsync(fileno(f)) != 0;
  bad |= fclose(f) != 0;
  return bad || rename(tmp, path) != 0 ? -1 : 0;
}

static void publish_one(wtx__publisher *p) {
  wtx_store_view v;
  if (wtx_store_acquire(p->store, WTX_TARGET_MAIN, &v) != 0) return;
  if (v.n_params == 0 || (v.generation == p->written_gen && p->written_version &&
                          strcmp(v.version, p->written_version) == 0)) {
    wtx_store_release(p->store, &v);
    return;
  }
  char name[256], path[4400], err[512] = "";
  wtx__file_name(v.version, name, sizeof name - 16);
  strcat(name, ".safetensors");
  snprintf(path, sizeof path, "%s/%s", p->dir, name);
  int rc = wtx__write_view(&v, path, err, sizeof err);
  char q[600];
  if (rc == 0 && write_latest(p->dir, name) != 0) {
    rc = WTX_EIO;
    snprintf(err, sizeof err, "%s/LATEST: cannot write", p->dir);
  }
  if (rc == 0) {
    wtx__log(WTX__LOG_INFO, "event=written file=%s version=%s bytes=%llu",
            wtx__log_quote(path, q, sizeof q), v.version,
            (unsigned long long)v.total_bytes);
    p->written_gen = v.generation;
    free(p->written_version);
    p->written_version = strdup(v.version);
    /* Remember the file; forget (and delete) the oldest beyond keep. A name
     * written again (same version) moves to the end. */
    for (size_t i = 0; i < p->n_files; i++)
      if (strcmp(p->files[i], path) == 0) {
        free(p->files[i]);
        memmove(&p->files[i], &p->files[i + 1], (--p->n_files - i) * sizeof *p->files);
        break;
      }
    char **files = realloc(p->files, (p->n_files + 1) * sizeof *files);
    if (files != NULL) {
      p->files = files;
      p->files[p->n_files++] = strdup(path);
    }
    while (p->n_files > (size_t)p->keep) {
      unlink(p->files[0]);
      free(p->files[0]);
      memmove(&p->files[0], &p->files[1], --p->n_files * sizeof *p->files);
    }
  } else {
    wtx__log(WTX__LOG_ERROR, "event=publish_failed version=%s error=%s",
            v.version, wtx__log_quote(err[0] ? err : wtx_strerror(rc), q, sizeof q));
  }
  wtx_store_release(p->store, &v);
}

static void *run(void *arg) {
  wtx__publisher *p = arg;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->pending && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
    if (!p->pending) break;
    p->pending = 0;
    pthread_mutex_unlock(&p->mu);
    publish_one(p);
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int wtx__publisher_create(wtx_store *store, const char *dir, int keep,
                          wtx__publisher **out) {
  *out = NULL;
  if (access(dir, W_OK) != 0) return WTX_ENOENT;
  wtx__publisher *p = calloc(1, sizeof *p);
  if (p == NULL || (p->dir = strdup(dir)) == NULL) {
    free(p);
    return WTX_ENOMEM;
  }
  p->store = store;
  p->keep = keep > 0 ? keep : 1;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  if (pthread_create(&p->thread, NULL, run, p) != 0) {
    free(p->dir);
    free(p);
    return WTX_ENOMEM;
  }
  *out = p;
  return 0;
}

void wtx__publisher_notify(wtx__publisher *p) {
  pthread_mutex_lock(&p->mu);
  p->pending = 1;
  pthread_cond_signal(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

void wtx__publisher_destroy(wtx__publisher *p) {
  if (p == NULL) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_signal(&p->cv);
  pthread_mutex_unlock(&p->mu);
  pthread_join(p->thread, NULL); /* a queued version is written first */
  for (size_t i = 0; i < p->n_files; i++) free(p->files[i]);
  free(p->files);
  free(p->written_version);
  free(p->dir);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  free(p);
}
