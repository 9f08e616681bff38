/* Checks of the text a caller sends (parameter names, version labels,
 * reasons): valid UTF-8, over GNU libunistring. */
#ifndef WTX_COMMON_TEXT_H
#define WTX_COMMON_TEXT_H

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when s (a C string) is valid UTF-8. */
int wtx__utf8_valid(const char *s);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_TEXT_H */
