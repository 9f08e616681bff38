// The worker's parameter store: atomic publish, refcounted snapshots that a
// publish never frees under a reader, buffers of the version before last
// reused for the next update, a commit undone, an abort that keeps the published bytes, and
// the layout check.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <atomic>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/store.h"
#include "wtx/worker.h"

namespace {

wtx_tensor_meta Meta(const char *name, uint64_t n) {
  wtx_tensor_meta m{};
  char err[128];
  uint64_t shape = n;
  EXPECT_EQ(0, wtx_tensor_meta_set(&m, name, WTX_DTYPE_UINT8, &shape, 1, err, sizeof err));
  return m;
}

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(0, wtx_store_create(&s_)); }
  void TearDown() override { wtx_store_destroy(s_); }

  // One update of tensors (name, size, fill byte); returns where each landed.
  std::vector<uint8_t *> Stage(const std::vector<std::tuple<const char *, uint64_t, int>> &ts) {
    const wtx_model_ops &ops = wtx_store_model_ops;
    EXPECT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
    std::vector<uint8_t *> dst;
    dst.reserve(ts.size());
    for (auto &[name, n, fill] : ts) {
      wtx_tensor_meta m = Meta(name, n);
      uint8_t *d = nullptr;
      EXPECT_EQ(0, ops.stage(s_, &m, &d));
      memset(d, fill, n);
      uint64_t sum = static_cast<uint64_t>(fill);
      EXPECT_EQ(0, ops.loaded(s_, &m, &sum));
      dst.push_back(d);
    }
    return dst;
  }
  std::vector<uint8_t *> Publish(const char *version,
                                 const std::vector<std::tuple<const char *, uint64_t, int>> &ts) {
    std::vector<uint8_t *> dst = Stage(ts);
    EXPECT_EQ(0, wtx_store_model_ops.commit(s_, version));
    return dst;
  }
  static bool Filled(const wtx_store_param &p, int fill) {
    for (uint64_t i = 0; i < p.meta.nbytes; i++)
      if (p.data[i] != fill) return false;
    return true;
  }
  wtx_store *s_ = nullptr;
};

TEST_F(StoreTest, APublishIsAtomicAndCarriesOverTensorsTheUpdateLacks) {
  Publish("v1", {{"a", 16, 1}, {"b", 32, 2}});
  Publish("v2", {{"b", 32, 3}, {"c", 8, 4}});  // replaces b, adds c, keeps a
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  EXPECT_STREQ("v2", v.version);
  EXPECT_EQ(2u, v.generation);
  ASSERT_EQ(3u, v.n_params);
  EXPECT_STREQ("a", v.params[0].meta.name);  // previous order first, then new ones
  EXPECT_STREQ("b", v.params[1].meta.name);
  EXPECT_STREQ("c", v.params[2].meta.name);
  EXPECT_TRUE(Filled(v.params[0], 1));
  EXPECT_TRUE(Filled(v.params[1], 3));
  EXPECT_EQ(3u, v.params[1].xxh3);
  EXPECT_EQ(56u, v.total_bytes);
  wtx_store_release(s_, &v);
}

TEST_F(StoreTest, AHeldSnapshotSurvivesLaterPublishesUnchanged) {
  Publish("v1", {{"w", 4096, 1}});
  wtx_store_view old;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &old));
  const uint8_t *old_data = old.params[0].data;
  // Two more versions: v1's buffer would be the spare, but a reader holds it.
  std::vector<uint8_t *> d2 = Publish("v2", {{"w", 4096, 2}});
  std::vector<uint8_t *> d3 = Publish("v3", {{"w", 4096, 3}});
  EXPECT_NE(old_data, d2[0]);
  EXPECT_NE(old_data, d3[0]);
  EXPECT_STREQ("v1", old.version);
  EXPECT_TRUE(Filled(old.params[0], 1));
  wtx_store_release(s_, &old);
}

TEST_F(StoreTest, TheNextUpdateStagesIntoTheBuffersOfTheVersionBeforeLast) {
  std::vector<uint8_t *> d1 = Publish("v1", {{"a", 1 << 20, 1}, {"b", 1 << 16, 2}});
  std::vector<uint8_t *> d2 = Publish("v2", {{"a", 1 << 20, 3}, {"b", 1 << 16, 4}});
  std::vector<uint8_t *> d3 = Publish("v3", {{"a", 1 << 20, 5}, {"b", 1 << 16, 6}});
  // v1's buffers were freed by v2's publish and reused for v3, not v2's.
  EXPECT_EQ(std::set<uint8_t *>(d1.begin(), d1.end()), std::set<uint8_t *>(d3.begin(), d3.end()));
  EXPECT_EQ(0u, std::set<uint8_t *>(d2.begin(), d2.end()).count(d3[0]));
  wtx_store_view v;
  wtx_store_acquire(s_, WTX_TARGET_MAIN, &v);
  EXPECT_TRUE(Filled(v.params[0], 5));
  EXPECT_TRUE(Filled(v.params[1], 6));
  wtx_store_release(s_, &v);
}

// A tensor above the slab size starts on a 64-byte line, fresh or reused,
// whatever its length: the receive streams whole aligned lines into it
// while hashing them (wtx__copy_hash), and falls back to slower stores
// where the first byte is not at a line's start.
TEST_F(StoreTest, LargeTensorsStartOnA64ByteLine) {
  for (const char *v : {"v1", "v2", "v3"}) {
    std::vector<uint8_t *> d =
        Publish(v, {{"a", (1 << 20) + 3, 1}, {"b", 5000, 2}, {"c", (3 << 20) + 17, 3}});
    for (uint8_t *p : d) EXPECT_EQ(0u, reinterpret_cast<uintptr_t>(p) % 64) << v;
  }
}

// The pool holds the version before last between updates; an update that
// stages fewer tensors of a length than the pool holds gives the rest back.
// A publish holds the version it replaced (a trainer may still undo it);
// the next begin hands that version to the pool, where staging takes it:
// memory stays two versions and one spare however many updates come.
TEST_F(StoreTest, EachPublishHoldsTheVersionItReplacedUntilTheNextBegin) {
  const uint64_t model = (2 << 20) + (1 << 16);
  for (int v = 1; v <= 5; v++) {
    Publish(("v" + std::to_string(v)).c_str(),
            {{"a", 1 << 20, v}, {"b", 1 << 16, v}, {"c", 1 << 20, v}});
    EXPECT_EQ(0u, wtx__store_pooled_bytes(s_)) << "after v" << v;
    ASSERT_EQ(0, wtx_store_model_ops.begin(s_, WTX_TARGET_MAIN));
    EXPECT_EQ(v == 1 ? 0 : model, wtx__store_pooled_bytes(s_)) << "begin after v" << v;
    wtx_store_model_ops.abort(s_);
  }
  // v6 takes v4's a and carries v5's b and c: the pool then has v4's b
  // and c, and v5 (its a, and b and c shared with v6) is held.
  Publish("v6", {{"a", 1 << 20, 6}});
  EXPECT_EQ((1u << 20) + (1u << 16), wtx__store_pooled_bytes(s_));
  Publish("v7", {{"a", 1 << 20, 7}, {"b", 1 << 16, 7}, {"c", 1 << 20, 7}});
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  for (size_t i = 0; i < v.n_params; i++) EXPECT_TRUE(Filled(v.params[i], 7)) << i;
  wtx_store_release(s_, &v);
}

// A commit undone (its Finish failed on another replica) publishes again
// the version it replaced: bytes, names and label, with tensors the update
// added gone. Once only: a second revert, or one after the next begin, is
// refused and changes nothing.
TEST_F(StoreTest, ARevertPublishesAgainTheVersionTheLastCommitReplaced) {
  const wtx_model_ops &ops = wtx_store_model_ops;
  Publish("v1", {{"a", 4096, 1}, {"b", 64, 1}});
  Publish("v2", {{"a", 4096, 2}, {"c", 64, 2}});
  char err[256] = "";
  ASSERT_EQ(0, ops.revert(s_, WTX_TARGET_MAIN, err, sizeof err)) << err;
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  EXPECT_STREQ("v1", v.version);
  ASSERT_EQ(2u, v.n_params);
  std::set<std::string> names;
  for (size_t i = 0; i < v.n_params; i++) {
    names.insert(v.params[i].meta.name);
    EXPECT_TRUE(Filled(v.params[i], 1)) << v.params[i].meta.name;
  }
  EXPECT_EQ((std::set<std::string>{"a", "b"}), names);
  wtx_store_release(s_, &v);
  EXPECT_EQ(WTX_ESTATE, ops.revert(s_, WTX_TARGET_MAIN, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "no commit to undo")) << err;
  // The next update stages and publishes as usual over v1.
  Publish("v3", {{"b", 64, 3}});
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  EXPECT_STREQ("v3", v.version);
  for (size_t i = 0; i < v.n_params; i++)
    EXPECT_TRUE(Filled(v.params[i], std::string(v.params[i].meta.name) == "a" ? 1 : 3));
  wtx_store_release(s_, &v);
  ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
  ops.abort(s_);
  EXPECT_EQ(WTX_ESTATE, ops.revert(s_, WTX_TARGET_MAIN, err, sizeof err));
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  EXPECT_STREQ("v3", v.version);
  wtx_store_release(s_, &v);
}

// A reader holding the undone version keeps it whole; undoing a first
// version leaves the target empty, as before it.
TEST_F(StoreTest, ARevertNeverFreesUnderAReaderAndUndoesAFirstVersionToNothing) {
  const wtx_model_ops &ops = wtx_store_model_ops;
  Publish("v1", {{"w", 4096, 1}});
  wtx_store_view held;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &held));
  char err[256] = "";
  ASSERT_EQ(0, ops.revert(s_, WTX_TARGET_MAIN, err, sizeof err)) << err;
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  EXPECT_STREQ("", v.version);
  EXPECT_EQ(0u, v.n_params);
  wtx_store_release(s_, &v);
  Publish("v2", {{"w", 4096, 2}});
  EXPECT_STREQ("v1", held.version);
  EXPECT_TRUE(Filled(held.params[0], 1));
  wtx_store_release(s_, &held);
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  EXPECT_STREQ("v2", v.version);
  wtx_store_release(s_, &v);
}

TEST_F(StoreTest, BuffersAreReusedByLengthWhateverTheNumberOfLengths) {
  // 1000 tensors of 1000 different lengths, each too large for a slab:
  // each of v3's lands in the buffer v1's tensor of that length had (the
  // pool is keyed by length).
  std::vector<std::string> names;
  for (int i = 0; i < 1000; i++) names.push_back("t" + std::to_string(i));
  auto update = [&](int fill) {
    std::vector<std::tuple<const char *, uint64_t, int>> ts;
    for (int i = 0; i < 1000; i++)
      ts.emplace_back(names[i].c_str(), WTX__STORE_SMALL + 1 + i, fill);
    return ts;
  };
  std::vector<uint8_t *> d1 = Publish("v1", update(1));
  Publish("v2", update(2));
  std::vector<uint8_t *> d3 = Publish("v3", update(3));
  EXPECT_EQ(d1, d3);
}

// Every RL step publishes a version as large as the last: its snapshot
// arrays (megabytes at 40k tensors) and buffers are those of the version
// before last, so a steady-state publish touches no fresh page. Counted in
// minor page faults, which fresh arrays would cost one per 4 KiB page.
TEST_F(StoreTest, SteadyStatePublishesReuseTheirArraysAndTouchNoFreshPage) {
  std::vector<std::string> names;
  for (int i = 0; i < 40000; i++) names.push_back("model.layers." + std::to_string(i) + ".w");
  std::vector<std::tuple<const char *, uint64_t, int>> ts;
  for (auto &n : names) ts.emplace_back(n.c_str(), 16, 1);
  for (int v = 0; v < 4; v++) Publish(("warm" + std::to_string(v)).c_str(), ts);
  struct rusage before, after;
  getrusage(RUSAGE_SELF, &before);
  for (int v = 0; v < 4; v++) Publish(("steady" + std::to_string(v)).c_str(), ts);
  getrusage(RUSAGE_SELF, &after);
  long faults = after.ru_minflt - before.ru_minflt;
  // Fresh arrays: 40k entries and views, ~2 x 4 MB, each publish.
  EXPECT_LT(faults, 1000) << "minor page faults over 4 steady-state publishes";
}

// Small tensors live in slabs their version holds. One a partial update
// carries over is copied into the new version's slabs, so it survives the
// slabs of the version it came from going back to the pool and being staged
// into again, and memory stays the same however many partial updates come.
// A reader's version keeps its slabs, a relabel shares them.
TEST_F(StoreTest, SmallTensorsCarriedOverOutliveTheirSlabsAndMemoryStaysFlat) {
  std::vector<std::string> names;
  std::vector<std::tuple<const char *, uint64_t, int>> all;
  for (int i = 0; i < 3000; i++) names.push_back("t" + std::to_string(i));
  for (int i = 0; i < 3000; i++) all.emplace_back(names[i].c_str(), 1 + i % 64, i % 250);
  auto fill_of = [](int i, int last) {
    return i < 2 && last > 40 ? 252 : i >= 2 && i <= last ? 251 : i % 250;
  };
  auto partial = [&](int from, int to) {
    for (int v = from; v <= to; v++)
      Publish(("v" + std::to_string(v)).c_str(), {{names[v].c_str(), 1 + v % 64, 251}});
  };
  Publish("v1", all);
  partial(2, 5);
  uint64_t flat = wtx__store_allocated_bytes(s_);
  for (int v = 6; v <= 40; v++) {
    partial(v, v);
    EXPECT_EQ(flat, wtx__store_allocated_bytes(s_)) << "after v" << v;
  }
  wtx_store_view held;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &held));
  partial(41, 44);
  // The first two in the version's order: the rest carried the same way.
  Publish("v45", {{names[0].c_str(), 1, 252}, {names[1].c_str(), 2, 252}});
  partial(43, 44);  // staged into the slabs v44 gave back, which v45 must not use
  char *was = nullptr;
  ASSERT_EQ(0, wtx_store_set_version(s_, "relabelled", &was));
  free(was);
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(3000u, v.n_params);
  EXPECT_STREQ("relabelled", v.version);
  for (int i = 0; i < 3000; i++) {
    EXPECT_TRUE(Filled(v.params[i], fill_of(i, 44))) << names[i];
    EXPECT_EQ(static_cast<uint64_t>(fill_of(i, 44)), v.params[i].xxh3) << names[i];
    EXPECT_EQ(0u, reinterpret_cast<uintptr_t>(v.params[i].data) % 16) << names[i];
    EXPECT_TRUE(Filled(held.params[i], fill_of(i, 40))) << names[i] << " in v40, held";
  }
  wtx_store_release(s_, &v);
  wtx_store_release(s_, &held);
}

TEST_F(StoreTest, NamesOfAHeldVersionOutliveTheVersionsThatSharedThem) {
  Publish("v1", {{"a", 8, 1}, {"b", 8, 1}});
  Publish("v2", {{"a", 8, 2}});  // same names: shares v1's
  wtx_store_view held;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &held));
  Publish("v3", {{"c", 8, 3}});  // a new name: a new layout
  Publish("v4", {{"b", 8, 4}});
  Publish("v5", {{"a", 8, 5}});  // v1..v4 gone, held v2 stays
  ASSERT_EQ(2u, held.n_params);
  EXPECT_STREQ("a", held.params[0].meta.name);
  EXPECT_STREQ("b", held.params[1].meta.name);
  EXPECT_TRUE(Filled(held.params[0], 2));
  wtx_store_release(s_, &held);
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(3u, v.n_params);
  EXPECT_STREQ("c", v.params[2].meta.name);
  EXPECT_TRUE(Filled(v.params[0], 5));
  EXPECT_TRUE(Filled(v.params[1], 4));
  wtx_store_release(s_, &v);
  // The layout check finds every name of the current version.
  char err[256] = "";
  wtx_tensor_meta c = Meta("c", 8);
  EXPECT_EQ(0, wtx_store_check(s_, WTX_TARGET_MAIN, &c, err, sizeof err)) << err;
}

TEST_F(StoreTest, UpdatesInAnyOrderOrPartReplaceExactlyTheirTensors) {
  Publish("v1", {{"a", 8, 1}, {"b", 8, 1}, {"c", 8, 1}});
  // In the published order for one tensor, then out of it: the store
  // switches from positions to its index midway.
  Publish("v2", {{"a", 8, 2}, {"c", 8, 2}, {"b", 8, 3}});
  Publish("v3", {{"a", 8, 4}});               // a prefix, in order
  Publish("v4", {{"c", 8, 5}, {"d", 16, 5}});  // out of order, and a new name
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(4u, v.n_params);
  const char *names[] = {"a", "b", "c", "d"};
  const int fills[] = {4, 3, 5, 5};
  for (size_t i = 0; i < 4; i++) {
    EXPECT_STREQ(names[i], v.params[i].meta.name);
    EXPECT_TRUE(Filled(v.params[i], fills[i])) << names[i];
  }
  EXPECT_EQ(40u, v.total_bytes);
  wtx_store_release(s_, &v);
  // Growing and shrinking versions reuse the previous arrays safely.
  Publish("v5", {{"a", 8, 6}, {"b", 8, 6}, {"c", 8, 6}, {"d", 16, 6}, {"e", 8, 6}});
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(5u, v.n_params);
  EXPECT_STREQ("e", v.params[4].meta.name);
  EXPECT_TRUE(Filled(v.params[4], 6));
  wtx_store_release(s_, &v);
}

// A version describes each tensor as it was staged, never as the version
// before had it: staging in the published order reuses the published
// descriptions only for tensors that are the same (a model calling stage
// without check may change a shape).
TEST_F(StoreTest, ATensorStagedInOrderWithAnotherShapeIsPublishedAsStaged) {
  Publish("v1", {{"a", 8, 1}, {"b", 8, 1}});
  Publish("v2", {{"a", 8, 2}, {"b", 32, 2}});
  Publish("v3", {{"a", 8, 3}});
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(2u, v.n_params);
  EXPECT_EQ(8u, v.params[0].meta.nbytes);
  EXPECT_EQ(32u, v.params[1].meta.nbytes);
  EXPECT_EQ(32u, v.params[1].meta.shape[0]);
  EXPECT_TRUE(Filled(v.params[0], 3));
  EXPECT_TRUE(Filled(v.params[1], 2));
  EXPECT_EQ(40u, v.total_bytes);
  wtx_store_release(s_, &v);
}

// As the session drives a model: each chunk's tensors checked, then
// staged, then loaded, from one array of metas that the next chunk reuses
// for other tensors (the store remembers which meta check matched where,
// so the same address must never stand for a tensor it no longer is).
TEST_F(StoreTest, ChunksCheckedStagedAndLoadedFromOneReusedArrayLandByName) {
  Publish("v1", {{"a", 8, 1}, {"b", 8, 1}, {"c", 8, 1}, {"d", 8, 1}});
  const wtx_model_ops &ops = wtx_store_model_ops;
  wtx_tensor_meta chunk[2];
  auto update = [&](const char *version, std::vector<std::vector<const char *>> chunks,
                    int fill) {
    ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
    for (auto &names : chunks) {
      char err[256] = "";
      for (size_t i = 0; i < names.size(); i++) {
        chunk[i] = Meta(names[i], 8);
        ASSERT_EQ(0, ops.check(s_, WTX_TARGET_MAIN, &chunk[i], err, sizeof err)) << err;
      }
      uint8_t *d[2];
      for (size_t i = 0; i < names.size(); i++) {
        ASSERT_EQ(0, ops.stage(s_, &chunk[i], &d[i]));
        memset(d[i], fill + names[i][0], 8);
      }
      for (size_t k = names.size(); k-- > 0;) {  // loaded in any order
        uint64_t sum = static_cast<uint64_t>(fill + names[k][0]);
        ASSERT_EQ(0, ops.loaded(s_, &chunk[k], &sum));
      }
    }
    ASSERT_EQ(0, ops.commit(s_, version));
  };
  auto expect = [&](int fill) {
    wtx_store_view v;
    ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
    ASSERT_EQ(4u, v.n_params);
    for (size_t i = 0; i < 4; i++) {
      EXPECT_STREQ(std::string(1, static_cast<char>('a' + i)).c_str(), v.params[i].meta.name);
      EXPECT_TRUE(Filled(v.params[i], fill + 'a' + static_cast<int>(i))) << i;
      EXPECT_EQ(static_cast<uint64_t>(fill + 'a' + static_cast<int>(i)), v.params[i].xxh3) << i;
    }
    wtx_store_release(s_, &v);
  };
  update("v2", {{"a", "b"}, {"c", "d"}}, 10);  // in order
  expect(10);
  update("v3", {{"b", "a"}, {"d", "c"}}, 20);  // out of order, same addresses
  expect(20);
  update("v4", {{"a", "b"}, {"d", "c"}}, 30);  // in order, then out of it
  expect(30);
}

// check_range: a position of a table found the same as the model's is not
// compared again while that layout stands (the session never changes a
// table's metas, so the store may trust them); once a publish changes the
// layout, the same table is compared again and its stale tensor refused.
TEST_F(StoreTest, ARangeOfATableIsComparedOnceWhileTheLayoutStands) {
  Publish("v1", {{"a", 8, 1}, {"b", 8, 1}, {"c", 8, 1}});
  const wtx_model_ops &ops = wtx_store_model_ops;
  wtx_tensor_meta table[3] = {Meta("a", 8), Meta("b", 8), Meta("c", 8)};
  auto by_range = [&](uint64_t id, const char *version, int fill) {
    char err[256] = "";
    size_t bad = 99;
    ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
    for (size_t first : {0, 2}) {  // two chunks: [0, 2) and [2, 3)
      size_t n = first == 0 ? 2 : 1;
      ASSERT_EQ(0, ops.check_range(s_, WTX_TARGET_MAIN, id, first, &table[first], n, &bad, err,
                                   sizeof err)) << err;
      for (size_t i = first; i < first + n; i++) {
        uint8_t *d = nullptr;
        ASSERT_EQ(0, ops.stage(s_, &table[i], &d));
        memset(d, fill, 8);
        uint64_t sum = static_cast<uint64_t>(fill);
        ASSERT_EQ(0, ops.loaded(s_, &table[i], &sum));
      }
    }
    ASSERT_EQ(0, ops.commit(s_, version));
  };
  by_range(7, "v2", 2);  // compared, and found the same
  // Trusted now: the store does not read what it found the same (here the
  // metas are made wrong behind its back, which a session never does).
  table[1].name = "not-b";
  ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
  char err[256] = "";
  size_t bad = 99;
  EXPECT_EQ(0, ops.check_range(s_, WTX_TARGET_MAIN, 7, 0, table, 3, &bad, err, sizeof err));
  // Another table is compared: the same metas are refused, by name.
  EXPECT_EQ(WTX_ENOENT, ops.check_range(s_, WTX_TARGET_MAIN, 8, 0, table, 3, &bad, err,
                                        sizeof err));
  EXPECT_EQ(1u, bad);
  EXPECT_STREQ("parameter 'not-b' is not in the model (3 parameters)", err);
  ops.abort(s_);
  table[1].name = "b";
  by_range(7, "v3", 3);
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(3u, v.n_params);
  EXPECT_STREQ("v3", v.version);
  for (size_t i = 0; i < 3; i++) EXPECT_TRUE(Filled(v.params[i], 3)) << i;
  wtx_store_release(s_, &v);

  // b becomes 16 bytes: the layout changes, and table 7's b is refused.
  Publish("v4", {{"b", 16, 4}});
  ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
  EXPECT_EQ(WTX_EINVAL, ops.check_range(s_, WTX_TARGET_MAIN, 7, 0, table, 3, &bad, err,
                                        sizeof err));
  EXPECT_EQ(1u, bad);
  EXPECT_STREQ("parameter 'b': shape [8] UINT8, the model holds shape [16] UINT8", err);
  ops.abort(s_);
}

// Readers on other threads take and drop versions while updates stage and
// publish: a reader's release returns buffers to the pool while staging
// holds buffers of its own, and every version a reader holds stays whole
// (all its tensors filled with its own byte) until it lets go.
TEST_F(StoreTest, ReadersReleasingWhileUpdatesStageSeeWholeVersions) {
  std::vector<std::string> names;
  for (int i = 0; i < 64; i++) names.push_back("t" + std::to_string(i));
  std::atomic<bool> done{false};
  std::atomic<int> bad{0}, seen{0};
  auto reader = [&] {
    while (!done.load()) {
      wtx_store_view v;
      if (wtx_store_acquire(s_, WTX_TARGET_MAIN, &v) != 0 || v.n_params == 0) continue;
      int fill = v.params[0].data[0];
      for (size_t i = 0; i < v.n_params; i++)
        if (!Filled(v.params[i], fill)) bad++;
      seen++;
      wtx_store_release(s_, &v);
    }
  };
  std::thread r1(reader), r2(reader);
  // At least 300 versions, and on until the readers have held 50 (they
  // may start late on a loaded machine), within a bound.
  for (int v = 1; v <= 300 || (seen.load() < 50 && v <= 200000); v++) {
    std::vector<std::tuple<const char *, uint64_t, int>> ts;
    // Lengths repeat (pool classes shared by many tensors); every seventh
    // version stages out of the published order.
    for (int i = 0; i < 64; i++) {
      int k = v % 7 == 0 ? 63 - i : i;
      ts.emplace_back(names[k].c_str(), 64 + 64 * (k % 5), v % 251);
    }
    Publish(("v" + std::to_string(v)).c_str(), ts);
  }
  done = true;
  r1.join();
  r2.join();
  EXPECT_EQ(0, bad.load());
  EXPECT_GE(seen.load(), 50);
}

TEST_F(StoreTest, ADeclaredLayoutRefusesANameGivenTwice) {
  wtx_tensor_meta m[2] = {Meta("w", 4), Meta("w", 4)};
  EXPECT_EQ(WTX_EINVAL, wtx_store_declare(s_, m, 2));
  EXPECT_EQ(0, wtx_store_declare(s_, m, 1));  // nothing was kept
}

TEST_F(StoreTest, AnAbortKeepsThePublishedBytesAndTheNextUpdateWorks) {
  Publish("v1", {{"a", 64, 7}});
  Stage({{"a", 64, 9}, {"new", 8, 9}});
  wtx_store_model_ops.abort(s_);
  wtx_store_view v;
  wtx_store_acquire(s_, WTX_TARGET_MAIN, &v);
  EXPECT_STREQ("v1", v.version);
  ASSERT_EQ(1u, v.n_params);
  EXPECT_TRUE(Filled(v.params[0], 7));
  wtx_store_release(s_, &v);
  Publish("v2", {{"a", 64, 8}});
  wtx_store_acquire(s_, WTX_TARGET_MAIN, &v);
  EXPECT_STREQ("v2", v.version);
  EXPECT_TRUE(Filled(v.params[0], 8));
  wtx_store_release(s_, &v);
}

TEST_F(StoreTest, RelabelingSharesTheBytesAndKeepsTheGeneration) {
  Publish("v1", {{"a", 64, 7}});
  wtx_store_view before;
  wtx_store_acquire(s_, WTX_TARGET_MAIN, &before);
  char *prev = nullptr;
  ASSERT_EQ(0, wtx_store_set_version(s_, "step-9", &prev));
  EXPECT_STREQ("v1", prev);
  free(prev);
  wtx_store_view after;
  wtx_store_acquire(s_, WTX_TARGET_MAIN, &after);
  EXPECT_STREQ("step-9", after.version);
  EXPECT_STREQ("v1", before.version);  // a reader keeps its label
  EXPECT_EQ(before.generation, after.generation);
  EXPECT_EQ(before.params[0].data, after.params[0].data);  // no copy
  wtx_store_release(s_, &before);
  wtx_store_release(s_, &after);
}

TEST_F(StoreTest, TheLayoutCheckNamesTheTensorAndTheDifference) {
  char err[256] = "";
  wtx_tensor_meta a = Meta("a", 16);
  EXPECT_EQ(0, wtx_store_check(s_, WTX_TARGET_MAIN, &a, err, sizeof err));  // no layout yet
  ASSERT_EQ(0, wtx_store_declare(s_, &a, 1));
  wtx_tensor_meta other = Meta("zz", 16), shorter = Meta("a", 15);
  EXPECT_EQ(WTX_ENOENT, wtx_store_check(s_, WTX_TARGET_MAIN, &other, err, sizeof err));
  EXPECT_STREQ("parameter 'zz' is not in the model (1 parameters)", err);
  EXPECT_EQ(WTX_EINVAL, wtx_store_check(s_, WTX_TARGET_MAIN, &shorter, err, sizeof err));
  EXPECT_STREQ("parameter 'a': shape [15] UINT8, the model holds shape [16] UINT8", err);
  EXPECT_EQ(0, wtx_store_check(s_, WTX_TARGET_MAIN, &a, err, sizeof err));
  // The draft model has no declared layout: anything goes until it publishes.
  EXPECT_EQ(0, wtx_store_check(s_, WTX_TARGET_DRAFT, &other, err, sizeof err));
  EXPECT_EQ(WTX_ESTATE, wtx_store_declare(s_, &a, 1));  // declared once
}

}  // namespace

namespace {

// The first version's layout takes over the index staging built of its
// names: prepared twice, or prepared then aborted, no name is lost or freed
// under the store (ASan runs this too), and lookups by name work after.
TEST_F(StoreTest, AFirstVersionPreparedTwiceOrAbortedKeepsItsNames) {
  char err[256] = "";
  Stage({{"x.weight", 8, 1}, {"y.weight", 4, 2}});
  ASSERT_EQ(0, wtx_store_model_ops.prepare(s_, "first", err, sizeof err)) << err;
  wtx_store_model_ops.abort(s_);
  Stage({{"x.weight", 8, 3}, {"y.weight", 4, 4}, {"z.weight", 2, 5}});
  ASSERT_EQ(0, wtx_store_model_ops.prepare(s_, "v1", err, sizeof err)) << err;
  ASSERT_EQ(0, wtx_store_model_ops.prepare(s_, "v1", err, sizeof err)) << err;
  ASSERT_EQ(0, wtx_store_model_ops.commit(s_, "v1"));
  // A check by name (the index) and an update out of order (the names).
  wtx_tensor_meta z = Meta("z.weight", 2);
  EXPECT_EQ(0, wtx_store_model_ops.check(s_, WTX_TARGET_MAIN, &z, err, sizeof err)) << err;
  Publish("v2", {{"z.weight", 2, 6}, {"x.weight", 8, 7}});
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(3u, v.n_params);
  const char *want[3] = {"x.weight", "y.weight", "z.weight"};
  const int fill[3] = {7, 4, 6};
  for (int i = 0; i < 3; i++) {
    EXPECT_STREQ(want[i], v.params[i].meta.name);
    EXPECT_TRUE(Filled(v.params[i], fill[i])) << want[i];
  }
  wtx_store_release(s_, &v);
}

// A first version's prepare makes what staging described its layout, not a
// copy: after it the update's tensors are fixed. Another tensor staged then
// is refused (nothing else changes), a tensor loaded again is still found
// by name, the prepared version publishes whole, and the next update (a
// merge, out of order) names every tensor right, after the staging that
// described the first one has been reused.
TEST_F(StoreTest, AFirstVersionPreparedIsFixedAndItsLayoutOutlivesItsStaging) {
  const wtx_model_ops &ops = wtx_store_model_ops;
  char err[256] = "";
  Stage({{"a", 8, 1}, {"b", 4, 2}, {"c", 2, 3}});
  ASSERT_EQ(0, ops.prepare(s_, "v1", err, sizeof err)) << err;
  wtx_tensor_meta d = Meta("d", 4);
  uint8_t *dst = nullptr;
  EXPECT_EQ(WTX_ESTATE, ops.stage(s_, &d, &dst));
  wtx_tensor_meta b = Meta("b", 4);
  uint64_t sum = 2;
  EXPECT_EQ(0, ops.loaded(s_, &b, &sum));  // by name, through the prepared layout
  ASSERT_EQ(0, ops.commit(s_, "v1"));
  Publish("v2", {{"c", 2, 6}, {"e", 16, 7}, {"a", 8, 5}});
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  const char *want[4] = {"a", "b", "c", "e"};
  const int fill[4] = {5, 2, 6, 7};
  ASSERT_EQ(4u, v.n_params);
  for (int i = 0; i < 4; i++) {
    EXPECT_STREQ(want[i], v.params[i].meta.name);
    EXPECT_TRUE(Filled(v.params[i], fill[i])) << want[i];
  }
  EXPECT_EQ(30u, v.total_bytes);
  wtx_store_release(s_, &v);
  wtx_tensor_meta e = Meta("e", 16);
  EXPECT_EQ(0, ops.check(s_, WTX_TARGET_MAIN, &e, err, sizeof err)) << err;
}

// A first version (nothing published, so no order to follow) keeps its
// own copies of the names it was staged with: the caller's go as each
// chunk ends (the session's are in the call's request), here overwritten
// at once. Its index comes at prepare, which finds a name staged twice.
TEST_F(StoreTest, AFirstVersionNamesItsTensorsWithItsOwnCopies) {
  const wtx_model_ops &ops = wtx_store_model_ops;
  char names[2][32];
  wtx_tensor_meta chunk[2];
  auto stage_chunk = [&](const char *a, const char *b, int fill) {
    snprintf(names[0], sizeof names[0], "%s", a);
    snprintf(names[1], sizeof names[1], "%s", b);
    for (int i = 0; i < 2; i++) {
      chunk[i] = Meta(names[i], 4);
      uint8_t *d = nullptr;
      ASSERT_EQ(0, ops.stage(s_, &chunk[i], &d));
      memset(d, fill + i, 4);
    }
    for (int i = 0; i < 2; i++) {
      uint64_t sum = static_cast<uint64_t>(fill + i);
      ASSERT_EQ(0, ops.loaded(s_, &chunk[i], &sum));
    }
    memset(names, 'z', sizeof names);  // the chunk's request is gone
  };
  char err[256] = "";
  ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
  stage_chunk("layers.0.w", "layers.0.b", 1);
  stage_chunk("layers.1.w", "layers.0.w", 3);  // a name staged twice
  EXPECT_EQ(WTX_EEXIST, ops.prepare(s_, "v1", err, sizeof err));
  ops.abort(s_);
  ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
  stage_chunk("layers.0.w", "layers.0.b", 1);
  stage_chunk("layers.1.w", "layers.1.b", 3);
  ASSERT_EQ(0, ops.prepare(s_, "v1", err, sizeof err)) << err;
  ASSERT_EQ(0, ops.commit(s_, "v1"));
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(s_, WTX_TARGET_MAIN, &v));
  ASSERT_EQ(4u, v.n_params);
  const char *want[4] = {"layers.0.w", "layers.0.b", "layers.1.w", "layers.1.b"};
  const int fill[4] = {1, 2, 3, 4};
  for (int i = 0; i < 4; i++) {
    EXPECT_STREQ(want[i], v.params[i].meta.name);
    EXPECT_TRUE(Filled(v.params[i], fill[i])) << want[i];
  }
  wtx_store_release(s_, &v);
  wtx_tensor_meta found = Meta("layers.1.w", 4);  // found by name
  EXPECT_EQ(0, ops.check(s_, WTX_TARGET_MAIN, &found, err, sizeof err)) << err;
}

TEST_F(StoreTest, PrepareFindsAFirstVersionMissingADeclaredTensorAndCommitCannotFail) {
  wtx_tensor_meta decl[2] = {Meta("a", 16), Meta("b", 8)};
  ASSERT_EQ(0, wtx_store_declare(s_, decl, 2));
  Stage({{"a", 16, 1}});
  char err[256] = "";
  EXPECT_EQ(WTX_ENOENT, wtx_store_model_ops.prepare(s_, "v1", err, sizeof err));
  EXPECT_STREQ("the first version must hold every parameter of the model spec; 'b' is "
               "missing (1 of 2 sent)", err);
  wtx_store_model_ops.abort(s_);
  Stage({{"a", 16, 1}, {"b", 8, 2}});
  ASSERT_EQ(0, wtx_store_model_ops.prepare(s_, "v1", err, sizeof err)) << err;
  wtx_store_view v;
  wtx_store_acquire(s_, WTX_TARGET_MAIN, &v);
  EXPECT_EQ(0u, v.n_params);  // prepared is not published
  wtx_store_release(s_, &v);
  EXPECT_EQ(0, wtx_store_model_ops.commit(s_, "v1"));
  wtx_store_acquire(s_, WTX_TARGET_MAIN, &v);
  EXPECT_STREQ("v1", v.version);
  EXPECT_EQ(2u, v.n_params);
  wtx_store_release(s_, &v);
  // Later versions may be partial: the rest carries over.
  Stage({{"b", 8, 3}});
  ASSERT_EQ(0, wtx_store_model_ops.prepare(s_, "v2", err, sizeof err)) << err;
  EXPECT_EQ(0, wtx_store_model_ops.commit(s_, "v2"));
}

}  // namespace
