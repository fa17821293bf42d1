#include "client_runtime/training/dataset.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <limits>

#include "client_runtime/text/tokenizer.h"
#include "client_runtime/training/loss.h"

namespace symbiosis {
namespace {

// A token id array field of one line; `where` is "<file>:<line>: ".
std::vector<int64_t> read_ids(const nlohmann::json& line, const char* field, bool allow_ignore,
                              const std::string& where) {
  const auto& value = line.at(field);
  TORCH_CHECK(value.is_array(), where, field, ": expected an array of token ids, got ", value.type_name());
  std::vector<int64_t> ids;
  ids.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    const auto& v = value[i];
    const bool integer = v.is_number_integer() && (!v.is_number_unsigned() ||
                                                   v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()));
    const int64_t id = integer ? v.get<int64_t>() : 0;
    TORCH_CHECK(integer && (id >= 0 || (allow_ignore && id == kIgnoreIndex)), where, field, "[", i, "]: expected ",
                allow_ignore ? "a token id or -100" : "a token id (a non-negative integer)", ", got ", v.dump());
    ids.push_back(id);
  }
  return ids;
}

// Fills default labels and checks an example; `where` names it for messages.
void check_example(TokenExample& example, const std::string& where) {
  TORCH_CHECK(!example.input_ids.empty(), where, "input_ids: is empty");
  for (size_t i = 0; i < example.input_ids.size(); ++i) {
    TORCH_CHECK(example.input_ids[i] >= 0, where, "input_ids[", i, "]: expected a token id, got ",
                example.input_ids[i]);
  }
  if (example.labels.empty()) example.labels = example.input_ids;
  TORCH_CHECK(example.labels.size() == example.input_ids.size(), where, "labels: has ", example.labels.size(),
              " entries, but input_ids has ", example.input_ids.size());
  int64_t targets = 0;
  for (size_t i = 0; i < example.labels.size(); ++i) {
    TORCH_CHECK(example.labels[i] >= 0 || example.labels[i] == kIgnoreIndex, where, "labels[", i,
                "]: expected a token id or -100, got ", example.labels[i]);
    if (i > 0 && example.labels[i] != kIgnoreIndex) ++targets;
  }
  TORCH_CHECK(targets > 0, where, "labels: nothing to train on (", example.input_ids.size(),
              " tokens; a position t>0 whose label is not -100 is needed, since the first token is never predicted)");
}

// splitmix64: a small, fully specified generator, so epoch orders do not depend on the standard
// library (std::shuffle and std::uniform_int_distribution are implementation-defined).
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) by rejection (no modulo bias).
  uint64_t below(uint64_t bound) {
    const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % bound;
    uint64_t x;
    do x = next();
    while (x >= limit);
    return x % bound;
  }
};

}  // namespace

namespace {

std::string text_field(const nlohmann::json& line, const char* field, const std::string& where) {
  const auto& value = line.at(field);
  TORCH_CHECK(value.is_string(), where, field, ": expected a string, got ", value.type_name());
  return value.get<std::string>();
}

// [Text examples]
TokenExample text_example(const nlohmann::json& line, const Tokenizer* tokenizer, const std::string& where) {
  const bool text = line.contains("text");
  TORCH_CHECK(
      tokenizer, where, text ? "text" : "prompt",
      ": a line of text needs the checkpoint's tokenizer (tokenizer.json or tokenizer.model beside config.json)");
  TokenExample example;
  if (text) {
    example.input_ids = tokenizer->encode(text_field(line, "text", where));
  } else {
    TORCH_CHECK(line.contains("completion"), where, "completion: missing (a \"prompt\" needs a \"completion\")");
    example.input_ids = tokenizer->encode(text_field(line, "prompt", where));
    example.labels.assign(example.input_ids.size(), kIgnoreIndex);
    const auto completion = tokenizer->encode(text_field(line, "completion", where), /*add_special_tokens=*/false);
    example.input_ids.insert(example.input_ids.end(), completion.begin(), completion.end());
    example.labels.insert(example.labels.end(), completion.begin(), completion.end());
  }
  if (const auto eos = tokenizer->eos_token_id()) {
    example.input_ids.push_back(*eos);
    if (!text) example.labels.push_back(*eos);
  }
  return example;
}

}  // namespace

TokenDataset TokenDataset::from_jsonl(const std::filesystem::path& file, const Tokenizer* tokenizer) {
  std::ifstream in(file);
  TORCH_CHECK(in, file.string(), ": cannot open the dataset file");
  TokenDataset data;
  data.source_ = file.string();
  std::string text;
  for (int64_t number = 1; std::getline(in, text); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = file.string() + ":" + std::to_string(number) + ": ";
    nlohmann::json line;
    try {
      line = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      TORCH_CHECK(false, where, "not valid JSON (", e.what(), ")");
    }
    TORCH_CHECK(line.is_object(), where,
                "expected a JSON object with \"input_ids\", \"text\", or \"prompt\" and \"completion\", got ",
                line.type_name());
    TokenExample example;
    if (!line.contains("input_ids") && (line.contains("text") || line.contains("prompt"))) {
      example = text_example(line, tokenizer, where);
    } else {
      TORCH_CHECK(line.contains("input_ids"), where,
                  "input_ids: missing (expected \"input_ids\", \"text\", or \"prompt\" and \"completion\")");
      example.input_ids = read_ids(line, "input_ids", /*allow_ignore=*/false, where);
    }
    example.line = number;
    if (line.contains("input_ids") && line.contains("labels") && !line["labels"].is_null()) {
      example.labels = read_ids(line, "labels", /*allow_ignore=*/true, where);
      TORCH_CHECK(!example.labels.empty(), where, "labels: is empty, but input_ids has ", example.input_ids.size(),
                  " entries");
    }
    check_example(example, where);
    data.examples_.push_back(std::move(example));
  }
  TORCH_CHECK(!in.bad(), file.string(), ": read error");
  TORCH_CHECK(!data.examples_.empty(), file.string(), ": holds no examples");
  return data;
}

TokenDataset TokenDataset::from_examples(std::vector<TokenExample> examples, std::string source) {
  TokenDataset data;
  data.source_ = std::move(source);
  TORCH_CHECK(!examples.empty(), data.source_, ": holds no examples");
  for (size_t i = 0; i < examples.size(); ++i) {
    check_example(examples[i], data.source_ + " example " + std::to_string(i) + ": ");
  }
  data.examples_ = std::move(examples);
  return data;
}

std::string TokenDataset::where(size_t i) const {
  const auto line = examples_.at(i).line;
  return line > 0 ? source_ + ":" + std::to_string(line) : source_ + " example " + std::to_string(i);
}

int64_t TokenDataset::max_token_id() const {
  int64_t most = -1;
  for (const auto& e : examples_) {
    for (auto id : e.input_ids) most = std::max(most, id);
    for (auto id : e.labels) most = std::max(most, id);
  }
  return most;
}

int64_t TokenDataset::num_tokens() const {
  int64_t n = 0;
  for (const auto& e : examples_) n += static_cast<int64_t>(e.input_ids.size());
  return n;
}

void MicroBatchOptions::validate() const {
  TORCH_CHECK(micro_batch_size >= 1, "micro_batch_size is ", micro_batch_size, ", expected at least 1");
  TORCH_CHECK(max_length >= 0, "max_length is ", max_length, ", expected 0 (no limit) or a positive length");
  if (mode == BatchingMode::kPacking) {
    TORCH_CHECK(pack_length >= 2, "pack_length is ", pack_length, ", expected at least 2");
  }
}

std::vector<int64_t> epoch_order(size_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  std::vector<int64_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int64_t>(i);
  if (!shuffle) return order;
  SplitMix64 rng{seed * 0x100000001B3ull ^ (static_cast<uint64_t>(epoch) + 0x51ED270B27ull)};
  for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);  // Fisher-Yates
  return order;
}

namespace {

int64_t cut_length(const TokenExample& e, const MicroBatchOptions& options) {
  int64_t limit = options.max_length;
  if (options.mode == BatchingMode::kPacking && (limit == 0 || limit > options.pack_length))
    limit = options.pack_length;
  const auto n = static_cast<int64_t>(e.input_ids.size());
  return limit > 0 ? std::min(n, limit) : n;
}

}  // namespace

std::vector<MicroBatchPlan> plan_micro_batches(const TokenDataset& data, const std::vector<int64_t>& order,
                                               const MicroBatchOptions& options) {
  options.validate();
  std::vector<std::vector<int64_t>> rows;
  if (options.mode == BatchingMode::kPadding) {
    for (auto i : order) rows.push_back({i});
  } else {
    int64_t used = 0;
    for (auto i : order) {
      const int64_t n = cut_length(data[i], options);
      if (rows.empty() || used + n > options.pack_length) {
        rows.emplace_back();
        used = 0;
      }
      rows.back().push_back(i);
      used += n;
    }
  }
  std::vector<MicroBatchPlan> plans;
  for (size_t r = 0; r < rows.size(); r += options.micro_batch_size) {
    const size_t end = std::min(rows.size(), r + static_cast<size_t>(options.micro_batch_size));
    plans.emplace_back(rows.begin() + r, rows.begin() + end);
  }
  return plans;
}

int64_t longest_row(const TokenDataset& data, const MicroBatchOptions& options) {
  if (options.mode == BatchingMode::kPacking) return options.pack_length;
  int64_t longest = 0;
  for (size_t i = 0; i < data.size(); ++i) longest = std::max(longest, cut_length(data[i], options));
  return longest;
}

MicroBatch collate(const TokenDataset& data, const MicroBatchPlan& plan, const MicroBatchOptions& options,
                   std::optional<FixedShape> shape) {
  TORCH_CHECK(shape || !plan.empty(), "collate: an empty micro-batch");
  std::vector<int64_t> lengths;
  for (const auto& row : plan) {
    int64_t n = 0;
    for (auto i : row) n += cut_length(data[i], options);
    lengths.push_back(n);
  }
  int64_t batch = static_cast<int64_t>(plan.size());
  int64_t length = plan.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  if (shape) {
    TORCH_CHECK(batch <= shape->rows && length <= shape->length, "collate: a micro-batch of ", batch, " rows of up to ",
                length, " tokens does not fit the fixed shape of ", shape->rows, " rows of ", shape->length, " tokens");
    batch = shape->rows;
    length = shape->length;
  }
  MicroBatch mb;
  mb.input_ids = at::zeros({batch, length}, at::kLong);
  mb.attention_mask = at::zeros({batch, length}, at::kLong);
  mb.position_ids = at::zeros({batch, length}, at::kLong);
  mb.labels = at::full({batch, length}, kIgnoreIndex, at::kLong);
  auto ids = mb.input_ids.accessor<int64_t, 2>();
  auto mask = mb.attention_mask.accessor<int64_t, 2>();
  auto positions = mb.position_ids.accessor<int64_t, 2>();
  auto labels = mb.labels.accessor<int64_t, 2>();
  static const std::vector<int64_t> kPaddingRow;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t t = 0;
    for (auto i : b < static_cast<int64_t>(plan.size()) ? plan[b] : kPaddingRow) {
      const auto& e = data[i];
      const int64_t n = cut_length(e, options);
      for (int64_t k = 0; k < n; ++k, ++t) {
        ids[b][t] = e.input_ids[k];
        mask[b][t] = 1;
        positions[b][t] = k;
        // An example's first label is never a target of its own; in a packed row it would be
        // predicted from the previous example's last token, so it is ignored (see [Batching modes]).
        labels[b][t] = k == 0 ? kIgnoreIndex : e.labels[k];
        if (k > 0 && e.labels[k] != kIgnoreIndex) ++mb.num_targets;
      }
    }
    // Padding: masked and never a target; its positions only need to be valid. A padding row (a
    // fixed shape's) attends to itself: a row with nothing to attend to would be 0/0 in attention.
    const bool padding_row = b >= static_cast<int64_t>(plan.size());
    for (; t < length; ++t) {
      positions[b][t] = t;
      if (padding_row) mask[b][t] = 1;
    }
    if (!padding_row) mb.num_tokens += lengths[b];
  }
  return mb;
}

}  // namespace symbiosis
