// Many senders (client/many.c): four trainer ranks, each a process holding
// only its part of a Llama-shaped model (tests/client/many_rank.cc), sync it
// over tcp to two tensor-parallel wtx-worker processes and a whole replica.
// Every worker's tensors are checked against hashes the test computes from
// the full tensors by itself; no byte is relayed; a rank killed mid-sync
// leaves every worker on its version and the next sync lands.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/client/llama.h"
#include "tests/client/vllm_standin.h"

namespace {

using wtxtest::Llama;
using wtxtest::Worker;

const char kToken[] = "many-test-session-token";

// A trainer rank's process: its stdin and stdout.
struct Rank {
  pid_t pid = -1;
  FILE *in = nullptr, *out = nullptr;
};

class ManyTest : public wtxtest::ShardedFixture {
 protected:
  void SetUp() override {
    ShardedFixture::SetUp();
    // A rank that died answers a write to its stdin with EPIPE, a failure
    // of the test that wrote, not a signal that ends every test.
    signal(SIGPIPE, SIG_IGN);
    backend_ = "tcp";
    for (int r = 0; r < 4; r++) ports_.push_back(FreePort());
  }
  void TearDown() override {
    for (Rank &r : ranks_) Finish(r);
    ShardedFixture::TearDown();
  }

  // A port free now, below the kernel's ephemeral range (32768 on), so
  // that no connection or port-0 listener of the test takes it before the
  // rank listens on it; and not another rank's (closed again, it is free
  // to bind here until that rank listens).
  int FreePort() const {
    static unsigned seed = static_cast<unsigned>(getpid());
    for (;;) {
      int port = 20000 + static_cast<int>(rand_r(&seed) % 12000);
      if (std::find(ports_.begin(), ports_.end(), port) != ports_.end()) continue;
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(port));
      int ok = bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0;
      close(fd);
      if (ok) return port;
    }
  }
  std::string RankAddr(int r) const { return "127.0.0.1:" + std::to_string(ports_[r]); }

  // Starts rank r of 4 against workers ws; it answers "ready" once its
  // trainer is initialized. Its timeout bounds every wait of its trainer
  // and of the workers' sessions; generous, for a loaded machine, since
  // no test but one waits it out.
  Rank Start(int r, const std::vector<Worker> &ws, int timeout_ms = 20000, bool other = false) {
    // Over nccl each rank has a GPU of its own on the double (its UUID;
    // the workers take GPUs 1.. by ordinal) and names the backend.
    std::vector<std::string> env_s;
    for (char **e = environ; *e != nullptr; e++) env_s.emplace_back(*e);
    if (backend_ != "tcp") env_s.push_back("WTX_MANY_BACKEND=" + backend_);
    if (delta_) env_s.push_back(patches_ ? "WTX_MANY_DELTA=patches" : "WTX_MANY_DELTA=1");
    if (rows_) env_s.push_back("WTX_MANY_LAYOUT=rows");
    if (backend_ == "nccl") {
      env_s.push_back("WTX_CUDA_DEVICE=0");
      env_s.push_back("WTX_FAKE_CUDA_UUID=" + std::string(31, 'a') + std::to_string(r));
    }
    std::vector<char *> envp;
    for (auto &e : env_s) envp.push_back(const_cast<char *>(e.c_str()));
    envp.push_back(nullptr);
    std::string ranks, workers;
    for (int k = 0; k < 4; k++) ranks += (k ? "," : "") + RankAddr(k);
    for (const Worker &w : ws) workers += (workers.empty() ? "" : ",") + w.addr();
    std::vector<std::string> args = {"tests/client/many_rank", std::to_string(r), "4", ranks,
                                     workers, kToken, std::to_string(timeout_ms)};
    if (other) args.push_back("other");
    int to[2], from[2];
    EXPECT_EQ(0, pipe2(to, O_CLOEXEC));
    EXPECT_EQ(0, pipe2(from, O_CLOEXEC));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from[1], 1);
    std::vector<char *> argv;
    for (auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
    argv.push_back(nullptr);
    Rank k;
    EXPECT_EQ(0, posix_spawn(&k.pid, argv[0], &fa, nullptr, argv.data(), envp.data()));
    posix_spawn_file_actions_destroy(&fa);
    close(to[0]);
    close(from[1]);
    k.in = fdopen(to[1], "w");
    k.out = fdopen(from[0], "r");
    ranks_.push_back(k);
    return k;
  }
  // The rank's next line, waiting at most 60 s ("" when none came).
  static std::string Line(Rank &k) {
    pollfd p = {fileno(k.out), POLLIN, 0};
    char buf[4096];
    if (poll(&p, 1, 60000) != 1 || fgets(buf, sizeof buf, k.out) == nullptr) return "";
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  static void Say(Rank &k, const std::string &cmd) {
    fprintf(k.in, "%s\n", cmd.c_str());
    fflush(k.in);
  }
  // Its stdin closed, a rank shuts its trainer down and must exit with
  // code (0: its init worked; 1: it failed) within 30 s; under ASan a leak
  // at exit is another status.
  static void Finish(Rank &k, int code = 0) {
    if (k.pid <= 0) return;
    fclose(k.in);
    ExpectExit(k.pid, code, "rank, its stdin closed");
    fclose(k.out);
    k.pid = -1;
  }
  static void Kill(Rank &k) {
    if (k.pid <= 0) return;
    kill(k.pid, SIGKILL);
    int st;
    waitpid(k.pid, &st, 0);
    fclose(k.in);
    fclose(k.out);
    k.pid = -1;
  }
  // Starts ranks 0..3 and waits for every one to be ready.
  void StartAll(const std::vector<Worker> &ws) {
    for (int r = 0; r < 4; r++) Start(r, ws);
    for (int r = 0; r < 4; r++) ASSERT_EQ("ready", Line(ranks_[r])) << "rank " << r;
  }
  // One sync on every rank (cmd: sync, or bump with its NAME BYTE; or
  // patch, the caller's patches); each rank's answer.
  std::vector<std::string> SyncAll(int seed, const std::string &v,
                                   const std::string &bump = "", const char *how = "bump ") {
    std::vector<std::string> got;
    std::string verb = bump.empty() && std::string(how) == "bump " ? "sync " : how;
    std::string cmd = verb + std::to_string(seed) + " " + v;
    for (int r = 0; r < 4; r++) Say(ranks_[r], bump.empty() ? cmd : cmd + " " + bump);
    for (int r = 0; r < 4; r++) got.push_back(Line(ranks_[r]));
    return got;
  }
  // An element of each rank's, as bump takes them: up_proj's rows over
  // ranks 0 and 1, layer 1's tensors (each sent by rank 2 or 3) and
  // model.scale (rank 3's).
  static std::string EachRanksBumps() {
    return "model.layers.0.mlp.up_proj.weight 10 model.layers.0.mlp.up_proj.weight 3202 "
           "model.layers.1.mlp.up_proj.weight 3202 model.layers.1.self_attn.q_proj.weight 0 "
           "model.scale 0";
  }
  // Waits (30 s at most) until w's session is receiving an update.
  bool Updating(const Worker &w) {
    wtx_client *c = Client({w});
    bool updating = false;
    for (int i = 0; i < 3000 && !updating; i++) {
      wtx_weight_info info;
      updating = wtx_client_weight_info(c, 0, 0, &info) == 0 &&
                 info.state == WTX_SESSION_UPDATING;
      wtx_weight_info_free(&info);
      if (!updating) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    wtx_client_destroy(c);
    return updating;
  }
  // Field i (from 1) of a rank's "ok BYTES CONTROL DELTA PARAMS PATCHED".
  static uint64_t Field(const std::string &line, int i) {
    EXPECT_EQ(0u, line.rfind("ok ", 0)) << line;
    std::stringstream in(line.substr(std::min<size_t>(3, line.size())));
    uint64_t x = 0;
    for (int k = 0; k < i && (in >> x); k++) {
    }
    return x;
  }
  // Bytes the rank sent; the control plane's (rank 0's UpdateInfo); 1
  // when the sync was a delta; the parameters it sent.
  static uint64_t Sent(const std::string &line) { return Field(line, 1); }
  static uint64_t Control(const std::string &line) { return Field(line, 2); }
  static uint64_t Delta(const std::string &line) { return Field(line, 3); }
  static uint64_t Params(const std::string &line) { return Field(line, 4); }
  static uint64_t Patched(const std::string &line) { return Field(line, 5); }
  // f summed over the ranks' answers, each of which must be a delta's.
  static uint64_t DeltaSum(const std::vector<std::string> &got,
                           uint64_t (*f)(const std::string &)) {
    uint64_t n = 0;
    for (const std::string &l : got) {
      EXPECT_EQ(1u, Delta(l)) << l;
      n += f(l);
    }
    return n;
  }

  // Two syncs land on every worker, sent once, by the owners; then a rank
  // killed mid-sync leaves every worker on v2, and the next sync lands.
  void SyncsLandAndADeadRankCostsOneSync();
  // Two row-parallel syncs land on 2 tensor-parallel workers and a whole
  // replica on the GPU (gpu_model_worker), whose device bytes are checked.
  void BoxesReachAWorkerStagingOnAGpu();
  // Over shm, to two store-backed tensor-parallel workers and a whole
  // replica whose model reads its tensors in place (host_model_worker
  // with args): syncs land exact, a dead rank costs one sync.
  void AModelThatReadsInPlace(const std::vector<std::string> &args);
  // What every worker must hold once a sync of model lands as v.
  using Hold = std::function<void(const Llama &model, const std::string &v)>;
  // Syncs v1 and v2 (seeds 1 and 2) land on every rank; hold after each.
  void TwoSyncsLand(const Hold &hold) {
    for (int seed = 1; seed <= 2; seed++) {
      Llama model(static_cast<uint8_t>(seed));
      std::string v = "v" + std::to_string(seed);
      std::vector<std::string> got = SyncAll(seed, v);
      for (int r = 0; r < 4; r++) EXPECT_EQ(0u, got[r].rfind("ok", 0)) << "rank " << r << ": " << got[r];
      hold(model, v);
    }
  }
  // After v2: rank 2 killed while sync 3 is under way on worker watched
  // (of ws) fails it on rank 0, and every worker holds v2 still; rank 2
  // started again, sync 3 lands on every rank as v3.
  void ADeadRankCostsOneSync(const std::vector<Worker> &ws, const Worker &watched,
                             const Hold &hold) {
    for (int r : {0, 1, 3}) Say(ranks_[r], "sync 3 v3");
    ASSERT_TRUE(Updating(watched));
    Kill(ranks_[2]);
    EXPECT_EQ(0u, Line(ranks_[0]).rfind("fail", 0));
    for (int r : {1, 3}) Line(ranks_[r]);
    hold(Llama(2), "v2");
    ranks_[2] = Start(2, ws);
    ranks_.pop_back();
    for (int r : {0, 1, 3}) Say(ranks_[r], "sync 3 v3");
    ASSERT_EQ("ready", Line(ranks_[2]));
    Say(ranks_[2], "sync 3 v3");
    for (int r = 0; r < 4; r++) {
      std::string line = Line(ranks_[r]);
      EXPECT_EQ(0u, line.rfind("ok", 0)) << "rank " << r << ": " << line;
    }
    hold(Llama(3), "v3");
  }
  // Deltas: a first sync whole, then only what changed, from every owner
  // of it; a restarted worker takes the whole stream while the others take
  // a delta.
  void DeltasSendOnlyTheChangedTensorsFromEveryOwner();
  // Deltas with patches: what one rank feeds whole goes as a patch of the
  // elements that changed; what several feed, as a patch of the spans
  // that changed, each from its rank.
  // whole_on_gpu: the whole replica stages on its GPU and reads back what
  // it serves (gpu_model_worker --read).
  void PatchesSendTheChangedElementsFromEachRankThatOwnsThem(bool whole_on_gpu = false);
  // What a model worker's --sums (gpu_model_worker, host_model_worker)
  // wrote at its last commit is model, every tensor of it, published as v.
  void ExpectSums(const std::string &sums, const Llama &model, const std::string &v) {
    std::string version;
    std::map<std::string, uint64_t> dev = DeviceSums(sums, &version);
    EXPECT_EQ(v, version);
    EXPECT_EQ(model.t.size(), dev.size()) << v;
    for (const wtxtest::Tensor &x : model.t)
      EXPECT_EQ(XXH3_64bits(x.data.data(), x.data.size()), dev[x.name]) << x.name << " " << v;
  }
  // A rank killed while rank 0 waits for what it changed: rank 0 fails at
  // once naming it, every worker keeps v2, the rank comes back, v3 lands
  // and v4, nothing changed, is a delta that moves nothing.
  void RankKilledMidDelta();
  // A delta sync fails before rank 0's ask reaches the other ranks (a
  // worker restarted, or rank 0's pass failing after its go); the next
  // lands exact.
  void FailBeforeTheAsk(bool restart);
  // The caller's patches: rank 0 sends them all, each worker the part in
  // its tensors; refusals leave the sessions standing, and once they land
  // the ranks' next delta sends whole what it sends.
  void CallerPatchesGoFromRankZeroToEveryWorkersPart();

  std::vector<int> ports_;
  std::vector<Rank> ranks_;
  bool rows_ = false;  // the ranks own layer 1 row-parallel (OwnersOf's rows)
  bool delta_ = false;  // the ranks' trainers send deltas (WTX_MANY_DELTA)
  bool patches_ = false;  // with patches (WTX_DELTA_PATCHES)
};

TEST_F(ManyTest, EveryRankSendsItsOwnBytesStraightToTheWorkersThatHoldThem) {
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  uint64_t first_control = 0;
  for (int seed = 1; seed <= 2; seed++) {
    Llama model(static_cast<uint8_t>(seed));
    std::string v = "v" + std::to_string(seed);
    std::vector<std::string> got = SyncAll(seed, v);
    // The second sync names tensors by position: no per-tensor metadata.
    if (seed == 1) first_control = Control(got[0]);
    if (seed == 2) {
      EXPECT_LT(Control(got[0]) * 2, first_control) << got[0];
    }
    EXPECT_EQ(0u, Control(got[1])) << "only rank 0 calls the workers";
    uint64_t sent = 0;
    for (int r = 0; r < 4; r++) sent += Sent(got[r]);
    uint64_t held = ExpectHolds(r0, 0, model, v) + ExpectHolds(r1, 1, model, v);
    EXPECT_LE(held * 100, 2 * model.total * 55) << "a TP worker holds over 0.55x the model";
    held += ExpectHolds(whole, -1, model, v);
    EXPECT_EQ(held, sent) << "every byte a worker holds was sent once, by one rank";
    EXPECT_LT(Sent(got[0]), model.total) << "rank 0 sends only what it owns";
    EXPECT_GT(Sent(got[3]), 0u) << "a rank that owns bytes sends them";
  }
}

TEST_F(ManyTest, ARankKilledMidSyncLeavesEveryWorkerOnItsVersionAndTheNextSyncLands) {
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  std::vector<Worker> ws = {r0, r1, whole};
  ASSERT_NO_FATAL_FAILURE(StartAll(ws));
  for (const std::string &line : SyncAll(1, "v1")) ASSERT_EQ(0u, line.rfind("ok", 0)) << line;
  // The sync starts without rank 2, which is killed once the workers
  // receive: its connections close under them.
  for (int r : {0, 1, 3}) Say(ranks_[r], "sync 2 v2");
  ASSERT_TRUE(Updating(r0));
  Kill(ranks_[2]);
  std::string err = Line(ranks_[0]);
  EXPECT_EQ(0u, err.rfind("fail", 0)) << err;
  EXPECT_NE(std::string::npos, err.find(RankAddr(2))) << "the error names the dead rank: " << err;
  for (int r : {1, 3}) Line(ranks_[r]);  // each answers, one way or the other
  Llama one(1), two(2);
  ExpectHolds(r0, 0, one, "v1");
  ExpectHolds(r1, 1, one, "v1");
  ExpectHolds(whole, -1, one, "v1");
  // Rank 2 comes back; the next sync lands everywhere.
  ranks_[2] = Start(2, ws);
  ranks_.pop_back();
  for (int r : {0, 1, 3}) Say(ranks_[r], "sync 2 v2");
  ASSERT_EQ("ready", Line(ranks_[2]));
  Say(ranks_[2], "sync 2 v2");
  for (int r = 0; r < 4; r++) EXPECT_EQ(0u, Line(ranks_[r]).rfind("ok", 0)) << "rank " << r;
  ExpectHolds(r0, 0, two, "v2");
  ExpectHolds(r1, 1, two, "v2");
  ExpectHolds(whole, -1, two, "v2");
}

// A worker that restarts loses its session: the next sync fails on rank 0
// at that worker's start, and rank 0 says so to the other ranks on their
// links, so each fails at once saying why, rather than waiting out its
// timeout for workers that will not come. Every worker keeps v1, and the
// sync after lands everywhere.
TEST_F(ManyTest, AWorkerThatRestartedFailsOneSyncOnEveryRankAndTheNextLands) {
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  std::vector<Worker> ws = {r0, r1, whole};
  ASSERT_NO_FATAL_FAILURE(StartAll(ws));
  for (const std::string &line : SyncAll(1, "v1")) ASSERT_EQ(0u, line.rfind("ok", 0)) << line;
  Stop(workers_[1]);
  Worker again = SpawnRank(1, {"--listen", r1.addr()});
  ASSERT_EQ(r1.port, again.port);
  std::vector<std::string> got = SyncAll(2, "v2");
  EXPECT_EQ(0u, got[0].rfind("fail", 0)) << got[0];
  EXPECT_NE(std::string::npos, got[0].find("worker 1 (" + r1.addr() + ")")) << got[0];
  for (int r = 1; r < 4; r++) {
    EXPECT_EQ(0u, got[r].rfind("fail", 0)) << "rank " << r << ": " << got[r];
    EXPECT_NE(std::string::npos, got[r].find("rank 0 ended this sync"))
        << "rank " << r << ": " << got[r];
  }
  Llama one(1), two(2);
  ExpectHolds(r0, 0, one, "v1");
  ExpectHolds(whole, -1, one, "v1");
  for (const std::string &line : SyncAll(2, "v2")) EXPECT_EQ(0u, line.rfind("ok", 0)) << line;
  ExpectHolds(r0, 0, two, "v2");
  ExpectHolds(again, 1, two, "v2");
  ExpectHolds(whole, -1, two, "v2");
}

// Deltas with many senders: every rank hashes the pieces it sends, and rank
// 0 asks them which changed and tells them which tensors each worker gets.
void ManyTest::DeltasSendOnlyTheChangedTensorsFromEveryOwner() {
  delta_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  std::vector<Worker> ws = {r0, r1, whole};
  ASSERT_NO_FATAL_FAILURE(StartAll(ws));
  Llama one(1);
  // This trainer's first sync is whole.
  for (const std::string &l : SyncAll(1, "v1")) EXPECT_EQ(0u, Delta(l)) << l;
  ExpectHolds(r0, 0, one, "v1");
  ExpectHolds(r1, 1, one, "v1");
  ExpectHolds(whole, -1, one, "v1");
  // Nothing changed: nothing moves, and every worker publishes v2.
  for (const std::string &l : SyncAll(1, "v2")) {
    EXPECT_EQ(1u, Delta(l)) << l;
    EXPECT_EQ(0u, Sent(l)) << l;
    EXPECT_EQ(0u, Params(l)) << l;
  }
  ExpectHolds(r0, 0, one, "v2");
  ExpectHolds(r1, 1, one, "v2");
  ExpectHolds(whole, -1, one, "v2");
  // One byte of layer 0's up_proj, in tensor-parallel rank 1's rows: that
  // tensor travels again, to rank 1's worker and the whole replica, from
  // every rank that owns part of it; rank 0's worker gets nothing.
  const std::string name = "model.layers.0.mlp.up_proj.weight";
  const size_t byte = 50 * 32 * 2;  // row 50 of 64 (bf16)
  Llama three(1);
  three.Bump(name, byte);
  std::vector<std::string> got = SyncAll(1, "v3", name + " " + std::to_string(byte));
  uint64_t sent = 0;
  for (const std::string &l : got) {
    EXPECT_EQ(1u, Delta(l)) << l;
    EXPECT_EQ(1u, Params(l)) << l;
    sent += Sent(l);
  }
  std::vector<uint8_t> part;
  std::vector<uint64_t> shape;
  for (const wtxtest::Tensor &x : three.t)
    if (x.name == name) {
      ASSERT_TRUE(wtxtest::Expected(x, 1, &part, &shape));
      EXPECT_EQ(part.size() + x.data.size(), sent) << "the tensor's bytes, once per worker";
    }
  ExpectHolds(r0, 0, three, "v3");
  ExpectHolds(r1, 1, three, "v3");
  ExpectHolds(whole, -1, three, "v3");
  // Rank 1's worker restarts: the sync that finds its session gone fails
  // (every worker keeps v3), and the next sends it the whole stream while
  // the others take a delta.
  Stop(workers_[1]);
  Worker again = SpawnRank(1, {"--listen", r1.addr()});
  ASSERT_EQ(r1.port, again.port);
  Llama four(2);
  got = SyncAll(2, "v4");
  bool failed = got[0].rfind("fail", 0) == 0;
  if (failed) got = SyncAll(2, "v4");
  for (const std::string &l : got) {
    EXPECT_EQ(0u, l.rfind("ok", 0)) << l;
    EXPECT_EQ(0u, Delta(l)) << "a worker took the whole stream: " << l;
  }
  ExpectHolds(r0, 0, four, "v4");
  ExpectHolds(again, 1, four, "v4");
  ExpectHolds(whole, -1, four, "v4");
}

// Patches with many senders: a worker tensor that one piece feeds whole
// (a layer one rank owns, to every worker; the column slice one rank's
// shard covers, to its tensor-parallel worker) travels as a patch of the
// elements that changed, made by that rank from its copy of the piece as
// the workers hold it; one that several ranks feed (a trainer's shards
// of it) as a patch of spans, one from each rank whose shard changed, or,
// where a changed shard has no smaller patch, whole from each.
void ManyTest::PatchesSendTheChangedElementsFromEachRankThatOwnsThem(bool whole_on_gpu) {
  delta_ = patches_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  const std::string sums = dir_ + "/sums";
  if (whole_on_gpu) worker_binary_ = "tests/client/gpu_model_worker";
  Worker whole = whole_on_gpu ? Spawn({"--read", "--sums", sums}) : Spawn();
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  for (const std::string &l : SyncAll(1, "v1")) {
    EXPECT_EQ(0u, Delta(l)) << l;
    EXPECT_EQ(0u, Patched(l)) << l;
  }
  // One element of layer 1's up_proj (replicated on ranks 2 and 3; the
  // plan gives each worker's part to one of them), in tensor-parallel rank
  // 1's rows: a patch to rank 1's worker and one to the whole replica, an
  // int32 index and a bf16 value each.
  const std::string l1 = "model.layers.1.mlp.up_proj.weight";
  const std::string l0 = "model.layers.0.mlp.up_proj.weight";
  const size_t byte = 50 * 32 * 2;  // row 50 of 64
  auto holds = [&](const Llama &model, const std::string &v) {
    ExpectHolds(r0, 0, model, v);
    ExpectHolds(r1, 1, model, v);
    if (whole_on_gpu) ExpectSums(sums, model, v);
    else ExpectHolds(whole, -1, model, v);
  };
  auto patch_l1 = [&](int seed, const std::string &v) {
    Llama model(static_cast<uint8_t>(seed));
    model.Bump(l1, byte);
    std::vector<std::string> got = SyncAll(seed, v, l1 + " " + std::to_string(byte));
    EXPECT_EQ(2u, DeltaSum(got, Patched));
    EXPECT_EQ(2u * (4 + 2), DeltaSum(got, Sent)) << "two patches of one element";
    holds(model, v);
  };
  patch_l1(1, "v2");
  // Layer 1 back as it was, and one element of layer 0's up_proj (Shard(0)
  // over ranks 0 and 1): rank 1's shard is tensor-parallel rank 1's slice,
  // a patch; the whole replica's tensor is a patch of one span, rank 1's
  // (rank 0's shard did not change, and does not travel).
  Llama three(1);
  three.Bump(l0, byte);
  std::vector<std::string> got = SyncAll(1, "v3", l0 + " " + std::to_string(byte));
  EXPECT_EQ(4u, DeltaSum(got, Patched));
  EXPECT_EQ(4u * (4 + 2), DeltaSum(got, Sent)) << "two patches of l1, one of l0, one span of l0";
  EXPECT_EQ(0u, Sent(got[0])) << "rank 0's shard of l0 did not change";
  holds(three, "v3");
  // Another model: every tensor that changed differs almost everywhere,
  // so no patch is smaller and each travels whole, to every worker that
  // holds part of it (those the same in both stay).
  Llama four(2);
  got = SyncAll(2, "v4");
  EXPECT_EQ(0u, DeltaSum(got, Patched));
  uint64_t changed = 0;
  for (size_t i = 0; i < four.t.size(); i++) {
    if (four.t[i].data == three.t[i].data) continue;
    std::vector<uint8_t> part;
    std::vector<uint64_t> shape;
    for (int r : {0, 1})
      if (wtxtest::Expected(four.t[i], r, &part, &shape)) changed += part.size();
    changed += four.t[i].data.size();
  }
  EXPECT_EQ(changed, DeltaSum(got, Sent)) << "the changed tensors whole, once per worker";
  holds(four, "v4");
  // The ranks' copies followed that whole sync: a patch again.
  patch_l1(2, "v5");
  // lm_head is Shard(0) over the four ranks, 24 rows each; tensor-parallel
  // rank 0 holds rows 0-47 (ranks 0 and 1), rank 1 rows 48-95. One element
  // in row 10 (rank 0's) and one in row 60 (rank 2's): each worker's
  // lm_head is a patch of the spans that changed, the whole replica's of
  // two, from two ranks, in two chunks.
  const std::string head = "lm_head.weight";
  const std::string l1_bumped = l1 + " " + std::to_string(byte);
  const std::string six_bumps = l1_bumped + " " + head + " 640 " + head + " 3840";
  Llama six(2);
  six.Bump(l1, byte);
  six.Bump(head, 640);
  six.Bump(head, 3840);
  got = SyncAll(2, "v6", six_bumps);
  EXPECT_EQ(4u, DeltaSum(got, Patched));
  EXPECT_EQ(4u * (4 + 2), DeltaSum(got, Sent)) << "four spans of one element";
  EXPECT_EQ(2u * (4 + 2), Sent(got[0])) << got[0];
  EXPECT_EQ(2u * (4 + 2), Sent(got[2])) << got[2];
  holds(six, "v6");
  // One element in row 30 (rank 1's) and every byte of rank 3's rows:
  // rank 3 has no smaller patch, so the whole replica's lm_head and
  // tensor-parallel rank 1's travel whole, from each of their ranks, while
  // rank 0's worker still gets rank 1's span.
  Llama seven(2);
  seven.Bump(l1, byte);
  seven.Bump(head, 640);
  seven.Bump(head, 3840);
  seven.Bump(head, 1920);
  for (size_t b = 72 * 64; b < 96 * 64; b++) seven.Bump(head, b);
  got = SyncAll(2, "v7", six_bumps + " " + head + " 1920 " + head + " 4608+1536");
  EXPECT_EQ(1u, DeltaSum(got, Patched));
  EXPECT_EQ(4u + 2 + 48 * 64 + 96 * 64, DeltaSum(got, Sent))
      << "a span to rank 0's worker, rows 48-95 to rank 1's, every row to the whole replica";
  holds(seven, "v7");
  // Another element of layer 1's up_proj beside every byte of five more
  // of layer 1's tensors, from the same ranks, cut across the 4 KiB
  // buffers: chunks hold a patch and whole tensors, which run on into the
  // next chunk or began in the one before, and the row-parallel workers'
  // parts of o_proj and down_proj (columns, gathered by their rank) share
  // a chunk.
  const std::string p1 = "model.layers.1.";
  const std::vector<std::pair<std::string, size_t>> whole_tensors = {
      {p1 + "self_attn.q_proj.weight", 2048}, {p1 + "self_attn.k_proj.weight", 1024},
      {p1 + "self_attn.v_proj.weight", 1024}, {p1 + "self_attn.o_proj.weight", 2048},
      {p1 + "mlp.down_proj.weight", 4096}};
  Llama eight(2);
  for (size_t b : {size_t{640}, size_t{3840}, size_t{1920}}) eight.Bump(head, b);
  for (size_t b = 72 * 64; b < 96 * 64; b++) eight.Bump(head, b);
  eight.Bump(l1, byte);
  std::string eight_bumps = six_bumps + " " + head + " 1920 " + head + " 4608+1536 " + l1 +
                            " " + std::to_string(byte + 2);
  eight.Bump(l1, byte + 2);
  for (const auto &[name, n] : whole_tensors) {
    eight_bumps += " " + name + " 0+" + std::to_string(n);
    for (size_t b = 0; b < n; b++) eight.Bump(name, b);
  }
  got = SyncAll(2, "v8", eight_bumps);
  EXPECT_EQ(2u, DeltaSum(got, Patched)) << "l1 to rank 1's worker and to the whole replica";
  holds(eight, "v8");
}

// The caller's patches with many senders (wtx_trainer_send_patches, vLLM's
// sparse sender's shape): every rank calls it, and rank 0 alone sends,
// each worker the elements that fall in its tensors.
void ManyTest::CallerPatchesGoFromRankZeroToEveryWorkersPart() {
  delta_ = patches_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  auto holds = [&](const Llama &model, const std::string &v) {
    return ExpectHolds(r0, 0, model, v) + ExpectHolds(r1, 1, model, v) +
           ExpectHolds(whole, -1, model, v);
  };
  auto patch_all = [&](int seed, const std::string &v, const std::string &what) {
    std::vector<std::string> got = SyncAll(seed, v, what, "patch ");
    for (int r = 1; r < 4; r++) EXPECT_EQ("ok 0 0 0 0 0", got[r]) << "rank " << r << " sent";
    return got[0];
  };
  const std::string head = "lm_head.weight", l1 = "model.layers.1.mlp.up_proj.weight";
  // No sync of every rank has made the workers' sessions yet.
  std::string got = patch_all(1, "v0", head + " 640");
  EXPECT_EQ(0u, got.rfind("fail " + std::to_string(WTX_ESTATE) + " ", 0)) << got;
  for (const std::string &l : SyncAll(1, "v1")) EXPECT_EQ(0u, l.rfind("ok", 0)) << l;
  // lm_head is Shard(0) over the four ranks (tensor-parallel rank 0 holds
  // rows 0-47, rank 1 rows 48-95): one element in row 10 and one in row
  // 60; layer 1's up_proj, ranks 2 and 3's: one in row 50 (tensor-parallel
  // rank 1's). Each worker gets its elements, an int32 index and a bf16
  // value each: 1 to rank 0's worker, 2 to rank 1's, 3 to the whole one.
  const std::string bumps = head + " 640 " + head + " 3840 " + l1 + " 3200";
  Llama two(1);
  two.Bump(head, 640);
  two.Bump(head, 3840);
  two.Bump(l1, 3200);
  got = patch_all(1, "v2", bumps);
  EXPECT_EQ(6u * (4 + 2), Sent(got)) << got;
  EXPECT_EQ(1u, Delta(got)) << got;
  EXPECT_EQ(2u, Patched(got)) << got;
  holds(two, "v2");
  // The ranks' records of what the workers hold went with those patches:
  // a delta of Llama(1) as it was sends every tensor whole (skipping one
  // on a record that no longer stands would leave the patched elements)
  // ...
  Llama one(1);
  std::vector<std::string> all = SyncAll(1, "v3");
  uint64_t sent = 0;
  for (const std::string &l : all) {
    EXPECT_EQ(1u, Delta(l)) << l;
    EXPECT_EQ(0u, Patched(l)) << l;
    sent += Sent(l);
  }
  EXPECT_EQ(holds(one, "v3"), sent) << "every tensor, whole, once per worker";
  // ... and the next sends patches again.
  Llama four(1);
  four.Bump(l1, 3202);
  all = SyncAll(1, "v4", l1 + " 3202");
  sent = 0;
  for (const std::string &l : all) sent += Sent(l);
  EXPECT_EQ(2u * (4 + 2), sent) << "one element to rank 1's worker and the whole one";
  holds(four, "v4");
  // Refused before any byte moves, each naming what: an index past the
  // tensor, a worker's part too large for a buffer as a patch (every
  // element of lm_head, to the whole replica). Every worker keeps v4 and
  // its session: the next patches land.
  got = patch_all(1, "v5", head + " past");
  EXPECT_EQ(0u, got.rfind("fail " + std::to_string(WTX_EINVAL) + " ", 0)) << got;
  EXPECT_NE(std::string::npos, got.find("'lm_head.weight': index 0 of 1 is past")) << got;
  got = patch_all(1, "v5", head + " 0+6144");
  EXPECT_EQ(0u, got.rfind("fail " + std::to_string(WTX_ETOOBIG) + " ", 0)) << got;
  EXPECT_NE(std::string::npos, got.find("more than a buffer")) << got;
  holds(four, "v4");
  got = patch_all(1, "v5", l1 + " 3202 " + l1 + " 3202");
  EXPECT_EQ(2u * (4 + 2), Sent(got)) << "l1's element back, to two workers: " << got;
  holds(one, "v5");
  // Rank 1's worker restarts: the patches fail (its session is gone) and
  // every other worker keeps v5; with no sessions standing the next are
  // refused, and a sync of every rank lands (rank 0 closed its links to
  // the others, who take the workers' new connections).
  Stop(workers_[1]);
  Worker again = SpawnRank(1, {"--listen", r1.addr()});
  ASSERT_EQ(r1.port, again.port);
  got = patch_all(1, "v6", head + " 640");
  EXPECT_EQ(0u, got.rfind("fail ", 0)) << got;
  ExpectHolds(r0, 0, one, "v5");
  ExpectHolds(whole, -1, one, "v5");
  got = patch_all(1, "v6", head + " 640");
  EXPECT_EQ(0u, got.rfind("fail " + std::to_string(WTX_ESTATE) + " ", 0)) << got;
  Llama six(2);
  all = SyncAll(2, "v6");
  for (const std::string &l : all) EXPECT_EQ(0u, l.rfind("ok", 0)) << l;
  ExpectHolds(r0, 0, six, "v6");
  ExpectHolds(again, 1, six, "v6");
  ExpectHolds(whole, -1, six, "v6");
}

// On every backend many senders run on (nccl and cuda_ipc on the TEST
// DOUBLE of CUDA and NCCL).
class ManyDeltaTest : public ManyTest {
 protected:
  void SetUp() override {
    ManyTest::SetUp();
    backend_ = GetParam();
  }
};

TEST_P(ManyDeltaTest, ADeltaSendsOnlyTheChangedTensorsFromEveryOwner) {
  DeltasSendOnlyTheChangedTensorsFromEveryOwner();
}

TEST_P(ManyDeltaTest, PatchesSendTheChangedElementsFromEachRankThatOwnsThem) {
  PatchesSendTheChangedElementsFromEachRankThatOwnsThem();
}

// A delta of layer 1's o_proj and down_proj, every byte: each
// tensor-parallel worker keeps columns of both, which their rank gathers
// from its whole tensors, and both parts go to it in one chunk, each with
// its own bytes.
TEST_P(ManyDeltaTest, TwoGatheredPartsInOneChunkEachCarryTheirOwnBytes) {
  delta_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  for (const std::string &l : SyncAll(1, "v1")) ASSERT_EQ(0u, l.rfind("ok", 0)) << l;
  std::string bumps;
  Llama two(1);
  for (const char *n : {"self_attn.o_proj.weight", "mlp.down_proj.weight"}) {
    const std::string name = std::string("model.layers.1.") + n;
    size_t size = two.Find(name)->data.size();
    bumps += (bumps.empty() ? "" : " ") + name + " 0+" + std::to_string(size);
    for (size_t b = 0; b < size; b++) two.Bump(name, b);
  }
  std::vector<std::string> got = SyncAll(1, "v2", bumps);
  EXPECT_EQ(2u * (2048 + 4096), DeltaSum(got, Sent)) << "both, to the whole replica and in parts";
  ExpectHolds(r0, 0, two, "v2");
  ExpectHolds(r1, 1, two, "v2");
  ExpectHolds(whole, -1, two, "v2");
}

// Deltas of random changes, each from the one before: a few tensors, each
// with one byte, a run of bytes or every byte changed (so a patch, a patch
// of spans or boxes, or whole, by what is smaller), in the pipeline and
// the row-parallel layouts, with patches and without, and over nccl with
// the whole replica staging on its GPU. After each, every worker holds
// exactly its part of the model, hashed by the test. The generator's seed
// is fixed: a failure names the changes that made it.
TEST_P(ManyDeltaTest, RandomDeltasKeepEveryWorkerExact) {
  std::mt19937 gen(20261207);
  const std::string binary = worker_binary_, sums = dir_ + "/sums";
  // Over nccl, two more rounds with patches: the whole replica on its GPU.
  int rounds = backend_ == "nccl" ? 6 : 4;
  for (int round = 0; round < rounds; round++) {
    const int layout = round % 2, with_patches = round >= 2;
    const bool on_gpu = round >= 4;
    rows_ = layout == 1;
    delta_ = true;
    patches_ = with_patches == 1;
    ranks_.clear();
    worker_binary_ = binary;
    Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
    if (on_gpu) worker_binary_ = "tests/client/gpu_model_worker";
    Worker whole = on_gpu ? Spawn({"--read", "--sums", sums}) : Spawn();
    ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
    for (const std::string &l : SyncAll(1, "v0")) ASSERT_EQ(0u, l.rfind("ok", 0)) << l;
    const Llama base(1);
    for (int step = 1; step <= 12; step++) {
      Llama model(1);
      std::string bumps;
      int changes = 1 + static_cast<int>(gen() % 12);
      for (int k = 0; k < changes; k++) {
        const wtxtest::Tensor &x = base.t[gen() % base.t.size()];
        size_t n = x.data.size(), first = gen() % n, len = 1;
        int how = static_cast<int>(gen() % 4);  // a byte, a run, every byte (two in four)
        if (how == 1) len = 1 + gen() % (n - first);
        if (how >= 2) first = 0, len = n;
        bumps += (bumps.empty() ? "" : " ") + x.name + " " + std::to_string(first) + "+" +
                 std::to_string(len);
        for (size_t b = first; b < first + len; b++) model.Bump(x.name, b);
      }
      std::string v = "r" + std::to_string(step);
      std::vector<std::string> got = SyncAll(1, v, bumps);
      for (const std::string &l : got) ASSERT_EQ(0u, l.rfind("ok", 0)) << l << " after " << bumps;
      SCOPED_TRACE("layout " + std::to_string(layout) + ", patches " +
                   std::to_string(with_patches) + ", " + v + ": " + bumps);
      ExpectHolds(r0, 0, model, v);
      ExpectHolds(r1, 1, model, v);
      if (on_gpu) ExpectSums(sums, model, v);
      else ExpectHolds(whole, -1, model, v);
    }
    for (Rank &r : ranks_) Finish(r);
    ranks_.clear();
  }
}

TEST_P(ManyDeltaTest, CallerPatchesGoFromRankZeroToEveryWorkersPart) {
  CallerPatchesGoFromRankZeroToEveryWorkersPart();
}

INSTANTIATE_TEST_SUITE_P(Backends, ManyDeltaTest,
                         ::testing::Values("tcp", "shm", "nccl", "cuda_ipc"));

// The patches above with the whole replica staging on its GPU
// (gpu_model_worker --read, over nccl on the TEST DOUBLE): a chunk
// carrying patches comes to the host, where each patch applies to the
// published tensor read back, and every tensor of the chunk then goes to
// its device staging; the replica takes the same patches and bytes as one
// staging on the host. (shm and tcp stage on the host; cuda_ipc's receive
// region is adopted in place, where no patch applies.)
TEST_F(ManyTest, PatchesReachAWorkerStagingOnAGpu) {
  backend_ = "nccl";
  PatchesSendTheChangedElementsFromEachRankThatOwnsThem(true);
}

// A rank killed while rank 0 waits for what it changed: rank 0 fails at
// once naming it, every worker keeps v2, and once it is back (knowing
// nothing of what it sent) the next sync lands.
TEST_F(ManyTest, ARankKilledMidDeltaLeavesEveryWorkerOnItsVersionAndTheNextSyncLands) {
  RankKilledMidDelta();
}

// The same with patches: the ranks' copies written for the lost sync are
// not trusted, the restarted rank starts with none, and once a sync lands
// a changed element goes as a patch again.
TEST_F(ManyTest, ARankKilledMidPatchDeltaLeavesEveryWorkerOnItsVersionAndPatchesResume) {
  patches_ = true;
  RankKilledMidDelta();
  const std::string l1 = "model.layers.1.mlp.up_proj.weight";
  const size_t byte = 50 * 32 * 2;
  Llama five(2);
  five.Bump(l1, byte);
  uint64_t patched = 0, sent = 0;
  for (const std::string &l : SyncAll(2, "v5", l1 + " " + std::to_string(byte))) {
    EXPECT_EQ(1u, Delta(l)) << l;
    patched += Patched(l);
    sent += Sent(l);
  }
  EXPECT_EQ(2u, patched);
  EXPECT_EQ(2u * (4 + 2), sent);
  ExpectHolds(workers_[0], 0, five, "v5");
  ExpectHolds(workers_[1], 1, five, "v5");
  ExpectHolds(workers_[2], -1, five, "v5");
}

void ManyTest::RankKilledMidDelta() {
  delta_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  std::vector<Worker> ws = {r0, r1, whole};
  ASSERT_NO_FATAL_FAILURE(StartAll(ws));
  for (const std::string &line : SyncAll(1, "v1")) ASSERT_EQ(0u, line.rfind("ok", 0)) << line;
  for (const std::string &line : SyncAll(1, "v2")) ASSERT_EQ(1u, Delta(line)) << line;
  for (int r : {0, 1, 3}) Say(ranks_[r], "sync 2 v3");
  ASSERT_TRUE(Updating(r0));
  Kill(ranks_[2]);
  std::string err = Line(ranks_[0]);
  EXPECT_EQ(0u, err.rfind("fail", 0)) << err;
  EXPECT_NE(std::string::npos, err.find(RankAddr(2))) << "the error names the dead rank: " << err;
  for (int r : {1, 3}) EXPECT_EQ(0u, Line(ranks_[r]).rfind("fail", 0)) << "rank " << r;
  Llama one(1), two(2);
  ExpectHolds(r0, 0, one, "v2");
  ExpectHolds(r1, 1, one, "v2");
  ExpectHolds(whole, -1, one, "v2");
  ranks_[2] = Start(2, ws);
  ranks_.pop_back();
  for (int r : {0, 1, 3}) Say(ranks_[r], "sync 2 v3");
  ASSERT_EQ("ready", Line(ranks_[2]));
  Say(ranks_[2], "sync 2 v3");
  for (int r = 0; r < 4; r++) EXPECT_EQ(0u, Line(ranks_[r]).rfind("ok", 0)) << "rank " << r;
  ExpectHolds(r0, 0, two, "v3");
  ExpectHolds(r1, 1, two, "v3");
  ExpectHolds(whole, -1, two, "v3");
  // And a delta again: nothing changed, nothing moves.
  for (const std::string &l : SyncAll(2, "v4")) {
    EXPECT_EQ(1u, Delta(l)) << l;
    EXPECT_EQ(0u, Sent(l)) << l;
  }
  ExpectHolds(r1, 1, two, "v4");
}

// A delta whose publish fails (the engine behind the whole replica refuses
// its load, and every worker is put back on v1) leaves every rank's record
// of what the workers hold standing: the next delta names v1 as its base
// and sends only the tensor that changed, as a delta after a landed sync
// does.
TEST_F(ManyTest, AfterAFailedDeltaTheNextSendsOnlyWhatChanged) {
  delta_ = true;
  wtxtest::VllmStandIn vllm;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1),
         whole = Spawn({"--vllm-url", vllm.url(), "--vllm-dir", dir_ + "/vllm"});
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  for (const std::string &l : SyncAll(1, "v1")) ASSERT_EQ(0u, l.rfind("ok", 0)) << l;
  const std::string up = "model.layers.0.mlp.up_proj.weight";  // Shard(0), ranks 0 and 1
  vllm.Refuse(1);
  std::vector<std::string> got = SyncAll(1, "v2", up + " 10");
  EXPECT_EQ(0u, got[0].rfind("fail", 0)) << got[0];
  Llama one(1);
  ExpectHolds(whole, -1, one, "v1");
  got = SyncAll(1, "v2", up + " 10");
  for (const std::string &l : got) {
    EXPECT_EQ(0u, l.rfind("ok", 0)) << l;
    EXPECT_EQ(1u, Delta(l)) << l;
  }
  uint64_t after_failure = DeltaSum(got, Sent);
  Llama two(1);
  two.Bump(up, 10);
  ExpectHolds(r0, 0, two, "v2");
  ExpectHolds(r1, 1, two, "v2");
  ExpectHolds(whole, -1, two, "v2");
  // The same tensor changed after a sync that landed: the same bytes.
  got = SyncAll(1, "v3", up + " 10 " + up + " 12");
  for (const std::string &l : got) EXPECT_EQ(1u, Delta(l)) << l;
  EXPECT_EQ(DeltaSum(got, Sent), after_failure);
  EXPECT_LT(after_failure * 4, two.total) << "only up_proj's parts travel";
  two.Bump(up, 12);
  ExpectHolds(whole, -1, two, "v3");
}

// A sync that fails before rank 0's ask reaches the other ranks leaves each
// rank holding the hashes of the sync before, which did land: the next ask
// names that sync, and each rank takes them for what the workers hold. A
// tensor changed by that sync and changed back after it must travel again,
// or the workers keep the change. Here a worker restarted, so rank 0's
// start fails (and the ranks' connections to it are gone)...
TEST_F(ManyTest, ASyncThatFailsBeforeTheAskKeepsTheRecordOfTheOneThatLanded) {
  FailBeforeTheAsk(true);
}

// ... and here rank 0's source fails the sync's pass after its go has
// reached the other ranks, which wait for an ask that never comes.
TEST_F(ManyTest, ARankZeroThatFailsAfterItsGoLeavesEveryRanksRecordOfTheSyncThatLanded) {
  FailBeforeTheAsk(false);
}

void ManyTest::FailBeforeTheAsk(bool restart) {
  delta_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  for (const std::string &l : SyncAll(1, "v1")) ASSERT_EQ(0u, l.rfind("ok", 0)) << l;
  for (const std::string &l : SyncAll(1, "v2", EachRanksBumps())) ASSERT_EQ(1u, Delta(l)) << l;
  if (restart) {
    Stop(workers_[1]);
    r1 = SpawnRank(1, {"--listen", r1.addr()});
  }
  for (const std::string &l : SyncAll(1, "v3", "", restart ? "bump " : "failsync "))
    EXPECT_EQ(0u, l.rfind("fail", 0)) << l;
  for (const std::string &l : SyncAll(1, "v3")) EXPECT_EQ(0u, l.rfind("ok", 0)) << l;
  Llama one(1);
  ExpectHolds(r0, 0, one, "v3");
  ExpectHolds(r1, 1, one, "v3");
  ExpectHolds(whole, -1, one, "v3");
}

// A sync of the draft model does not change what the ranks know of the
// main model: the next delta of the main model is against its version,
// v1. Nothing changed there, so nothing moves, though the draft took other
// weights under the same version label; and the draft's weights (seed 2)
// then reach the main model in full, so no rank took what it hashed for
// the draft for what the main model holds.
TEST_F(ManyTest, ADraftSyncLeavesTheMainModelsRecordStanding) {
  delta_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  for (const std::string &l : SyncAll(1, "v1")) ASSERT_EQ(0u, l.rfind("ok", 0)) << l;
  for (int r = 0; r < 4; r++) Say(ranks_[r], "draft 2 v1");
  for (int r = 0; r < 4; r++) ASSERT_EQ(0u, Line(ranks_[r]).rfind("ok", 0)) << "rank " << r;
  for (const std::string &l : SyncAll(1, "v2")) {
    EXPECT_EQ(1u, Delta(l)) << l;
    EXPECT_EQ(0u, Sent(l)) << l;
  }
  Llama one(1), two(2);
  ExpectHolds(whole, -1, one, "v2");
  for (const std::string &l : SyncAll(2, "v3")) EXPECT_EQ(1u, Delta(l)) << l;
  ExpectHolds(r0, 0, two, "v3");
  ExpectHolds(r1, 1, two, "v3");
  ExpectHolds(whole, -1, two, "v3");
}

// With layer 1 row-parallel: its pieces boxes.
TEST_F(ManyTest, ADeltaOfARowParallelTrainerSendsOnlyTheChangedTensors) {
  rows_ = true;
  DeltasSendOnlyTheChangedTensorsFromEveryOwner();
}

// Patches from a row-parallel trainer (layer 1's q_proj, o_proj and
// down_proj Shard(1) over ranks 2 and 3): a piece that is no run of the
// worker's tensor travels as a patch of its box, from its rank, as one
// that is a run travels as a patch of its span.
TEST_F(ManyTest, PatchesOfARowParallelTrainerTravelAsPatchesOfItsBoxes) {
  rows_ = delta_ = patches_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  auto holds = [&](const Llama &model, const std::string &v) {
    ExpectHolds(r0, 0, model, v);
    ExpectHolds(r1, 1, model, v);
    ExpectHolds(whole, -1, model, v);
  };
  for (const std::string &l : SyncAll(1, "v1")) EXPECT_EQ(0u, l.rfind("ok", 0)) << l;
  // q_proj's element (20, 3): rank 2's columns, tensor-parallel rank 1's
  // rows; both its worker and the whole replica get it in boxes (rows by
  // the workers' cut, columns by the trainer's), so each gets a patch of
  // rank 2's box. o_proj's (5, 20): rank 3's columns, which are all of
  // tensor-parallel rank 1's part (a patch of the whole part) and a box of
  // the whole replica's. An int32 index and a bf16 value each.
  const std::string q = "model.layers.1.self_attn.q_proj.weight";
  const std::string o = "model.layers.1.self_attn.o_proj.weight";
  const std::string bumps = q + " 1286 " + o + " 360";
  Llama two(1);
  two.Bump(q, 1286);
  two.Bump(o, 360);
  std::vector<std::string> got = SyncAll(1, "v2", bumps);
  EXPECT_EQ(4u, DeltaSum(got, Patched));
  EXPECT_EQ(4u * (4 + 2), DeltaSum(got, Sent));
  EXPECT_EQ(2u * (4 + 2), Sent(got[2])) << got[2];
  EXPECT_EQ(2u * (4 + 2), Sent(got[3])) << got[3];
  holds(two, "v2");
  // Every byte of q_proj changed: neither rank's box has a smaller patch,
  // so q_proj travels whole from both to every worker; o_proj's element
  // back as it was is a patch again.
  Llama three(1);
  for (size_t b = 0; b < 2048; b++) three.Bump(q, b);
  got = SyncAll(1, "v3", q + " 0+2048");
  EXPECT_EQ(2u, DeltaSum(got, Patched));
  EXPECT_EQ(2048u * 2 + 2 * (4 + 2), DeltaSum(got, Sent))
      << "q_proj: half to each tensor-parallel worker, all to the whole one";
  holds(three, "v3");
}

// Every worker or none, with many senders: the whole replica is a sidecar
// whose vLLM (a stand-in) refuses to load v2, so its Finish fails after
// the tensor-parallel workers published v2. Rank 0 undoes v2 on every
// worker, that vLLM loads v1 again, and the error says so; the next sync
// lands everywhere.
TEST_F(ManyTest, AFinishRefusedByOneWorkerIsUndoneOnEveryWorker) {
  wtxtest::VllmStandIn vllm;
  std::string vdir = dir_ + "/vllm";
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1),
         whole = Spawn({"--vllm-url", vllm.url(), "--vllm-dir", vdir});
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, whole}));
  for (const std::string &line : SyncAll(1, "v1")) ASSERT_EQ(0u, line.rfind("ok", 0)) << line;
  ASSERT_EQ(1u, vllm.Reloads().size());
  const std::string v1_reload = vllm.Reloads()[0];
  vllm.Refuse(1);
  std::vector<std::string> got = SyncAll(2, "v2");
  EXPECT_EQ(0u, got[0].rfind("fail", 0)) << got[0];
  for (const char *part : {"published here, but the engine it feeds did not load it",
                           "vLLM /collective_rpc answered 500",
                           "so it was undone: every replica serves its weights from before "
                           "the update (version 'v1')"})
    EXPECT_NE(std::string::npos, got[0].find(part)) << "missing \"" << part << "\" in " << got[0];
  Llama one(1), two(2), three(3);
  ExpectHolds(r0, 0, one, "v1");
  ExpectHolds(r1, 1, one, "v1");
  ExpectHolds(whole, -1, one, "v1");
  std::vector<std::string> reloads = vllm.Reloads();
  ASSERT_EQ(3u, reloads.size());  // v1, v2 refused, v1 again
  EXPECT_EQ(v1_reload, reloads[2]) << "the undo loads the directory of v1 again";
  for (const std::string &line : SyncAll(3, "v3")) EXPECT_EQ(0u, line.rfind("ok", 0)) << line;
  ExpectHolds(r0, 0, three, "v3");
  ExpectHolds(r1, 1, three, "v3");
  ExpectHolds(whole, -1, three, "v3");
  (void)two;
}

// The same over nccl, on the TEST DOUBLE of CUDA and NCCL: one
// communicator of the four ranks and the three workers, each chunk an
// ncclSend from the rank that owns it to its worker, in an order every
// rank and worker share (the double's sends, like NCCL's, wait for their
// receives, so another order would deadlock), its span checksums a second
// send. A rank killed mid-sync leaves every worker on its version, and the
// next sync, in a new communicator, lands.
TEST_F(ManyTest, OverNcclEveryRankSendsItsOwnBytesAndADeadRankCostsOneSync) {
  backend_ = "nccl";
  SyncsLandAndADeadRankCostsOneSync();
}

// The same on one host over shm: tcp's protocol, each sender's frames,
// bytes and trailers through a ring in shared memory that its worker made
// (the socket only says both sides are alive).
TEST_F(ManyTest, OverShmEveryRankSendsItsOwnBytesAndADeadRankCostsOneSync) {
  backend_ = "shm";
  SyncsLandAndADeadRankCostsOneSync();
}

// On one host over shm, to a worker whose model reads its tensors where
// they land and copies what it keeps, as a loader does
// (tests/client/host_model_worker --in-place-only): that worker makes one
// receive region in shared memory instead of a ring per sender, each rank
// writes its bytes there at their offset in the worker's stream, and only
// frames and trailers go on the sockets. The model has no staging, so a
// sync lands only if the ranks' copies were the only ones. Every tensor it
// serves hashes as the full model's; the store-backed workers beside it
// take rings as before; a rank killed mid-sync leaves it on its version,
// and the next sync, on new connections and a new region, lands.
TEST_F(ManyTest, OverShmAModelThatReadsInPlaceGetsEachByteCopiedOnlyByItsOwner) {
  AModelThatReadsInPlace({"--in-place-only"});
}

// A row-parallel trainer's boxes cannot lie where the stream would put
// them: such a model stages them (stage), and adopts every other tensor.
TEST_F(ManyTest, OverShmAModelThatReadsInPlaceStagesTheBoxesOfARowParallelTrainer) {
  rows_ = true;
  AModelThatReadsInPlace({});
}

void ManyTest::AModelThatReadsInPlace(const std::vector<std::string> &args) {
  backend_ = "shm";
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  worker_binary_ = "tests/client/host_model_worker";
  std::string sums = dir_ + "/sums";
  std::vector<std::string> all = args;
  all.insert(all.end(), {"--sums", sums});
  Worker whole = Spawn(all);
  std::vector<Worker> ws = {r0, r1, whole};
  ASSERT_NO_FATAL_FAILURE(StartAll(ws));
  Hold hold = [&](const Llama &model, const std::string &v) {
    ExpectHolds(r0, 0, model, v);
    ExpectHolds(r1, 1, model, v);
    ExpectSums(sums, model, v);
  };
  TwoSyncsLand(hold);
  ADeadRankCostsOneSync(ws, whole, hold);
}

// The same on one node over cuda_ipc, on the TEST DOUBLE: each worker's
// receive region on its GPU, opened by every rank with its IPC handle; a
// chunk's bytes copied there by its rank before its frame, the frame and
// the trailer on the socket.
TEST_F(ManyTest, OverCudaIpcEveryRankSendsItsOwnBytesAndADeadRankCostsOneSync) {
  backend_ = "cuda_ipc";
  SyncsLandAndADeadRankCostsOneSync();
}

void ManyTest::SyncsLandAndADeadRankCostsOneSync() {
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  std::vector<Worker> ws = {r0, r1, whole};
  ASSERT_NO_FATAL_FAILURE(StartAll(ws));
  for (int seed = 1; seed <= 2; seed++) {
    Llama model(static_cast<uint8_t>(seed));
    std::string v = "v" + std::to_string(seed);
    std::vector<std::string> got = SyncAll(seed, v);
    uint64_t sent = 0;
    for (int r = 0; r < 4; r++) sent += Sent(got[r]);
    uint64_t held = ExpectHolds(r0, 0, model, v) + ExpectHolds(r1, 1, model, v) +
                    ExpectHolds(whole, -1, model, v);
    EXPECT_EQ(held, sent) << "every byte a worker holds was sent once, by one rank";
    EXPECT_LT(Sent(got[0]), model.total) << "rank 0 sends only what it owns";
  }
  ADeadRankCostsOneSync(ws, r0, [&](const Llama &model, const std::string &v) {
    ExpectHolds(r0, 0, model, v);
    ExpectHolds(r1, 1, model, v);
    ExpectHolds(whole, -1, model, v);
  });
}

// A trainer whose row-parallel layers split columns (Megatron's layout):
// what each rank owns of them is not one run of what any worker keeps,
// whole or sliced by rows, so it travels as boxes that the workers
// scatter into staging, cut to fit the ranks' small buffers. Every worker
// ends with the right bytes, each sent once by its owner; a dead owner
// still costs one sync.
TEST_F(ManyTest, ARowParallelTrainerFeedsEveryWorkerInBoxesOverTcp) {
  rows_ = true;
  SyncsLandAndADeadRankCostsOneSync();
}

TEST_F(ManyTest, ARowParallelTrainerFeedsEveryWorkerInBoxesOverShm) {
  rows_ = true;
  backend_ = "shm";
  SyncsLandAndADeadRankCostsOneSync();
}

// Over the GPU backends, on the TEST DOUBLE, to workers that stage on the
// host (wtx-worker's store): each box leaves its rank by ncclSend, or
// through the worker's receive region on its GPU, and is scattered there.
TEST_F(ManyTest, ARowParallelTrainerFeedsEveryWorkerInBoxesOverNccl) {
  rows_ = true;
  backend_ = "nccl";
  SyncsLandAndADeadRankCostsOneSync();
}

TEST_F(ManyTest, ARowParallelTrainerFeedsEveryWorkerInBoxesOverCudaIpc) {
  rows_ = true;
  backend_ = "cuda_ipc";
  SyncsLandAndADeadRankCostsOneSync();
}

// A worker whose model stages on its GPU (tests/client/gpu_model_worker,
// as vLLM's does) takes boxes too, on the TEST DOUBLE: each comes to the
// host, verified there, and is scattered into its tensor's device staging
// one run at a time (over cuda_ipc beside the receive region, where the
// other tensors are adopted in place). The model's device bytes, hashed
// at each commit, are the full model's.
TEST_F(ManyTest, ARowParallelTrainerFeedsAWorkerStagingOnAGpuInBoxesOverNccl) {
  backend_ = "nccl";
  BoxesReachAWorkerStagingOnAGpu();
}

TEST_F(ManyTest, ARowParallelTrainerFeedsAWorkerStagingOnAGpuInBoxesOverCudaIpc) {
  backend_ = "cuda_ipc";
  BoxesReachAWorkerStagingOnAGpu();
}

void ManyTest::BoxesReachAWorkerStagingOnAGpu() {
  rows_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  worker_binary_ = "tests/client/gpu_model_worker";
  std::string sums = dir_ + "/sums";
  Worker gpu = Spawn({"--sums", sums});
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, gpu}));
  TwoSyncsLand([&](const Llama &model, const std::string &v) {
    ExpectHolds(r0, 0, model, v);
    ExpectHolds(r1, 1, model, v);
    ExpectSums(sums, model, v);
  });
}

// Patches go only to workers that take them: a model staging on its GPU
// (gpu_model_worker over nccl, on the TEST DOUBLE) says it takes whole
// tensors at each start, so rank 0 drops the offer of a patch for it and
// the tensor's owner sends it whole there, while the tensor-parallel
// worker holding the same element still gets a patch.
TEST_F(ManyTest, PatchesGoOnlyToWorkersThatTakeThem) {
  backend_ = "nccl";
  delta_ = patches_ = true;
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  worker_binary_ = "tests/client/gpu_model_worker";
  std::string sums = dir_ + "/sums";
  Worker gpu = Spawn({"--sums", sums});
  ASSERT_NO_FATAL_FAILURE(StartAll({r0, r1, gpu}));
  for (const std::string &l : SyncAll(1, "v1")) ASSERT_EQ(0u, l.rfind("ok", 0)) << l;
  const std::string l1 = "model.layers.1.mlp.up_proj.weight";
  const size_t byte = 50 * 32 * 2;  // row 50 of 64: tensor-parallel rank 1's
  Llama two(1);
  two.Bump(l1, byte);
  std::vector<std::string> got = SyncAll(1, "v2", l1 + " " + std::to_string(byte));
  uint64_t sent = 0, patched = 0, whole_l1 = 0;
  for (const std::string &l : got) {
    EXPECT_EQ(1u, Delta(l)) << l;
    sent += Sent(l);
    patched += Patched(l);
  }
  for (const wtxtest::Tensor &x : two.t) whole_l1 += x.name == l1 ? x.data.size() : 0;
  EXPECT_EQ(1u, patched);
  EXPECT_EQ(4u + 2 + whole_l1, sent) << "a patch to rank 1's worker, the tensor whole to the GPU";
  ExpectHolds(r0, 0, two, "v2");
  ExpectHolds(r1, 1, two, "v2");
  // The GPU model hashes what each update staged on it: l1 alone, whole.
  std::string version;
  std::map<std::string, uint64_t> dev = DeviceSums(sums, &version);
  EXPECT_EQ("v2", version);
  EXPECT_EQ(1u, dev.size());
  uint64_t want = 0;
  for (const wtxtest::Tensor &x : two.t)
    want = x.name == l1 ? XXH3_64bits(x.data.data(), x.data.size()) : want;
  EXPECT_EQ(want, dev[l1]);
}

// A model that only adopts tensors in place in the receive region
// (gpu_model_worker --in-place-only) cannot take boxes: its init answers
// so (refuses_boxes), and rank 0 refuses the plan at init, naming the
// first tensor that would reach it in boxes and the worker, before any
// update starts; every worker keeps serving what it served.
TEST_F(ManyTest, BoxesForAWorkerThatOnlyAdoptsInPlaceAreRefusedAtInitNamingTensorAndWorker) {
  rows_ = true;
  backend_ = "cuda_ipc";
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1);
  worker_binary_ = "tests/client/gpu_model_worker";
  Worker gpu = Spawn({"--in-place-only", "--sums", dir_ + "/sums"});
  std::vector<Worker> ws = {r0, r1, gpu};
  for (int r = 0; r < 4; r++) Start(r, ws);
  std::string zero = Line(ranks_[0]);
  EXPECT_EQ(0u, zero.rfind("fail " + std::to_string(WTX_ENOTSUP) + " ", 0)) << zero;
  EXPECT_NE(std::string::npos,
            zero.find("'model.layers.1.self_attn.q_proj.weight' reaches worker 2 (" +
                      gpu.addr() + ") in boxes"))
      << zero;
  EXPECT_NE(std::string::npos, zero.find("adopts tensors in place on its GPU")) << zero;
  Finish(ranks_[0], 1);
  for (const Worker &w : ws) {  // no update started anywhere
    wtx_client *c = Client({w});
    wtx_weight_info info;
    EXPECT_EQ(0, wtx_client_weight_info(c, 0, 0, &info)) << wtx_client_last_error(c);
    EXPECT_EQ(0u, info.generation);
    EXPECT_NE(WTX_SESSION_UPDATING, info.state);
    EXPECT_STREQ("", info.version);
    wtx_weight_info_free(&info);
    wtx_client_destroy(c);
  }
}

// A rank whose metadata or ownership differs from rank 0's plans
// differently: the init fails on rank 0 naming that rank and the first
// parameter where they differ, as each sees it, and on that rank naming
// the same parameter, before any worker's session starts.
TEST_F(ManyTest, ARankThatPlansDifferentlyFailsTheInitOnBothSidesNamingTheParameter) {
  Worker r0 = SpawnRank(0), r1 = SpawnRank(1), whole = Spawn();
  std::vector<Worker> ws = {r0, r1, whole};
  for (int r = 0; r < 4; r++) Start(r, ws, 5000, r == 2);
  std::string zero = Line(ranks_[0]), two = Line(ranks_[2]);
  EXPECT_EQ(0u, zero.rfind("fail", 0)) << zero;
  EXPECT_NE(std::string::npos, zero.find("rank 2 (" + RankAddr(2) + ") planned")) << zero;
  EXPECT_NE(std::string::npos, zero.find("rank 0 has 'model.scale' INT8 [3, 5], owners [3]; "
                                         "rank 2 has 'model.scale' INT8 [3, 5], owners [2]"))
      << zero;
  EXPECT_EQ(0u, two.rfind("fail", 0)) << two;
  EXPECT_NE(std::string::npos, two.find("this rank has 'model.scale' INT8 [3, 5], owners [2]"))
      << two;
  for (Rank &r : ranks_) Finish(r, 1);  // every init failed, each within its timeout
  for (const Worker &w : ws) {  // no worker's session was started
    wtx_client *c = Client({w});
    wtx_weight_info info;
    EXPECT_EQ(0, wtx_client_weight_info(c, 0, 0, &info)) << wtx_client_last_error(c);
    EXPECT_STREQ("", info.backend);
    EXPECT_EQ(0u, info.generation);
    wtx_weight_info_free(&info);
    wtx_client_destroy(c);
  }
}

// Refused at init, before any byte moves, naming the parameter.
class ManyInitTest : public ManyTest {
 protected:
  int Init(const std::vector<Worker> &ws, std::vector<wtx_ownership> owners, std::string *err,
           const char *backend = "tcp", int delta = WTX_DELTA_OFF) {
    Llama model(1);
    std::vector<const char *> ra;
    std::vector<std::string> addrs = {RankAddr(0), RankAddr(1)};
    for (auto &a : addrs) ra.push_back(a.c_str());
    std::vector<wtx_memory_tensor> mem = model.mem;  // rank 0 given every byte
    char e[2048] = "";
    wtx_source *src = nullptr;
    int rc = wtx_source_memory_owned(mem.data(), owners.data(), mem.size(), 0, &src, e,
                                     sizeof e);
    wtx_client *c = Client(ws);
    wtx_trainer_config cfg = WTX_TRAINER_CONFIG_INIT;
    cfg.backend = backend;
    cfg.world = 2;
    cfg.rank_addresses = ra.data();
    cfg.session_token = kToken;
    cfg.delta = delta;
    wtx_trainer *t = nullptr;
    if (rc == 0) rc = wtx_trainer_init(&cfg, c, src, &t, e, sizeof e);
    *err = e;
    wtx_trainer_shutdown(t);
    wtx_client_destroy(c);
    wtx_source_destroy(src);
    return rc;
  }
  static std::vector<wtx_ownership> Owners(const Llama &model, uint32_t n_ranks) {
    static const uint32_t both[] = {0, 1};
    static const int32_t shard0[] = {0};
    std::vector<wtx_ownership> o(model.t.size(), wtx_ownership{both, n_ranks, nullptr, 0, shard0});
    return o;
  }
};

TEST_F(ManyInitTest, AnOrphanParameterIsRefusedByName) {
  Worker r0 = SpawnRank(0);
  Llama model(1);
  std::vector<wtx_ownership> o = Owners(model, 2);
  o[3].n_owners = 0;  // no rank owns it
  std::string err;
  EXPECT_EQ(WTX_EINVAL, Init({r0}, o, &err));
  EXPECT_NE(std::string::npos, err.find(model.t[3].name)) << err;
}

TEST_F(ManyInitTest, ManySendersRunOverTheFourBackendsOnly) {
  Worker r0 = SpawnRank(0);
  Llama model(1);
  std::string err;
  EXPECT_NE(0, Init({r0}, Owners(model, 2), &err, "carrier-pigeon"));
  EXPECT_NE(std::string::npos, err.find("carrier-pigeon")) << err;
}

// Every process of this test (workers and ranks inherit the environment)
// loads the TEST DOUBLE of CUDA and NCCL instead of the real libraries.
const auto *const kDouble = ::testing::AddGlobalTestEnvironment(new wtxtest::UseCudaDouble);

}  // namespace
