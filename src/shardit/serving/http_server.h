#pragma once
// cpp-httplib's server with the limits its 0.11 series leaves open, for a server that faces
// careless or hostile clients: a chunked body or one without a length is read whole, an encoded
// (gzip, brotli) body is bounded before decoding only, a bad Content-Length is answered after a
// read timeout, every connection waits for one of a fixed number of threads, and a client that
// sends one byte a second (or endless header lines) keeps its thread forever. Here every request
// head is checked before any body byte is read (one step, check_request_head), heads and bodies
// are bounded while they are read, each connection has its own thread up to a cap, and each
// request must arrive within a deadline.
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

namespace shardit::serving {

struct HttpLimits {
  /// The largest request body in bytes, however it is sent (Content-Length or chunked). Encoded
  /// bodies (Content-Encoding) are refused, so a body is never larger once decoded.
  size_t max_body_bytes = size_t{1} << 20;
  /// Connections served at once, each on its own thread; one more is answered 503 and closed.
  int64_t max_connections = 64;
  /// Connections one client address may hold at once (0: no cap); one more is answered 503 and
  /// closed, so one host cannot take every connection thread. Off by default: behind a proxy or
  /// load balancer every request comes from its address.
  int64_t max_connections_per_client = 0;
  /// The most time one request's head and body may take to arrive, counted from its first byte (an
  /// idle connection is closed after httplib's keep-alive timeout, 5 s): a slower client is
  /// answered 408 and its connection closed.
  std::chrono::milliseconds request_deadline{10000};
};

/// A refusal decided before the request reached a handler: the HTTP status and what to tell.
struct HeadRefusal {
  int status = 0;  ///< 0: accepted
  std::string message;
};

/// The checks every request head passes before any of its body is read: no Content-Encoding, a
/// Transfer-Encoding only "chunked" and not beside a Content-Length, one Content-Length that is a
/// plain byte count within `max_body_bytes`, a length (or chunks) for POST, PUT and PATCH, a
/// body only where `takes_body` says a route reads one, and a multipart/form-data body only where
/// `takes_form` says the route reads forms, with a boundary (serving/multipart.h).
HeadRefusal check_request_head(const httplib::Request& request, size_t max_body_bytes, bool takes_body,
                               bool takes_form = false);

class HttpServer : public httplib::Server {
 public:
  /// Writes a refusal's status and body (the API's error object) into a response.
  using Refuse = std::function<void(httplib::Response&, int status, const std::string& message)>;
  /// A route's handler given the request's whole body.
  using BodyHandler = std::function<void(const httplib::Request&, const std::string& body, httplib::Response&)>;
  /// One client connection as the request parser reads it (http_server.cpp).
  class Connection;

  HttpServer(HttpLimits limits, Refuse refuse);
  ~HttpServer() override;

  /// httplib's binds, then a listen backlog for bursts of clients (httplib's is 5: a sixth client
  /// connecting at once waits a second for its SYN to be sent again).
  bool bind_to_port(const std::string& host, int port);
  int bind_to_any_port(const std::string& host);

  /// POST `path` (an exact path), its body read under the limits before `handler` runs; with
  /// `takes_form`, a multipart/form-data body too, read as its bytes (parse_multipart splits it).
  void post_with_body(const std::string& path, BodyHandler handler, bool takes_form = false);
  /// Whether the client whose request this thread is handling has closed its connection (an end
  /// of stream or an error is waiting on its socket; data it sent ahead is left unread). False
  /// outside a handler.
  static bool client_disconnected();
  /// Stops accepting, and ends at once every connection waiting for (part of) a request; answers
  /// being computed or written finish.
  void stop_now();

 private:
  // httplib's per-connection entry point (private there, overridable): the keep-alive loop over a
  // Connection, or a 503 when the cap (or the client's cap) is reached.
  bool process_and_close_socket(socket_t sock) override;
  // The keep-alive loop over one accepted connection, then closes it.
  bool serve_connection(socket_t sock);
  void refuse_and_close(httplib::Response& response, int status, const std::string& message) const;

  const HttpLimits limits_;
  std::mutex clients_mutex_;
  std::map<std::string, int64_t> connections_of_client_;  ///< open connections per peer address
  const Refuse refuse_;
  std::map<std::string, bool> body_paths_;  ///< POST routes that read a body: whether they read forms
  std::atomic<bool> stopping_{false};
};

}  // namespace shardit::serving
