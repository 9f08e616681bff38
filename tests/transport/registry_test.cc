// Backend registries: built-ins on both sides, duplicates refused, and the
// handshake's wire parameters resolved with defaults and limits.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "transport/transport.h"

namespace {

TEST(Registry, BuiltinsAreRegisteredOnBothSidesAndDuplicatesAreRefused) {
  wtx_transports_register_builtin();
  for (const char *name : {"shm", "tcp", "nccl", "cuda_ipc"}) {
    ASSERT_NE(nullptr, wtx_worker_transport_find(name)) << name;
    ASSERT_NE(nullptr, wtx_trainer_transport_find(name)) << name;
    EXPECT_STREQ(name, wtx_trainer_transport_find(name)->name);
  }
  EXPECT_EQ(WTX_EEXIST, wtx_worker_transport_register(&wtx_shm_worker_transport));
  EXPECT_EQ(WTX_EEXIST, wtx_trainer_transport_register(&wtx_tcp_trainer_transport));
  wtx_worker_transport incomplete = wtx_shm_worker_transport;
  incomplete.name = "incomplete";
  incomplete.receive = nullptr;
  EXPECT_EQ(WTX_EINVAL, wtx_worker_transport_register(&incomplete));
  EXPECT_EQ(nullptr, wtx_worker_transport_find("incomplete"));
  char names[256];
  wtx_worker_transport_names(names, sizeof names);
  EXPECT_EQ("shm, tcp, nccl, cuda_ipc", std::string(names));
}

TEST(Registry, EveryBuiltinDeclaresItsOneofMembersAndChecksumDefault) {
  wtx_transports_register_builtin();
  const struct {
    const char *name;
    int init_case, update_case, checksum;
  } want[] = {
      {"shm", WTX__V1__INIT_INFO__BACKEND_SHM, WTX__V1__UPDATE_INFO__BACKEND_SHM,
       WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64},
      {"tcp", WTX__V1__INIT_INFO__BACKEND_TCP, WTX__V1__UPDATE_INFO__BACKEND_TCP,
       WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64},
      {"nccl", WTX__V1__INIT_INFO__BACKEND_NCCL, WTX__V1__UPDATE_INFO__BACKEND_NCCL,
       WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE},
      {"cuda_ipc", WTX__V1__INIT_INFO__BACKEND_CUDA_IPC,
       WTX__V1__UPDATE_INFO__BACKEND_CUDA_IPC,
       WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE},
  };
  for (const auto &w : want) {
    const wtx_worker_transport *wt = wtx_worker_transport_find(w.name);
    const wtx_trainer_transport *tt = wtx_trainer_transport_find(w.name);
    EXPECT_EQ(w.init_case, wt->init_case) << w.name;
    EXPECT_EQ(w.init_case, tt->init_case) << w.name;
    EXPECT_EQ(w.update_case, wt->update_case) << w.name;
    EXPECT_EQ(w.update_case, tt->update_case) << w.name;
    EXPECT_EQ(w.checksum, wt->default_checksum) << w.name;
    EXPECT_EQ(w.checksum, tt->default_checksum) << w.name;
    EXPECT_STREQ(w.name, wtx_init_case_name(w.init_case));  // the schema's member name
    EXPECT_STREQ(w.name, wtx_update_case_name(w.update_case));
  }
  // Shared fields are no backend member; a case outside the oneof is refused.
  EXPECT_EQ(nullptr, wtx_init_case_name(5));
  wtx_worker_transport bad = wtx_shm_worker_transport;
  bad.name = "bad_case";
  bad.init_case = 7;
  EXPECT_EQ(WTX_EINVAL, wtx_worker_transport_register(&bad));
  // The same for UpdateInfo: layout (5) is a shared field, not a backend.
  EXPECT_EQ(nullptr, wtx_update_case_name(5));
  bad = wtx_shm_worker_transport;
  bad.name = "bad_update_case";
  bad.update_case = 5;
  EXPECT_EQ(WTX_EINVAL, wtx_worker_transport_register(&bad));
}

TEST(Registry, WireParametersTakeDefaultsAndRefuseOutOfRangeValues) {
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  wtx_wire_params w;
  char err[256] = "";
  const int xxh3 = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  const int none = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE;
  ASSERT_EQ(0, wtx_wire_params_from_init(&ii, xxh3, &w, err, sizeof err)) << err;
  EXPECT_EQ(WTX_DEFAULT_BUFFER_SIZE, w.buffer_size);
  EXPECT_EQ(WTX_DEFAULT_NUM_BUFFERS, (int)w.num_buffers);
  EXPECT_EQ(WTX_DEFAULT_TIMEOUT_MS, (int)w.timeout_ms);
  EXPECT_EQ(1, w.packed);
  EXPECT_EQ(xxh3, w.checksum);
  ASSERT_EQ(0, wtx_wire_params_from_init(&ii, none, &w, err, sizeof err));
  EXPECT_EQ(none, w.checksum);  // the backend's default (GPU: none)

  // Round trip through InitInfo's shared fields.
  Wtx__V1__PackingParams pk;
  Wtx__V1__InitInfo out = WTX__V1__INIT_INFO__INIT;
  w.buffer_size = 4096;
  w.num_buffers = 3;
  w.packed = 0;
  w.timeout_ms = 1234;
  wtx_wire_params_to_init(&w, &pk, &out);
  wtx_wire_params back;
  ASSERT_EQ(0, wtx_wire_params_from_init(&out, xxh3, &back, err, sizeof err)) << err;
  EXPECT_EQ(0, memcmp(&w, &back, sizeof w));

  pk = WTX__V1__PACKING_PARAMS__INIT;
  ii.packing = &pk;
  pk.buffer_size_bytes = 512;
  EXPECT_EQ(WTX_EINVAL, wtx_wire_params_from_init(&ii, none, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "packing.buffer_size_bytes: 512 is outside 1024 .. 2^40"));
  pk.buffer_size_bytes = 4096;
  pk.num_buffers = 65;
  EXPECT_EQ(WTX_EINVAL, wtx_wire_params_from_init(&ii, none, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "packing.num_buffers: 65 is outside 1 .. 64"));
  pk.num_buffers = 2;
  ii.timeout_ms = WTX_MAX_TIMEOUT_MS + 1;  // more than an hour
  EXPECT_EQ(WTX_EINVAL, wtx_wire_params_from_init(&ii, none, &w, err, sizeof err));
  EXPECT_STREQ("timeout_ms: 3600001 is above 3600000 (one hour)", err);
  ii.timeout_ms = WTX_MAX_TIMEOUT_MS;
  EXPECT_EQ(0, wtx_wire_params_from_init(&ii, none, &w, err, sizeof err)) << err;
  ii.checksum = (Wtx__V1__ChecksumAlgorithm)9;
  EXPECT_EQ(WTX_EINVAL, wtx_wire_params_from_init(&ii, none, &w, err, sizeof err));
  EXPECT_STREQ("checksum: unknown algorithm 9", err);
}

}  // namespace
