#pragma once
// The rendezvous through c10d's TCPStore, hosted by rank 0 (internal to dist/): joining it, with
// every missing rank named, and checks that all ranks hold the same value, through the store.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "shardit/dist/launch_env.h"

namespace shardit::dist {

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
