// Strict checks for untrusted JSON text (safetensors headers, sharded-checkpoint indexes, saved
// configs): UTF-8 validation, a nesting bound checked before the recursive parser runs, no
// repeated keys, and short descriptions of values for error messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "moh/error.hpp"

namespace moh {
namespace detail {

/// Largest accepted header, as in the reference implementation.
constexpr std::uint64_t kMaxSafetensorsHeader = 100000000;
/// Deepest accepted JSON nesting; the header itself needs 3.
constexpr int kMaxJsonDepth = 64;


/// Offset of the first byte that breaks strict UTF-8 (no overlongs, no surrogates, nothing above
/// U+10FFFF, no truncated sequences), or `size` if the text is valid.
inline std::size_t utf8_error_offset(const std::uint8_t* s, std::size_t size) {
  std::size_t i = 0;
  while (i < size) {
    const std::uint8_t c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t length;
    std::uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // UTF-16 surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;  // stray continuation byte, overlong lead C0/C1, or F5..FF
    }
    if (size - i < length) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (std::size_t k = 2; k < length; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
    }
    i += length;
  }
  return size;
}

/// True if the JSON text opens more than `max_depth` arrays/objects at once. Brackets inside
/// strings (including after escaped quotes) do not count. Runs in one pass without recursion,
/// so it is safe on any input.
inline bool json_nesting_exceeds(const std::uint8_t* s, std::size_t size, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < size; ++i) {
    const std::uint8_t c = s[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;  // a mismatch is left for the JSON parser to report
    }
  }
  return false;
}

/// Short description of a JSON value for messages, e.g. "number -3" or "array [1,2]".
inline std::string describe_json(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return concat(value.type_name(), ' ', text);
}

/// Reads a JSON number that must be a non-negative integer <= `limit`.
inline bool json_to_count(const nlohmann::json& value, std::uint64_t limit, std::uint64_t& out) {
  if (value.is_number_unsigned()) {
    out = value.get<std::uint64_t>();
  } else if (value.is_number_integer()) {
    const std::int64_t v = value.get<std::int64_t>();
    if (v < 0) return false;
    out = static_cast<std::uint64_t>(v);
  } else {
    return false;  // floats (2.0, 1e30), strings, booleans, ...
  }
  return out <= limit;
}


/// Parses `size` bytes of untrusted JSON text as strictly as a safetensors header: valid UTF-8,
/// nesting <= kMaxJsonDepth (checked before the recursive parser runs), valid JSON, no repeated
/// key in any object, an object at the top. Errors read "<prefix><what> ...", e.g.
/// "safetensors file a.st: header is not valid UTF-8: ...".
inline nlohmann::json parse_json_strictly(const std::uint8_t* text, std::size_t size,
                                          const std::string& prefix, const std::string& what) {
  const std::size_t bad_byte = utf8_error_offset(text, size);
  if (bad_byte != size) {
    static const char kHex[] = "0123456789abcdef";
    const std::uint8_t b = text[bad_byte];
    const char byte_text[] = {'0', 'x', kHex[b >> 4], kHex[b & 15], '\0'};
    fail(prefix, what, " is not valid UTF-8: expected UTF-8 text, got byte ", byte_text, " at ",
         what, " offset ", bad_byte);
  }
  if (json_nesting_exceeds(text, size, kMaxJsonDepth)) {
    fail(prefix, what, " JSON nests too deeply: expected depth <= ", kMaxJsonDepth, ", got more");
  }
  nlohmann::json root;
  try {
    // Reject repeated keys in any object (the parser would silently keep the last one).
    std::vector<std::set<std::string>> open_objects;
    auto reject_duplicates = [&](int, nlohmann::json::parse_event_t event,
                                 nlohmann::json& parsed) {
      using Event = nlohmann::json::parse_event_t;
      if (event == Event::object_start) {
        open_objects.emplace_back();
      } else if (event == Event::object_end && !open_objects.empty()) {
        open_objects.pop_back();
      } else if (event == Event::key && !open_objects.empty()) {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!open_objects.back().insert(key).second) {
          fail(prefix, what, " repeats the key '", key, "': expected unique keys");
        }
      }
      return true;
    };
    const char* first = reinterpret_cast<const char*>(text);
    root = nlohmann::json::parse(first, first + size, reject_duplicates);
  } catch (const nlohmann::json::exception& e) {
    fail(prefix, what, " is not valid JSON: expected a JSON object, got error: ", e.what());
  }
  if (!root.is_object()) {
    fail(prefix, what, ": expected a JSON object, got ", describe_json(root));
  }
  return root;
}

}  // namespace detail
}  // namespace moh
