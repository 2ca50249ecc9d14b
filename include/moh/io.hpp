// moh checkpoints: safetensors files read (validated, memory-mapped) and written, Hugging Face
// sharded checkpoints, and layers' weights, configs and routing records loaded and saved under
// the authors' PyTorch names. Needs nlohmann-json (and uses POSIX mmap where there is one).
// Includes <moh/moh.hpp>.
#pragma once

#include "moh/moh.hpp"

#include "moh/io/checkpoint.hpp"
#include "moh/io/dtype.hpp"
#include "moh/io/json.hpp"
#include "moh/io/mapped_file.hpp"
#include "moh/io/safetensors.hpp"
#include "moh/io/safetensors_writer.hpp"
#include "moh/io/sharded_safetensors.hpp"
#include "moh/io/tensor_source.hpp"
