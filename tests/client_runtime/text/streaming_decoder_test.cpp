// StreamingDecoder: ids pushed one at a time give back text that adds up to Tokenizer::decode of them all, for
// every family, with and without special tokens, on the corpus and on random ids (halves of characters among
// them); a character split over several byte tokens comes out whole, once its last byte arrives. StopStrings
// ([Stop strings]) ends at the token that completes a stop string, gives back the text before it, and holds
// back a tail that may begin one.
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

// The byte offset of the character boundary at or after `at` in UTF-8 `text`.
size_t character_boundary(const std::string& text, size_t at) {
  while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
  return at;
}

// [Stop strings]: a stop string taken from the middle of the decoded text ends the stream at the first id whose
// text completes its first occurrence, and what was given back is the text before that occurrence.
TEST_P(StreamingDecoderTest, AStopStringEndsAtTheIdThatCompletesItAndIsLeftOut) {
  int stopped = 0;
  for (const json& c : expected_->at("cases")) {
    const auto ids = c.at("ids").get<std::vector<int64_t>>();
    const auto pieces = stream(ids, true);
    const std::string full = joined(pieces);
    const size_t begin = character_boundary(full, full.size() / 2);
    const size_t end = character_boundary(full, begin + 2);
    if (full.size() < 8 || end > full.size() || full.find("\xEF\xBF\xBD") != std::string::npos) continue;
    const std::string stop = full.substr(begin, end - begin);
    // Where it must end: the first id after which the text so far holds the stop string.
    size_t last = 0;
    for (std::string so_far; last < ids.size(); ++last) {
      so_far += pieces[last];
      if (so_far.find(stop) != std::string::npos) break;
    }
    if (last == ids.size()) continue;  // held until finish() (a run of byte-fallback tokens at the end)
    StopStrings text(*tokenizer_, {"never \x01 seen", stop});
    std::string given;
    size_t n = 0;
    for (; n < ids.size() && !text.stopped(); ++n) given += text.push(ids[n]);
    EXPECT_TRUE(text.stopped()) << "stop " << json(stop).dump() << " in " << json(full).dump();
    EXPECT_EQ(n, last + 1) << "stop " << json(stop).dump() << " in " << json(full).dump();
    EXPECT_EQ(given + text.finish(), full.substr(0, full.find(stop))) << "stop " << json(stop).dump();
    EXPECT_EQ(text.push(ids[0]), "");  // nothing after the end
    ++stopped;
  }
  EXPECT_GE(stopped, 10);
}

// [Stop strings]: a tail of the text that begins a stop string is held back until finish() (the request ended
// otherwise); with no stop string seen, the pieces add up to decode, as StreamingDecoder's do.
TEST_P(StreamingDecoderTest, TextThatMayBeginAStopStringIsHeldBackUntilTheEnd) {
  for (const json& c : expected_->at("cases")) {
    const auto ids = c.at("ids").get<std::vector<int64_t>>();
    const std::string full = joined(stream(ids, true));
    if (full.size() < 4 || full.find("\xEF\xBF\xBD") != std::string::npos) continue;
    const size_t tail = character_boundary(full, full.size() - 3);
    const std::string stop = full.substr(tail) + "\x01 never";  // begins with the text's last characters
    StopStrings text(*tokenizer_, {stop});
    std::string given;
    for (const int64_t id : ids) given += text.push(id);
    EXPECT_FALSE(text.stopped());
    // The decoder may hold more (a run of byte-fallback tokens at the end), never less.
    EXPECT_LE(given.size(), tail) << json(full).dump();
    EXPECT_EQ(full.compare(0, given.size(), given), 0) << json(full).dump();
    EXPECT_EQ(given + text.finish(), full) << json(full).dump();
  }
  EXPECT_NE(testing::error_message([&] {
              StopStrings(*tokenizer_, {"ok", ""});
            }).find("stop string 1 is empty"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Families, StreamingDecoderTest, ::testing::ValuesIn(testing::kTokenizerFamilies),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace symbiosis
