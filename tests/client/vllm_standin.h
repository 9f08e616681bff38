// A STAND-IN for a vLLM server's HTTP routes, as the sidecar bridge
// (wtx-worker --vllm-url) calls them, served by libmicrohttpd on loopback.
// Every route answers 200 "{}" unless Answer set another status and body
// for it; the reload (POST /collective_rpc) answers 500 while refusals set
// by Refuse are left, as a vLLM whose load_weights raised. It keeps every
// request line and each reload's body. vLLM itself needs a GPU; its real
// routers are driven by tests/python/sidecar_test.py.
#ifndef WTX_TESTS_CLIENT_VLLM_STANDIN_H
#define WTX_TESTS_CLIENT_VLLM_STANDIN_H

#include <gtest/gtest.h>
#include <microhttpd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace wtxtest {

class VllmStandIn {
 public:
  VllmStandIn() {
    d_ = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, 0, nullptr, nullptr, &Handle, this,
                          MHD_OPTION_END);
    EXPECT_NE(nullptr, d_);
    if (d_ != nullptr) port_ = MHD_get_daemon_info(d_, MHD_DAEMON_INFO_BIND_PORT)->port;
  }
  ~VllmStandIn() { Stop(); }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // Closes the port: vLLM is down from here on.
  void Stop() {
    if (d_ != nullptr) MHD_stop_daemon(d_);
    d_ = nullptr;
  }
  // What route (its path, no query) answers from now on.
  void Answer(const std::string &route, int status, const std::string &body) {
    std::lock_guard<std::mutex> l(mu_);
    routes_[route] = {status, body};
  }
  // The next n reloads answer 500.
  void Refuse(int n) { refuse_ = n; }
  // "METHOD /path?query" of every request but GET /weight_info, in order.
  std::vector<std::string> Requests() {
    std::lock_guard<std::mutex> l(mu_);
    return requests_;
  }
  // Each reload's request body, in order.
  std::vector<std::string> Reloads() {
    std::lock_guard<std::mutex> l(mu_);
    return reloads_;
  }

 private:
  static MHD_Result Query(void *cls, MHD_ValueKind, const char *key, const char *value) {
    auto *line = static_cast<std::string *>(cls);
    *line += (line->find('?') == std::string::npos ? "?" : "&") + std::string(key) + "=" +
             (value != nullptr ? value : "");
    return MHD_YES;
  }
  static MHD_Result Handle(void *cls, MHD_Connection *conn, const char *url,
                           const char *method, const char *, const char *data, size_t *size,
                           void **state) {
    auto *self = static_cast<VllmStandIn *>(cls);
    auto *body = static_cast<std::string *>(*state);
    if (body == nullptr) {  // headers only: the body comes next
      *state = new std::string;
      return MHD_YES;
    }
    if (*size > 0) {
      body->append(data, *size);
      *size = 0;
      return MHD_YES;
    }
    std::pair<int, std::string> answer{200, "{}"};
    {
      std::lock_guard<std::mutex> l(self->mu_);
      std::string line = std::string(method) + " " + url;
      MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, &Query, &line);
      if (line != "GET /weight_info") self->requests_.push_back(line);
      auto it = self->routes_.find(url);
      if (it != self->routes_.end()) answer = it->second;
      if (strcmp(url, "/collective_rpc") == 0) {
        self->reloads_.push_back(*body);
        if (self->refuse_ > 0) {
          self->refuse_--;
          answer = {500, "{\"error\": \"reload_weights refused by the stand-in\"}"};
        }
      }
    }
    delete body;
    *state = nullptr;
    MHD_Response *r = MHD_create_response_from_buffer(answer.second.size(), &answer.second[0],
                                                      MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(r, "Content-Type", "application/json");
    MHD_Result ok = MHD_queue_response(conn, static_cast<unsigned>(answer.first), r);
    MHD_destroy_response(r);
    return ok;
  }

  MHD_Daemon *d_ = nullptr;
  int port_ = 0;
  std::atomic<int> refuse_{0};
  std::mutex mu_;
  std::map<std::string, std::pair<int, std::string>> routes_;
  std::vector<std::string> requests_, reloads_;
};

}  // namespace wtxtest

#endif  // WTX_TESTS_CLIENT_VLLM_STANDIN_H
