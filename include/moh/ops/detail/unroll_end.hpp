// Closes what detail/unroll_begin.hpp opened (no include guard: included once per kernel header).
#undef MOH_DETAIL_UNROLL_REGISTERS
#undef MOH_DETAIL_INLINE_LAMBDA
#undef MOH_DETAIL_IN_REGISTER
