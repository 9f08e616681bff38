/* The handshake's shared wire parameters (see transport.h): InitInfo's own
 * fields resolved and checked, and the backend members' names. Pure: the
 * fuzz targets link it alone. */
#include <stdio.h>
#include <string.h>

#include "transport/transport.h"

/* The name of desc's oneof member numbered number, or NULL: only oneof
 * members name a backend (the shared fields are no members). */
static const char *member_name(const ProtobufCMessageDescriptor *desc, int number) {
  const ProtobufCFieldDescriptor *f =
      protobuf_c_message_descriptor_get_field(desc, (unsigned)number);
  return f != NULL && (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) ? f->name : NULL;
}

const char *wtx_init_case_name(int init_case) {
  return member_name(&wtx__v1__init_info__descriptor, init_case);
}

const char *wtx_update_case_name(int update_case) {
  return member_name(&wtx__v1__update_info__descriptor, update_case);
}

static int resolve_checksum(int checksum, int default_checksum, int *out) {
  switch (checksum) {
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_UNSPECIFIED:
      *out = default_checksum;
      return 0;
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE:
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64:
      *out = checksum;
      return 0;
    default:
      return WTX_EINVAL;
  }
}

int wtx_wire_params_from_init(const Wtx__V1__InitInfo *init,
                              int default_checksum, wtx_wire_params *out,
                              char *err, size_t errlen) {
  const Wtx__V1__PackingParams *pk = init->packing;
  memset(out, 0, sizeof *out);
  out->packed = pk != NULL ? pk->packed : 1;
  out->buffer_size = pk != NULL && pk->buffer_size_bytes != 0
                         ? pk->buffer_size_bytes
                         : WTX_DEFAULT_BUFFER_SIZE;
  out->num_buffers = pk != NULL && pk->num_buffers != 0
                         ? pk->num_buffers
                         : WTX_DEFAULT_NUM_BUFFERS;
  out->timeout_ms = init->timeout_ms != 0 ? init->timeout_ms : WTX_DEFAULT_TIMEOUT_MS;
  if (out->buffer_size < WTX_MIN_BUFFER_SIZE || out->buffer_size > WTX_MAX_BUFFER_SIZE) {
    snprintf(err, errlen, "packing.buffer_size_bytes: %llu is outside %llu .. 2^40",
             (unsigned long long)out->buffer_size,
             (unsigned long long)WTX_MIN_BUFFER_SIZE);
    return WTX_EINVAL;
  }
  if (out->timeout_ms > WTX_MAX_TIMEOUT_MS) {
    snprintf(err, errlen, "timeout_ms: %u is above %d (one hour)", out->timeout_ms,
             WTX_MAX_TIMEOUT_MS);
    return WTX_EINVAL;
  }
  if (out->num_buffers > WTX_MAX_BUFFERS) {
    snprintf(err, errlen, "packing.num_buffers: %u is outside 1 .. %d",
             out->num_buffers, WTX_MAX_BUFFERS);
    return WTX_EINVAL;
  }
  if (resolve_checksum(init->checksum, default_checksum, &out->checksum) != 0) {
    snprintf(err, errlen, "checksum: unknown algorithm %d", init->checksum);
    return WTX_EINVAL;
  }
  return 0;
}

void wtx_wire_params_to_init(const wtx_wire_params *wire,
                             Wtx__V1__PackingParams *pk,
                             Wtx__V1__InitInfo *init) {
  wtx__v1__packing_params__init(pk);
  pk->packed = wire->packed;
  pk->buffer_size_bytes = wire->buffer_size;
  pk->num_buffers = wire->num_buffers;
  init->packing = pk;
  init->checksum = (Wtx__V1__ChecksumAlgorithm)wire->checksum;
  init->timeout_ms = wire->timeout_ms;
}
