/* wtx limits and defaults: every number the schema (proto/wtx/v1) promises,
 * named once. The worker enforces the limits (INVALID_ARGUMENT naming the
 * field and the limit); the trainer library and the CLI check them before
 * sending; a 0 on the wire selects the default. */
#ifndef WTX_LIMITS_H
#define WTX_LIMITS_H

#include <stdint.h>

/* ParamMeta.name: 1..1024 bytes. */
#define WTX_MAX_NAME_BYTES 1024
/* ParamMeta.shape: at most 8 dimensions. */
#define WTX_MAX_DIMS 8
/* UpdateInfo.params: 1..65536 parameters per chunk. */
#define WTX_MAX_CHUNK_PARAMS 65536

/* A weight version label: at most 256 bytes. FinishWeightUpdate takes an
 * empty one (the worker numbers versions); UpdateWeightVersion does not. */
#define WTX_MAX_VERSION_BYTES 256
/* AbortWeightUpdateRequest.reason: at most 1024 bytes. */
#define WTX_MAX_REASON_BYTES 1024

/* PackingParams.buffer_size_bytes: 1 KiB .. 1 TiB, default 64 MiB. */
#define WTX_MIN_BUFFER_SIZE UINT64_C(1024)
#define WTX_MAX_BUFFER_SIZE (UINT64_C(1) << 40)
#define WTX_DEFAULT_BUFFER_SIZE (UINT64_C(64) << 20)
/* PackingParams.num_buffers: 1..64, default 2. */
#define WTX_MAX_BUFFERS 64
#define WTX_DEFAULT_NUM_BUFFERS 2

/* InitInfo.timeout_ms: bound on one data-plane step, default 5 min; also
 * the client library's default call deadline. */
#define WTX_DEFAULT_TIMEOUT_MS 300000
/* InitInfo.timeout_ms: at most one hour; more is INVALID_ARGUMENT. */
#define WTX_MAX_TIMEOUT_MS 3600000
/* wtx-worker --watchdog-ms: an update idle this long is aborted. */
#define WTX_DEFAULT_WATCHDOG_MS 600000
/* wtx-worker --grace-ms: how long running calls may finish on SIGTERM. */
#define WTX_DEFAULT_GRACE_MS 5000
/* Largest gRPC message either side accepts, default 64 MiB. */
#define WTX_DEFAULT_MAX_MESSAGE_BYTES (64 << 20)
/* Replicas one wtx_client drives. */
#define WTX_MAX_WORKERS 256
/* Trainer ranks that may feed one worker at once (tcp's many senders,
 * TcpInitInfo.sender_addresses): each holds a connection and a thread. */
#define WTX_MAX_SENDERS 1024
/* wtx-worker --max-calls: gRPC calls served at once. */
#define WTX_DEFAULT_MAX_CALLS 256

/* GetWeightInfo lists at most this many parameters per response (the
 * request's limit may ask for fewer); next_offset pages through the rest. */
#define WTX_MAX_INFO_PARAMS 16384

/* NcclInitInfo.world_size: 2..65536 ranks. */
#define WTX_MAX_NCCL_WORLD_SIZE 65536

/* wtx-worker --publish-keep: published files kept, default 2. */
#define WTX_DEFAULT_PUBLISH_KEEP 2

/* The _INIT macros of the config structs (WTX_CLIENT_OPTIONS_INIT, ...):
 * every field zero, which is each field's default. C gets a designated
 * initializer; C++ (before C++20 designated initializers) gets {}. */
#ifdef __cplusplus
#define WTX__INIT(designator) {}
#else
#define WTX__INIT(designator) {designator}
#endif

#endif /* WTX_LIMITS_H */
