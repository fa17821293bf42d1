// StreamingDecoder: ids pushed one at a time give back text that adds up to Tokenizer::decode of them all, for
// every family, with and without special tokens, on the corpus and on random ids (halves of characters among
// them); a character split over several byte tokens comes out whole, once its last byte arrives.
#include <gtest/gtest.h>

#include <symbiosis/text.h>

#include "tests/client_runtime/text/reference_tokenizers.h"

namespace symbiosis {
namespace {

using nlohmann::json;

class StreamingDecoderTest : public testing::WithReferenceTokenizers<::testing::TestWithParam<std::string>> {
 protected:
  void SetUp() override {
    WithReferenceTokenizers::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    expected_ = &reference_->expected.at(GetParam());
    tokenizer_ = Tokenizer::from_directory(reference_->dir / GetParam());
  }

  // The pieces StreamingDecoder gives for `ids`, finish() last.
  std::vector<std::string> stream(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
    StreamingDecoder decoder(*tokenizer_, skip_special_tokens);
    std::vector<std::string> pieces;
    for (const int64_t id : ids) pieces.push_back(decoder.push(id));
    pieces.push_back(decoder.finish());
    return pieces;
  }
  static std::string joined(const std::vector<std::string>& pieces) {
    std::string text;
    for (const auto& piece : pieces) text += piece;
    return text;
  }

  const json* expected_ = nullptr;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_P(StreamingDecoderTest, PiecesAddUpToDecodeOfAllIds) {
  int streams = 0;
  for (const json& c : expected_->at("cases")) {
    const auto ids = c.at("ids").get<std::vector<int64_t>>();
    for (const bool skip : {true, false}) {
      EXPECT_EQ(joined(stream(ids, skip)), tokenizer_->decode(ids, skip))
          << "text " << json(c.at("text")).dump() << " skip_special_tokens " << skip;
      ++streams;
    }
  }
  for (const json& c : expected_->at("decode_cases")) {
    const auto ids = c.at("ids").get<std::vector<int64_t>>();
    EXPECT_EQ(joined(stream(ids, true)), c.at("decoded_skip").get<std::string>()) << "ids " << c.at("ids").dump();
    ++streams;
  }
  EXPECT_GE(streams, 90);
}

// Every piece given back before finish() is whole UTF-8: no half of a character, no U+FFFD standing for one.
TEST_P(StreamingDecoderTest, PiecesAreWholeCharacters) {
  for (const json& c : expected_->at("cases")) {
    const std::string text = c.at("text");
    const auto pieces = stream(c.at("ids").get<std::vector<int64_t>>(), true);
    for (size_t i = 0; i + 1 < pieces.size(); ++i) {
      EXPECT_EQ(pieces[i].find("\xEF\xBF\xBD"), std::string::npos) << "text " << json(text).dump() << " piece " << i;
    }
  }
}

// Text arrives as its ids do: after each id, what was given back so far is a prefix of decode(ids so far), and
// all of it unless that ends in an incomplete character (U+FFFD) or the id is a byte-fallback or special token.
TEST_P(StreamingDecoderTest, TextArrivesWithoutDelay) {
  for (const json& c : expected_->at("cases")) {
    const auto ids = c.at("ids").get<std::vector<int64_t>>();
    StreamingDecoder decoder(*tokenizer_);
    std::string given;
    for (size_t n = 1; n <= ids.size(); ++n) {
      given += decoder.push(ids[n - 1]);
      const std::string so_far = tokenizer_->decode(std::vector<int64_t>(ids.begin(), ids.begin() + n), true);
      ASSERT_EQ(so_far.compare(0, given.size(), given), 0) << "text " << json(c.at("text")).dump() << " after " << n;
      const bool incomplete = so_far.size() >= 3 && so_far.compare(so_far.size() - 3, 3, "\xEF\xBF\xBD") == 0;
      const std::string token = tokenizer_->id_to_token(ids[n - 1]).value_or("");
      if (!incomplete && token.rfind("<0x", 0) != 0 && !tokenizer_->is_special(ids[n - 1])) {
        EXPECT_EQ(given, so_far) << "text " << json(c.at("text")).dump() << " after " << n;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, StreamingDecoderTest, ::testing::ValuesIn(testing::kTokenizerFamilies),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace symbiosis
