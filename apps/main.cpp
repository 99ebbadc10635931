// shardit: the command-line front end. `--nproc-per-node N` (before the subcommand) re-runs the
// same command as N local ranks, like torchrun.
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "shardit/core/error.h"
#include "shardit/dist/launcher.h"
#include "shardit/dist/world.h"

int main(int argc, char** argv) {
  CLI::App app{"shardit: tensor-parallel diffusion transformers in C++"};
  app.require_subcommand(1);
  int nproc_per_node = 1;
  app.add_option("--nproc-per-node", nproc_per_node, "run the command as N ranks on this host")
      ->check(CLI::PositiveNumber);

  shardit::apps::CommandBody body;
  shardit::apps::register_inspect(app, body);
  shardit::apps::register_run_transformer(app, body);
  shardit::apps::register_run_vae(app, body);
  shardit::apps::register_schedule(app, body);

  CLI11_PARSE(app, argc, argv);

  if (nproc_per_node > 1) {
    return shardit::dist::relaunch_as_local_ranks(argc, argv, nproc_per_node);
  }

  try {
    shardit::dist::World::init();
    return body ? body() : 0;
  } catch (const std::exception& e) {
    // What the command printed so far goes out first (std::_Exit below flushes nothing).
    std::fflush(stdout);
    const int rank = shardit::dist::World::initialized() ? shardit::dist::World::get().rank() : 0;
    std::fprintf(stderr, "shardit: error (rank %d): %s\n", rank, shardit::error_message(e).c_str());
    std::fflush(stderr);
    // Exit without running destructors: a failed collective can leave c10d threads that would
    // block a normal shutdown.
    std::_Exit(1);
  }
}
