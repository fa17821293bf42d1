// Tokenizer against Hugging Face's libraries, family by family (tests/reference/tokenizers_reference.py): encode
// with and without special tokens, decode with and without them, decode of random ids (halves of characters among
// them), BOS, EOS and the vocabulary's size; finding the tokenizer in a directory; errors that name the file, the
// field or the value.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include <symbiosis/text.h>

#include "tests/client_runtime/text/reference_tokenizers.h"

namespace symbiosis {
namespace {

using nlohmann::json;
using testing::error_message;
using testing::new_temp_dir;

std::vector<int64_t> ids_of(const json& list) { return list.get<std::vector<int64_t>>(); }

std::string escaped(const std::string& text) { return json(text).dump(); }

class ReferenceTest : public testing::WithReferenceTokenizers<::testing::TestWithParam<std::string>> {
 protected:
  void SetUp() override {
    WithReferenceTokenizers::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    expected_ = &reference_->expected.at(GetParam());
    tokenizer_ = Tokenizer::from_directory(expected_->at("dir").get<std::string>());
  }

  const json* expected_ = nullptr;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_P(ReferenceTest, EncodeEqualsHuggingFace) {
  int compared = 0;
  for (const json& c : expected_->at("cases")) {
    const std::string text = c.at("text");
    EXPECT_EQ(tokenizer_->encode(text), ids_of(c.at("ids"))) << "text " << escaped(text);
    EXPECT_EQ(tokenizer_->encode(text, /*add_special_tokens=*/false), ids_of(c.at("ids_plain")))
        << "text " << escaped(text);
    ++compared;
  }
  EXPECT_GE(compared, 25);
}

TEST_P(ReferenceTest, DecodeEqualsHuggingFace) {
  for (const json& c : expected_->at("cases")) {
    const auto ids = ids_of(c.at("ids"));
    EXPECT_EQ(tokenizer_->decode(ids), c.at("decoded").get<std::string>()) << "text " << escaped(c.at("text"));
    EXPECT_EQ(tokenizer_->decode(ids, /*skip_special_tokens=*/true), c.at("decoded_skip").get<std::string>())
        << "text " << escaped(c.at("text"));
  }
}

TEST_P(ReferenceTest, DecodeOfRandomIdsEqualsHuggingFace) {
  for (const json& c : expected_->at("decode_cases")) {
    const auto ids = ids_of(c.at("ids"));
    EXPECT_EQ(tokenizer_->decode(ids), c.at("decoded").get<std::string>()) << "ids " << c.at("ids").dump();
    EXPECT_EQ(tokenizer_->decode(ids, true), c.at("decoded_skip").get<std::string>()) << "ids " << c.at("ids").dump();
  }
}

TEST_P(ReferenceTest, SpecialTokensAndVocabularySize) {
  const auto expected_id = [](const json& value) {
    return value.is_null() ? std::nullopt : std::optional<int64_t>(value.get<int64_t>());
  };
  EXPECT_EQ(tokenizer_->bos_token_id(), expected_id(expected_->at("bos")));
  EXPECT_EQ(tokenizer_->eos_token_id(), expected_id(expected_->at("eos")));
  EXPECT_EQ(tokenizer_->vocab_size(), expected_->at("vocab_size").get<int64_t>());
  for (const json& special : expected_->at("specials")) {
    const auto id = tokenizer_->token_to_id(special.get<std::string>());
    ASSERT_TRUE(id.has_value()) << special;
    EXPECT_TRUE(tokenizer_->is_special(*id)) << special;
    EXPECT_EQ(tokenizer_->encode(special.get<std::string>(), false), std::vector<int64_t>{*id}) << special;
  }
  EXPECT_FALSE(tokenizer_->token_to_id("surely-no-such-token-in-any-vocabulary").has_value());
}

INSTANTIATE_TEST_SUITE_P(Families, ReferenceTest, ::testing::ValuesIn(testing::kTokenizerFamilies),
                         [](const auto& info) { return info.param; });

// Byte-level BPE without a normalizer loses nothing: decoding what encode gave is the text again.
class ByteLevelRoundTripTest : public ReferenceTest {};

TEST_P(ByteLevelRoundTripTest, DecodeOfEncodeIsTheText) {
  for (const json& c : expected_->at("cases")) {
    const std::string text = c.at("text");
    EXPECT_EQ(tokenizer_->decode(tokenizer_->encode(text, false)), text) << "text " << escaped(text);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ByteLevelRoundTripTest, ::testing::Values("gpt2", "llama3", "starcoder"),
                         [](const auto& info) { return info.param; });

// ---- Finding the tokenizer, and errors ----

class TokenizerFilesTest : public testing::WithReferenceTokenizers<::testing::Test> {
 protected:
  void SetUp() override {
    WithReferenceTokenizers::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    dir_ = new_temp_dir("symbiosis-tokenizer-files");
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::filesystem::path family_file(const std::string& family, const std::string& name) const {
    return reference_->dir / family / name;
  }
  json read(const std::filesystem::path& file) const {
    std::ifstream in(file);
    return json::parse(in);
  }
  void write(const std::string& name, const std::string& content) const { std::ofstream(dir_ / name) << content; }

  std::filesystem::path dir_;
};

TEST_F(TokenizerFilesTest, MissingFilesAreNamedWithTheDirectory) {
  const std::string message = error_message([&] { Tokenizer::from_directory(dir_); });
  EXPECT_NE(message.find(dir_.string()), std::string::npos) << message;
  EXPECT_NE(message.find("tokenizer.json"), std::string::npos) << message;
  EXPECT_NE(message.find("tokenizer.model"), std::string::npos) << message;
  const std::string not_dir = error_message([&] { Tokenizer::from_directory(dir_ / "absent"); });
  EXPECT_NE(not_dir.find((dir_ / "absent").string() + " is not a directory"), std::string::npos) << not_dir;
}

TEST_F(TokenizerFilesTest, TokenizerJsonIsPreferredToTokenizerModel) {
  std::filesystem::copy_file(family_file("gpt2", "tokenizer.json"), dir_ / "tokenizer.json");
  std::filesystem::copy_file(family_file("spm_bpe", "tokenizer.model"), dir_ / "tokenizer.model");
  const auto gpt2 = Tokenizer::from_directory(reference_->dir / "gpt2");
  EXPECT_EQ(Tokenizer::from_directory(dir_)->encode("Hello world"), gpt2->encode("Hello world"));
}

// A tokenizer.json with a part not implemented here gives way to the tokenizer.model beside it; alone it is
// refused naming the part.
TEST_F(TokenizerFilesTest, UnsupportedTokenizerJsonFallsBackToTokenizerModel) {
  json file = read(family_file("gpt2", "tokenizer.json"));
  file["model"]["type"] = "WordPiece";
  write("tokenizer.json", file.dump());
  const std::string message = error_message([&] { Tokenizer::from_directory(dir_); });
  EXPECT_NE(message.find("model.type 'WordPiece' is not supported"), std::string::npos) << message;
  EXPECT_NE(message.find((dir_ / "tokenizer.json").string()), std::string::npos) << message;

  std::filesystem::copy_file(family_file("spm_bpe", "tokenizer.model"), dir_ / "tokenizer.model");
  std::filesystem::copy_file(family_file("spm_bpe", "tokenizer_config.json"), dir_ / "tokenizer_config.json");
  const auto spm = Tokenizer::from_directory(reference_->dir / "spm_bpe");
  EXPECT_EQ(Tokenizer::from_directory(dir_)->encode("Hello world"), spm->encode("Hello world"));
}

TEST_F(TokenizerFilesTest, CorruptTokenizerJsonNamesTheField) {
  const json good = read(family_file("llama3", "tokenizer.json"));
  const auto refusal = [&](const std::function<void(json&)>& corrupt) {
    json file = good;
    corrupt(file);
    write("tokenizer.json", file.dump());
    return error_message([&] { Tokenizer::from_directory(dir_); });
  };
  const auto expect_named = [&](const std::string& message, const std::string& what) {
    EXPECT_NE(message.find(what), std::string::npos) << message;
    EXPECT_NE(message.find("tokenizer.json"), std::string::npos) << message;
  };
  expect_named(refusal([](json& f) { f.erase("model"); }), "missing field 'model'");
  expect_named(refusal([](json& f) { f["model"]["vocab"] = json::array(); }), "model.vocab should be an object");
  expect_named(refusal([](json& f) { f["model"]["merges"][3] = 7; }), "model.merges[3] should be");
  expect_named(refusal([](json& f) {
                 f["model"]["merges"][0] = {"no-such-token", "x"};
               }),
               "model.merges[0] (\"no-such-token\", \"x\") names a token that");
  expect_named(refusal([](json& f) { f["added_tokens"][0].erase("content"); }),
               "added_tokens[0]: missing field 'content'");
  expect_named(refusal([](json& f) { f["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; }),
               "pre_tokenizer.pretokenizers[0].behavior 'Sideways' is none of");
  expect_named(refusal([](json& f) {
                 f["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
               }),
               "'(unclosed' does not compile");
  expect_named(refusal([](json& f) { f["decoder"]["type"] = "CTC"; }),
               "decoder: the decoder type 'CTC' is not supported");
  write("tokenizer.json", "{\"model\": ");
  expect_named(error_message([&] { Tokenizer::from_directory(dir_); }), "is not valid JSON");
}

TEST_F(TokenizerFilesTest, CorruptTokenizerConfigNamesTheField) {
  std::filesystem::copy_file(family_file("gpt2", "tokenizer.json"), dir_ / "tokenizer.json");
  write("tokenizer_config.json", R"({"bos_token": 5})");
  std::string message = error_message([&] { Tokenizer::from_directory(dir_); });
  EXPECT_NE(message.find("tokenizer_config.json: bos_token should be a string"), std::string::npos) << message;
  write("tokenizer_config.json", R"({"eos_token": "<|no-such-token|>"})");
  message = error_message([&] { Tokenizer::from_directory(dir_); });
  EXPECT_NE(message.find("eos_token '<|no-such-token|>' is not a token"), std::string::npos) << message;
  write("tokenizer_config.json", R"({"bos_token": {"content": "<|endoftext|>"}, "eos_token": null})");
  const auto tokenizer = Tokenizer::from_directory(dir_);
  EXPECT_EQ(tokenizer->bos_token_id(), tokenizer->token_to_id("<|endoftext|>"));
  EXPECT_EQ(tokenizer->eos_token_id(), std::nullopt);
}

TEST_F(TokenizerFilesTest, CorruptTokenizerModelIsNamed) {
  write("tokenizer_config.json", R"({"tokenizer_class": "LlamaTokenizer"})");
  write("tokenizer.model", "not a SentencePiece model");
  std::string message = error_message([&] { Tokenizer::from_directory(dir_); });
  EXPECT_NE(message.find((dir_ / "tokenizer.model").string() + " is not a SentencePiece model"), std::string::npos)
      << message;
  std::ifstream in(family_file("spm_bpe", "tokenizer.model"), std::ios::binary);
  const std::string model((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  write("tokenizer.model", model.substr(0, model.size() / 2));
  message = error_message([&] { Tokenizer::from_directory(dir_); });
  EXPECT_NE(message.find("is not a SentencePiece model: its protobuf breaks at byte"), std::string::npos) << message;
}

// [Tokenizer classes] The class matters: these tokenizer.json files, read as written (their tokenizer_config.json
// naming no class), tokenize some of the texts otherwise than AutoTokenizer, which rebuilds their pipeline.
TEST_F(TokenizerFilesTest, TokenizerJsonReadWithoutItsClassDiffersFromTransformers) {
  for (const char* family : {"llama2_legacy_json", "gemma_rewritten_json"}) {
    std::filesystem::copy_file(family_file(family, "tokenizer.json"), dir_ / "tokenizer.json",
                               std::filesystem::copy_options::overwrite_existing);
    json config = read(family_file(family, "tokenizer_config.json"));
    config.erase("tokenizer_class");
    write("tokenizer_config.json", config.dump());
    const auto as_written = Tokenizer::from_directory(dir_);
    int differing = 0;
    for (const json& c : reference_->expected.at(family).at("cases")) {
      differing += as_written->encode(c.at("text").get<std::string>()) != ids_of(c.at("ids"));
    }
    EXPECT_GT(differing, 0) << family;
  }
}

// [SentencePiece conversion] A tokenizer.model alone is converted as transformers converts LlamaTokenizer's and
// GemmaTokenizer's; another class, or none, is refused naming it, since transformers would build that class's own
// pipeline.
TEST_F(TokenizerFilesTest, TokenizerModelOfAnotherClassIsRefused) {
  std::filesystem::copy_file(family_file("spm_bpe", "tokenizer.model"), dir_ / "tokenizer.model");
  for (const auto& [config, named] :
       {std::pair{R"({"tokenizer_class": "T5Tokenizer"})", "tokenizer_class is 'T5Tokenizer'"},
        std::pair{R"({"bos_token": "<s>"})", "tokenizer_class is not given"}}) {
    write("tokenizer_config.json", config);
    const std::string message = error_message([&] { Tokenizer::from_directory(dir_); });
    EXPECT_NE(message.find(named), std::string::npos) << message;
    EXPECT_NE(message.find("implemented here: LlamaTokenizer, GemmaTokenizer"), std::string::npos) << message;
    EXPECT_NE(message.find((dir_ / "tokenizer.model").string()), std::string::npos) << message;
  }
}

TEST_F(TokenizerFilesTest, TextThatIsNotUtf8AndNegativeIdsAreRefused) {
  for (const char* family : {"gpt2", "spm_bpe"}) {
    const auto tokenizer = Tokenizer::from_directory(reference_->dir / family);
    const std::string message = error_message([&] {
      tokenizer->encode(
          "ab\xff"
          "c");
    });
    EXPECT_NE(message.find("not UTF-8 (byte 2 of 4)"), std::string::npos) << family << ": " << message;
    const std::string negative = error_message([&] { tokenizer->decode({1, -3}); });
    EXPECT_NE(negative.find("-3"), std::string::npos) << family << ": " << negative;
  }
}

}  // namespace
}  // namespace symbiosis
