// Opens a kernel header's use of MOH_DETAIL_UNROLL_REGISTERS; detail/unroll_end.hpp closes it,
// so that the macro never reaches code that includes moh. No include guard: each kernel header
// includes the pair around its own code, after its own includes.
//
// Put the macro before each loop over the register arrays of a kernel (their initialisation, use
// and store): GCC 12 unrolls such loops only after it has placed the arrays in memory, and then
// stored the bfloat16 weighted-value panel's 16 accumulators (attention_kernel.hpp) to the stack
// on every key. Unrolled from the start, the arrays become registers. Other compilers need no
// hint.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8
#define MOH_DETAIL_UNROLL_REGISTERS _Pragma("GCC unroll 16")
#else
#define MOH_DETAIL_UNROLL_REGISTERS
#endif
