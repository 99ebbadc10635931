#include "shardit/verify/lora_case.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "shardit/io/json.h"
#include "shardit/models/lora_formats.h"

namespace shardit::verify {

LoraCase read_lora_case(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "case.json").string();
  const nlohmann::json json = io::read_json_file(path);
  auto field = [&](const nlohmann::json& object, const std::string& key, const std::string& where) {
    TORCH_CHECK(object.is_object() && object.contains(key), path, ": ", where, " has no '", key, "'");
    return object.at(key);
  };
  LoraCase lora_case;
  for (const auto& adapter : field(json, "adapters", "the case")) {
    lora_case.adapters.push_back({field(adapter, "adapter_name", "an adapter").get<std::string>(),
                                  (std::filesystem::path(dir) / field(adapter, "file", "an adapter").get<std::string>())
                                      .string()});
  }
  const nlohmann::json set_adapters = field(json, "set_adapters", "the case");
  lora_case.active = field(set_adapters, "adapter_names", "set_adapters").get<std::vector<std::string>>();
  lora_case.weights = field(set_adapters, "adapter_weights", "set_adapters").get<std::vector<double>>();
  lora_case.lora_scale = field(field(json, "fuse_lora", "the case"), "lora_scale", "fuse_lora").get<double>();
  return lora_case;
}

std::unique_ptr<parallel::LoraAdapters> load_lora_case(parallel::TensorParallelModule& model, const LoraCase& lora_case) {
  auto adapters = std::make_unique<parallel::LoraAdapters>(model);
  for (const LoraCaseAdapter& adapter : lora_case.adapters) {
    adapters->load(adapter.name, models::read_lora_spec(adapter.file, model));
  }
  adapters->set_adapters(lora_case.active, lora_case.weights);
  return adapters;
}

}  // namespace shardit::verify
