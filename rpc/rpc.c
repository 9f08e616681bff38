/* wtx__rpc runtime over the gRPC core C API. See rpc.h for the contract.
 *
 * Every client call owns a pluck completion queue, so a caller blocks only on
 * its own call. The server polls one "next" queue for new calls on a single
 * thread; each accepted call is bound to a pluck queue of its own and served
 * on a new thread, where the handler may block without stalling the others. */
#include "rpc/rpc.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/arena.h"

/* ---- shared helpers ---- */

static const char *const code_names[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *wtx__rpc_code_name(grpc_status_code code) {
  if ((unsigned)code < sizeof(code_names) / sizeof(code_names[0]))
    return code_names[code];
  return "UNKNOWN_CODE";
}

int wtx__rpc_code_transient(grpc_status_code code) {
  return code == GRPC_STATUS_UNAVAILABLE || code == GRPC_STATUS_DEADLINE_EXCEEDED;
}

static void status_set(wtx__rpc_status *st, grpc_status_code code,
                       const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void status_set(wtx__rpc_status *st, grpc_status_code code,
                       const char *fmt, ...) {
  if (st == NULL) return;
  st->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(st->message, sizeof st->message, fmt, ap);
  va_end(ap);
}

static void status_from_slice(wtx__rpc_status *st, grpc_status_code code,
                              grpc_slice details) {
  if (st == NULL) return;
  size_t n = GRPC_SLICE_LENGTH(details);
  if (n >= sizeof st->message) n = sizeof st->message - 1;
  st->code = code;
  memcpy(st->message, GRPC_SLICE_START_PTR(details), n);
  st->message[n] = '\0';
}

/* Packs msg into a new byte buffer; NULL when out of memory. */
static grpc_byte_buffer *pack(const ProtobufCMessage *msg) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  grpc_slice s = grpc_slice_malloc(n);
  protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

/* Unpacks bb as desc with allocator (NULL: malloc); NULL when it does not
 * decode. */
static ProtobufCMessage *unpack(const ProtobufCMessageDescriptor *desc,
                                grpc_byte_buffer *bb, ProtobufCAllocator *allocator) {
  grpc_byte_buffer_reader r;
  if (!grpc_byte_buffer_reader_init(&r, bb)) return NULL;
  grpc_slice s = grpc_byte_buffer_reader_readall(&r);
  grpc_byte_buffer_reader_destroy(&r);
  ProtobufCMessage *m = protobuf_c_message_unpack(
      desc, allocator, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  grpc_slice_unref(s);
  return m;
}

static gpr_timespec deadline_after(int64_t timeout_ms) {
  if (timeout_ms <= 0) return gpr_inf_future(GPR_CLOCK_REALTIME);
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                      gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

static grpc_event pluck(grpc_completion_queue *cq, void *tag) {
  return grpc_completion_queue_pluck(cq, tag,
                                     gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
}

static void cq_destroy(grpc_completion_queue *cq) {
  grpc_completion_queue_shutdown(cq);
  grpc_completion_queue_destroy(cq);
}

/* Request metadata converted to slices for one call. */
typedef struct md_list {
  grpc_metadata *md;
  size_t n;
} md_list;

static int md_list_init(md_list *l, const wtx__rpc_call_options *opts) {
  l->md = NULL;
  l->n = 0;
  if (opts == NULL || opts->n_metadata == 0) return 0;
  l->md = calloc(opts->n_metadata, sizeof *l->md);
  if (l->md == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < opts->n_metadata; i++) {
    l->md[i].key = grpc_slice_from_copied_string(opts->metadata[i].key);
    l->md[i].value = grpc_slice_from_copied_string(opts->metadata[i].value);
  }
  l->n = opts->n_metadata;
  return 0;
}

static void md_list_free(md_list *l) {
  for (size_t i = 0; i < l->n; i++) {
    grpc_slice_unref(l->md[i].key);
    grpc_slice_unref(l->md[i].value);
  }
  free(l->md);
  l->md = NULL;
  l->n = 0;
}

/* Appends an integer channel argument when value > 0. */
static void int_arg(grpc_arg *args, size_t *n, const char *key, int value) {
  if (value <= 0) return;
  args[*n].type = GRPC_ARG_INTEGER;
  args[*n].key = (char *)key;
  args[*n].value.integer = value;
  (*n)++;
}

/* ---- channel ---- */

struct wtx__rpc_channel {
  grpc_channel *chan;
  char *target;
};

int wtx__rpc_channel_create(const char *target,
                           const wtx__rpc_channel_options *opts,
                           wtx__rpc_channel **out) {
  *out = NULL;
  if (target == NULL || target[0] == '\0') return WTX_EINVAL;
  wtx__rpc_channel *ch = calloc(1, sizeof *ch);
  if (ch == NULL) return WTX_ENOMEM;
  ch->target = strdup(target);
  if (ch->target == NULL) {
    free(ch);
    return WTX_ENOMEM;
  }
  grpc_init();
  grpc_arg args[6];
  size_t nargs = 0;
  int max = opts != NULL ? opts->max_message_bytes : 0;
  int_arg(args, &nargs, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max);
  int_arg(args, &nargs, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max);
  /* A trainer talks to a handful of workers and must reach one again as
   * soon as it is back (an update undone elsewhere is still to undo
   * there): reconnect attempts stay close together, and one to a worker
   * that died mid-connection gives up soon (rpc.h). */
  int_arg(args, &nargs, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  int_arg(args, &nargs, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, WTX__RPC_RECONNECT_MAX_MS);
  int_arg(args, &nargs, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, WTX__RPC_CONNECT_TIMEOUT_MS);
  /* Connections of its own: with gRPC's process-wide pool, a new channel
   * to a worker that just restarted inherits another channel's failed
   * attempts and fails its first call at once, though the worker is up. */
  int_arg(args, &nargs, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  grpc_channel_args cargs = {nargs, args};
  grpc_channel_credentials *creds =
      opts != NULL ? opts->credentials : NULL;
  grpc_channel_credentials *insecure = NULL;
  if (creds == NULL) creds = insecure = grpc_insecure_credentials_create();
  ch->chan = grpc_channel_create(target, creds, &cargs);
  if (insecure != NULL) grpc_channel_credentials_release(insecure);
  if (ch->chan == NULL) {
    free(ch->target);
    free(ch);
    grpc_shutdown();
    return WTX_EINVAL;
  }
  *out = ch;
  return 0;
}

void wtx__rpc_channel_destroy(wtx__rpc_channel *ch) {
  if (ch == NULL) return;
  grpc_channel_destroy(ch->chan);
  free(ch->target);
  free(ch);
  grpc_shutdown();
}

grpc_channel *wtx__rpc_channel_grpc(wtx__rpc_channel *ch) { return ch->chan; }

void wtx__rpc_channel_backoff(wtx__rpc_channel *ch, int64_t ms) {
  gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                       gpr_time_from_millis(ms, GPR_TIMESPAN));
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  grpc_connectivity_state st = grpc_channel_check_connectivity_state(ch->chan, 1);
  int was_ready = st == GRPC_CHANNEL_READY;
  for (;;) {
    /* One event per watch: a change of state, or the deadline (success 0). */
    grpc_channel_watch_connectivity_state(ch->chan, st, deadline, cq, NULL);
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type != GRPC_OP_COMPLETE || !ev.success) break;
    st = grpc_channel_check_connectivity_state(ch->chan, 1);
    if (st == GRPC_CHANNEL_READY && !was_ready) break;
    was_ready = st == GRPC_CHANNEL_READY;
  }
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
}

const char *wtx__rpc_channel_target(const wtx__rpc_channel *ch) {
  return ch->target;
}

/* ---- client calls ---- */

/* What every client call holds, unary or streaming: its queue, the call,
 * the metadata sent and received, and the final status. */
typedef struct call_core {
  const wtx__rpc_method *method;
  grpc_completion_queue *cq;
  grpc_call *call;
  md_list md;
  grpc_metadata_array initial_md;
  grpc_metadata_array trailing_md;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
} call_core;

/* Creates the call of m on ch with opts' deadline and metadata. */
static int core_open(call_core *c, wtx__rpc_channel *ch, const wtx__rpc_method *m,
                     const wtx__rpc_call_options *opts) {
  c->method = m;
  if (md_list_init(&c->md, opts) != 0) return WTX_ENOMEM;
  c->cq = grpc_completion_queue_create_for_pluck(NULL);
  c->call = grpc_channel_create_call(
      ch->chan, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq,
      grpc_slice_from_static_string(m->path), NULL,
      deadline_after(opts != NULL ? opts->timeout_ms : 0), NULL);
  grpc_metadata_array_init(&c->initial_md);
  grpc_metadata_array_init(&c->trailing_md);
  c->details = grpc_empty_slice();
  return 0;
}

static void core_close(call_core *c) {
  grpc_call_unref(c->call);
  cq_destroy(c->cq);
  md_list_free(&c->md);
  grpc_metadata_array_destroy(&c->initial_md);
  grpc_metadata_array_destroy(&c->trailing_md);
  grpc_slice_unref(c->details);
  gpr_free((void *)c->error_string);
}

/* The ops that open a call and that collect its final status. */
static void op_send_md(call_core *c, grpc_op *op) {
  memset(op, 0, sizeof *op);
  op->op = GRPC_OP_SEND_INITIAL_METADATA;
  op->data.send_initial_metadata.count = c->md.n;
  op->data.send_initial_metadata.metadata = c->md.md;
}

static void op_recv_status(call_core *c, grpc_op *op) {
  memset(op, 0, sizeof *op);
  op->op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  op->data.recv_status_on_client.trailing_metadata = &c->trailing_md;
  op->data.recv_status_on_client.status = &c->status;
  op->data.recv_status_on_client.status_details = &c->details;
  op->data.recv_status_on_client.error_string = &c->error_string;
}

/* ---- unary client calls ---- */

struct wtx__rpc_pending {
  call_core c;
  grpc_byte_buffer *req_bb;
  grpc_byte_buffer *resp_bb;
  int start_failed;
  int finished; /* its batch completed (plucked by poll) */
};

int wtx__rpc_unary_start(wtx__rpc_channel *ch, const wtx__rpc_method *m,
                        const ProtobufCMessage *req,
                        const wtx__rpc_call_options *opts,
                        wtx__rpc_pending **out) {
  *out = NULL;
  if (req == NULL || req->descriptor != m->input) return WTX_EINVAL;
  wtx__rpc_pending *p = calloc(1, sizeof *p);
  if (p == NULL || core_open(&p->c, ch, m, opts) != 0) {
    free(p);
    return WTX_ENOMEM;
  }
  p->req_bb = pack(req);
  /* The whole exchange in one batch. */
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  op_send_md(&p->c, &ops[0]);
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = p->req_bb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &p->c.initial_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &p->resp_bb;
  op_recv_status(&p->c, &ops[5]);
  if (grpc_call_start_batch(p->c.call, ops, 6, p, NULL) != GRPC_CALL_OK)
    p->start_failed = 1;
  *out = p;
  return 0;
}

int wtx__rpc_unary_poll(wtx__rpc_pending *p, int *code) {
  return wtx__rpc_unary_poll_within(p, 0, code);
}

int wtx__rpc_unary_poll_within(wtx__rpc_pending *p, int ms, int *code) {
  if (!p->finished && !p->start_failed) {
    gpr_timespec until = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                      gpr_time_from_millis(ms > 0 ? ms : 0, GPR_TIMESPAN));
    grpc_event ev = grpc_completion_queue_pluck(p->c.cq, p, until, NULL);
    p->finished = ev.type == GRPC_OP_COMPLETE;
  }
  if (code != NULL) *code = p->start_failed ? GRPC_STATUS_INTERNAL : (int)p->c.status;
  return p->finished || p->start_failed;
}

void wtx__rpc_unary_cancel(wtx__rpc_pending *p) {
  if (p != NULL) grpc_call_cancel(p->c.call, NULL);
}

/* The response of a finished unary call, or why there is none. */
static int unary_result(wtx__rpc_pending *p, ProtobufCMessage **resp,
                        wtx__rpc_status *st) {
  const wtx__rpc_method *m = p->c.method;
  if (p->c.status != GRPC_STATUS_OK) {
    status_from_slice(st, p->c.status, p->c.details);
    return wtx_err_from_grpc(p->c.status);
  }
  if (p->resp_bb == NULL) {
    status_set(st, GRPC_STATUS_INTERNAL, "%s: OK status without a response", m->path);
    return WTX_EPROTO;
  }
  if ((*resp = unpack(m->output, p->resp_bb, NULL)) == NULL) {
    status_set(st, GRPC_STATUS_INTERNAL, "%s: response does not decode as %s",
               m->path, m->output->name);
    return WTX_EPROTO;
  }
  status_set(st, GRPC_STATUS_OK, "%s", "");
  return 0;
}

int wtx__rpc_unary_wait(wtx__rpc_pending *p, ProtobufCMessage **resp,
                       wtx__rpc_status *st) {
  *resp = NULL;
  int rc;
  if (p->start_failed) {
    status_set(st, GRPC_STATUS_INTERNAL, "%s: cannot start the call",
               p->c.method->path);
    rc = WTX_EINTERNAL;
  } else {
    if (!p->finished) pluck(p->c.cq, p);
    rc = unary_result(p, resp, st);
  }
  core_close(&p->c);
  grpc_byte_buffer_destroy(p->req_bb);
  if (p->resp_bb != NULL) grpc_byte_buffer_destroy(p->resp_bb);
  free(p);
  return rc;
}

int wtx__rpc_unary(wtx__rpc_channel *ch, const wtx__rpc_method *m,
                  const ProtobufCMessage *req, ProtobufCMessage **resp,
                  const wtx__rpc_call_options *opts, wtx__rpc_status *st) {
  wtx__rpc_pending *p;
  *resp = NULL;
  int rc = wtx__rpc_unary_start(ch, m, req, opts, &p);
  if (rc != 0) {
    status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "%s: %s", m->path,
               wtx_strerror(rc));
    return rc;
  }
  return wtx__rpc_unary_wait(p, resp, st);
}

/* ---- streaming client calls ---- */

struct wtx__rpc_stream {
  call_core c;
  int got_initial_md;
  int half_closed;
  int status_started;
  /* distinct addresses used as tags */
  char tag_send, tag_recv, tag_status, tag_close;
};

int wtx__rpc_stream_open(wtx__rpc_channel *ch, const wtx__rpc_method *m,
                        const wtx__rpc_call_options *opts,
                        wtx__rpc_stream **out) {
  *out = NULL;
  wtx__rpc_stream *s = calloc(1, sizeof *s);
  if (s == NULL || core_open(&s->c, ch, m, opts) != 0) {
    free(s);
    return WTX_ENOMEM;
  }
  /* The status is collected whenever the call ends; the metadata goes now. */
  grpc_op op;
  op_recv_status(&s->c, &op);
  if (grpc_call_start_batch(s->c.call, &op, 1, &s->tag_status, NULL) == GRPC_CALL_OK)
    s->status_started = 1;
  op_send_md(&s->c, &op);
  if (grpc_call_start_batch(s->c.call, &op, 1, &s->tag_send, NULL) == GRPC_CALL_OK)
    pluck(s->c.cq, &s->tag_send);
  *out = s;
  return 0;
}

static int stream_op(wtx__rpc_stream *s, grpc_op *ops, size_t n, void *tag) {
  if (grpc_call_start_batch(s->c.call, ops, n, tag, NULL) != GRPC_CALL_OK)
    return WTX_EIO;
  grpc_event ev = pluck(s->c.cq, tag);
  return ev.success ? 0 : WTX_EIO;
}

int wtx__rpc_stream_send(wtx__rpc_stream *s, const ProtobufCMessage *msg) {
  if (msg == NULL || msg->descriptor != s->c.method->input) return WTX_EINVAL;
  if (s->half_closed) return WTX_ESTATE;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = pack(msg);
  int rc = stream_op(s, &op, 1, &s->tag_send);
  grpc_byte_buffer_destroy(op.data.send_message.send_message);
  return rc;
}

int wtx__rpc_stream_close_send(wtx__rpc_stream *s) {
  if (s->half_closed) return 0;
  s->half_closed = 1;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  return stream_op(s, &op, 1, &s->tag_close);
}

int wtx__rpc_stream_recv(wtx__rpc_stream *s, ProtobufCMessage **msg) {
  *msg = NULL;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (!s->got_initial_md) {
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n].data.recv_initial_metadata.recv_initial_metadata = &s->c.initial_md;
    n++;
    s->got_initial_md = 1;
  }
  grpc_byte_buffer *bb = NULL;
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n].data.recv_message.recv_message = &bb;
  n++;
  int rc = stream_op(s, ops, n, &s->tag_recv);
  if (rc != 0) return rc;
  if (bb == NULL) return 0;
  *msg = unpack(s->c.method->output, bb, NULL);
  grpc_byte_buffer_destroy(bb);
  return *msg != NULL ? 1 : WTX_EPROTO;
}

int wtx__rpc_stream_finish(wtx__rpc_stream *s, wtx__rpc_status *st) {
  int rc;
  if (!s->half_closed) wtx__rpc_stream_close_send(s);
  if (!s->status_started) {
    status_set(st, GRPC_STATUS_INTERNAL, "%s: cannot start the call",
               s->c.method->path);
    rc = WTX_EINTERNAL;
  } else {
    pluck(s->c.cq, &s->tag_status);
    status_from_slice(st, s->c.status, s->c.details);
    rc = wtx_err_from_grpc(s->c.status);
  }
  core_close(&s->c);
  free(s);
  return rc;
}

/* ---- server ---- */

typedef struct service_entry {
  const wtx__rpc_service *svc;
  const void *handlers;
  void *user;
  void **registered; /* one grpc registered-method handle per method */
} service_entry;

/* A request slot: one outstanding grpc_server_request_*call. method == NULL
 * marks the slot for methods nobody registered (answered UNIMPLEMENTED). */
typedef struct slot {
  wtx__rpc_server *srv;
  const service_entry *entry;
  const wtx__rpc_method *method;
  void *registered;
  grpc_completion_queue *cq; /* bound to the call, plucked by its thread */
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  grpc_call_details details;
} slot;

struct wtx__rpc_server {
  wtx__rpc_server_options opts;
  grpc_server *server;
  grpc_completion_queue *cq;
  service_entry *entries;
  size_t n_entries;
  pthread_t poller;
  int started;
  int shut_down;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int active;  /* handler threads running (shutdown waits for them) */
  int serving; /* calls counted against max_calls: until their status is sent */
  /* Handler threads that finished a call wait a while for the next one
   * (a sync is about eight calls; a thread made for each cost a clone and
   * an 8 MB stack mapped and unmapped):
   * idle of them, woken by handoff (a call for one to take). Shutdown wakes
   * them, and waits for them to go. */
  int idle;
  slot *handoff;
  pthread_cond_t idle_cv;
  int accepting;
  int shutdown_notified; /* the server's shutdown tag has come out of cq */
  char shutdown_tag;
};

int wtx__rpc_server_create(const wtx__rpc_server_options *opts,
                          wtx__rpc_server **out) {
  *out = NULL;
  wtx__rpc_server *srv = calloc(1, sizeof *srv);
  if (srv == NULL) return WTX_ENOMEM;
  if (opts != NULL) srv->opts = *opts;
  pthread_mutex_init(&srv->mu, NULL);
  pthread_cond_init(&srv->cv, NULL);
  pthread_cond_init(&srv->idle_cv, NULL);
  grpc_init();
  grpc_arg args[2];
  size_t nargs = 0;
  int_arg(args, &nargs, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
          srv->opts.max_receive_message_bytes);
  int_arg(args, &nargs, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
          srv->opts.max_send_message_bytes);
  grpc_channel_args cargs = {nargs, args};
  srv->server = grpc_server_create(&cargs, NULL);
  srv->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(srv->server, srv->cq, NULL);
  *out = srv;
  return 0;
}

int wtx__rpc_server_add_service(wtx__rpc_server *srv, const wtx__rpc_service *svc,
                               const void *handlers, void *user) {
  if (srv->started) return WTX_ESTATE;
  if (svc == NULL || handlers == NULL) return WTX_EINVAL;
  for (size_t i = 0; i < srv->n_entries; i++)
    if (strcmp(srv->entries[i].svc->full_name, svc->full_name) == 0)
      return WTX_EEXIST;
  service_entry *e =
      realloc(srv->entries, (srv->n_entries + 1) * sizeof *srv->entries);
  if (e == NULL) return WTX_ENOMEM;
  srv->entries = e;
  service_entry *ne = &srv->entries[srv->n_entries];
  ne->svc = svc;
  ne->handlers = handlers;
  ne->user = user;
  ne->registered = calloc(svc->n_methods ? svc->n_methods : 1, sizeof(void *));
  if (ne->registered == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < svc->n_methods; i++) {
    const wtx__rpc_method *m = &svc->methods[i];
    int unary = !m->client_streaming && !m->server_streaming;
    ne->registered[i] = grpc_server_register_method(
        srv->server, m->path, NULL,
        unary ? GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER
              : GRPC_SRM_PAYLOAD_NONE,
        0);
  }
  srv->n_entries++;
  return 0;
}

size_t wtx__rpc_server_service_count(const wtx__rpc_server *srv) {
  return srv->n_entries;
}

const wtx__rpc_service *wtx__rpc_server_service(const wtx__rpc_server *srv,
                                              size_t i) {
  return i < srv->n_entries ? srv->entries[i].svc : NULL;
}

static void slot_free(slot *sl) {
  if (sl->call != NULL) grpc_call_unref(sl->call);
  if (sl->payload != NULL) grpc_byte_buffer_destroy(sl->payload);
  grpc_metadata_array_destroy(&sl->md);
  if (sl->method == NULL) grpc_call_details_destroy(&sl->details);
  cq_destroy(sl->cq);
  free(sl);
}

/* Posts a request slot for method (or for unregistered methods). */
static void slot_post(wtx__rpc_server *srv, const service_entry *e,
                      const wtx__rpc_method *m, void *registered) {
  slot *sl = calloc(1, sizeof *sl);
  if (sl == NULL) abort(); /* nothing sensible to do: the method would die */
  sl->srv = srv;
  sl->entry = e;
  sl->method = m;
  sl->registered = registered;
  sl->cq = grpc_completion_queue_create_for_pluck(NULL);
  grpc_metadata_array_init(&sl->md);
  grpc_call_error err;
  if (m != NULL) {
    int unary = !m->client_streaming && !m->server_streaming;
    err = grpc_server_request_registered_call(
        srv->server, registered, &sl->call, &sl->deadline, &sl->md,
        unary ? &sl->payload : NULL, sl->cq, srv->cq, sl);
  } else {
    grpc_call_details_init(&sl->details);
    err = grpc_server_request_call(srv->server, &sl->call, &sl->details,
                                   &sl->md, sl->cq, srv->cq, sl);
  }
  if (err != GRPC_CALL_OK) slot_free(sl);
}

/* ---- handler context ---- */

struct wtx__rpc_ctx {
  slot *sl;
  /* The call's memory: what the handler allocates (wtx__rpc_ctx_alloc) and
   * a unary call's decoded request, freed at once when the call ends (a
   * request of 40k ParamMeta decodes into 120k small pieces, which malloc
   * and free one by one would cost a third of the call). */
  wtx__arena arena;
  grpc_status_code code;
  char message[1024];
  int counted; /* in srv->serving until the final status goes */
  int sent_initial_md;
  char tag_read, tag_write, tag_final;
};

void *wtx__rpc_ctx_alloc(wtx__rpc_ctx *ctx, size_t n) {
  void *p = wtx__arena_alloc(&ctx->arena, n);
  if (p != NULL) memset(p, 0, n);
  return p;
}

static void *pb_alloc(void *ctx, size_t n) {
  return wtx__arena_alloc(&((wtx__rpc_ctx *)ctx)->arena, n);
}

static void pb_free(void *ctx, void *p) {
  (void)ctx; /* the arena frees everything when the call ends */
  (void)p;
}

char *wtx__rpc_ctx_strdup(wtx__rpc_ctx *ctx, const char *s) {
  size_t n = strlen(s) + 1;
  char *d = wtx__rpc_ctx_alloc(ctx, n);
  if (d != NULL) memcpy(d, s, n);
  return d;
}

void *wtx__rpc_ctx_user(const wtx__rpc_ctx *ctx) { return ctx->sl->entry->user; }

const wtx__rpc_method *wtx__rpc_ctx_method(const wtx__rpc_ctx *ctx) {
  return ctx->sl->method;
}

size_t wtx__rpc_ctx_request_bytes(const wtx__rpc_ctx *ctx) {
  return ctx->sl->payload != NULL ? grpc_byte_buffer_length(ctx->sl->payload) : 0;
}

const char *wtx__rpc_ctx_metadata(wtx__rpc_ctx *ctx, const char *key) {
  size_t klen = strlen(key);
  for (size_t i = 0; i < ctx->sl->md.count; i++) {
    const grpc_metadata *m = &ctx->sl->md.metadata[i];
    if (GRPC_SLICE_LENGTH(m->key) == klen &&
        memcmp(GRPC_SLICE_START_PTR(m->key), key, klen) == 0) {
      size_t n = GRPC_SLICE_LENGTH(m->value);
      char *v = wtx__rpc_ctx_alloc(ctx, n + 1);
      if (v == NULL) return NULL;
      memcpy(v, GRPC_SLICE_START_PTR(m->value), n);
      return v;
    }
  }
  return NULL;
}

grpc_status_code wtx__rpc_ctx_errorf(wtx__rpc_ctx *ctx, grpc_status_code code,
                                    const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx->message, sizeof ctx->message, fmt, ap);
  va_end(ap);
  ctx->code = code;
  return code;
}

static int ctx_batch(wtx__rpc_ctx *ctx, grpc_op *ops, size_t n, void *tag) {
  if (grpc_call_start_batch(ctx->sl->call, ops, n, tag, NULL) != GRPC_CALL_OK)
    return WTX_EIO;
  grpc_event ev = pluck(ctx->sl->cq, tag);
  return ev.success ? 0 : WTX_EIO;
}

int wtx__rpc_ctx_read(wtx__rpc_ctx *ctx, ProtobufCMessage **msg) {
  *msg = NULL;
  grpc_byte_buffer *bb = NULL;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &bb;
  int rc = ctx_batch(ctx, &op, 1, &ctx->tag_read);
  if (rc != 0) return rc;
  if (bb == NULL) return 0;
  *msg = unpack(ctx->sl->method->input, bb, NULL);
  grpc_byte_buffer_destroy(bb);
  return *msg != NULL ? 1 : WTX_EPROTO;
}

int wtx__rpc_ctx_write(wtx__rpc_ctx *ctx, const ProtobufCMessage *msg) {
  if (msg == NULL || msg->descriptor != ctx->sl->method->output)
    return WTX_EINVAL;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (!ctx->sent_initial_md) {
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ctx->sent_initial_md = 1;
  }
  ops[n].op = GRPC_OP_SEND_MESSAGE;
  ops[n].data.send_message.send_message = pack(msg);
  int rc = ctx_batch(ctx, ops, n + 1, &ctx->tag_write);
  grpc_byte_buffer_destroy(ops[n].data.send_message.send_message);
  return rc;
}

/* Sends the final status (and for unary calls the response) and waits for
 * the client's close. */
/* The call stops counting against max_calls: its client may call again as
 * soon as it has the answer, so the slot frees before the answer goes. */
static void ctx_uncount(wtx__rpc_ctx *ctx) {
  if (!ctx->counted) return;
  wtx__rpc_server *srv = ctx->sl->srv;
  pthread_mutex_lock(&srv->mu);
  srv->serving--;
  pthread_mutex_unlock(&srv->mu);
  ctx->counted = 0;
}

static void ctx_finish(wtx__rpc_ctx *ctx, const ProtobufCMessage *resp) {
  ctx_uncount(ctx);
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  grpc_byte_buffer *bb = NULL;
  if (!ctx->sent_initial_md) {
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ctx->sent_initial_md = 1;
  }
  if (resp != NULL && ctx->code == GRPC_STATUS_OK) {
    bb = pack(resp);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = bb;
    n++;
  }
  grpc_slice details = grpc_slice_from_copied_string(ctx->message);
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = ctx->code;
  ops[n].data.send_status_from_server.status_details = &details;
  n++;
  int cancelled = 0;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n].data.recv_close_on_server.cancelled = &cancelled;
  n++;
  ctx_batch(ctx, ops, n, &ctx->tag_final);
  grpc_slice_unref(details);
  if (bb != NULL) grpc_byte_buffer_destroy(bb);
}

static void serve_unary(wtx__rpc_ctx *ctx) {
  const wtx__rpc_method *m = ctx->sl->method;
  ProtobufCAllocator pb = {.alloc = pb_alloc, .free = pb_free, .allocator_data = ctx};
  ProtobufCMessage *req = NULL; /* in the call's arena */
  ProtobufCMessage *resp = NULL;
  if (ctx->sl->payload == NULL) {
    wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                       "%s: request message missing", m->path);
  } else if ((req = unpack(m->input, ctx->sl->payload, &pb)) == NULL) {
    wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                       "%s: request does not decode as %s", m->path,
                       m->input->name);
  } else if ((resp = wtx__rpc_ctx_alloc(ctx, m->output->sizeof_message)) ==
             NULL) {
    wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    protobuf_c_message_init(m->output, resp);
    ctx->code = m->invoke_unary(ctx->sl->entry->handlers, ctx, req, resp);
  }
  ctx_finish(ctx, resp);
}

static void serve_one(slot *sl) {
  wtx__rpc_server *srv = sl->srv;
  wtx__rpc_ctx ctx;
  memset(&ctx, 0, sizeof ctx);
  ctx.sl = sl;
  ctx.counted = 1;
  if (sl->method == NULL) {
    char *path = grpc_slice_to_c_string(sl->details.method);
    wtx__rpc_ctx_errorf(&ctx, GRPC_STATUS_UNIMPLEMENTED,
                       "method %s is not served here", path);
    gpr_free(path);
    ctx_finish(&ctx, NULL);
  } else if (srv->opts.authorize != NULL &&
             (ctx.code = srv->opts.authorize(srv->opts.auth_data, &ctx)) !=
                 GRPC_STATUS_OK) {
    ctx_finish(&ctx, NULL);
  } else if (sl->method->invoke_unary != NULL) {
    serve_unary(&ctx);
  } else {
    ctx.code = sl->method->invoke_stream(sl->entry->handlers, &ctx);
    ctx_finish(&ctx, NULL);
  }
  wtx__arena_free(&ctx.arena);
  ctx_uncount(&ctx);
  slot_free(sl);
}

/* Idle handler threads kept, and how long one waits for a call. */
#define MAX_IDLE 8
#define IDLE_S 10

/* The next call for a thread that has served one, or NULL when none comes
 * in IDLE_S, MAX_IDLE others wait already, or the server shuts down. Caller
 * holds mu. */
static slot *next_call(wtx__rpc_server *srv) {
  if (srv->idle >= MAX_IDLE || !srv->accepting) return NULL;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += IDLE_S;
  srv->idle++;
  while (srv->handoff == NULL && srv->accepting)
    if (pthread_cond_timedwait(&srv->idle_cv, &srv->mu, &until) != 0) break;
  srv->idle--;
  slot *sl = srv->handoff;
  srv->handoff = NULL;
  if (sl == NULL) pthread_cond_broadcast(&srv->cv); /* shutdown counts idle threads */
  return sl;
}

static void *serve_call(void *arg) {
  slot *sl = arg;
  wtx__rpc_server *srv = sl->srv;
  while (sl != NULL) {
    serve_one(sl);
    pthread_mutex_lock(&srv->mu);
    srv->active--;
    pthread_cond_broadcast(&srv->cv);
    sl = next_call(srv);
    pthread_mutex_unlock(&srv->mu);
  }
  return NULL;
}

/* Hands sl to an idle handler thread (1), or 0 when none is free. */
static int hand_off(wtx__rpc_server *srv, slot *sl) {
  pthread_mutex_lock(&srv->mu);
  int taken = srv->idle > 0 && srv->handoff == NULL;
  if (taken) {
    srv->handoff = sl;
    pthread_cond_signal(&srv->idle_cv);
  }
  pthread_mutex_unlock(&srv->mu);
  return taken;
}

/* Whether another call would pass opts.max_calls (calls not yet answered). */
static int over_capacity(wtx__rpc_server *srv) {
  pthread_mutex_lock(&srv->mu);
  int over = srv->opts.max_calls > 0 && srv->serving >= srv->opts.max_calls;
  pthread_mutex_unlock(&srv->mu);
  return over;
}

/* Answers a call beyond the cap RESOURCE_EXHAUSTED, on the poller (the
 * status batch completes at once: nothing is read from the client). */
static void refuse_busy(slot *sl) {
  wtx__rpc_ctx ctx;
  memset(&ctx, 0, sizeof ctx);
  ctx.sl = sl;
  wtx__rpc_ctx_errorf(&ctx, GRPC_STATUS_RESOURCE_EXHAUSTED,
                     "the worker serves at most %d calls at once; retry later",
                     sl->srv->opts.max_calls);
  ctx_finish(&ctx, NULL);
  slot_free(sl);
}

static void *poll_loop(void *arg) {
  wtx__rpc_server *srv = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(
        srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.tag == &srv->shutdown_tag) {
      pthread_mutex_lock(&srv->mu);
      srv->shutdown_notified = 1;
      pthread_cond_broadcast(&srv->cv);
      pthread_mutex_unlock(&srv->mu);
      continue;
    }
    slot *sl = ev.tag;
    pthread_mutex_lock(&srv->mu);
    int accepting = srv->accepting;
    pthread_mutex_unlock(&srv->mu);
    if (!ev.success || !accepting) {
      slot_free(sl);
      continue;
    }
    /* Re-arm first so the method keeps accepting while this call runs. */
    slot_post(srv, sl->entry, sl->method, sl->registered);
    if (over_capacity(srv)) {
      refuse_busy(sl);
      continue;
    }
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_mutex_lock(&srv->mu);
    srv->active++;
    srv->serving++;
    pthread_mutex_unlock(&srv->mu);
    if (hand_off(srv, sl)) {
      pthread_attr_destroy(&attr);
      continue;
    }
    if (pthread_create(&t, &attr, serve_call, sl) != 0) {
      pthread_mutex_lock(&srv->mu);
      srv->active--;
      srv->serving--;
      pthread_mutex_unlock(&srv->mu);
      grpc_call_cancel(sl->call, NULL);
      slot_free(sl);
    }
    pthread_attr_destroy(&attr);
  }
  return NULL;
}

int wtx__rpc_server_start(wtx__rpc_server *srv, const char *addr, int *port) {
  if (srv->started) return WTX_ESTATE;
  grpc_server_credentials *creds = srv->opts.credentials;
  grpc_server_credentials *insecure = NULL;
  if (creds == NULL) creds = insecure = grpc_insecure_server_credentials_create();
  int bound = grpc_server_add_http2_port(srv->server, addr, creds);
  if (insecure != NULL) grpc_server_credentials_release(insecure);
  if (bound == 0) return WTX_EIO;
  grpc_server_start(srv->server);
  srv->started = 1;
  srv->accepting = 1;
  for (size_t i = 0; i < srv->n_entries; i++)
    for (size_t j = 0; j < srv->entries[i].svc->n_methods; j++)
      slot_post(srv, &srv->entries[i], &srv->entries[i].svc->methods[j],
                srv->entries[i].registered[j]);
  slot_post(srv, NULL, NULL, NULL);
  if (pthread_create(&srv->poller, NULL, poll_loop, srv) != 0) {
    srv->accepting = 0;
    return WTX_ENOMEM;
  }
  if (port != NULL) *port = bound;
  return 0;
}

void wtx__rpc_server_shutdown(wtx__rpc_server *srv, int64_t grace_ms) {
  if (!srv->started || srv->shut_down) return;
  srv->shut_down = 1;
  pthread_mutex_lock(&srv->mu);
  srv->accepting = 0;
  pthread_cond_broadcast(&srv->idle_cv); /* idle handler threads go */
  pthread_mutex_unlock(&srv->mu);
  grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
  /* Give running handlers the grace period, then cancel what is left. */
  gpr_timespec until = deadline_after(grace_ms > 0 ? grace_ms : 1);
  struct timespec ts;
  gpr_timespec rt = gpr_convert_clock_type(until, GPR_CLOCK_REALTIME);
  ts.tv_sec = rt.tv_sec;
  ts.tv_nsec = rt.tv_nsec;
  pthread_mutex_lock(&srv->mu);
  while (srv->active > 0)
    if (pthread_cond_timedwait(&srv->cv, &srv->mu, &ts) != 0) break;
  pthread_mutex_unlock(&srv->mu);
  grpc_server_cancel_all_calls(srv->server);
  pthread_mutex_lock(&srv->mu);
  while (srv->active > 0 || srv->idle > 0 || !srv->shutdown_notified)
    pthread_cond_wait(&srv->cv, &srv->mu);
  pthread_mutex_unlock(&srv->mu);
  grpc_completion_queue_shutdown(srv->cq);
  pthread_join(srv->poller, NULL);
}

void wtx__rpc_server_destroy(wtx__rpc_server *srv) {
  if (srv == NULL) return;
  if (srv->started) wtx__rpc_server_shutdown(srv, 0);
  grpc_server_destroy(srv->server);
  if (!srv->started) grpc_completion_queue_shutdown(srv->cq);
  grpc_completion_queue_destroy(srv->cq);
  for (size_t i = 0; i < srv->n_entries; i++) free(srv->entries[i].registered);
  free(srv->entries);
  pthread_mutex_destroy(&srv->mu);
  pthread_cond_destroy(&srv->cv);
  pthread_cond_destroy(&srv->idle_cv);
  free(srv);
  grpc_shutdown();
}
