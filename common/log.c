/* wtx structured logs (see log.h). */
#include "common/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "wtx/error.h"

static atomic_int threshold = WTX__LOG_INFO;
static pthread_mutex_t sink_mu = PTHREAD_MUTEX_INITIALIZER;
static wtx__log_sink sink_fn;
static void *sink_user;

static const char *const names[] = {"debug", "info", "warn", "error", "off"};

void wtx__log_set_level(int level) { atomic_store(&threshold, level); }


int wtx__log_parse_level(const char *name, int *level) {
  for (int i = 0; i <= WTX__LOG_OFF; i++)
    if (strcasecmp(name, names[i]) == 0) {
      *level = i;
      return 0;
    }
  return WTX_EINVAL;
}

void wtx__log_set_sink(wtx__log_sink sink, void *user) {
  pthread_mutex_lock(&sink_mu);
  sink_fn = sink;
  sink_user = user;
  pthread_mutex_unlock(&sink_mu);
}

void wtx__log(int level, const char *fmt, ...) {
  if (level < atomic_load(&threshold) || level >= WTX__LOG_OFF) return;
  char line[4096];
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  size_t off = strftime(line, sizeof line, "ts=%Y-%m-%dT%H:%M:%S", &tm);
  off += (size_t)snprintf(line + off, sizeof line - off, ".%03ldZ level=%s ",
                          ts.tv_nsec / 1000000, names[level]);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line + off, sizeof line - off, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&sink_mu);
  if (sink_fn != NULL)
    sink_fn(sink_user, level, line);
  else
    fprintf(stderr, "%s\n", line);
  pthread_mutex_unlock(&sink_mu);
}

const char *wtx__log_quote(const char *s, char *buf, size_t len) {
  if (len == 0) return buf;
  int plain = s[0] != '\0';
  for (const char *p = s; *p && plain; p++)
    if (*p == ' ' || *p == '"' || *p == '=' || *p == '\\' ||
        (unsigned char)*p < 0x20)
      plain = 0;
  if (plain) {
    snprintf(buf, len, "%s", s);
    return buf;
  }
  size_t o = 0;
  buf[o++] = '"';
  for (const char *p = s; *p && o + 3 < len; p++) {
    char c = *p;
    if (c == '"' || c == '\\' || c == '\n') {
      buf[o++] = '\\';
      c = c == '\n' ? 'n' : c;
    } else if ((unsigned char)c < 0x20) {
      c = ' ';
    }
    buf[o++] = c;
  }
  if (o + 1 < len) buf[o++] = '"';
  buf[o < len ? o : len - 1] = '\0';
  return buf;
}
