// Protobuf round trips for every wtx.v1 message: each message is filled with
// non-default values in every field (every member of every oneof, in turn),
// packed, unpacked and compared field by field. The list of messages is
// checked against the schema embedded by protoc-gen-wtxc, so a message added
// to the .proto files without a round trip here fails the suite.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.pb-c.h"
#include "wtx/v1/weight_transfer.grpc-c.h"

namespace {

const ProtobufCMessageDescriptor *const kMessages[] = {
    // types.proto
    &wtx__v1__param_meta__descriptor,
    &wtx__v1__packing_params__descriptor,
    // transport.proto
    &wtx__v1__nccl_init_info__descriptor,
    &wtx__v1__cuda_ipc_init_info__descriptor,
    &wtx__v1__tcp_init_info__descriptor,
    &wtx__v1__shm_init_info__descriptor,
    &wtx__v1__nccl_update_info__descriptor,
    &wtx__v1__cuda_ipc_buffer__descriptor,
    &wtx__v1__cuda_ipc_update_info__descriptor,
    &wtx__v1__tcp_update_info__descriptor,
    &wtx__v1__shm_update_info__descriptor,
    // weight_transfer.proto
    &wtx__v1__init_info__descriptor,
    &wtx__v1__update_info__descriptor,
    &wtx__v1__init_weight_transfer_engine_request__descriptor,
    &wtx__v1__init_weight_transfer_engine_response__descriptor,
    &wtx__v1__start_weight_update_request__descriptor,
    &wtx__v1__start_weight_update_response__descriptor,
    &wtx__v1__update_weights_request__descriptor,
    &wtx__v1__update_weights_response__descriptor,
    &wtx__v1__finish_weight_update_request__descriptor,
    &wtx__v1__finish_weight_update_response__descriptor,
    &wtx__v1__abort_weight_update_request__descriptor,
    &wtx__v1__abort_weight_update_response__descriptor,
    &wtx__v1__update_weight_version_request__descriptor,
    &wtx__v1__update_weight_version_response__descriptor,
    &wtx__v1__get_weight_info_request__descriptor,
    &wtx__v1__param_info__descriptor,
    &wtx__v1__get_weight_info_response__descriptor,
    &wtx__v1__get_world_size_request__descriptor,
    &wtx__v1__get_world_size_response__descriptor,
    &wtx__v1__pause_request__descriptor,
    &wtx__v1__pause_response__descriptor,
    &wtx__v1__resume_request__descriptor,
    &wtx__v1__resume_response__descriptor,
};

// Fills every field of msg with a value derived from seed; for oneofs, sets
// the member whose position in its oneof equals variant % members.
void Fill(ProtobufCMessage *msg, unsigned seed, unsigned variant, int depth);

template <typename T>
T *At(ProtobufCMessage *m, unsigned offset) {
  return reinterpret_cast<T *>(reinterpret_cast<char *>(m) + offset);
}

size_t ScalarSize(ProtobufCType t) {
  switch (t) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT:
    case PROTOBUF_C_TYPE_ENUM:
      return 4;
    case PROTOBUF_C_TYPE_BOOL:
      return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
      return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES:
      return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE:
      return sizeof(ProtobufCMessage *);
    default:
      return 8;
  }
}

void FillValue(const ProtobufCFieldDescriptor *f, void *p, unsigned seed,
               unsigned variant, int depth) {
  unsigned v = seed * 31 + f->id;
  switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
      *static_cast<int32_t *>(p) = -static_cast<int32_t>(v % 100000) - 1;
      break;
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
      *static_cast<uint32_t *>(p) = v + 0x80000000u;
      break;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
      *static_cast<int64_t *>(p) = -static_cast<int64_t>(v) * 1000003 - 1;
      break;
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
      *static_cast<uint64_t *>(p) = (uint64_t{v} << 40) + 12345;
      break;
    case PROTOBUF_C_TYPE_FLOAT:
      *static_cast<float *>(p) = 0.5f + static_cast<float>(v);
      break;
    case PROTOBUF_C_TYPE_DOUBLE:
      *static_cast<double *>(p) = 0.25 + v;
      break;
    case PROTOBUF_C_TYPE_BOOL:
      *static_cast<protobuf_c_boolean *>(p) = 1;
      break;
    case PROTOBUF_C_TYPE_ENUM: {
      auto *e = static_cast<const ProtobufCEnumDescriptor *>(f->descriptor);
      // A non-zero value: the last one the enum declares.
      *static_cast<int *>(p) = e->values[e->n_values - 1].value;
      break;
    }
    case PROTOBUF_C_TYPE_STRING: {
      std::string s = std::string(f->name) + "-" + std::to_string(v);
      *static_cast<char **>(p) = strdup(s.c_str());
      break;
    }
    case PROTOBUF_C_TYPE_BYTES: {
      auto *b = static_cast<ProtobufCBinaryData *>(p);
      b->len = 5 + v % 7;
      b->data = static_cast<uint8_t *>(malloc(b->len));
      for (size_t i = 0; i < b->len; i++) b->data[i] = static_cast<uint8_t>(v + i);
      break;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
      auto *d = static_cast<const ProtobufCMessageDescriptor *>(f->descriptor);
      auto *m = static_cast<ProtobufCMessage *>(calloc(1, d->sizeof_message));
      protobuf_c_message_init(d, m);
      if (depth < 4) Fill(m, v, variant, depth + 1);
      *static_cast<ProtobufCMessage **>(p) = m;
      break;
    }
  }
}

void Fill(ProtobufCMessage *msg, unsigned seed, unsigned variant, int depth) {
  const ProtobufCMessageDescriptor *d = msg->descriptor;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
      // Members of one oneof share quantifier_offset.
      std::vector<const ProtobufCFieldDescriptor *> members;
      for (unsigned j = 0; j < d->n_fields; j++)
        if ((d->fields[j].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            d->fields[j].quantifier_offset == f->quantifier_offset)
          members.push_back(&d->fields[j]);
      if (members[variant % members.size()] != f) continue;
      *At<uint32_t>(msg, f->quantifier_offset) = f->id;
      FillValue(f, At<void>(msg, f->offset), seed, variant, depth);
    } else if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      const size_t n = 2;
      size_t es = ScalarSize(f->type);
      char *arr = static_cast<char *>(calloc(n, es));
      for (size_t k = 0; k < n; k++)
        FillValue(f, arr + k * es, seed + static_cast<unsigned>(k), variant,
                  depth);
      *At<size_t>(msg, f->quantifier_offset) = n;
      *At<char *>(msg, f->offset) = arr;
    } else {
      FillValue(f, At<void>(msg, f->offset), seed, variant, depth);
    }
  }
}

std::string Packed(const ProtobufCMessage *m) {
  std::string s(protobuf_c_message_get_packed_size(m), '\0');
  protobuf_c_message_pack(m, reinterpret_cast<uint8_t *>(&s[0]));
  return s;
}

// Field-by-field equality (recursing into sub-messages).
void ExpectEqual(const ProtobufCMessage *a, const ProtobufCMessage *b,
                 const std::string &path);

void ExpectValueEqual(const ProtobufCFieldDescriptor *f, const void *a,
                      const void *b, const std::string &path) {
  switch (f->type) {
    case PROTOBUF_C_TYPE_STRING:
      EXPECT_STREQ(*static_cast<char *const *>(a),
                   *static_cast<char *const *>(b))
          << path;
      break;
    case PROTOBUF_C_TYPE_BYTES: {
      auto *x = static_cast<const ProtobufCBinaryData *>(a);
      auto *y = static_cast<const ProtobufCBinaryData *>(b);
      ASSERT_EQ(x->len, y->len) << path;
      if (x->len > 0) {
        EXPECT_EQ(0, memcmp(x->data, y->data, x->len)) << path;
      }
      break;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
      auto *x = *static_cast<ProtobufCMessage *const *>(a);
      auto *y = *static_cast<ProtobufCMessage *const *>(b);
      ASSERT_EQ(x == nullptr, y == nullptr) << path;
      if (x != nullptr) ExpectEqual(x, y, path);
      break;
    }
    default:
      EXPECT_EQ(0, memcmp(a, b, ScalarSize(f->type))) << path;
  }
}

void ExpectEqual(const ProtobufCMessage *a, const ProtobufCMessage *b,
                 const std::string &path) {
  ASSERT_EQ(a->descriptor, b->descriptor) << path;
  const ProtobufCMessageDescriptor *d = a->descriptor;
  auto *ca = reinterpret_cast<const char *>(a);
  auto *cb = reinterpret_cast<const char *>(b);
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    std::string fp = path + "." + f->name;
    if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
      uint32_t qa = *reinterpret_cast<const uint32_t *>(ca + f->quantifier_offset);
      uint32_t qb = *reinterpret_cast<const uint32_t *>(cb + f->quantifier_offset);
      ASSERT_EQ(qa, qb) << fp;
      if (qa == f->id) ExpectValueEqual(f, ca + f->offset, cb + f->offset, fp);
    } else if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t na = *reinterpret_cast<const size_t *>(ca + f->quantifier_offset);
      size_t nb = *reinterpret_cast<const size_t *>(cb + f->quantifier_offset);
      ASSERT_EQ(na, nb) << fp;
      auto *arr_a = *reinterpret_cast<char *const *>(ca + f->offset);
      auto *arr_b = *reinterpret_cast<char *const *>(cb + f->offset);
      size_t es = ScalarSize(f->type);
      for (size_t k = 0; k < na; k++)
        ExpectValueEqual(f, arr_a + k * es, arr_b + k * es,
                         fp + "[" + std::to_string(k) + "]");
    } else {
      ExpectValueEqual(f, ca + f->offset, cb + f->offset, fp);
    }
  }
}

unsigned MaxOneofMembers(const ProtobufCMessageDescriptor *d) {
  unsigned most = 1;
  for (unsigned i = 0; i < d->n_fields; i++) {
    if (!(d->fields[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF)) continue;
    unsigned n = 0;
    for (unsigned j = 0; j < d->n_fields; j++)
      if ((d->fields[j].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
          d->fields[j].quantifier_offset == d->fields[i].quantifier_offset)
        n++;
    if (n > most) most = n;
  }
  return most;
}

TEST(WtxV1Messages, EveryMessageRoundTripsWithEveryFieldSet) {
  for (const ProtobufCMessageDescriptor *d : kMessages) {
    for (unsigned variant = 0; variant < MaxOneofMembers(d); variant++) {
      SCOPED_TRACE(std::string(d->name) + " variant " + std::to_string(variant));
      auto *m = static_cast<ProtobufCMessage *>(calloc(1, d->sizeof_message));
      protobuf_c_message_init(d, m);
      Fill(m, 7, variant, 0);
      std::string wire = Packed(m);
      if (d->n_fields > 0) {
        EXPECT_GT(wire.size(), 0u);
      }
      ProtobufCMessage *back = protobuf_c_message_unpack(
          d, nullptr, wire.size(), reinterpret_cast<const uint8_t *>(wire.data()));
      ASSERT_NE(nullptr, back);
      ExpectEqual(m, back, d->name);
      EXPECT_EQ(wire, Packed(back));
      protobuf_c_message_free_unpacked(back, nullptr);
      protobuf_c_message_free_unpacked(m, nullptr);
    }
  }
}

TEST(WtxV1Messages, DefaultMessagesRoundTripToDefaults) {
  for (const ProtobufCMessageDescriptor *d : kMessages) {
    auto *m = static_cast<ProtobufCMessage *>(calloc(1, d->sizeof_message));
    protobuf_c_message_init(d, m);
    std::string wire = Packed(m);
    EXPECT_EQ(0u, wire.size()) << d->name;  // proto3: defaults are not sent
    ProtobufCMessage *back = protobuf_c_message_unpack(
        d, nullptr, wire.size(), reinterpret_cast<const uint8_t *>(wire.data()));
    ASSERT_NE(nullptr, back) << d->name;
    ExpectEqual(m, back, d->name);
    protobuf_c_message_free_unpacked(back, nullptr);
    free(m);
  }
}

void CollectMessages(const std::string &prefix,
                     Google__Protobuf__DescriptorProto *m,
                     std::set<std::string> *out) {
  std::string full = prefix + "." + m->name;
  out->insert(full);
  for (size_t i = 0; i < m->n_nested_type; i++)
    CollectMessages(full, m->nested_type[i], out);
}

TEST(WtxV1Messages, RoundTripListCoversTheWholeSchema) {
  std::set<std::string> in_schema;
  const wtx_rpc_file &f = wtx_v1_weight_transfer_proto__file;
  for (size_t i = 0; i < f.n_blobs; i++) {
    auto *fd = google__protobuf__file_descriptor_proto__unpack(
        nullptr, f.blobs[i].len, f.blobs[i].data);
    ASSERT_NE(nullptr, fd);
    for (size_t j = 0; j < fd->n_message_type; j++)
      CollectMessages(fd->package, fd->message_type[j], &in_schema);
    google__protobuf__file_descriptor_proto__free_unpacked(fd, nullptr);
  }
  std::set<std::string> tested;
  for (const ProtobufCMessageDescriptor *d : kMessages) tested.insert(d->name);
  EXPECT_EQ(in_schema, tested);
}

TEST(WtxV1Messages, DecodingGarbageFailsCleanly) {
  const uint8_t garbage[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01};
  for (const ProtobufCMessageDescriptor *d : kMessages)
    EXPECT_EQ(nullptr, protobuf_c_message_unpack(d, nullptr, sizeof garbage,
                                                 garbage))
        << d->name;
}

}  // namespace
