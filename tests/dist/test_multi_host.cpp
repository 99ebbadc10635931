// Two ranks as two hosts: each rank in a network namespace of its own (`ip netns`), with a host
// name of its own that resolves to nothing (Gloo's default device would then fall back to
// loopback), the two joined by a veth pair, and started as torchrun starts ranks on two hosts
// (MASTER_ADDR is rank 0's host). The image equals the one two ranks on one host make, and one
// process's within one level. Without namespaces (no CAP_NET_ADMIN) the cases skip, saying why.
// The cases wait on the ranks' exits, never on a clock.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shardit/io/png.h"
#include "support/test_support.h"

namespace test_multi_host {
namespace {

using shardit::testing::cli_path;
using shardit::testing::kHangDeadline;
using shardit::testing::make_temp_dir;
using shardit::testing::run_command;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The generation every case runs: the built-in tiny pipeline, 2 steps at 64x48.
const std::string kGenerate = " generate --steps 2 --width 64 --height 48 --seed 3 --out ";

// A rank started in a host's namespace; SIGKILLed when still running at the end.
struct RankProcess {
  pid_t pid = -1;
  std::string log;
  std::optional<int> status;

  ~RankProcess() {
    if (pid > 0 && !status) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  // Whether it exited before the hang deadline (its code in exit_code()).
  bool exited() {
    const auto deadline = Clock::now() + kHangDeadline;
    while (!status && Clock::now() < deadline) {
      int raw = 0;
      if (::waitpid(pid, &raw, WNOHANG) == pid) status = raw;
      else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return status.has_value();
  }
  int exit_code() const { return WIFSIGNALED(*status) ? 128 + WTERMSIG(*status) : WEXITSTATUS(*status); }
};

// Two network namespaces joined by a veth pair, 10.231.77.1/24 and 10.231.77.2/24, loopback up in
// each; deleted (with the pair) when this goes, also after a failed check.
class TwoHosts {
 public:
  static constexpr const char* kAddress[2] = {"10.231.77.1", "10.231.77.2"};

  TwoHosts() {
    const std::string id = std::to_string(::getpid());
    for (int h = 0; h < 2; ++h) {
      names_[h] = "shardit-host" + std::to_string(h) + "-" + id;
      veth_[h] = "smh" + id + (h == 0 ? "a" : "b");
    }
    const std::string& a = veth_[0];
    const std::string& b = veth_[1];
    const std::vector<std::string> steps = {
        "ip netns add " + names_[0],
        "ip netns add " + names_[1],
        "ip link add " + a + " type veth peer name " + b,
        "ip link set " + a + " netns " + names_[0],
        "ip link set " + b + " netns " + names_[1],
        "ip -n " + names_[0] + " addr add " + kAddress[0] + "/24 dev " + a,
        "ip -n " + names_[1] + " addr add " + kAddress[1] + "/24 dev " + b,
        "ip -n " + names_[0] + " link set lo up",
        "ip -n " + names_[1] + " link set lo up",
        "ip -n " + names_[0] + " link set " + a + " up",
        "ip -n " + names_[1] + " link set " + b + " up"};
    for (const std::string& step : steps) {
      std::string output;
      if (run_command(step, &output) != 0) {
        error_ = "`" + step + "` failed: " + output;
        return;
      }
    }
  }
  ~TwoHosts() {
    std::string output;
    for (const std::string& name : names_) run_command("ip netns del " + name + " 2>/dev/null", &output);
    run_command("ip link del " + veth_[0] + " 2>/dev/null", &output);  // a pair left in this namespace
  }
  // Why the namespaces could not be made ("" when they were).
  const std::string& error() const { return error_; }

  // Starts rank `rank` of 2 on host `rank` with torchrun's variables and `env`, its output in `log`.
  std::unique_ptr<RankProcess> start_rank(int rank, const std::vector<std::string>& argv,
                                          const std::map<std::string, std::string>& env, const std::string& log) {
    auto process = std::make_unique<RankProcess>();
    process->log = log;
    const std::string netns = "/run/netns/" + names_[rank];
    const std::string host_name = "shardit-test-host-" + std::to_string(rank);
    process->pid = ::fork();
    if (process->pid == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      const int ns = ::open(netns.c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) {
        std::perror(("entering " + netns).c_str());
        ::_exit(126);
      }
      // A host name of its own, which resolves to nothing (where UTS namespaces are allowed).
      if (::unshare(CLONE_NEWUTS) == 0) ::sethostname(host_name.c_str(), host_name.size());
      ::unsetenv("GLOO_SOCKET_IFNAME");
      const std::map<std::string, std::string> torchrun = {
          {"MASTER_ADDR", kAddress[0]}, {"MASTER_PORT", "29500"},     {"RANK", std::to_string(rank)},
          {"WORLD_SIZE", "2"},          {"LOCAL_RANK", "0"},          {"LOCAL_WORLD_SIZE", "1"},
          {"GROUP_RANK", std::to_string(rank)}};
      for (const auto& [key, value] : torchrun) ::setenv(key.c_str(), value.c_str(), 1);
      for (const auto& [key, value] : env) ::setenv(key.c_str(), value.c_str(), 1);
      std::vector<char*> args;
      for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    return process;
  }

 private:
  std::string names_[2];
  std::string veth_[2];
  std::string error_;
};

// Both ranks of `shardit --timeout <timeout> generate ... --out <out>`, one per host.
std::vector<std::unique_ptr<RankProcess>> run_on_two_hosts(TwoHosts& hosts, const std::string& dir,
                                                           const std::string& out, const std::string& timeout,
                                                           const std::map<std::string, std::string>& env) {
  std::vector<std::string> argv = {cli_path(), "--timeout", timeout};
  std::istringstream words(kGenerate + out);
  for (std::string word; words >> word;) argv.push_back(word);
  std::vector<std::unique_ptr<RankProcess>> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(hosts.start_rank(r, argv, env, dir + "/rank" + std::to_string(r) + ".log"));
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(ranks[r]->exited()) << "rank " << r << " hung:\n" << read_text(ranks[r]->log);
  return ranks;
}

// No interface named: each rank's Gloo device is the address that routes to MASTER_ADDR (never
// the loopback its host name would give), and the image is the one-host image.
TEST(MultiHost, TwoHostsInNetworkNamespacesGiveTheOneHostImage) {
  TwoHosts hosts;
  if (!hosts.error().empty()) GTEST_SKIP() << "network namespaces cannot be made here: " << hosts.error();
  const std::string dir = make_temp_dir("multi_host");
  std::string output;
  // The references (they also write the built-in model before the ranks read it).
  ASSERT_EQ(run_command(cli_path() + kGenerate + dir + "/single.png", &output), 0) << output;
  ASSERT_EQ(run_command(cli_path() + " --nproc-per-node 2" + kGenerate + dir + "/one_host.png", &output), 0) << output;

  auto ranks = run_on_two_hosts(hosts, dir, dir + "/two_hosts.png", "60", {});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ranks[r]->status) << "rank " << r;
    ASSERT_EQ(ranks[r]->exit_code(), 0) << "rank " << r << ":\n" << read_text(ranks[r]->log);
  }
  EXPECT_THAT(read_text(ranks[0]->log), HasSubstr("tp 2 of 2 ranks"));
  const at::Tensor two_hosts = shardit::io::read_png(dir + "/two_hosts.png").to(at::kInt);
  const at::Tensor one_host = shardit::io::read_png(dir + "/one_host.png").to(at::kInt);
  const at::Tensor single = shardit::io::read_png(dir + "/single.png").to(at::kInt);
  ASSERT_EQ(two_hosts.sizes(), one_host.sizes());
  EXPECT_TRUE(two_hosts.equal(one_host)) << "the two hosts' image differs from one host's in "
                                         << two_hosts.ne(one_host).sum().item<int64_t>() << " values";
  EXPECT_LE((two_hosts - single).abs().max().item<int>(), 1) << "the image differs from one process's";
}

// Both hosts told to use loopback (GLOO_SOCKET_IFNAME=lo): the ranks cannot reach each other. Both
// fail within the timeout (and the time to hear the other), naming the address and port Gloo
// tried, every rank's published address as loopback, the other rank's own error (it is alive and
// could not connect, not lost) and the variable to set.
TEST(MultiHost, UnreachableAddressesAreNamedWithTheVariableToSet) {
  TwoHosts hosts;
  if (!hosts.error().empty()) GTEST_SKIP() << "network namespaces cannot be made here: " << hosts.error();
  const std::string dir = make_temp_dir("multi_host_lo");
  auto ranks = run_on_two_hosts(hosts, dir, dir + "/never.png", "10", {{"GLOO_SOCKET_IFNAME", "lo"}});
  std::string both;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ranks[r]->status) << "rank " << r;
    const std::string log = read_text(ranks[r]->log);
    both += log;
    EXPECT_NE(ranks[r]->exit_code(), 0) << log;
    EXPECT_THAT(log, HasSubstr("Gloo could not connect group 'world'")) << "rank " << r;
    EXPECT_THAT(log, HasSubstr("set GLOO_SOCKET_IFNAME on every rank")) << "rank " << r;
    EXPECT_THAT(log, HasSubstr("loopback, which no other host reaches, while MASTER_ADDR 10.231.77.1 is reached from " +
                               std::string(TwoHosts::kAddress[r])))
        << "rank " << r;
    EXPECT_THAT(log, HasSubstr("rank " + std::to_string(1 - r) + " could not connect either")) << "rank " << r;
    EXPECT_THAT(log, Not(HasSubstr("exited, crashed or was killed"))) << "rank " << r;
  }
  EXPECT_TRUE(std::regex_search(both, std::regex(R"(\[127\.0\.0\.1\]:[0-9]+)")))
      << "no rank names the address and port it tried:\n" << both;
}

}  // namespace
}  // namespace test_multi_host
