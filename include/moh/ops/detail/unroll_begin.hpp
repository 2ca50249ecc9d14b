// Opens a kernel header's use of MOH_DETAIL_UNROLL_REGISTERS, MOH_DETAIL_INLINE_LAMBDA and
// MOH_DETAIL_IN_REGISTER; detail/unroll_end.hpp closes it, so that the macros never reach code
// that includes moh. No include guard: each kernel header includes the pair around its own code,
// after its own includes.
//
// Put MOH_DETAIL_UNROLL_REGISTERS before each loop over the register arrays of a kernel (their
// initialisation, use and store): GCC 12 unrolls such loops only after it has placed the arrays in
// memory, and then stored the bfloat16 weighted-value panel's 16 accumulators
// (attention_kernel.hpp) to the stack on every key. Unrolled from the start, the arrays become
// registers. Other compilers need no hint.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8
#define MOH_DETAIL_UNROLL_REGISTERS _Pragma("GCC unroll 16")
#else
#define MOH_DETAIL_UNROLL_REGISTERS
#endif
// Put MOH_DETAIL_INLINE_LAMBDA after the parameters of a kernel's step handed to a helper as a
// lambda (for_parts() in rows_product.hpp), so that the step is compiled into the helper's loop
// as a plain loop's body would be: GCC 12 otherwise compiles a step (6 parts of bfloat16 rows) as
// a function of its own and keeps most of its accumulators on the stack there. Clang takes the
// same attribute; other compilers get nothing.
#if defined(__GNUC__)
#define MOH_DETAIL_INLINE_LAMBDA __attribute__((always_inline))
#else
#define MOH_DETAIL_INLINE_LAMBDA
#endif
// MOH_DETAIL_IN_REGISTER(x) tells GCC and Clang that x, a loaded packet, is in a vector register
// and may have changed there (an empty asm statement), so that each multiply-add that uses it
// reads that register rather than the packet's memory again: GCC folds a load into every
// multiply-add it feeds (rows_product_long() in rows_product.hpp). x86 with SSE2 only; elsewhere
// nothing.
#if defined(__GNUC__) && defined(__SSE2__)
#define MOH_DETAIL_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define MOH_DETAIL_IN_REGISTER(x) ((void)0)
#endif
