// moh_parity FILE...: runs golden cases (format moh-case/1) and prints one line per file,
// PASS or FAIL with the largest error, or FAIL with the reason a file cannot be run (the
// moh::Error message: unreadable, not a safetensors file, not a case, ...). Exits 0 when every
// case passes, 1 if any fails or cannot be run, or on bad arguments; it never crashes on input.
#include <cstdio>
#include <exception>
#include <string>

#include "moh/io.hpp"
#include "moh/io/golden_case.hpp"

namespace {

void usage(std::FILE* to) {
  std::fprintf(to, "usage: moh_parity FILE.safetensors...\n"
                   "Runs each golden case (format moh-case/1) and prints PASS or FAIL per file.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "moh_parity: expected at least one FILE.safetensors, got none\n");
    usage(stderr);
    return 1;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage(stdout);
      return 0;
    }
    if (arg.size() > 1 && arg[0] == '-') {
      std::fprintf(stderr, "moh_parity: unknown option '%s': expected FILE.safetensors paths\n",
                   arg.c_str());
      usage(stderr);
      return 1;
    }
  }
  int failed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string path = argv[i];
    try {
      const moh::SafeTensors st = moh::SafeTensors::open(path);
      if (!st.has_metadata("format")) {
        throw moh::Error(moh::detail::concat(
            "moh: ", path, " is not a golden case: expected __metadata__ with format ",
            "moh-case/1, got ",
            st.metadata().empty() ? "no __metadata__" : "__metadata__ without 'format'"));
      }
      const moh::CaseResult r = moh::run_case<float>(st);
      std::string detail;
      for (const moh::CaseCheck& c : r.checks) {
        char buf[160];
        std::snprintf(buf, sizeof buf, " %s=%.3g/%.3g%s", c.name.c_str(), c.max_error,
                      c.tolerance, c.zeros_exact ? "" : "(nonzero where 0 expected)");
        detail += buf;
      }
      std::printf("%s %s [%s]%s\n", r.passed() ? "PASS" : "FAIL", path.c_str(), r.layer.c_str(),
                  detail.c_str());
      failed += r.passed() ? 0 : 1;
    } catch (const std::exception& e) {  // moh::Error for bad input; bad_alloc and the like too
      std::printf("FAIL %s: %s\n", path.c_str(), e.what());
      ++failed;
    } catch (...) {
      std::printf("FAIL %s: unknown exception\n", path.c_str());
      ++failed;
    }
  }
  std::printf("%d passed, %d failed\n", argc - 1 - failed, failed);
  return failed ? 1 : 0;
}
