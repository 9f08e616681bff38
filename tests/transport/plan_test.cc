// The sharded transfer plan (transport/plan.h): every byte a worker holds
// comes from exactly one rank that owns it, whatever the two layouts, and
// bad layouts are refused by name before any byte moves.
#include "transport/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Owned {  // a wtx_ownership with its arrays
  std::vector<uint32_t> owners, mesh;
  std::vector<int32_t> place;
  bool every = false;
  wtx_ownership View() const {
    wtx_ownership o{};
    if (every) return o;
    static const uint32_t none = 0;  // an empty list, not "every rank"
    o.owners = owners.empty() ? &none : owners.data();
    o.n_owners = owners.size();
    o.mesh_shape = mesh.empty() ? nullptr : mesh.data();
    o.mesh_ndim = mesh.size();
    o.placements = place.empty() ? nullptr : place.data();
    return o;
  }
};

struct Model {
  std::vector<std::string> names;
  std::vector<wtx_tensor_meta> metas;
  std::vector<Owned> owned;
  std::vector<std::vector<wtx_slice>> needs;
  uint32_t ranks = 1;

  void Add(const std::string &name, int dtype, std::vector<uint64_t> shape, Owned o) {
    names.push_back(name);
    wtx_tensor_meta m{};
    char err[256];
    EXPECT_EQ(0, wtx_tensor_meta_set(&m, "x", dtype, shape.data(), shape.size(), err, sizeof err))
        << err;
    metas.push_back(m);
    owned.push_back(std::move(o));
  }
  // Makes the plan; names are bound here, since names may have moved.
  int Make(wtx_plan **plan, std::string *error) {
    for (size_t i = 0; i < metas.size(); i++) metas[i].name = names[i].c_str();
    std::vector<wtx_ownership> own;
    for (const Owned &o : owned) own.push_back(o.View());
    std::vector<const wtx_slice *> n;
    std::vector<size_t> k;
    for (auto &w : needs) {
      n.push_back(w.data());
      k.push_back(w.size());
    }
    wtx_plan_input in{};
    in.metas = metas.data();
    in.owners = own.data();
    in.n = metas.size();
    in.n_ranks = ranks;
    in.n_workers = static_cast<uint32_t>(needs.size());
    in.needs = n.data();
    in.n_needs = k.data();
    char err[512] = "";
    int rc = wtx_plan_make(&in, plan, err, sizeof err);
    if (error) *error = err;
    return rc;
  }
};

Owned Sharded(std::vector<uint32_t> owners, std::vector<int32_t> place,
              std::vector<uint32_t> mesh = {}) {
  Owned o;
  o.owners = std::move(owners);
  o.place = std::move(place);
  o.mesh = std::move(mesh);
  return o;
}

Owned Every() {
  Owned o;
  o.every = true;
  return o;
}

std::vector<uint32_t> Range(uint32_t from, uint32_t n) {
  std::vector<uint32_t> r(n);
  for (uint32_t i = 0; i < n; i++) r[i] = from + i;
  return r;
}

wtx_slice Whole(uint32_t param) { return wtx_slice{param, WTX_SLICE_WHOLE, 0, 0}; }
wtx_slice Cut(uint32_t param, int32_t dim, uint64_t start, uint64_t len) {
  return wtx_slice{param, dim, start, len};
}

// The full tensor's bytes: byte k of tensor i is a function of (i, k).
uint8_t Byte(size_t i, uint64_t k) { return static_cast<uint8_t>((k * 2654435761u) >> 13 ^ i * 31); }

// Element offsets of box b in a full tensor of shape, row-major, computed
// element by element (independently of wtx_box_copy).
std::vector<uint64_t> Elements(const wtx_tensor_meta &m, const wtx_box &b) {
  std::vector<uint64_t> out;
  uint64_t total = wtx_box_elements(&b);
  for (uint64_t e = 0; e < total; e++) {
    uint64_t rest = e, off = 0, mul = 1;
    std::vector<uint64_t> idx(m.ndim);
    for (size_t d = m.ndim; d-- > 0;) {
      idx[d] = b.lo[d] + rest % b.len[d];
      rest /= b.len[d];
    }
    for (size_t d = m.ndim; d-- > 0;) {
      off += idx[d] * mul;
      mul *= m.shape[d];
    }
    out.push_back(off);
  }
  return out;
}

std::vector<uint8_t> BoxBytes(size_t i, const wtx_tensor_meta &m, const wtx_box &b) {
  size_t es = wtx_dtype_size(m.dtype);
  std::vector<uint8_t> out;
  for (uint64_t off : Elements(m, b))
    for (size_t k = 0; k < es; k++) out.push_back(Byte(i, off * es + k));
  return out;
}

bool Inside(const wtx_box &in, const wtx_box &out) {
  for (size_t d = 0; d < in.ndim; d++)
    if (in.lo[d] < out.lo[d] || in.lo[d] + in.len[d] > out.lo[d] + out.len[d]) return false;
  return true;
}

// Runs the plan as the data plane will: each rank holds only its local
// parts (cut from the full tensors), packs each piece from there onto its
// link to the worker, and the worker scatters what arrives into its
// slices. Then every worker's slices must equal the full tensors' slices,
// every element filled exactly once, no rank may send a part it does not
// own, and the byte counts must add up.
void ExpectDelivers(Model &m) {
  wtx_plan *plan = nullptr;
  std::string err;
  ASSERT_EQ(0, m.Make(&plan, &err)) << err;
  const wtx_piece *pieces;
  size_t n = wtx_plan_pieces(plan, &pieces);
  // Slices as received, and how often each element was written.
  std::vector<std::vector<std::vector<uint8_t>>> got(m.needs.size());
  std::vector<std::vector<std::vector<int>>> hits(m.needs.size());
  for (size_t w = 0; w < m.needs.size(); w++)
    for (const wtx_slice &s : m.needs[w]) {
      wtx_box b;
      wtx_slice_box(&m.metas[s.param], &s, &b);
      uint64_t e = wtx_box_elements(&b);
      got[w].emplace_back(e * wtx_dtype_size(m.metas[s.param].dtype));
      hits[w].emplace_back(e);
    }
  std::vector<uint64_t> sent(m.ranks), received(m.needs.size());
  for (size_t k = 0; k < n; k++) {
    const wtx_piece &pc = pieces[k];
    const wtx_tensor_meta &meta = m.metas[pc.param];
    wtx_ownership o = m.owned[pc.param].View();
    wtx_box own, part, sl;
    wtx_ownership_box(&meta, &o, pc.owner, &own);
    uint32_t owner_rank = o.owners ? o.owners[pc.owner] : pc.owner;
    ASSERT_EQ(owner_rank, pc.rank) << "piece " << k << " sent by a rank that is not its owner";
    wtx_plan_piece_box(plan, &pc, &part);
    ASSERT_TRUE(Inside(part, own)) << "rank " << pc.rank << " sends bytes it does not own";
    const wtx_slice &s = m.needs[pc.worker][pc.slice];
    wtx_slice_box(&meta, &s, &sl);
    ASSERT_TRUE(Inside(part, sl));
    size_t es = wtx_dtype_size(meta.dtype);
    std::vector<uint8_t> local = BoxBytes(pc.param, meta, own);  // the rank's part only
    std::vector<uint8_t> wire(wtx_box_elements(&part) * es);
    wtx_box_copy(wire.data(), nullptr, local.data(), &own, &part, es);
    wtx_box_copy(got[pc.worker][pc.slice].data(), &sl, wire.data(), nullptr, &part, es);
    std::vector<uint64_t> sl_el = Elements(meta, sl);  // full offset -> place in the slice
    std::vector<int64_t> at(std::max<uint64_t>(meta.nbytes / es, 1), -1);
    for (size_t j = 0; j < sl_el.size(); j++) at[sl_el[j]] = static_cast<int64_t>(j);
    for (uint64_t e : Elements(meta, part)) hits[pc.worker][pc.slice][at[e]]++;
    ASSERT_EQ(wire.size(), wtx_plan_piece_bytes(plan, &pc));
    sent[pc.rank] += wire.size();
    received[pc.worker] += wire.size();
  }
  for (size_t w = 0; w < m.needs.size(); w++) {
    EXPECT_EQ(received[w], wtx_plan_worker_bytes(plan, static_cast<uint32_t>(w)));
    for (size_t j = 0; j < m.needs[w].size(); j++) {
      const wtx_slice &s = m.needs[w][j];
      wtx_box b;
      wtx_slice_box(&m.metas[s.param], &s, &b);
      EXPECT_EQ(BoxBytes(s.param, m.metas[s.param], b), got[w][j])
          << "worker " << w << " slice " << j << " (param " << s.param << ")";
      for (int h : hits[w][j]) ASSERT_EQ(1, h) << "worker " << w << " slice " << j;
    }
  }
  for (uint32_t r = 0; r < m.ranks; r++) EXPECT_EQ(sent[r], wtx_plan_rank_bytes(plan, r));
  wtx_plan_destroy(plan);
}

TEST(Plan, ChunkRangeSplitsAsTorchChunk) {
  // torch.chunk(torch.arange(10), 4) -> 3, 3, 3, 1; (5, 4) -> 2, 2, 1 (and
  // no fourth piece); (0, 3) -> nothing.
  struct Case {
    uint64_t n;
    uint32_t k;
    std::vector<uint64_t> lens;
  } cases[] = {{10, 4, {3, 3, 3, 1}}, {5, 4, {2, 2, 1, 0}}, {0, 3, {0, 0, 0}},
               {8, 8, {1, 1, 1, 1, 1, 1, 1, 1}}, {7, 1, {7}}};
  for (const Case &c : cases) {
    uint64_t at = 0;
    for (uint32_t i = 0; i < c.k; i++) {
      uint64_t start, len;
      wtx_chunk_range(c.n, c.k, i, &start, &len);
      EXPECT_EQ(c.lens[i], len) << c.n << " in " << c.k << " piece " << i;
      if (len > 0) {
        EXPECT_EQ(at, start);
      }
      at += len;
    }
    EXPECT_EQ(c.n, at);
  }
}

TEST(Plan, TwoMeshAxesShardingOneDimSplitTheOuterFirst) {
  Model m;
  m.ranks = 4;
  m.Add("w", WTX_DTYPE_FLOAT32, {8, 6}, Sharded(Range(0, 4), {0, 0}, {2, 2}));
  m.Add("v", WTX_DTYPE_FLOAT32, {8, 6}, Sharded(Range(0, 4), {0, 1}, {2, 2}));
  wtx_ownership o = m.owned[0].View();
  uint64_t want[4] = {0, 2, 4, 6};
  for (size_t p = 0; p < 4; p++) {
    wtx_box b;
    wtx_ownership_box(&m.metas[0], &o, p, &b);
    EXPECT_EQ(want[p], b.lo[0]);
    EXPECT_EQ(2u, b.len[0]);
    EXPECT_EQ(6u, b.len[1]);
  }
  wtx_ownership v = m.owned[1].View();
  wtx_box b;
  wtx_ownership_box(&m.metas[1], &v, 3, &b);  // coordinate (1, 1)
  EXPECT_EQ(4u, b.lo[0]);
  EXPECT_EQ(4u, b.len[0]);
  EXPECT_EQ(3u, b.lo[1]);
  EXPECT_EQ(3u, b.len[1]);
}

TEST(Plan, ReshardsShard0OverFourIntoShard0AndShard1OverTwo) {
  Model m;
  m.ranks = 4;
  m.Add("w", WTX_DTYPE_BFLOAT16, {16, 12}, Sharded(Range(0, 4), {0}));
  m.needs = {{Cut(0, 0, 0, 8)}, {Cut(0, 0, 8, 8)}, {Cut(0, 1, 0, 6)}, {Cut(0, 1, 6, 6)}};
  ExpectDelivers(m);
  wtx_plan *plan;
  std::string err;
  ASSERT_EQ(0, m.Make(&plan, &err)) << err;
  // Row slices come from the two ranks whose rows they are; column slices
  // take a strip from every rank.
  const uint32_t *idx;
  size_t n;
  wtx_plan_worker_pieces(plan, 1, &idx, &n);
  ASSERT_EQ(2u, n);
  const wtx_piece *pieces;
  wtx_plan_pieces(plan, &pieces);
  EXPECT_EQ(2u, pieces[idx[0]].rank);
  EXPECT_EQ(3u, pieces[idx[1]].rank);
  wtx_plan_worker_pieces(plan, 2, &idx, &n);
  EXPECT_EQ(4u, n);
  EXPECT_EQ(16u * 6 * 2, wtx_plan_worker_bytes(plan, 2));  // half the tensor, no more
  wtx_plan_destroy(plan);
}

// A Llama-shaped model as the sharded end-to-end test uses it: the
// embedding on rank 0, layers split 2 + 2 by pipeline stage, one weight
// Shard(0) over all four; two tensor-parallel workers and one replica.
TEST(Plan, PipelineStagesAndTensorParallelWorkers) {
  Model m;
  m.ranks = 4;
  m.Add("model.embed_tokens.weight", WTX_DTYPE_BFLOAT16, {32, 16}, Sharded({0}, {}));
  for (int l = 0; l < 4; l++) {
    std::vector<uint32_t> stage = l < 2 ? std::vector<uint32_t>{0, 1} : std::vector<uint32_t>{2, 3};
    std::string p = "model.layers." + std::to_string(l) + ".";
    m.Add(p + "self_attn.q_proj.weight", WTX_DTYPE_BFLOAT16, {16, 16}, Sharded(stage, {0}));
    m.Add(p + "self_attn.o_proj.weight", WTX_DTYPE_BFLOAT16, {16, 16}, Sharded(stage, {1}));
    m.Add(p + "input_layernorm.weight", WTX_DTYPE_FLOAT32, {16}, Sharded(stage, {-1}));
  }
  m.Add("lm_head.weight", WTX_DTYPE_BFLOAT16, {32, 16}, Sharded(Range(0, 4), {0}));
  const char *rules =
      "# column- and row-parallel\n"
      "*.q_proj.weight dim 0 unit 4\n"
      "*.o_proj.weight dim 1\n"
      "lm_head.weight dim 0\n"
      "model.embed_tokens.weight dim 0\n";
  wtx_shard_rule *r;
  size_t nr;
  char err[256];
  ASSERT_EQ(0, wtx_shard_rules_parse(rules, &r, &nr, err, sizeof err)) << err;
  ASSERT_EQ(4u, nr);
  for (size_t i = 0; i < m.metas.size(); i++) m.metas[i].name = m.names[i].c_str();
  for (uint32_t tp = 0; tp < 2; tp++) {
    wtx_slice *s;
    size_t ns;
    ASSERT_EQ(0, wtx_shard_slices(m.metas.data(), m.metas.size(), r, nr, tp, 2, &s, &ns, err,
                                  sizeof err)) << err;
    m.needs.emplace_back(s, s + ns);
    free(s);
  }
  free(r);
  std::vector<wtx_slice> whole;
  for (uint32_t i = 0; i < m.metas.size(); i++) whole.push_back(Whole(i));
  m.needs.push_back(whole);
  ExpectDelivers(m);
  wtx_plan *plan;
  std::string e;
  ASSERT_EQ(0, m.Make(&plan, &e)) << e;
  uint64_t model = 0;
  for (const wtx_tensor_meta &t : m.metas) model += t.nbytes;
  for (uint32_t w = 0; w < 2; w++) {
    uint64_t got = wtx_plan_worker_bytes(plan, w);
    EXPECT_LE(got * 100, model * 55) << "a tensor-parallel worker receives over 0.55x";
  }
  EXPECT_EQ(model, wtx_plan_worker_bytes(plan, 2));
  wtx_plan_destroy(plan);
}

TEST(Plan, FusedSlicesAndExperts) {
  Model m;
  m.ranks = 2;
  for (const char *n : {"q", "k", "v"})
    m.Add(std::string("layers.0.") + n + ".weight", WTX_DTYPE_FLOAT16, {8, 4},
          Sharded({0, 1}, {1}));
  for (int e = 0; e < 4; e++)
    m.Add("layers.0.mlp.experts." + std::to_string(e) + ".w1", WTX_DTYPE_FLOAT16, {6, 4},
          Sharded({static_cast<uint32_t>(e % 2)}, {}));
  // Worker 0: the first half of q, k and v (one fused qkv) and experts 0-1;
  // worker 1: the second halves, two rows of k in two slices, experts 2-3.
  m.needs = {{Cut(0, 0, 0, 4), Cut(1, 0, 0, 4), Cut(2, 0, 0, 4), Whole(3), Whole(4)},
             {Cut(0, 0, 4, 4), Cut(1, 0, 4, 2), Cut(1, 0, 6, 2), Cut(2, 0, 4, 4), Whole(5),
              Whole(6)}};
  ExpectDelivers(m);
}

// Random layouts, random needs: the plan delivers, and no rank sends more
// than its fair share plus the largest piece.
TEST(Plan, PropertyRandomLayoutsDeliverExactlyOnceAndBalance) {
  std::mt19937 rng(7);
  for (int round = 0; round < 60; round++) {
    Model m;
    m.ranks = 1 + rng() % 6;
    size_t params = 1 + rng() % 6;
    for (size_t i = 0; i < params; i++) {
      size_t nd = rng() % 3 + (rng() % 5 == 0 ? 0 : 1);
      std::vector<uint64_t> shape;
      for (size_t d = 0; d < nd; d++) shape.push_back(1 + rng() % 9);
      Owned o;
      if (rng() % 4 == 0) {
        o = Every();
      } else {
        std::vector<uint32_t> all = Range(0, m.ranks);
        std::shuffle(all.begin(), all.end(), rng);
        uint32_t k = 1 + rng() % m.ranks;
        o.owners.assign(all.begin(), all.begin() + k);
        if (k % 2 == 0 && rng() % 2) o.mesh = {2, k / 2};
        size_t axes = o.mesh.empty() ? 1 : 2;
        for (size_t a = 0; a < axes; a++)
          o.place.push_back(nd == 0 || rng() % 3 == 0 ? -1 : static_cast<int32_t>(rng() % nd));
      }
      m.Add("p" + std::to_string(i), rng() % 2 ? WTX_DTYPE_FLOAT32 : WTX_DTYPE_INT8, shape, o);
    }
    size_t workers = 1 + rng() % 4;
    m.needs.resize(workers);
    for (auto &w : m.needs)
      for (uint32_t i = 0; i < params; i++) {
        const wtx_tensor_meta &t = m.metas[i];
        int how = rng() % 4;
        if (how == 0) continue;
        if (how == 1 || t.ndim == 0) {
          w.push_back(Whole(i));
          continue;
        }
        int32_t d = rng() % t.ndim;
        uint64_t at = 0;
        while (at < t.shape[d]) {  // disjoint cuts, some skipped
          uint64_t len = 1 + rng() % t.shape[d];
          len = std::min(len, t.shape[d] - at);
          if (rng() % 3) w.push_back(Cut(i, d, at, len));
          at += len;
        }
      }
    SCOPED_TRACE("round " + std::to_string(round));
    ExpectDelivers(m);
    wtx_plan *plan;
    std::string err;
    ASSERT_EQ(0, m.Make(&plan, &err)) << err;
    // The fair share: each piece's bytes split among the ranks that could
    // send it. (Fixed pieces count whole for their one owner.)
    const wtx_piece *pieces;
    size_t n = wtx_plan_pieces(plan, &pieces);
    std::vector<double> fair(m.ranks);
    uint64_t largest = 0;
    for (size_t k = 0; k < n; k++) {
      uint64_t b = wtx_plan_piece_bytes(plan, &pieces[k]);
      largest = std::max(largest, b);
      wtx_ownership o = m.owned[pieces[k].param].View();
      wtx_box mine;
      wtx_ownership_box(&m.metas[pieces[k].param], &o, pieces[k].owner, &mine);
      std::vector<uint32_t> could;
      size_t owners = o.owners ? o.n_owners : m.ranks;
      for (size_t p = 0; p < owners; p++) {
        wtx_box other;
        wtx_ownership_box(&m.metas[pieces[k].param], &o, p, &other);
        if (wtx_box_equal(&other, &mine)) could.push_back(o.owners ? o.owners[p] : p);
      }
      for (uint32_t r : could) fair[r] += static_cast<double>(b) / could.size();
    }
    for (uint32_t r = 0; r < m.ranks; r++)
      EXPECT_LE(static_cast<double>(wtx_plan_rank_bytes(plan, r)), fair[r] + largest + 1e-6)
          << "rank " << r;
    wtx_plan_destroy(plan);
  }
}

TEST(Plan, ReplicatedBytesAreSpreadOverTheirOwners) {
  Model m;
  m.ranks = 4;
  for (int i = 0; i < 40; i++)
    m.Add("t" + std::to_string(i), WTX_DTYPE_FLOAT32, {256}, Every());
  std::vector<wtx_slice> all;
  for (uint32_t i = 0; i < 40; i++) all.push_back(Whole(i));
  m.needs = {all, all};
  ExpectDelivers(m);
  wtx_plan *plan;
  std::string err;
  ASSERT_EQ(0, m.Make(&plan, &err)) << err;
  for (uint32_t r = 0; r < 4; r++)  // 80 tensors of 1 KiB over 4 ranks
    EXPECT_EQ(20u * 1024, wtx_plan_rank_bytes(plan, r)) << "rank " << r;
  wtx_plan_destroy(plan);
}

TEST(Plan, TheDigestIsTheSameForTheSameInputsAndChangesWithThem) {
  auto make = [](uint64_t cut, uint32_t owner) {
    Model m;
    m.ranks = 2;
    m.Add("a", WTX_DTYPE_FLOAT32, {4, 4}, Sharded({0, 1}, {0}));
    m.Add("b", WTX_DTYPE_FLOAT32, {4}, Sharded({owner}, {}));
    m.needs = {{Cut(0, 1, 0, cut), Whole(1)}, {Cut(0, 1, cut, 4 - cut)}};
    wtx_plan *plan;
    std::string err;
    EXPECT_EQ(0, m.Make(&plan, &err)) << err;
    uint64_t d = wtx_plan_digest(plan);
    wtx_plan_destroy(plan);
    return d;
  };
  EXPECT_EQ(make(2, 0), make(2, 0));
  EXPECT_NE(make(2, 0), make(1, 0));
  EXPECT_NE(make(2, 0), make(2, 1));
}

// What ranks whose plans differ compare: one digest per parameter, which
// changes with its name, shape or ownership and nothing else's, and the
// parameter in words.
TEST(Plan, ParameterDigestsFindWhereTwoRanksDisagree) {
  auto digests = [](const std::string &b, uint64_t rows, std::vector<int32_t> place) {
    Model m;
    m.Add("a", WTX_DTYPE_FLOAT32, {4, 4}, Sharded({0, 1}, {0}));
    m.Add(b, WTX_DTYPE_BFLOAT16, {rows, 2}, Sharded({0, 1}, place));
    Owned every;
    every.every = true;
    m.Add("c", WTX_DTYPE_FLOAT32, {4}, every);
    std::vector<wtx_ownership> own;
    for (size_t i = 0; i < m.metas.size(); i++) {
      m.metas[i].name = m.names[i].c_str();
      own.push_back(m.owned[i].View());
    }
    std::vector<uint64_t> d(3);
    EXPECT_EQ(0, wtx_plan_param_digests(m.metas.data(), own.data(), 3, d.data()));
    return d;
  };
  std::vector<uint64_t> base = digests("b", 6, {0});
  EXPECT_EQ(base, digests("b", 6, {0}));
  for (const auto &other : {digests("B", 6, {0}), digests("b", 8, {0}),
                            digests("b", 6, {WTX_PLACEMENT_REPLICATE})}) {
    EXPECT_EQ(base[0], other[0]);
    EXPECT_NE(base[1], other[1]);
    EXPECT_EQ(base[2], other[2]);
  }
  wtx_tensor_meta meta{};
  uint64_t shape[] = {6, 2};
  char err[256], buf[300];
  ASSERT_EQ(0, wtx_tensor_meta_set(&meta, "w", WTX_DTYPE_BFLOAT16, shape, 2, err, sizeof err));
  Owned o = Sharded({0, 1, 2, 3}, {WTX_PLACEMENT_REPLICATE, 1}, {2, 2});
  wtx_ownership ov = o.View();
  wtx_plan_param_describe(&meta, &ov, buf, sizeof buf);
  EXPECT_STREQ("'w' BFLOAT16 [6, 2], owners [0, 1, 2, 3] mesh [2, 2] placements [R, 1]", buf);
  wtx_plan_param_describe(&meta, nullptr, buf, sizeof buf);
  EXPECT_STREQ("'w' BFLOAT16 [6, 2], owned by every rank", buf);
  wtx_plan_param_describe(&meta, &ov, buf, 12);  // cut, never past the buffer
  EXPECT_STREQ("'w' BFLOAT1", buf);
}

// Each refusal names the parameter and what is wrong, and makes no plan.
void ExpectRefused(Model &m, const std::string &part) {
  wtx_plan *plan = reinterpret_cast<wtx_plan *>(1);
  std::string err;
  EXPECT_EQ(WTX_EINVAL, m.Make(&plan, &err));
  EXPECT_EQ(nullptr, plan);
  EXPECT_NE(std::string::npos, err.find(part)) << err;
}

TEST(Plan, RefusesBadOwnershipByName) {
  {
    Model m;
    m.ranks = 2;
    m.Add("orphan.weight", WTX_DTYPE_FLOAT32, {4}, Sharded({}, {}));
    m.needs = {{Whole(0)}};
    ExpectRefused(m, "'orphan.weight': no trainer rank owns it");
  }
  {
    Model m;
    m.ranks = 2;
    m.Add("w", WTX_DTYPE_FLOAT32, {4}, Sharded({0, 2}, {0}));
    m.needs = {{Whole(0)}};
    ExpectRefused(m, "'w': owners[1]: rank 2 of 2 ranks");
  }
  {
    Model m;
    m.ranks = 2;
    m.Add("w", WTX_DTYPE_FLOAT32, {4}, Sharded({1, 1}, {0}));
    m.needs = {{Whole(0)}};
    ExpectRefused(m, "rank 1 appears twice");
  }
  {
    Model m;
    m.ranks = 4;
    m.Add("w", WTX_DTYPE_FLOAT32, {4}, Sharded(Range(0, 4), {0, 0}, {3, 1}));
    m.needs = {{Whole(0)}};
    ExpectRefused(m, "mesh_shape: does not cover its 4 owners");
  }
  {
    Model m;
    m.ranks = 2;
    m.Add("w", WTX_DTYPE_FLOAT32, {4}, Sharded({0, 1}, {1}));
    m.needs = {{Whole(0)}};
    ExpectRefused(m, "'w': placements[0]: shards dim 1 of a 1-D tensor");
  }
}

TEST(Plan, RefusesBadSlicesByName) {
  auto model = [] {
    Model m;
    m.ranks = 1;
    m.Add("model.w", WTX_DTYPE_FLOAT32, {8, 4}, Every());
    return m;
  };
  struct Case {
    std::vector<wtx_slice> slices;
    std::string says;
  } cases[] = {
      {{Cut(0, 0, 6, 4)}, "'model.w': worker 0 slice [6, 6 + 4) of dim 0 is out of range"},
      {{Cut(0, 2, 0, 1)}, "'model.w': worker 0 slices dim 2 of a 2-D tensor"},
      {{Cut(0, 0, 0, 0)}, "out of range"},
      {{Cut(0, 0, 0, 4), Cut(0, 0, 3, 2)}, "'model.w': worker 0 holds overlapping slices"},
      {{Whole(0), Cut(0, 1, 0, 1)}, "overlapping slices"},
      {{Cut(0, 0, 0, 1), Cut(0, 1, 3, 1)}, "overlapping slices"},
      {{Cut(1, 0, 0, 1)}, "worker 0 slice 0: param 1 of 1 parameters"},
  };
  for (const Case &c : cases) {
    Model m = model();
    m.needs = {c.slices};
    ExpectRefused(m, c.says);
  }
  Model ok = model();  // touching, not overlapping
  ok.needs = {{Cut(0, 0, 0, 4), Cut(0, 0, 4, 4)}};
  ExpectDelivers(ok);
}

TEST(Plan, BoxCopyGathersAndScatters) {
  // A 4x6 tensor holding box [1,5)x[0,6); part [2,4)x[1,4).
  wtx_box src{2, {1, 0}, {4, 6}}, part{2, {2, 1}, {2, 3}};
  std::vector<uint16_t> full(4 * 6);
  for (size_t i = 0; i < full.size(); i++) full[i] = static_cast<uint16_t>(100 + i);
  std::vector<uint16_t> packed(6);
  wtx_box_copy(packed.data(), nullptr, full.data(), &src, &part, 2);
  EXPECT_EQ((std::vector<uint16_t>{107, 108, 109, 113, 114, 115}), packed);
  wtx_box dst{2, {2, 0}, {3, 5}};
  std::vector<uint16_t> into(15, 0);
  wtx_box_copy(into.data(), &dst, packed.data(), nullptr, &part, 2);
  EXPECT_EQ((std::vector<uint16_t>{0, 107, 108, 109, 0, 0, 113, 114, 115, 0, 0, 0, 0, 0, 0}),
            into);
}

TEST(Plan, ABoxIsContiguousWhenEveryDimAfterItsFirstCutIsWhole) {
  wtx_box outer{3, {0, 0, 0}, {4, 6, 5}};
  uint64_t at = 0;
  wtx_box rows{3, {1, 0, 0}, {2, 6, 5}}, row{3, {2, 3, 0}, {1, 2, 5}}, cols{3, {0, 0, 1}, {4, 6, 2}};
  EXPECT_EQ(1, wtx_box_contiguous(&outer, &rows, &at));
  EXPECT_EQ(30u, at);
  EXPECT_EQ(1, wtx_box_contiguous(&outer, &row, &at));  // one row, columns 3-4 of it
  EXPECT_EQ(2u * 30 + 3 * 5, at);
  EXPECT_EQ(0, wtx_box_contiguous(&outer, &cols, &at));
}

// Random boxes in random tensors, random limits: the cuts lie in the box,
// each within the limit (or one element), each the next run of the box's
// packed bytes, and together they are the box (each element once).
TEST(Plan, PropertyBoxCutsAreTheBoxsPackedBytesInOrderWithinTheLimit) {
  std::mt19937 rng(11);
  for (int iter = 0; iter < 400; iter++) {
    size_t nd = rng() % 4, es = size_t{1} << (rng() % 3);
    wtx_box b{nd, {}, {}};
    for (size_t d = 0; d < nd; d++) {
      b.lo[d] = rng() % 3;
      b.len[d] = 1 + rng() % 6;
    }
    uint64_t max = 1 + rng() % 200;
    // Each element of b, numbered in b's own packing.
    uint64_t n = wtx_box_elements(&b);
    std::vector<uint32_t> packed(n);
    for (uint64_t i = 0; i < n; i++) packed[i] = static_cast<uint32_t>(i);
    struct Seen {
      const wtx_box *b;
      const std::vector<uint32_t> *packed;
      uint64_t next = 0, max, es;
      bool ok = true;
    } seen{&b, &packed, 0, max, es};
    auto each = [](void *arg, const wtx_box *part) {
      Seen *s = static_cast<Seen *>(arg);
      uint64_t k = wtx_box_elements(part);
      for (size_t d = 0; d < part->ndim; d++)
        if (part->lo[d] < s->b->lo[d] || part->lo[d] + part->len[d] > s->b->lo[d] + s->b->len[d])
          s->ok = false;
      if (k == 0 || (k > 1 && k * s->es > s->max)) s->ok = false;
      // Gathered out of b's packing, the cut is elements [next, next + k).
      std::vector<uint32_t> got(k);
      wtx_box_copy(got.data(), nullptr, s->packed->data(), s->b, part, sizeof(uint32_t));
      for (uint64_t i = 0; i < k; i++)
        if (got[i] != s->next + i) s->ok = false;
      s->next += k;
      return 0;
    };
    ASSERT_EQ(0, wtx_box_cut(&b, es, max, each, &seen));
    EXPECT_TRUE(seen.ok) << "iteration " << iter << ", max " << max;
    EXPECT_EQ(n, seen.next) << "iteration " << iter;
  }
}

TEST(Plan, BoxMarksRefuseAnOverlapAndMarkNothingThen) {
  wtx_box outer{2, {0, 0}, {4, 70}};  // rows of 70: runs cross 64-bit words
  std::vector<uint64_t> bits((4 * 70 + 63) / 64, 0);
  wtx_box left{2, {0, 0}, {4, 35}}, right{2, {0, 35}, {4, 35}}, mid{2, {1, 30}, {2, 10}};
  EXPECT_EQ(0, wtx_box_mark(bits.data(), &outer, &left));
  std::vector<uint64_t> before = bits;
  EXPECT_EQ(WTX_EEXIST, wtx_box_mark(bits.data(), &outer, &mid));
  EXPECT_EQ(before, bits) << "a refused box marks nothing";
  EXPECT_EQ(0, wtx_box_mark(bits.data(), &outer, &right));
  uint64_t set = 0;
  for (uint64_t w : bits) set += static_cast<uint64_t>(__builtin_popcountll(w));
  EXPECT_EQ(4u * 70, set) << "two halves cover the tensor";
  EXPECT_EQ(WTX_EEXIST, wtx_box_mark(bits.data(), &outer, &right));
}

TEST(Plan, ShardRulesGiveTensorParallelSlices) {
  const char *text =
      "*.k_proj.weight dim 0 unit 4\n"
      "  *.o_proj.weight   dim 1  \n"
      "*.experts.* expert\n"
      "*.rotary.* skip\n";
  wtx_shard_rule *r;
  size_t nr;
  char err[256];
  ASSERT_EQ(0, wtx_shard_rules_parse(text, &r, &nr, err, sizeof err)) << err;
  std::vector<std::string> names = {"l.k_proj.weight", "l.o_proj.weight", "l.mlp.experts.0.w",
                                    "l.mlp.experts.1.w",  "l.mlp.experts.2.w", "l.rotary.inv",
                                    "l.norm.weight"};
  std::vector<std::vector<uint64_t>> shapes = {{8, 16}, {16, 10}, {2}, {2}, {2}, {3}, {16}};
  std::vector<wtx_tensor_meta> metas(names.size());
  for (size_t i = 0; i < names.size(); i++)
    ASSERT_EQ(0, wtx_tensor_meta_set(&metas[i], names[i].c_str(), WTX_DTYPE_FLOAT32,
                                     shapes[i].data(), shapes[i].size(), err, sizeof err));
  std::vector<std::vector<wtx_slice>> per(4);
  for (uint32_t tp = 0; tp < 4; tp++) {
    wtx_slice *s;
    size_t n;
    ASSERT_EQ(0, wtx_shard_slices(metas.data(), metas.size(), r, nr, tp, 4, &s, &n, err,
                                  sizeof err)) << err;
    per[tp].assign(s, s + n);
    free(s);
  }
  free(r);
  // k_proj: 8 rows in units of 4 = 2 heads over 4 ranks: ranks 0-1 share
  // head 0, ranks 2-3 head 1 (vLLM replicates KV heads so).
  EXPECT_EQ(0u, per[1][0].start);
  EXPECT_EQ(4u, per[1][0].length);
  EXPECT_EQ(4u, per[2][0].start);
  // o_proj: 10 columns in pieces of 3, 3, 3, 1.
  EXPECT_EQ(1, per[3][1].dim);
  EXPECT_EQ(9u, per[3][1].start);
  EXPECT_EQ(1u, per[3][1].length);
  // Experts 0, 1, 2 over 4 ranks: one each on ranks 0-2, none on 3; the
  // rotary table is skipped; the norm is whole everywhere.
  ASSERT_EQ(4u, per[0].size());
  EXPECT_EQ(2u, per[0][2].param);
  EXPECT_EQ(6u, per[0][3].param);
  EXPECT_EQ(WTX_SLICE_WHOLE, per[0][3].dim);
  ASSERT_EQ(3u, per[3].size());
}

TEST(Plan, AnExpertRuleWithItsCountChecksOneTensorAlone) {
  wtx_shard_rule *r;
  size_t nr;
  char err[256];
  ASSERT_EQ(0, wtx_shard_rules_parse("*.experts.* expert 8\n", &r, &nr, err, sizeof err)) << err;
  EXPECT_EQ(8u, r[0].unit);
  wtx_tensor_meta m{};
  uint64_t shape[] = {4};
  wtx_slice s;
  ASSERT_EQ(0, wtx_tensor_meta_set(&m, "l.experts.5.w", WTX_DTYPE_FLOAT32, shape, 1, err,
                                   sizeof err));
  EXPECT_EQ(1, wtx_shard_slice_of(&m, r, nr, 2, 4, 0, &s, err, sizeof err));  // 4-5 on rank 2
  EXPECT_EQ(WTX_SLICE_WHOLE, s.dim);
  EXPECT_EQ(0, wtx_shard_slice_of(&m, r, nr, 1, 4, 0, &s, err, sizeof err));
  ASSERT_EQ(0, wtx_tensor_meta_set(&m, "l.experts.8.w", WTX_DTYPE_FLOAT32, shape, 1, err,
                                   sizeof err));
  EXPECT_EQ(WTX_EINVAL, wtx_shard_slice_of(&m, r, nr, 0, 4, 0, &s, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "expert 8 of 8 experts")) << err;
  free(r);
  EXPECT_EQ(WTX_EINVAL, wtx_shard_rules_parse("x expert 0\n", &r, &nr, err, sizeof err));
  EXPECT_EQ(nullptr, r);
}

TEST(Plan, ShardRulesRefuseWhatTheyCannotSay) {
  wtx_shard_rule *r;
  size_t nr;
  char err[256];
  EXPECT_EQ(WTX_EINVAL, wtx_shard_rules_parse("a whole\n*.w dims 0\n", &r, &nr, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "line 2"));
  EXPECT_EQ(WTX_EINVAL, wtx_shard_rules_parse("*.w dim 0 unit 0\n", &r, &nr, err, sizeof err));
  ASSERT_EQ(0, wtx_shard_rules_parse("*.w dim 1\n", &r, &nr, err, sizeof err));
  wtx_tensor_meta m{};
  uint64_t shape[] = {4};
  ASSERT_EQ(0, wtx_tensor_meta_set(&m, "x.w", WTX_DTYPE_FLOAT32, shape, 1, err, sizeof err));
  wtx_slice *s;
  size_t n;
  EXPECT_EQ(WTX_EINVAL, wtx_shard_slices(&m, 1, r, nr, 0, 2, &s, &n, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "'x.w': rule '*.w' slices dim 1 of a 1-D tensor")) << err;
  EXPECT_EQ(WTX_EINVAL, wtx_shard_slices(&m, 1, r, nr, 2, 2, &s, &n, err, sizeof err));
  // A kind from a newer peer is refused, not read as "skip".
  r[0].kind = static_cast<wtx_shard_kind>(7);
  wtx_slice one;
  EXPECT_EQ(WTX_EINVAL, wtx_shard_slice_of(&m, r, nr, 0, 2, 0, &one, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "has kind 7")) << err;
  free(r);
}

}  // namespace
