// The CLI as a hostile user meets it: generated bad inputs, environments and signals, each run as
// a real subprocess. Every case asserts the documented exit code, a message naming the thing, no
// death by signal, an end (no hang), no process left behind and no file created or changed
// (except where a case documents one). docs/reliability.md lists the guarantees tested here.
// The cases wait on events (the process's exit, processes appearing in or leaving /proc), never on
// a clock: the hang deadline only ends a hung case, and a refusal "before loading" or "at once" is
// checked by what the CLI printed (the refusal's message, and nothing of a load or a run).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "support/test_support.h"

namespace test_hostile_cli {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

// Every process a case starts carries this variable, so that leftovers can be found in /proc
// whatever process group or parent they ended up with.
const std::string kMarkName = "SHARDIT_HOSTILE_CASE";

// Only a hung case waits this long: for a CLI run to end, or for its processes to be gone.
using shardit::testing::kHangDeadline;
using shardit::testing::poll_until;

struct Outcome {
  int exit_code = -1;     // when it exited
  int signal = 0;         // when a signal killed it
  bool timed_out = false;  // hung: killed at the hang deadline
  std::string out, err;
};

struct Spawn {
  std::vector<std::string> args{};
  std::map<std::string, std::string> env{};  // added to (or replacing) the test's environment
  std::optional<rlim_t> file_size_limit{};
};

/// A started CLI process; wait() collects its output until it exits (SIGKILLed when it hangs).
class Process {
 public:
  Process(const Spawn& spawn, const std::string& mark) {
    int out_pipe[2], err_pipe[2];
    EXPECT_EQ(::pipe2(out_pipe, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(err_pipe, O_CLOEXEC), 0);
    std::vector<std::string> env_strings;
    std::map<std::string, std::string> env;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string text = *entry;
      const auto eq = text.find('=');
      if (eq != std::string::npos) env[text.substr(0, eq)] = text.substr(eq + 1);
    }
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
      env.erase(name);
    }
    for (const auto& [key, value] : spawn.env) env[key] = value;
    env[kMarkName] = mark;
    for (const auto& [key, value] : env) env_strings.push_back(key + "=" + value);
    std::vector<char*> envp;
    for (auto& entry : env_strings) envp.push_back(entry.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_strings{shardit::testing::cli_path()};
    argv_strings.insert(argv_strings.end(), spawn.args.begin(), spawn.args.end());
    std::vector<char*> argv;
    for (auto& arg : argv_strings) argv.push_back(arg.data());
    argv.push_back(nullptr);

    start_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      if (spawn.file_size_limit) {
        const rlimit limit{*spawn.file_size_limit, *spawn.file_size_limit};
        ::setrlimit(RLIMIT_FSIZE, &limit);
      }
      ::dup2(out_pipe[1], 1);
      ::dup2(err_pipe[1], 2);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    out_fd_ = out_pipe[0];
    err_fd_ = err_pipe[0];
  }

  pid_t pid() const { return pid_; }

  Outcome wait() {
    Outcome outcome;
    const auto deadline = start_ + kHangDeadline;
    int status = 0;
    bool exited = false;
    while (!exited || out_fd_ >= 0 || err_fd_ >= 0) {
      if (!exited && ::waitpid(pid_, &status, WNOHANG) == pid_) exited = true;
      if (!exited && Clock::now() > deadline) {
        outcome.timed_out = true;
        ::kill(-pid_, SIGKILL);
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        exited = true;
      }
      std::vector<pollfd> fds;
      for (int fd : {out_fd_, err_fd_}) {
        if (fd >= 0) fds.push_back(pollfd{fd, POLLIN, 0});
      }
      if (fds.empty()) continue;
      if (::poll(fds.data(), fds.size(), exited ? 200 : 20) <= 0) {
        if (exited) break;  // a leftover process may hold the pipe: stop reading
        continue;
      }
      for (const auto& fd : fds) {
        if (fd.revents == 0) continue;
        char buffer[65536];
        const ssize_t n = ::read(fd.fd, buffer, sizeof(buffer));
        std::string& sink = fd.fd == out_fd_ ? outcome.out : outcome.err;
        if (n > 0) {
          if (sink.size() < (8u << 20)) sink.append(buffer, static_cast<size_t>(n));
        } else {
          ::close(fd.fd);
          (fd.fd == out_fd_ ? out_fd_ : err_fd_) = -1;
        }
      }
    }
    for (int* fd : {&out_fd_, &err_fd_}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
    if (WIFSIGNALED(status)) outcome.signal = WTERMSIG(status);
    if (WIFEXITED(status)) outcome.exit_code = WEXITSTATUS(status);
    return outcome;
  }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  Clock::time_point start_;
};

/// Processes whose environment carries `mark` (leftover ranks, whatever their parent).
std::vector<pid_t> marked_processes(const std::string& mark) {
  std::vector<pid_t> found;
  const std::string needle = kMarkName + "=" + mark;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "environ", std::ios::binary);
    const std::string environ_text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (environ_text.find(needle + '\0') != std::string::npos) found.push_back(std::stoi(name));
  }
  return found;
}

/// Waits for every process carrying `mark` to be gone (polling; only a hang waits past the hang
/// deadline); returns those left.
std::vector<pid_t> leftovers(const std::string& mark) {
  std::vector<pid_t> left;
  poll_until([&] {
    left = marked_processes(mark);
    return left.empty();
  }, std::chrono::milliseconds(100));
  for (pid_t pid : left) ::kill(pid, SIGKILL);  // never leave them to the next case
  return left;
}

/// path -> (size, modification time) of every entry under `root`. Folders count by name only:
/// checking that an output folder is writable creates and removes a probe file there.
std::map<std::string, std::pair<uintmax_t, int64_t>> snapshot(const std::string& root) {
  std::map<std::string, std::pair<uintmax_t, int64_t>> out;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      out[entry.path().string()] = {0, 0};
      continue;
    }
    out[entry.path().string()] = {static_cast<uintmax_t>(st.st_size),
                                  static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
  }
  return out;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_text(const fs::path& path, const std::string& text) {
  fs::remove(path);
  std::ofstream(path) << text;
}

class Hostile : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = shardit::testing::make_temp_dir("hostile");
    const auto builtin = shardit::models::write_builtin_model((fs::path(root_) / "model").string());
    model_ = builtin.pipeline;
    transformer_ = builtin.transformer;
    inputs_ = builtin.inputs;
    fs::create_directories(fs::path(root_) / "out");
    mark_ = ::testing::UnitTest::GetInstance()->current_test_info()->name() + std::to_string(::getpid());
  }
  void TearDown() override { fs::remove_all(root_); }

  /// The built-in transformer's width (a LoRA factor's input side), from its config.
  int64_t hidden() const {
    std::ifstream in(fs::path(transformer_) / "config.json");
    const nlohmann::json config = nlohmann::json::parse(in);
    return config.at("num_attention_heads").get<int64_t>() * config.at("attention_head_dim").get<int64_t>();
  }

  /// Runs the CLI and checks what every case checks: it ended (no hang), not killed by a signal,
  /// no process left. Files under the case's folder must be unchanged unless `files_may_change`.
  Outcome run(const Spawn& spawn, bool files_may_change = false) {
    const auto before = snapshot(root_);
    Process process(spawn, mark_);
    Outcome outcome = process.wait();
    EXPECT_FALSE(outcome.timed_out) << "hung: still running after " << kHangDeadline.count() << " min\n" << outcome.err;
    EXPECT_EQ(outcome.signal, 0) << "killed by signal " << outcome.signal << "\n" << outcome.err;
    EXPECT_THAT(leftovers(mark_), ::testing::IsEmpty()) << "processes left running";
    if (!files_may_change) {
      EXPECT_EQ(snapshot(root_), before) << "files were created or changed";
    }
    return outcome;
  }

  /// True once `count` processes of this case run at the same time (polled); false when that
  /// never happens before the hang deadline.
  bool wait_for_processes(size_t count) const {
    return poll_until([&] { return marked_processes(mark_).size() >= count; }, std::chrono::milliseconds(5));
  }

  /// Makes every weight file of the model (transformer shards, text encoders, VAE) bytes that are
  /// no safetensors file: a run that reads any weight fails naming it, so a refusal that still
  /// names its own problem came before anything was loaded.
  void make_weights_unreadable() const {
    for (const auto& entry : fs::recursive_directory_iterator(model_)) {
      const fs::path& path = entry.path();
      if (path.extension() != ".safetensors" || path.filename() == "prompt_embeds.safetensors") continue;
      if (path.parent_path() == fs::path(inputs_)) continue;
      write_text(path, "not a safetensors file");
    }
  }

  /// A refusal: exit code `code`, the message on stderr containing every `needles` entry.
  void expect_refused(const Outcome& outcome, const std::vector<std::string>& needles, int code = 1) {
    EXPECT_EQ(outcome.exit_code, code) << outcome.err;
    for (const auto& needle : needles) EXPECT_THAT(outcome.err, HasSubstr(needle));
    EXPECT_THAT(outcome.err, Not(HasSubstr("Exception raised from"))) << "a backtrace was printed";
  }

  std::string out_path(const std::string& name = "sample.safetensors") const {
    return (fs::path(root_) / "out" / name).string();
  }
  std::vector<std::string> run_args(const std::string& out) const {
    return {"run-transformer", "--model", model_, "--inputs", inputs_, "--out", out};
  }
  std::string config() const { return (fs::path(transformer_) / "config.json").string(); }

  std::string root_, model_, transformer_, inputs_, mark_;
};

// ---------------------------------------------------------------------------------------------
// Crashes

TEST_F(Hostile, DeeplyNestedConfigIsRefusedWithoutCrashing) {
  const int depth = 100000;
  write_text(config(), std::string("{\"_class_name\": \"FluxTransformer2DModel\", \"x\": ") + std::string(depth, '[') +
                           std::string(depth, ']') + "}");
  for (const auto& args : {std::vector<std::string>{"inspect", model_}, run_args(out_path())}) {
    const Outcome outcome = run({args});
    EXPECT_THAT(outcome.err + outcome.out, HasSubstr(config()));
    EXPECT_THAT(outcome.err + outcome.out, HasSubstr("nests JSON deeper than"));
    EXPECT_LT(outcome.out.size(), 100000u) << "printed a huge document";
    EXPECT_NE(outcome.exit_code, 0);
  }
}

TEST_F(Hostile, DeepIndexAndInputsJsonAreRefused) {
  const std::string deep = "{\"a\":" + std::string(5000, '[') + std::string(5000, ']') + "}";
  write_text(fs::path(inputs_) / "inputs.json", deep);
  expect_refused(run({run_args(out_path())}), {"inputs.json", "nests JSON deeper than"});
  write_text(fs::path(transformer_) / "diffusion_pytorch_model.safetensors.index.json", deep);
  expect_refused(run({{"inspect", transformer_}}), {"index.json", "nests JSON deeper than"});
}

// ---------------------------------------------------------------------------------------------
// Hangs

TEST_F(Hostile, FifoInputsAreRefusedWithoutBlocking) {
  const auto make_fifo = [](const fs::path& path) {
    fs::remove(path);
    ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  };
  const fs::path fifo = fs::path(root_) / "weights.safetensors";
  make_fifo(fifo);
  expect_refused(run({{"inspect", fifo.string()}}), {fifo.string(), "FIFO"});

  make_fifo(fs::path(inputs_) / "inputs.safetensors");
  expect_refused(run({run_args(out_path())}), {"inputs.safetensors", "FIFO"});

  make_fifo(fs::path(transformer_) / "diffusion_pytorch_model-00002-of-00002.safetensors");
  expect_refused(run({{"inspect", transformer_}}), {"00002-of-00002.safetensors", "FIFO"});

  make_fifo(config());
  expect_refused(run({{"inspect", transformer_}}), {"config.json", "FIFO"});
}

TEST_F(Hostile, ForeignServerOnMasterPortIsBounded) {
  // A server that accepts connections and never answers.
  const int server = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(server, 16), 0);
  ASSERT_EQ(::getsockname(server, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  std::map<std::string, std::string> env = {
      {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};

  env["RANK"] = "1";
  auto args = run_args(out_path());
  args.insert(args.end(), {"--timeout", "2"});
  const Outcome client = run({args, env});
  expect_refused(client, {"rank 1", "127.0.0.1:" + port});

  env["RANK"] = "0";
  const Outcome host = run({args, env});
  // Refused at once: by the check of the port, not after waiting for the other rank to join.
  expect_refused(host, {"MASTER_PORT=" + port, "already in use"});
  EXPECT_THAT(host.err, Not(HasSubstr("did not join")));
  ::close(server);
}

TEST_F(Hostile, LauncherStopsStartingRanksOnSigterm) {
  auto args = run_args(out_path());
  args.insert(args.begin(), {"--nproc-per-node", "16"});
  const auto before = snapshot(root_);
  Process process({args}, mark_);
  // Once the launcher has started its first ranks (before that, SIGTERM simply ends it).
  ASSERT_TRUE(wait_for_processes(2)) << "the launcher started no rank";
  ::kill(process.pid(), SIGTERM);
  const Outcome outcome = process.wait();
  EXPECT_FALSE(outcome.timed_out);
  EXPECT_EQ(outcome.signal, 0);
  EXPECT_NE(outcome.exit_code, 0);
  EXPECT_THAT(leftovers(mark_), ::testing::IsEmpty());
  EXPECT_FALSE(fs::exists(out_path()));
  EXPECT_EQ(snapshot(root_), before);
}

// serve's batching and replica options: out-of-range values and a replica count that does not
// fit the ranks are refused with the option named, before any weight is read, nothing left behind.
TEST_F(Hostile, ServeBatchAndReplicaOptionsAreBounded) {
  for (const auto& [option, value] : {std::pair<std::string, std::string>{"--max-batch", "0"},
                                      {"--max-batch", "100000"},
                                      {"--batch-wait-ms", "5000"},
                                      {"--batch-wait-ms", "-1"},
                                      {"--replicas", "0"}}) {
    const Outcome outcome = run({{"serve", "--model", model_, "--port", "0", option, value}});
    EXPECT_EQ(outcome.exit_code, 2) << option << " " << value << ": " << outcome.err;
    EXPECT_THAT(outcome.err, HasSubstr(option));
    EXPECT_LT(outcome.err.size(), 400u) << outcome.err;
  }
  const Outcome misfit = run({{"--nproc-per-node", "4", "serve", "--model", model_, "--port", "0", "--replicas", "3"}});
  EXPECT_NE(misfit.exit_code, 0);
  EXPECT_THAT(misfit.err, HasSubstr("--replicas 3"));
  EXPECT_THAT(misfit.err, HasSubstr("replicas x cfg x ulysses x ring x tp = 4"));
}

TEST_F(Hostile, LocalRankCountIsBounded) {
  for (const std::string n : {"0", "1000", "-3"}) {
    const Outcome outcome = run({{"--nproc-per-node", n, "inspect", model_}});
    EXPECT_EQ(outcome.exit_code, 2) << outcome.err;
    EXPECT_THAT(outcome.err, HasSubstr("--nproc-per-node"));
    EXPECT_LT(outcome.err.size(), 400u) << outcome.err;
  }
}

// ---------------------------------------------------------------------------------------------
// Orphans and files

TEST_F(Hostile, RanksDieWithAKilledLauncher) {
  auto args = run_args(out_path());
  args.insert(args.end(), {"--nproc-per-node", "2"});
  Process process({args}, mark_);
  // Wait until both ranks run, then kill the launcher outright.
  ASSERT_TRUE(wait_for_processes(3)) << "the launcher and its two ranks never ran together";
  ::kill(process.pid(), SIGKILL);
  process.wait();
  EXPECT_THAT(leftovers(mark_), ::testing::IsEmpty()) << "ranks outlived their launcher";
  // Every process of the case is gone, so nothing can write --out any more.
  EXPECT_FALSE(fs::exists(out_path())) << "a rank wrote --out after its launcher was killed";
}

TEST_F(Hostile, FailedWriteLeavesNoPartialOutput) {
  // Writes beyond 1 KiB fail (EFBIG instead of SIGXFSZ); the sample is larger.
  Spawn spawn{run_args(out_path())};
  spawn.file_size_limit = 1024;
  expect_refused(run(spawn), {out_path(), "writing failed"});
  // An existing output is left as it was.
  write_text(out_path(), "previous");
  expect_refused(run(spawn), {out_path(), "writing failed"});
  EXPECT_EQ(read_text(out_path()), "previous");
}

TEST_F(Hostile, OutputNamingAnInputIsRefused) {
  const std::string inputs_file = (fs::path(inputs_) / "inputs.safetensors").string();
  const std::string shard = (fs::path(transformer_) / "diffusion_pytorch_model-00001-of-00002.safetensors").string();
  const std::string link = (fs::path(root_) / "out" / "link.safetensors").string();
  fs::create_symlink(shard, link);
  for (const auto& out : {inputs_file, shard, link}) {
    expect_refused(run({run_args(out)}), {out, "is also an input"});
  }
}

// Sizes, counts and lengths are bounded, and guidance scales must be finite, before anything is
// allocated: each is refused at once, naming the option (no 5 GB allocation, no black image), with
// the model's weights unreadable (a load would fail naming them).
TEST_F(Hostile, GenerateBoundsAndNonFiniteScalesAreRefusedBeforeLoading) {
  make_weights_unreadable();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--height", "100000", "--width", "100000"}, "height (--height) is 100000; it must be between 1 and 16384"},
      {{"--width", "16", "--height", "100000"}, "height (--height) is 100000"},
      {{"--num-images", "100000"}, "num_images_per_prompt (--num-images) is 100000"},
      {{"--steps", "2000000000"}, "num_inference_steps (--steps) is 2000000000"},
      {{"--max-sequence-length", "100000000"}, "max_sequence_length (--max-sequence-length) is 100000000"},
      {{"--guidance", "nan"}, "guidance_scale (--guidance) is nan; it must be a finite number"},
      {{"--true-cfg-scale", "inf"}, "true_cfg_scale (--true-cfg-scale) is inf"},
      {{"--guidance", "-1e308"}, "guidance_scale (--guidance) is -1e+308; it must be a finite number from -10000 to 10000"},
  };
  for (const auto& [options, message] : cases) {
    std::vector<std::string> args = {"generate", "--model", model_, "--prompt", "a fox", "--out", out_path("x.png")};
    args.insert(args.end(), options.begin(), options.end());
    const Outcome outcome = run({args});
    expect_refused(outcome, {message});
    EXPECT_THAT(outcome.err, Not(HasSubstr("safetensors"))) << "the weights were read before the refusal";
  }
}

// A PNG's IHDR declaring `width` x `height` (a valid header, a small file): what a 2.6 MB PNG of
// zeros decoding to 30000x30000 looks like before decoding.
std::string png_declaring(uint32_t width, uint32_t height) {
  const auto crc32 = [](const std::string& bytes) {
    uint32_t crc = 0xFFFFFFFFu;
    for (unsigned char byte : bytes) {
      crc ^= byte;
      for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return crc ^ 0xFFFFFFFFu;
  };
  const auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                       static_cast<char>(v)};
  };
  const auto chunk = [&](const std::string& type, const std::string& data) {
    return be32(static_cast<uint32_t>(data.size())) + type + data + be32(crc32(type + data));
  };
  const std::string ihdr = be32(width) + be32(height) + std::string{8, 2, 0, 0, 0};  // 8-bit RGB
  return std::string("\x89PNG\r\n\x1a\n", 8) + chunk("IHDR", ihdr) + chunk("IDAT", "") + chunk("IEND", "");
}

// Refused from its header, before any weight is read (they are unreadable here) and without
// decoding 30000x30000 pixels.
TEST_F(Hostile, HugePngForCompareToIsRefusedFromItsHeader) {
  make_weights_unreadable();
  const std::string png = (fs::path(root_) / "huge.png").string();
  std::ofstream(png, std::ios::binary) << png_declaring(30000, 30000);
  const Outcome outcome = run({{"generate", "--model", model_, "--prompt", "a fox", "--steps", "1", "--compare-to", png,
                                "--out", out_path("fox.png")}});
  expect_refused(outcome, {png + ": not a readable PNG: it is 30000x30000 pixels; at most 16384 per side are read"});
  EXPECT_THAT(outcome.err, Not(HasSubstr("safetensors"))) << "the weights were read before the refusal";
}

// generate reads the whole model folder: an output onto any file under it (weights, configs,
// tokenizer files, model_index.json) is refused before anything loads, and the folder is unchanged.
TEST_F(Hostile, GenerateOutputOntoTheModelFolderIsRefused) {
  for (const std::string relative : {"model_index.json", "vae/diffusion_pytorch_model.safetensors",
                                     "vae/config.json", "tokenizer/vocab.json"}) {
    const std::string target = (fs::path(model_) / relative).string();
    ASSERT_TRUE(fs::is_regular_file(target)) << target;
    for (const std::string flag : {"--out", "--out-tensors"}) {
      std::vector<std::string> args = {"generate", "--model", model_, "--prompt", "a fox", "--steps", "1"};
      args.insert(args.end(), {flag, target});
      if (flag == "--out-tensors") args.insert(args.end(), {"--out", out_path("image.png")});
      expect_refused(run({args}), {target, "is also an input", "in the folder " + model_});
    }
  }
}

TEST_F(Hostile, UnwritableOutputIsRefusedBeforeLoading) {
  for (const auto& out : {(fs::path(root_) / "missing" / "x.safetensors").string(), (fs::path(root_) / "out").string() + "/",
                          (fs::path(root_) / "out").string()}) {
    const Outcome outcome = run({run_args(out)});
    expect_refused(outcome, {out});
    EXPECT_THAT(outcome.out, Not(HasSubstr("sample"))) << "the model ran before the output was checked";
  }
}

// ---------------------------------------------------------------------------------------------
// Slow failures

TEST_F(Hostile, HeaderWithManyTensorsParsesInLinearTime) {
  // 400k empty tensors, then trailing bytes that make the file invalid: the parse must end and the
  // error name the problem. Quadratic parsing took minutes at 100k, so at 400k it would take hours
  // and be ended by the hang deadline; a linear parse takes seconds (no clock is read).
  std::string header = "{";
  for (int i = 0; i < 400000; ++i) {
    header += (i ? "," : "") + std::string("\"t") + std::to_string(i) +
              "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
  }
  header += "}";
  const fs::path file = fs::path(root_) / "many.safetensors";
  std::ofstream out(file, std::ios::binary);
  const uint64_t size = header.size();
  out.write(reinterpret_cast<const char*>(&size), 8);
  out << header << "xxxx";
  out.close();
  const Outcome outcome = run({{"inspect", file.string()}});
  expect_refused(outcome, {file.string(), "trailing bytes"});
}

TEST_F(Hostile, AbsurdConfigValuesFailFastNamingTheKey) {
  const std::string original = read_text(config());
  const auto with = [&](const std::string& key, const std::string& value) {
    auto json = nlohmann::json::parse(original);
    json[key] = nlohmann::json::parse(value);
    write_text(config(), json.dump());
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"num_layers", "100000", "out of the accepted range"},
      {"num_single_layers", "1000000", "out of the accepted range"},
      {"num_layers", "9223372036854775808", "out of the accepted range"},
      {"num_layers", "2.5", "expected an integer"},
      {"num_attention_heads", "null", "is null"},
      {"attention_head_dim", "\"16\"", "expected an integer"},
      {"num_attention_heads", "1048576", "larger than the accepted width"},
  };
  for (const auto& [key, value, reason] : cases) {
    with(key, value);
    const Outcome outcome = run({run_args(out_path())});
    expect_refused(outcome, {config(), "'" + key + "'", reason});
  }
}

TEST_F(Hostile, TimeoutOptionBoundsAMissingRank) {
  // Rank 1 of 2 alone: rank 0 never comes.
  auto args = run_args(out_path());
  args.insert(args.begin(), {"--timeout", "2"});
  const Outcome outcome =
      run({args, {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}}});
  expect_refused(outcome, {"rank 1", "2000 ms"});  // the --timeout given, not the default
}

TEST_F(Hostile, HugeWorldSizeIsBoundedByTheTimeoutAndNamedBriefly) {
  // Rank 0 of 100000: it hosts the store and waits the timeout for 99999 ranks that never come;
  // the message lists a few of them, not all.
  auto args = run_args(out_path());
  args.insert(args.begin(), {"--timeout", "2"});
  const int port = 20000 + (::getpid() + 13) % 20000;
  const Outcome outcome = run(
      {args, {{"RANK", "0"}, {"WORLD_SIZE", "100000"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}}});
  expect_refused(outcome, {"rank 0 of 100000", "2000 ms", "did not join", "more)"});
  EXPECT_LT(outcome.err.size(), 2000u) << outcome.err;
}

// ---------------------------------------------------------------------------------------------
// Ranks that disagree

TEST_F(Hostile, RanksWithDifferentWorkFailNamingTheDifference) {
  const int port = 20000 + ::getpid() % 20000;
  const std::map<std::string, std::string> base = {
      {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}};
  auto env0 = base, env1 = base;
  env0["RANK"] = "0";
  env1["RANK"] = "1";
  auto args0 = run_args(out_path()), args1 = run_args(out_path());
  args0.insert(args0.end(), {"--timeout", "10"});
  args1.insert(args1.end(), {"--dtype", "bf16", "--timeout", "10"});
  Process rank0({args0, env0}, mark_), rank1({args1, env1}, mark_);
  const Outcome out0 = rank0.wait(), out1 = rank1.wait();
  for (const Outcome* outcome : {&out0, &out1}) {
    EXPECT_EQ(outcome->signal, 0) << outcome->err;
    EXPECT_FALSE(outcome->timed_out);
    EXPECT_EQ(outcome->exit_code, 1) << outcome->err;
  }
  EXPECT_THAT(out0.err + out1.err, HasSubstr("ranks disagree on the compute dtype"));
  EXPECT_THAT(leftovers(mark_), ::testing::IsEmpty());
  EXPECT_FALSE(fs::exists(out_path()));
}

TEST_F(Hostile, WorldSizeDisagreementIsNamed) {
  const int port = 20000 + (::getpid() + 7) % 20000;
  std::map<std::string, std::string> env0 = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}};
  auto env1 = env0;
  env1["RANK"] = "1";
  env1["WORLD_SIZE"] = "3";
  auto args = run_args(out_path());
  args.insert(args.end(), {"--timeout", "5"});
  Process rank0({args, env0}, mark_), rank1({args, env1}, mark_);
  const Outcome out0 = rank0.wait(), out1 = rank1.wait();
  EXPECT_EQ(out0.exit_code, 1) << out0.err;
  EXPECT_EQ(out1.exit_code, 1) << out1.err;
  EXPECT_THAT(out0.err + out1.err, HasSubstr("world size"));
  EXPECT_THAT(out0.err + out1.err, Not(HasSubstr("rank 1 did not join")));
  EXPECT_THAT(leftovers(mark_), ::testing::IsEmpty());
}

TEST_F(Hostile, NestedLaunchersAreRefused) {
  const Outcome outcome = run({{"--nproc-per-node", "2", "inspect", model_},
                               {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}});
  expect_refused(outcome, {"--nproc-per-node 2 inside a job", "openmpi", "rank 0 of 2"});
}

// ---------------------------------------------------------------------------------------------
// Messages

TEST_F(Hostile, CommandLineMistakesNameTheMistake) {
  const Outcome unknown = run({{"frobnicate", "--x"}});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown command 'frobnicate'"));
  const Outcome tp_alone = run({{"inspect", model_, "--tp", "2"}});
  EXPECT_EQ(tp_alone.exit_code, 2);
  EXPECT_THAT(tp_alone.err, HasSubstr("--plan"));
}

// Numeric options are checked on their text with one readable range (CLI11's own wrapped "-1" to
// 2^64-1 and printed 309-digit bounds), before anything loads.
TEST_F(Hostile, NumericOptionsAreCheckedAsWritten) {
  const std::string tokenizer = (fs::path(model_) / "tokenizer").string();
  const std::vector<std::string> generate = {"generate", "--model", model_, "--prompt", "a fox", "--out",
                                             out_path("x.png")};
  const std::vector<std::string> schedule = {"schedule", "--model", model_, "--height", "64", "--width", "64",
                                             "--steps", "4"};
  const auto with = [](std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {with(generate, {"--seed", "-1"}), "--seed: must be an integer from 0 to 18446744073709551615, got '-1'"},
      {with(generate, {"--seed", "18446744073709551616"}),
       "--seed: must be an integer from 0 to 18446744073709551615, got '18446744073709551616'"},
      {with(generate, {"--steps", "0"}), "--steps: must be an integer from 1 to 9223372036854775807, got '0'"},
      {with(generate, {"--steps", "010"}), "--steps: must be an integer from 1 to 9223372036854775807, got '010'"},
      {with(generate, {"--steps", "0x10"}), "--steps: must be an integer from 1 to 9223372036854775807, got '0x10'"},
      {with(generate, {"--tp", "0"}), "--tp: must be an integer from 1 to 65536, got '0'"},
      {with(generate, {"--height", "9223372036854775808"}),
       "--height: must be an integer from 1 to 9223372036854775807, got '9223372036854775808'"},
      {{"tokenize", "--tokenizer", tokenizer, "--kind", "clip", "--text", "a", "--max-length", "2000000000"},
       "--max-length: must be an integer from 1 to 4096, got '2000000000'"},
      {with(schedule, {"--steps", "2000000000"}), "--steps: must be an integer from 1 to 10000, got '2000000000'"},
      {with(schedule, {"--height", "9223372036854775807"}),
       "--height: must be an integer from 1 to 16384, got '9223372036854775807'"},
      {{"--timeout", "0", "inspect", model_}, "--timeout: must be a number from 0.001 to 86400, got '0'"},
  };
  for (const auto& [args, message] : cases) {
    const Outcome outcome = run({args});
    expect_refused(outcome, {message}, 2);
    EXPECT_LT(outcome.err.size(), 400u) << "an unreadable message:\n" << outcome.err;
  }
}

// The built-in model is written under TMPDIR: a TMPDIR that is not a folder is named with what to
// do.
TEST_F(Hostile, UnusableTmpdirIsNamed) {
  const std::string file = (fs::path(root_) / "not-a-folder").string();
  std::ofstream(file) << "x";
  const Outcome not_folder = run({{"inspect"}, {{"TMPDIR", file}}});
  expect_refused(not_folder, {"the built-in model has no folder: ", "TMPDIR (\"" + file + "\"); set TMPDIR to a writable folder"});
}

TEST_F(Hostile, MalformedCasesFileIsNamed) {
  const std::string cases = (fs::path(root_) / "cases.json").string();
  std::ofstream(cases) << R"({"fast_vs_slow_differences": [{"text": "a"}]})";
  const Outcome outcome = run({{"tokenize", "--tokenizer", (fs::path(model_) / "tokenizer_2").string(), "--kind",
                                "t5", "--cases", cases}});
  expect_refused(outcome, {cases + ": not a cases file of the expected layout for this tokenizer ("});
  std::ofstream(cases, std::ios::trunc) << R"({"cases": [{"text": "a", "ids": [1, "x"]}]})";
  expect_refused(run({{"tokenize", "--tokenizer", (fs::path(model_) / "tokenizer").string(), "--kind", "clip",
                       "--cases", cases}}),
                 {cases + ": cases[0].ids: expected integer ids"});
}

// A scheduler config whose shift is 0 or whose dynamic shift overflows would give NaN sigmas (and
// a black image, or `-nan` in schedule's JSON): refused, naming the key or the sigma.
TEST_F(Hostile, SchedulerConfigsGivingNonFiniteSigmasAreRefused) {
  const fs::path config = fs::path(model_) / "scheduler" / "scheduler_config.json";
  auto json = nlohmann::json::parse(read_text(config));
  const std::vector<std::string> schedule = {"schedule", "--model", model_, "--height", "64", "--width", "64",
                                             "--steps", "4"};
  json["use_dynamic_shifting"] = false;
  json["shift"] = 0;
  write_text(config, json.dump());
  expect_refused(run({schedule}), {config.string() + ": shift must be positive, got 0"});
  json["use_dynamic_shifting"] = true;
  json["shift"] = 1;
  json["base_shift"] = 1000;
  json["max_shift"] = 1000;
  write_text(config, json.dump());
  const Outcome outcome = run({schedule});
  expect_refused(outcome, {"FlowMatchEulerDiscreteScheduler: sigma 0 of 4 is", "outside [0, 1]"});
  EXPECT_THAT(outcome.out, Not(HasSubstr("nan")));
}

// NaN weights in the transformer make every latent NaN: generate fails naming the cause instead of
// writing a black image with exit 0.
TEST_F(Hostile, NonFiniteImageIsRefused) {
  const fs::path folder = fs::path(model_) / "transformer";
  for (const auto& entry : fs::directory_iterator(folder)) {
    if (entry.path().extension() != ".safetensors") continue;
    auto file = shardit::io::SafetensorsFile::open(entry.path().string());
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& name : file->names()) {
      at::Tensor tensor = file->read(name);
      if (name.find("proj_out.weight") != std::string::npos) tensor.fill_(std::numeric_limits<float>::quiet_NaN());
      tensors.emplace_back(name, tensor);
    }
    file.reset();
    shardit::io::save_safetensors(entry.path().string(), tensors);
  }
  const Outcome outcome = run({{"generate", "--model", model_, "--prompt", "a fox", "--steps", "1", "--width", "32",
                                "--height", "32", "--out", out_path("fox.png")}});
  expect_refused(outcome, {"the decoded image is not finite", "NaN or infinite"});
  EXPECT_FALSE(fs::exists(out_path("fox.png")));
}

TEST_F(Hostile, GlobalOptionsWorkAfterTheSubcommand) {
  auto args = run_args(out_path());
  args.insert(args.end(), {"--nproc-per-node", "2", "--timeout", "60"});
  const Outcome outcome = run({args}, /*files_may_change=*/true);
  EXPECT_EQ(outcome.exit_code, 0) << outcome.err;
  EXPECT_TRUE(fs::exists(out_path()));
  // Only the output appeared in the out folder (no temporary file left).
  EXPECT_EQ(std::distance(fs::directory_iterator(fs::path(root_) / "out"), fs::directory_iterator()), 1);
}

TEST_F(Hostile, BadFilesAreNamedWithTheReason) {
  fs::remove(config());
  fs::create_directory(config());
  expect_refused(run({{"inspect", transformer_}}), {config(), "is a directory"});
  fs::remove(config());
  fs::create_symlink(fs::path(root_) / "nowhere.json", config());
  expect_refused(run({{"inspect", transformer_}}), {config(), "symbolic link", "does not exist"});
}

TEST_F(Hostile, IntegerWeightsAreRefusedNamingTheTensor) {
  const fs::path shard = fs::path(transformer_) / "diffusion_pytorch_model-00001-of-00002.safetensors";
  auto file = shardit::io::SafetensorsFile::open(shard.string());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::string changed;
  for (const auto& name : file->names()) {
    at::Tensor tensor = file->read(name);
    if (changed.empty() && name.find("norm") != std::string::npos && name.find("weight") != std::string::npos) {
      changed = name;
      tensor = tensor.to(at::kLong);
    }
    tensors.emplace_back(name, tensor);
  }
  file.reset();
  ASSERT_FALSE(changed.empty());
  shardit::io::save_safetensors(shard.string(), tensors);
  expect_refused(run({run_args(out_path())}), {"'" + changed + "'", "I64"});
  // The pipelines load through the same loader: named before any weight is read.
  expect_refused(run({{"generate", "--model", model_, "--prompt", "a fox", "--steps", "1", "--out",
                       out_path("fox.png")}}),
                 {shard.string() + ": tensor '" + changed + "' is I64, but it is a weight of FluxTransformer2DModel"});
}

TEST_F(Hostile, IntegerLoraFactorIsRefusedNamingTheTensor) {
  const std::string lora = (fs::path(root_) / "int.safetensors").string();
  const std::string key = "transformer.transformer_blocks.0.attn.to_q";
  shardit::io::save_safetensors(lora, {{key + ".lora_A.weight", at::ones({4, hidden()}, at::kInt)},
                                       {key + ".lora_B.weight", at::randn({hidden(), 4})}});
  expect_refused(run({{"generate", "--model", model_, "--prompt", "a fox", "--steps", "1", "--lora", lora, "--out",
                       out_path("fox.png")}}),
                 {lora + ": tensor '" + key + ".lora_A.weight' is I32, expected a floating-point LoRA factor"});
  // A weight beyond float's range is named, not left to LibTorch's conversion error.
  shardit::io::save_safetensors(lora, {{key + ".lora_A.weight", at::randn({4, hidden()})},
                                       {key + ".lora_B.weight", at::randn({hidden(), 4})}});
  expect_refused(run({{"generate", "--model", model_, "--prompt", "a fox", "--steps", "1", "--lora", lora + ":1e308",
                       "--out", out_path("fox.png")}}),
                 {"the weight of LoRA adapter 'int' is 1e+308; it must be a finite number from -10000 to 10000"});
}

TEST_F(Hostile, ControlCharactersInNamesAreNeverPrinted) {
  const fs::path file = fs::path(root_) / "evil.safetensors";
  shardit::io::save_safetensors(file.string(), {{"ok", at::zeros({2})}}, {{"note", "\x1b[31mred\ninjected line"}});
  const Outcome shown = run({{"inspect", file.string()}});
  EXPECT_EQ(shown.exit_code, 0) << shown.err;
  EXPECT_THAT(shown.out, Not(HasSubstr("\x1b")));
  EXPECT_THAT(shown.out, Not(HasSubstr("\ninjected line")));

  const std::string header = "{\"a\\u001b[2Jb\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}";
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  const uint64_t size = header.size();
  out.write(reinterpret_cast<const char*>(&size), 8);
  out << header;
  out.close();
  const Outcome refused = run({{"inspect", file.string()}});
  expect_refused(refused, {"control characters"});
  EXPECT_THAT(refused.err, Not(HasSubstr("\x1b")));
}

// Options that changed nothing, or meant something else than written, are refused naming them:
// a LoRA weight in hexadecimal, an empty --cache, --no-auto-resize without an image, an adapter
// named as the served model; an adapter holding NaN is refused at load naming it.
TEST_F(Hostile, SilentlyAcceptedOptionsAreRefused) {
  const std::string lora = (fs::path(root_) / "style.safetensors").string();
  const std::string key = "transformer.transformer_blocks.0.attn.to_q";
  at::Tensor factor = at::randn({4, hidden()});
  shardit::io::save_safetensors(lora, {{key + ".lora_A.weight", factor}, {key + ".lora_B.weight", at::randn({hidden(), 4})}});
  const std::vector<std::string> generate = {"generate", "--model", model_, "--prompt", "a fox", "--steps", "1",
                                             "--out", out_path("fox.png")};
  const auto with = [](std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  expect_refused(run({with(generate, {"--lora", lora + ":0x10"})}),
                 {"the weight \"0x10\" is not a finite decimal number"});
  expect_refused(run({with(generate, {"--cache", ""})}), {"--cache: is empty"}, 2);
  expect_refused(run({with(generate, {"--no-auto-resize"})}), {"--no-auto-resize requires --image"}, 2);
  expect_refused(run({{"serve", "--model", model_, "--port", "0", "--model-name", "tiny", "--lora", "tiny=" + lora}}),
                 {"the adapter's name \"tiny\" is the served model's name"});
  factor[2][5].fill_(std::nan(""));
  shardit::io::save_safetensors(lora, {{key + ".lora_A.weight", factor}, {key + ".lora_B.weight", at::randn({hidden(), 4})}});
  expect_refused(run({with(generate, {"--lora", lora})}),
                 {lora + ": LoRA adapter 'style', tensor '" + key + ".lora_A.weight': 1 of " +
                  std::to_string(4 * hidden()) + " values are NaN"});
}

// One-line errors stay one line and short whatever the user typed: control characters in a path
// escaped, a 100 KB --cache value cut, a threshold out of range named with its bounds.
TEST_F(Hostile, MessagesStayOneShortLine) {
  const std::vector<std::string> generate = {"generate", "--model", model_, "--prompt", "a fox", "--steps", "1",
                                             "--out", out_path("fox.png")};
  const auto with = [](std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  const Outcome evil = run({with(generate, {"--pipeline", "FluxKontextPipeline", "--image", "a\nb\x1b[31m.png"})});
  expect_refused(evil, {"a\\nb\\x1b[31m.png"});
  EXPECT_THAT(evil.err, Not(HasSubstr("\x1b")));
  EXPECT_EQ(std::count(evil.err.begin(), evil.err.end(), '\n'), 1) << evil.err;
  const Outcome long_value =
      run({with(generate, {"--cache", "first_block_cache:threshold=" + std::string(100000, '1')})});
  expect_refused(long_value, {"threshold is"});
  EXPECT_LT(long_value.err.size(), 400u) << long_value.err.substr(0, 400);
  expect_refused(run({with(generate, {"--cache", "first_block_cache:threshold=1e308"})}),
                 {"threshold is 1e+308, but it takes a number from 0 (never skip) to 1000000"});
}

// FluxKontextPipeline without auto-resize would encode the reference at its own size: an
// 8192x8192 PNG (a legal size, 200 KB) is refused with the numbers before anything is allocated
// for it, and --max-area is bounded at 2048² (larger areas gave NaN sigmas).
TEST_F(Hostile, KontextReferenceAndMaxAreaAreBounded) {
  const std::string big = (fs::path(root_) / "big.png").string();
  {
    const std::string bytes = shardit::io::encode_png(at::full({8192, 8192, 3}, 90, at::kByte));
    std::ofstream(big, std::ios::binary) << bytes;
  }
  const std::vector<std::string> kontext = {"generate", "--model", model_, "--pipeline", "FluxKontextPipeline",
                                            "--prompt", "a fox", "--steps", "1", "--out", out_path("fox.png")};
  std::vector<std::string> args = kontext;
  args.insert(args.end(), {"--image", big, "--no-auto-resize"});
  expect_refused(run({args}), {"reference image 0 (--image) is 8192x8192 and would reach the VAE encoder as "
                               "8192x8192 (67108864 pixels) without auto-resize; at most"});
  args = kontext;
  args.insert(args.end(), {"--max-area", "268435456"});
  expect_refused(run({args}), {"--max-area: must be an integer from 1 to 4194304, got '268435456'"}, 2);
  // A size within --height/--width's range whose schedule shift overflows float32 (as in diffusers)
  // is refused by its numbers before anything is allocated, not as a scheduler config error.
  expect_refused(run({{"generate", "--model", model_, "--prompt", "a fox", "--steps", "1", "--height", "16384",
                       "--width", "12288", "--out", out_path("huge.png")}}),
                 {"a 16384x12288 image is 786432 latent tokens, and the scheduler has no schedule for that many",
                  "choose a smaller size"});
}

// ---------------------------------------------------------------------------------------------
// Decisions (docs/reliability.md, "Questionable inputs")

TEST_F(Hostile, NonFiniteInputsWarnOrFailWithCheckFinite) {
  const fs::path inputs_file = fs::path(inputs_) / "inputs.safetensors";
  auto file = shardit::io::SafetensorsFile::open(inputs_file.string());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& name : file->names()) {
    at::Tensor tensor = file->read(name);
    if (name == "hidden_states") tensor.view(-1)[3] = std::numeric_limits<float>::quiet_NaN();
    tensors.emplace_back(name, tensor);
  }
  file.reset();
  shardit::io::save_safetensors(inputs_file.string(), tensors);

  auto strict = run_args(out_path());
  strict.push_back("--check-finite");
  expect_refused(run({strict}), {"input 'hidden_states'", "NaN"});
  const Outcome warned = run({run_args(out_path())}, /*files_may_change=*/true);
  EXPECT_EQ(warned.exit_code, 0) << warned.err;
  EXPECT_THAT(warned.err, HasSubstr("warning: the sample has non-finite values"));
}

// A model_index.json key is a component folder's name: a path there would make inspect (and every
// reader) leave the pipeline folder.
TEST_F(Hostile, ComponentKeysThatArePathsAreRefused) {
  const fs::path index = fs::path(model_) / "model_index.json";
  const auto original = nlohmann::json::parse(read_text(index));
  for (const std::string key : {"../../x", "/etc", "..", "a/b"}) {
    auto json = original;
    json[key] = {"diffusers", "AutoencoderKL"};
    write_text(index, json.dump());
    const Outcome outcome = run({{"inspect", model_}});
    expect_refused(outcome, {index.string() + ": component \"" + key + "\" is not a folder name"});
  }
}

// A folder that is a symbolic link loop is named as one, path first.
TEST_F(Hostile, SymbolicLinkLoopIsNamed) {
  const fs::path loop = fs::path(root_) / "loop";
  fs::create_symlink(loop, loop);
  expect_refused(run({{"inspect", loop.string()}}),
                 {"shardit: error: " + loop.string() + ": Too many levels of symbolic links (a symbolic link loop)"});
}

TEST_F(Hostile, IndexPointingOutsideTheFolderIsRefused) {
  const fs::path index = fs::path(transformer_) / "diffusion_pytorch_model.safetensors.index.json";
  auto json = nlohmann::json::parse(read_text(index));
  json["weight_map"].begin().value() = "../../model/transformer/diffusion_pytorch_model-00001-of-00002.safetensors";
  write_text(index, json.dump());
  expect_refused(run({{"inspect", transformer_}}), {"index.json", "outside the index's folder"});
  json["weight_map"].begin().value() = "/etc/passwd";
  write_text(index, json.dump());
  expect_refused(run({{"inspect", transformer_}}), {"outside the index's folder"});
}

TEST_F(Hostile, InspectUnderSeveralRanksPrintsOnce) {
  const Outcome outcome = run({{"--nproc-per-node", "2", "inspect", model_}});
  EXPECT_EQ(outcome.exit_code, 0) << outcome.err;
  size_t count = 0;
  for (size_t at = outcome.out.find("== pipeline at"); at != std::string::npos;
       at = outcome.out.find("== pipeline at", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << outcome.out.substr(0, 2000);
}

TEST_F(Hostile, DamagedBuiltinModelCacheIsRebuilt) {
  const fs::path tmp = fs::path(root_) / "tmp";
  fs::create_directories(tmp);
  const std::map<std::string, std::string> env = {{"TMPDIR", tmp.string()}};
  ASSERT_EQ(run({{"inspect"}, env}, true).exit_code, 0);
  fs::path shard;
  for (const auto& entry : fs::recursive_directory_iterator(tmp)) {
    if (entry.path().filename() == "diffusion_pytorch_model-00002-of-00002.safetensors") shard = entry.path();
  }
  ASSERT_FALSE(shard.empty());
  fs::resize_file(shard, fs::file_size(shard) / 2);
  const Outcome outcome = run({{"run-transformer", "--out", out_path()}, env}, true);
  EXPECT_EQ(outcome.exit_code, 0) << outcome.err;
}

}  // namespace
}  // namespace test_hostile_cli
