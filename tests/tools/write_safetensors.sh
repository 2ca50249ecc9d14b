# Sourced by tests/tools/make_inputs.sh and fuzz/make_corpus.sh, which write small safetensors
# files by hand (valid and malformed ones).
#
# write NAME HEADER DATA: writes ${out:-.}/NAME: the header's 8-byte little-endian length, the
# header (ASCII JSON, or anything for a malformed file), then DATA, a printf format of \x escapes.
write() {
  local name=$1 header=$2 data=$3 n=${#2} i
  {
    for i in 0 1 2 3 4 5 6 7; do
      # shellcheck disable=SC2059
      printf "\\x$(printf %02x $(((n >> (8 * i)) & 255)))"
    done
    printf '%s' "$header"
    # shellcheck disable=SC2059
    printf "$data"
  } > "${out:-.}/$name"
}
