/* gRPC server reflection, v1 and v1alpha, over wtx__rpc (see services.h).
 *
 * The two versions declare the same messages with the same field numbers, so
 * their wire bytes are identical: one handler serves both, reading a v1alpha
 * request as v1 (re-decoded from its bytes) and answering in v1, re-decoded
 * as v1alpha for that service. */
#include <stdlib.h>
#include <string.h>

#include "google/protobuf/descriptor.pb-c.h"
#include "grpc/reflection/v1/reflection.grpc-c.h"
#include "grpc/reflection/v1alpha/reflection.grpc-c.h"
#include "rpc/services.h"

#define REQ(x) GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_##x
#define RESP(x) GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_##x

typedef Grpc__Reflection__V1__ServerReflectionRequest Request;
typedef Grpc__Reflection__V1__ServerReflectionResponse Response;

/* The embedded file named name, or defining symbol, among the files of every
 * service of srv and their imports; NULL when none. */
static const wtx__rpc_file_blob *find_blob(const wtx__rpc_server *srv,
                                          const char *name, const char *symbol) {
  for (size_t i = 0; i < wtx__rpc_server_service_count(srv); i++) {
    const wtx__rpc_file *f = wtx__rpc_server_service(srv, i)->file;
    for (size_t j = 0; f != NULL && j < f->n_blobs; j++) {
      const wtx__rpc_file_blob *b = &f->blobs[j];
      if (name != NULL && strcmp(b->name, name) == 0) return b;
      for (size_t k = 0; symbol != NULL && k < b->n_symbols; k++)
        if (strcmp(b->symbols[k], symbol) == 0) return b;
    }
  }
  return NULL;
}

/* The file defining symbol, or (for a field or enum value) its parent. */
static const wtx__rpc_file_blob *find_symbol(const wtx__rpc_server *srv,
                                            const char *symbol) {
  char buf[1024];
  if (strlen(symbol) >= sizeof buf) return NULL;
  strcpy(buf, symbol);
  for (;;) {
    const wtx__rpc_file_blob *b = find_blob(srv, NULL, buf);
    if (b != NULL) return b;
    char *dot = strrchr(buf, '.');
    if (dot == NULL) return NULL;
    *dot = '\0';
  }
}

typedef struct file_list {
  ProtobufCBinaryData *items;
  size_t n, cap;
} file_list;

/* Appends b and, recursively, every file it imports that is not listed yet.
 * Storage comes from the call's arena. */
static int add_with_imports(wtx__rpc_ctx *ctx, const wtx__rpc_server *srv,
                            file_list *l, const wtx__rpc_file_blob *b) {
  for (size_t i = 0; i < l->n; i++)
    if (l->items[i].data == b->data) return 0;
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 8;
    ProtobufCBinaryData *items = wtx__rpc_ctx_alloc(ctx, cap * sizeof *items);
    if (items == NULL) return WTX_ENOMEM;
    if (l->n > 0) memcpy(items, l->items, l->n * sizeof *items);
    l->items = items;
    l->cap = cap;
  }
  l->items[l->n].data = (uint8_t *)b->data;
  l->items[l->n].len = b->len;
  l->n++;
  Google__Protobuf__FileDescriptorProto *fd =
      google__protobuf__file_descriptor_proto__unpack(NULL, b->len, b->data);
  if (fd == NULL) return WTX_EPROTO;
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < fd->n_dependency; i++) {
    const wtx__rpc_file_blob *dep = find_blob(srv, fd->dependency[i], NULL);
    if (dep != NULL) rc = add_with_imports(ctx, srv, l, dep);
  }
  google__protobuf__file_descriptor_proto__free_unpacked(fd, NULL);
  return rc;
}

/* The list_services answer: every service the server hosts. */
static void list_services(wtx__rpc_ctx *ctx, const wtx__rpc_server *srv, Response *resp) {
  size_t n = wtx__rpc_server_service_count(srv);
  Grpc__Reflection__V1__ListServiceResponse *list = wtx__rpc_ctx_alloc(ctx, sizeof *list);
  Grpc__Reflection__V1__ServiceResponse *items = wtx__rpc_ctx_alloc(ctx, (n + 1) * sizeof *items);
  if (list == NULL || items == NULL) return;
  grpc__reflection__v1__list_service_response__init(list);
  if ((list->service = wtx__rpc_ctx_alloc(ctx, (n + 1) * sizeof *list->service)) == NULL)
    return;
  for (size_t i = 0; i < n; i++) {
    grpc__reflection__v1__service_response__init(&items[i]);
    items[i].name = (char *)wtx__rpc_server_service(srv, i)->full_name;
    list->service[i] = &items[i];
  }
  list->n_service = n;
  resp->message_response_case = RESP(LIST_SERVICES_RESPONSE);
  resp->list_services_response = list;
}

/* The file_descriptor answer: b and every file it imports. */
static void send_files(wtx__rpc_ctx *ctx, const wtx__rpc_server *srv,
                       const wtx__rpc_file_blob *b, Response *resp,
                       Grpc__Reflection__V1__ErrorResponse *err) {
  Grpc__Reflection__V1__FileDescriptorResponse *files = wtx__rpc_ctx_alloc(ctx, sizeof *files);
  file_list l = {0};
  int rc = files != NULL ? add_with_imports(ctx, srv, &l, b) : WTX_ENOMEM;
  if (rc != 0) {
    err->error_code = GRPC_STATUS_INTERNAL;
    err->error_message = wtx__rpc_ctx_strdup(ctx, wtx_strerror(rc));
    return;
  }
  grpc__reflection__v1__file_descriptor_response__init(files);
  files->file_descriptor_proto = l.items;
  files->n_file_descriptor_proto = l.n;
  resp->message_response_case = RESP(FILE_DESCRIPTOR_RESPONSE);
  resp->file_descriptor_response = files;
}

/* Fills resp for one request; the response lives in the call's arena. */
static void answer(wtx__rpc_ctx *ctx, const wtx__rpc_server *srv,
                   const Request *req, Response *resp) {
  Grpc__Reflection__V1__ErrorResponse *err =
      wtx__rpc_ctx_alloc(ctx, sizeof *err);
  Grpc__Reflection__V1__ExtensionNumberResponse *ext =
      wtx__rpc_ctx_alloc(ctx, sizeof *ext);
  if (err == NULL || ext == NULL) return;
  grpc__reflection__v1__error_response__init(err);
  grpc__reflection__v1__extension_number_response__init(ext);
  resp->valid_host = req->host;
  resp->original_request = (Request *)req;
  resp->message_response_case = RESP(ERROR_RESPONSE);
  resp->error_response = err;
  err->error_code = GRPC_STATUS_NOT_FOUND;

  const wtx__rpc_file_blob *b = NULL;
  switch (req->message_request_case) {
    case REQ(LIST_SERVICES):
      list_services(ctx, srv, resp);
      return;
    case REQ(FILE_BY_FILENAME):
      b = find_blob(srv, req->file_by_filename, NULL);
      if (b == NULL)
        err->error_message = wtx__rpc_ctx_strdup(ctx, "file not found");
      break;
    case REQ(FILE_CONTAINING_SYMBOL):
      b = find_symbol(srv, req->file_containing_symbol);
      if (b == NULL)
        err->error_message = wtx__rpc_ctx_strdup(ctx, "symbol not found");
      break;
    case REQ(ALL_EXTENSION_NUMBERS_OF_TYPE):
      if (find_symbol(srv, req->all_extension_numbers_of_type) == NULL) {
        err->error_message = wtx__rpc_ctx_strdup(ctx, "type not found");
        return;
      }
      ext->base_type_name = req->all_extension_numbers_of_type;
      resp->message_response_case = RESP(ALL_EXTENSION_NUMBERS_RESPONSE);
      resp->all_extension_numbers_response = ext;
      return;
    case REQ(FILE_CONTAINING_EXTENSION):
      err->error_message =
          wtx__rpc_ctx_strdup(ctx, "extension not found (none are declared)");
      return;
    default:
      err->error_code = GRPC_STATUS_INVALID_ARGUMENT;
      err->error_message = wtx__rpc_ctx_strdup(ctx, "message_request: not set");
      return;
  }
  if (b != NULL) send_files(ctx, srv, b, resp, err);
}

/* m re-decoded as the wire-identical message type to (m itself when it is
 * of that type already); m is consumed. NULL when out of memory. */
static ProtobufCMessage *recode(ProtobufCMessage *m,
                                const ProtobufCMessageDescriptor *to) {
  if (m->descriptor == to) return m;
  size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(len ? len : 1);
  ProtobufCMessage *r = NULL;
  if (buf != NULL) {
    protobuf_c_message_pack(m, buf);
    r = protobuf_c_message_unpack(to, NULL, len, buf);
    free(buf);
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return r;
}

static grpc_status_code reflection_info(wtx__rpc_ctx *ctx) {
  const wtx__rpc_server *srv = wtx__rpc_ctx_user(ctx);
  const ProtobufCMessageDescriptor *out_desc = wtx__rpc_ctx_method(ctx)->output;
  for (;;) {
    ProtobufCMessage *m = NULL;
    int rc = wtx__rpc_ctx_read(ctx, &m);
    if (rc == 0) return GRPC_STATUS_OK; /* the client is done */
    if (rc < 0)
      return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                                "ServerReflectionInfo: unreadable request");
    Request *req = (Request *)recode(
        m, &grpc__reflection__v1__server_reflection_request__descriptor);
    if (req == NULL)
      return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_RESOURCE_EXHAUSTED,
                                "out of memory");
    Response resp = GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__INIT;
    answer(ctx, srv, req, &resp);
    ProtobufCMessage *out = &resp.base;
    if (out_desc != resp.base.descriptor) {
      /* v1alpha: the same bytes, decoded as its own type. */
      size_t len = protobuf_c_message_get_packed_size(&resp.base);
      uint8_t *buf = wtx__rpc_ctx_alloc(ctx, len ? len : 1);
      out = buf == NULL ? NULL : protobuf_c_message_unpack(out_desc, NULL,
          protobuf_c_message_pack(&resp.base, buf), buf);
    }
    rc = out == NULL ? WTX_ENOMEM : wtx__rpc_ctx_write(ctx, out);
    if (out != NULL && out != &resp.base)
      protobuf_c_message_free_unpacked(out, NULL);
    protobuf_c_message_free_unpacked(&req->base, NULL);
    if (rc != 0) return GRPC_STATUS_OK; /* the client went away */
  }
}

static const Grpc__Reflection__V1__ServerReflection_Handlers v1_handlers = {
    .server_reflection_info = reflection_info,
};
static const Grpc__Reflection__V1alpha__ServerReflection_Handlers
    v1alpha_handlers = {
        .server_reflection_info = reflection_info,
};

int wtx__rpc_server_add_reflection(wtx__rpc_server *srv) {
  int rc = wtx__rpc_server_add_service(
      srv, &grpc__reflection__v1__server_reflection__grpc, &v1_handlers, srv);
  if (rc == 0)
    rc = wtx__rpc_server_add_service(
        srv, &grpc__reflection__v1alpha__server_reflection__grpc,
        &v1alpha_handlers, srv);
  return rc;
}
