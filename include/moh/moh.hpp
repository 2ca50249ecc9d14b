// moh: attention layers on Eigen — dense multi-head attention, Mixture-of-Head attention (MoH)
// and Mixture of Attention heads (MoA) — whose cost follows the heads each token uses.
// This header only includes the others.
#pragma once

#include "moh/error.hpp"
#include "moh/tensor.hpp"
#include "moh/thread_pool.hpp"
#include "moh/options.hpp"
#include "moh/linear.hpp"
#include "moh/weight_matrix.hpp"
#include "moh/softmax.hpp"
#include "moh/top_k.hpp"
#include "moh/rope.hpp"
#include "moh/attention_kernel.hpp"
#include "moh/kv_cache.hpp"
#include "moh/moh_router.hpp"
#include "moh/moa_router.hpp"
#include "moh/multi_head_attention.hpp"
#include "moh/moh_attention.hpp"
#include "moh/moa_attention.hpp"
#include "moh/float16.hpp"
#include "moh/safetensors.hpp"
#include "moh/safetensors_writer.hpp"
#include "moh/sharded_safetensors.hpp"
#include "moh/checkpoint.hpp"
#include "moh/golden_case.hpp"
