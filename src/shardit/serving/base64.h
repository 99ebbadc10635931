#pragma once
// Base64 (RFC 4648, standard alphabet, padded): how the images API carries PNG bytes in JSON.
#include <optional>
#include <string>

namespace shardit::serving {

/// `bytes` as padded standard base64.
std::string base64_encode(const std::string& bytes);

/// The bytes of padded standard base64 `text`; nullopt when `text` is not such base64.
std::optional<std::string> base64_decode(const std::string& text);

}  // namespace shardit::serving
