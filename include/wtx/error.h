/* wtx error codes.
 *
 * Every wtx function that can fail returns int: 0 on success or one negative
 * WTX_E* code below. A function that fails leaves the state it was given
 * unchanged unless its header says otherwise. Handles keep a last-error
 * message with the detail (the field, the limit, the peer).
 *
 * The table also fixes how each code crosses the wire as a gRPC status, so the
 * worker answers with the same code the client library maps back. */
#ifndef WTX_ERROR_H
#define WTX_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

/* XX(name, value, message, grpc status code number) */
#define WTX_ERRNO_MAP(XX)                                                     \
  XX(EINVAL, -1, "invalid argument", 3 /* INVALID_ARGUMENT */)               \
  XX(ENOMEM, -2, "out of memory", 8 /* RESOURCE_EXHAUSTED */)                \
  XX(ESTATE, -3, "call not valid in the current state",                      \
     9 /* FAILED_PRECONDITION */)                                             \
  XX(ENOENT, -4, "not found", 5 /* NOT_FOUND */)                             \
  XX(EEXIST, -5, "already exists", 6 /* ALREADY_EXISTS */)                   \
  XX(ENOTSUP, -6, "not supported", 12 /* UNIMPLEMENTED */)                   \
  XX(ETIMEDOUT, -7, "timed out", 4 /* DEADLINE_EXCEEDED */)                  \
  XX(EIO, -8, "I/O error", 14 /* UNAVAILABLE */)                             \
  XX(ECHECKSUM, -9, "checksum mismatch", 15 /* DATA_LOSS */)                 \
  XX(ECANCELED, -10, "canceled", 1 /* CANCELLED */)                          \
  XX(EABORTED, -11, "aborted", 10 /* ABORTED */)                             \
  XX(EUNAVAIL, -12, "unavailable", 14 /* UNAVAILABLE */)                     \
  XX(ETOOBIG, -13, "size limit exceeded", 8 /* RESOURCE_EXHAUSTED */)        \
  XX(EAUTH, -14, "not authenticated", 16 /* UNAUTHENTICATED */)              \
  XX(EPERM, -15, "permission denied", 7 /* PERMISSION_DENIED */)             \
  XX(EPROTO, -16, "protocol error", 13 /* INTERNAL */)                       \
  XX(ERANGE, -17, "out of range", 11 /* OUT_OF_RANGE */)                     \
  XX(EINTERNAL, -18, "internal error", 13 /* INTERNAL */)                    \
  XX(EUNKNOWN, -19, "unknown error", 2 /* UNKNOWN */)

typedef enum wtx_errno {
#define WTX__ERR_ENUM(name, value, msg, grpc) WTX_##name = (value),
  WTX_ERRNO_MAP(WTX__ERR_ENUM)
#undef WTX__ERR_ENUM
} wtx_errno;

/* Returns a static, human-readable description of code (0 or WTX_E*);
 * "unknown error code" for anything else. Never NULL. */
const char *wtx_strerror(int code);

/* Returns the static name of code, e.g. "WTX_EINVAL"; "WTX_OK" for 0. */
const char *wtx_err_name(int code);

/* The gRPC status code (grpc_status_code value) that carries code on the
 * wire; 0 (OK) for 0. */
int wtx_err_to_grpc(int code);

/* The WTX_E* code for a non-OK gRPC status code (its inverse where the
 * mapping is one to one; UNAVAILABLE maps to WTX_EUNAVAIL); 0 for OK. */
int wtx_err_from_grpc(int grpc_code);

#ifdef __cplusplus
}
#endif
#endif /* WTX_ERROR_H */
