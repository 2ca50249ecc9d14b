#!/usr/bin/env bash
# tests/tools/make_inputs.sh: writes the malformed inputs the tools_* tests feed to moh_parity
# (tests/tools/*.safetensors). The files are checked in; rerun this only to change them.
set -euo pipefail
export LC_ALL=C
cd "$(dirname "${BASH_SOURCE[0]}")"

# shellcheck source=write_safetensors.sh
source ./write_safetensors.sh

x='"x":{"dtype":"F32","shape":[1,2,2],"data_offsets":[0,16]}'
x_data='\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x00\x40\x40\x00\x00\x80\x40'

# A golden case with its metadata and input but none of the layer's weights (valid safetensors).
meta='"__metadata__":{"format":"moh-case/1","layer":"mha","embed_dim":"2","num_heads":"1",'
meta+='"head_dim":"2","causal":"0"}'
write incomplete_case.safetensors "{$meta,$x}" "$x_data"
# Cut inside the header, and inside the data.
head -c 40 incomplete_case.safetensors > truncated_header.safetensors
head -c $(($(wc -c < incomplete_case.safetensors) - 5)) incomplete_case.safetensors \
  > truncated_data.safetensors
# Shorter than the 8-byte length prefix.
printf 'moh' > truncated_prefix.safetensors
# A length prefix followed by text that is not JSON, and by bytes that are not UTF-8.
write garbage_header.safetensors 'this is not a JSON header' ''
write binary_header.safetensors "$(printf '\x89PNG\xff\xfe')" ''
# Valid safetensors, but not a golden case: no metadata at all, or another format.
write not_a_case.safetensors "{$x}" "$x_data"
write wrong_format.safetensors "{\"__metadata__\":{\"format\":\"pt\"},$x}" "$x_data"
