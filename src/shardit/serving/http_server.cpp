#include "shardit/serving/http_server.h"

#include <fmt/format.h>
#include <poll.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <netinet/in.h>
#include <thread>
#include <utility>

#include "shardit/serving/api.h"
#include "shardit/serving/multipart.h"

#include "shardit/core/heap.h"

namespace shardit::serving {

namespace {

using Clock = std::chrono::steady_clock;

/// The most bytes a request head (request line and headers) may take; httplib 0.11 reads header
/// lines without a count or a total bound.
constexpr size_t kMaxHeadBytes = size_t{64} << 10;
/// Connections the kernel completes before the listener accepts them (httplib listens with 5).
constexpr int kListenBacklog = 128;
/// How long a refused connection's unread request is read and dropped before it is closed.
constexpr auto kLinger = std::chrono::seconds(2);
/// How long a blocked read or write waits before it looks at the deadline and the stop flag again.
constexpr auto kPollSlice = std::chrono::milliseconds(100);

bool equals_ignoring_case(const std::string& a, const char* b) { return ::strcasecmp(a.c_str(), b) == 0; }

/// The peer's address without its port ("127.0.0.1", "::1"), or "unknown".
std::string peer_address(int sock) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getpeername(sock, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "unknown";
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = address.ss_family == AF_INET6
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&address)->sin6_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&address)->sin_addr);
  if (::inet_ntop(address.ss_family, raw, text, sizeof(text)) == nullptr) return "unknown";
  return text;
}

/// Sends what fits without waiting: used only on connections about to be closed.
void send_now(int fd, const std::string& bytes) {
  (void)::send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

/// The bytes of a whole answer with the refusal body, closing the connection; written outside
/// httplib (a late request, an oversized head, a connection beyond the cap).
std::string raw_answer(const HttpServer::Refuse& refuse, int status, const std::string& message) {
  httplib::Response response;
  refuse(response, status, message);
  const char* reason = status == 408 ? "Request Timeout"
                       : status == 413 ? "Payload Too Large"
                       : status == 431 ? "Request Header Fields Too Large"
                                       : "Service Unavailable";
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}", status,
                     reason, response.get_header_value("Content-Type"), response.body.size(), response.body);
}

void ip_and_port(const sockaddr_storage& address, std::string& ip, int& port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    ::inet_ntop(AF_INET, &in.sin_addr, text, sizeof(text));
    port = ntohs(in.sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, text, sizeof(text));
    port = ntohs(in6.sin6_port);
  }
  ip = text;
}

// Set while the listener thread runs a connection's task itself to refuse it (the cap is reached).
thread_local bool t_refusing = false;

/// One thread per connection, at most `max` at once. A connection beyond that runs on the
/// listener thread with t_refusing set, which answers it 503 without waiting and closes it.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(int64_t max) : max_(max) {}

  void enqueue(std::function<void()> task) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (running_ < max_) {
        ++running_;
        std::thread([this, task = std::move(task)]() mutable {
          task();
          task = nullptr;
          std::lock_guard<std::mutex> done(mutex_);
          --running_;
          idle_.notify_all();
        }).detach();
        return;
      }
    }
    t_refusing = true;
    task();
    t_refusing = false;
  }

  void shutdown() override {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
  }

 private:
  const int64_t max_;
  std::mutex mutex_;
  std::condition_variable idle_;
  int64_t running_ = 0;
};

}  // namespace

/// A connection as httplib's request parser reads it: its reads are bounded by the request's
/// deadline and byte budget (the head's, then the body's), and end at once when the server stops.
/// A request over either bound is answered here (408, 431, 413) and the connection closed.
class HttpServer::Connection : public httplib::Stream {
 public:
  Connection(socket_t sock, const HttpServer& server) : sock_(sock), server_(server) {}

  /// Waits up to `idle` for the next request's first byte; false on timeout, stop or an error.
  bool wait_for_request(std::chrono::seconds idle) {
    if (buffered() > 0) return true;
    const auto until = Clock::now() + idle;
    while (!closing_ && !server_.stopping_.load()) {
      const auto now = Clock::now();
      if (now >= until) return false;
      pollfd p{sock_, POLLIN, 0};
      const auto slice = std::min<Clock::duration>(kPollSlice, until - now);
      const int ready = ::poll(&p, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(slice).count()));
      if (ready > 0) return true;
      if (ready < 0 && errno != EINTR) return false;
    }
    return false;
  }

  /// A new request starts: its deadline runs, its head may take kMaxHeadBytes.
  void begin_request() {
    deadline_ = Clock::now() + server_.limits_.request_deadline;
    budget_ = kMaxHeadBytes;
    in_head_ = true;
    handling_ = false;
  }
  /// The head is in: the body may take the body limit (and its chunk framing).
  void head_read() {
    in_head_ = false;
    budget_ = 8 * server_.limits_.max_body_bytes + kMaxHeadBytes;
  }
  /// The whole request is in: no deadline while it is handled and answered.
  void request_read() { handling_ = true; }
  /// The connection closes after this answer (its body was not read).
  void close_after_answer() { close_after_answer_ = true; }
  bool closes_after_answer() const { return close_after_answer_ || closing_; }

  bool is_readable() const override { return buffered() > 0 || poll_once(POLLIN, 0); }
  bool is_writable() const override { return !closing_ && poll_once(POLLOUT, write_timeout_ms()); }

  ssize_t read(char* ptr, size_t size) override {
    if (closing_) return -1;
    if (buffered() == 0) {
      const ssize_t got = fill();
      if (got <= 0) return got;
    }
    const size_t n = std::min(size, buffered());
    std::copy_n(buffer_ + position_, n, ptr);
    position_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (closing_ || !is_writable()) return -1;
    return ::send(sock_, ptr, size, MSG_NOSIGNAL);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    if (::getpeername(sock_, reinterpret_cast<sockaddr*>(&address), &length) == 0) ip_and_port(address, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&address), &length) == 0) ip_and_port(address, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  size_t buffered() const { return length_ - position_; }

  int write_timeout_ms() const {
    return static_cast<int>(server_.write_timeout_sec_ * 1000 + server_.write_timeout_usec_ / 1000);
  }

  bool poll_once(short events, int timeout_ms) const {
    pollfd p{sock_, events, 0};
    return ::poll(&p, 1, timeout_ms) > 0;
  }

  // Answers `status` with `message` itself and closes: httplib's own answer (a 400) never follows.
  ssize_t refuse(int status, const std::string& message) {
    send_now(sock_, raw_answer(server_.refuse_, status, message));
    closing_ = true;
    return -1;
  }

 public:
  /// Ends a connection whose request was not read to its end: the answer is followed by the end
  /// of the stream, then what the client still sends is read and dropped for a while (bounded in
  /// time and bytes), so that a client still sending its body reads the answer instead of a reset.
  void linger() {
    ::shutdown(sock_, SHUT_WR);
    size_t left = 8 * server_.limits_.max_body_bytes + kMaxHeadBytes;
    const auto until = Clock::now() + kLinger;
    while (left > 0 && !server_.stopping_.load()) {
      const auto now = Clock::now();
      if (now >= until) break;
      pollfd p{sock_, POLLIN, 0};
      const auto slice = std::min<Clock::duration>(kPollSlice, until - now);
      const int ready = ::poll(&p, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(slice).count()));
      if (ready < 0 && errno != EINTR) break;
      if (ready <= 0) continue;
      const ssize_t got = ::recv(sock_, buffer_, std::min(sizeof(buffer_), left), 0);
      if (got <= 0) break;
      left -= static_cast<size_t>(got);
    }
  }

 private:

  // Reads what has arrived into the buffer, waiting within the deadline (while the request is read)
  // and httplib's read timeout; -1 on a bound, the stop, a timeout or an error; 0 at the end.
  ssize_t fill() {
    if (!handling_ && budget_ == 0) {
      return in_head_ ? refuse(431, fmt::format("the request head is larger than {} bytes", kMaxHeadBytes))
                      : refuse(413, fmt::format("the request body is too large: more than {} bytes (chunked)",
                                                server_.limits_.max_body_bytes));
    }
    const auto read_timeout = std::chrono::seconds(server_.read_timeout_sec_) +
                              std::chrono::microseconds(server_.read_timeout_usec_);
    const auto give_up = Clock::now() + read_timeout;
    for (;;) {
      if (server_.stopping_.load()) return -1;
      const auto now = Clock::now();
      if (!handling_ && now >= deadline_) {
        return refuse(408, fmt::format("the request did not arrive within {} s; send it faster",
                                       server_.limits_.request_deadline.count() / 1000.0));
      }
      if (now >= give_up) return -1;
      auto until = std::min(give_up, handling_ ? give_up : deadline_);
      const auto slice = std::min<Clock::duration>(kPollSlice, until - now);
      pollfd p{sock_, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(slice).count()));
      if (ready > 0) break;
      if (ready < 0 && errno != EINTR) return -1;
    }
    const size_t room = handling_ ? sizeof(buffer_) : std::min(sizeof(buffer_), budget_);
    const ssize_t got = ::recv(sock_, buffer_, room, 0);
    if (got <= 0) return got;
    if (!handling_) budget_ -= static_cast<size_t>(got);
    position_ = 0;
    length_ = static_cast<size_t>(got);
    return got;
  }

  socket_t sock_;
  const HttpServer& server_;
  char buffer_[4096];
  size_t position_ = 0, length_ = 0;
  Clock::time_point deadline_;
  size_t budget_ = kMaxHeadBytes;
  bool in_head_ = true;
  bool handling_ = false;
  bool close_after_answer_ = false;
  bool closing_ = false;
};

namespace {

// The connection the calling thread serves (httplib runs a request's handlers on its thread).
thread_local HttpServer::Connection* t_connection = nullptr;

}  // namespace

HeadRefusal check_request_head(const httplib::Request& request, size_t max_body_bytes, bool takes_body,
                               bool takes_form) {
  const std::string encoding = request.get_header_value("Content-Encoding");
  if (request.get_header_value_count("Content-Encoding") > 1 ||
      (!encoding.empty() && !equals_ignoring_case(encoding, "identity"))) {
    return {415, fmt::format("the request body is encoded ('Content-Encoding: {}'); send it unencoded", encoding)};
  }
  const bool has_transfer_encoding = request.has_header("Transfer-Encoding");
  const bool chunked = request.get_header_value_count("Transfer-Encoding") == 1 &&
                       equals_ignoring_case(request.get_header_value("Transfer-Encoding"), "chunked");
  if (has_transfer_encoding && !chunked) {
    return {501, fmt::format("'Transfer-Encoding: {}' is not supported; send the body with a Content-Length or "
                             "chunked",
                             request.get_header_value("Transfer-Encoding"))};
  }
  const size_t lengths = request.get_header_value_count("Content-Length");
  if (chunked && lengths > 0) return {400, "the request has both a Content-Length and 'Transfer-Encoding: chunked'"};
  if (lengths > 1) return {400, "the request has several Content-Length headers"};
  uint64_t length = 0;
  if (lengths == 1) {
    const std::string text = request.get_header_value("Content-Length");
    // At most 19 digits: every such number fits in 64 bits.
    if (text.empty() || text.size() > 19 || text.find_first_not_of("0123456789") != std::string::npos) {
      return {400, fmt::format("'Content-Length: {}' is not a number of bytes", text.substr(0, 40))};
    }
    length = std::stoull(text);
    if (length > max_body_bytes) {
      return {413, fmt::format("the request body is too large: {} bytes, at most {} are accepted", length,
                               max_body_bytes)};
    }
  }
  const std::string& method = request.method;
  if (lengths == 0 && !chunked && (method == "POST" || method == "PUT" || method == "PATCH")) {
    return {411, fmt::format("a {} needs a Content-Length header (or a chunked body)", method)};
  }
  if ((chunked || length > 0) && !takes_body) {
    if (method == "POST") return {404, fmt::format("no route {} {}", method, request.path)};
    return {400, fmt::format("{} {} takes no request body", method, request.path)};
  }
  const std::string content_type = request.get_header_value("Content-Type");
  if (takes_body && (request.is_multipart_form_data() || is_form_data(content_type)) && !takes_form) {
    return {415, fmt::format("multipart bodies are not accepted at {}; send the request as JSON (Content-Type: "
                             "application/json)",
                             request.path)};
  }
  if (takes_body && takes_form && is_form_data(content_type)) {
    try {
      multipart_boundary(content_type);
    } catch (const ApiError& error) {
      return {error.status(), error.message()};
    }
  } else if (takes_body && takes_form && equals_ignoring_case(content_type.substr(0, 10), "multipart/")) {
    return {415, fmt::format("a {} body is not accepted; send multipart/form-data or JSON",
                             content_type.substr(0, content_type.find(';')))};
  }
  return {};
}

HttpServer::HttpServer(HttpLimits limits, Refuse refuse) : limits_(limits), refuse_(std::move(refuse)) {
  new_task_queue = [max = limits.max_connections] { return new ConnectionThreads(max); };
  // Belt and braces: httplib's own check of a Content-Length (check_request_head answers first).
  set_payload_max_length(limits.max_body_bytes);
  // A read waits at most the request's deadline: a stalled request is answered 408 there.
  set_read_timeout(limits.request_deadline);
  set_pre_routing_handler([this](const httplib::Request& request, httplib::Response& response) {
    const auto route = request.method == "POST" ? body_paths_.find(request.path) : body_paths_.end();
    const bool takes_body = route != body_paths_.end();
    const HeadRefusal refusal =
        check_request_head(request, limits_.max_body_bytes, takes_body, takes_body && route->second);
    if (refusal.status != 0) {
      refuse_and_close(response, refusal.status, refusal.message);
      return HandlerResponse::Handled;
    }
    if (t_connection != nullptr) {
      // A request without a body is whole once its head is in; one with a body, once it is read.
      if (takes_body) {
        t_connection->head_read();
      } else {
        t_connection->request_read();
      }
    }
    return HandlerResponse::Unhandled;
  });
}

HttpServer::~HttpServer() { stop_now(); }

void HttpServer::refuse_and_close(httplib::Response& response, int status, const std::string& message) const {
  refuse_(response, status, message);
  response.set_header("Connection", "close");
  if (t_connection != nullptr) t_connection->close_after_answer();
}

void HttpServer::post_with_body(const std::string& path, BodyHandler handler, bool takes_form) {
  body_paths_[path] = takes_form;
  Post(path, [this, handler = std::move(handler)](const httplib::Request& request, httplib::Response& response,
                                                  const httplib::ContentReader& read) {
    std::string body;
    bool too_large = false;
    const auto receive = [&](const char* data, size_t size) {
      if (body.size() + size > limits_.max_body_bytes) {
        too_large = true;
        return false;
      }
      body.append(data, size);
      return true;
    };
    bool complete = false;
    if (request.is_multipart_form_data()) {
      // httplib 0.11 hands a form's body only to its own part parser (it passes a client's file
      // name through as given, ignores a part's unknown headers, and says nothing of why it
      // refuses a body): the body is read here as its bytes, under the same bounds, and split by
      // parse_multipart. httplib picks its parser from the request's Content-Type, which is
      // therefore hidden while the body is read (the request is httplib's own, not const).
      auto& headers = const_cast<httplib::Request&>(request).headers;
      const auto type = headers.find("Content-Type");
      std::string content_type = std::exchange(type->second, "application/octet-stream");
      complete = read(receive);
      type->second = std::move(content_type);
    } else {
      complete = read(receive);
    }
    if (too_large) {
      refuse_and_close(response, 413,
                       fmt::format("the request body is too large: more than {} bytes (chunked)",
                                   limits_.max_body_bytes));
      return;
    }
    if (!complete) {
      refuse_and_close(response, 400, "the request body could not be read: malformed chunks, or the client "
                                      "stopped sending");
      return;
    }
    if (t_connection != nullptr) t_connection->request_read();
    handler(request, body, response);
    // The body and what the handler decoded from it are freed, their pages given back to the OS
    // (core/heap.h), before the answer is written: a client that has its answer sees the
    // server's memory without its request.
    std::string().swap(body);
    release_freed_memory();
  });
}

bool HttpServer::bind_to_port(const std::string& host, int port) {
  return httplib::Server::bind_to_port(host, port) && ::listen(svr_sock_, kListenBacklog) == 0;
}

int HttpServer::bind_to_any_port(const std::string& host) {
  const int port = httplib::Server::bind_to_any_port(host);
  return port > 0 && ::listen(svr_sock_, kListenBacklog) == 0 ? port : -1;
}

bool HttpServer::client_disconnected() {
  if (t_connection == nullptr) return false;
  const socket_t sock = t_connection->socket();
  pollfd p{sock, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLERR | POLLHUP | POLLRDHUP)) != 0) return true;
  // Readable: either the end of the stream (closed) or bytes the client sent ahead (still there).
  char byte = 0;
  const ssize_t got = ::recv(sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

void HttpServer::stop_now() {
  stopping_.store(true);
  if (is_running()) stop();
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  if (t_refusing) {
    send_now(sock, raw_answer(refuse_, 503,
                              fmt::format("the server has {} connections open, its most; retry later",
                                          limits_.max_connections)));
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return false;
  }
  if (limits_.max_connections_per_client > 0) {
    const std::string client = peer_address(sock);
    {
      std::lock_guard<std::mutex> lock(clients_mutex_);
      int64_t& open = connections_of_client_[client];
      if (open < limits_.max_connections_per_client) {
        ++open;
      } else {
        send_now(sock, raw_answer(refuse_, 503,
                                  fmt::format("this client ({}) has {} connections open, the most one client may; "
                                              "retry later",
                                              client, limits_.max_connections_per_client)));
        ::shutdown(sock, SHUT_RDWR);
        ::close(sock);
        return false;
      }
    }
    const bool result = serve_connection(sock);
    std::lock_guard<std::mutex> lock(clients_mutex_);
    if (--connections_of_client_[client] == 0) connections_of_client_.erase(client);
    return result;
  }
  return serve_connection(sock);
}

bool HttpServer::serve_connection(socket_t sock) {
  // httplib's keep-alive loop (process_server_socket_core), over a Connection instead of its
  // SocketStream.
  Connection connection(sock, *this);
  t_connection = &connection;
  bool result = false;
  for (size_t left = keep_alive_max_count_; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
    if (!connection.wait_for_request(std::chrono::seconds(keep_alive_timeout_sec_))) break;
    connection.begin_request();
    bool closed = false;
    result = process_request(connection, /*close_connection=*/left == 1, closed, nullptr);
    // The request's body and answer are freed: their pages go back to the OS now, so a burst of
    // large bodies does not stay resident (core/heap.h).
    release_freed_memory();
    if (!result || closed || connection.closes_after_answer()) break;
  }
  t_connection = nullptr;
  if (connection.closes_after_answer()) connection.linger();
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return result;
}

}  // namespace shardit::serving
