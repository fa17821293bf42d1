#pragma once
// Token-id datasets for fine-tuning, and how they become micro-batches.
//
// A dataset is a list of examples, each a sequence of token ids with per-position labels (-100:
// not trained on). Read from JSON Lines, one example a line, in one of three forms:
//   {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}   token ids ("labels" optional,
//                                                                 input_ids by default)
//   {"text": "..."}                                                text, trained on whole
//   {"prompt": "...", "completion": "..."}                         trained on the completion only
// Text is tokenized with the checkpoint's tokenizer ([Text examples]). Other fields are ignored;
// blank lines are skipped. Malformed input is refused with "<file>:<line>: <field>...: <what is
// wrong>".
//
// [Text examples] As transformers' tokenizer and TRL's SFTTrainer make them: "text" is
// encode(text) (with the tokenizer's BOS where it adds one) followed by EOS, every token a target;
// "prompt"/"completion" is encode(prompt) followed by encode(completion) without special tokens and
// EOS, the prompt's labels -100 (the loss is on the completion and its EOS only).
//
// Micro-batches are built by plan_epoch() (which examples go in which row) and collate() (the
// tensors). See [Batching modes] for the two layouts.
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace symbiosis {

class Tokenizer;

struct TokenExample {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;  // same length as input_ids; -100 ignores a position
  int64_t line = 0;             // 1-based line in the source file (0 when built in memory)
};

class TokenDataset {
 public:
  TokenDataset() = default;
  // Throws naming the file, line and field for a malformed line, and for an example with nothing
  // to learn from (fewer than 2 tokens, or every label after the first -100: the model predicts
  // position t+1 from position t, so the first label is never a target).
  // tokenizer: for lines of text ([Text examples]); null refuses them, naming the line.
  static TokenDataset from_jsonl(const std::filesystem::path& file, const Tokenizer* tokenizer = nullptr);
  // Labels left empty default to input_ids. Same checks as from_jsonl, naming "example N".
  static TokenDataset from_examples(std::vector<TokenExample> examples, std::string source = "<memory>");

  size_t size() const { return examples_.size(); }
  const TokenExample& operator[](size_t i) const { return examples_[i]; }
  const std::string& source() const { return source_; }
  // "<source>:<line>" (or "<source> example <i>") for messages about example i.
  std::string where(size_t i) const;
  int64_t max_token_id() const;
  int64_t num_tokens() const;

 private:
  std::vector<TokenExample> examples_;
  std::string source_;
};

// [Batching modes]
// kPadding: a row is one example; rows are right-padded to the longest in the micro-batch with
//   attention_mask 0 and labels -100. Exactly what the examples would compute one by one.
// kPacking ("padding-free" packing): consecutive examples (in the epoch's order) are concatenated
//   into a row while the row stays within pack_length tokens; position_ids restart at 0 for every
//   example, and the label of each example's first token is -100, so no token is trained to
//   predict across a boundary. The models here have no block-diagonal (per-example) causal mask,
//   so a packed example's tokens DO attend to the earlier examples in its row: packing changes the
//   numbers (as transformers' eager attention with DataCollatorWithFlattening does), trading that
//   for fewer padding tokens. Use kPadding where each example must be computed alone.
enum class BatchingMode { kPadding, kPacking };

struct MicroBatchOptions {
  BatchingMode mode = BatchingMode::kPadding;
  int64_t micro_batch_size = 1;  // rows per micro-batch
  int64_t pack_length = 512;     // kPacking: the token budget of a row
  int64_t max_length = 0;        // examples are cut to this many tokens; 0: no limit (kPacking: pack_length)
  void validate() const;         // throws naming the bad field
};

// One micro-batch's rows: indices into the dataset (one per row for kPadding).
using MicroBatchPlan = std::vector<std::vector<int64_t>>;

// The example order of an epoch: a permutation of [0, n) drawn from (seed, epoch) by a generator
// of our own, so it is the same on every platform and standard library. shuffle=false: 0..n-1.
std::vector<int64_t> epoch_order(size_t n, uint64_t seed, int64_t epoch, bool shuffle = true);

// The micro-batches of one pass over `order`.
std::vector<MicroBatchPlan> plan_micro_batches(const TokenDataset& data, const std::vector<int64_t>& order,
                                               const MicroBatchOptions& options);

struct MicroBatch {
  at::Tensor input_ids;       // [B, T] int64 (padding: 0)
  at::Tensor attention_mask;  // [B, T] int64, 1 token / 0 padding
  at::Tensor position_ids;    // [B, T] int64
  at::Tensor labels;          // [B, T] int64, -100 where not trained
  int64_t num_tokens = 0;     // real (non-padding) tokens
  int64_t num_targets = 0;    // positions t whose label[t+1] is trained on
};

// A micro-batch of one shape whatever its plan holds: what a captured step reads ([Captured training
// steps] in trainer.h). Rows past the plan's are padding rows (token 0, attending to themselves,
// never a target), and every row is padded to `length` tokens.
struct FixedShape {
  int64_t rows = 0;
  int64_t length = 0;
};

// shape: the micro-batch's shape (the plan must fit it; an empty plan gives a micro-batch of padding
// rows), or, by default, as many rows as the plan and the longest row's length.
MicroBatch collate(const TokenDataset& data, const MicroBatchPlan& plan, const MicroBatchOptions& options,
                   std::optional<FixedShape> shape = std::nullopt);

// The longest row any micro-batch of the data can have: pack_length when packing, else the longest
// example after max_length's cut.
int64_t longest_row(const TokenDataset& data, const MicroBatchOptions& options);

}  // namespace symbiosis
