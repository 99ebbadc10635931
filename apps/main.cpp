// shardit: the command-line front end. `--nproc-per-node N` (before or after the subcommand)
// re-runs the same command as N local ranks, like torchrun; `--timeout S` bounds every wait on
// another rank.
#include <ATen/Parallel.h>

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "shardit/core/heap.h"
#include "shardit/core/error.h"
#include "shardit/dist/launch_env.h"
#include "shardit/dist/launcher.h"
#include "shardit/dist/world.h"
#include "shardit/nn/program_start.h"

namespace {

/// Exit code of a command line that could not be parsed (runtime errors exit 1).
constexpr int kUsageError = 2;

// "rank r: " once the rank is known (from the world, else from the launcher's variables), so an
// error before the rendezvous is not blamed on rank 0.
std::string rank_label() {
  if (shardit::dist::World::initialized()) {
    const auto& world = shardit::dist::World::get();
    return world.size() > 1 ? "rank " + std::to_string(world.rank()) + ": " : "";
  }
  try {
    const auto env = shardit::dist::LaunchEnv::from_environment();
    return env.world_size > 1 ? "rank " + std::to_string(env.rank) + ": " : "";
  } catch (const std::exception&) {
    return "";
  }
}

[[noreturn]] void fail(const std::string& message) {
  // What the command printed so far goes out first (std::_Exit below flushes nothing).
  std::fflush(stdout);
  // One line whatever the message quotes (a path holding a newline or an escape sequence).
  std::fprintf(stderr, "shardit: error: %s%s\n", rank_label().c_str(), shardit::printable_line(message).c_str());
  std::fflush(stderr);
  // Exit without running destructors: a failed collective can leave c10d threads that would
  // block a normal shutdown.
  std::_Exit(1);
}

// An exception escaping a LibTorch or Gloo thread (a transport failure) would abort with a core
// dump and a raw `terminate` message; report it like any other error instead.
[[noreturn]] void on_terminate() {
  std::string message = "internal failure outside the command (a communication thread)";
  if (const std::exception_ptr current = std::current_exception()) {
    try {
      std::rethrow_exception(current);
    } catch (const std::exception& e) {
      message = "communication failed: " + shardit::error_message(e) +
                " (the ranks probably disagree about the work; run every rank with the same command)";
    } catch (...) {
    }
  }
  fail(message);
}

// The subcommand the user typed when CLI11 found none it knows: the first word that is neither an
// option nor the value of a global option.
std::string unknown_command(const CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.rfind("-", 0) == 0) {
      if (arg.find('=') == std::string::npos && (arg == "--nproc-per-node" || arg == "--timeout" || arg == "--attention-backend" ||
                                                   arg == "--gemm-backend")) {
        ++i;
      }
      continue;
    }
    for (const CLI::App* sub : app.get_subcommands({})) {
      if (sub->get_name() == arg) return "";
    }
    return arg;
  }
  return "";
}

// The command line of one process: the CLI as started, or a rank that the local launcher forked
// from it (--nproc-per-node), with the rank's command line.
int run_cli(int argc, char** argv) {
  // A write past the file-size limit fails with EFBIG (reported, temp file removed) instead of
  // killing the process; a closed stdout pipe is an error, not a silent death.
  ::signal(SIGXFSZ, SIG_IGN);
  ::signal(SIGPIPE, SIG_IGN);
  std::set_terminate(on_terminate);

  CLI::App app{"shardit: tensor-parallel diffusion transformers in C++"};
  app.require_subcommand(1);
  // Global options are also accepted after the subcommand.
  app.fallthrough();
  int nproc_per_node = 1;
  app.add_option("--nproc-per-node", nproc_per_node, "run the command as N ranks on this host")
      ->check(shardit::apps::integer_in(1, shardit::dist::kMaxLocalRanks));
  double timeout_seconds = 0;
  app.add_option("--timeout", timeout_seconds,
                 "seconds to wait for another rank (rendezvous, agreement, each collective) before failing; "
                 "default 120, or SHARDIT_DIST_TIMEOUT_MS")
      ->check(shardit::apps::number_in(0.001, 86400.0));
  shardit::apps::BackendCliOptions backends;
  shardit::apps::add_backend_options(&app, backends);

  shardit::apps::CommandBody body;
  shardit::apps::register_generate(app, body);
  shardit::apps::register_inspect(app, body);
  shardit::apps::register_run_encoder(app, body);
  shardit::apps::register_run_transformer(app, body);
  shardit::apps::register_run_vae(app, body);
  shardit::apps::register_schedule(app, body);
  shardit::apps::register_tokenize(app, body);
  shardit::apps::register_preprocess_image(app, body);
  shardit::apps::register_check_backends(app, body);
  shardit::apps::register_serve(app, body);
  shardit::apps::register_version(app, body);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const std::string command = e.get_exit_code() == 0 ? "" : unknown_command(app, argc, argv);
    if (!command.empty()) {
      std::string known;
      for (const CLI::App* sub : app.get_subcommands({})) known += (known.empty() ? "" : ", ") + sub->get_name();
      std::fprintf(stderr, "shardit: error: unknown command '%s' (commands: %s; see --help)\n", command.c_str(),
                   known.c_str());
      return kUsageError;
    }
    // --help and --version exit 0; every misuse of the command line exits kUsageError.
    return app.exit(e) == 0 ? 0 : kUsageError;
  }

  try {
    if (timeout_seconds > 0) {
      // The world reads it (and the ranks of a local launch inherit it).
      const long ms = std::max(1L, static_cast<long>(timeout_seconds * 1000.0));
      ::setenv("SHARDIT_DIST_TIMEOUT_MS", std::to_string(ms).c_str(), 1);
    }
    backends.apply();
    if (nproc_per_node > 1) {
      const auto env = shardit::dist::LaunchEnv::from_environment();
      TORCH_CHECK(env.world_size == 1, "--nproc-per-node ", nproc_per_node, " inside a job that ",
                  shardit::dist::launch_source_name(env.source), " already started as rank ", env.rank, " of ",
                  env.world_size, ": that would run ", env.world_size, " independent jobs on the same files; "
                  "use one launcher (drop --nproc-per-node, or start a single process)");
      return shardit::dist::relaunch_as_local_ranks(
          argc, argv, nproc_per_node, "--nproc-per-node", [](const std::vector<std::string>& rank_argv) {
            std::vector<char*> pointers;
            for (const std::string& arg : rank_argv) pointers.push_back(const_cast<char*>(arg.c_str()));
            pointers.push_back(nullptr);
            return run_cli(static_cast<int>(rank_argv.size()), pointers.data());
          });
    }
    shardit::dist::World::init();
    return body ? body() : 0;
  } catch (const std::exception& e) {
    fail(shardit::error_message(e));
  }
}

}  // namespace

int main(int argc, char** argv) {
  shardit::nn::start_program(argv);
  return run_cli(argc, argv);
}
