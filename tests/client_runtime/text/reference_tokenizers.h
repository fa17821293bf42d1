#pragma once
// The test tokenizers of every family and Hugging Face's encodings and decodings of a varied corpus, made once per
// process by tests/reference/tokenizers_reference.py (see it for the families and the cases). No LibTorch.
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace symbiosis::testing {

inline const std::vector<std::string> kTokenizerFamilies = {"gpt2",
                                                            "llama3",
                                                            "qwen2",
                                                            "starcoder",
                                                            "lowercase",
                                                            "spm_bpe",
                                                            "spm_bpe_legacy",
                                                            "spm_bpe_no_prefix",
                                                            "spm_unigram",
                                                            "llama2_json",
                                                            "llama2_legacy_json",
                                                            "gemma_spm",
                                                            "gemma_spm_eos",
                                                            "gemma_json",
                                                            "gemma_rewritten_json"};

struct ReferenceTokenizers {
  std::filesystem::path dir;  // <dir>/<family>/ holds each family's files
  nlohmann::json expected;    // expected.json: per family, "cases", "decode_cases", "bos", "eos", "vocab_size"
};
// nullptr, with `why`, when the Python lacks tokenizers, sentencepiece, protobuf or transformers (the tests then
// skip); a failing script
// fails the calling test.
const ReferenceTokenizers* reference_tokenizers(std::string& why);
// A fixture over the reference tokenizers (Base: ::testing::Test or TestWithParam<...>): SetUp
// skips where the Python lacks the packages and fails where the script failed; a derived SetUp
// calls it first and returns when IsSkipped() or HasFatalFailure().
template <typename Base>
class WithReferenceTokenizers : public Base {
 protected:
  void SetUp() override {
    std::string why;
    reference_ = reference_tokenizers(why);
    if (reference_ == nullptr) {
      if (why.find("lacks") != std::string::npos) GTEST_SKIP() << why;
      FAIL() << why;
    }
  }
  const ReferenceTokenizers* reference_ = nullptr;
};

// A copy of `checkpoint` at `out` with the reference tokenizer of `family` beside its config.json
// (the family's tokenizer files and tokenizer_config.json): a model whose tools read and write text.
std::filesystem::path with_tokenizer(const ReferenceTokenizers& reference, const std::string& family,
                                     const std::filesystem::path& checkpoint, const std::filesystem::path& out);

// A new empty directory under the system's temporary one.
std::filesystem::path new_temp_dir(const std::string& prefix);
// The message of the exception that f throws (c10::Error's without its backtrace), or "(no error)".
std::string error_message(const std::function<void()>& f);

}  // namespace symbiosis::testing
