#pragma once
// The pieces shared by the byte-level BPE tokenizers (CLIP, Qwen): GPT-2's byte-to-character map
// and the merge loop.
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shardit::tokenizers {

/// GPT-2's `bytes_to_unicode`: each byte of `bytes` as its printable stand-in character (UTF-8).
std::string byte_level_encode(std::string_view bytes);

/// Merge ranks: a lower rank merges first.
class BpeRanks {
 public:
  /// Adds the merge `left right` with the next rank; false if the pair was already listed
  /// (the first listing keeps its rank, as the references do).
  bool add(std::string_view left, std::string_view right);
  /// The rank of merging `left` with `right`, or -1 when they do not merge.
  int rank(std::string_view left, std::string_view right) const;
  size_t size() const { return ranks_.size(); }

 private:
  std::unordered_map<std::string, int> ranks_;
  int next_ = 0;
};

/// Applies the merges to `symbols` (one word): repeatedly joins the adjacent pair of lowest rank,
/// leftmost first, until no listed pair remains.
std::vector<std::string> bpe_merge(std::vector<std::string> symbols, const BpeRanks& ranks);

/// The UTF-8 characters of valid UTF-8 `text`, one string each.
std::vector<std::string> split_characters(std::string_view text);

}  // namespace shardit::tokenizers
