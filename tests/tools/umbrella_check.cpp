// Compiled (not run) by the umbrella_headers_stay_plain_* tests: <moh/moh.hpp> brings the layers,
// ops and runtime without nlohmann-json, POSIX file headers or the kernels' private macros, and
// <moh/io.hpp> brings checkpoints without the golden-case runner.
#include "moh/moh.hpp"

#if defined(NLOHMANN_JSON_VERSION_MAJOR) || defined(INCLUDE_NLOHMANN_JSON_HPP_)
#error "<moh/moh.hpp> includes nlohmann-json"
#endif
// The POSIX headers the checkpoint reader opens and maps files with (io/mapped_file.hpp). Not
// <unistd.h>: libstdc++'s own <thread> brings that one in C++20. Not <sys/mman.h>: the compute
// headers ask for huge pages with madvise (runtime/large_buffer.hpp), on Linux only.
#if defined(_FCNTL_H) || defined(_SYS_STAT_H)
#error "<moh/moh.hpp> includes POSIX file headers"
#endif

// The kernels' hints (ops/detail/unroll_begin.hpp) stay inside their headers.
#ifdef MOH_DETAIL_UNROLL_REGISTERS
#error "<moh/moh.hpp> leaves MOH_DETAIL_UNROLL_REGISTERS defined"
#endif
#ifdef MOH_DETAIL_INLINE_LAMBDA
#error "<moh/moh.hpp> leaves MOH_DETAIL_INLINE_LAMBDA defined"
#endif
#ifdef MOH_DETAIL_IN_REGISTER
#error "<moh/moh.hpp> leaves MOH_DETAIL_IN_REGISTER defined"
#endif

#include "moh/io.hpp"

namespace moh {
// Were the golden-case runner included, these names would already be declared and clash.
int CaseResult = 0;
int run_case = 0;
}  // namespace moh

int main() { return moh::CaseResult + moh::run_case; }
