// One trainer rank of many_test, as a process of its own (so a test can
// kill it mid-sync): it holds only its part of the Llama model of llama.h,
// under wtxtest::OwnersOf, and syncs it to the workers when told.
//
//   many_rank RANK WORLD RANK_ADDRESSES(comma) WORKERS(comma) TOKEN TIMEOUT_MS [other]
//
// "other": this rank believes another ownership than the rest (OwnersOf's
// other), so its plan differs.
// It initializes its trainer, prints "ready" (or "fail RC MESSAGE"), then
// takes one command a line on stdin:
//   sync SEED VERSION  its part of Llama(SEED), sent as VERSION; prints
//                      "ok BYTES CONTROL DELTA PARAMS PATCHED" (this rank's
//                      bytes, rank 0's UpdateInfo bytes, whether the sync
//                      was a delta, the parameters it sent, the pieces it
//                      sent as patches) or "fail RC MESSAGE".
//   bump SEED VERSION NAME BYTE [NAME BYTE ...]   the same, of Llama(SEED)
//                      with byte BYTE of tensor NAME changed (Llama::Bump),
//                      each pair; BYTE as FIRST+COUNT: COUNT bytes from
//                      FIRST.
//   draft SEED VERSION the same as sync, to the workers' draft model.
//   failsync SEED VERSION  the same as sync, but on rank 0 its source fails
//                      the sync's pass (after rank 0's go, before its ask).
//   patch SEED VERSION NAME BYTE [NAME BYTE ...]   the caller's patches
//                      (wtx_trainer_send_patches), on every rank: of each
//                      NAME, the elements holding the bytes BYTE (as bump
//                      names them) with Llama(SEED)'s values bumped; BYTE
//                      "past": one index past the tensor's end. Prints as
//                      sync; the rank's part becomes Llama(SEED) bumped.
// WTX_MANY_DELTA=1: the trainer sends deltas (WTX_DELTA_TENSORS); =patches:
// with patches (WTX_DELTA_PATCHES).
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/client/llama.h"
#include "transport/plan.h"

namespace {

// The rank's memory source, whose next pass fails when told (failsync).
struct Failing {
  wtx_source *inner = nullptr;
  bool fail_next = false;
  static int Metadata(void *self, const wtx_tensor_meta **metas, size_t *n) {
    return wtx_source_metadata(static_cast<Failing *>(self)->inner, metas, n);
  }
  static int Open(void *self, void **iter) {
    auto *s = static_cast<Failing *>(self);
    if (s->fail_next) {
      s->fail_next = false;
      return WTX_EIO;
    }
    return wtx_source_open(s->inner, iter);
  }
  // The memory source's parts stay put until close, as it says
  // (WTX_NEXT_STAYS), which wtx_source_next reports as a tensor: said
  // again, so the ranks send from them as they do without the wrapper.
  static int Next(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data) {
    int r = wtx_source_next(static_cast<Failing *>(self)->inner, iter, meta, data);
    return r == WTX_NEXT_TENSOR ? WTX_NEXT_STAYS : r;
  }
  static void Close(void *self, void *iter) {
    wtx_source_close(static_cast<Failing *>(self)->inner, iter);
  }
  static void Destroy(void *) {}
  static int Ownership(void *self, const wtx_ownership **owners, size_t *n) {
    return wtx_source_ownership(static_cast<Failing *>(self)->inner, owners, n);
  }
};

const wtx_source_ops kFailingOps = {WTX_SOURCE_OPS_VERSION, "failing", Failing::Metadata,
                                    Failing::Open, Failing::Next, Failing::Close,
                                    Failing::Destroy, nullptr, Failing::Ownership};

std::vector<std::string> Split(const std::string &s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');) out.push_back(x);
  return out;
}

// This rank's part of every tensor of model, into parts (the source's
// memory, rewritten in place for each sync).
bool g_other = false;
// WTX_MANY_LAYOUT=rows: OwnersOf's row-parallel layer 1, in small buffers,
// so its boxes are cut across chunks.
bool g_rows = false;

void FillParts(const wtxtest::Llama &model, uint32_t rank,
               std::vector<std::vector<uint8_t>> *parts) {
  parts->resize(model.t.size());
  for (size_t i = 0; i < model.t.size(); i++) {
    const wtxtest::Tensor &x = model.t[i];
    wtx_ownership o = wtxtest::OwnersOf(x.name, g_other, g_rows);
    wtx_tensor_meta m;
    char why[256];
    wtx_tensor_meta_set(&m, x.name.c_str(), x.dtype, x.shape.data(), x.shape.size(), why,
                        sizeof why);
    wtx_box whole, mine;
    wtx_box_whole(&m, &whole);
    if (!wtx_ownership_rank_box(&m, &o, rank, &mine)) continue;
    (*parts)[i].resize(wtx_box_elements(&mine) * x.Elsize());
    wtx_box_copy((*parts)[i].data(), nullptr, x.data.data(), &whole, &mine, x.Elsize());
  }
}

// The caller's patches of next's tensors at the elements touched names
// (an index past a tensor's end has a zero value), sent.
int SendPatches(wtx_trainer *t, const wtxtest::Llama &next,
                const std::map<std::string, std::set<uint64_t>> &touched,
                const wtx_send_options *so, wtx_send_result *res) {
  std::vector<wtx_patch> patches;
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<uint8_t>> val;
  for (const auto &[name, elements] : touched) {
    const wtxtest::Tensor *x = next.Find(name);
    size_t es = x->Elsize(), n = x->data.size() / es;
    idx.emplace_back(elements.begin(), elements.end());
    val.emplace_back();
    for (uint64_t e : elements) {
      const uint8_t *v = &x->data[(e < n ? e : 0) * es];
      val.back().insert(val.back().end(), v, v + es);
      if (e >= n) std::fill(val.back().end() - es, val.back().end(), 0);
    }
    patches.push_back({x->name.c_str(), x->dtype, x->shape.data(), x->shape.size(),
                       WTX_DTYPE_INT64, idx.back().size(), idx.back().data(),
                       val.back().data()});
  }
  return wtx_trainer_send_patches(t, patches.data(), patches.size(), so, res);
}

}  // namespace

int main(int argc, char **argv) {
  g_other = argc == 8 && std::string(argv[7]) == "other";
  const char *layout = getenv("WTX_MANY_LAYOUT");
  g_rows = layout != nullptr && std::string(layout) == "rows";
  if (argc != 7 && !g_other) {
    std::fprintf(stderr, "usage: many_rank RANK WORLD RANKS WORKERS TOKEN TIMEOUT_MS\n");
    return 2;
  }
  uint32_t rank = std::stoul(argv[1]), world = std::stoul(argv[2]);
  std::vector<std::string> ranks = Split(argv[3]), workers = Split(argv[4]);
  std::vector<const char *> ra, wa;
  for (auto &r : ranks) ra.push_back(r.c_str());
  for (auto &w : workers) wa.push_back(w.c_str());
  wtxtest::Llama model(1);
  std::vector<std::vector<uint8_t>> parts;
  FillParts(model, rank, &parts);
  std::vector<wtx_ownership> owners;
  std::vector<wtx_memory_tensor> mem = model.mem;
  for (size_t i = 0; i < mem.size(); i++) {
    owners.push_back(wtxtest::OwnersOf(model.t[i].name, g_other, g_rows));
    mem[i].data = parts[i].empty() ? nullptr : parts[i].data();
  }
  char err[2048] = "";
  wtx_source *src = nullptr;
  wtx_client *c = nullptr;
  wtx_trainer *t = nullptr;
  wtx_client_options co = WTX_CLIENT_OPTIONS_INIT;
  co.timeout_ms = 60000;
  wtx_trainer_config cfg = WTX_TRAINER_CONFIG_INIT;
  const char *backend = getenv("WTX_MANY_BACKEND");  // the test's choice; tcp by default
  cfg.backend = backend != nullptr ? backend : "tcp";
  cfg.rank = rank;
  cfg.world = world;
  cfg.rank_addresses = ra.data();
  cfg.session_token = argv[5];
  cfg.timeout_ms = std::stoul(argv[6]);
  cfg.buffer_size = g_rows ? 1024 : 4096;  // many chunks, and tensors cut across them
  cfg.checksum = WTX_CHECKSUM_XXH3_64;
  const char *delta = getenv("WTX_MANY_DELTA");
  if (delta != nullptr && std::string(delta) == "1") cfg.delta = WTX_DELTA_TENSORS;
  if (delta != nullptr && std::string(delta) == "patches") cfg.delta = WTX_DELTA_PATCHES;
  Failing failing;
  int rc = wtx_source_memory_owned(mem.data(), owners.data(), mem.size(), rank,
                                   &failing.inner, err, sizeof err);
  if (rc == 0) rc = wtx_source_create(&kFailingOps, &failing, &src);
  if (rc == 0) rc = wtx_client_create(wa.data(), wa.size(), &co, &c, err, sizeof err);
  if (rc == 0) rc = wtx_trainer_init(&cfg, c, src, &t, err, sizeof err);
  if (rc != 0) {
    std::printf("fail %d %s\n", rc, err);
    std::fflush(stdout);
    wtx_client_destroy(c);
    wtx_source_destroy(src);
    wtx_source_destroy(failing.inner);
    return 1;
  }
  std::printf("ready\n");
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
    std::stringstream in(line);
    std::string cmd, version, name, bytes;
    int seed = 0;
    in >> cmd >> seed >> version;
    if (cmd == "failsync") {
      failing.fail_next = rank == 0;
      cmd = "sync";
    }
    if (cmd != "sync" && cmd != "bump" && cmd != "draft" && cmd != "patch") continue;
    wtxtest::Llama next(static_cast<uint8_t>(seed));
    std::map<std::string, std::set<uint64_t>> touched;  // patch: elements by tensor
    while ((cmd == "bump" || cmd == "patch") && in >> name >> bytes) {
      const wtxtest::Tensor *x = next.Find(name);
      if (bytes == "past" && x != nullptr) {
        touched[name].insert(x->data.size() / x->Elsize());
        continue;
      }
      size_t plus = bytes.find('+'), first = std::stoul(bytes.substr(0, plus));
      size_t count = plus == std::string::npos ? 1 : std::stoul(bytes.substr(plus + 1));
      for (size_t b = first; b < first + count; b++) next.Bump(name, b);
      for (size_t b = first; x != nullptr && b < first + count; b++)
        touched[name].insert(b / x->Elsize());
    }
    std::vector<std::vector<uint8_t>> fresh;
    FillParts(next, rank, &fresh);
    for (size_t i = 0; i < parts.size(); i++)
      if (!parts[i].empty()) std::memcpy(parts[i].data(), fresh[i].data(), parts[i].size());
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = version.c_str();
    if (cmd == "draft") so.target = WTX_TARGET_DRAFT;
    wtx_send_result res;
    if (cmd == "patch") rc = SendPatches(t, next, touched, &so, &res);
    else rc = wtx_trainer_send_weights(t, &so, &res);
    if (rc == 0)
      std::printf("ok %llu %llu %d %zu %zu\n", static_cast<unsigned long long>(res.bytes),
                  static_cast<unsigned long long>(res.control_bytes), res.delta, res.params,
                  res.patched_params);
    else std::printf("fail %d %s\n", rc, wtx_trainer_last_error(t));
    std::fflush(stdout);
  }
  wtx_trainer_shutdown(t);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
  wtx_source_destroy(failing.inner);
  return 0;
}
