/* protoc-gen-wtxc: a protoc plugin that generates C gRPC stubs.
 *
 * For every file protoc asks it to generate, X.proto, it writes:
 *   X.grpc-c.h  typed client stubs (blocking, start/wait, streaming), a typed
 *               handlers struct per service, and the tables below;
 *   X.grpc-c.c  the wtx__rpc_service / wtx__rpc_method tables, server
 *               trampolines, and X.proto's serialized FileDescriptorProto plus
 *               those of its imports (for server reflection).
 * The messages themselves come from protobuf-c (protoc-gen-c, X.pb-c.h); the
 * stubs call the wtx__rpc runtime (rpc/rpc.h) over the gRPC core C API.
 *
 * Nothing here knows about wtx's own services. Names follow protobuf-c's
 * conventions, with suffixes that cannot clash with protobuf-c's own service
 * code: for service pkg.Svc, method DoIt:
 *   Pkg__Svc_Handlers                 the handlers struct, member do_it
 *   pkg__svc__grpc                    the wtx__rpc_service table
 *   pkg__svc__do_it__call / __start / __wait              unary client stubs
 *   pkg__svc__do_it__open / __send / __recv               streaming client
 *   pkg__svc__do_it__read / __write                       streaming server
 *   pkg_file_proto__file              the file's wtx__rpc_file (path-derived)
 */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "google/protobuf/compiler/plugin.pb-c.h"

typedef Google__Protobuf__FileDescriptorProto FileProto;
typedef Google__Protobuf__DescriptorProto MsgProto;
typedef Google__Protobuf__ServiceDescriptorProto SvcProto;
typedef Google__Protobuf__MethodDescriptorProto MethodProto;

/* ---- growable string ---- */

typedef struct buf {
  char *p;
  size_t n, cap;
} buf;

static void die(const char *msg) {
  fprintf(stderr, "protoc-gen-wtxc: %s\n", msg);
  exit(1);
}

static void out(buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void out(buf *b, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->cap - b->n;
    int k = vsnprintf(b->p ? b->p + b->n : NULL, room, fmt, ap);
    va_end(ap);
    if (k < 0) die("formatting failed");
    if ((size_t)k < room) {
      b->n += (size_t)k;
      return;
    }
    b->cap = (b->cap + (size_t)k + 1) * 2;
    b->p = realloc(b->p, b->cap);
    if (b->p == NULL) die("out of memory");
  }
}

static char *xstrdup(const char *s) {
  char *d = strdup(s);
  if (d == NULL) die("out of memory");
  return d;
}

/* ---- protobuf-c naming ---- */

/* "foo_bar" -> "FooBar" (protobuf-c's ToCamel). */
static void to_camel(buf *b, const char *s, size_t n) {
  int upper = 1;
  for (size_t i = 0; i < n; i++) {
    if (s[i] == '_') {
      upper = 1;
    } else if (upper) {
      out(b, "%c", toupper((unsigned char)s[i]));
      upper = 0;
    } else {
      out(b, "%c", s[i]);
    }
  }
}

/* "FooBar" -> "foo_bar" (protobuf-c's CamelToLower). */
static void camel_to_lower(buf *b, const char *s, size_t n) {
  int was_upper = 1;
  for (size_t i = 0; i < n; i++) {
    int is_upper = isupper((unsigned char)s[i]) != 0;
    if (is_upper) {
      if (!was_upper) out(b, "_");
      out(b, "%c", tolower((unsigned char)s[i]));
    } else {
      out(b, "%c", s[i]);
    }
    was_upper = is_upper;
  }
}

/* Dotted full name (leading dot allowed) -> "Pkg__Svc" (lower == 0) or
 * "pkg__svc" (lower == 1). Returns a malloc'd string. */
static char *c_name(const char *full, int lower) {
  buf b = {0};
  out(&b, "%s", "");
  const char *p = full;
  while (*p != '\0') {
    if (*p == '.') {
      p++;
      continue;
    }
    const char *e = strchr(p, '.');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (b.n > 0) out(&b, "__");
    if (lower)
      camel_to_lower(&b, p, n);
    else
      to_camel(&b, p, n);
    p += n;
  }
  return b.p;
}

static char *lower_name(const char *s) {
  buf b = {0};
  out(&b, "%s", "");
  camel_to_lower(&b, s, strlen(s));
  return b.p;
}

/* "wtx/v1/types.proto" -> "wtx_v1_types_proto" */
static char *file_ident(const char *name) {
  char *d = xstrdup(name);
  for (char *p = d; *p; p++)
    if (!isalnum((unsigned char)*p)) *p = '_';
  return d;
}

/* "wtx/v1/types.proto" -> "wtx/v1/types" */
static char *file_base(const char *name) {
  char *d = xstrdup(name);
  size_t n = strlen(d);
  if (n > 6 && strcmp(d + n - 6, ".proto") == 0) d[n - 6] = '\0';
  return d;
}

static char *qualified(const FileProto *f, const char *prefix,
                       const char *name) {
  buf b = {0};
  if (prefix != NULL && prefix[0] != '\0')
    out(&b, "%s.%s", prefix, name);
  else if (f->package != NULL && f->package[0] != '\0')
    out(&b, "%s.%s", f->package, name);
  else
    out(&b, "%s", name);
  return b.p;
}

/* ---- symbols defined by a file (for reflection's FileContainingSymbol) ---- */

typedef struct strlist {
  char **v;
  size_t n;
} strlist;

static void strlist_add(strlist *l, char *s) {
  l->v = realloc(l->v, (l->n + 1) * sizeof *l->v);
  if (l->v == NULL) die("out of memory");
  l->v[l->n++] = s;
}

static void strlist_free(strlist *l) {
  for (size_t i = 0; i < l->n; i++) free(l->v[i]);
  free(l->v);
  l->v = NULL;
  l->n = 0;
}

static void add_message_symbols(strlist *l, const FileProto *f,
                                const char *prefix, const MsgProto *m) {
  char *full = qualified(f, prefix, m->name);
  strlist_add(l, full);
  for (size_t i = 0; i < m->n_nested_type; i++)
    add_message_symbols(l, f, full, m->nested_type[i]);
  for (size_t i = 0; i < m->n_enum_type; i++)
    strlist_add(l, qualified(f, full, m->enum_type[i]->name));
}

static void file_symbols(strlist *l, const FileProto *f) {
  for (size_t i = 0; i < f->n_message_type; i++)
    add_message_symbols(l, f, NULL, f->message_type[i]);
  for (size_t i = 0; i < f->n_enum_type; i++)
    strlist_add(l, qualified(f, NULL, f->enum_type[i]->name));
  for (size_t i = 0; i < f->n_service; i++) {
    const SvcProto *s = f->service[i];
    char *full = qualified(f, NULL, s->name);
    for (size_t j = 0; j < s->n_method; j++)
      strlist_add(l, qualified(f, full, s->method[j]->name));
    strlist_add(l, full);
  }
}

/* ---- file set ---- */

typedef struct request {
  Google__Protobuf__Compiler__CodeGeneratorRequest *req;
} request;

static const FileProto *find_file(const request *r, const char *name) {
  for (size_t i = 0; i < r->req->n_proto_file; i++)
    if (strcmp(r->req->proto_file[i]->name, name) == 0)
      return r->req->proto_file[i];
  return NULL;
}

/* Marks f and everything it imports, transitively. */
static void mark_deps(const request *r, const FileProto *f, int *marks) {
  for (size_t i = 0; i < r->req->n_proto_file; i++) {
    if (r->req->proto_file[i] != f) continue;
    if (marks[i]) return;
    marks[i] = 1;
  }
  for (size_t i = 0; i < f->n_dependency; i++) {
    const FileProto *d = find_file(r, f->dependency[i]);
    if (d == NULL) die("imported file missing from the request");
    mark_deps(r, d, marks);
  }
}

/* ---- emission ---- */

/* Emits f's serialized descriptor and symbols into c, and its entry of the
 * blobs table into tbl. */
static void emit_blob(buf *c, buf *tbl, size_t idx, FileProto *f) {
  /* Reflection clients need the descriptor, not comments or locations. */
  Google__Protobuf__SourceCodeInfo *saved = f->source_code_info;
  f->source_code_info = NULL;
  size_t n = protobuf_c_message_get_packed_size(&f->base);
  uint8_t *data = malloc(n ? n : 1);
  if (data == NULL) die("out of memory");
  protobuf_c_message_pack(&f->base, data);
  f->source_code_info = saved;

  out(c, "static const uint8_t blob%zu_data[%zu] = {", idx, n ? n : 1);
  for (size_t i = 0; i < n; i++)
    out(c, "%s0x%02x,", i % 16 == 0 ? "\n    " : " ", data[i]);
  if (n == 0) out(c, "0");
  out(c, "\n};\n");
  free(data);

  strlist syms = {0};
  file_symbols(&syms, f);
  if (syms.n > 0) {
    out(c, "static const char *const blob%zu_symbols[] = {\n", idx);
    for (size_t i = 0; i < syms.n; i++) out(c, "    \"%s\",\n", syms.v[i]);
    out(c, "};\n");
  }
  out(c, "\n");
  out(tbl,
      "    {.name = \"%s\", .data = blob%zu_data, .len = sizeof blob%zu_data,\n",
      f->name, idx, idx);
  if (syms.n > 0)
    out(tbl, "     .symbols = blob%zu_symbols, .n_symbols = %zu},\n", idx, syms.n);
  else
    out(tbl, "     .symbols = NULL, .n_symbols = 0},\n");
  strlist_free(&syms);
}

static int is_unary(const MethodProto *m) {
  return !m->client_streaming && !m->server_streaming;
}

/* The C names of a service: its full proto name, its type prefix and its
 * function prefix ("wtx.v1.WeightTransfer", "Wtx__V1__WeightTransfer",
 * "wtx__v1__weight_transfer"). */
typedef struct svc_names {
  char *full, *type, *low;
} svc_names;

static svc_names svc_names_of(const FileProto *f, const SvcProto *s) {
  svc_names n = {qualified(f, NULL, s->name), NULL, NULL};
  n.type = c_name(n.full, 0);
  n.low = c_name(n.full, 1);
  return n;
}

static void svc_names_free(svc_names *n) {
  free(n->full);
  free(n->type);
  free(n->low);
}

/* The C names of a method: lower-case name, input and output types (type
 * names, or descriptor prefixes with lower = 1). */
typedef struct method_names {
  char *low, *in, *out;
} method_names;

static method_names method_names_of(const MethodProto *m, int lower) {
  return (method_names){lower_name(m->name), c_name(m->input_type, lower),
                        c_name(m->output_type, lower)};
}

static void method_names_free(method_names *n) {
  free(n->low);
  free(n->in);
  free(n->out);
}

/* The handlers struct a server fills, one member per method. */
static void emit_handlers_struct(buf *h, const svc_names *sn, const SvcProto *s) {
  out(h,
      "/* Server handlers: fill a struct, pass it to "
      "wtx__rpc_server_add_service(srv, &%s__grpc, &handlers, user).\n"
      " * A NULL member answers UNIMPLEMENTED. Unary handlers fill resp "
      "(fields pointing to\n"
      " * wtx__rpc_ctx_alloc memory or longer-lived memory) and return a status "
      "code. */\n",
      sn->low);
  out(h, "typedef struct %s_Handlers {\n", sn->type);
  for (size_t i = 0; i < s->n_method; i++) {
    const MethodProto *m = s->method[i];
    method_names mn = method_names_of(m, 0);
    out(h, "  /* rpc %s(%s%s) returns (%s%s) */\n", m->name,
        m->client_streaming ? "stream " : "", m->input_type + 1,
        m->server_streaming ? "stream " : "", m->output_type + 1);
    if (is_unary(m))
      out(h, "  grpc_status_code (*%s)(wtx__rpc_ctx *ctx, const %s *req, %s *resp);\n",
          mn.low, mn.in, mn.out);
    else
      out(h, "  grpc_status_code (*%s)(wtx__rpc_ctx *ctx);\n", mn.low);
    method_names_free(&mn);
  }
  if (s->n_method == 0) out(h, "  int unused;\n");
  out(h, "} %s_Handlers;\n\n", sn->type);
}

/* Typed client stubs of unary method i: blocking call, start and wait. */
static void emit_unary_stubs(buf *h, const char *low, const method_names *mn, size_t i) {
  out(h,
      "static inline int %s__%s__call(wtx__rpc_channel *ch, const %s *req,\n"
      "    %s **resp, const wtx__rpc_call_options *opts, wtx__rpc_status *st) {\n"
      "  ProtobufCMessage *m = NULL;\n"
      "  int rc = wtx__rpc_unary(ch, &%s__grpc.methods[%zu], &req->base, &m, opts, st);\n"
      "  *resp = (%s *)m;\n"
      "  return rc;\n"
      "}\n",
      low, mn->low, mn->in, mn->out, low, i, mn->out);
  out(h,
      "static inline int %s__%s__start(wtx__rpc_channel *ch, const %s *req,\n"
      "    const wtx__rpc_call_options *opts, wtx__rpc_pending **out) {\n"
      "  return wtx__rpc_unary_start(ch, &%s__grpc.methods[%zu], &req->base, opts, out);\n"
      "}\n",
      low, mn->low, mn->in, low, i);
  out(h,
      "static inline int %s__%s__wait(wtx__rpc_pending *p, %s **resp,\n"
      "    wtx__rpc_status *st) {\n"
      "  ProtobufCMessage *m = NULL;\n"
      "  int rc = wtx__rpc_unary_wait(p, &m, st);\n"
      "  *resp = (%s *)m;\n"
      "  return rc;\n"
      "}\n\n",
      low, mn->low, mn->out, mn->out);
}

/* Typed stubs of streaming method i: client open/send/recv, server
 * read/write. */
static void emit_stream_stubs(buf *h, const char *low, const method_names *mn, size_t i) {
  out(h,
      "static inline int %s__%s__open(wtx__rpc_channel *ch,\n"
      "    const wtx__rpc_call_options *opts, wtx__rpc_stream **out) {\n"
      "  return wtx__rpc_stream_open(ch, &%s__grpc.methods[%zu], opts, out);\n"
      "}\n",
      low, mn->low, low, i);
  out(h,
      "static inline int %s__%s__send(wtx__rpc_stream *s, const %s *msg) {\n"
      "  return wtx__rpc_stream_send(s, &msg->base);\n"
      "}\n",
      low, mn->low, mn->in);
  /* recv (client) and read (server) differ only in the call and the type. */
  const char *const rd[2][3] = {{"recv", "wtx__rpc_stream *s", "wtx__rpc_stream_recv(s"},
                                {"read", "wtx__rpc_ctx *ctx", "wtx__rpc_ctx_read(ctx"}};
  for (int k = 0; k < 2; k++) {
    const char *t = k == 0 ? mn->out : mn->in;
    out(h,
        "static inline int %s__%s__%s(%s, %s **msg) {\n"
        "  ProtobufCMessage *m = NULL;\n"
        "  int rc = %s, &m);\n"
        "  *msg = (%s *)m;\n"
        "  return rc;\n"
        "}\n",
        low, mn->low, rd[k][0], rd[k][1], t, rd[k][2], t);
  }
  out(h,
      "static inline int %s__%s__write(wtx__rpc_ctx *ctx, const %s *msg) {\n"
      "  return wtx__rpc_ctx_write(ctx, &msg->base);\n"
      "}\n\n",
      low, mn->low, mn->out);
}

static void emit_service_header(buf *h, const FileProto *f, const SvcProto *s) {
  svc_names sn = svc_names_of(f, s);
  out(h, "/* ---- service %s ---- */\n\n", sn.full);
  out(h, "extern const wtx__rpc_service %s__grpc;\n\n", sn.low);
  emit_handlers_struct(h, &sn, s);
  for (size_t i = 0; i < s->n_method; i++) {
    const MethodProto *m = s->method[i];
    method_names mn = method_names_of(m, 0);
    out(h, "/* %s.%s */\n", sn.full, m->name);
    /* The method's table entry by name, for generic callers (retrying
     * wrappers, reflection) that must not search the table by string. */
    out(h, "#define %s__%s__method (&%s__grpc.methods[%zu])\n", sn.low, mn.low, sn.low, i);
    if (is_unary(m))
      emit_unary_stubs(h, sn.low, &mn, i);
    else
      emit_stream_stubs(h, sn.low, &mn, i);
    method_names_free(&mn);
  }
  svc_names_free(&sn);
}

/* The trampoline of method m: casts the messages, calls the handler. */
static void emit_invoke(buf *c, const svc_names *sn, const MethodProto *m) {
  method_names mn = method_names_of(m, 0);
  int unary = is_unary(m);
  out(c,
      "static grpc_status_code %s__%s__invoke(const void *handlers,\n"
      "    wtx__rpc_ctx *ctx%s) {\n"
      "  const %s_Handlers *h = (const %s_Handlers *)handlers;\n"
      "  if (h->%s == NULL)\n"
      "    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNIMPLEMENTED,\n"
      "                              \"%s.%s is not implemented\");\n",
      sn->low, mn.low,
      unary ? ", const ProtobufCMessage *req, ProtobufCMessage *resp" : "",
      sn->type, sn->type, mn.low, sn->full, m->name);
  if (unary)
    out(c, "  return h->%s(ctx, (const %s *)req, (%s *)resp);\n}\n\n", mn.low, mn.in,
        mn.out);
  else
    out(c, "  return h->%s(ctx);\n}\n\n", mn.low);
  method_names_free(&mn);
}

static void emit_service_source(buf *c, const FileProto *f, const SvcProto *s,
                                const char *fid) {
  svc_names sn = svc_names_of(f, s);
  for (size_t i = 0; i < s->n_method; i++) emit_invoke(c, &sn, s->method[i]);
  out(c, "static const wtx__rpc_method %s__methods[] = {\n", sn.low);
  for (size_t i = 0; i < s->n_method; i++) {
    const MethodProto *m = s->method[i];
    method_names mn = method_names_of(m, 1);
    out(c,
        "    {.path = \"/%s/%s\",\n"
        "     .name = \"%s\",\n"
        "     .input = &%s__descriptor,\n"
        "     .output = &%s__descriptor,\n"
        "     .client_streaming = %d,\n"
        "     .server_streaming = %d,\n"
        "     .%s = %s__%s__invoke},\n",
        sn.full, m->name, m->name, mn.in, mn.out, m->client_streaming ? 1 : 0,
        m->server_streaming ? 1 : 0,
        is_unary(m) ? "invoke_unary" : "invoke_stream", sn.low, mn.low);
    method_names_free(&mn);
  }
  if (s->n_method == 0) out(c, "    {0},\n");
  out(c, "};\n\n");
  out(c,
      "const wtx__rpc_service %s__grpc = {\n"
      "    .full_name = \"%s\",\n"
      "    .methods = %s__methods,\n"
      "    .n_methods = %zu,\n"
      "    .file = &%s__file,\n"
      "};\n\n",
      sn.low, sn.full, sn.low, s->n_method, fid);
  svc_names_free(&sn);
}

static void generate(const request *r, FileProto *f,
                     Google__Protobuf__Compiler__CodeGeneratorResponse__File
                         *hf,
                     Google__Protobuf__Compiler__CodeGeneratorResponse__File
                         *cf) {
  char *base = file_base(f->name);
  char *fid = file_ident(f->name);
  char *guard = file_ident(f->name);
  for (char *p = guard; *p; p++) *p = (char)toupper((unsigned char)*p);

  buf h = {0}, c = {0};
  out(&h,
      "/* Generated by protoc-gen-wtxc from %s. DO NOT EDIT. */\n"
      "#ifndef WTXC_%s_GRPC_C_H\n"
      "#define WTXC_%s_GRPC_C_H\n\n"
      "#include \"rpc/rpc.h\"\n"
      "#include \"%s.pb-c.h\"\n\n"
      "#ifdef __cplusplus\n"
      "extern \"C\" {\n"
      "#endif\n\n"
      "/* %s and every file it imports, serialized, for server reflection. */\n"
      "extern const wtx__rpc_file %s__file;\n\n",
      f->name, guard, guard, base, f->name, fid);
  for (size_t i = 0; i < f->n_service; i++)
    emit_service_header(&h, f, f->service[i]);
  out(&h,
      "#ifdef __cplusplus\n"
      "}\n"
      "#endif\n"
      "#endif\n");

  out(&c,
      "/* Generated by protoc-gen-wtxc from %s. DO NOT EDIT. */\n"
      "#include \"%s.grpc-c.h\"\n\n"
      "#include <stdint.h>\n\n",
      f->name, base);
  int *marks = calloc(r->req->n_proto_file + 1, sizeof *marks);
  if (marks == NULL) die("out of memory");
  mark_deps(r, f, marks);
  size_t nblobs = 0;
  buf tbl = {0};
  out(&tbl, "static const wtx__rpc_file_blob blobs[] = {\n");
  for (size_t i = 0; i < r->req->n_proto_file; i++)
    if (marks[i]) emit_blob(&c, &tbl, nblobs++, r->req->proto_file[i]);
  out(&c, "%s", tbl.p);
  free(tbl.p);
  out(&c, "};\n\n");
  out(&c,
      "const wtx__rpc_file %s__file = {\n"
      "    .name = \"%s\",\n"
      "    .blobs = blobs,\n"
      "    .n_blobs = %zu,\n"
      "};\n\n",
      fid, f->name, nblobs);
  free(marks);
  for (size_t i = 0; i < f->n_service; i++)
    emit_service_source(&c, f, f->service[i], fid);

  buf name = {0};
  out(&name, "%s.grpc-c.h", base);
  hf->name = name.p;
  hf->content = h.p;
  buf cname = {0};
  out(&cname, "%s.grpc-c.c", base);
  cf->name = cname.p;
  cf->content = c.p;
  free(base);
  free(fid);
  free(guard);
}

static uint8_t *read_all(FILE *in, size_t *len) {
  size_t cap = 1 << 16, n = 0;
  uint8_t *data = malloc(cap);
  if (data == NULL) die("out of memory");
  for (;;) {
    size_t k = fread(data + n, 1, cap - n, in);
    n += k;
    if (n < cap) break;
    cap *= 2;
    data = realloc(data, cap);
    if (data == NULL) die("out of memory");
  }
  if (ferror(in)) die("cannot read the request from stdin");
  *len = n;
  return data;
}

int main(void) {
  size_t len;
  uint8_t *data = read_all(stdin, &len);
  request r;
  r.req = google__protobuf__compiler__code_generator_request__unpack(NULL, len,
                                                                     data);
  free(data);
  if (r.req == NULL) die("cannot decode the CodeGeneratorRequest");

  Google__Protobuf__Compiler__CodeGeneratorResponse resp =
      GOOGLE__PROTOBUF__COMPILER__CODE_GENERATOR_RESPONSE__INIT;
  size_t nfiles = r.req->n_file_to_generate * 2;
  Google__Protobuf__Compiler__CodeGeneratorResponse__File *files =
      calloc(nfiles ? nfiles : 1, sizeof *files);
  Google__Protobuf__Compiler__CodeGeneratorResponse__File **ptrs =
      calloc(nfiles ? nfiles : 1, sizeof *ptrs);
  if (files == NULL || ptrs == NULL) die("out of memory");
  for (size_t i = 0; i < r.req->n_file_to_generate; i++) {
    FileProto *f = (FileProto *)find_file(&r, r.req->file_to_generate[i]);
    if (f == NULL) die("file to generate missing from the request");
    google__protobuf__compiler__code_generator_response__file__init(
        &files[2 * i]);
    google__protobuf__compiler__code_generator_response__file__init(
        &files[2 * i + 1]);
    generate(&r, f, &files[2 * i], &files[2 * i + 1]);
    ptrs[2 * i] = &files[2 * i];
    ptrs[2 * i + 1] = &files[2 * i + 1];
  }
  resp.n_file = nfiles;
  resp.file = ptrs;

  size_t n = protobuf_c_message_get_packed_size(&resp.base);
  uint8_t *packed = malloc(n ? n : 1);
  if (packed == NULL) die("out of memory");
  protobuf_c_message_pack(&resp.base, packed);
  if (fwrite(packed, 1, n, stdout) != n || fflush(stdout) != 0)
    die("cannot write the CodeGeneratorResponse to stdout");
  free(packed);
  for (size_t i = 0; i < nfiles; i++) {
    free(files[i].name);
    free(files[i].content);
  }
  free(files);
  free(ptrs);
  google__protobuf__compiler__code_generator_request__free_unpacked(r.req,
                                                                    NULL);
  return 0;
}
