/* wtx structured logs: one line per event, logfmt (key=value pairs), with a
 * level, written to stderr or handed to the host's sink.
 *
 *   ts=2026-11-29T14:03:07.512Z level=info event=published version=7 ...
 *
 * A library call never prints on its own below the threshold (default
 * info); the daemons set it from --log-level / WTX_LOG_LEVEL. */
#ifndef WTX_COMMON_LOG_H
#define WTX_COMMON_LOG_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum wtx__log_level {
  WTX__LOG_DEBUG = 0,
  WTX__LOG_INFO = 1,
  WTX__LOG_WARN = 2,
  WTX__LOG_ERROR = 3,
  WTX__LOG_OFF = 4,
} wtx__log_level;

/* Lines below level are dropped. Process-wide. */
void wtx__log_set_level(int level);
/* "debug", "info", "warn", "error", "off" -> level; WTX_EINVAL otherwise. */
int wtx__log_parse_level(const char *name, int *level);

/* Where lines go: sink(user, level, line) with line holding the whole
 * logfmt line without newline (valid during the call). NULL restores
 * stderr. Process-wide; set it before starting workers. */
typedef void (*wtx__log_sink)(void *user, int level, const char *line);
void wtx__log_set_sink(wtx__log_sink sink, void *user);

/* Logs one event. fmt formats the pairs after ts and level, e.g.
 * "event=aborted update=%llu reason=%s" with the reason passed through
 * wtx__log_quote. Lines longer than 4 KiB are cut. */
void wtx__log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* s as a logfmt value into buf: as is when it holds no space, quote, '=' or
 * control byte, otherwise in double quotes with \" \\ \n escaped. Returns
 * buf. */
const char *wtx__log_quote(const char *s, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_LOG_H */
