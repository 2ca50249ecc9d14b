// moh: attention layers on Eigen — dense multi-head attention, Mixture-of-Head attention (MoH)
// and Mixture of Attention heads (MoA) — whose cost follows the heads each token uses.
//
// This header brings the layers, the ops they are built from and the runtime (threads, KV
// cache, workspace); it needs Eigen and the standard library only. Checkpoints (safetensors
// reading and writing, load_weights / save_weights) come from <moh/io.hpp>, which needs
// nlohmann-json; the golden-case runner from <moh/io/golden_case.hpp>.
//
// A comment's "§N" is section N of docs/semantics.md, which states what each layer computes,
// formula by formula.
#pragma once

#include "moh/error.hpp"
#include "moh/float16.hpp"
#include "moh/tensor.hpp"

#include "moh/runtime/kv_cache.hpp"
#include "moh/runtime/large_buffer.hpp"
#include "moh/runtime/thread_pool.hpp"
#include "moh/runtime/tuning.hpp"
#include "moh/runtime/workspace.hpp"

#include "moh/ops/attention_kernel.hpp"
#include "moh/ops/gemm.hpp"
#include "moh/ops/linear.hpp"
#include "moh/ops/rope.hpp"
#include "moh/ops/softmax.hpp"
#include "moh/ops/top_k.hpp"
#include "moh/ops/weight_matrix.hpp"
#include "moh/ops/weight_storage.hpp"

#include "moh/attention_config.hpp"
#include "moh/layers/moa_attention.hpp"
#include "moh/layers/moa_router.hpp"
#include "moh/layers/moh_attention.hpp"
#include "moh/layers/moh_router.hpp"
#include "moh/layers/multi_head_attention.hpp"
#include "moh/options.hpp"
