#pragma once
// The pieces shared by the byte-level BPE tokenizers (CLIP, Qwen): GPT-2's byte-to-character map
// and the merge loop, and a small merge learner.
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace shardit::tokenizers {

/// GPT-2's `bytes_to_unicode`: each byte of `bytes` as its printable stand-in character (UTF-8).
std::string byte_level_encode(std::string_view bytes);

/// The 256 byte symbols in `bytes_to_unicode()`'s order (printable bytes first, then the others):
/// how byte-level vocabularies (CLIP's, GPT-2's) start.
std::vector<std::string> byte_level_alphabet();

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

/// A word of a BPE training corpus: its symbols and how often it occurs.
struct BpeWord {
  std::vector<std::string> symbols;
  int64_t count = 1;
};

/// Learns up to `num_merges` merges from `words` as BPE's trainer does: repeatedly joins the most
/// frequent adjacent pair everywhere (ties broken by the pairs' bytes, so the result depends on
/// nothing but the input); stops early when no pair occurs twice.
std::vector<std::pair<std::string, std::string>> learn_bpe_merges(std::vector<BpeWord> words, size_t num_merges);

/// The UTF-8 characters of valid UTF-8 `text`, one string each.
std::vector<std::string> split_characters(std::string_view text);

}  // namespace shardit::tokenizers
