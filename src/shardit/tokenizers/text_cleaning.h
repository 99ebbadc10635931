#pragma once
// CLIPTokenizer's text preparation: ftfy's `fix_text` (the fixers that do not guess encodings),
// then `whitespace_clean` and lower-casing.
#include <string>
#include <string_view>

namespace shardit::tokenizers {

/// ftfy 6's `fix_text` with its default configuration, line by line until stable: HTML entities
/// (only where the line has no '<'), C1 controls read as Windows-1252, Latin ligatures, full- and
/// half-width forms, curly quotes, line breaks, terminal escapes, control characters, then NFC.
/// The mojibake detector (re-decoding text that "looks like" misdecoded UTF-8) is not applied:
/// it is a heuristic over a large character table and never fires on text typed as a prompt.
std::string fix_text(std::string_view utf8);

/// transformers' `whitespace_clean`: runs of whitespace (Python's `\s`) become one space, and the
/// ends are stripped.
std::string whitespace_clean(std::string_view utf8);

}  // namespace shardit::tokenizers
