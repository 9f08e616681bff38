#include "wtx/error.h"

const char *wtx_strerror(int code) {
  switch (code) {
    case 0:
      return "success";
#define XX(name, value, msg, grpc) \
  case WTX_##name:                 \
    return msg;
      WTX_ERRNO_MAP(XX)
#undef XX
  }
  return "unknown error code";
}

const char *wtx_err_name(int code) {
  switch (code) {
    case 0:
      return "WTX_OK";
#define XX(name, value, msg, grpc) \
  case WTX_##name:                 \
    return "WTX_" #name;
      WTX_ERRNO_MAP(XX)
#undef XX
  }
  return "WTX_E?";
}

int wtx_err_to_grpc(int code) {
  switch (code) {
    case 0:
      return 0;
#define XX(name, value, msg, grpc) \
  case WTX_##name:                 \
    return grpc;
      WTX_ERRNO_MAP(XX)
#undef XX
  }
  return 2; /* UNKNOWN */
}

int wtx_err_from_grpc(int grpc_code) {
  switch (grpc_code) {
    case 0:
      return 0;
    case 14: /* UNAVAILABLE is also where EIO lands: keep the transient one */
      return WTX_EUNAVAIL;
    case 8: /* RESOURCE_EXHAUSTED: size limits are what the wire reports */
      return WTX_ETOOBIG;
    case 13:
      return WTX_EINTERNAL;
  }
#define XX(name, value, msg, grpc) \
  if (grpc_code == (grpc)) return WTX_##name;
  WTX_ERRNO_MAP(XX)
#undef XX
  return WTX_EUNKNOWN;
}
