#pragma once
// The program every example is: a pipeline folder opened with DiffusionPipeline::open, its
// transformer split over every rank (tensor parallelism) while loading or, with
// --enable-parallelism, after loading whole, then one call from prompt embeddings to PNG on rank 0.
// An example names only what differs: its pipeline and its help texts. The program is compiled
// once (tp_example.cpp) and linked into each example.
#include <string>

namespace shardit::examples {

/// What one example program is about.
struct TpExample {
  std::string program;         ///< its name, which starts its errors ("flux_tp")
  std::string pipeline_class;  ///< the pipeline model_index.json must name ("FluxPipeline")
  std::string description;     ///< the --help title
  std::string prompt_embeds;   ///< what the --prompt-embeds file holds, for --help
  std::string out;             ///< the default --out
};

/// Parses the example's command line, runs it, and returns the exit status (errors on stderr).
int run_tp_example(int argc, char** argv, const TpExample& example);

}  // namespace shardit::examples
