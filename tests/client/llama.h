// The Llama-shaped model of the sharded tests (sharded_test, many_test):
// its tensors, the tensor-parallel rules of its workers, what rank r of 2
// holds of each tensor (computed here element by element, not by wtx's
// plan), and a fixture that spawns such workers and checks what they hold.
#ifndef WTX_TESTS_CLIENT_LLAMA_H
#define WTX_TESTS_CLIENT_LLAMA_H

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/client/harness.h"

namespace wtxtest {

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
    // No period: a part sent from the wrong offset never hashes the same.
    for (uint64_t i = 0; i < n; i++) {
      uint32_t h = static_cast<uint32_t>(i + 1) * 2654435761u ^
                   static_cast<uint32_t>(t.size() * 40503u + seed * 97u);
      h ^= h >> 15;
      x.data.push_back(static_cast<uint8_t>(h >> 7));
    }
    total += n;
    t.push_back(std::move(x));
  }
  // One byte of tensor name changed (a delta's change of one element).
  const Tensor *Find(const std::string &name) const {
    for (const Tensor &x : t)
      if (x.name == name) return &x;
    return nullptr;
  }
  void Bump(const std::string &name, size_t byte) {
    for (Tensor &x : t)
      if (x.name == name) x.data.at(byte) ^= 0x5a;
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
inline bool Expected(const Tensor &x, int r, std::vector<uint8_t> *out, std::vector<uint64_t> *shape) {
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

// The trainer of the many-sender tests, four ranks: the embedding is rank
// 0's, layer 0 is Shard(0) over ranks 0 and 1 (a pipeline stage under
// FSDP), layer 1 is replicated on ranks 2 and 3 (the plan splits its bytes
// between them), the int8 scale is rank 3's, and lm_head is Shard(0) over
// all four. Arrays live as long as the program.
// other: a rank that believes the scale is rank 2's, not rank 3's (its plan
// differs from the others').
// rows: layer 1 is Megatron-style tensor parallel over ranks 2 and 3 where
// a trainer's row-parallel layers split columns: o_proj, down_proj and
// (to cut across the workers' row slices too) q_proj are Shard(1). Their
// pieces are not runs of what the workers keep, and travel as boxes.
inline wtx_ownership OwnersOf(const std::string &name, bool other = false, bool rows = false) {
  static const uint32_t r0[] = {0}, r01[] = {0, 1}, r23[] = {2, 3}, r3[] = {3}, r2[] = {2},
                        all[] = {0, 1, 2, 3};
  if (other && name == "model.scale") return {r2, 1, nullptr, 0, nullptr};
  static const int32_t shard0[] = {0}, shard1[] = {1}, repl[] = {WTX_PLACEMENT_REPLICATE};
  auto has = [&](const char *s) { return name.find(s) != std::string::npos; };
  if (rows && has("layers.1.") && (has("o_proj") || has("down_proj") || has("q_proj")))
    return {r23, 2, nullptr, 0, shard1};
  if (name.find("embed") != std::string::npos) return {r0, 1, nullptr, 0, nullptr};
  if (name.find("layers.0.") != std::string::npos) return {r01, 2, nullptr, 0, shard0};
  if (name.find("layers.1.") != std::string::npos) return {r23, 2, nullptr, 0, repl};
  if (name == "model.scale") return {r3, 1, nullptr, 0, nullptr};
  return {all, 4, nullptr, 0, shard0};
}

class ShardedFixture : public EngineTest {
 protected:
  Worker SpawnRank(int r, std::vector<std::string> extra = {}) {
    std::string rules = dir_ + "/rules";
    std::ofstream(rules) << kRules;
    std::vector<std::string> args = {"--shard-rules", rules, "--tp-rank", std::to_string(r),
                                     "--tp-size", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(args);
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

}  // namespace wtxtest

#endif  // WTX_TESTS_CLIENT_LLAMA_H
