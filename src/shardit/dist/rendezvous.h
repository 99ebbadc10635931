#pragma once
// The rendezvous through c10d's TCPStore, hosted by rank 0 (internal to dist/): joining it, with
// every missing rank named, and checks that all ranks hold the same value, through the store.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "shardit/dist/launch_env.h"

namespace shardit::dist {

/// Runs `fn` on its own thread and waits at most `limit`, else fails with `on_timeout`: for c10d
/// calls with no bound of their own (a store server that accepts but never answers, Gloo retrying a
/// refused connection). On timeout the thread is abandoned (the process is about to exit with the
/// error).
template <class T>
T run_bounded(std::chrono::milliseconds limit, std::function<T()> fn, const std::string& on_timeout) {
  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    T value{};
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  std::thread([state, fn = std::move(fn)] {
    T value{};
    std::exception_ptr error;
    try {
      value = fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->value = std::move(value);
    state->error = error;
    state->done = true;
    state->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mutex);
  const bool finished = state->done_cv.wait_for(lock, limit, [&] { return state->done; });
  TORCH_CHECK(finished, on_timeout);
  if (state->error) std::rethrow_exception(state->error);
  return std::move(state->value);
}

/// Where the store is: MASTER_ADDR, or loopback when every rank is local (no MASTER_ADDR).
std::string store_host(const LaunchEnv& env);

/// "host:port" of the store, for messages.
std::string store_address(const LaunchEnv& env);

/// Rank 0 hosts the store on MASTER_PORT: a port some other program holds is reported now, by
/// name, instead of as a rendezvous timeout blamed on MASTER_ADDR.
void check_port_free(int port);

/// Connects to the store (rank 0 hosts it) and waits until every rank has joined with
/// the same world size, within `timeout`. Errors name the ranks that did not join, or the rank
/// with another WORLD_SIZE; the caller says who failed and where.
c10::intrusive_ptr<c10d::Store> join_store(const LaunchEnv& env, std::chrono::milliseconds timeout);

/// World::agree on `store`: every rank records `value` for `topic` under `prefix` and compares it
/// with every other rank's, failing at the first that differs or, after `timeout`, naming the
/// ranks that never reached the check.
void agree_through_store(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                         const std::string& topic, const std::string& value, std::chrono::milliseconds timeout);

}  // namespace shardit::dist
