// moh::Error: the one exception type the library throws for bad input.
//
// Every message names what was expected and what was given, e.g.
//   "moh: MoHAttention: active_routed_heads must be <= routed heads: expected <= 6, got 7".
// Define MOH_THROW before including any moh header to route errors elsewhere (it receives a
// moh::Error and must not return).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace moh {

/// Thrown on bad input: wrong shapes, impossible settings, malformed files.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace moh

#ifndef MOH_THROW
#define MOH_THROW(error) throw(error)
#endif

namespace moh {
namespace detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

/// Formats a shape as "[2, 5, 16]".
template <class Int>
std::string shape_string(const std::vector<Int>& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

/// Throws moh::Error("moh: <message>").
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  MOH_THROW(::moh::Error(concat("moh: ", parts...)));
}

/// Throws unless `ok`; the message parts are only formatted on failure.
template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

/// Throws "moh: <what>: expected E, got A" unless expected == actual.
template <class E, class A>
void require_equal(const std::string& what, const E& expected, const A& actual) {
  if (!(expected == actual)) fail(what, ": expected ", expected, ", got ", actual);
}

}  // namespace detail
}  // namespace moh
