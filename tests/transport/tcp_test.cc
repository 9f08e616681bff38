// The tcp backend's worker half fed by several senders (TcpInitInfo.
// sender_addresses): it connects to each, says hello and its index, takes
// each chunk from the connection its UpdateInfo names, and checks each
// sender's checksum of the bytes that sender sent. The senders here are the
// test's own, written from the wire records of tcp_frame.h, so that every
// way one can misbehave (a wrong checksum, dying mid-chunk) is reached.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "transport/rx.h"
#include "transport/tcp_frame.h"
#include "transport/tcp_rank.h"

namespace {

const uint8_t kToken[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
const uint64_t kPlan = 0x1234567890abcdefull;  // rank 0's plan digest

// One sender rank's data port: accepts the worker, checks its hello and
// index, then writes what the test tells it to.
class Sender {
 public:
  Sender() {
    lfd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(0, bind(lfd_, reinterpret_cast<sockaddr *>(&a), sizeof a));
    socklen_t len = sizeof a;
    getsockname(lfd_, reinterpret_cast<sockaddr *>(&a), &len);
    EXPECT_EQ(0, listen(lfd_, 4));
    addr_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~Sender() {
    if (fd_ >= 0) close(fd_);
    close(lfd_);
  }
  const std::string &addr() const { return addr_; }
  // Accepts the worker and answers with plan; its index, or -1 when its
  // hello is not ours or it brings another plan.
  int Accept(uint64_t plan = kPlan) {
    fd_ = accept(lfd_, nullptr, nullptr);
    uint8_t h[WTX__TCP_HELLO_BYTES], who[WTX__TCP_WHO_BYTES], p[WTX__TCP_PLAN_BYTES];
    uint32_t index = 0;
    uint64_t theirs = 0;
    if (!ReadAll(h, sizeof h) || wtx__tcp_hello_check(h, kToken, sizeof kToken) != 0 ||
        !ReadAll(who, sizeof who) || wtx__tcp_who_decode(who, &index, &theirs) != 0)
      return -1;
    wtx__tcp_plan_encode(p, plan);
    Write(p, sizeof p);
    return theirs == kPlan ? static_cast<int>(index) : -1;
  }
  // Chunk seq: header, bytes, and a trailer with one checksum per tensor
  // span the chunk touches (spans: their lengths, in order).
  void Chunk(uint64_t seq, uint64_t first_offset, const uint8_t *p,
             const std::vector<size_t> &spans, bool corrupt_sum = false) {
    size_t bytes = 0;
    for (size_t s : spans) bytes += s;
    uint8_t f[WTX__TCP_FRAME_BYTES];
    wtx__tcp_frame fr = {seq, first_offset, bytes};
    wtx__tcp_frame_encode(f, &fr);
    Write(f, sizeof f);
    Write(p, bytes);
    std::vector<uint64_t> sums;
    for (size_t s : spans) {
      sums.push_back(XXH3_64bits(p, s) ^ (corrupt_sum ? 1 : 0));
      p += s;
    }
    std::vector<uint8_t> t(WTX__TCP_TRAILER_HEAD_BYTES + 8 * sums.size());
    wtx__tcp_trailer_encode(t.data(), seq, static_cast<uint32_t>(sums.size()));
    wtx__tcp_trailer_put_sums(t.data() + WTX__TCP_TRAILER_HEAD_BYTES, sums.data(),
                              sums.size());
    Write(t.data(), t.size());
  }
  void Write(const void *p, size_t n) { ASSERT_EQ(static_cast<ssize_t>(n), write(fd_, p, n)); }
  void Die() {
    close(fd_);
    fd_ = -1;
  }

 private:
  bool ReadAll(uint8_t *p, size_t n) {
    while (n > 0) {
      ssize_t r = read(fd_, p, n);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  int lfd_ = -1, fd_ = -1;
  std::string addr_;
};

class TcpManyTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(0, wtx__rx_create(&rx_)); }
  void TearDown() override {
    if (w_ != nullptr) wtx_tcp_worker_transport.destroy(w_);
    wtx__rx_destroy(rx_);
  }
  // Initializes the worker half over upstream s[0] and senders s[1..], and
  // connects while the senders accept; each sender's Accept answer in who.
  int Init(std::vector<Sender *> s, uint32_t index, std::vector<int> *who,
           bool relay = false, bool trailer = true, uint64_t last_plan = kPlan) {
    std::vector<const char *> addrs;
    for (size_t i = 1; i < s.size(); i++) addrs.push_back(s[i]->addr().c_str());
    Wtx__V1__TcpInitInfo ti = WTX__V1__TCP_INIT_INFO__INIT;
    ti.upstream_address = const_cast<char *>(s[0]->addr().c_str());
    ti.data_token.data = const_cast<uint8_t *>(kToken);
    ti.data_token.len = sizeof kToken;
    ti.checksum_trailer = trailer;
    ti.relay = relay;
    ti.n_sender_addresses = addrs.size();
    ti.sender_addresses = const_cast<char **>(addrs.data());
    ti.worker_index = index;
    ti.plan_digest = kPlan;
    Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
    ii.backend_case = WTX__V1__INIT_INFO__BACKEND_TCP;
    ii.tcp = &ti;
    int rc = wtx_tcp_worker_transport.init(&ii, &wire_, nullptr, &w_, err_, sizeof err_);
    if (rc != 0) return rc;
    std::vector<std::thread> accepts;
    who->assign(s.size(), -1);
    for (size_t i = 0; i < s.size(); i++)
      accepts.emplace_back(
          [&, i] { (*who)[i] = s[i]->Accept(i + 1 == s.size() ? last_plan : kPlan); });
    char data[64];
    rc = wtx_tcp_worker_transport.connect(w_, data, sizeof data, err_, sizeof err_);
    for (auto &t : accepts) t.join();
    return rc;
  }
  // Receives one chunk from sender k: tensors [first, first+n) of t_,
  // first_offset into the first, bytes long.
  // A session of senders r0 and r1 into tensor "a" (a's 4096 bytes), and
  // r1 having sent chunk 0's header and its first `sent` bytes.
  void PartOfAChunk(Sender &r0, Sender &r1, std::vector<uint8_t> &a, size_t sent) {
    std::vector<int> who;
    ASSERT_EQ(0, Init({&r0, &r1}, 0, &who)) << err_;
    std::vector<uint8_t> src(a.size(), 5);
    t_ = {{"a", a.size(), a.data()}};
    uint8_t f[WTX__TCP_FRAME_BYTES];
    wtx__tcp_frame fr = {0, 0, a.size()};
    wtx__tcp_frame_encode(f, &fr);
    r1.Write(f, sizeof f);
    r1.Write(src.data(), sent);
  }

  int Receive(uint32_t k, size_t first, size_t n, uint64_t first_offset, uint64_t bytes) {
    Wtx__V1__TcpUpdateInfo tu = WTX__V1__TCP_UPDATE_INFO__INIT;
    tu.sender = k;
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_TCP;
    ui.tcp = &tu;
    ui.first_param_offset = first_offset;
    ui.chunk_bytes = bytes;
    int rc = wtx__rx_begin(rx_, &t_[first], n, first_offset, bytes, WTX__RX_VERIFY);
    if (rc == 0) rc = wtx_tcp_worker_transport.receive(w_, &ui, rx_);
    if (rc == 0) rc = wtx__rx_end(rx_);
    error_ = wtx__rx_error(rx_);
    return rc;
  }

  wtx_wire_params wire_{1, 1 << 20, 1, WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64,
                        5000};
  void *w_ = nullptr;
  wtx_rx *rx_ = nullptr;
  std::vector<wtx_rx_tensor> t_;
  char err_[512] = "";
  std::string error_;
};

// The stream of one worker: a (100 bytes) from rank 0; b (300 bytes) split
// 120 from rank 1 and 180 from rank 2; c (50) from rank 2.
TEST_F(TcpManyTest, EachSendersBytesLandWhereThePlanPutsThem) {
  Sender r0, r1, r2;
  std::vector<int> who;
  ASSERT_EQ(0, Init({&r0, &r1, &r2}, 7, &who)) << err_;
  EXPECT_EQ((std::vector<int>{7, 7, 7}), who) << "each sender learns which worker it feeds";
  std::vector<uint8_t> src(450), a(100), b(300), c(50);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 13 + 1);
  t_ = {{"a", 100, a.data()}, {"b", 300, b.data()}, {"c", 50, c.data()}};
  // Each sender writes ahead of the worker's reading, as real ranks do.
  r0.Chunk(0, 0, src.data(), {100});
  r1.Chunk(0, 0, src.data() + 100, {120});
  r2.Chunk(0, 120, src.data() + 220, {180, 50});
  ASSERT_EQ(0, Receive(0, 0, 1, 0, 100)) << error_;
  ASSERT_EQ(0, Receive(1, 1, 1, 0, 120)) << error_;
  ASSERT_EQ(0, Receive(2, 1, 2, 120, 230)) << error_;
  EXPECT_EQ(0, memcmp(a.data(), src.data(), 100));
  EXPECT_EQ(0, memcmp(b.data(), src.data() + 100, 300));
  EXPECT_EQ(0, memcmp(c.data(), src.data() + 400, 50));
  // The model gets each completed tensor's whole XXH3, though no sender sent it.
  ASSERT_TRUE(wtx__rx_whole_sums(rx_));
  ASSERT_EQ(2u, wtx__rx_completed(rx_));
  EXPECT_EQ(XXH3_64bits(src.data() + 100, 300), wtx__rx_checksum(rx_, 0));
  EXPECT_EQ(XXH3_64bits(src.data() + 400, 50), wtx__rx_checksum(rx_, 1));
}

TEST_F(TcpManyTest, ASendersWrongChecksumNamesTheTensor) {
  Sender r0, r1;
  std::vector<int> who;
  ASSERT_EQ(0, Init({&r0, &r1}, 0, &who)) << err_;
  std::vector<uint8_t> src(64, 9), a(64);
  t_ = {{"a", 64, a.data()}};
  r0.Chunk(0, 0, src.data(), {32});
  r1.Chunk(0, 32, src.data() + 32, {32}, /*corrupt_sum=*/true);
  ASSERT_EQ(0, Receive(0, 0, 1, 0, 32)) << error_;
  EXPECT_EQ(WTX_ECHECKSUM, Receive(1, 0, 1, 32, 32));
  EXPECT_NE(std::string::npos, error_.find("'a'")) << error_;
}

TEST_F(TcpManyTest, ASenderThatDiesMidChunkIsNamedAndTheStreamBreaks) {
  Sender r0, r1;
  std::vector<uint8_t> a(4096);
  ASSERT_NO_FATAL_FAILURE(PartOfAChunk(r0, r1, a, 1000));
  r1.Die();
  EXPECT_EQ(WTX_EIO, Receive(1, 0, 1, 0, 4096));
  EXPECT_NE(std::string::npos, error_.find(r1.addr())) << error_;
  EXPECT_NE(std::string::npos, error_.find("after 1000 of 4096")) << error_;
  // Every connection is dropped: the other senders see the failure at once.
  EXPECT_EQ(WTX_ESTATE, Receive(0, 0, 1, 0, 4096));
}

// A sender's connection is read ahead by a thread of the worker's; a
// receive waiting on it ends on cancel (abort, SIGTERM), not at the
// timeout, and the reader stops with the stream.
TEST_F(TcpManyTest, ACancelEndsAReceiveWaitingOnASendersReadAhead) {
  Sender r0, r1;
  std::vector<uint8_t> a(4096);
  ASSERT_NO_FATAL_FAILURE(PartOfAChunk(r0, r1, a, 100));  // then nothing: r1 stalls
  int rc = 0;
  std::thread t([&] { rc = Receive(1, 0, 1, 0, 4096); });
  wtx_tcp_worker_transport.cancel(w_);
  t.join();
  EXPECT_EQ(WTX_ECANCELED, rc) << error_;  // the timeout is 5 s: this is the cancel
  EXPECT_NE(std::string::npos, error_.find("cancelled")) << error_;
  wtx_tcp_worker_transport.reset(w_);  // stops the readers with the stream
}

TEST_F(TcpManyTest, AChunkFromASenderTheSessionDoesNotHaveIsRefused) {
  Sender r0, r1;
  std::vector<int> who;
  ASSERT_EQ(0, Init({&r0, &r1}, 0, &who)) << err_;
  std::vector<uint8_t> a(8);
  t_ = {{"a", 8, a.data()}};
  EXPECT_EQ(WTX_EINVAL, Receive(2, 0, 1, 0, 8));
  EXPECT_NE(std::string::npos, error_.find("update_info.tcp.sender: 2")) << error_;
}

TEST_F(TcpManyTest, InitRefusesARelayOrMissingTrailerWithSeveralSenders) {
  Sender r0, r1;
  std::vector<int> who;
  EXPECT_EQ(WTX_EINVAL, Init({&r0, &r1}, 0, &who, /*relay=*/true));
  EXPECT_NE(std::string::npos, std::string(err_).find("init_info.tcp.relay")) << err_;
  EXPECT_EQ(WTX_EINVAL, Init({&r0, &r1}, 0, &who, false, /*trailer=*/false));
  EXPECT_NE(std::string::npos, std::string(err_).find("init_info.tcp.checksum_trailer"))
      << err_;
}

TEST_F(TcpManyTest, ASenderThatPlannedDifferentlyFailsTheInitByItsAddress) {
  Sender r0, r1;
  std::vector<int> who;
  EXPECT_EQ(WTX_EINVAL, Init({&r0, &r1}, 0, &who, false, true, kPlan + 1));
  EXPECT_NE(std::string::npos, std::string(err_).find("sender " + r1.addr() + " planned"))
      << err_;
}

// A trainer rank's side (tcp_rank.h), with rank 0's link and one worker
// that takes no bytes: while the rank sends a sync's chunk, rank 0 closing
// the link (it failed the sync) ends the send at once (WTX_ECANCELED), not
// at the timeout, and unwatch says the link closed; a watch that saw no
// close answers 0.
TEST(TcpRankTest, RankZeroClosingItsLinkEndsASendToAWorkerThatTakesNothing) {
  const uint64_t digests[1] = {kPlan};
  wtx__tcp_params params = {digests, 1, nullptr, nullptr, 1, 0, 0};
  wtx__tcp_rank *r = nullptr;
  char bound[64], err[512] = "", aerr[512] = "";
  ASSERT_EQ(0, wtx__tcp_rank_listen("127.0.0.1:0", kToken, sizeof kToken, kPlan, &params, 1,
                                    5000, &r, bound, sizeof bound, err, sizeof err))
      << err;
  int arc = -1;
  std::thread acc([&] { arc = wtx__tcp_rank_accept(r, aerr, sizeof aerr); });
  int link = -1;
  ASSERT_EQ(0, wtx__tcp_rank_check(bound, 1, kToken, sizeof kToken, kPlan, &params, 5000, &link,
                                   err, sizeof err))
      << err;
  // The worker: hello, who (index 0, rank 0's plan), the rank's answer.
  std::string host(bound);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(host.substr(host.rfind(':') + 1))));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int wfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(0, connect(wfd, reinterpret_cast<sockaddr *>(&a), sizeof a));
  uint8_t h[WTX__TCP_HELLO_BYTES], who[WTX__TCP_WHO_BYTES], plan[WTX__TCP_PLAN_BYTES];
  wtx__tcp_hello_encode(h, kToken, sizeof kToken);
  wtx__tcp_who_encode(who, 0, kPlan);
  ASSERT_EQ(static_cast<ssize_t>(sizeof h), write(wfd, h, sizeof h));
  ASSERT_EQ(static_cast<ssize_t>(sizeof who), write(wfd, who, sizeof who));
  ASSERT_EQ(static_cast<ssize_t>(sizeof plan), recv(wfd, plan, sizeof plan, MSG_WAITALL));
  acc.join();
  ASSERT_EQ(0, arc) << aerr;
  // A watch with nothing closed.
  ASSERT_EQ(0, wtx__tcp_rank_watch(r));
  EXPECT_EQ(0, wtx__tcp_rank_unwatch(r));
  // A chunk far past the sockets' buffers, and rank 0 closing the link.
  ASSERT_EQ(0, wtx__tcp_rank_watch(r));
  std::vector<uint8_t> big(64 << 20, 7);
  iovec v = {big.data(), big.size()};
  uint64_t end = big.size();
  std::thread closer([&] {
    pollfd p = {wfd, POLLIN, 0};
    poll(&p, 1, 5000);  // the chunk has begun
    close(link);
  });
  int rc = wtx__tcp_rank_chunk(r, 0, 0, 0, big.size(), &v, 1, &end, 1, 1, err, sizeof err);
  closer.join();
  EXPECT_EQ(WTX_ECANCELED, rc) << err;
  EXPECT_EQ(1, wtx__tcp_rank_unwatch(r));
  close(wfd);
  wtx__tcp_rank_destroy(r);
}

}  // namespace
