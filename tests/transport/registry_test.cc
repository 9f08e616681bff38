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

TEST(Registry, WireParametersTakeDefaultsAndRefuseOutOfRangeValues) {
  Wtx__V1__TcpInitInfo tcp = WTX__V1__TCP_INIT_INFO__INIT;
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  ii.backend_case = WTX__V1__INIT_INFO__BACKEND_TCP;
  ii.tcp = &tcp;
  wtx_wire_params w;
  char err[256] = "";
  ASSERT_EQ(0, wtx_wire_params_from_init(&ii, &w, err, sizeof err)) << err;
  EXPECT_EQ(WTX_DEFAULT_BUFFER_SIZE, w.buffer_size);
  EXPECT_EQ(WTX_DEFAULT_NUM_BUFFERS, (int)w.num_buffers);
  EXPECT_EQ(WTX_DEFAULT_TIMEOUT_MS, (int)w.timeout_ms);
  EXPECT_EQ(WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64, w.checksum);
  Wtx__V1__PackingParams pk = WTX__V1__PACKING_PARAMS__INIT;
  wtx_wire_params_packing(&w, &pk);
  EXPECT_EQ(w.buffer_size, pk.buffer_size_bytes);

  Wtx__V1__NcclInitInfo nccl = WTX__V1__NCCL_INIT_INFO__INIT;
  ii.backend_case = WTX__V1__INIT_INFO__BACKEND_NCCL;
  ii.nccl = &nccl;
  ASSERT_EQ(0, wtx_wire_params_from_init(&ii, &w, err, sizeof err));
  EXPECT_EQ(WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE, w.checksum);  // GPU default

  pk.buffer_size_bytes = 512;
  nccl.packing = &pk;
  EXPECT_EQ(WTX_EINVAL, wtx_wire_params_from_init(&ii, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "packing.buffer_size_bytes: 512 is outside 1024 .. 2^40"));
  pk.buffer_size_bytes = 4096;
  pk.num_buffers = 65;
  EXPECT_EQ(WTX_EINVAL, wtx_wire_params_from_init(&ii, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "packing.num_buffers: 65 is outside 1 .. 64"));
}

}  // namespace
