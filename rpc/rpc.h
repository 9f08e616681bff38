/* wtx__rpc: the runtime beneath the C stubs that protoc-gen-wtxc generates.
 *
 * gRPC ships no C stub generator; protoc-gen-wtxc emits, for every service,
 * typed wrappers over the functions below plus the tables they read
 * (wtx__rpc_service, wtx__rpc_method, wtx__rpc_file). Messages are protobuf-c
 * messages; calls go through the gRPC core C API.
 *
 * Client side: a wtx__rpc_channel talks to one server. Unary calls are blocking
 * (wtx__rpc_unary) or split in two (wtx__rpc_unary_start + wtx__rpc_unary_wait)
 * so a caller can keep a call in flight while it moves data out of band.
 * Streaming calls use wtx__rpc_stream_*.
 *
 * Server side: a wtx__rpc_server hosts services. Each accepted call runs its
 * handler on a thread of its own, so a handler may block (an UpdateWeights
 * that receives a chunk) while other calls are answered. A handler returns a
 * gRPC status code; on non-OK it sets the message with wtx__rpc_ctx_errorf.
 *
 * Functions returning int return 0 or a negative WTX_E* code (common/error.h).
 * Call failures also fill a wtx__rpc_status with the gRPC code and message. */
#ifndef WTX_RPC_RPC_H
#define WTX_RPC_RPC_H

#include <grpc/grpc.h>
#include <grpc/status.h>
#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

#include "wtx/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- descriptor tables (filled by generated code) ---- */

/* One serialized google.protobuf.FileDescriptorProto, as protoc saw it
 * (source info stripped), with the fully qualified names it defines
 * (packages + messages, enums, services, methods), for server reflection. */
typedef struct wtx__rpc_file_blob {
  const char *name; /* "wtx/v1/types.proto" */
  const uint8_t *data;
  size_t len;
  const char *const *symbols;
  size_t n_symbols;
} wtx__rpc_file_blob;

/* A generated .proto file and every file it imports, transitively; blobs are
 * in dependency order, the file itself last. */
typedef struct wtx__rpc_file {
  const char *name;
  const wtx__rpc_file_blob *blobs;
  size_t n_blobs;
} wtx__rpc_file;

typedef struct wtx__rpc_ctx wtx__rpc_ctx;

/* Generated trampolines: cast the messages and call the typed handler found
 * in the handlers struct; UNIMPLEMENTED when it is NULL. */
typedef grpc_status_code (*wtx__rpc_unary_invoke_fn)(const void *handlers,
                                                    wtx__rpc_ctx *ctx,
                                                    const ProtobufCMessage *req,
                                                    ProtobufCMessage *resp);
typedef grpc_status_code (*wtx__rpc_stream_invoke_fn)(const void *handlers,
                                                     wtx__rpc_ctx *ctx);

typedef struct wtx__rpc_method {
  const char *path; /* "/wtx.v1.WeightTransfer/GetWorldSize" */
  const char *name; /* "GetWorldSize" */
  const ProtobufCMessageDescriptor *input;
  const ProtobufCMessageDescriptor *output;
  int client_streaming;
  int server_streaming;
  wtx__rpc_unary_invoke_fn invoke_unary;   /* set when neither side streams */
  wtx__rpc_stream_invoke_fn invoke_stream; /* set otherwise */
} wtx__rpc_method;

typedef struct wtx__rpc_service {
  const char *full_name; /* "wtx.v1.WeightTransfer" */
  const wtx__rpc_method *methods;
  size_t n_methods;
  const wtx__rpc_file *file; /* the file that defines the service */
} wtx__rpc_service;

/* ---- status ---- */

/* The outcome of a call. message is NUL-terminated (truncated if longer). */
typedef struct wtx__rpc_status {
  grpc_status_code code;
  char message[1024];
} wtx__rpc_status;

/* ---- client ---- */

typedef struct wtx__rpc_channel wtx__rpc_channel;

typedef struct wtx__rpc_channel_options {
  /* Largest message sent or received, bytes; 0 keeps gRPC's defaults
   * (unlimited send, 4 MiB receive). */
  int max_message_bytes;
  /* Credentials; NULL means insecure (plaintext). Borrowed: only read during
   * wtx__rpc_channel_create. */
  grpc_channel_credentials *credentials;
} wtx__rpc_channel_options;

#define WTX__RPC_CHANNEL_OPTIONS_INIT {0, NULL}

/* The longest wait between a channel's attempts to reconnect, and the
 * longest an attempt may take (gRPC's defaults: 120 s and 20 s), ms: a
 * worker back from a partition or a restart is reached again within
 * their sum. */
#define WTX__RPC_RECONNECT_MAX_MS 1000
#define WTX__RPC_CONNECT_TIMEOUT_MS 1000

/* Connects lazily to target ("host:port", any gRPC target URI). opts may be
 * NULL. On success *out is owned by the caller until wtx__rpc_channel_destroy.
 * Calls grpc_init(); destroy balances it. */
int wtx__rpc_channel_create(const char *target,
                           const wtx__rpc_channel_options *opts,
                           wtx__rpc_channel **out);
void wtx__rpc_channel_destroy(wtx__rpc_channel *ch);
/* The underlying channel, owned by ch. */
grpc_channel *wtx__rpc_channel_grpc(wtx__rpc_channel *ch);
/* The target ch was created with, owned by ch. */
const char *wtx__rpc_channel_target(const wtx__rpc_channel *ch);
/* The wait before retrying a call on ch that failed: ms, or less once ch
 * becomes ready after it was not (reconnected). The waiting thread polls
 * gRPC meanwhile: its connection attempts progress only while some thread
 * waits in gRPC, so a plain sleep would let a reconnect time out. */
void wtx__rpc_channel_backoff(wtx__rpc_channel *ch, int64_t ms);

typedef struct wtx__rpc_metadata {
  const char *key; /* lowercase ASCII, e.g. "authorization" */
  const char *value;
} wtx__rpc_metadata;

/* Per-call options; a NULL opts means no deadline and no metadata. */
typedef struct wtx__rpc_call_options {
  /* Deadline relative to the call's start, milliseconds; 0 means none. */
  int64_t timeout_ms;
  /* Metadata sent with the call; borrowed until the call function returns
   * (for start, until wtx__rpc_unary_start returns). */
  const wtx__rpc_metadata *metadata;
  size_t n_metadata;
} wtx__rpc_call_options;

#define WTX__RPC_CALL_OPTIONS_INIT {0, NULL, 0}

/* Blocking unary call. On OK, *resp receives a message the caller frees with
 * protobuf_c_message_free_unpacked(*resp, NULL) and 0 is returned. Otherwise
 * *resp is NULL, st holds the status and the WTX_E* code mapped from it is
 * returned. st may be NULL. */
int wtx__rpc_unary(wtx__rpc_channel *ch, const wtx__rpc_method *m,
                  const ProtobufCMessage *req, ProtobufCMessage **resp,
                  const wtx__rpc_call_options *opts, wtx__rpc_status *st);

/* A unary call in flight; owned by the caller until wtx__rpc_unary_wait. */
typedef struct wtx__rpc_pending wtx__rpc_pending;

/* Sends req and returns at once. Every started call must be waited for. */
int wtx__rpc_unary_start(wtx__rpc_channel *ch, const wtx__rpc_method *m,
                        const ProtobufCMessage *req,
                        const wtx__rpc_call_options *opts, wtx__rpc_pending **out);
/* Waits for the call and frees p; results as for wtx__rpc_unary. */
int wtx__rpc_unary_wait(wtx__rpc_pending *p, ProtobufCMessage **resp,
                       wtx__rpc_status *st);
/* 1 when the call has ended (wtx__rpc_unary_wait then returns at once) with
 * *code (may be NULL) its status, else 0; never blocks. */
int wtx__rpc_unary_poll(wtx__rpc_pending *p, int *code);
/* The same, waiting at most ms milliseconds for the call to end. */
int wtx__rpc_unary_poll_within(wtx__rpc_pending *p, int ms, int *code);
/* Cancels the call (it then ends with CANCELLED); p must still be waited for.
 * Safe from any thread. */
void wtx__rpc_unary_cancel(wtx__rpc_pending *p);

/* A streaming call (client, server or bidirectional streaming); owned by the
 * caller until wtx__rpc_stream_finish. One reader and one writer thread at a
 * time. */
typedef struct wtx__rpc_stream wtx__rpc_stream;

int wtx__rpc_stream_open(wtx__rpc_channel *ch, const wtx__rpc_method *m,
                        const wtx__rpc_call_options *opts, wtx__rpc_stream **out);
/* Sends one message; WTX_EIO once the call has ended (see finish). */
int wtx__rpc_stream_send(wtx__rpc_stream *s, const ProtobufCMessage *msg);
/* Half-closes: tells the server no more messages follow. */
int wtx__rpc_stream_close_send(wtx__rpc_stream *s);
/* Receives one message: 1 with *msg set (free it with
 * protobuf_c_message_free_unpacked), 0 at the end of the stream, or a
 * negative WTX_E* code. */
int wtx__rpc_stream_recv(wtx__rpc_stream *s, ProtobufCMessage **msg);
/* Waits for the final status, fills st (may be NULL), frees s. */
int wtx__rpc_stream_finish(wtx__rpc_stream *s, wtx__rpc_status *st);

/* ---- server ---- */

typedef struct wtx__rpc_server wtx__rpc_server;

typedef struct wtx__rpc_server_options {
  /* Largest request accepted, bytes (larger: RESOURCE_EXHAUSTED); 0 keeps
   * gRPC's default of 4 MiB. */
  int max_receive_message_bytes;
  /* Largest response sent, bytes; 0: unlimited. */
  int max_send_message_bytes;
  /* Credentials; NULL means insecure. Borrowed during wtx__rpc_server_start. */
  grpc_server_credentials *credentials;
  /* Called before every handler; a non-OK return rejects the call with that
   * code (set the message with wtx__rpc_ctx_errorf). NULL: accept all. */
  grpc_status_code (*authorize)(void *auth_data, wtx__rpc_ctx *ctx);
  void *auth_data;
  /* Handler threads at once; a call beyond it is answered
   * RESOURCE_EXHAUSTED without a thread. 0: unlimited. */
  int max_calls;
} wtx__rpc_server_options;

#define WTX__RPC_SERVER_OPTIONS_INIT {0, 0, NULL, NULL, NULL, 0}

/* opts may be NULL. On success *out is owned by the caller until
 * wtx__rpc_server_destroy. */
int wtx__rpc_server_create(const wtx__rpc_server_options *opts,
                          wtx__rpc_server **out);
/* Adds a service before start. handlers points to the service's generated
 * handlers struct; handlers and user must outlive the server. A service name
 * added twice is WTX_EEXIST. */
int wtx__rpc_server_add_service(wtx__rpc_server *srv, const wtx__rpc_service *svc,
                               const void *handlers, void *user);
/* Binds addr ("host:port"; port 0 picks a free one) and starts serving.
 * *port (may be NULL) receives the bound port. */
int wtx__rpc_server_start(wtx__rpc_server *srv, const char *addr, int *port);
/* Stops accepting calls, cancels calls still running after grace_ms and waits
 * for every handler to return. Idempotent. */
void wtx__rpc_server_shutdown(wtx__rpc_server *srv, int64_t grace_ms);
/* Shuts down if needed and frees srv. */
void wtx__rpc_server_destroy(wtx__rpc_server *srv);

/* Services added to srv, in order; owned by srv. */
size_t wtx__rpc_server_service_count(const wtx__rpc_server *srv);
const wtx__rpc_service *wtx__rpc_server_service(const wtx__rpc_server *srv,
                                              size_t i);

/* ---- handler context (valid only during the handler) ---- */

/* The user pointer given to wtx__rpc_server_add_service. */
void *wtx__rpc_ctx_user(const wtx__rpc_ctx *ctx);
/* The method being served (from the service's generated table). */
const wtx__rpc_method *wtx__rpc_ctx_method(const wtx__rpc_ctx *ctx);
/* Bytes of a unary call's request as it arrived (0 for streaming calls). */
size_t wtx__rpc_ctx_request_bytes(const wtx__rpc_ctx *ctx);
/* The value of request metadata key copied into the call arena (NUL
 * terminated), or NULL when absent. */
const char *wtx__rpc_ctx_metadata(wtx__rpc_ctx *ctx, const char *key);

/* Memory that lives until the response has been sent: response fields point
 * here (or to static / longer-lived memory). Zeroed. NULL when out of memory. */
void *wtx__rpc_ctx_alloc(wtx__rpc_ctx *ctx, size_t n);
char *wtx__rpc_ctx_strdup(wtx__rpc_ctx *ctx, const char *s);

/* Records the status message (printf format) and returns code, so a handler
 * can `return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT, ...)`. */
grpc_status_code wtx__rpc_ctx_errorf(wtx__rpc_ctx *ctx, grpc_status_code code,
                                    const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Streaming handlers: read one request (1 with *msg set, freed by the caller
 * with protobuf_c_message_free_unpacked; 0 when the client half-closed;
 * negative on error) and write one response. */
int wtx__rpc_ctx_read(wtx__rpc_ctx *ctx, ProtobufCMessage **msg);
int wtx__rpc_ctx_write(wtx__rpc_ctx *ctx, const ProtobufCMessage *msg);

/* Status code name, "OK", "INVALID_ARGUMENT", ... (static). */
const char *wtx__rpc_code_name(grpc_status_code code);
/* Whether a failure with code may pass if asked again (UNAVAILABLE,
 * DEADLINE_EXCEEDED): the client retries idempotent calls on these, so a
 * server answers them only for what a retry can cure. */
int wtx__rpc_code_transient(grpc_status_code code);

#ifdef __cplusplus
}
#endif
#endif /* WTX_RPC_RPC_H */
