#!/usr/bin/env bash
# fuzz/make_corpus.sh [DIR]: writes the seed corpus for safetensors_fuzz (default fuzz/corpus/):
# tiny valid safetensors files, one per dtype, each with __metadata__, covering ranks 0 to 3, an
# empty tensor, unaligned data and a golden-case-like file. The files are checked in; rerun this
# only to change them.
set -euo pipefail
export LC_ALL=C
out=${1:-"$(dirname "${BASH_SOURCE[0]}")/corpus"}
mkdir -p "$out"

# shellcheck source=../tests/tools/write_safetensors.sh
source "$(dirname "${BASH_SOURCE[0]}")/../tests/tools/write_safetensors.sh"

m='"__metadata__":{"format":"pt"}'
write f64.safetensors "{$m,\"t\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]}}" \
  '\x00\x00\x00\x00\x00\x00\xf0\x3f\x00\x00\x00\x00\x00\x00\x04\xc0'           # 1, -2.5
write f32.safetensors "{$m,\"t\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}" \
  '\x00\x00\x80\x3f\x00\x00\x00\x00\x00\x00\x80\xbf\x00\x00\x00\x3f'           # 1, 0, -1, 0.5
write f16.safetensors "{$m,\"t\":{\"dtype\":\"F16\",\"shape\":[1,2,1],\"data_offsets\":[0,4]}}" \
  '\x00\x3c\x01\x00'                                                           # 1, 2^-24
write bf16.safetensors "{$m,\"t\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,6]}}" \
  '\x80\x3f\x80\xbf\xc0\x7f'                                                   # 1, -1, NaN
write i64.safetensors "{$m,\"t\":{\"dtype\":\"I64\",\"shape\":[2,1],\"data_offsets\":[0,16]}}" \
  '\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x80'           # 1, INT64_MIN
write i32.safetensors "{$m,\"t\":{\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[0,4]}}" \
  '\x07\x00\x00\x00'                                                           # scalar 7
write i16.safetensors "{$m,\"t\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[0,4]}}" \
  '\xff\xff\x2c\x01'                                                           # -1, 300
write i8.safetensors "{$m,\"t\":{\"dtype\":\"I8\",\"shape\":[2,2],\"data_offsets\":[0,4]}}" \
  '\x80\x7f\x00\x01'                                                           # -128, 127, 0, 1
write u8.safetensors "{$m,\"t\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]}}" \
  '\x00\x01\xff'
write bool.safetensors "{$m,\"t\":{\"dtype\":\"BOOL\",\"shape\":[2,3],\"data_offsets\":[0,6]}}" \
  '\x00\x01\x01\x00\x00\x01'
# Several tensors: a BOOL mask first so that the F32 data starts at an odd offset, an empty
# tensor, and the metadata of a golden case.
meta='"__metadata__":{"format":"moh-case/1","layer":"mha","embed_dim":"2","causal":"0"}'
mask='"key_padding_mask":{"dtype":"BOOL","shape":[1,3],"data_offsets":[0,3]}'
x='"x":{"dtype":"F32","shape":[1,3,2],"data_offsets":[3,27]}'
empty='"empty":{"dtype":"F32","shape":[0,4],"data_offsets":[27,27]}'
data='\x00\x00\x01'                                            # key_padding_mask: 0 0 1
data+='\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x00\x40\x40'       # x: 1 2 3
data+='\x00\x00\x80\x40\x00\x00\xa0\x40\x00\x00\xc0\x40'       #    4 5 6
write case.safetensors "{$meta,$mask,$x,$empty}" "$data"
