// `shardit serve` as a hostile client meets it: large legal reference images and junk bodies
// leave the server's memory where it was after its first request; reference images are bounded
// (pixels per image and per request from their headers, scans of a progressive JPEG, the time a
// request's images take to decode) and what is not an image is refused. One process serves the
// built-in tiny FLUX.1 pipeline as FluxKontextPipeline; the cases wait on answers and lines, never
// on a clock (the hang deadline only ends a hung case).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

// jpeglib.h needs FILE and size_t declared first.
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "shardit/io/png.h"
#include "shardit/models/builtin.h"
#include "shardit/serving/base64.h"
#include "support/test_support.h"

namespace test_hostile_serve {
namespace {

using nlohmann::json;
using shardit::testing::kHangDeadline;
using ::testing::HasSubstr;

// A write to a connection the server closed is an error for the client, not a death by SIGPIPE.
[[maybe_unused]] const bool kSigpipeIgnored = std::signal(SIGPIPE, SIG_IGN) != SIG_ERR;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// `shardit serve` of the built-in model as FluxKontextPipeline (one process), its output in a log;
// SIGKILLed at the end when still running.
class Server {
 public:
  explicit Server(const std::vector<std::string>& extra) {
    const std::string dir = shardit::testing::make_temp_dir("hostile_serve");
    const std::string model = shardit::models::write_builtin_model(dir + "/model").pipeline;
    log_ = dir + "/server.log";
    std::vector<std::string> argv = {shardit::testing::cli_path(), "serve", "--model", model, "--pipeline",
                                     "FluxKontextPipeline", "--port", "0", "--max-sequence-length", "64"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    const std::regex line_re("listening on http://[^:]+:([0-9]+)");
    shardit::testing::poll_until([&] {
      std::smatch match;
      const std::string text = read_text(log_);
      if (std::regex_search(text, match, line_re)) port_ = std::stoi(match[1]);
      return port_ > 0 || ::waitpid(pid_, nullptr, WNOHANG) == pid_;
    });
  }
  ~Server() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }
  std::string log() const { return read_text(log_); }
  /// The process's resident memory (VmRSS) in bytes.
  int64_t rss() const {
    std::smatch match;
    const std::string status = read_text("/proc/" + std::to_string(pid_) + "/status");
    static const std::regex rss_re("VmRSS:\\s+([0-9]+) kB");
    return std::regex_search(status, match, rss_re) ? std::stoll(match[1]) * 1024 : -1;
  }
  httplib::Result post(const std::string& body, const std::string& path = "/v1/images/edits") const {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(kHangDeadline);
    client.set_write_timeout(kHangDeadline);
    return client.Post(path.c_str(), body, "application/json");
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_;
};

// A tiny edit (1 step at 64x48) of `images` (PNG or JPEG bytes).
std::string edit_body(const std::vector<std::string>& images) {
  json list = json::array();
  for (const auto& bytes : images) list.push_back(shardit::serving::base64_encode(bytes));
  return json{{"prompt", "a cat"}, {"size", "64x48"}, {"num_inference_steps", 1}, {"seed", 3}, {"image", list}}.dump();
}

// A PNG of one colour, `width` x `height`: a few hundred KB however large.
std::string flat_png(int64_t height, int64_t width) {
  return shardit::io::encode_png(at::full({height, width, 3}, 90, at::kByte));
}

// A progressive JPEG of `side`² pixels in 1 + 3 x 63 scans: the DC of every component, then each
// AC coefficient of each component in a scan of its own.
std::string many_scan_jpeg(int side) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr errors;
  cinfo.err = jpeg_std_error(&errors);
  jpeg_create_compress(&cinfo);
  unsigned char* out = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &out, &size);
  cinfo.image_width = static_cast<JDIMENSION>(side);
  cinfo.image_height = static_cast<JDIMENSION>(side);
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  std::vector<jpeg_scan_info> scans(1);
  scans[0].comps_in_scan = 3;
  for (int c = 0; c < 3; ++c) scans[0].component_index[c] = c;
  for (int c = 0; c < 3; ++c) {
    for (int k = 1; k < 64; ++k) {
      jpeg_scan_info scan{};
      scan.comps_in_scan = 1;
      scan.component_index[0] = c;
      scan.Ss = k;
      scan.Se = k;
      scans.push_back(scan);
    }
  }
  cinfo.scan_info = scans.data();
  cinfo.num_scans = static_cast<int>(scans.size());
  jpeg_start_compress(&cinfo, TRUE);
  std::vector<unsigned char> row(static_cast<size_t>(side) * 3);
  for (size_t x = 0; x < row.size(); ++x) row[x] = static_cast<unsigned char>(x * 7);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW pointer = row.data();
    jpeg_write_scanlines(&cinfo, &pointer, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::string bytes(reinterpret_cast<const char*>(out), size);
  std::free(out);
  return bytes;
}

std::string message_of(const httplib::Result& answer) {
  if (!answer) return "no answer: " + httplib::to_string(answer.error());
  const json body = json::parse(answer->body, nullptr, false);
  return body.is_discarded() ? answer->body : body["error"].value("message", answer->body);
}

// 20 edits of a 4096x4096 reference (48 MiB decoded) and 20 junk 10 MiB bodies at once: the
// server's RSS after the last answer is within 64 MiB of what it was after the first request (it
// grew by 48 MiB per edit when finished jobs kept their images, and junk bodies stayed resident
// in per-thread heaps).
TEST(HostileServe, MemoryStaysFlatOverLargeEditsAndJunkBodies) {
  Server server({});
  ASSERT_GT(server.port(), 0) << server.log();
  const std::string edit = edit_body({flat_png(4096, 4096)});
  auto first = server.post(edit);
  ASSERT_TRUE(first && first->status == 200) << message_of(first);
  const int64_t after_first = server.rss();
  for (int i = 0; i < 20; ++i) {
    auto answer = server.post(edit);
    ASSERT_TRUE(answer && answer->status == 200) << i << ": " << message_of(answer);
  }
  std::vector<std::future<httplib::Result>> junk;
  const std::string junk_body(size_t{10} << 20, 'x');
  for (int i = 0; i < 20; ++i) {
    junk.push_back(std::async(std::launch::async, [&server, &junk_body] { return server.post(junk_body); }));
  }
  for (auto& answer : junk) {
    const auto result = answer.get();
    ASSERT_TRUE(result) << message_of(result);
    EXPECT_EQ(result->status, 400);
  }
  const int64_t after_all = server.rss();
  constexpr int64_t kMargin = int64_t{64} << 20;
  EXPECT_LE(after_all, after_first + kMargin)
      << "RSS after the first request " << (after_first >> 20) << " MiB, after 20 more edits and 20 junk bodies "
      << (after_all >> 20) << " MiB";
}

// Reference images are bounded from their headers (pixels per image, per request) before any is
// decoded; a progressive JPEG of more than 100 scans and a decode past --decode-timeout are
// stopped; a data: URL that is not an image is refused. Each is a 400 naming the bound, and the
// server keeps serving.
TEST(HostileServe, ReferenceImagesAreBoundedBeforeAndWhileDecoding) {
  Server server({"--max-image-pixels", "16000000", "--max-request-pixels", "20000000"});
  ASSERT_GT(server.port(), 0) << server.log();
  const auto refused = [&server](const std::string& body, const std::string& needle) {
    auto answer = server.post(body);
    ASSERT_TRUE(answer) << needle;
    EXPECT_EQ(answer->status, 400) << needle << ": " << answer->body;
    EXPECT_THAT(message_of(answer), HasSubstr(needle));
  };
  refused(edit_body({flat_png(8192, 8192)}), "8192x8192 (67108864 pixels); at most 16000000 pixels an image are "
                                             "decoded (serve --max-image-pixels)");
  const std::string twelve_million = flat_png(3000, 4000);
  refused(edit_body({twelve_million, twelve_million}),
          "2 images of 24000000 pixels together; at most 20000000 pixels a request are decoded (serve "
          "--max-request-pixels)");
  refused(edit_body({many_scan_jpeg(64)}), "a progressive JPEG of more than 100 scans");
  const json text_url = {{"prompt", "a cat"},
                         {"image", "data:text/plain;base64," + shardit::serving::base64_encode(flat_png(64, 64))}};
  refused(text_url.dump(), "'image' is a data: URL of \"text/plain\", not an image");
  // Still serving: a small image in a data:image URL.
  const json fine = {{"prompt", "a cat"}, {"size", "64x48"}, {"num_inference_steps", 1},
                     {"image", "data:image/png;base64," + shardit::serving::base64_encode(flat_png(64, 64))}};
  auto answer = server.post(fine.dump());
  ASSERT_TRUE(answer && answer->status == 200) << message_of(answer);

  Server hasty({"--decode-timeout", "0.001"});
  ASSERT_GT(hasty.port(), 0) << hasty.log();
  auto late = hasty.post(edit_body({flat_png(4096, 4096)}));
  ASSERT_TRUE(late);
  EXPECT_EQ(late->status, 400) << late->body;
  EXPECT_THAT(message_of(late), HasSubstr("took longer than serve --decode-timeout (0.001 s)"));
}

}  // namespace
}  // namespace test_hostile_serve
