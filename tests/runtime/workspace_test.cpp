// Tests for moh/runtime/workspace.hpp: detail::Arena (64-byte aligned bump allocation, scopes that
// rewind, spilling into further blocks and merging them into one block of the high-water size, so
// that the same allocation pattern again allocates no new block, release()), and moh::Workspace
// (bytes(), release(), one call at a time: releasing or leasing a busy workspace is an error).
#include "moh/runtime/workspace.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::detail::Arena;
using moh_test::error_of;
using moh_test::Mentions;

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % Arena::kAlign == 0; }

/// Distance in bytes from a to b.
std::ptrdiff_t bytes_between(const void* a, const void* b) {
  return static_cast<const char*>(b) - static_cast<const char*>(a);
}

// ---- detail::Arena --------------------------------------------------------------------------------

TEST(Arena, EmptyUntilUsed) {
  Arena arena;
  EXPECT_EQ(Arena::kAlign, 64u);
  EXPECT_EQ(arena.bytes(), 0u);
  EXPECT_EQ(arena.in_use(), 0u);
}

TEST(Arena, AllocationsAre64ByteAligned) {
  Arena arena;
  const Arena::Scope scope(arena);
  std::vector<const void*> got;
  got.push_back(arena.allocate<char>(1));
  got.push_back(arena.allocate<double>(3));
  got.push_back(arena.allocate<float>(17));
  got.push_back(arena.allocate<std::int16_t>(0));
  got.push_back(arena.allocate<char>(65));
  got.push_back(arena.matrix<double>(3, 5).data());
  got.push_back(arena.allocate<char>(200000));  // a block of its own
  got.push_back(arena.allocate<float>(1));
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(aligned(got[i])) << i;
  // Sizes are rounded up to whole 64-byte units, so neighbours never share a cache line.
  EXPECT_EQ(bytes_between(got[0], got[1]), 64);
  EXPECT_EQ(bytes_between(got[1], got[2]), 64);
  EXPECT_EQ(bytes_between(got[2], got[3]), 128);  // 68 bytes
  EXPECT_EQ(bytes_between(got[3], got[4]), 0);    // nothing taken for 0 elements
  EXPECT_EQ(bytes_between(got[4], got[5]), 128);  // 65 bytes
}

TEST(Arena, MemoryIsWritableAndMatrixHasItsShape) {
  Arena arena;
  const Arena::Scope scope(arena);
  moh::MatrixMap<float> m = arena.matrix<float>(4, 7);
  EXPECT_EQ(m.rows(), 4);
  EXPECT_EQ(m.cols(), 7);
  m.setConstant(2.5f);
  double* d = arena.allocate<double>(100);
  for (int i = 0; i < 100; ++i) d[i] = i;
  EXPECT_EQ(m.sum(), 2.5f * 28);  // untouched by the later allocation
  EXPECT_EQ(d[99], 99.0);
  EXPECT_EQ(m.data() + 28 <= reinterpret_cast<float*>(d), true);
}

TEST(Arena, NegativeCountIsAnError) {
  Arena arena;
  EXPECT_TRUE(Mentions(error_of([&] { arena.allocate<float>(-1); }),
                       {"Arena: count must be >= 0", "got -1"}));
  EXPECT_EQ(arena.in_use(), 0u);
}

TEST(Arena, ScopesRewind) {
  Arena arena;
  const Arena::Scope outer(arena);
  char* a = arena.allocate<char>(100);  // 128 bytes
  EXPECT_EQ(arena.in_use(), 128u);
  const std::size_t held = arena.bytes();
  EXPECT_GE(held, 128u);
  char* inner_first = nullptr;
  {
    const Arena::Scope inner(arena);
    inner_first = arena.allocate<char>(1000);
    EXPECT_EQ(bytes_between(a, inner_first), 128);
    EXPECT_EQ(arena.in_use(), 128u + 1024u);
    {
      const Arena::Scope innermost(arena);
      arena.allocate<char>(64);
      EXPECT_EQ(arena.in_use(), 128u + 1024u + 64u);
    }
    EXPECT_EQ(arena.in_use(), 128u + 1024u);
  }
  // Back to where the inner scope began: the same memory is handed out again.
  EXPECT_EQ(arena.in_use(), 128u);
  EXPECT_EQ(arena.allocate<char>(1000), inner_first);
  EXPECT_EQ(arena.bytes(), held);  // rewinding frees nothing
}

TEST(Arena, SpillsIntoMoreBlocksAndMergesThemIntoOneOfTheHighWaterSize) {
  Arena arena;
  std::size_t spilled_bytes = 0, requested = 0;
  const void *first = nullptr, *second = nullptr;
  {
    const Arena::Scope call(arena);  // a call on an empty arena
    first = arena.allocate<char>(60000);    // 60032 bytes: the first block
    const std::size_t one_block = arena.bytes();
    EXPECT_GE(one_block, 60032u);
    second = arena.allocate<char>(one_block - 60032 + 64);  // does not fit in what is left
    requested = 60032 + (one_block - 60032 + 64);
    spilled_bytes = arena.bytes();
    EXPECT_GT(spilled_bytes, one_block);  // a second block
    EXPECT_NE(bytes_between(first, second), 60032);
    EXPECT_TRUE(aligned(second));
    EXPECT_GE(arena.in_use(), requested);
  }
  // Rewound to empty: one block of the most the call had in use (at least what it asked for).
  const std::size_t merged = arena.bytes();
  EXPECT_LT(merged, spilled_bytes);
  EXPECT_GE(merged, requested);
  EXPECT_EQ(merged % Arena::kAlign, 0u);
  EXPECT_EQ(arena.in_use(), 0u);
  // The same pattern again fits that block: no new block, the allocations back to back.
  for (int repeat = 0; repeat < 3; ++repeat) {
    const Arena::Scope call(arena);
    const char* a = arena.allocate<char>(60000);
    const char* b = arena.allocate<char>(static_cast<Index>(requested - 60032));
    EXPECT_EQ(bytes_between(a, b), 60032) << repeat;
    EXPECT_EQ(arena.bytes(), merged) << repeat;
  }
  EXPECT_EQ(arena.bytes(), merged);
  // Less than that also allocates nothing.
  {
    const Arena::Scope call(arena);
    arena.allocate<double>(1000);
    arena.allocate<float>(5000);
    EXPECT_EQ(arena.bytes(), merged);
  }
  EXPECT_EQ(arena.bytes(), merged);
}

TEST(Arena, RewindingInsideACallReusesTheSpilledBlocks) {
  Arena arena;
  const Arena::Scope call(arena);
  arena.allocate<char>(1000);
  std::size_t after_first_spill = 0;
  for (int round = 0; round < 3; ++round) {
    const Arena::Scope step(arena);
    arena.allocate<char>(50000);
    arena.allocate<char>(50000);  // spills on the first round
    arena.allocate<char>(100000);
    if (round == 0) after_first_spill = arena.bytes();
    EXPECT_EQ(arena.bytes(), after_first_spill) << round;  // later rounds reuse those blocks
  }
  EXPECT_GT(after_first_spill, 0u);
}

TEST(Arena, ReleaseFreesEverything) {
  Arena arena;
  {
    const Arena::Scope call(arena);
    arena.allocate<double>(100000);
    arena.allocate<double>(100000);
  }
  EXPECT_GT(arena.bytes(), 0u);
  arena.release();
  EXPECT_EQ(arena.bytes(), 0u);
  EXPECT_EQ(arena.in_use(), 0u);
  // Usable again afterwards, from scratch.
  {
    const Arena::Scope call(arena);
    float* p = arena.allocate<float>(10);
    EXPECT_TRUE(aligned(p));
    p[9] = 1.0f;
    EXPECT_GT(arena.bytes(), 0u);
  }
  // After a release the high-water mark starts again: a small call merges into a small block.
  arena.release();
  {
    const Arena::Scope call(arena);
    arena.allocate<char>(40000);
    arena.allocate<char>(40000);  // spills
  }
  EXPECT_LT(arena.bytes(), 2 * 80000u + 65536u);
  EXPECT_GE(arena.bytes(), 80000u);
}

TEST(Arena, MovesKeepTheBlocks) {
  Arena a;
  {
    const Arena::Scope call(a);
    a.allocate<char>(1000);
  }
  const std::size_t held = a.bytes();
  Arena b(std::move(a));
  EXPECT_EQ(b.bytes(), held);
  Arena c;
  c = std::move(b);
  EXPECT_EQ(c.bytes(), held);
}

// ---- Workspace --------------------------------------------------------------------------------------

TEST(Workspace, BytesCountTheCallArenaAndEveryThreadArena) {
  moh::Workspace ws;
  EXPECT_EQ(ws.bytes(), 0u);
  moh::detail::WorkspaceAccess::prepare(ws, 3);
  EXPECT_EQ(ws.bytes(), 0u);  // arenas hold nothing until used
  {
    const Arena::Scope a(moh::detail::WorkspaceAccess::call(ws));
    moh::detail::WorkspaceAccess::call(ws).allocate<char>(100);
  }
  const std::size_t call_bytes = moh::detail::WorkspaceAccess::call(ws).bytes();
  EXPECT_GT(call_bytes, 0u);
  EXPECT_EQ(ws.bytes(), call_bytes);
  std::size_t total = call_bytes;
  for (int t = 0; t < 3; ++t) {
    {
      const Arena::Scope s(moh::detail::WorkspaceAccess::thread(ws, t));
      moh::detail::WorkspaceAccess::thread(ws, t).allocate<double>(1000 * (t + 1));
    }
    total += moh::detail::WorkspaceAccess::thread(ws, t).bytes();
    EXPECT_EQ(ws.bytes(), total) << t;
  }
  // prepare() only ever adds arenas and keeps the existing ones.
  Arena* first = &moh::detail::WorkspaceAccess::thread(ws, 0);
  moh::detail::WorkspaceAccess::prepare(ws, 2);
  EXPECT_EQ(&moh::detail::WorkspaceAccess::thread(ws, 0), first);
  EXPECT_EQ(ws.bytes(), total);
  moh::detail::WorkspaceAccess::prepare(ws, 5);
  EXPECT_EQ(&moh::detail::WorkspaceAccess::thread(ws, 0), first);
  EXPECT_EQ(moh::detail::WorkspaceAccess::thread(ws, 4).bytes(), 0u);
  EXPECT_EQ(ws.bytes(), total);
}

TEST(Workspace, ReleaseFreesAllScratch) {
  moh::Workspace ws;
  moh::detail::WorkspaceAccess::prepare(ws, 2);
  {
    const Arena::Scope a(moh::detail::WorkspaceAccess::call(ws));
    moh::detail::WorkspaceAccess::call(ws).allocate<float>(5000);
  }
  {
    const Arena::Scope s(moh::detail::WorkspaceAccess::thread(ws, 1));
    moh::detail::WorkspaceAccess::thread(ws, 1).allocate<float>(5000);
  }
  EXPECT_GT(ws.bytes(), 0u);
  ws.release();
  EXPECT_EQ(ws.bytes(), 0u);
  moh::detail::WorkspaceAccess::prepare(ws, 1);  // usable again
  {
    const Arena::Scope s(moh::detail::WorkspaceAccess::thread(ws, 0));
    EXPECT_NE(moh::detail::WorkspaceAccess::thread(ws, 0).allocate<float>(10), nullptr);
  }
  EXPECT_GT(ws.bytes(), 0u);
}

TEST(Workspace, ReleaseWhileACallUsesItIsAnError) {
  moh::Workspace ws;
  {
    const moh::detail::WorkspaceLease lease(&ws, nullptr, "Test");
    EXPECT_EQ(&lease.get(), &ws);
    {
      const Arena::Scope a(moh::detail::WorkspaceAccess::call(ws));
      moh::detail::WorkspaceAccess::call(ws).allocate<char>(10);
    }
    const std::size_t held = ws.bytes();
    EXPECT_TRUE(Mentions(error_of([&] { ws.release(); }),
                         {"Workspace::release", "in use by a forward call", "expected no call running"}));
    EXPECT_EQ(ws.bytes(), held);  // nothing freed
  }
  EXPECT_NO_THROW(ws.release());  // the call is over
  EXPECT_EQ(ws.bytes(), 0u);
}

TEST(Workspace, OneCallAtATime) {
  moh::Workspace ws;
  moh::ThreadPool pool(3);
  {
    const moh::detail::WorkspaceLease lease(&ws, &pool, "Test");
    // Arenas for every thread of the pool were prepared.
    EXPECT_NO_THROW(lease.exec().thread(2));
    EXPECT_EQ(lease.exec().pool, &pool);
    EXPECT_EQ(lease.exec().ws, &ws);
    EXPECT_TRUE(Mentions(error_of([&] { moh::detail::WorkspaceLease second(&ws, nullptr, "Other"); }),
                         {"Other: workspace is in use by another call", "got a busy one"}));
  }
  // Free again once the first call ended.
  EXPECT_NO_THROW(moh::detail::WorkspaceLease(&ws, nullptr, "Test"));
  EXPECT_NO_THROW(moh::detail::WorkspaceLease(&ws, nullptr, "Test"));
  // Without a workspace a call gets a temporary one of its own.
  const moh::detail::WorkspaceLease a(nullptr, nullptr, "Test"), b(nullptr, nullptr, "Test");
  EXPECT_NE(&a.get(), &b.get());
  EXPECT_NE(&a.get(), &ws);
  EXPECT_NO_THROW(a.exec().thread(0));
}

TEST(Workspace, WarmCallsOfOneShapeAllocateNothing) {
  const moh::MultiHeadAttention<float> layer(moh_test::mha_config(32, 4), 7);
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(2, 9, 32, 1);
  moh::Tensor3<float> y1(2, 9, 32), y2(2, 9, 32), y3(2, 9, 32);
  moh::Workspace ws;
  moh::ForwardOptions opts;
  opts.workspace = &ws;
  layer.forward(x, y1, opts);
  const std::size_t warm = ws.bytes();
  EXPECT_GT(warm, 0u);
  layer.forward(x, y2, opts);
  EXPECT_EQ(ws.bytes(), warm);
  EXPECT_TRUE(moh_test::BitEqual(y1, y2));
  // A smaller call of the same kernels fits too (more than kDotRows rows: the tiled products).
  const moh::Tensor3<float> smaller = moh_test::random_tensor<float>(1, 9, 32, 3);
  moh::Tensor3<float> y_smaller(1, 9, 32);
  layer.forward(smaller, y_smaller, opts);
  EXPECT_EQ(ws.bytes(), warm);
  // A call of at most kDotRows rows takes the decode kernels, whose scratch differs: with AVX2
  // or SSE tiles it can need more than this larger call, with AVX-512's less. It may grow the
  // workspace once, then its warm calls allocate nothing either.
  const moh::Tensor3<float> small = moh_test::random_tensor<float>(1, 3, 32, 2);
  moh::Tensor3<float> y_small(1, 3, 32);
  layer.forward(small, y_small, opts);
  const std::size_t warm_small = ws.bytes();
  EXPECT_GE(warm_small, warm);
  layer.forward(small, y_small, opts);
  EXPECT_EQ(ws.bytes(), warm_small);
  layer.forward(x, y2, opts);  // and the larger call still fits
  EXPECT_EQ(ws.bytes(), warm_small);
  // release() frees it all, and the next call grows it again.
  ws.release();
  EXPECT_EQ(ws.bytes(), 0u);
  layer.forward(x, y3, opts);
  EXPECT_TRUE(moh_test::BitEqual(y1, y3));
  EXPECT_GT(ws.bytes(), 0u);
  // Without a workspace the result is the same.
  EXPECT_TRUE(moh_test::BitEqual(layer(x), y1));
}

}  // namespace
