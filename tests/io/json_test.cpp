// Tests for moh/io/json.hpp: the strict checks every untrusted JSON text goes through (safetensors
// headers, sharded-checkpoint indexes): strict UTF-8, a nesting bound checked without recursion,
// valid JSON, no repeated key in any object, an object at the top; and the helpers that describe
// values and read counts for messages. The reader's and the index's own wording of these errors
// is tested in safetensors_test.cpp and sharded_safetensors_test.cpp.
#include "moh/io/json.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "test_helpers.hpp"

namespace {

using moh_test::error_of;
using moh_test::Mentions;

const std::string kPrefix = "safetensors file test.st: ";

/// parse_json_strictly on `text` as a safetensors header of file "test.st".
nlohmann::json parse(const std::string& text) {
  return moh::detail::parse_json_strictly(reinterpret_cast<const std::uint8_t*>(text.data()),
                                          text.size(), kPrefix, "header");
}

std::string parse_error(const std::string& text) {
  return error_of([&] { parse(text); });
}

std::size_t utf8_error(const std::string& text) {
  return moh::detail::utf8_error_offset(reinterpret_cast<const std::uint8_t*>(text.data()),
                                        text.size());
}

bool nests_deeper(const std::string& text, int depth) {
  return moh::detail::json_nesting_exceeds(reinterpret_cast<const std::uint8_t*>(text.data()),
                                           text.size(), depth);
}

TEST(Json, Limits) {
  EXPECT_EQ(moh::detail::kMaxSafetensorsHeader, 100000000u);
  EXPECT_EQ(moh::detail::kMaxJsonDepth, 64);
}

// ---- UTF-8 ----------------------------------------------------------------------------------------

TEST(Json, Utf8ErrorOffsetAcceptsExactlyStrictUtf8) {
  const std::vector<std::string> valid = {
      "",
      "plain ascii \x7F",
      "\xC2\x80",                                  // U+0080, the first two-byte character
      "\xDF\xBF",                                  // U+07FF
      "\xE0\xA0\x80",                              // U+0800, the first three-byte character
      "\xED\x9F\xBF",                              // U+D7FF, just below the surrogates
      "\xEE\x80\x80",                              // U+E000, just above them
      "\xEF\xBF\xBF",                              // U+FFFF
      "\xF0\x90\x80\x80",                          // U+10000, the first four-byte character
      "\xF4\x8F\xBF\xBF",                          // U+10FFFF, the last character
      "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"};  // mixed
  for (const std::string& s : valid) EXPECT_EQ(utf8_error(s), s.size()) << s;

  struct Bad {
    std::string text;
    std::size_t offset;  // where the offending sequence starts
  };
  const std::vector<Bad> invalid = {
      {"\xFF", 0},                  // never valid
      {"\xF5\x80\x80\x80", 0},      // lead byte beyond U+10FFFF
      {"ab\xC0\x80", 2},            // overlong NUL
      {"\xC1\xBF", 0},              // overlong
      {"\xE0\x9F\xBF", 0},          // overlong three-byte form
      {"\xF0\x8F\xBF\xBF", 0},      // overlong four-byte form
      {"x\xED\xA0\x80", 1},         // UTF-16 surrogate
      {"\xED\xBF\xBF", 0},          // the last surrogate
      {"\xF4\x90\x80\x80", 0},      // above U+10FFFF
      {"abc\xE2\x82", 3},           // truncated at the end
      {"\xF0\x9F\x98", 0},          // truncated four-byte sequence
      {"\x80", 0},                  // stray continuation byte
      {"a\xE2\x82\x41", 1},         // third byte not a continuation
      {"\xC3\xA9\xC3", 2},          // valid, then a truncated sequence
      {"\xC3(", 0},                 // second byte not a continuation
  };
  for (const Bad& b : invalid) EXPECT_EQ(utf8_error(b.text), b.offset) << b.text;
}

// Moved from safetensors_test.cpp (SafeTensorsMalformed.InvalidUtf8): the same inputs and message
// parts, now against parse_json_strictly itself.
TEST(Json, InvalidUtf8) {
  const std::vector<std::string> bad = {
      "\xFF",          // never valid
      "\xC0\x80",      // overlong NUL
      "\xED\xA0\x80",  // UTF-16 surrogate
      "\xE2\x82",      // truncated sequence
      "\xF4\x90\x80\x80",  // above U+10FFFF
      "\x80"};         // stray continuation byte
  for (const std::string& b : bad) {
    const std::string header = "{\"__metadata__\":{\"k\":\"" + b + "\"}}";
    EXPECT_TRUE(Mentions(parse_error(header), {"UTF-8", "header offset 22"}));
  }
  EXPECT_TRUE(Mentions(parse_error("{\"k\":\"\xFF\"}"),
                       {"moh: safetensors file test.st: header is not valid UTF-8",
                        "expected UTF-8 text, got byte 0xff at header offset 6"}));
  // Valid multi-byte text is accepted.
  const nlohmann::json root =
      parse("{\"__metadata__\":{\"k\":\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"}}");
  EXPECT_EQ(root["__metadata__"]["k"].get<std::string>(), "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
}

// ---- nesting ----------------------------------------------------------------------------------------

TEST(Json, NestingBoundIsExact) {
  const std::string deep64 = std::string(64, '[') + std::string(64, ']');
  const std::string deep65 = std::string(65, '[') + std::string(65, ']');
  EXPECT_FALSE(nests_deeper(deep64, 64));
  EXPECT_TRUE(nests_deeper(deep65, 64));
  EXPECT_FALSE(nests_deeper("{\"a\":[{\"b\":[]}]}", 4));
  EXPECT_TRUE(nests_deeper("{\"a\":[{\"b\":[]}]}", 3));
  EXPECT_FALSE(nests_deeper("[][][][][]", 1));  // siblings do not add up
  // Closers without openers do not go below zero (the parser reports the mismatch).
  EXPECT_FALSE(nests_deeper("]]]][", 1));
  EXPECT_TRUE(nests_deeper("]]]][[", 1));
  // Brackets in strings do not count, even after escaped quotes; an escaped backslash ends the
  // escape, so the brackets after "\\\\" count again.
  EXPECT_FALSE(nests_deeper("[\"[[[[\\\"[[[[\"]", 1));
  EXPECT_TRUE(nests_deeper("[\"\\\\\"[[]]]", 1));
  EXPECT_FALSE(nests_deeper("", 0));
  EXPECT_TRUE(nests_deeper("{", 0));
}

// Moved from safetensors_test.cpp (SafeTensorsMalformed.DeepNestingIsRejectedWithoutRecursion).
TEST(Json, DeepNestingIsRejectedWithoutRecursion) {
  EXPECT_TRUE(Mentions(parse_error(std::string(10000, '[') + std::string(10000, ']')),
                       {"nests too deeply", "64"}));
  std::string objects;
  for (int i = 0; i < 10000; ++i) objects += "{\"a\":";
  EXPECT_TRUE(Mentions(parse_error(objects), {"nests too deeply"}));
  EXPECT_TRUE(Mentions(parse_error(std::string(1000000, '[')),
                       {"safetensors file test.st: header JSON nests too deeply",
                        "expected depth <= 64"}));
  // Brackets inside strings, even after escaped quotes, do not count as nesting.
  const std::string key = "\\\"" + std::string(200, '[');
  const nlohmann::json root = parse("{\"__metadata__\":{\"" + key + "\":\"{{{{\"}}");
  EXPECT_TRUE(root["__metadata__"].contains("\"" + std::string(200, '[')));
}

// ---- JSON, keys, the top level --------------------------------------------------------------------

// Moved from safetensors_test.cpp (SafeTensorsMalformed.InvalidJson).
TEST(Json, InvalidJson) {
  for (const std::string& header : {std::string(""), std::string("{"), std::string("{\"a\":}"),
                                    std::string("{} trailing"), std::string("{'a': 1}"),
                                    std::string("{\"a\":\"\x01\"}")}) {
    EXPECT_TRUE(Mentions(parse_error(header), {"not valid JSON"})) << header;
  }
  EXPECT_TRUE(Mentions(parse_error("{"), {"moh: safetensors file test.st: header is not valid JSON",
                                          "expected a JSON object, got error"}));
}

// Moved from safetensors_test.cpp (SafeTensorsMalformed.TopLevelNotAnObject).
TEST(Json, TopLevelNotAnObject) {
  EXPECT_TRUE(Mentions(parse_error("[]"), {"expected a JSON object", "got array"}));
  EXPECT_TRUE(Mentions(parse_error("42"), {"expected a JSON object", "got number"}));
  EXPECT_TRUE(Mentions(parse_error("\"x\""), {"expected a JSON object", "got string"}));
  EXPECT_TRUE(Mentions(parse_error("null"), {"expected a JSON object", "got null"}));
  EXPECT_TRUE(Mentions(parse_error("[1,2]"),
                       {"safetensors file test.st: header: expected a JSON object, got array [1,2]"}));
}

// Moved from safetensors_test.cpp (SafeTensorsMalformed.DuplicateKeys), with nested objects.
TEST(Json, DuplicateKeys) {
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_TRUE(Mentions(parse_error(header), {"repeats the key 'a'"}));
  EXPECT_TRUE(Mentions(parse_error(R"({"a":{"b":1,"c":2,"b":3}})"),
                       {"safetensors file test.st: header repeats the key 'b'", "expected unique keys"}));
  EXPECT_TRUE(Mentions(parse_error(R"({"x":[{"k":1},{"k":2,"k":3}]})"), {"repeats the key 'k'"}));
  // The same key in different objects, or after a nested object closed, is fine.
  EXPECT_NO_THROW(parse(R"({"a":{"k":1},"b":{"k":2},"k":{"a":{"b":{}}}})"));
  EXPECT_NO_THROW(parse(R"({"x":[{"k":1},{"k":2}],"y":{"x":[]}})"));
  const nlohmann::json root = parse(R"({"a":{"k":1},"k":2})");
  EXPECT_EQ(root["k"].get<int>(), 2);
  EXPECT_EQ(root["a"]["k"].get<int>(), 1);
}

TEST(Json, MessagesUseThePrefixAndTheRoleOfTheText) {
  const std::string text = R"({"t":1,"t":2})";
  const std::string msg = error_of([&] {
    moh::detail::parse_json_strictly(reinterpret_cast<const std::uint8_t*>(text.data()), text.size(),
                                     "safetensors index i.json: ", "index");
  });
  EXPECT_TRUE(Mentions(msg, {"moh: safetensors index i.json: index repeats the key 't'"}));
}

// ---- describing values and reading counts ---------------------------------------------------------

TEST(Json, DescribeJson) {
  using moh::detail::describe_json;
  EXPECT_EQ(describe_json(nlohmann::json(-3)), "number -3");
  EXPECT_EQ(describe_json(nlohmann::json::parse("[1,2]")), "array [1,2]");
  EXPECT_EQ(describe_json(nlohmann::json("x")), "string \"x\"");
  EXPECT_EQ(describe_json(nlohmann::json(nullptr)), "null null");
  EXPECT_EQ(describe_json(nlohmann::json(true)), "boolean true");
  EXPECT_EQ(describe_json(nlohmann::json::parse(R"({"a":1})")), "object {\"a\":1}");
  // Long values are cut to 57 characters and "...".
  const std::string long_text = describe_json(nlohmann::json(std::string(100, 'z')));
  EXPECT_EQ(long_text, "string \"" + std::string(56, 'z') + "...");
  // Invalid UTF-8 inside a value is replaced, never thrown.
  EXPECT_NO_THROW(describe_json(nlohmann::json(std::string("\xFF"))));
}

TEST(Json, JsonToCount) {
  using moh::detail::json_to_count;
  std::uint64_t out = 99;
  EXPECT_TRUE(json_to_count(nlohmann::json(5), 10, out));
  EXPECT_EQ(out, 5u);
  EXPECT_TRUE(json_to_count(nlohmann::json(0), 0, out));
  EXPECT_EQ(out, 0u);
  EXPECT_TRUE(json_to_count(nlohmann::json(10), 10, out));
  EXPECT_FALSE(json_to_count(nlohmann::json(11), 10, out));
  EXPECT_FALSE(json_to_count(nlohmann::json(-1), 10, out));
  EXPECT_FALSE(json_to_count(nlohmann::json(2.0), 10, out));
  EXPECT_FALSE(json_to_count(nlohmann::json(1e30), ~std::uint64_t(0), out));
  EXPECT_FALSE(json_to_count(nlohmann::json("3"), 10, out));
  EXPECT_FALSE(json_to_count(nlohmann::json(true), 10, out));
  EXPECT_FALSE(json_to_count(nlohmann::json(nullptr), 10, out));
  const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  EXPECT_TRUE(json_to_count(nlohmann::json::parse("18446744073709551615"), max, out));
  EXPECT_EQ(out, max);
  const std::uint64_t limit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  EXPECT_FALSE(json_to_count(nlohmann::json::parse("9223372036854775808"), limit, out));
  EXPECT_TRUE(json_to_count(nlohmann::json::parse("9223372036854775807"), limit, out));
  EXPECT_EQ(out, limit);
}

}  // namespace
