// `shardit serve` end to end: a real server (the CLI as a subprocess, TP=2 on loopback) driven by a
// real HTTP client. The image equals `shardit generate`'s; bad requests get their documented
// status and message while the server keeps serving; a full queue answers 429; a lost rank fails
// /health and the server exits non-zero naming it; SIGTERM stops it with exit code 0.
// The cases wait on what the server reports (a line, /health, a job's status, /metrics, an
// answer), never on a clock: the hang deadline (kHangDeadline) only ends a hung case.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <future>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "shardit/io/image.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/serving/base64.h"
#include "shardit/models/builtin.h"
#include "support/single_file_case.h"
#include "support/test_support.h"

namespace test_serve {
namespace {

using nlohmann::json;
using shardit::testing::cli_path;
using shardit::testing::make_temp_dir;
using shardit::testing::run_command;
using ::testing::HasSubstr;
using ::testing::Not;
using shardit::testing::kHangDeadline;
using shardit::testing::poll_until;
using Clock = std::chrono::steady_clock;

// The pipeline every case serves: the built-in tiny FLUX.1 pipeline, with its CLIP and T5 text
// encoders and tokenizers (prompts need them), written once per test process. Prompts are kept to
// 64 tokens by the server and by `generate` alike.
const std::string kModelId = "tiny-flux";
std::string served_model() {
  static const std::string path =
      shardit::models::write_builtin_model(make_temp_dir("serve-model") + "/" + kModelId).pipeline;
  return path;
}
const std::string kMaxSequenceLength = "64";

// A write to a connection the server closed is an error for the client, not a death by SIGPIPE
// (httplib's client sends without MSG_NOSIGNAL).
[[maybe_unused]] const bool kSigpipeIgnored = std::signal(SIGPIPE, SIG_IGN) != SIG_ERR;

// A tiny, quick request: 2 steps at 64x48.
const json kValid = {{"prompt", "A cat holding a sign that says hello world"},
                     {"size", "64x48"},
                     {"num_inference_steps", 2},
                     {"seed", 7}};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t length = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// A child process with its stdout and stderr in a log file; SIGKILLed when still running at the end.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env, std::string log)
      : log_(std::move(log)) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      for (const auto& [key, value] : env) ::setenv(key.c_str(), value.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
  }
  ~Process() {
    if (!status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  std::string log() const { return read_text(log_); }

  // The port from the "listening on http://host:port" line, once the model is loaded.
  int wait_listening() {
    const std::regex line_re("listening on http://[^:]+:([0-9]+)");
    const auto deadline = Clock::now() + kHangDeadline;
    while (Clock::now() < deadline) {
      std::smatch match;
      const std::string text = log();
      if (std::regex_search(text, match, line_re)) return std::stoi(match[1]);
      if (exited(std::chrono::milliseconds(100))) break;
    }
    ADD_FAILURE() << "the server did not start; its output:\n" << log();
    return 0;
  }

  // Whether the process exited within `limit` (its status in exit_code()).
  bool exited(std::chrono::milliseconds limit = kHangDeadline) {
    const auto deadline = Clock::now() + limit;
    do {
      if (status_) return true;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        status_ = status;
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (Clock::now() < deadline);
    return false;
  }
  /// The exit code (128 + signal when killed); -1 while running.
  int exit_code() const {
    if (!status_) return -1;
    return WIFSIGNALED(*status_) ? 128 + WTERMSIG(*status_) : WEXITSTATUS(*status_);
  }

 private:
  pid_t pid_ = -1;
  std::string log_;
  std::optional<int> status_;
};

// `shardit --nproc-per-node <ranks> --timeout 20 serve --model <model> --port 0 <extra>`.
std::unique_ptr<Process> start_server(const std::string& dir, const std::vector<std::string>& extra,
                                      const std::string& ranks = "2", const std::string& model = served_model()) {
  std::vector<std::string> argv = {cli_path(), "--nproc-per-node", ranks, "--timeout", "20", "serve",
                                   "--model", model, "--port", "0",
                                   "--max-sequence-length", kMaxSequenceLength};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return std::make_unique<Process>(argv, std::map<std::string, std::string>{}, dir + "/server.log");
}

/// `shardit --nproc-per-node 2 generate <arguments>`'s PNG (written under `dir`), which `served`
/// must equal bit for bit; returned for further checks.
at::Tensor expect_generate_equals(const at::Tensor& served, const std::string& dir, const std::string& arguments) {
  std::string output;
  const std::string generated = dir + "/generated.png";
  const int code = run_command(cli_path() + " --nproc-per-node 2 generate " + arguments + " --max-sequence-length " +
                                   kMaxSequenceLength + " --out " + generated,
                               &output);
  EXPECT_EQ(code, 0) << output;
  if (code != 0) return {};
  const at::Tensor expected = shardit::io::read_png(generated);
  EXPECT_EQ(served.sizes(), expected.sizes());
  if (served.sizes() == expected.sizes()) {
    EXPECT_TRUE(served.equal(expected)) << "the served image differs from generate's in "
                                        << served.ne(expected).sum().item<int64_t>() << " values";
  }
  return expected;
}

std::unique_ptr<httplib::Client> client(int port) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", port);
  c->set_read_timeout(kHangDeadline);
  c->set_connection_timeout(kHangDeadline);
  return c;
}

httplib::Result post(int port, const std::string& body, const std::string& path = "/v1/images/generations") {
  return client(port)->Post(path.c_str(), body, "application/json");
}

// A connection to the server on loopback written to byte by byte, as a hostile client does.
class RawConnection {
 public:
  explicit RawConnection(int port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawConnection() { ::close(fd_); }
  bool connected() const { return connected_; }
  /// Sends all of `bytes`; false once the server closed the connection.
  bool send(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }
  /// What the server sends until it closes the connection (closed() then holds) or the hang
  /// deadline passes.
  std::string read_until_closed() {
    std::string text;
    const auto deadline = Clock::now() + kHangDeadline;
    while (!closed_ && Clock::now() < deadline) receive(50, text);
    return text;
  }
  /// One whole answer (its head, and as many body bytes as its Content-Length says), for a
  /// connection the server keeps open; what came when the hang deadline passes.
  std::string read_answer() {
    std::string text;
    const auto deadline = Clock::now() + kHangDeadline;
    while (!closed_ && Clock::now() < deadline && !whole_answer(text)) receive(50, text);
    return text;
  }
  /// Whether the server has sent anything, or closed the connection, that was not read yet.
  bool answered() {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  bool closed() const { return closed_; }

 private:
  // Waits up to `wait_ms` for bytes and appends them; an end of stream or an error closes.
  void receive(int wait_ms, std::string& text) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, wait_ms) <= 0) return;
    char buffer[65536];
    const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
    if (n <= 0) {
      closed_ = true;
      return;
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  static bool whole_answer(const std::string& text) {
    const size_t head_end = text.find("\r\n\r\n");
    if (head_end == std::string::npos) return false;
    std::smatch match;
    static const std::regex length_re("\r\n[Cc]ontent-[Ll]ength: *([0-9]+)\r\n");
    const std::string head = text.substr(0, head_end + 2);
    const size_t length = std::regex_search(head, match, length_re) ? std::stoul(match[1]) : 0;
    return text.size() >= head_end + 4 + length;
  }

  int fd_;
  bool connected_ = false;
  bool closed_ = false;
};

std::string fmt_hex(size_t value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%zx", value);
  return text;
}

// The status of a raw answer ("HTTP/1.1 413 ..."), 0 when there is none.
int raw_status(const std::string& answer) {
  std::smatch match;
  static const std::regex status_re("^HTTP/1\\.1 ([0-9]{3}) ");
  return std::regex_search(answer, match, status_re) ? std::stoi(match[1]) : 0;
}

// The error message of a raw answer's JSON body.
std::string raw_message(const std::string& answer) {
  const size_t body = answer.find("\r\n\r\n");
  if (body == std::string::npos) return "";
  const json parsed = json::parse(answer.substr(body + 4), nullptr, false);
  return parsed.is_discarded() ? "" : parsed["error"].value("message", "");
}

// The pixels of the base64 PNG of a 200 answer.
at::Tensor png_pixels(const std::string& b64, const std::string& dir, const std::string& name) {
  const auto bytes = shardit::serving::base64_decode(b64);
  EXPECT_TRUE(bytes.has_value()) << "b64_json is not base64";
  write_text(dir + "/" + name, bytes.value_or(""));
  return shardit::io::read_png(dir + "/" + name);
}

// The status of job `id` as GET /v1/jobs/{id} reports it ("" when it does not answer 200).
std::string job_status(int port, const std::string& id) {
  auto job = client(port)->Get(("/v1/jobs/" + id).c_str());
  return job && job->status == 200 ? json::parse(job->body)["status"].get<std::string>() : "";
}

// Starts a long request (256x256, `steps` steps, X-Request-Id `id`) and waits until the server
// reports its job running; its answer is the future's. False in `started` when it never started.
std::future<httplib::Result> start_long_request(int port, int steps, const std::string& id, bool* started) {
  json slow = kValid;
  slow["size"] = "256x256";
  slow["num_inference_steps"] = steps;
  auto answer = std::async(std::launch::async, [port, id, body = slow.dump()] {
    return client(port)->Post("/v1/images/generations", httplib::Headers{{"X-Request-Id", id}}, body,
                              "application/json");
  });
  *started = poll_until([&] { return job_status(port, id) == "running"; });
  return answer;
}

TEST(Serve, ImageEqualsGenerateAndSigtermExitsZero) {
  const std::string dir = make_temp_dir("serve_equal");
  const std::string images = dir + "/images";
  std::filesystem::create_directories(images);
  auto server = start_server(dir, {"--output-dir", images});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);

  auto health = client(port)->Get("/health");
  ASSERT_TRUE(health) << "GET /health failed";
  EXPECT_EQ(health->status, 200) << health->body;
  const json health_json = json::parse(health->body);
  EXPECT_EQ(health_json["status"], "ok");
  EXPECT_EQ(health_json["ranks"].size(), 2u);

  auto models = client(port)->Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], kModelId);

  auto answer = post(port, kValid.dump());
  ASSERT_TRUE(answer) << "POST failed: " << httplib::to_string(answer.error());
  ASSERT_EQ(answer->status, 200) << answer->body;
  const json body = json::parse(answer->body);
  ASSERT_EQ(body["data"].size(), 1u);
  EXPECT_EQ(body["size"], "64x48");
  const at::Tensor served = png_pixels(body["data"][0]["b64_json"], dir, "served.png");

  // The same image from `shardit generate` at the same TP degree, seed, size, steps and prompt.
  const at::Tensor expected = expect_generate_equals(
      served, dir,
      "--model " + served_model() + " --prompt 'A cat holding a sign that says hello world' --seed 7 --width 64 "
      "--height 48 --steps 2");
  ASSERT_TRUE(expected.defined());

  // response_format "url": the same picture, written under --output-dir and served by the server.
  json as_url = kValid;
  as_url["response_format"] = "url";
  auto url_answer = post(port, as_url.dump());
  ASSERT_TRUE(url_answer);
  ASSERT_EQ(url_answer->status, 200) << url_answer->body;
  const std::string url = json::parse(url_answer->body)["data"][0]["url"];
  const std::string prefix = "http://127.0.0.1:" + std::to_string(port);
  ASSERT_EQ(url.rfind(prefix, 0), 0u) << url;
  auto file = client(port)->Get(url.substr(prefix.size()).c_str());
  ASSERT_TRUE(file);
  ASSERT_EQ(file->status, 200);
  write_text(dir + "/from_url.png", file->body);
  EXPECT_TRUE(shardit::io::read_png(dir + "/from_url.png").equal(expected));

  // A symbolic link placed in --output-dir is never served, whatever it points to.
  std::filesystem::create_symlink("/etc/passwd", images + "/linked.png");
  auto linked = client(port)->Get("/images/linked.png");
  ASSERT_TRUE(linked);
  EXPECT_EQ(linked->status, 404) << linked->body;
  EXPECT_THAT(linked->body, Not(HasSubstr("root:"))) << "the link's target was served";
  // A Host header that is not a plain host[:port] is not echoed into the answer's URLs.
  auto hostile_host = client(port)->Post("/v1/images/generations", {{"Host", "evil.example/<script>"}},
                                         as_url.dump(), "application/json");
  ASSERT_TRUE(hostile_host);
  ASSERT_EQ(hostile_host->status, 200) << hostile_host->body;
  const std::string hostile_url = json::parse(hostile_host->body)["data"][0]["url"];
  EXPECT_EQ(hostile_url.rfind(prefix, 0), 0u) << hostile_url;
  EXPECT_THAT(hostile_url, Not(HasSubstr("evil")));

  auto metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_THAT(metrics->body, HasSubstr("shardit_requests_total{endpoint=\"generations\",status=\"200\"} 3"));
  EXPECT_THAT(metrics->body, HasSubstr("shardit_request_duration_seconds_count 3"));
  EXPECT_THAT(metrics->body, HasSubstr("shardit_rank_resident_memory_bytes{rank=\"1\"}"));
  EXPECT_THAT(metrics->body, HasSubstr("shardit_denoising_steps_total 6"));

  // Every field of OpenAI's request schema: answered, a warning for each without a meaning here;
  // output_format "jpeg" written as a .jpg file and served as image/jpeg.
  json every = as_url;
  every.update(json{{"quality", "standard"}, {"style", "vivid"}, {"user", "u1"}, {"background", "auto"},
                    {"moderation", "auto"}, {"output_format", "jpeg"}, {"output_compression", 90},
                    {"partial_images", 0}, {"stream", false}, {"input_fidelity", "low"}});
  auto every_answer = post(port, every.dump());
  ASSERT_TRUE(every_answer);
  ASSERT_EQ(every_answer->status, 200) << every_answer->body;
  const json every_body = json::parse(every_answer->body);
  EXPECT_EQ(every_body["warnings"].size(), 6u) << every_body["warnings"].dump();
  const std::string jpeg_url = every_body["data"][0]["url"];
  ASSERT_EQ(jpeg_url.compare(jpeg_url.size() - 4, 4, ".jpg"), 0) << jpeg_url;
  auto jpeg = client(port)->Get(jpeg_url.substr(prefix.size()).c_str());
  ASSERT_TRUE(jpeg);
  ASSERT_EQ(jpeg->status, 200);
  EXPECT_EQ(jpeg->get_header_value("Content-Type"), "image/jpeg");
  EXPECT_EQ(shardit::io::sniff_image_format(jpeg->body.substr(0, 8)), "jpeg");
  EXPECT_EQ(shardit::io::decode_image(jpeg->body).sizes(), expected.sizes());

  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
  EXPECT_THAT(server->log(), HasSubstr("shardit serve: stopped"));
}

struct BadRequest {
  std::string body;
  int status;
  std::string message;  ///< exact, or the start when it ends with "..."
  std::string param;    ///< "" for null
};

// kValid's image from `shardit generate` at TP=2 with `options` added, written to `png`.
at::Tensor generate_valid(const std::string& png, const std::string& options) {
  std::string output;
  const int code = run_command(cli_path() + " --nproc-per-node 2 generate --model " + served_model() +
                                   " --prompt 'A cat holding a sign that says hello world' --seed 7 --width 64 "
                                   "--height 48 --steps 2 --max-sequence-length " + kMaxSequenceLength + " " +
                                   options + " --out " + png,
                               &output);
  EXPECT_EQ(code, 0) << output;
  return shardit::io::read_png(png);
}

// A LoRA adapter on the built-in transformer's first double block (rank 4 on every attention
// projection, of the transformer's width), from a seeded generator.
std::string write_adapter(const std::string& path, int seed) {
  std::ifstream in(served_model() + "/transformer/config.json");
  const json config = json::parse(in);
  const int64_t width = config.at("num_attention_heads").get<int64_t>() * config.at("attention_head_dim").get<int64_t>();
  at::manual_seed(seed);
  std::vector<std::pair<std::string, at::Tensor>> factors;
  for (const std::string module : {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}) {
    const std::string key = "transformer.transformer_blocks.0.attn." + module;
    factors.emplace_back(key + ".lora_A.weight", at::randn({4, width}) * 0.5);
    factors.emplace_back(key + ".lora_B.weight", at::randn({width, 4}) * 0.5);
  }
  shardit::io::save_safetensors(path, factors);
  return path;
}

// The value of a metric line "name value" (or "name{labels} value") in a /metrics answer; -1 when absent.
double metric_value(const std::string& metrics, const std::string& name) {
  const size_t at = metrics.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(metrics.substr(at + name.size() + 2));
}

// `serve --lora` loads the adapter once with the transformer and applies it to every request: the
// served image equals `generate --lora` with the same seed at the same TP degree, and differs
// from the image without the adapter.
TEST(Serve, LoraAppliesToEveryRequestAsInGenerate) {
  const std::string dir = make_temp_dir("serve_lora");
  const std::string lora = write_adapter(dir + "/style.safetensors", 11);

  auto server = start_server(dir, {"--lora", lora + ":0.8"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  auto answer = post(port, kValid.dump());
  ASSERT_TRUE(answer) << "POST failed: " << httplib::to_string(answer.error());
  ASSERT_EQ(answer->status, 200) << answer->body;
  const at::Tensor served = png_pixels(json::parse(answer->body)["data"][0]["b64_json"], dir, "served.png");

  const at::Tensor with_lora = generate_valid(dir + "/lora.png", "--lora " + lora + ":0.8");
  const at::Tensor without = generate_valid(dir + "/base.png", "");
  ASSERT_EQ(served.sizes(), with_lora.sizes());
  EXPECT_TRUE(served.equal(with_lora)) << "the served image differs from generate --lora's in "
                                       << served.ne(with_lora).sum().item<int64_t>() << " values";
  EXPECT_FALSE(with_lora.equal(without)) << "the adapter does not change the image";
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}

// Two adapters loaded at start (one named on the command line, one after its file); requests that
// alternate between none, either and both get the images `generate --lora` makes with the same
// adapters, weights and seed at the same TP degree, and no adapter is read again (the load counter
// stays at 2 while the switch counter grows).
TEST(Serve, LoraChosenPerRequestEqualsGenerateWithoutReload) {
  const std::string dir = make_temp_dir("serve_lora_choice");
  const std::string style = write_adapter(dir + "/style_v1.safetensors", 11);
  const std::string detail = write_adapter(dir + "/detail.safetensors", 12);
  auto server = start_server(dir, {"--lora", "style=" + style + ":0.8", "--lora", detail});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);

  auto models = client(port)->Get("/v1/models");
  ASSERT_TRUE(models);
  const json listed = json::parse(models->body)["data"];
  ASSERT_EQ(listed.size(), 3u) << models->body;
  EXPECT_EQ(listed[1]["id"], "style");
  EXPECT_EQ(listed[1]["parent"], kModelId);
  EXPECT_EQ(listed[1]["default_scale"], 0.8);
  EXPECT_EQ(listed[2]["id"], "detail");

  // None, style, detail, both, none again, and the server's default (both at their start weights).
  const std::vector<std::pair<std::string, json>> choices = {
      {"none", json::array()},
      {"style", json::array({{{"name", "style"}, {"scale", 0.8}}})},
      {"detail", json::array({{{"name", "detail"}}})},
      {"both", json::array({{{"name", "style"}, {"scale", 0.8}}, {{"name", "detail"}, {"scale", 1.0}}})},
      {"none_again", json::array()},
      {"default", json(nullptr)}};
  std::map<std::string, at::Tensor> served;
  for (const auto& [name, lora] : choices) {
    json request = kValid;
    if (!lora.is_null()) request["lora"] = lora;
    auto answer = post(port, request.dump());
    ASSERT_TRUE(answer) << name << ": " << httplib::to_string(answer.error());
    ASSERT_EQ(answer->status, 200) << name << ": " << answer->body;
    served[name] = png_pixels(json::parse(answer->body)["data"][0]["b64_json"], dir, name + ".png");
  }
  // An adapter named as the `model` (as vLLM serves them): the base model with that adapter alone.
  json as_model = kValid;
  as_model["model"] = "detail";
  auto answer = post(port, as_model.dump());
  ASSERT_TRUE(answer);
  ASSERT_EQ(answer->status, 200) << answer->body;
  EXPECT_EQ(json::parse(answer->body)["lora"], json::parse(R"([{"name": "detail", "scale": 1.0}])"));
  served["detail_as_model"] = png_pixels(json::parse(answer->body)["data"][0]["b64_json"], dir, "as_model.png");

  const auto generate = [&](const std::string& name, const std::string& options) {
    return generate_valid(dir + "/generated_" + name + ".png", options);
  };
  const std::map<std::string, at::Tensor> expected = {
      {"none", generate("none", "")},
      {"style", generate("style", "--lora " + style + ":0.8")},
      {"detail", generate("detail", "--lora " + detail)},
      {"both", generate("both", "--lora " + style + ":0.8 --lora " + detail + ":1.0")}};
  const auto same = [](const at::Tensor& a, const at::Tensor& b) { return a.sizes() == b.sizes() && a.equal(b); };
  for (const auto& [name, image] : served) {
    const std::string as = name == "none_again"        ? "none"
                           : name == "default"         ? "both"
                           : name == "detail_as_model" ? "detail"
                                                       : name;
    EXPECT_TRUE(same(image, expected.at(as))) << name << ": the served image differs from generate's ("
                                              << as << ")";
  }
  // The adapters change the image, each differently: the comparisons above can fail.
  EXPECT_FALSE(same(expected.at("none"), expected.at("style")));
  EXPECT_FALSE(same(expected.at("style"), expected.at("detail")));
  EXPECT_FALSE(same(expected.at("style"), expected.at("both")));

  // An unknown adapter is named in a 400, and changes nothing.
  auto unknown = post(port, json{{"prompt", "a"}, {"lora", {{{"name", "style"}}, {{"name", "nope"}}}}}.dump());
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 400);
  EXPECT_EQ(json::parse(unknown->body)["error"]["message"],
            "unknown LoRA adapter \"nope\" in 'lora' (this server loaded: style, detail; GET /v1/models lists them)");

  auto metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metric_value(metrics->body, "shardit_lora_loads_total"), 2) << metrics->body;
  EXPECT_EQ(metric_value(metrics->body, "shardit_lora_adapters"), 2);
  // both -> none -> style -> detail -> both -> none -> both -> detail: seven switches, none for a repeat.
  EXPECT_EQ(metric_value(metrics->body, "shardit_lora_switches_total"), 7);
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}

TEST(Serve, BadRequestsGetTheirStatusAndKeepServing) {
  const std::string dir = make_temp_dir("serve_errors");
  // Bodies bounded at 1 MiB (--max-body-mb; the default, 16, leaves room for edits' images).
  auto server = start_server(dir, {"--max-steps", "50", "--max-body-mb", "1"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  const auto with = [](const json& changes) {
    json body = kValid;
    for (const auto& [key, value] : changes.items()) body[key] = value;
    return body.dump();
  };
  const std::string fields =
      "prompt, model, n, size, response_format, seed, negative_prompt, num_inference_steps, guidance_scale, "
      "true_cfg_scale, cache, lora, user, background, moderation, output_compression, output_format, "
      "partial_images, quality, stream, style, input_fidelity, safety_identifier, complexity, frame_count, "
      "frame_duration_ms, svg";
  const std::vector<BadRequest> cases = {
      {"{not json", 400, "the request body is not valid JSON: ...", ""},
      {R"({"prompt": "a", "prompt": "b"})", 400, "the request body is not valid JSON: ...", ""},
      {"[1, 2]", 400, "the request body must be a JSON object, got array", ""},
      {"{}", 400, "'prompt' is required", "prompt"},
      {R"({"prompt": 5})", 400, "'prompt' must be a string, got integer", "prompt"},
      {R"({"prompt": "  "})", 400, "'prompt' must not be empty", "prompt"},
      {json{{"prompt", std::string(10001, 'a')}}.dump(), 400,
       "'prompt' is 10001 bytes long; at most 10000 are accepted (longer prompts are truncated to " + kMaxSequenceLength + " tokens anyway)",
       "prompt"},
      {with({{"n", 0}}), 400, "'n' must be between 1 and 4, got 0", "n"},
      {with({{"n", "2"}}), 400, "'n' must be an integer, got string", "n"},
      {with({{"n", 1.5}}), 400, "'n' must be an integer, got number", "n"},
      {with({{"size", "big"}}), 400,
       "'size' must be \"WIDTHxHEIGHT\" in pixels (e.g. \"512x512\") or \"auto\", got \"big\"", "size"},
      {with({{"size", "100x64"}}), 400,
       "'size' 100x64 is not supported by this model: width and height must be multiples of 16 (e.g. 96x64)", "size"},
      {with({{"size", "4096x64"}}), 400, "'size' 4096x64 is not supported: width and height must be between 16 and 2048",
       "size"},
      {with({{"response_format", "png"}}), 400, "'response_format' must be \"b64_json\" or \"url\", got \"png\"",
       "response_format"},
      {with({{"response_format", "url"}}), 400,
       "'response_format' \"url\" is not served: the server was started without --output-dir", "response_format"},
      {with({{"num_inference_steps", 0}}), 400, "'num_inference_steps' must be between 1 and 50, got 0",
       "num_inference_steps"},
      {with({{"num_inference_steps", 51}}), 400, "'num_inference_steps' must be between 1 and 50, got 51",
       "num_inference_steps"},
      {with({{"guidance_scale", "high"}}), 400, "'guidance_scale' must be a number, got string", "guidance_scale"},
      {with({{"true_cfg_scale", -1}}), 400, "'true_cfg_scale' must be between 0 and 100, got -1", "true_cfg_scale"},
      {with({{"seed", -1}}), 400, "'seed' must be between 0 and 9223372036854775807, got -1", "seed"},
      {with({{"model", "dall-e-3"}}), 404,
       "the model \"dall-e-3\" does not exist; this server serves '" + kModelId + "'", "model"},
      {with({{"lora", "style"}}), 400, "'lora' must be an array of {\"name\": ..., \"scale\": ...}, got string",
       "lora"},
      {with({{"lora", {{{"name", "style"}, {"weight", 1}}}}}), 400,
       "unknown field \"weight\" in 'lora[0]' (fields: name, scale)", "lora"},
      {with({{"lora", {{{"name", "style"}, {"scale", "high"}}}}}), 400,
       "'lora[0].scale' must be a number, got string", "lora[0].scale"},
      {with({{"lora", {{{"name", "style"}}, {{"name", "ink"}}}}}), 400,
       "unknown LoRA adapters \"style\", \"ink\" in 'lora' (this server loaded: none, start it with --lora "
       "NAME=FILE; GET /v1/models lists them)",
       "lora"},
      {with({{"steps", 4}}), 400, "unknown field \"steps\" (fields: " + fields + ")", "steps"},
      {with({{"stream", true}}), 400,
       "'stream' true is not supported: this server answers with the finished images only (no server-sent events "
       "or partial images); leave 'stream' out or send false",
       "stream"},
      {with({{"background", "transparent"}}), 400,
       "'background' \"transparent\" is not supported: this pipeline's images have no alpha channel; send "
       "\"opaque\" or \"auto\"",
       "background"},
      {with({{"output_format", "webp"}}), 400, "'output_format' \"webp\" is not supported: send \"png\" or \"jpeg\"",
       "output_format"},
      {with({{"quality", 1}}), 400, "'quality' must be a string, got integer", "quality"},
      {"{\"prompt\": \"a cat \xff\xfe\", \"n\": 1}", 400, "'prompt' is not valid UTF-8; send text as UTF-8", "prompt"},
      {"{\"pro\xc3mpt\": \"a cat\"}", 400,
       "the request body is not valid UTF-8 (in a field name); send text as UTF-8", ""},
  };
  ASSERT_GE(cases.size(), 20u);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.body.substr(0, 200));
    auto answer = post(port, c.body);
    ASSERT_TRUE(answer) << "no answer: " << httplib::to_string(answer.error());
    EXPECT_EQ(answer->status, c.status) << answer->body;
    const json error = json::parse(answer->body)["error"];
    const std::string message = error["message"];
    if (c.message.size() > 3 && c.message.compare(c.message.size() - 3, 3, "...") == 0) {
      EXPECT_EQ(message.rfind(c.message.substr(0, c.message.size() - 3), 0), 0u) << message;
    } else {
      EXPECT_EQ(message, c.message);
    }
    EXPECT_EQ(error["type"], c.status == 404 || c.status == 400 ? "invalid_request_error" : "?");
    EXPECT_EQ(error["param"], c.param.empty() ? json(nullptr) : json(c.param));
  }
  // The routes and limits httplib enforces answer in the same shape.
  auto get = client(port)->Get("/v1/images/generations");
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 405);
  EXPECT_EQ(json::parse(get->body)["error"]["message"], "use POST for /v1/images/generations");
  auto missing = post(port, kValid.dump(), "/v1/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(json::parse(missing->body)["error"]["message"], "no route POST /v1/nothing");
  auto huge = post(port, std::string(2 << 20, ' '));
  ASSERT_TRUE(huge);
  EXPECT_EQ(huge->status, 413);
  EXPECT_EQ(json::parse(huge->body)["error"]["message"],
            "the request body is too large: 2097152 bytes, at most 1048576 are accepted");

  // A second server on the same port is refused (not bound beside the first).
  std::string output;
  EXPECT_EQ(run_command(cli_path() + " serve --model " + served_model() + " --port " + std::to_string(port), &output), 1);
  EXPECT_THAT(output, HasSubstr("serve: cannot listen on 127.0.0.1:" + std::to_string(port) + ": the port is in use"));

  // Still serving.
  auto answer = post(port, kValid.dump());
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->status, 200) << answer->body;
  auto health = client(port)->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// What a careless or hostile HTTP client does (bad or missing lengths, encoded or endless chunked
// bodies, connections trickling a byte a second, more connections than the cap) is answered at
// once or within the request deadline, and the server keeps answering /health and generating.
/// True once /health answers 200 (asked every 10 ms); false when the server hung.
bool health_answers(int port) {
  return poll_until([port] {
    auto health = client(port)->Get("/health");
    return health && health->status == 200;
  });
}

TEST(Serve, HostileHttpIsAnsweredAtOnceAndKeepsServing) {
  const std::string dir = make_temp_dir("serve_hostile_http");
  // The request deadline is long enough for /health and a generation to be answered before it
  // passes, on a slow machine too: the slowloris part checks that order, not a duration.
  auto server = start_server(dir, {"--request-timeout", "15", "--max-connections", "60", "--max-body-mb", "1"}, "1");
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  const std::string head = "POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n";
  const std::string body = kValid.dump();
  // "At once": each is answered by the check that refuses it (its own status and message), then
  // closed, rather than waited on until the request deadline (408) or httplib's read timeout.
  struct Case {
    std::string request;
    int status;
    std::string message;
  };
  std::string many_headers;  // each line within httplib's 8 KiB, 80 KB in all
  for (int i = 0; i < 20; ++i) many_headers += "X-Filler-" + std::to_string(i) + ": " + std::string(4000, 'a') + "\r\n";
  const std::vector<Case> cases = {
      {head + "Content-Length: -5\r\n\r\n", 400, "'Content-Length: -5' is not a number of bytes"},
      {head + many_headers + "\r\n", 431, "the request head is larger than 65536 bytes"},
      {head + "Content-Length: 99999999999999999999\r\n\r\n", 400,
       "'Content-Length: 99999999999999999999' is not a number of bytes"},
      {head + "Content-Length: 5000000\r\n\r\n", 413,
       "the request body is too large: 5000000 bytes, at most 1048576 are accepted"},
      {head + "Content-Type: application/json\r\n\r\n" + body, 411,
       "a POST needs a Content-Length header (or a chunked body)"},
      {head + "Content-Encoding: gzip\r\nContent-Length: 20\r\n\r\n", 415,
       "the request body is encoded ('Content-Encoding: gzip'); send it unencoded"},
      {head + "Transfer-Encoding: gzip, chunked\r\n\r\n", 501,
       "'Transfer-Encoding: gzip, chunked' is not supported; send the body with a Content-Length or chunked"},
      {head + "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", 400,
       "the request has both a Content-Length and 'Transfer-Encoding: chunked'"},
      {"POST /v1/nothing HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 404, "no route POST /v1/nothing"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.request.substr(0, 160));
    RawConnection connection(port);
    ASSERT_TRUE(connection.connected());
    connection.send(c.request);
    const std::string answer = connection.read_until_closed();
    EXPECT_TRUE(connection.closed()) << "the server hung on the connection";
    EXPECT_EQ(raw_status(answer), c.status) << answer;
    EXPECT_EQ(raw_message(answer), c.message) << answer;
  }

  // A chunked body is bounded while it is read: 1.5 MiB in 64 KiB chunks is refused once it
  // passes 1 MiB, and a small chunked body is served.
  {
    RawConnection connection(port);
    ASSERT_TRUE(connection.connected());
    connection.send(head + "Transfer-Encoding: chunked\r\n\r\n");
    const std::string chunk = "10000\r\n" + std::string(0x10000, ' ') + "\r\n";
    for (int i = 0; i < 24 && connection.send(chunk); ++i) {
    }
    const std::string answer = connection.read_until_closed();
    EXPECT_EQ(raw_status(answer), 413) << answer.substr(0, 300);
    EXPECT_EQ(raw_message(answer), "the request body is too large: more than 1048576 bytes (chunked)");
  }
  {
    RawConnection connection(port);
    ASSERT_TRUE(connection.connected());
    const std::string half = body.substr(0, body.size() / 2), rest = body.substr(body.size() / 2);
    connection.send(head + "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" +
                    fmt_hex(half.size()) + "\r\n" + half + "\r\n" + fmt_hex(rest.size()) + "\r\n" + rest +
                    "\r\n0\r\n\r\n");
    const std::string answer = connection.read_until_closed();
    EXPECT_EQ(raw_status(answer), 200) << answer.substr(0, 300);
  }

  // Slowloris: 50 connections trickling one byte a second hold no thread that /health or a
  // generation needs (both are answered while every slow connection is still waiting for its
  // answer), and each is answered 408 and closed once the deadline passes.
  std::vector<std::unique_ptr<RawConnection>> slow;
  for (int i = 0; i < 50; ++i) {
    slow.push_back(std::make_unique<RawConnection>(port));
    ASSERT_TRUE(slow.back()->connected());
    slow.back()->send("P");
  }
  std::atomic<bool> trickling{true};
  // Four bytes over four seconds, then silence until the deadline (a byte sent to a connection
  // the server has closed would make it reset the connection before its 408 is read).
  std::thread trickler([&] {
    const std::string rest = head.substr(1);
    for (size_t i = 0; trickling && i < 4; ++i) {
      for (auto& connection : slow) connection->send(rest.substr(i, 1));
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  });
  for (int i = 0; i < 3; ++i) {
    auto health = client(port)->Get("/health");
    ASSERT_TRUE(health) << "no answer to /health under slowloris";
    EXPECT_EQ(health->status, 200);
  }
  auto generated = post(port, kValid.dump());
  ASSERT_TRUE(generated);
  EXPECT_EQ(generated->status, 200) << generated->body;
  int answered_before = 0;
  for (auto& connection : slow) answered_before += connection->answered() ? 1 : 0;
  EXPECT_EQ(answered_before, 0) << "/health and the generation were answered only after the slow connections' "
                                   "deadline: they waited behind them";
  int timed_out = 0;
  for (auto& connection : slow) {
    const std::string answer = connection->read_until_closed();
    if (raw_status(answer) == 408) ++timed_out;
  }
  trickling = false;
  trickler.join();
  EXPECT_EQ(timed_out, 50) << "every trickling connection is answered 408";

  // More connections than the cap: those beyond it are answered 503 at once and closed; the
  // others are closed unanswered once idle long enough (each read waits for the server's close),
  // and then the server answers again.
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < 70; ++i) {
    idle.push_back(std::make_unique<RawConnection>(port));
    ASSERT_TRUE(idle.back()->connected());
  }
  int refused = 0;
  for (auto& connection : idle) {
    const std::string answer = connection->read_until_closed();
    EXPECT_TRUE(connection->closed()) << "the server hung on an idle connection";
    if (raw_status(answer) != 503) continue;
    ++refused;
    EXPECT_EQ(raw_message(answer), "the server has 60 connections open, its most; retry later");
  }
  EXPECT_GE(refused, 10) << "70 connections, at most 60";
  EXPECT_LT(refused, 70);
  idle.clear();
  EXPECT_TRUE(health_answers(port)) << "the server did not answer again after the idle connections left";
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}

// A multipart/form-data POST of `body` with `boundary`.
httplib::Result post_form(int port, const std::string& body, const std::string& boundary,
                          const std::string& path = "/v1/images/edits") {
  return client(port)->Post(path.c_str(), body, ("multipart/form-data; boundary=" + boundary).c_str());
}

// One form part: its head lines and bytes, after the boundary line of `boundary`.
std::string form_part(const std::string& boundary, const std::vector<std::string>& head, const std::string& data) {
  std::string out = "--" + boundary + "\r\n";
  for (const auto& line : head) out += line + "\r\n";
  return out + "\r\n" + data + "\r\n";
}

// Rank 0's resident and peak resident memory as /health reports them (bytes).
std::pair<int64_t, int64_t> rank0_memory(int port) {
  auto health = client(port)->Get("/health");
  if (!health || health->status != 200) return {0, 0};
  const json rank = json::parse(health->body)["ranks"][0];
  return {rank["resident_memory_bytes"].get<int64_t>(), rank["peak_resident_memory_bytes"].get<int64_t>()};
}

// Edits as a form (what OpenAI's clients send): the same image as the JSON body; every hostile
// form (framing, heads, names, file names, counts, sizes, nesting, a body that stops coming) is
// answered its named 4xx within the request deadline, /health answers after each, and the
// server's memory stays bounded (printed: resident and peak before and after).
TEST(Serve, HostileMultipartIsNamedAndFormEditsEqualJsonGolden) {
  const std::string dir = make_temp_dir("serve_multipart");
  auto server = start_server(dir, {"--pipeline", "FluxKontextPipeline", "--max-body-mb", "1", "--request-timeout", "10"},
                             "1");
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  const std::string png = read_text(shardit::testing::golden_path("edit_flux1_kontext/reference_a.png"));
  const std::string b = "b0undary";
  const auto field = [&](const std::string& name, const std::string& value) {
    return form_part(b, {"Content-Disposition: form-data; name=\"" + name + "\""}, value);
  };
  const auto file = [&](const std::string& name, const std::string& filename, const std::string& data) {
    return form_part(b, {"Content-Disposition: form-data; name=\"" + name + "\"; filename=\"" + filename + "\"",
                         "Content-Type: image/png"},
                     data);
  };
  const std::string end = "--" + b + "--\r\n";
  const std::string fields = field("prompt", kValid["prompt"]) + field("size", "64x48") +
                             field("num_inference_steps", "2") + field("seed", "7");
  // The form's image equals the JSON body's.
  auto form = post_form(port, file("image", "cat.png", png) + fields + end, b);
  ASSERT_TRUE(form) << httplib::to_string(form.error());
  ASSERT_EQ(form->status, 200) << form->body;
  json edit = kValid;
  edit["image"] = shardit::serving::base64_encode(png);
  auto as_json = post(port, edit.dump(), "/v1/images/edits");
  ASSERT_TRUE(as_json && as_json->status == 200);
  EXPECT_TRUE(png_pixels(json::parse(form->body)["data"][0]["b64_json"], dir, "form.png")
                  .equal(png_pixels(json::parse(as_json->body)["data"][0]["b64_json"], dir, "json.png")));
  // The memory of a server that has generated (the generations' own peak is in it).
  const auto before = rank0_memory(port);

  std::string many_parts, eleven_images;
  for (int i = 0; i < 65; ++i) many_parts += field("prompt", "a");
  for (int i = 0; i < 11; ++i) eleven_images += file("image[]", "a.png", png.substr(0, 60));
  struct Case {
    std::string body;
    int status;
    std::string message;  // its start
    std::string path = "/v1/images/edits";
  };
  const std::vector<Case> cases = {
      {file("image", "cat.png", png) + fields + "--" + b, 400, "the multipart body ends after a boundary line"},
      {file("image", "cat.png", png) + fields, 400, "part 5 (\"seed\") never ends"},
      {file("image", "cat.png", png) + field("prompt", "a").substr(0, 60), 400, "part 2: the body ends inside its head"},
      {"not a form at all", 400, "the multipart body holds no boundary line \"--b0undary\""},
      {file("image", "cat.png", png) + field("prompt", "") + end, 400, "part 2 (\"prompt\") is empty (0 bytes)"},
      {file("image", "cat.png", "") + end, 400, "part 1 (\"image\") is empty (0 bytes)"},
      {file("image", "cat.png", png) + fields + field("seed", "8") + end, 400,
       "'seed' is given twice (part 6 (\"seed\") repeats it)"},
      {file("image", "cat.png", png) + file("prompt", "prompt.png", png) + end, 400,
       "'prompt' must be a text field, got a file (part 2 (\"prompt\"), file name \"prompt.png\""},
      {form_part(b, {"Content-Disposition: form-data; name=\"image\"", "Content-Type: multipart/mixed; boundary=x"},
                 "--x\r\n\r\nx\r\n--x--") + end,
       415, "part 1: a nested multipart body (\"multipart/mixed\") is not accepted"},
      {form_part(b, {"Content-Disposition: form-data; name=\"prompt\ncontent-type: image/png\""}, "a") + end, 400,
       "part 1: its head holds the control character 0x0a"},
      {form_part(b, {"Content-Disposition: form-data; name=\"prompt%0D%0AX-Injected: 1\""}, "a") + end, 400,
       "part 1: its name \"prompt%0D%0AX-Injected: 1\" is not a field name"},
      {file("image", "../../../tmp/owned.png", png) + fields + end, 400,
       "part 1 (\"image\"): the file name \"../../../tmp/owned.png\" holds the path character '/'"},
      {many_parts + end, 400, "the form has more than 64 parts"},
      {form_part(b, {"Content-Disposition: form-data; name=\"prompt\"", "X-Filler: " + std::string(5000, 'a')}, "a") +
           end,
       400, "part 1: its head is longer than 4096 bytes"},
      {file("image", "cat.png", png) + field("prompt", std::string(70000, 'a')) + end, 400,
       "part 2 (\"prompt\") is a text field of 70000 bytes; at most 65536 are accepted"},
      {eleven_images + fields + end, 400, "'image' holds 11 images; at most 10 are accepted"},
      {file("image", "cat.png", png) + file("mask", "mask.png", png) + fields + end, 400,
       "'mask' is not supported: no pipeline this server can serve inpaints"},
      {file("image", "cat.webp", std::string("RIFF\x10\0\0\0WEBPVP8 ", 16)) + fields + end, 400,
       "'image': a WebP image, which is not read here"},
      {file("image", "cat.png", png) + fields + end, 415,
       "multipart bodies are not accepted at /v1/images/generations", "/v1/images/generations"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    auto answer = post_form(port, c.body, b, c.path);
    ASSERT_TRUE(answer) << httplib::to_string(answer.error());
    EXPECT_EQ(answer->status, c.status) << answer->body;
    const std::string message = json::parse(answer->body)["error"]["message"];
    EXPECT_EQ(message.rfind(c.message, 0), 0u) << message;
    EXPECT_TRUE(health_answers(port));
  }
  // Heads refused before any body byte is read: no boundary, a body over --max-body-mb.
  for (const auto& [type, length, status, message] :
       std::vector<std::tuple<std::string, std::string, int, std::string>>{
           {"multipart/form-data", "10", 400, "the Content-Type multipart/form-data has no boundary parameter"},
           {"multipart/form-data; boundary=x", "5000000", 413, "the request body is too large: 5000000 bytes"}}) {
    RawConnection connection(port);
    ASSERT_TRUE(connection.connected());
    connection.send("POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Type: " + type + "\r\nContent-Length: " +
                    length + "\r\n\r\n");
    const std::string answer = connection.read_until_closed();
    EXPECT_EQ(raw_status(answer), status) << answer;
    EXPECT_EQ(raw_message(answer).rfind(message, 0), 0u) << answer;
  }
  // A form whose rest (and closing boundary) never comes: 408 once the request deadline passes,
  // while /health and other requests are answered meanwhile.
  {
    RawConnection connection(port);
    ASSERT_TRUE(connection.connected());
    const std::string part = file("image", "cat.png", png);
    connection.send("POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=" + b +
                    "\r\nContent-Length: 900000\r\n\r\n" + part);
    EXPECT_TRUE(health_answers(port));
    const std::string answer = connection.read_until_closed();
    EXPECT_EQ(raw_status(answer), 408) << answer.substr(0, 300);
  }
  // Memory stays bounded: 40 more of the largest hostile forms (a 1 MiB body of 64 KiB parts, and
  // 11 images) leave the peak where it was.
  std::string large;
  for (int i = 0; i < 15; ++i) large += file("image[]", "a.png", std::string(65536, 'x'));
  for (int i = 0; i < 20; ++i) {
    auto big = post_form(port, large + end, b);
    ASSERT_TRUE(big);
    EXPECT_EQ(big->status, 400) << big->body;
    auto images = post_form(port, eleven_images + fields + end, b);
    ASSERT_TRUE(images);
    EXPECT_EQ(images->status, 400);
  }
  const auto after = rank0_memory(port);
  std::cout << "serve rank 0 memory (MiB) before and after the hostile forms: resident " << before.first / 1048576.0 << " -> " << after.first / 1048576.0
            << ", peak " << before.second / 1048576.0 << " -> " << after.second / 1048576.0 << "\n";
  EXPECT_LT(after.second - before.second, int64_t{64} << 20) << "the peak grew under hostile forms";
  auto again = post_form(port, file("image", "cat.png", png) + fields + end, b);
  ASSERT_TRUE(again && again->status == 200) << (again ? again->body : "no answer");
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}

// --max-connections-per-client: a client address that holds the most connections gets 503 for one
// more, naming the cap; once one of its connections closes, it is served again.
TEST(Serve, ClientOverItsConnectionCapAnswers503) {
  const std::string dir = make_temp_dir("serve_client_cap");
  auto server = start_server(dir, {"--max-connections-per-client", "2"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(std::make_unique<RawConnection>(port));
    ASSERT_TRUE(held.back()->connected());
  }
  // Both are taken up (served) before the third arrives: a request on each gets its answer.
  for (auto& connection : held) {
    connection->send("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    const std::string answer = connection->read_answer();
    ASSERT_EQ(raw_status(answer), 200) << answer;
  }
  {
    RawConnection third(port);
    ASSERT_TRUE(third.connected());
    const std::string answer = third.read_until_closed();
    EXPECT_EQ(raw_status(answer), 503) << answer;
    EXPECT_EQ(raw_message(answer),
              "this client (127.0.0.1) has 2 connections open, the most one client may; retry later");
  }
  held.pop_back();
  EXPECT_TRUE(health_answers(port))
      << "the client was not served again after one of its connections closed";
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}

// A slow request (256x256, `steps` steps) written on a raw connection with the X-Request-Id `id`,
// so that the test can close the connection while the server computes.
std::unique_ptr<RawConnection> post_raw(int port, int steps, const std::string& id) {
  json slow = kValid;
  slow["size"] = "256x256";
  slow["num_inference_steps"] = steps;
  const std::string body = slow.dump();
  auto raw = std::make_unique<RawConnection>(port);
  EXPECT_TRUE(raw->connected());
  EXPECT_TRUE(raw->send("POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-Id: " + id +
                        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                        "\r\n\r\n" + body));
  return raw;
}

// While one request runs (a long one, which the test cancels by closing its connection once it has
// seen the refusals), eight more arrive together: four wait, the queue's depth, and four are
// refused 429 at once (the long one still running). The four that waited are then served.
TEST(Serve, FullQueueAnswers429) {
  const std::string dir = make_temp_dir("serve_queue");
  auto server = start_server(dir, {"--queue-depth", "4", "--max-steps", "1000"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  auto holder = post_raw(port, 1000, "queue-holder");
  ASSERT_TRUE(poll_until([&] { return job_status(port, "queue-holder") == "running"; }))
      << "the long request never started";
  json request = kValid;
  request["size"] = "128x128";
  request["num_inference_steps"] = 4;
  std::promise<void> go;
  std::shared_future<void> start = go.get_future().share();
  std::vector<std::future<int>> statuses;
  for (int i = 0; i < 8; ++i) {
    statuses.push_back(std::async(std::launch::async, [&, start] {
      auto c = client(port);
      start.wait();
      auto answer = c->Post("/v1/images/generations", request.dump(), "application/json");
      return answer ? answer->status : -1;
    }));
  }
  go.set_value();
  const auto answered = [&] {
    int count = 0;
    for (auto& status : statuses) count += status.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    return count;
  };
  ASSERT_TRUE(poll_until([&] { return answered() >= 4; })) << "the requests over the queue's depth were not refused";
  auto queued = client(port)->Get("/health");
  ASSERT_TRUE(queued);
  EXPECT_EQ(json::parse(queued->body)["queue"]["waiting"], 4) << queued->body;
  EXPECT_EQ(job_status(port, "queue-holder"), "running") << "the refusals waited for the running request";
  EXPECT_EQ(answered(), 4);
  holder.reset();  // cancels the long request: the four waiting run
  int ok = 0, rejected = 0;
  for (auto& status : statuses) {
    const int s = status.get();
    if (s == 200) ++ok;
    if (s == 429) ++rejected;
  }
  std::printf("8 requests behind a running one, queue depth 4: %d answered 200, %d answered 429\n", ok, rejected);
  EXPECT_EQ(ok, 4);
  EXPECT_EQ(rejected, 4);
  auto metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_THAT(metrics->body,
              HasSubstr("shardit_requests_total{endpoint=\"generations\",status=\"429\"} " + std::to_string(rejected)));
  auto health = client(port)->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// The bodies of `requests` posted at once, each from its own client; their answers in order.
std::vector<json> post_together(int port, const std::vector<json>& requests) {
  std::promise<void> go;
  std::shared_future<void> start = go.get_future().share();
  std::vector<std::future<json>> answers;
  for (const json& request : requests) {
    answers.push_back(std::async(std::launch::async, [port, request, start] {
      auto c = client(port);
      start.wait();
      auto answer = c->Post("/v1/images/generations", request.dump(), "application/json");
      EXPECT_TRUE(answer && answer->status == 200) << (answer ? answer->body : httplib::to_string(answer.error()));
      return answer && answer->status == 200 ? json::parse(answer->body) : json();
    }));
  }
  go.set_value();
  std::vector<json> out;
  for (auto& answer : answers) out.push_back(answer.get());
  return out;
}

// --max-batch: four compatible requests that arrive together run as one batch at TP=2 (the
// answers and /metrics say so), and each image equals the one the same request gets alone, from
// this server and from `shardit generate`; four requests that differ in size or steps run one by
// one.
TEST(Serve, CompatibleRequestsAreBatchedAndEachGetsItsOwnImage) {
  const std::string dir = make_temp_dir("serve_batch");
  auto server = start_server(dir, {"--max-batch", "4", "--batch-wait-ms", "1000"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  std::vector<json> compatible;
  for (int i = 0; i < 4; ++i) {
    json request = kValid;
    request["prompt"] = "a lighthouse, picture " + std::to_string(i) + (i % 2 ? " at dusk in the rain" : "");
    request["seed"] = 40 + i;
    compatible.push_back(request);
  }
  const std::vector<json> batched = post_together(port, compatible);
  std::vector<std::string> batched_images;
  for (const json& answer : batched) {
    ASSERT_FALSE(answer.is_null());
    EXPECT_EQ(answer["batch_requests"], 4) << answer.dump().substr(0, 300);
    batched_images.push_back(answer["data"][0]["b64_json"]);
  }
  auto metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_THAT(metrics->body, HasSubstr("shardit_batches_total{requests=\"4\"} 1\n"));
  EXPECT_EQ(metric_value(metrics->body, "shardit_batched_images_total"), 4);
  for (int i = 0; i < 4; ++i) {
    auto alone = post(port, compatible[i].dump());
    ASSERT_TRUE(alone && alone->status == 200);
    const json answer = json::parse(alone->body);
    EXPECT_EQ(answer["batch_requests"], 1);
    EXPECT_EQ(answer["data"][0]["b64_json"], batched_images[i]) << "request " << i << " in a batch of 4";
  }
  // `shardit generate` at the same degree gives the first request's image.
  const at::Tensor served = png_pixels(batched_images[0], dir, "batched0.png");
  std::string output;
  ASSERT_EQ(run_command(cli_path() + " --nproc-per-node 2 generate --model " + served_model() + " --prompt '" +
                            compatible[0]["prompt"].get<std::string>() + "' --height 48 --width 64 --steps 2 --seed 40 "
                            "--max-sequence-length " + kMaxSequenceLength + " --out " + dir + "/generated.png",
                        &output),
            0)
      << output;
  EXPECT_TRUE(at::equal(served, shardit::io::read_png(dir + "/generated.png"))) << "batched image vs generate";

  std::vector<json> incompatible = compatible;
  incompatible[1]["num_inference_steps"] = 3;
  incompatible[2]["size"] = "48x64";
  incompatible[3]["n"] = 2;
  for (const json& answer : post_together(port, incompatible)) {
    ASSERT_FALSE(answer.is_null());
    EXPECT_EQ(answer["batch_requests"], 1);
  }
  metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_THAT(metrics->body, HasSubstr("shardit_batches_total{requests=\"4\"} 1\n"));
  EXPECT_EQ(metric_value(metrics->body, "shardit_batched_images_total"), 4) << "incompatible requests were batched";
}

// GET /v1/jobs/{id} once it has reached step `step` or ended (the last answer when the server
// hung; {} when the job was never found).
json wait_for_step(int port, const std::string& id, int64_t step) {
  json job;
  poll_until([&] {
    auto answer = client(port)->Get(("/v1/jobs/" + id).c_str());
    if (!answer || answer->status != 200) return false;
    job = json::parse(answer->body);
    return job["step"].get<int64_t>() >= step || (job["status"] != "running" && job["status"] != "queued");
  });
  return job;
}

// A client that closes its connection mid-generation cancels its job at the next step boundary
// on every rank: GET /v1/jobs/{id} follows the job step by step, the job ends cancelled long before
// the 1000 steps it asked for, the next request is served, both ranks stay alive, and /metrics
// counts the cancellation.
TEST(Serve, DisconnectCancelsAtTheNextStepAndJobsReportProgress) {
  const std::string dir = make_temp_dir("serve_cancel");
  auto server = start_server(dir, {"--max-steps", "1000"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  auto health = client(port)->Get("/health");
  ASSERT_TRUE(health);
  const json ranks = json::parse(health->body)["ranks"];
  ASSERT_EQ(ranks.size(), 2u);

  auto raw = post_raw(port, 1000, "slow-1");
  json job = wait_for_step(port, "slow-1", 3);
  ASSERT_EQ(job["status"], "running") << job.dump();
  EXPECT_EQ(job["num_inference_steps"], 1000);
  // The job reports its progress step by step.
  const int64_t seen_step = job["step"];
  job = wait_for_step(port, "slow-1", seen_step + 5);
  ASSERT_EQ(job["status"], "running") << job.dump();
  EXPECT_GE(job["step"].get<int64_t>(), seen_step + 5) << job.dump();
  // An id still in use is refused.
  auto twice = client(port)->Post("/v1/images/generations", {{"X-Request-Id", "slow-1"}}, kValid.dump(),
                                  "application/json");
  ASSERT_TRUE(twice);
  EXPECT_EQ(twice->status, 409) << twice->body;

  job = json::parse(client(port)->Get("/v1/jobs/slow-1")->body);
  const int64_t step_at_close = job["step"];
  raw.reset();
  auto next = post(port, kValid.dump());
  ASSERT_TRUE(next) << httplib::to_string(next.error());
  EXPECT_EQ(next->status, 200) << next->body;
  EXPECT_FALSE(next->get_header_value("X-Request-Id").empty());
  EXPECT_EQ(json::parse(next->body)["id"], next->get_header_value("X-Request-Id"));

  job = json::parse(client(port)->Get("/v1/jobs/slow-1")->body);
  EXPECT_EQ(job["status"], "cancelled") << job.dump();
  EXPECT_EQ(job["cancel_reason"], "disconnected");
  const int64_t steps_after_close = job["step"].get<int64_t>() - step_at_close;
  // How many steps ran between the close and the cancellation depends on the machine's speed
  // (the server looks for a closed connection every 50 ms): reported, not bounded. The job was
  // stopped, not run to its end.
  std::printf("the job ran %lld step(s) after its client left\n", static_cast<long long>(steps_after_close));
  EXPECT_LT(job["step"].get<int64_t>(), 1000) << job.dump();

  // Every rank is still serving, and the cancellation is counted.
  health = client(port)->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200) << health->body;
  for (const auto& rank : ranks) EXPECT_EQ(::kill(static_cast<pid_t>(rank["pid"].get<int64_t>()), 0), 0);
  auto metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_THAT(metrics->body, HasSubstr("shardit_cancelled_total{reason=\"disconnected\"} 1\n"));
  EXPECT_THAT(metrics->body, HasSubstr("shardit_cancelled_total{reason=\"timeout\"} 0\n"));
}

// --generation-timeout cancels a request that runs too long at its next step boundary (answered
// 504, the job says why); a prompt truncated to the server's token limit is answered with a
// warning; a bad X-Request-Id or an unknown job id is refused.
TEST(Serve, GenerationTimeoutCancelsAndWarningsAreAnswered) {
  const std::string dir = make_temp_dir("serve_timeout");
  auto server = start_server(dir, {"--max-steps", "1000", "--generation-timeout", "2"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);

  json long_prompt = kValid;
  std::string words;
  for (int i = 0; i < 100; ++i) words += "a red cat ";
  long_prompt["prompt"] = words;
  auto truncated = post(port, long_prompt.dump());
  ASSERT_TRUE(truncated);
  ASSERT_EQ(truncated->status, 200) << truncated->body;
  const json warnings = json::parse(truncated->body)["warnings"];
  ASSERT_FALSE(warnings.empty()) << truncated->body;
  EXPECT_THAT(warnings.dump(), HasSubstr("more than max_length " + kMaxSequenceLength)) << warnings.dump();
  EXPECT_THAT(warnings.dump(), Not(HasSubstr(served_model()))) << "the server's folders are not the client's business";
  auto plain = post(port, kValid.dump());
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200) << plain->body;
  EXPECT_EQ(json::parse(plain->body)["warnings"], json::array());

  json slow = kValid;
  slow["size"] = "256x256";
  slow["num_inference_steps"] = 1000;
  auto late = client(port)->Post("/v1/images/generations", {{"X-Request-Id", "late-1"}}, slow.dump(),
                                 "application/json");
  ASSERT_TRUE(late) << "no answer: " << httplib::to_string(late.error());
  EXPECT_EQ(late->status, 504) << late->body;
  EXPECT_THAT(json::parse(late->body)["error"]["message"].get<std::string>(),
              HasSubstr("the request took longer than --generation-timeout (2 s) and was cancelled at step "));
  const json job = json::parse(client(port)->Get("/v1/jobs/late-1")->body);
  EXPECT_EQ(job["status"], "cancelled");
  EXPECT_EQ(job["cancel_reason"], "timeout");
  EXPECT_LT(job["step"].get<int64_t>(), 1000);
  // A finished job still reports what was asked, without keeping the request's prompt or images.
  EXPECT_EQ(job["size"], "256x256") << job.dump();
  EXPECT_EQ(job["n"], 1) << job.dump();
  EXPECT_EQ(job["reference_images"], 0) << job.dump();

  auto bad_id = client(port)->Post("/v1/images/generations", {{"X-Request-Id", "two words"}}, kValid.dump(),
                                   "application/json");
  ASSERT_TRUE(bad_id);
  EXPECT_EQ(bad_id->status, 400);
  EXPECT_EQ(json::parse(bad_id->body)["error"]["param"], "X-Request-Id");
  auto unknown = client(port)->Get("/v1/jobs/nope");
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 404);

  auto metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_THAT(metrics->body, HasSubstr("shardit_cancelled_total{reason=\"timeout\"} 1\n"));
  EXPECT_GE(metric_value(metrics->body, "shardit_warnings_total"), 1);
  auto again = post(port, kValid.dump());
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << again->body;
}

// Two ranks started by hand, as torchrun would (no launcher to report or forward anything).
std::vector<std::unique_ptr<Process>> start_ranks(const std::string& dir, int world_size = 2,
                                                 const std::vector<std::string>& extra = {}) {
  const int master_port = free_port();
  std::vector<std::unique_ptr<Process>> ranks;
  const std::string world = std::to_string(world_size);
  for (int r = 0; r < world_size; ++r) {
    const std::map<std::string, std::string> env = {{"RANK", std::to_string(r)},       {"WORLD_SIZE", world},
                                                     {"LOCAL_RANK", std::to_string(r)}, {"LOCAL_WORLD_SIZE", world},
                                                     {"MASTER_ADDR", "127.0.0.1"},      {"MASTER_PORT", std::to_string(master_port)},
                                                     {"SHARDIT_DIST_TIMEOUT_MS", "10000"}};
    std::vector<std::string> argv = {cli_path(), "serve", "--model", served_model(), "--port", "0",
                                     "--max-sequence-length", kMaxSequenceLength};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ranks.push_back(std::make_unique<Process>(
        argv,
        env,
        dir + "/rank" + std::to_string(r) + ".log"));
  }
  return ranks;
}

// SIGTERM while a generation runs and others wait: /health and new requests answer 503 at once,
// the waiting requests are answered 503 at once (all of it while the running job still runs, as
// the server reports it), the running one finishes, and the server exits 0.
TEST(Serve, SigtermAnswersWaitingAndNewRequestsAtOnce) {
  const std::string dir = make_temp_dir("serve_sigterm");
  // Ranks started by hand, as torchrun or srun start them, so the signal reaches rank 0 alone (the
  // --nproc-per-node launcher forwards it to every rank and waits: test_dist_failure.cpp).
  auto ranks = start_ranks(dir);
  const int port = ranks[0]->wait_listening();
  ASSERT_GT(port, 0);
  bool is_running = false;
  auto running = start_long_request(port, 50, "sigterm-running", &is_running);
  ASSERT_TRUE(is_running) << "the request never started";
  std::vector<std::future<httplib::Result>> waiting;
  for (int i = 0; i < 2; ++i) waiting.push_back(std::async(std::launch::async, [&] { return post(port, kValid.dump()); }));
  const bool queued = poll_until([&] {
    auto h = client(port)->Get("/health");
    return h && json::parse(h->body)["queue"]["waiting"].get<int>() == 2;
  });
  ASSERT_TRUE(queued) << "the two requests were not queued";

  ::kill(ranks[0]->pid(), SIGTERM);
  for (auto& w : waiting) {
    auto answer = w.get();
    ASSERT_TRUE(answer) << "a waiting request got no answer";
    EXPECT_EQ(answer->status, 503) << answer->body;
    EXPECT_EQ(json::parse(answer->body)["error"]["message"], "the server is shutting down");
  }
  auto health = client(port)->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  EXPECT_EQ(json::parse(health->body)["status"], "stopping");
  auto refused = post(port, kValid.dump());
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503) << refused->body;
  EXPECT_EQ(job_status(port, "sigterm-running"), "running")
      << "the waiting requests, /health or the new request were answered only after the running job ended";
  auto first = running.get();
  ASSERT_TRUE(first) << "the running request got no answer";
  EXPECT_EQ(first->status, 200) << first->body;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ranks[r]->exited()) << "rank " << r << ":\n" << ranks[r]->log();
    EXPECT_EQ(ranks[r]->exit_code(), 0) << "rank " << r << ":\n" << ranks[r]->log();
  }
}

// SIGTERM to rank 0 alone: rank 0 tells the other ranks to stop, and every rank exits 0.
TEST(Serve, SigtermToRankZeroStopsEveryRank) {
  const std::string dir = make_temp_dir("serve_stop");
  auto ranks = start_ranks(dir);
  const int port = ranks[0]->wait_listening();
  ASSERT_GT(port, 0);
  ::kill(ranks[0]->pid(), SIGTERM);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ranks[r]->exited()) << "rank " << r << ":\n" << ranks[r]->log();
    EXPECT_EQ(ranks[r]->exit_code(), 0) << "rank " << r << ":\n" << ranks[r]->log();
  }
}

// Rank 0's own detection (no launcher): a request in flight when rank 1 dies is answered with an
// error, /health fails naming rank 1, and rank 0 exits non-zero naming it.
TEST(Serve, LostRankFailsHealthAndExitsNamingIt) {
  const std::string dir = make_temp_dir("serve_lost");
  auto ranks = start_ranks(dir);
  const int port = ranks[0]->wait_listening();
  ASSERT_GT(port, 0);
  auto health = client(port)->Get("/health");
  ASSERT_TRUE(health);
  ASSERT_EQ(health->status, 200) << health->body;
  const json listed = json::parse(health->body)["ranks"];
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[1]["pid"].get<int64_t>(), ranks[1]->pid());

  // A long request (many steps), running when rank 1 is killed.
  bool running = false;
  auto in_flight = start_long_request(port, 100, "lost-in-flight", &running);
  ASSERT_TRUE(running) << "the request never started";

  ::kill(static_cast<pid_t>(listed[1]["pid"].get<int64_t>()), SIGKILL);
  // /health fails (503 naming the lost rank, then no answer once the server is gone).
  std::string failure_body;
  const bool saw_failure = poll_until([&] {
    auto answer = client(port)->Get("/health");
    if (answer && answer->status == 200) return false;
    if (answer) failure_body = answer->body;
    return true;
  });
  EXPECT_TRUE(saw_failure);
  // The server reports the loss for a second before it exits: polled every 10 ms, it is seen.
  EXPECT_THAT(failure_body, HasSubstr("lost rank 1"));
  EXPECT_THAT(failure_body, HasSubstr("\"status\":\"failed\""));
  auto answer = in_flight.get();
  ASSERT_TRUE(answer) << "the request in flight got no answer: " << httplib::to_string(answer.error());
  EXPECT_TRUE(answer->status == 500 || answer->status == 503) << answer->status;
  EXPECT_THAT(answer->body, HasSubstr("lost rank 1"));
  ASSERT_TRUE(ranks[0]->exited()) << ranks[0]->log();
  EXPECT_NE(ranks[0]->exit_code(), 0);
  EXPECT_THAT(ranks[0]->log(), HasSubstr("lost rank 1"));
}

// POST /v1/images/edits on the built-in FLUX.1 pipeline served as FluxKontextPipeline at TP=2: a
// golden reference image gives the PNG `generate --image` gives with the same seed; images that
// cannot be decoded or edited from are 400s naming them, and the server keeps serving.
TEST(Serve, EditsEqualGenerateWithImageAndRefuseBadImagesGolden) {
  const std::string dir = make_temp_dir("serve_edits");
  auto server = start_server(dir, {"--pipeline", "FluxKontextPipeline"});
  const int port = server->wait_listening();
  ASSERT_GT(port, 0);
  const std::string reference = shardit::testing::golden_path("edit_flux1_kontext/reference_a.png");
  const std::string png_bytes = read_text(reference);
  json edit = kValid;
  edit["image"] = shardit::serving::base64_encode(png_bytes);
  auto answer = post(port, edit.dump(), "/v1/images/edits");
  ASSERT_TRUE(answer) << "POST failed: " << httplib::to_string(answer.error());
  ASSERT_EQ(answer->status, 200) << answer->body;
  const at::Tensor served = png_pixels(json::parse(answer->body)["data"][0]["b64_json"], dir, "served.png");

  std::string output;
  const std::string generated = dir + "/generated.png";
  const int code = run_command(cli_path() + " --nproc-per-node 2 generate --pipeline FluxKontextPipeline --model " +
                                   served_model() + " --image " + reference +
                                   " --prompt 'A cat holding a sign that says hello world' --seed 7 --width 64 "
                                   "--height 48 --max-area 3072 --steps 2 --max-sequence-length " + kMaxSequenceLength +
                                   " --out " + generated,
                               &output);
  ASSERT_EQ(code, 0) << output;
  const at::Tensor expected = shardit::io::read_png(generated);
  ASSERT_EQ(served.sizes(), expected.sizes());
  EXPECT_TRUE(served.equal(expected)) << "the edited image differs from generate --image's in "
                                      << served.ne(expected).sum().item<int64_t>() << " values";
  // The reference image matters: the text-to-image answer differs.
  auto plain = post(port, kValid.dump());
  ASSERT_TRUE(plain && plain->status == 200);
  EXPECT_FALSE(png_pixels(json::parse(plain->body)["data"][0]["b64_json"], dir, "plain.png").equal(served));

  // A PNG whose header declares 30000 x 30000 (the IHDR fields patched; the CRC no longer matches,
  // and the size is refused before that is read).
  std::string huge = png_bytes;
  for (const size_t offset : {size_t{16}, size_t{20}}) {
    const uint32_t side = 30000;
    huge[offset] = static_cast<char>(side >> 24);
    huge[offset + 1] = static_cast<char>((side >> 16) & 0xff);
    huge[offset + 2] = static_cast<char>((side >> 8) & 0xff);
    huge[offset + 3] = static_cast<char>(side & 0xff);
  }
  const at::Tensor one_pixel = at::full({1, 1, 3}, 200, at::kByte);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {png_bytes.substr(0, png_bytes.size() / 2), "truncated PNG"},
      {shardit::io::encode_png(one_pixel), "1x1 image"},
      {huge, "30000x30000 header"},
      {"this is a text file, not a picture\n", "text named .png"}};
  for (const auto& [bytes, what] : bad) {
    json body = kValid;
    body["image"] = shardit::serving::base64_encode(bytes);
    auto refused = post(port, body.dump(), "/v1/images/edits");
    ASSERT_TRUE(refused) << what;
    EXPECT_EQ(refused->status, 400) << what << ": " << refused->body;
    EXPECT_THAT(json::parse(refused->body)["error"]["message"].get<std::string>(), HasSubstr("image")) << what;
  }
  json missing = kValid;
  auto no_image = post(port, missing.dump(), "/v1/images/edits");
  ASSERT_TRUE(no_image);
  EXPECT_EQ(no_image->status, 400);
  EXPECT_THAT(no_image->body, HasSubstr("'image' is required"));
  // Still serving: the same edit again gives the same image.
  auto again = post(port, edit.dump(), "/v1/images/edits");
  ASSERT_TRUE(again && again->status == 200) << (again ? again->body : "no answer");
  EXPECT_TRUE(png_pixels(json::parse(again->body)["data"][0]["b64_json"], dir, "again.png").equal(served));
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}


// POST /v1/images/edits on the golden QwenImageEditPlusPipeline folder at TP=2 with two images (a
// JSON array, in order): the answer is the PNG `generate --image A --image B` writes with the same
// seed, size and steps; its VAE area stays diffusers' 1024² (a request's size is only the
// answer's), so the CLI runs at its default --max-area too. A fourth image is refused by name.
TEST(Serve, QwenImageEditPlusEditsEqualGenerateGolden) {
  const std::string dir = make_temp_dir("serve_qwen_edits");
  const std::string folder = shardit::testing::golden_path("edit_qwenimage");
  auto server = start_server(dir, {}, "2", folder);
  const int port = server->wait_listening();
  ASSERT_GT(port, 0) << server->log();
  const std::string first = folder + "/plus_two.image_0.png";
  const std::string second = folder + "/plus_one.image_0.png";
  json edit = {{"prompt", "the cat from picture 1 in the room of picture 2"},
               {"image", {shardit::serving::base64_encode(read_text(first)),
                          shardit::serving::base64_encode(read_text(second))}},
               {"size", "64x48"},
               {"num_inference_steps", 2},
               {"true_cfg_scale", 1.0},
               {"seed", 3},
               {"response_format", "b64_json"}};
  auto answer = post(port, edit.dump(), "/v1/images/edits");
  ASSERT_TRUE(answer) << "POST failed: " << httplib::to_string(answer.error());
  ASSERT_EQ(answer->status, 200) << answer->body;
  const at::Tensor served = png_pixels(json::parse(answer->body)["data"][0]["b64_json"], dir, "served.png");
  EXPECT_EQ(served.size(0), 48);
  EXPECT_EQ(served.size(1), 64);

  expect_generate_equals(served, dir,
                         "--model " + folder + " --image " + first + " --image " + second +
                             " --prompt 'the cat from picture 1 in the room of picture 2' --seed 3 --width 64"
                             " --height 48 --steps 2 --true-cfg-scale 1");

  json four = edit;
  four["image"] = {four["image"][0], four["image"][1], four["image"][0], four["image"][1]};
  auto refused = post(port, four.dump(), "/v1/images/edits");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400) << refused->body;
  EXPECT_THAT(refused->body, HasSubstr("image")) << refused->body;
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}

// --replicas 2 --tp 2 on 4 ranks: two requests that arrive together run at the same time, one on
// each replica (both jobs are seen running at once through GET /v1/jobs/{id}), and give the same
// image; /health lists every rank and both replicas. Then a rank of replica 1 is killed: the
// server fails as it does for any lost rank (/health 503 naming the replica and the rank, exit
// non-zero), and every other rank exits non-zero too.
// `serve --transformer FILE.gguf` at TP 2: the golden FLUX.1 pipeline with its transformer from the
// Q8_0 GGUF file (make_gguf_transformer_cases) serves generate --transformer's image bit for bit.
TEST(Serve, GgufTransformerServesGenerateImageGolden) {
  const std::string dir = make_temp_dir("serve_gguf");
  const std::string folder = shardit::testing::golden_path("pipeline_flux1");
  const std::string file = shardit::testing::single_file_path("gguf/pipeline_flux1_bfl.q8_0.gguf");
  auto server = start_server(dir, {"--transformer", file}, "2", folder);
  const int port = server->wait_listening();
  ASSERT_GT(port, 0) << server->log();
  auto answer = post(port, json{{"prompt", "a red circle"}, {"size", "64x48"}, {"num_inference_steps", 2},
                                {"seed", 5}, {"response_format", "b64_json"}}.dump());
  ASSERT_TRUE(answer) << "POST failed: " << httplib::to_string(answer.error());
  ASSERT_EQ(answer->status, 200) << answer->body;
  const at::Tensor served = png_pixels(json::parse(answer->body)["data"][0]["b64_json"], dir, "served.png");

  expect_generate_equals(served, dir,
                         "--model " + folder + " --transformer " + file +
                             " --prompt 'a red circle' --seed 5 --width 64 --height 48 --steps 2");
  ::kill(server->pid(), SIGTERM);
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 0) << server->log();
}

TEST(Serve, ReplicasServeConcurrentlyAndALostReplicaRankFailsTheServer) {
  const std::string dir = make_temp_dir("serve_replicas");
  auto ranks = start_ranks(dir, 4, {"--replicas", "2", "--tp", "2"});
  const int port = ranks[0]->wait_listening();
  ASSERT_GT(port, 0) << ranks[0]->log();
  // The other replica's ranks report after their first tick.
  json health_json;
  poll_until([&] {
    auto health = client(port)->Get("/health");
    if (!health) return true;  // the server is gone: the checks below say what it last reported
    health_json = json::parse(health->body);
    return health->status == 200 && health_json["ranks"].size() == 4u;
  });
  ASSERT_EQ(health_json["ranks"].size(), 4u) << health_json.dump();
  ASSERT_EQ(health_json["replicas"].size(), 2u) << health_json.dump();
  EXPECT_EQ(health_json["ranks"][3]["pid"].get<int64_t>(), ranks[3]->pid());

  json slow = kValid;
  slow["size"] = "256x256";
  slow["num_inference_steps"] = 12;
  std::vector<std::future<httplib::Result>> answers;
  for (const std::string id : {"replica-job-a", "replica-job-b"}) {
    answers.push_back(std::async(std::launch::async, [port, slow, id] {
      return client(port)->Post("/v1/images/generations", httplib::Headers{{"X-Request-Id", id}}, slow.dump(),
                                "application/json");
    }));
  }
  // Both jobs running at the same moment: each on its own replica.
  const bool both_running = poll_until([&] {
    return job_status(port, "replica-job-a") == "running" && job_status(port, "replica-job-b") == "running";
  });
  EXPECT_TRUE(both_running) << "the two requests never ran at the same time";
  std::set<int> replicas_used;
  std::vector<std::string> images;
  for (auto& answer : answers) {
    auto result = answer.get();
    ASSERT_TRUE(result && result->status == 200) << (result ? result->body : httplib::to_string(result.error()));
    const json body = json::parse(result->body);
    replicas_used.insert(body["replica"].get<int>());
    images.push_back(body["data"][0]["b64_json"]);
  }
  EXPECT_EQ(replicas_used, (std::set<int>{0, 1}));
  EXPECT_EQ(images[0], images[1]) << "the two replicas gave different images for the same request";
  auto metrics = client(port)->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_THAT(metrics->body, HasSubstr("shardit_replica_generations_total{replica=\"1\"} 1\n"));

  ::kill(static_cast<pid_t>(ranks[3]->pid()), SIGKILL);
  std::string failure_body;
  poll_until([&] {
    auto answer = client(port)->Get("/health");
    if (!answer) return true;
    if (answer->status != 503) return false;
    failure_body = answer->body;
    return true;
  });
  EXPECT_THAT(failure_body, HasSubstr("\"status\":\"failed\""));
  EXPECT_THAT(failure_body, HasSubstr("replica 1"));
  EXPECT_THAT(failure_body, HasSubstr("lost rank 3"));
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(ranks[r]->exited()) << "rank " << r << ":\n" << ranks[r]->log();
    EXPECT_NE(ranks[r]->exit_code(), 0) << "rank " << r;
  }
  EXPECT_THAT(ranks[0]->log(), HasSubstr("lost rank 3"));
}

// The serve options of the replica-loss cases: two one-rank replicas, long requests allowed.
const std::vector<std::string> kTwoReplicas = {"--replicas", "2", "--max-steps", "2000"};

// A server of two one-rank replicas on `port`, with two requests running (one on each replica,
// 2000 steps: none ends before the kill) and two queued, when rank 1 (replica 1) is killed with
// SIGKILL: /health answers 503 "failed" naming the replica and the rank (never "stopping"), the
// running requests are answered 500 and the queued ones 503, each naming the rank, and nothing is
// left unanswered. `why` names the case.
void expect_replica_loss_fails_every_request(int port, const std::string& why) {
  json health_json;
  poll_until([&] {
    auto health = client(port)->Get("/health");
    if (!health) return true;
    health_json = json::parse(health->body);
    return health->status == 200 && health_json["ranks"].size() == 2u;
  });
  ASSERT_EQ(health_json["ranks"].size(), 2u) << why << ": " << health_json.dump();
  const auto rank1_pid = static_cast<pid_t>(health_json["ranks"][1]["pid"].get<int64_t>());

  json slow = kValid;
  slow["size"] = "256x256";
  slow["num_inference_steps"] = 2000;
  std::vector<std::future<httplib::Result>> answers;
  for (int i = 0; i < 4; ++i) {
    const std::string id = "replica-loss-" + std::to_string(i);
    answers.push_back(std::async(std::launch::async, [port, slow, id] {
      return client(port)->Post("/v1/images/generations", httplib::Headers{{"X-Request-Id", id}}, slow.dump(),
                                "application/json");
    }));
    // In order: the first two are taken by the replicas, the last two wait.
    poll_until([&] {
      return !job_status(port, id).empty() ||
             answers.back().wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    });
    ASSERT_FALSE(job_status(port, id).empty()) << why << ": " << id << " was never queued";
  }
  const bool placed = poll_until([&] {
    auto health = client(port)->Get("/health");
    if (!health) return true;
    const json h = json::parse(health->body);
    return h["queue"]["waiting"] == 2 && h["replicas"][0]["busy"] == true && h["replicas"][1]["busy"] == true;
  });
  ASSERT_TRUE(placed) << why << ": two requests never ran with two waiting";

  ::kill(rank1_pid, SIGKILL);
  std::string failure_body;
  bool saw_stopping = false;
  poll_until([&] {
    auto answer = client(port)->Get("/health");
    if (!answer) return true;  // gone: what it said last is checked below
    if (answer->status == 200) return false;
    const json h = json::parse(answer->body);
    saw_stopping = saw_stopping || h["status"] == "stopping";
    if (h["status"] != "failed") return false;
    EXPECT_EQ(answer->status, 503) << why;
    failure_body = answer->body;
    return true;
  });
  EXPECT_FALSE(saw_stopping) << why << ": /health said stopping after a rank was lost";
  EXPECT_THAT(failure_body, HasSubstr("\"status\":\"failed\"")) << why;
  EXPECT_THAT(failure_body, HasSubstr("replica 1 (rank 1) failed: lost rank 1")) << why;
  std::map<int, int> statuses;
  for (auto& answer : answers) {
    auto result = answer.get();
    ASSERT_TRUE(result) << why << ": a request got no answer: " << httplib::to_string(result.error());
    ++statuses[result->status];
    if (result->status == 200) continue;  // (counted: the check of the statuses below fails)
    EXPECT_THAT(result->body, HasSubstr("lost rank 1")) << why;
  }
  EXPECT_EQ(statuses, (std::map<int, int>{{500, 2}, {503, 2}})) << why << ": the running ones 500, the queued ones 503";
}

// Under `--nproc-per-node 2 serve --replicas 2`: the launcher stops rank 0 with a SIGTERM that
// names the failed rank, so the server fails rather than shutting down; rank 0 logs the rank, and
// the launcher exits with the lost rank's code (137).
TEST(Serve, KilledReplicaRankUnderTheLauncherFailsEveryRequestNamingIt) {
  const std::string dir = make_temp_dir("serve_replica_kill");
  auto server = start_server(dir, kTwoReplicas);
  const int port = server->wait_listening();
  ASSERT_GT(port, 0) << server->log();
  expect_replica_loss_fails_every_request(port, "under the launcher");
  ASSERT_TRUE(server->exited()) << server->log();
  EXPECT_EQ(server->exit_code(), 128 + SIGKILL) << server->log();
  const std::string log = server->log();
  EXPECT_THAT(log, HasSubstr("shardit: rank 1 failed (killed by signal 9"));
  EXPECT_THAT(log, HasSubstr("[0] shardit serve: replica 1 (rank 1) failed: lost rank 1"));
  EXPECT_THAT(log, HasSubstr("[0] shardit: error: rank 0: serve: replica 1 (rank 1) failed: lost rank 1"));
}

// The same with ranks started by hand (no launcher to tell): replica 1's heartbeat standing still
// fails the server while replica 0 (rank 0 itself) is busy generating, not after its generation;
// rank 0 exits 1 naming the rank.
TEST(Serve, KilledReplicaRankWithoutALauncherFailsEveryRequestWhileRankZeroGenerates) {
  const std::string dir = make_temp_dir("serve_replica_kill_alone");
  auto ranks = start_ranks(dir, 2, kTwoReplicas);
  const int port = ranks[0]->wait_listening();
  ASSERT_GT(port, 0) << ranks[0]->log();
  expect_replica_loss_fails_every_request(port, "ranks started by hand");
  ASSERT_TRUE(ranks[0]->exited()) << ranks[0]->log();
  EXPECT_EQ(ranks[0]->exit_code(), 1) << ranks[0]->log();
  EXPECT_THAT(ranks[0]->log(), HasSubstr("shardit: error: rank 0: serve: replica 1 (rank 1) failed: lost rank 1"));
}

}  // namespace
}  // namespace test_serve
