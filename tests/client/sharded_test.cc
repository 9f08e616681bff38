// Syncs to tensor-parallel workers (client/sharded.c): wtx-worker processes
// with --shard-rules receive and publish only their parts of a Llama-shaped
// model, a whole replica beside them the whole model; every part is checked
// against a hash the test computes from the full tensors by itself.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/client/harness.h"

namespace {

using wtxtest::EngineTest;
using wtxtest::Worker;

struct Tensor {
  std::string name;
  int dtype;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> data;
  size_t Elsize() const { return wtx_dtype_size(dtype); }
};

// embed, two layers of attention and MLP, four experts, lm_head; bf16 but
// a float32 norm and an int8 scale.
struct Llama {
  std::vector<Tensor> t;
  std::vector<wtx_memory_tensor> mem;
  uint64_t total = 0;

  explicit Llama(uint8_t seed) {
    Add("model.embed_tokens.weight", WTX_DTYPE_BFLOAT16, {96, 32}, seed);
    for (int l = 0; l < 2; l++) {
      std::string p = "model.layers." + std::to_string(l) + ".";
      Add(p + "self_attn.q_proj.weight", WTX_DTYPE_BFLOAT16, {32, 32}, seed);
      Add(p + "self_attn.k_proj.weight", WTX_DTYPE_BFLOAT16, {16, 32}, seed);
      Add(p + "self_attn.v_proj.weight", WTX_DTYPE_BFLOAT16, {16, 32}, seed);
      Add(p + "self_attn.o_proj.weight", WTX_DTYPE_BFLOAT16, {32, 32}, seed);
      Add(p + "mlp.up_proj.weight", WTX_DTYPE_BFLOAT16, {64, 32}, seed);
      Add(p + "mlp.down_proj.weight", WTX_DTYPE_BFLOAT16, {32, 64}, seed);
      Add(p + "input_layernorm.weight", WTX_DTYPE_FLOAT32, {32}, seed);
      for (int e = 0; e < 4; e++)
        Add(p + "mlp.experts." + std::to_string(e) + ".w1", WTX_DTYPE_BFLOAT16, {8, 32}, seed);
    }
    Add("model.scale", WTX_DTYPE_INT8, {3, 5}, seed);
    Add("lm_head.weight", WTX_DTYPE_BFLOAT16, {96, 32}, seed);
    for (Tensor &x : t)
      mem.push_back({x.name.c_str(), x.dtype, x.shape.data(), x.shape.size(), x.data.data(), 0});
  }
  void Add(const std::string &name, int dtype, std::vector<uint64_t> shape, uint8_t seed) {
    Tensor x{name, dtype, shape, {}};
    uint64_t n = x.Elsize();
    for (uint64_t d : shape) n *= d;
    for (uint64_t i = 0; i < n; i++)
      x.data.push_back(static_cast<uint8_t>((i * 131 + t.size() * 7) ^ seed));
    total += n;
    t.push_back(std::move(x));
  }
  wtx_source *Source() {
    wtx_source *s = nullptr;
    char e[256];
    EXPECT_EQ(0, wtx_source_memory(mem.data(), mem.size(), &s, e, sizeof e)) << e;
    return s;
  }
};

const char kRules[] =
    "# attention: heads of 8 rows; MLP; experts; vocabulary\n"
    "*.q_proj.weight dim 0 unit 8\n"
    "*.k_proj.weight dim 0 unit 8\n"
    "*.v_proj.weight dim 0 unit 8\n"
    "*.o_proj.weight dim 1 unit 8\n"
    "*.up_proj.weight dim 0\n"
    "*.down_proj.weight dim 1\n"
    "*.experts.* expert 4\n"
    "model.embed_tokens.weight dim 0\n"
    "lm_head.weight dim 0\n";

// What tensor-parallel rank r of 2 holds of x under kRules, computed here
// element by element: nothing (empty optional via found=false), or the
// bytes of rows/columns [lo, lo + len) of dim, or the whole tensor.
bool Expected(const Tensor &x, int r, std::vector<uint8_t> *out, std::vector<uint64_t> *shape) {
  auto has = [&](const char *s) { return x.name.find(s) != std::string::npos; };
  int dim = -1;
  if (has("q_proj") || has("k_proj") || has("v_proj") || has("up_proj") || has("embed") ||
      has("lm_head"))
    dim = 0;
  if (has("o_proj") || has("down_proj")) dim = 1;
  if (has("experts.")) {
    int e = x.name[x.name.find("experts.") + 8] - '0';
    if (e / 2 != r) return false;  // experts 0-1 on rank 0, 2-3 on rank 1
  }
  *shape = x.shape;
  if (dim < 0) {
    *out = x.data;
    return true;
  }
  uint64_t half = x.shape[dim] / 2, lo = half * r;  // every cut dim here is even
  (*shape)[dim] = half;
  out->clear();
  uint64_t rows = x.shape[0], cols = x.shape.size() > 1 ? x.shape[1] : 1;
  for (uint64_t i = 0; i < rows; i++)
    for (uint64_t j = 0; j < cols; j++) {
      uint64_t at = dim == 0 ? i : j;
      if (at < lo || at >= lo + half) continue;
      const uint8_t *e = &x.data[(i * cols + j) * x.Elsize()];
      out->insert(out->end(), e, e + x.Elsize());
    }
  return true;
}

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

class ShardedTest : public EngineTest {
 protected:
  Worker SpawnRank(int r, std::vector<std::string> extra = {}) {
    std::string rules = dir_ + "/rules";
    std::ofstream(rules) << kRules;
    std::vector<std::string> args = {"--shard-rules", rules, "--tp-rank", std::to_string(r),
                                     "--tp-size", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(args);
  }

  // A trainer over c and src for the backend under test, 4 KiB buffers;
  // nullptr (and a failure recorded) when it cannot start.
  wtx_trainer *Trainer(wtx_client *c, wtx_source *src, uint32_t timeout_ms) {
    std::string backend = GetParam();
    wtx_trainer_config cfg = Config(backend, 4096, 2, timeout_ms);
    wtx_trainer *t = nullptr;
    char e[2048] = "";
    EXPECT_EQ(0, wtx_trainer_init(&cfg, c, src, &t, e, sizeof e)) << e;
    return t;
  }

  // Every published tensor of w (rank r of 2, or -1: whole) against what
  // the rank should hold of model; returns the bytes it holds.
  uint64_t ExpectHolds(const Worker &w, int r, const Llama &model, const std::string &v) {
    wtx_client *c = Client({w});
    wtx_weight_info info;
    EXPECT_EQ(0, wtx_client_weight_info(c, 0, 1, &info)) << wtx_client_last_error(c);
    EXPECT_EQ(v, info.version);
    EXPECT_EQ(r < 0 ? 0u : 2u, info.tp_size);  // the rules it announces
    if (r >= 0) {
      EXPECT_EQ(static_cast<uint32_t>(r), info.tp_rank);
      EXPECT_EQ(9u, info.n_shard_rules);
    }
    std::map<std::string, const wtx_param_info *> got;
    for (size_t i = 0; i < info.n_params; i++) got[info.params[i].meta.name] = &info.params[i];
    size_t held = 0;
    for (const Tensor &x : model.t) {
      std::vector<uint8_t> bytes;
      std::vector<uint64_t> shape;
      bool holds = r < 0 ? (bytes = x.data, shape = x.shape, true) : Expected(x, r, &bytes, &shape);
      auto it = got.find(x.name);
      if (!holds) {
        EXPECT_TRUE(it == got.end()) << x.name << " is not rank " << r << "'s";
        continue;
      }
      held++;
      if (it == got.end()) {
        ADD_FAILURE() << x.name << " missing on rank " << r;
        continue;
      }
      const wtx_param_info *p = it->second;
      EXPECT_EQ(shape, std::vector<uint64_t>(p->meta.shape, p->meta.shape + p->meta.ndim))
          << x.name;
      EXPECT_EQ(1, p->has_xxh3);
      EXPECT_EQ(XXH3_64bits(bytes.data(), bytes.size()), p->xxh3) << x.name << " rank " << r;
    }
    EXPECT_EQ(held, info.num_params);
    uint64_t total = info.total_bytes;
    wtx_weight_info_free(&info);
    wtx_client_destroy(c);
    return total;
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
