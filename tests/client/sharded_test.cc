// Syncs to tensor-parallel workers (client/sharded.c): wtx-worker processes
// with --shard-rules receive and publish only their parts of a Llama-shaped
// model, a whole replica beside them the whole model; every part is checked
// against a hash the test computes from the full tensors by itself.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/client/llama.h"

namespace {

using wtxtest::Llama;
using wtxtest::Tensor;
using wtxtest::Worker;

// Progress as the caller sees it: one sum over every group, never going
// back, ending at the total.
struct Progress {
  uint64_t done = 0, total = 0;
  int calls = 0, backwards = 0;
  static void Fn(void *arg, uint64_t done, uint64_t total) {
    auto *p = static_cast<Progress *>(arg);
    p->backwards += done < p->done;
    p->done = done;
    p->total = total;
    p->calls++;
  }
};

class ShardedTest : public wtxtest::ShardedFixture {
 protected:
  // A trainer over c and src for the backend under test, 4 KiB buffers;
  // nullptr (and a failure recorded) when it cannot start.
  wtx_trainer *Trainer(wtx_client *c, wtx_source *src, uint32_t timeout_ms,
                       int delta = WTX_DELTA_OFF) {
    std::string backend = GetParam();
    wtx_trainer_config cfg = Config(backend, 4096, 2, timeout_ms);
    cfg.delta = delta;
    wtx_trainer *t = nullptr;
    char e[2048] = "";
    EXPECT_EQ(0, wtx_trainer_init(&cfg, c, src, &t, e, sizeof e)) << e;
    return t;
  }

  void DeltaSendsOnlyChangedParts(int mode);

  // Llama(1) to two tensor-parallel workers and a whole replica through a
  // trainer of delta mode (StandUp); its trainer, client and source go
  // with it.
  struct DeltaStand {
    Llama model{1};
    Worker r0, r1, whole;
    wtx_client *c = nullptr;
    wtx_source *src = nullptr;
    wtx_trainer *t = nullptr;
    ~DeltaStand() {
      if (t != nullptr) wtx_trainer_shutdown(t);
      wtx_client_destroy(c);
      wtx_source_destroy(src);
    }
  };
  // Starts s's workers and trainer, and sends its first sync as v (res).
  void StandUp(DeltaStand *s, int mode, const char *v, wtx_send_result *res) {
    s->r0 = SpawnRank(0);
    s->r1 = SpawnRank(1);
    s->whole = Spawn();
    s->c = Client({s->r0, s->r1, s->whole});
    s->src = s->model.Source();
    s->t = Trainer(s->c, s->src, 60000, mode);
    ASSERT_NE(nullptr, s->t);
    ASSERT_NO_FATAL_FAILURE(Sync(s->t, v, res));
  }

  // One sync of t as version v; res: its result.
  static void Sync(wtx_trainer *t, const char *v, wtx_send_result *res) {
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = v;
    ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, res)) << wtx_trainer_last_error(t);
  }

  // Ranks 0 and 1 (workers w0, w1) each hold their parts of model as v.
  void ExpectRanksHold(const Worker &w0, const Worker &w1, const Llama &model,
                       const std::string &v) {
    ExpectHolds(w0, 0, model, v);
    ExpectHolds(w1, 1, model, v);
  }
};

TEST_P(ShardedTest, EachTensorParallelWorkerReceivesOnlyItsPartsAndAReplicaTheWhole) {
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn(), r0b = SpawnRank(0);
  std::vector<Worker> ws = {r0, r1, whole, r0b};
  wtx_client *c = Client(ws);
  for (uint8_t step = 1; step <= 2; step++) {  // the second sync names tensors by range
    Llama model(step);
    wtx_source *src = model.Source();
    std::string v = "step-" + std::to_string(step), err;
    Progress pr;
    ASSERT_EQ(0, Push(c, src, v.c_str(), 4096, 2, 60000, &err, nullptr, Progress::Fn, &pr))
        << err;
    EXPECT_GT(pr.calls, 2);
    EXPECT_EQ(0, pr.backwards);
    EXPECT_EQ(pr.total, pr.done);
    for (int i : {0, 3}) {
      uint64_t b = ExpectHolds(ws[i], 0, model, v);
      EXPECT_LE(b * 100, model.total * 55) << "rank 0 holds over 0.55x the model";
    }
    EXPECT_LE(ExpectHolds(r1, 1, model, v) * 100, model.total * 55);
    EXPECT_EQ(model.total, ExpectHolds(whole, -1, model, v));
    wtx_source_destroy(src);
  }
  wtx_client_destroy(c);
}

TEST_P(ShardedTest, AGroupThatFailsLeavesEveryWorkerOnItsPreviousVersion) {
  Llama model(1);
  wtx_source *src = model.Source();
  // Rank 1 takes at most 1 KiB per update: its group fails mid-sync.
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), small = SpawnRank(1, {"--max-model-bytes", "1024"});
  wtx_client *c = Client({r0, r1});
  std::string err;
  ASSERT_EQ(0, Push(c, src, "v1", 4096, 2, 60000, &err)) << err;
  wtx_client_destroy(c);
  Llama next(2);
  wtx_source *src2 = next.Source();
  c = Client({r0, r1, small});
  EXPECT_EQ(WTX_ETOOBIG, Push(c, src2, "v2", 4096, 2, 60000, &err));
  EXPECT_NE(std::string::npos, err.find("tensor-parallel rank 1 of 2")) << err;
  EXPECT_NE(std::string::npos, err.find("worker 2")) << err;
  ExpectHolds(r0, 0, model, "v1");
  ExpectHolds(r1, 1, model, "v1");
  wtx_client_destroy(c);
  // Without it, the next sync lands everywhere.
  c = Client({r0, r1});
  ASSERT_EQ(0, Push(c, src2, "v2", 4096, 2, 60000, &err)) << err;
  ExpectHolds(r0, 0, next, "v2");
  ExpectHolds(r1, 1, next, "v2");
  wtx_client_destroy(c);
  wtx_source_destroy(src);
  wtx_source_destroy(src2);
}

// wtx_trainer_verify (wtx push --verify) compares each worker's published
// parts with what the trainer sent them, and names the group that differs.
TEST_P(ShardedTest, VerifyComparesEveryWorkersPartsWithWhatWasSent) {
  Llama model(1), other(9);
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  wtx_client *c = Client({r0, r1});
  wtx_source *src = model.Source();
  wtx_trainer *t = Trainer(c, src, 60000);
  ASSERT_NE(nullptr, t);
  EXPECT_EQ(WTX_ESTATE, wtx_trainer_verify(t));  // nothing sent yet
  ASSERT_EQ(0, wtx_trainer_send_weights(t, nullptr, nullptr)) << wtx_trainer_last_error(t);
  EXPECT_EQ(0, wtx_trainer_verify(t)) << wtx_trainer_last_error(t);
  // Rank 1 gets another model's parts behind this trainer's back.
  wtx_client *c1 = Client({r1});
  wtx_source *src1 = other.Source();
  std::string err;
  ASSERT_EQ(0, Push(c1, src1, "other", 4096, 2, 60000, &err)) << err;
  EXPECT_EQ(WTX_ECHECKSUM, wtx_trainer_verify(t));
  EXPECT_NE(std::string::npos,
            std::string(wtx_trainer_last_error(t)).find("tensor-parallel rank 1 of 2"))
      << wtx_trainer_last_error(t);
  wtx_trainer_shutdown(t);
  wtx_client_destroy(c1);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
  wtx_source_destroy(src1);
}

// A delta to tensor-parallel workers sends each group only the parts whose
// bytes changed since what it serves: one row of q_proj in rank 0's half
// travels to rank 0 and to the whole replica (whole, or as a patch of the
// part and of the tensor), and nothing to rank 1. A new trainer learns the
// parts' hashes from the workers and sends nothing.
void ShardedTest::DeltaSendsOnlyChangedParts(int mode) {
  DeltaStand s;
  wtx_send_result res;
  ASSERT_NO_FATAL_FAILURE(StandUp(&s, mode, "v1", &res));
  Llama &model = s.model;
  EXPECT_EQ(0, res.delta);
  ASSERT_NE(nullptr, res.full_reason);
  size_t parts = res.params;
  Tensor *q = nullptr;
  for (Tensor &x : model.t)
    if (x.name == "model.layers.1.self_attn.q_proj.weight") q = &x;
  ASSERT_NE(nullptr, q);
  q->data[5] ^= 0x5a;  // row 0: rank 0's half
  ASSERT_NO_FATAL_FAILURE(Sync(s.t, "v2", &res));
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(2u, res.params);  // rank 0's half of q_proj, and the whole q_proj
  if (mode == WTX_DELTA_TENSORS) {
    EXPECT_EQ(q->data.size() / 2 + q->data.size(), res.bytes);
  } else {  // a patch of one element each
    EXPECT_EQ(2u, res.patched_params);
    EXPECT_LT(res.bytes, 64u);
  }
  EXPECT_EQ(parts - 2, res.skipped_params);
  ExpectRanksHold(s.r0, s.r1, model, "v2");
  EXPECT_EQ(model.total, ExpectHolds(s.whole, -1, model, "v2"));
  wtx_trainer_shutdown(s.t);  // a new trainer
  s.t = Trainer(s.c, s.src, 60000, mode);
  ASSERT_NE(nullptr, s.t);
  ASSERT_NO_FATAL_FAILURE(Sync(s.t, "v3", &res));
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(0u, res.params);
  EXPECT_EQ(parts, res.skipped_params);
  ExpectRanksHold(s.r0, s.r1, model, "v3");
}

// A tensor-parallel worker restarted between two deltas serves nothing: its
// group's start refuses the base, and that group sends its parts whole in
// the same sync (its send round begins after the others' hash round), while
// the other group sends its delta; the next sync is a delta everywhere.
TEST_P(ShardedTest, ARestartedTensorParallelWorkerGetsItsPartsWholeAndTheOthersADelta) {
  Llama model(1);
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  wtx_client *c = Client({r0, r1});
  wtx_source *src = model.Source();
  wtx_trainer *t = Trainer(c, src, 60000, WTX_DELTA_TENSORS);
  ASSERT_NE(nullptr, t);
  wtx_send_result res;
  ASSERT_NO_FATAL_FAILURE(Sync(t, "v1", &res));
  size_t parts = res.params;
  int port = r1.port;
  Stop(workers_[1]);
  Worker again = SpawnRank(1, {"--listen", "127.0.0.1:" + std::to_string(port)});
  ASSERT_EQ(port, again.port);
  model.t[1].data[0] ^= 1;  // layer 0's q_proj, row 0: rank 0's half
  ASSERT_NO_FATAL_FAILURE(Sync(t, "v2", &res));
  EXPECT_EQ(0, res.delta);
  ASSERT_NE(nullptr, res.full_reason);
  size_t held[2] = {0, 0};
  for (const Tensor &x : model.t)
    for (int r : {0, 1}) {
      std::vector<uint8_t> bytes;
      std::vector<uint64_t> shape;
      held[r] += wtxtest::Expected(x, r, &bytes, &shape);
    }
  ASSERT_EQ(parts, held[0] + held[1]);
  EXPECT_EQ(held[1] + 1, res.params);  // rank 1's parts whole, rank 0's changed one
  EXPECT_EQ(held[0] - 1, res.skipped_params);
  ExpectRanksHold(r0, again, model, "v2");
  model.t[1].data[0] ^= 2;
  ASSERT_NO_FATAL_FAILURE(Sync(t, "v3", &res));
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(1u, res.params);
  ExpectRanksHold(r0, again, model, "v3");
  wtx_trainer_shutdown(t);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

TEST_P(ShardedTest, ADeltaSendsEachTensorParallelWorkerOnlyItsChangedParts) {
  DeltaSendsOnlyChangedParts(WTX_DELTA_TENSORS);
}

TEST_P(ShardedTest, ADeltaOfPatchesSendsEachTensorParallelWorkerOnlyItsChangedParts) {
  DeltaSendsOnlyChangedParts(WTX_DELTA_PATCHES);
}

// Deltas of random changes from one trainer to two tensor-parallel
// workers and a whole replica: each step changes a few random tensors by
// one byte, a run of bytes or every byte, from the step before, with
// tensor deltas and with patches. After each, every worker holds exactly
// its parts, hashed by the test. Fixed seed; a failure names the changes.
TEST_P(ShardedTest, RandomDeltasKeepEveryWorkerExact) {
  std::mt19937 gen(20261207);
  for (int mode : {WTX_DELTA_TENSORS, WTX_DELTA_PATCHES}) {
    DeltaStand s;
    wtx_send_result res;
    ASSERT_NO_FATAL_FAILURE(StandUp(&s, mode, "v0", &res));
    Llama &model = s.model;
    for (int step = 1; step <= 12; step++) {
      std::string changes;
      for (int k = 1 + static_cast<int>(gen() % 12); k > 0; k--) {
        Tensor &x = model.t[gen() % model.t.size()];
        size_t n = x.data.size(), first = gen() % n, len = 1;
        int how = static_cast<int>(gen() % 4);  // a byte, a run, every byte (two in four)
        if (how == 1) len = 1 + gen() % (n - first);
        if (how >= 2) first = 0, len = n;
        for (size_t b = first; b < first + len; b++) x.data[b] ^= 0x5a;
        changes += " " + x.name + " " + std::to_string(first) + "+" + std::to_string(len);
      }
      std::string v = "r" + std::to_string(step);
      SCOPED_TRACE("mode " + std::to_string(mode) + ", " + v + ":" + changes);
      ASSERT_NO_FATAL_FAILURE(Sync(s.t, v.c_str(), &res));
      EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
      ExpectRanksHold(s.r0, s.r1, model, v);
      ExpectHolds(s.whole, -1, model, v);
    }
  }
}

// The caller's patches (vLLM's sparse_nccl shape: indices into the whole
// tensor) reach each tensor-parallel worker cut to its parts: an element
// of q_proj's row 2 only rank 0, of row 20 only rank 1, o_proj's column 3
// (dim 1) only rank 0, an expert only the rank that hosts it; every worker
// publishes the new version, even one with nothing to patch, and the
// whole replica takes every element. A patch out of bounds is refused
// before any worker starts.
TEST_P(ShardedTest, TheCallersPatchesReachEachTensorParallelWorkerCutToItsParts) {
  Llama model(1);
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  wtx_client *c = Client({r0, r1, whole});
  wtx_source *src = model.Source();
  wtx_trainer *t = Trainer(c, src, 60000);
  ASSERT_NE(nullptr, t);
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  so.version = "v1";
  ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, nullptr)) << wtx_trainer_last_error(t);
  auto find = [&](const std::string &name) -> Tensor & {
    for (Tensor &x : model.t)
      if (x.name == name) return x;
    throw std::runtime_error(name);
  };
  Tensor &q = find("model.layers.0.self_attn.q_proj.weight");  // 32 x 32, rows split
  Tensor &o = find("model.layers.0.self_attn.o_proj.weight");  // 32 x 32, columns split
  Tensor &e3 = find("model.layers.1.mlp.experts.3.w1");        // rank 1's expert
  std::vector<int32_t> qi = {2 * 32 + 7, 20 * 32 + 1}, oi = {5 * 32 + 3}, ei = {9};
  std::vector<uint16_t> qv = {0x7fc0, 0x3f80}, ov = {0x4000}, ev = {0xc000};  // a NaN too
  std::vector<wtx_patch> ps = {
      {q.name.c_str(), q.dtype, q.shape.data(), 2, WTX_DTYPE_INT32, 2, qi.data(), qv.data()},
      {o.name.c_str(), o.dtype, o.shape.data(), 2, WTX_DTYPE_INT32, 1, oi.data(), ov.data()},
      {e3.name.c_str(), e3.dtype, e3.shape.data(), 2, WTX_DTYPE_INT32, 1, ei.data(), ev.data()}};
  auto apply = [](Tensor &x, const std::vector<int32_t> &at, const std::vector<uint16_t> &v) {
    for (size_t k = 0; k < at.size(); k++) memcpy(&x.data[at[k] * 2], &v[k], 2);
  };
  // Refused whole: an index past the tensor, then a name the source lacks.
  std::vector<int32_t> far = {32 * 32};
  wtx_patch bad = ps[0];
  bad.count = 1;
  bad.indices = far.data();
  so.version = "bad";
  EXPECT_EQ(WTX_EINVAL, wtx_trainer_send_patches(t, &bad, 1, &so, nullptr));
  bad = ps[1];
  bad.name = "model.nope";
  EXPECT_EQ(WTX_EINVAL, wtx_trainer_send_patches(t, &bad, 1, &so, nullptr));
  EXPECT_NE(std::string::npos, std::string(wtx_trainer_last_error(t)).find("'model.nope'"));
  ExpectRanksHold(r0, r1, model, "v1");
  wtx_send_result res;
  so.version = "v2";
  ASSERT_EQ(0, wtx_trainer_send_patches(t, ps.data(), ps.size(), &so, &res))
      << wtx_trainer_last_error(t);
  apply(q, qi, qv);
  apply(o, oi, ov);
  apply(e3, ei, ev);
  // rank 0: q, o; rank 1: q, e3; the replica: all three.
  EXPECT_EQ(7u, res.patched_params);
  EXPECT_EQ("v2", std::string(res.version));
  ExpectRanksHold(r0, r1, model, "v2");
  EXPECT_EQ(model.total, ExpectHolds(whole, -1, model, "v2"));
  // Patches for rank 1's expert only: rank 0 publishes v3 all the same.
  so.version = "v3";
  ev[0] = 0x3f00;
  ASSERT_EQ(0, wtx_trainer_send_patches(t, &ps[2], 1, &so, &res)) << wtx_trainer_last_error(t);
  apply(e3, ei, ev);
  EXPECT_EQ(2u, res.patched_params);
  ExpectRanksHold(r0, r1, model, "v3");
  wtx_trainer_shutdown(t);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// One group stuck (its worker stopped before the sync starts) holds the
// shared pass; the others give up waiting for it (twice the data plane's
// timeout, here 1 s, well before the stuck call's own 3 s deadline, so the
// error says so), then every group is aborted and every worker keeps its
// weights.
TEST_P(ShardedTest, AStuckGroupEndsTheSyncWithinItsBoundAndNothingIsPublished) {
  Llama model(1), next(2);
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  wtx_client *c = Client({r0, r1}, 3000);
  wtx_source *src = model.Source(), *src2 = next.Source();
  std::string err;
  ASSERT_EQ(0, Push(c, src, "v1", 4096, 2, 500, &err)) << err;
  wtx_trainer *t = Trainer(c, src2, 500);
  ASSERT_NE(nullptr, t);
  kill(r1.pid, SIGSTOP);
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  so.version = "v2";
  EXPECT_NE(0, wtx_trainer_send_weights(t, &so, nullptr));
  err = wtx_trainer_last_error(t);
  EXPECT_NE(std::string::npos, err.find("another group of workers did not move past")) << err;
  EXPECT_NE(std::string::npos, err.find("it waited for tensor-parallel rank 1 of 2: worker 1"))
      << err;
  kill(r1.pid, SIGCONT);
  wtx_trainer_shutdown(t);
  ExpectHolds(r0, 0, model, "v1");
  ExpectHolds(r1, 1, model, "v1");
  wtx_client_destroy(c);
  wtx_source_destroy(src);
  wtx_source_destroy(src2);
}

INSTANTIATE_TEST_SUITE_P(HostBackends, ShardedTest, ::testing::Values("shm", "tcp"),
                         [](const auto &p) { return std::string(p.param); });

}  // namespace
