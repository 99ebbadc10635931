#pragma once
// Byte counts as people read them, the same in every report (inspect, plans, bench).
#include <cstdint>
#include <string>

namespace shardit {

/// Bytes per GiB.
constexpr double kBytesPerGiB = 1024.0 * 1024.0 * 1024.0;

/// In the largest binary unit below the value, two decimals: "512 B", "1.50 KiB", "12.34 MiB",
/// "22.17 GiB", "1.02 TiB".
std::string human_bytes(int64_t bytes);

/// Always in GiB, two decimals ("0.25 GiB"): for columns that compare sizes.
std::string gib(int64_t bytes);

}  // namespace shardit
