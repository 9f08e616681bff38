/* The worker's bearer-token check (see auth.h). */
#include "server/auth.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define MAX_TOKEN 4096

struct wtx__auth {
  pthread_mutex_t mu;
  char *path;          /* NULL: no token required */
  wtx_reflection reflection;
  char token[MAX_TOKEN + 2];
  size_t len;
  struct stat seen;    /* of the file the token came from */
};

int wtx__auth_equal(const char *a, size_t alen, const char *b, size_t blen) {
  /* Every byte of b is compared (against a, repeated): the time depends on
   * the lengths, never on where the first difference is. */
  unsigned char diff = alen != blen;
  for (size_t i = 0; i < blen; i++)
    diff |= (unsigned char)(b[i] ^ (alen ? a[i % alen] : 0));
  return alen == blen && diff == 0;
}

/* Reads the first line of path, the token, into tok (NUL-terminated) and
 * its length into *n. Only a regular file: opening a FIFO (or a device)
 * could block, under the lock every authenticated call takes. */
static int read_token(const char *path, char tok[MAX_TOKEN + 2], size_t *n, char *err,
                      size_t errlen) {
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  struct stat st;
  if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
    close(fd);
    snprintf(err, errlen, "token_file: %s is not a regular file", path);
    return WTX_EINVAL;
  }
  FILE *f = fd >= 0 ? fdopen(fd, "r") : NULL;
  if (fd >= 0 && f == NULL) close(fd);
  if (f == NULL || fgets(tok, MAX_TOKEN + 2, f) == NULL) {
    if (f != NULL) fclose(f);
    snprintf(err, errlen, "token_file: cannot read %s", path);
    return WTX_EINVAL;
  }
  fclose(f);
  *n = strcspn(tok, "\r\n");
  if (*n == 0 || *n > MAX_TOKEN) {
    snprintf(err, errlen, "token_file: %s: the first line must hold the token "
             "(1..%d bytes)", path, MAX_TOKEN);
    return WTX_EINVAL;
  }
  tok[*n] = '\0';
  return 0;
}

int wtx__auth_create(const char *token_file, wtx_reflection reflection,
                     wtx__auth **out, char *err, size_t errlen) {
  *out = NULL;
  wtx__auth *a = calloc(1, sizeof *a);
  if (a == NULL) return WTX_ENOMEM;
  pthread_mutex_init(&a->mu, NULL);
  a->reflection = reflection;
  int rc = 0;
  struct stat st;
  if (token_file != NULL) {
    if ((a->path = strdup(token_file)) == NULL) rc = WTX_ENOMEM;
    else if (stat(token_file, &st) != 0) {
      snprintf(err, errlen, "token_file: cannot read %s", token_file);
      rc = WTX_EINVAL;
    } else if ((rc = read_token(token_file, a->token, &a->len, err, errlen)) == 0) {
      a->seen = st;
    }
  }
  if (rc != 0) {
    wtx__auth_destroy(a);
    return rc;
  }
  *out = a;
  return 0;
}

void wtx__auth_destroy(wtx__auth *a) {
  if (a == NULL) return;
  pthread_mutex_destroy(&a->mu);
  free(a->path);
  free(a);
}

static int changed(const struct stat *a, const struct stat *b) {
  return a->st_ino != b->st_ino || a->st_dev != b->st_dev || a->st_size != b->st_size ||
         a->st_mtim.tv_sec != b->st_mtim.tv_sec || a->st_mtim.tv_nsec != b->st_mtim.tv_nsec;
}

/* Whether st was modified less than FRESH_S ago (or "in the future", by
 * another clock). A file's mtime comes from a clock that ticks coarsely (a
 * jiffy; 1 s on ext3, 2 s on FAT), so a second in-place write of a token
 * of the same length within one tick leaves inode, size and mtime as they
 * were: changed() cannot see it, nor the end of a write the first read
 * caught halfway (a token cut short). While the file is this young it is
 * read on every call; after that a stat is enough again. */
#define FRESH_S 2
static int fresh(const struct stat *st) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  int64_t age_ns = ((int64_t)now.tv_sec - st->st_mtim.tv_sec) * 1000000000 +
                   (now.tv_nsec - st->st_mtim.tv_nsec);
  return age_ns < (int64_t)FRESH_S * 1000000000;
}

/* Whether value ("Bearer <token>") carries the current token; re-reads the
 * file first when it changed or may have changed unseen. */
static int token_ok(wtx__auth *a, const char *value) {
  static const char bearer[] = "Bearer ";
  if (value == NULL || strncmp(value, bearer, sizeof bearer - 1) != 0) return 0;
  value += sizeof bearer - 1;
  pthread_mutex_lock(&a->mu);
  struct stat st;
  if (stat(a->path, &st) == 0) {
    int moved = changed(&st, &a->seen);
    char tok[MAX_TOKEN + 2], err[256];
    size_t n;
    if (moved || fresh(&st)) {
      if (read_token(a->path, tok, &n, err, sizeof err) != 0) {
        /* Said once per change, not on every call while it is fresh. */
        if (moved) wtx__log(WTX__LOG_WARN, "event=token_reload_failed keeping=previous");
      } else if (n != a->len || memcmp(tok, a->token, n) != 0) {
        memcpy(a->token, tok, n + 1);
        a->len = n;
        wtx__log(WTX__LOG_INFO, "event=token_reloaded");
      }
    }
    a->seen = st;
  }
  int ok = wtx__auth_equal(a->token, a->len, value, strlen(value));
  pthread_mutex_unlock(&a->mu);
  return ok;
}

grpc_status_code wtx__auth_check(void *auth, wtx__rpc_ctx *ctx) {
  wtx__auth *a = auth;
  const char *path = wtx__rpc_ctx_method(ctx)->path;
  if (strncmp(path, "/grpc.health.v1.Health/", 23) == 0) return GRPC_STATUS_OK;
  if (strncmp(path, "/grpc.reflection.", 17) == 0 && a->reflection == WTX_REFLECTION_OPEN)
    return GRPC_STATUS_OK;
  if (a->path == NULL) return GRPC_STATUS_OK;
  if (token_ok(a, wtx__rpc_ctx_metadata(ctx, "authorization"))) return GRPC_STATUS_OK;
  /* Nothing of what the caller sent is echoed. */
  return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAUTHENTICATED,
                            "missing or wrong bearer token (send 'authorization: "
                            "Bearer <token>')");
}
