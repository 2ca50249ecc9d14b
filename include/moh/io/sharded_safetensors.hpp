// moh::ShardedSafeTensors: a checkpoint split over several safetensors files, read through one
// interface.
//
// open() takes either one .safetensors file or a Hugging Face index (a path ending in ".json",
// usually model.safetensors.index.json):
//   {"metadata": {"total_size": 123, ...},                 // optional
//    "weight_map": {"tensor name": "shard file name", ...}}
// Shard names are relative to the index's folder; absolute names and any ".." component are
// rejected, so an index cannot point outside its folder. The index is checked as strictly as a
// safetensors header (<= 100 MB, UTF-8, nesting <= 64, valid JSON without repeated keys, an
// object; "weight_map" an object of strings; other top-level keys are allowed and ignored).
// Every shard is mapped and validated once, up front, and every tensor of the weight map must be
// in the shard it names; tensors a shard holds beyond the weight map are not exposed.
//
// The read interface is TensorSource's, as for a single SafeTensors file (contains, info, names,
// values, matrix, vector, tensor3, mask, metadata, source, file_of), so code that takes a
// TensorSource reads either. Read errors name the shard file the tensor lives in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moh/error.hpp"
#include "moh/io/json.hpp"
#include "moh/io/mapped_file.hpp"
#include "moh/io/safetensors.hpp"
#include "moh/io/tensor_source.hpp"

namespace moh {

/// A checkpoint of one or more safetensors shards. Copies are cheap and share the mappings.
/// source() is the path given to open() (the index, or the single file); metadata() is the
/// index's "metadata" (strings as they are, other values as their JSON text, e.g. total_size
/// 1024 -> "1024"), or the single file's "__metadata__".
class ShardedSafeTensors : public TensorSource {
 public:
  /// Opens an index (`path` ends in ".json") and all its shards, or one .safetensors file.
  static ShardedSafeTensors open(const std::string& path) {
    const std::string suffix = ".json";
    const bool is_index = path.size() >= suffix.size() &&
                          path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
    ShardedSafeTensors out;
    if (is_index) {
      out.source_ = path;
      out.read_index(path);
    } else {
      out.shards_.push_back(SafeTensors::open(path));
      out.TensorSource::operator=(out.shards_[0]);  // the file's entries, metadata and bytes
    }
    return out;
  }

 private:
  ShardedSafeTensors() = default;

  template <class... Parts>
  [[noreturn]] void bad_index(const Parts&... parts) const {
    detail::fail("safetensors index ", source_, ": ", parts...);
  }

  void read_index(const std::string& path) {
    const detail::SharedBytes bytes = detail::load_file(path, "safetensors index");
    if (bytes.size() > detail::kMaxSafetensorsHeader) {
      bad_index("index too large: expected <= ", detail::kMaxSafetensorsHeader, " bytes, got ",
                bytes.size());
    }
    const nlohmann::json root = detail::parse_json_strictly(
        bytes.data(), bytes.size(), detail::concat("safetensors index ", source_, ": "), "index");

    if (root.contains("metadata")) {
      const nlohmann::json& meta = root["metadata"];
      if (!meta.is_object()) {
        bad_index("metadata: expected an object, got ", detail::describe_json(meta));
      }
      for (auto it = meta.begin(); it != meta.end(); ++it) {
        metadata_.emplace(it.key(), it.value().is_string() ? it.value().get<std::string>()
                                                           : it.value().dump());
      }
    }

    if (!root.contains("weight_map")) {
      bad_index("expected a \"weight_map\" object mapping tensor names to shard files, got no "
                "\"weight_map\"");
    }
    const nlohmann::json& weight_map = root["weight_map"];
    if (!weight_map.is_object()) {
      bad_index("weight_map: expected an object mapping tensor names to shard files, got ",
                detail::describe_json(weight_map));
    }

    namespace fs = std::filesystem;
    const fs::path folder = fs::path(path).parent_path();
    std::map<std::string, std::size_t> opened;  // normalised shard name -> index in shards_
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      const std::string& tensor = it.key();
      if (!it.value().is_string()) {
        bad_index("weight_map['", tensor, "']: expected a shard file name (a string), got ",
                  detail::describe_json(it.value()));
      }
      const std::string shard = it.value().get<std::string>();
      const std::string relative = checked_shard_name(tensor, shard);
      auto found = opened.find(relative);
      if (found == opened.end()) {
        const std::string file = (folder / fs::path(relative)).string();
        try {
          shards_.push_back(SafeTensors::open(file));
          files_.push_back(shards_.back().source());
          storage_.push_back(storage_of(shards_.back()));  // copies of this source keep it mapped
        } catch (const Error& e) {
          std::string reason = e.what();
          if (reason.rfind("moh: ", 0) == 0) reason.erase(0, 5);
          bad_index("shard '", shard, "' (for tensor '", tensor, "'): ", reason);
        }
        found = opened.emplace(relative, shards_.size() - 1).first;
      }
      if (!shards_[found->second].contains(tensor)) {
        bad_index("weight_map['", tensor, "']: expected the tensor in shard ",
                  shards_[found->second].source(), ", got a shard without it");
      }
      Entry e = entry_in(shards_[found->second], tensor);
      e.file = found->second;
      tensors_.emplace(tensor, std::move(e));
    }
  }

  /// `shard` as a normalised path relative to the index's folder; throws for absolute paths,
  /// ".." components and names that are not files.
  std::string checked_shard_name(const std::string& tensor, const std::string& shard) const {
    namespace fs = std::filesystem;
    const fs::path p(shard);
    if (shard.empty()) {
      bad_index("weight_map['", tensor, "']: expected a shard file name, got \"\"");
    }
    if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) {
      bad_index("weight_map['", tensor, "']: expected a shard path relative to the index's "
                "folder, got the absolute path '", shard, "'");
    }
    for (const fs::path& part : p) {
      if (part == "..") {
        bad_index("weight_map['", tensor, "']: expected a shard path inside the index's folder "
                  "(no '..'), got '", shard, "'");
      }
    }
    const fs::path normal = p.lexically_normal();
    if (!normal.has_filename() || normal.filename() == ".") {
      bad_index("weight_map['", tensor, "']: expected a shard file name, got the folder '",
                shard, "'");
    }
    return normal.generic_string();
  }

  std::vector<SafeTensors> shards_;  // keep the mappings the entries point into alive
};

}  // namespace moh
