/* A control plane of the caller's (wtx_client_create_control in
 * wtx/client.h), for the fan-out client: the caller's four calls, init and
 * update run on a thread so the engine moves the bytes meanwhile. One call
 * runs at a time. Internal to client/. */
#ifndef WTX_CLIENT_CONTROL_H
#define WTX_CLIENT_CONTROL_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>

#include "wtx/client.h"

typedef struct wtx__control wtx__control;

int wtx__control_create(const wtx_control_ops *ops, void *self, wtx__control **out);
/* Waits for a running call, then frees ctl (NULL: no-op). */
void wtx__control_destroy(wtx__control *ctl);
/* Starts ops->init (is_update 0) or ops->update with msg, serialized now
 * (msg is not kept). WTX_ESTATE while a call runs. */
int wtx__control_begin(wtx__control *ctl, int is_update, const ProtobufCMessage *msg);
/* Waits for the started call: its result, err its message. */
int wtx__control_end(wtx__control *ctl, char *err, size_t errlen);
/* 1 when the started call has already failed; never blocks. */
int wtx__control_failed(wtx__control *ctl);
/* The synchronous calls. */
int wtx__control_start(wtx__control *ctl, int target, char *err, size_t errlen);
int wtx__control_finish(wtx__control *ctl, const char *version, char *err, size_t errlen);
void wtx__control_abort(wtx__control *ctl, const char *reason);

#endif /* WTX_CLIENT_CONTROL_H */
