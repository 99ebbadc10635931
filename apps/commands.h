#pragma once
// Each CLI subcommand lives in its own apps/cmd_<name>.cpp and registers itself here. The CLI is
// thin: it parses, calls the library, prints.
#include <CLI/CLI.hpp>

#include <functional>

namespace shardit::apps {

/// A subcommand's body: runs after parsing; returns the process exit code.
using CommandBody = std::function<int()>;

/// Adds `inspect` (checkpoint tensors, config, resolved TP plan).
void register_inspect(CLI::App& app, CommandBody& body);
/// Adds `run-transformer` (one forward of a transformer on a golden-style case folder).
void register_run_transformer(CLI::App& app, CommandBody& body);
/// Adds `tokenize` (prompt ids as JSON, or a check of a tokenizer cases file).
void register_tokenize(CLI::App& app, CommandBody& body);

}  // namespace shardit::apps
