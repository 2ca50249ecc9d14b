// libFuzzer target for moh::SafeTensors, the library's widest door for outside input.
//
// Each input is handed to SafeTensors::from_bytes. When it parses, every accessor runs on every
// tensor: values<T> for every element type, values(name, shape), matrix / vector / tensor3 / mask
// (with the tensor's own shape when the rank fits, and once with a wrong one), raw bytes and the
// metadata. A moh::Error is the reader doing its job and is caught; anything else (a crash, any
// other exception, an AddressSanitizer or UndefinedBehaviorSanitizer report, a broken invariant
// checked below) ends the run as a finding.
//
// Build: fuzz/run.sh SECONDS, or configure with clang and -DMOH_BUILD_FUZZ=ON.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "moh/io/safetensors.hpp"

namespace {

/// Aborts (a finding) with a message when an invariant of a parsed file does not hold.
void check(bool ok, const char* what, const std::string& name = std::string()) {
  if (ok) return;
  std::fprintf(stderr, "safetensors_fuzz: invariant broken: %s (tensor '%s')\n", what,
               name.c_str());
  std::abort();
}

/// Runs `f`; a moh::Error is an accepted outcome, anything else propagates.
template <class F>
bool attempt(F&& f) {
  try {
    f();
    return true;
  } catch (const moh::Error&) {
    return false;
  }
}

template <class T>
void exercise_values(const moh::SafeTensors& st, const moh::TensorInfo& t) {
  std::vector<T> v;
  if (attempt([&] { v = st.values<T>(t.name); })) {
    check(v.size() == static_cast<std::size_t>(t.numel()), "values<T>().size() != numel", t.name);
  }
  attempt([&] { st.values<T>(t.name, t.shape); });
  std::vector<std::int64_t> other = t.shape;
  other.push_back(1);
  check(!attempt([&] { st.values<T>(t.name, other); }), "values() accepted a wrong shape",
        t.name);
}

/// True when every dim of `t` fits moh::Index (then matrix/vector/tensor3/mask may accept it).
bool dims_fit_index(const moh::TensorInfo& t) {
  for (std::int64_t d : t.shape) {
    if (d < 0 || static_cast<std::uint64_t>(d) >
                     static_cast<std::uint64_t>(std::numeric_limits<moh::Index>::max())) {
      return false;
    }
  }
  return true;
}

void exercise_tensor(const moh::SafeTensors& st, const std::string& name) {
  check(st.contains(name), "names() lists a tensor that contains() denies", name);
  const moh::TensorInfo& t = st.info(name);
  check(t.name == name, "info(name).name != name", name);
  check(t.begin <= t.end, "begin > end", name);
  check(t.nbytes() == static_cast<std::size_t>(t.numel()) * moh::dtype_size(t.dtype),
        "nbytes != numel * dtype size", name);

  // Touch every byte the reader says belongs to the tensor (AddressSanitizer checks the bounds).
  const std::uint8_t* raw = st.raw(name);
  unsigned sum = 0;
  for (std::size_t i = 0; i < t.nbytes(); ++i) sum += raw[i];
  if (sum == 0xFFFFFFFFu) std::fputc(' ', stderr);  // keep the loop

  exercise_values<float>(st, t);
  exercise_values<double>(st, t);
  exercise_values<std::int64_t>(st, t);
  exercise_values<bool>(st, t);
  exercise_values<std::int32_t>(st, t);
  exercise_values<std::int16_t>(st, t);
  exercise_values<std::int8_t>(st, t);
  exercise_values<std::uint64_t>(st, t);
  exercise_values<std::uint32_t>(st, t);
  exercise_values<std::uint8_t>(st, t);

  // Cross-checks between conversions: an exact integer or bool result agrees with the double one.
  std::vector<double> as_double;
  if (attempt([&] { as_double = st.values<double>(name); })) {
    std::vector<bool> as_bool;
    if (attempt([&] { as_bool = st.values<bool>(name); })) {
      for (std::size_t i = 0; i < as_bool.size(); ++i) {
        check(as_double[i] == (as_bool[i] ? 1.0 : 0.0),
              "values<bool> disagrees with values<double>", name);
      }
    }
    std::vector<std::int64_t> as_int;
    if (attempt([&] { as_int = st.values<std::int64_t>(name); })) {
      for (std::size_t i = 0; i < as_int.size(); ++i) {
        if (as_int[i] > -(std::int64_t(1) << 53) && as_int[i] < (std::int64_t(1) << 53)) {
          check(as_double[i] == static_cast<double>(as_int[i]),
                "values<int64_t> disagrees with values<double>", name);
        }
      }
    }
  }

  const std::size_t rank = t.shape.size();
  const bool fits = dims_fit_index(t);
  if (rank == 1 && fits) {
    const moh::Index n = static_cast<moh::Index>(t.shape[0]);
    attempt([&] { st.vector<float>(name, n); });
    attempt([&] { st.vector<double>(name, n); });
    check(!attempt([&] { st.vector<float>(name, n == 0 ? 1 : 0); }),
          "vector() accepted a wrong size", name);
  } else {
    check(!attempt([&] { st.vector<float>(name, 1); }), "vector() accepted a wrong rank", name);
  }
  if (rank == 2 && fits) {
    const moh::Index r = static_cast<moh::Index>(t.shape[0]);
    const moh::Index c = static_cast<moh::Index>(t.shape[1]);
    attempt([&] { st.matrix<float>(name, r, c); });
    attempt([&] { st.matrix<double>(name, r, c); });
    attempt([&] { st.mask(name); });
    check(!attempt([&] { st.matrix<float>(name, r == 0 ? 1 : 0, c); }),
          "matrix() accepted a wrong shape", name);
  } else {
    check(!attempt([&] { st.matrix<float>(name, 1, 1); }), "matrix() accepted a wrong rank",
          name);
    check(!attempt([&] { st.mask(name); }), "mask() accepted a wrong rank", name);
  }
  if (rank == 3) {
    attempt([&] { st.tensor3<float>(name); });
    attempt([&] { st.tensor3<double>(name); });
  } else {
    check(!attempt([&] { st.tensor3<float>(name); }), "tensor3() accepted a wrong rank", name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::optional<moh::SafeTensors> parsed;
  if (!attempt([&] {
        parsed = moh::SafeTensors::from_bytes(std::vector<std::uint8_t>(data, data + size),
                                              "fuzz-input");
      })) {
    return 0;
  }
  // Copies share the bytes: use a copy after the original is gone.
  const moh::SafeTensors st = *parsed;
  parsed.reset();

  for (const auto& entry : st.metadata()) {
    check(st.has_metadata(entry.first), "metadata() lists a key has_metadata() denies",
          entry.first);
    check(st.metadata_value(entry.first) == entry.second, "metadata_value() disagrees",
          entry.first);
  }
  if (!st.has_metadata("")) {
    check(!attempt([&] { st.metadata_value(""); }), "metadata_value() of a missing key");
  }

  const std::vector<std::string> names = st.names();
  for (std::size_t i = 1; i < names.size(); ++i) {
    check(names[i - 1] < names[i], "names() not sorted and unique", names[i]);
  }
  for (const std::string& name : names) exercise_tensor(st, name);

  const std::string missing = "__metadata__";  // never a tensor name
  check(!st.contains(missing), "a tensor named __metadata__", missing);
  check(!attempt([&] { st.info(missing); }), "info() of a missing tensor", missing);
  check(!attempt([&] { st.values<float>(missing); }), "values() of a missing tensor", missing);
  return 0;
}
