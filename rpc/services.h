/* Standard gRPC services any wtx__rpc_server can host: health checking
 * (grpc.health.v1.Health, as Kubernetes' native gRPC probes and grpcurl ask
 * it) and server reflection (grpc.reflection.v1 and v1alpha, as grpcurl,
 * Postman and Python's grpcio-reflection ask it).
 *
 * Reflection answers from the descriptors protoc-gen-wtxc embeds with every
 * generated service (wtx__rpc_service.file), imports included, so it describes
 * exactly what the server hosts without any .proto file at run time. */
#ifndef WTX_RPC_SERVICES_H
#define WTX_RPC_SERVICES_H

#include "rpc/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- health ---- */

/* Serving status of a server as grpc.health.v1 reports it. Check answers
 * for the empty service name (the whole server) and for every service added
 * to the server; any other name is NOT_FOUND. Watch streams the status and
 * every change until wtx__rpc_health_close. */
typedef struct wtx__rpc_health wtx__rpc_health;

/* Creates a health service, NOT_SERVING until wtx__rpc_health_set, and adds
 * it to srv (before wtx__rpc_server_start). *out is owned by the caller until
 * wtx__rpc_health_destroy, which must come after wtx__rpc_server_shutdown. */
int wtx__rpc_health_create(wtx__rpc_server *srv, wtx__rpc_health **out);
/* serving: 1 SERVING, 0 NOT_SERVING, for every name at once. Watchers are
 * told of a change. Safe from any thread. */
void wtx__rpc_health_set(wtx__rpc_health *h, int serving);
/* 1 when SERVING. */
int wtx__rpc_health_serving(wtx__rpc_health *h);
/* Sets NOT_SERVING and ends every Watch call (with OK), so that a server
 * shutdown need not wait for them. Later Watch calls end at once. */
void wtx__rpc_health_close(wtx__rpc_health *h);
void wtx__rpc_health_destroy(wtx__rpc_health *h);

/* ---- reflection ---- */

/* Adds grpc.reflection.v1.ServerReflection and its v1alpha twin to srv
 * (before wtx__rpc_server_start). They list every service of srv (themselves
 * included) and serve the file descriptors of those services and of the
 * files they import: by file name, by fully qualified symbol (package,
 * message, enum, service, method; a field or enum value finds its parent's
 * file). Files defining a service come with their imports, the asked file
 * first. Extensions: none are declared by proto3 files, so
 * all_extension_numbers_of_type answers an empty list for a known message
 * and file_containing_extension answers NOT_FOUND. */
int wtx__rpc_server_add_reflection(wtx__rpc_server *srv);

#ifdef __cplusplus
}
#endif
#endif /* WTX_RPC_SERVICES_H */
